"""`deepspeed.compression`: in DeepSpeed 0.19.8 the compression library is gone and only `helper` is left
(recursive_getattr/recursive_setattr, which DeepSpeed-Chat imports from it). The same here; any other name
is refused, naming model compression."""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"compression.{name}"), name=name, obj=None)
