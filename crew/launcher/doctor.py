"""`crew doctor` and `crew run`'s preflight (being written)."""

from __future__ import annotations


def preflight(launch, args, say) -> int:
    return 0


def run_doctor(launch, args) -> int:
    raise NotImplementedError
