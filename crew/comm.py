"""The documented import path of crew.comm (DeepSpeed's deepspeed.comm).

The module is crew/runtime/comm.py; this name is bound to that same module object, so an attribute
read or set through either path is the same one.
"""

import sys

from crew.runtime import comm

sys.modules[__name__] = comm
