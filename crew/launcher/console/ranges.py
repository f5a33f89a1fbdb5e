"""Numbers as ranges in crew's messages: [0, 1, 2, 5] -> `0-2, 5`, and `rank 3` / `ranks 0-3, 6`. (leaf)"""

from __future__ import annotations

from collections.abc import Iterable


def spans(numbers: Iterable[int], sep: str = ", ") -> str:
    """[1, 2, 3, 5, 7, 8] -> '1-3, 5, 7-8' (sorted, duplicates dropped; '' when empty)."""
    return sep.join(_parts(sorted(set(numbers))))


def rank_list(ranks: Iterable[int], limit: int = 60) -> str:
    """`rank 3` or `ranks 0-3, 6`; spans past `limit` characters end in `… (N ranks)`."""
    ranks = sorted(set(ranks))
    parts = _parts(ranks)
    text = ", ".join(parts)
    if len(text) > limit:
        kept: list[str] = []
        for part in parts:
            if len(", ".join([*kept, part])) > limit:
                break
            kept.append(part)
        text = ", ".join(kept) + f", … ({len(ranks)} ranks)"
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _parts(numbers: list[int]) -> list[str]:
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
