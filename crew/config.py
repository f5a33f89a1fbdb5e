"""The documented import path of crew.config.Config.

The module is crew/runtime/config.py; this name is bound to that same module object, so an attribute
read or set through either path is the same one.
"""

import sys

from crew.runtime import config

sys.modules[__name__] = config
