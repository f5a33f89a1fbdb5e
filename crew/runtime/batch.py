"""The batch arithmetic: DeepSpeed's batch triple, and crew's micro batch per rank.

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size
    train_batch_size = sum(train_micro_batch_size_per_rank) x gradient_accumulation_steps

Any one of the triple may be omitted and is derived; values that cannot agree raise a BatchSizeError
that names every key involved and values that would agree. config.py reads the keys through this
module, balance.py moves samples between ranks within the sizes it resolved.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from typing import Any

from crew.errors import ConfigError

PER_RANK_KEY = "train_micro_batch_size_per_rank"


def allocate(total: int, seconds_per_sample: Sequence[float]) -> list[int]:
    """`total` samples as one micro batch per rank (each >= 1) minimising the slowest rank's
    predicted time size * seconds_per_sample: each sample goes to the rank that would finish it
    first (ties to the lower rank, so every rank computes the same split)."""
    sizes = [1] * len(seconds_per_sample)
    heap = [(2 * cost, rank) for rank, cost in enumerate(seconds_per_sample)]
    heapq.heapify(heap)
    for _ in range(total - len(sizes)):
        _, rank = heapq.heappop(heap)
        sizes[rank] += 1
        heapq.heappush(heap, ((sizes[rank] + 1) * seconds_per_sample[rank], rank))
    return sizes


class BatchSizeError(ConfigError):
    """The batch keys cannot be resolved. `suggestions`: key updates that would resolve (None = remove)."""

    def __init__(self, message: str, suggestions: list[dict[str, int | None]]):
        super().__init__(message)
        self.suggestions = suggestions


def resolve_batch_sizes(train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                        world_size: int, source: str = "<dict>",
                        auto: list[str] | None = None) -> tuple[int, int, int]:
    """DeepSpeed's batch rules -> (train_batch_size, micro batch per rank, grad accum steps).

    None means omitted. Raises BatchSizeError naming the values that would agree.
    """
    if train_batch_size is None and micro_batch is None:
        raise _neither_given(grad_accum, world_size, source, auto or [])
    if micro_batch is None:
        steps = 1 if grad_accum is None else grad_accum
        _require_multiple(train_batch_size, steps * world_size, "train_micro_batch_size_per_gpu",
                          f"gradient_accumulation_steps {steps}{'' if grad_accum else ' (default)'} x "
                          f"world size {world_size}",
                          source)
        return train_batch_size, train_batch_size // (steps * world_size), steps
    if train_batch_size is None:
        steps = 1 if grad_accum is None else grad_accum
        return micro_batch * steps * world_size, micro_batch, steps
    if grad_accum is None:
        _require_multiple(train_batch_size, micro_batch * world_size, "gradient_accumulation_steps",
                          f"train_micro_batch_size_per_gpu {micro_batch} x world size {world_size}", source)
        return train_batch_size, micro_batch, train_batch_size // (micro_batch * world_size)
    if train_batch_size != micro_batch * grad_accum * world_size:
        raise _mismatch(train_batch_size, micro_batch, grad_accum, world_size, source)
    return train_batch_size, micro_batch, grad_accum


def resolve_after_world_change(train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                                world_size: int, start_world_size: int, source: str = "<dict>",
                                auto: list[str] | None = None) -> tuple[tuple[int, int, int], str]:
    """The batch triple when an elastic job (`crew run --min_nodes`) continues on `world_size` ranks after it
    started on `start_world_size`, and the line that says what became of the global batch.

    A config whose train_batch_size resolves at the start's world keeps it and the micro batch it resolved
    to there; gradient accumulation makes up for the ranks lost (or gained), as DeepSpeed's elasticity did.
    Without train_batch_size (or one that only fits this world: a Hugging Face script fills it in for the
    world it sees), the keys resolve as usual and the global batch follows the world."""
    try:
        start = resolve_batch_sizes(train_batch_size, micro_batch, grad_accum, start_world_size, source, auto)
    except BatchSizeError:
        start = None
    world = f"{world_size} rank(s) (the job started on {start_world_size})"
    if train_batch_size is not None and start is not None:
        total, micro, _ = start
        if total % (micro * world_size):
            unit = math.lcm(micro * world_size, micro * start_world_size)
            raise BatchSizeError(
                f"{source}: train_batch_size {total} cannot be kept on {world}: it is not a multiple of "
                f"train_micro_batch_size_per_gpu {micro} x {world_size} ranks, so no whole number of "
                f"accumulation steps makes it up. Use a train_batch_size that micro batch x every world size "
                f"the job may continue on divides (e.g. {unit} for {start_world_size} and {world_size} ranks), "
                f"or a --min_nodes that leaves such worlds only.", [{"train_batch_size": unit}])
        here = resolve_batch_sizes(total, micro, None, world_size, source)
        return here, (f"{world}: train_batch_size {total} kept, gradient_accumulation_steps {start[2]} -> "
                      f"{here[2]} (micro batch {micro}).")
    here = resolve_batch_sizes(train_batch_size, micro_batch, grad_accum, world_size, source, auto)
    was = f" (was {start[0]})" if start and start[0] != here[0] else ""
    keep = (" Set train_batch_size in the config to keep the global batch: gradient accumulation then grows "
            "to make up for lost ranks." if was else "")
    return here, f"{world}: the global batch is {here[0]}{was}.{keep}"


def _neither_given(grad_accum: int | None, world_size: int, source: str, auto: list[str]) -> BatchSizeError:
    steps = grad_accum or 1
    alone = f" (gradient_accumulation_steps {grad_accum} alone is not enough)" if grad_accum else ""
    auto_note = f" \"auto\" counts as not given ({', '.join(auto)})." if auto else ""
    return BatchSizeError(
        f"{source}: neither train_batch_size nor train_micro_batch_size_per_gpu is given{alone}.{auto_note} "
        f"Set one, e.g. \"train_micro_batch_size_per_gpu\": 1, which gives train_batch_size "
        f"{steps * world_size} at world size {world_size}.",
        [{"train_micro_batch_size_per_gpu": 1}])


def _require_multiple(total: int, unit: int, derived: str, unit_text: str, source: str) -> None:
    if total % unit == 0:
        return
    lower, upper = total // unit * unit, (total // unit + 1) * unit
    options = [n for n in (lower, upper) if n > 0]
    values = " or ".join(str(n) for n in options)
    per = " or ".join(str(n // unit) for n in options)
    raise BatchSizeError(
        f"{source}: train_batch_size {total} is not a positive multiple of {unit_text} = {unit}, so "
        f"{derived} cannot be derived ({total} / {unit} is not a whole number >= 1). "
        f"Set train_batch_size to {values} ({derived} {per}).",
        [{"train_batch_size": n} for n in options])


def _mismatch(total: int, micro: int, steps: int, world_size: int, source: str) -> BatchSizeError:
    """Names each key of the triple, and each single change that makes them agree."""
    product = micro * steps * world_size
    suggestions: list[dict[str, int | None]] = [{"train_batch_size": product}, {"train_batch_size": None}]
    keep = []
    if total % (micro * world_size) == 0:
        keep.append(f"gradient_accumulation_steps to {total // (micro * world_size)}")
        suggestions.append({"gradient_accumulation_steps": total // (micro * world_size)})
    if total % (steps * world_size) == 0:
        keep.append(f"train_micro_batch_size_per_gpu to {total // (steps * world_size)}")
        suggestions.append({"train_micro_batch_size_per_gpu": total // (steps * world_size)})
    keep_text = f" Or keep {total} and set {' or '.join(keep)}." if keep else ""
    return BatchSizeError(
        f"{source}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
        f"gradient_accumulation_steps {steps} x world size {world_size} = {product}. Set train_batch_size "
        f"to {product} or remove it and crew will derive it.{keep_text}",
        suggestions)


# -- crew's train_micro_batch_size_per_rank ----------------------------------------------------

def resolve_per_rank(value: Any, train_batch_size: int | None, micro: int | None, steps: int | None,
                     world_size: int, source: str) -> tuple[int, int, tuple[int, ...]]:
    """PER_RANK_KEY's list or "auto" with the batch keys -> (train_batch_size, gradient_accumulation_steps,
    micro batch per rank); for "auto" the sizes are the split it starts from."""
    if value == "auto":
        if micro is not None:
            total, micro, steps = resolve_batch_sizes(train_batch_size, micro, steps, world_size, source)
            return total, steps, (micro,) * world_size
        return _auto_start(train_batch_size, steps, world_size, source)
    sizes = _check_list(value, world_size, source)
    if micro is not None:
        raise ConfigError(
            f"{source}: train_micro_batch_size_per_gpu {micro} and {PER_RANK_KEY} {sizes} are both given; with "
            f"{PER_RANK_KEY} each rank's micro batch is its entry. Remove train_micro_batch_size_per_gpu.")
    per_micro_step = sum(sizes)
    if steps is None and train_batch_size is not None and train_batch_size % per_micro_step == 0:
        steps = train_batch_size // per_micro_step
    steps = 1 if steps is None else steps
    if train_batch_size is not None and train_batch_size != per_micro_step * steps:
        raise _sum_mismatch(sizes, steps, train_batch_size, source)
    return per_micro_step * steps, steps, tuple(sizes)


def _auto_start(train_batch_size: int | None, steps: int | None, world_size: int,
                source: str) -> tuple[int, int, tuple[int, ...]]:
    if train_batch_size is None:
        raise ConfigError(
            f"{source}: {PER_RANK_KEY} \"auto\" needs the global batch, which it keeps fixed while it moves "
            f"samples between ranks: set train_batch_size (e.g. {8 * world_size}) or "
            "train_micro_batch_size_per_gpu (the even split it starts from).")
    steps = 1 if steps is None else steps
    if train_batch_size % steps or train_batch_size // steps < world_size:
        good = max(train_batch_size // steps, world_size) * steps
        raise ConfigError(
            f"{source}: with {PER_RANK_KEY} \"auto\", train_batch_size {train_batch_size} / "
            f"gradient_accumulation_steps {steps} must be a whole number of samples per micro step, "
            f"at least one per rank ({world_size}). Set train_batch_size to {good}.")
    return train_batch_size, steps, tuple(allocate(train_batch_size // steps, [1.0] * world_size))


def _check_list(value: Any, world_size: int, source: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{source}: {PER_RANK_KEY} {json.dumps(value, default=repr)} must be a list with one micro batch "
            f"size per global rank, e.g. {[4] * world_size}, or \"auto\".")
    bad = [i for i, size in enumerate(value) if isinstance(size, bool) or not isinstance(size, int) or size < 1]
    if bad:
        fixed = [size if i not in bad else _whole(size) for i, size in enumerate(value)]
        raise ConfigError(
            f"{source}: {PER_RANK_KEY}[{bad[0]}] is {json.dumps(value[bad[0]], default=repr)}: every rank's micro "
            f"batch must be a whole number >= 1, e.g. {fixed}.")
    if len(value) != world_size:
        example = allocate(max(sum(value), world_size), [1.0] * world_size)
        raise ConfigError(
            f"{source}: {PER_RANK_KEY} has {len(value)} entries but the job has {world_size} ranks: give one "
            f"micro batch per global rank, in rank order, e.g. {example} (or \"auto\").")
    return list(value)


def _whole(size: Any) -> int:
    """A valid micro batch close to a bad entry (12.0 -> 12, 0 or "x" -> 1)."""
    number = isinstance(size, (int, float)) and not isinstance(size, bool) and size == size
    return max(1, round(size)) if number and abs(size) != float("inf") else 1


def _sum_mismatch(sizes: list[int], steps: int, train_batch_size: int, source: str) -> ConfigError:
    per_micro_step = sum(sizes)
    fix = f"Set train_batch_size to {per_micro_step * steps} (or remove it)"
    if train_batch_size % steps == 0 and train_batch_size // steps >= len(sizes):
        scaled = allocate(train_batch_size // steps, [1 / size for size in sizes])
        fix += f", or keep it and give sizes that sum to {train_batch_size // steps}, e.g. {scaled}"
    return ConfigError(
        f"{source}: {PER_RANK_KEY} {sizes} takes {per_micro_step} samples per micro step, x "
        f"gradient_accumulation_steps {steps} = {per_micro_step * steps} per optimizer step, but "
        f"train_batch_size is {train_batch_size}. {fix}.")
