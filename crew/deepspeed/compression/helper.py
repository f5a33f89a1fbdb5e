"""`deepspeed.compression.helper`: DeepSpeed 0.19.8 keeps this module for DeepSpeed-Chat's imports only,
re-exporting `deepspeed.utils.module_utils` with a FutureWarning on import; crew does the same."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from crew.deepspeed import alias
from crew.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]


def _importer_stacklevel() -> int:
    """The warnings stack level of the line that imported this module. Under --as_deepspeed crew's alias
    loader and importlib.import_module stand between that line and this module: skipped, so the warning
    names the script's import line, as DeepSpeed's does. warnings itself skips importlib's _bootstrap frames."""
    loaders = {str(Path(alias.__file__)), str(Path(warnings.__file__).parent / "importlib" / "__init__.py")}
    frame, level = sys._getframe(1), 1
    while (frame := frame.f_back) is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            continue
        level += 1
        if name not in loaders:
            return level
    return 2


warnings.warn(
    "deepspeed.compression.helper is deprecated; import recursive_getattr and "
    "recursive_setattr from deepspeed.utils.module_utils instead. "
    "See https://github.com/deepspeedai/DeepSpeed/issues/8489",
    FutureWarning,
    stacklevel=_importer_stacklevel(),
)
