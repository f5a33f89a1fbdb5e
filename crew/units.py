"""Sizes people type: parameter counts ('7B', '350M') and bytes ('80GB', '24576MB').

Shared by `crew estimate` and the doctor's --min_free_disk; no torch.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from crew.errors import CrewError

GIB = 2**30
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {"": GIB, "b": 1, "k": 2**10, "m": 2**20, "g": GIB, "t": 2**40}


def parse_count(text: str) -> int:
    """'7B', '1.3e9', '350M', '125k', '1_000' -> a whole number of parameters (suffixes k/M/B/T)."""
    match = re.fullmatch(r"\s*([0-9_.]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]?)\s*", str(text))
    suffix = match.group(2).lower() if match else ""
    try:
        if not match or suffix not in _COUNT_SUFFIXES:
            raise InvalidOperation
        value = Decimal(match.group(1)) * _COUNT_SUFFIXES[suffix]
    except InvalidOperation:
        raise CrewError(f"parameter count {text!r}: expected a number with an optional k, M, B or T, "
                        "e.g. 7B, 1.3e9, 350M, 125k or 1000.") from None
    if value != value.to_integral_value() or value < 1:
        raise CrewError(f"parameter count {text!r} = {value}: expected a whole number of at least 1.")
    return int(value)


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '80G', '81920MB', '80' -> bytes. Binary units throughout: a GPU sold as
    '80GB' has about 80 GiB, and the table prints GiB. A bare number means GiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kKmMgGtT])(?:i?[bB])?|([bB]))?\s*", str(text))
    if not match:
        raise CrewError(f"device memory {text!r}: expected a size such as 80GB, 80GiB, 40G or "
                        "24576MB (binary units; a bare number means GiB).")
    unit = (match.group(2) or match.group(3) or "").lower()
    size = int(Decimal(match.group(1)) * _BYTE_UNITS[unit])
    if size < 1:
        raise CrewError(f"device memory {text!r}: must be more than 0.")
    return size
