"""Collective error handling: a problem on any rank raises the same CheckpointError on every rank,
so that no rank waits in a collective for one that gave up."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from crew.errors import CrewError
from crew.runtime import comm
from crew.runtime.checkpoint.layout import CheckpointError


def where() -> str:
    return f"rank {comm.get_rank()} on {os.environ.get('CREW_HOST') or socket.gethostname()}"


def all_gather(value: Any) -> list:
    """`value` from every rank, in rank order (a collective; [value] without a process group)."""
    if comm.get_world_size() == 1 or not torch.distributed.is_initialized():
        return [value]
    values = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def agree(problem: str | None, what: str) -> None:
    """Every rank raises the same error if any rank had a problem: nobody waits on a dead rank."""
    found = [p for p in all_gather(problem) if p]
    if found:
        shown = "\n  ".join(found[:8]) + (f"\n  ... and {len(found) - 8} more" if len(found) > 8 else "")
        raise CheckpointError(f"{what} failed on {len(found)} rank(s):\n  {shown}")


def attempt(action, *args) -> str | None:
    """None, or what went wrong on this rank: every rank must reach the next agree."""
    try:
        action(*args)
    except (OSError, RuntimeError, ValueError, CrewError) as exc:
        return f"{where()}: {exc}"
    except Exception as exc:  # e.g. a KeyError from torch's state dict code: still no hang
        return f"{where()}: {type(exc).__name__}: {exc}"
    return None


def same_everywhere(value: str, name: str) -> str | None:
    values = all_gather(value)
    if len(set(values)) > 1:
        return f"{where()}: the ranks passed different {name}s: {values}; pass the same on every rank"
    return None
