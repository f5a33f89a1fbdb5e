"""The engines alive in this process, for code that must reach each of them without owning one:
`zero.GatheredParameters` writes a modified parameter back into every model and fp32 master copy that
holds it, and the engine's exit handler releases their DDP wrappers before the process group goes."""

from __future__ import annotations

import weakref

_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def register(engine) -> None:
    _LIVE_ENGINES.add(engine)


def unregister(engine) -> None:
    _LIVE_ENGINES.discard(engine)


def live_engines() -> list:
    return list(_LIVE_ENGINES)
