"""The documented import path of crew.zero.Init and crew.zero.GatheredParameters.

The module is crew/runtime/zero.py; this name is bound to that same module object, so an attribute
read or set through either path is the same one.
"""

import sys

from crew.runtime import zero

sys.modules[__name__] = zero
