"""Unequal devices: each rank's micro batch, set by hand or balanced by measured speed.

    "train_micro_batch_size_per_rank": [12, 4]      rank 0 takes 12 samples per micro step, rank 1 four
    "train_micro_batch_size_per_rank": "auto"       start even, then move samples to the faster ranks

The sizes are resolved from the config by batch.py. Every global micro step takes sum(sizes) samples
and rank r the next sizes[r] of them (data.py), so train_batch_size stays the global batch. Rank r's
loss is weighted by world_size * sizes[r] / sum(sizes) before the gradients are averaged, which makes
the update the mean over every sample of the global batch: what one process taking the whole batch
computes.

"auto" times each rank's forward and backward up to the moment its gradients are ready, before it
waits for the others (the last DDP bucket's hook, at ZeRO stage 2 the last bucket's launch, or the
end of a no_sync backward). Every WINDOW
optimizer steps the ranks pool their median seconds per sample and move to the split that minimises
the slowest rank's predicted time, when that is more than TOLERANCE faster than the current one in
two windows running (one noisy window moves nothing; the first decision needs one). The window after
a move checks it: when the slowest rank's step did not get at least half the predicted gain (noise,
or fixed costs per step that the per-sample model does not see) the window doubles, so moves that do
not pay grow rare.
Timing needs gradient hooks (DDP's, or stage 2's own), so "auto" runs at ZeRO stages 0-2; stage 3
(FSDP2) takes sizes by hand.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from crew.errors import ConfigError
from crew.log import log_rank0
from crew.runtime.batch import PER_RANK_KEY, allocate

WARMUP = 1        # optimizer steps not timed after the start and after each change of split
WINDOW = 4        # optimizer steps timed per decision
MAX_WINDOW = 64   # the window doubles after each move that did not pay, up to this
TOLERANCE = 0.05  # move only when the predicted step time drops by more than this


def _slowest(sizes: Sequence[int], seconds_per_sample: Sequence[float]) -> float:
    return max(size * cost for size, cost in zip(sizes, seconds_per_sample, strict=True))


class _Clock:
    """Wall time on CPU; CUDA events on a GPU, whose work the host only queues."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class Balancer:
    """This rank's share of each global micro step, its gradient weight and, for "auto", the
    timing and the re-balancing. `loader` (crew's DataLoader) follows every change of split."""

    def __init__(self, sizes: Sequence[int], auto: bool, rank: int, device: torch.device) -> None:
        self.sizes = list(sizes)
        self.auto = auto and len(self.sizes) > 1
        self.rank = rank
        self.device = device
        self.loader = None
        self._clock = _Clock(device)
        self._timed: list[tuple[Any, Any, int]] = []  # (start, gradients ready, samples) per micro step
        self._started = self._ready = None
        self._steps = 0  # optimizer steps since the start or the last change of split
        self._decided = False
        self._better_before = False  # the previous window also found a better split (noise guard)
        self._window = WINDOW
        self._promised: tuple[float, float] | None = None  # last move: slowest step before, predicted

    @property
    def micro_batch(self) -> int:
        return self.sizes[self.rank]

    def grad_weight(self) -> float:
        return len(self.sizes) * self.micro_batch / sum(self.sizes)

    def describe(self) -> str:
        return f"{self.sizes} per rank{' (auto-balanced)' if self.auto else ''}"

    # -- timing: forward start -> gradients ready ------------------------------------------------

    def watch(self, hooks) -> None:
        """Mark the moment each gradient bucket is ready: `hooks` is DDP (stages 0-1; the bucket is
        then all-reduced as DDP would) or stage 2's GradientPartition."""
        if not self.auto or hooks is None:
            return
        if not isinstance(hooks, torch.nn.parallel.DistributedDataParallel):
            hooks.on_ready = self._mark_ready
            return
        ddp = hooks
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            self._ready = self._clock.mark()
            return allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, hook)

    def _mark_ready(self) -> None:
        self._ready = self._clock.mark()

    def forward_started(self) -> None:
        """The first training forward since the last backward (an eval forward under no_grad is not timed)."""
        if self.auto and self._started is None and torch.is_grad_enabled():
            self._started, self._ready = self._clock.mark(), None

    def backward_done(self) -> None:
        if self.auto and self._started is not None:
            ready = self._ready if self._ready is not None else self._clock.mark()
            self._timed.append((self._started, ready, self.micro_batch))
            self._started = None

    # -- deciding, at an optimizer step boundary (every rank, in step) ------------------------------

    def after_step(self, global_step: int) -> None:
        """On every rank at each optimizer step boundary; every WINDOW timed steps, decide."""
        if not self.auto:
            return
        self._steps += 1
        if self._steps <= WARMUP:
            self._timed.clear()
        elif self._steps == WARMUP + self._window:
            costs = self._pooled_seconds_per_sample()
            self._timed.clear()
            self._steps = WARMUP
            if all(cost == cost for cost in costs):  # NaN: a rank took no step through engine(...)
                self._decide(global_step, costs)

    def _decide(self, global_step: int, costs: list[float]) -> None:
        proposal = allocate(sum(self.sizes), costs)
        now, then = _slowest(proposal, costs), _slowest(self.sizes, costs)
        self._judge_last_move(global_step, then)
        shown = [round(cost * 1e3, 3) for cost in costs]
        better = now < then * (1 - TOLERANCE)
        confirmed, self._better_before = better and (self._better_before or not self._decided), better
        if confirmed:
            log_rank0("auto balance at step %d: micro batch per rank %s (was %s); measured ms per sample "
                      "%s; predicted step %.0f%% shorter", global_step, proposal, self.sizes, shown,
                      100 * (1 - now / then))
            self._promised = (then, now)
            self._use(proposal)
        elif not self._decided:
            log_rank0("auto balance at step %d: keeping micro batch per rank %s; measured ms per "
                      "sample %s", global_step, self.sizes, shown)
        self._decided = True

    def _judge_last_move(self, global_step: int, slowest: float) -> None:
        """A move pays when it brought at least half the gain it predicted."""
        if self._promised is None:
            return
        before, predicted = self._promised
        self._promised = None
        if slowest <= before - (before - predicted) / 2:
            self._window = WINDOW
        elif self._window < MAX_WINDOW:
            self._window *= 2
            log_rank0("auto balance at step %d: the last move did not pay (slowest rank %.3g -> %.3g ms, "
                      "predicted %.3g); checking every %d steps", global_step, before * 1e3, slowest * 1e3,
                      predicted * 1e3, self._window)

    def _pooled_seconds_per_sample(self) -> list[float]:
        """Every rank's median seconds per sample over the window (a collective)."""
        mine = statistics.median(self._clock.seconds(start, ready) / samples
                                 for start, ready, samples in self._timed) if self._timed else float("nan")
        slots = torch.zeros(len(self.sizes), dtype=torch.float64, device=self.device)
        slots[self.rank] = mine
        torch.distributed.all_reduce(slots)
        return [max(cost, 1e-9) for cost in slots.tolist()]

    def _use(self, sizes: list[int]) -> None:
        self.sizes = list(sizes)
        self._steps, self._timed, self._started = 0, [], None
        self._decided, self._better_before = True, False
        if self.loader is not None:
            self.loader.set_micro_batch_sizes(self.sizes)

    # -- checkpoints ---------------------------------------------------------------------------

    def restore(self, saved: list[int] | None) -> None:
        """The split a checkpoint was saved with: "auto" continues with it; sizes set by hand win."""
        if saved is None or list(saved) == self.sizes:
            return
        if not self.auto:
            log_rank0("the checkpoint was trained with micro batch per rank %s; this run's %s %s is "
                      "used", list(saved), PER_RANK_KEY, self.sizes)
        elif len(saved) != len(self.sizes) or sum(saved) != sum(self.sizes):
            log_rank0("auto balance: the checkpoint's micro batch per rank %s does not fit this run "
                      "(%d ranks, %d samples per micro step); starting from %s", list(saved),
                      len(self.sizes), sum(self.sizes), self.sizes)
        else:
            log_rank0("auto balance: continuing with the checkpoint's micro batch per rank %s", list(saved))
            self._use(list(saved))


def make(config, rank: int, device: torch.device, zero_stage: int) -> Balancer | None:
    """The engine's Balancer, or None when the config splits batches evenly (DeepSpeed's way)."""
    if config.train_micro_batch_size_per_rank is None:
        return None
    if config.auto_balance and zero_stage == 3 and config.world_size > 1:
        raise ConfigError(
            f"{config.source}: {PER_RANK_KEY} \"auto\" needs ZeRO stage 0, 1 or 2 (it times each rank "
            f"through the gradient hooks; stage 3 shards with FSDP2). Set the sizes by hand, e.g. "
            f"{list(config.train_micro_batch_size_per_rank)}, or use zero_optimization.stage 2.")
    return Balancer(config.train_micro_batch_size_per_rank, config.auto_balance, rank, device)
