"""The training loader `crew.initialize(training_data=...)` returns: DeepSpeed's, plus epochs and resume.

DeepSpeed's `deepspeed_io()` wraps the dataset in a `DeepSpeedDataLoader`: a torch
`DistributedSampler(dataset, num_replicas=dp world size, rank=dp rank)` with its defaults (shuffle,
seed 0, pad to a multiple of the world size), `batch_size=train_micro_batch_size_per_gpu`, the
user's `collate_fn`, `drop_last=dataloader_drop_last`. crew builds the same thing, so epoch 0 yields
the same micro batches on every rank. What crew adds:

- an epoch count: every new `iter(loader)` is the next epoch. Its order is DeepSpeed's: the sampler's
  epoch stays what the script last set with `loader.data_sampler.set_epoch(e)` (0 if never), so
  without that call every epoch repeats epoch 0's order, as DeepSpeedDataLoader does. With
  `reshuffle=True` (the config's `dataloader_reshuffle_each_epoch`, crew's key) each epoch is
  shuffled by its own number instead;
- `state_dict()` / `load_state_dict()` / `skip_to_step()` resume mid-epoch by slicing the rank's
  index list, so skipped samples are never read (no `__getitem__`, no collate, no worker traffic).

The arithmetic is in pure functions of `(num_samples, world_size, micro_batch_size, drop_last)`.

With one micro batch size per rank (crew/runtime/balance.py) the split is crew's own, `_ShareSampler`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler, IterableDataset

from crew.errors import ConfigError, CrewError

__all__ = [
    "DataLoader",
    "RepeatingLoader",
    "batches_per_epoch",
    "samples_per_rank",
    "split_micro_steps",
]

logger = logging.getLogger(__name__)


def samples_per_rank(num_samples: int, world_size: int) -> int:
    """Indices one rank gets per epoch: DistributedSampler pads the epoch up to a multiple of the
    world size by repeating its first indices, so every rank gets ceil(n / world_size)."""
    return math.ceil(num_samples / world_size)


def batches_per_epoch(num_samples: int, world_size: int, micro_batch_size: int, drop_last: bool) -> int:
    """Micro batches one rank yields per epoch (DeepSpeedDataLoader's `len`)."""
    per_rank = samples_per_rank(num_samples, world_size)
    if drop_last:
        return per_rank // micro_batch_size
    return math.ceil(per_rank / micro_batch_size)


def split_micro_steps(micro_steps: int, batches: int) -> tuple[int, int]:
    """`micro_steps` micro batches counted from the start of epoch 0 -> (epoch, batches into it)."""
    if micro_steps < 0:
        raise CrewError(f"skip_to_step: micro_steps must be >= 0, got {micro_steps}.")
    if batches == 0:
        raise CrewError("skip_to_step: this rank's loader yields no micro batch per epoch (dataset too small "
                        "for the micro batch with dataloader_drop_last); there is no step to skip to.")
    return divmod(micro_steps, batches)


class _EpochSampler(DistributedSampler):
    """DeepSpeed's sampler, remembering whether the user called set_epoch since the loader last did."""

    set_by_user = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.set_by_user = True


class _ShareSampler(torch.utils.data.Sampler):
    """Unequal shares: every global micro step takes the next sum(sizes) indices of the epoch's order
    and rank r the sizes[r] of them after ranks 0..r-1's. The order is DistributedSampler's (shuffled
    by seed + epoch), padded by repeating its start to whole micro steps, or cut to them with
    drop_last, so every rank yields the same number of micro batches. A new split between micro
    steps moves no sample across micro steps: each one covers the same indices whatever the split."""

    set_by_user = False

    def __init__(self, dataset, sizes: Sequence[int], rank: int, drop_last: bool, shuffle: bool = True,
                 seed: int = 0) -> None:
        self.dataset, self.sizes, self.rank = dataset, list(sizes), rank
        self.num_replicas = len(self.sizes)
        self.drop_last, self.shuffle, self.seed, self.epoch = drop_last, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.set_by_user = epoch, True

    def micro_steps(self) -> int:
        whole, rest = divmod(len(self.dataset), sum(self.sizes))
        return whole + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[int]:
        order, per_step = self._order(), sum(self.sizes)
        offset, size = sum(self.sizes[:self.rank]), self.sizes[self.rank]
        for step in range(self.micro_steps()):
            yield from order[step * per_step + offset:step * per_step + offset + size]

    def __len__(self) -> int:
        return self.micro_steps() * self.sizes[self.rank]

    def _order(self) -> list[int]:
        count = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(count, generator=generator).tolist()
        else:
            order = list(range(count))
        padding = self.micro_steps() * sum(self.sizes) - count
        return order + (order * math.ceil(padding / count))[:padding] if padding > 0 else order


def _check_dataset(dataset: Any) -> None:
    if isinstance(dataset, IterableDataset):
        raise CrewError(
            f"training_data is an IterableDataset ({type(dataset).__name__}); DeepSpeed's loader needs a "
            "map-style dataset (with __getitem__ and __len__) to shard it across ranks with "
            "DistributedSampler. Build your own torch.utils.data.DataLoader over it and iterate that "
            "instead of passing training_data to initialize().")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise CrewError(
            f"training_data ({type(dataset).__name__}) is not a map-style dataset: it needs __getitem__ "
            "and __len__, like a torch.utils.data.Dataset. Wrap it in one, or pass your own DataLoader.")


def _check_int(name: str, value: Any, low: int, error: type[CrewError] = CrewError) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise error(f"{name} must be an integer >= {low}, got {value!r}.")
    return value


def _check_sizes(sizes: Sequence[int], world_size: int) -> None:
    if len(sizes) != world_size:
        raise ConfigError(f"train_micro_batch_size_per_rank {list(sizes)} has {len(sizes)} entries for "
                          f"{world_size} ranks; give one per rank.")
    for size in sizes:
        _check_int("each train_micro_batch_size_per_rank entry", size, 1, ConfigError)


class DataLoader:
    """One rank's micro batches; `iter()` starts the next epoch (or resumes the saved one).

    Like DeepSpeedDataLoader it is its own iterator (`iter(loader)` returns the loader) and keeps
    DeepSpeed's attribute names (`data_sampler`, `batch_size`, `dataloader_drop_last`,
    `num_local_io_workers`, ...), which are read again at each `iter()`.

    `micro_batch_size`: one int for every rank (DeepSpeed's split), or one per rank (crew's
    train_micro_batch_size_per_rank), which `set_micro_batch_sizes` may change between steps.
    """

    def __init__(self, dataset, micro_batch_size: int | Sequence[int], world_size: int, rank: int,
                 collate_fn: Callable | None = None, drop_last: bool = False, num_workers: int = 0,
                 pin_memory: bool = False, seed: int = 0, reshuffle: bool = False) -> None:
        _check_dataset(dataset)
        _check_int("data parallel world size", world_size, 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise CrewError(f"data parallel rank must be in [0, {world_size - 1}] for world size "
                            f"{world_size}, got {rank!r}.")
        _check_int("num_workers", num_workers, 0)
        if isinstance(micro_batch_size, Sequence):
            _check_sizes(micro_batch_size, world_size)
            self.data_sampler = _ShareSampler(dataset, micro_batch_size, rank, drop_last, seed=seed)
            micro_batch_size = micro_batch_size[rank]
        else:
            _check_int("train_micro_batch_size_per_gpu", micro_batch_size, 1, ConfigError)
            self.data_sampler = _EpochSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
        self.dataset = dataset
        self.batch_size = micro_batch_size
        self.collate_fn = collate_fn
        self.dataloader_drop_last = drop_last
        self.num_local_io_workers = num_workers
        self.pin_memory = pin_memory
        self.epoch = 0
        self.reshuffle = reshuffle
        self._order_epoch = 0  # the sampler epoch that orders the samples (DeepSpeed's: the script's)
        self._consumed = 0                                  # micro batches yielded in `epoch`
        self._pending: tuple[int, int] | None = (0, 0)      # where the next iter() starts
        self._batches: Iterator | None = None
        self._base_seed: int | None = None  # what this epoch's iterator drew from the global RNG
        self._replay_seed = False  # the next iter() replays a loaded epoch: reuse its seed, draw none

    def __len__(self) -> int:
        if isinstance(self.data_sampler, _ShareSampler):
            return self.data_sampler.micro_steps()
        return batches_per_epoch(len(self.dataset), self.data_sampler.num_replicas, self.batch_size,
                                 self.dataloader_drop_last)

    def set_micro_batch_sizes(self, sizes: Sequence[int]) -> None:
        """A new split from the next micro batch on (at an optimizer step boundary, on every rank).
        Batches already prefetched with the old split are dropped; the epoch goes on from the same
        global micro step."""
        if not isinstance(self.data_sampler, _ShareSampler):
            raise CrewError("set_micro_batch_sizes needs a loader built with one micro batch size per rank "
                            "(train_micro_batch_size_per_rank in the config).")
        _check_sizes(sizes, self.data_sampler.num_replicas)
        self.data_sampler.sizes = list(sizes)
        self.batch_size = sizes[self.data_sampler.rank]
        if self._batches is not None:
            self._resume_at(self.epoch, self._consumed)

    def __iter__(self) -> DataLoader:
        epoch, skip = self._next_start()
        if self.reshuffle:
            self._order_epoch = epoch
        self.data_sampler.set_epoch(self._order_epoch)
        self.data_sampler.set_by_user = False
        # Slicing the index list is what makes resuming cheap: skipped samples are never fetched.
        indices = list(self.data_sampler)[skip * self.batch_size:]
        # torch's iterator draws one number from the global RNG per epoch (DeepSpeed's loader too).
        # Draw it here, once per epoch, and keep it: a mid-epoch resume reuses it instead of drawing
        # again, so the global RNG stream (dropout, ...) stays identical to an uninterrupted run.
        if (skip == 0 and not self._replay_seed) or self._base_seed is None:
            self._base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self._replay_seed = False
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=self.batch_size, sampler=indices, collate_fn=self.collate_fn,
            drop_last=self.dataloader_drop_last, num_workers=self.num_local_io_workers,
            pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self._base_seed))
        self.epoch, self._consumed, self._batches = epoch, skip, iter(loader)
        return self

    def __next__(self):
        if self._batches is None:
            iter(self)
        batch = next(self._batches)
        self._consumed += 1
        return batch

    def _next_start(self) -> tuple[int, int]:
        pending, self._pending = self._pending, None
        if self.data_sampler.set_by_user:
            # A DeepSpeed habit: `loader.data_sampler.set_epoch(e)` before each epoch. Honour it, and
            # keep a loaded resume point only if it is for that same epoch.
            epoch = self._order_epoch = self.data_sampler.epoch
            return (epoch, pending[1]) if pending and pending[0] == epoch else (epoch, 0)
        if pending is not None:
            return pending
        return self.epoch + 1, 0

    def state_dict(self) -> dict:
        """Where this rank is: the epoch in progress and the micro batches already yielded from it
        (before the first `iter()`, or after a load, the point the next `iter()` starts from)."""
        return {"epoch": self.epoch, "batches_consumed": self._consumed, "base_seed": self._base_seed,
                "order_epoch": self._order_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` continue epoch `state["epoch"]` after `batches_consumed` batches.

        A state saved after the last batch of an epoch resumes at the start of the next one, as the
        uninterrupted loader would.
        """
        missing = {"epoch", "batches_consumed"} - set(state)
        if missing:
            raise CrewError(f"data loader state {state!r} lacks {sorted(missing)}; expected the dict "
                            "DataLoader.state_dict() returns: {'epoch': e, 'batches_consumed': k}.")
        epoch = _check_int("data loader state 'epoch'", state["epoch"], 0)
        consumed = _check_int("data loader state 'batches_consumed'", state["batches_consumed"], 0)
        batches = len(self)
        if consumed > batches:
            raise CrewError(
                f"data loader state says {consumed} micro batches consumed in epoch {epoch}, but this "
                f"rank has {batches} per epoch ({len(self.dataset)} samples, world size "
                f"{self.data_sampler.num_replicas}, micro batch {self.batch_size}, drop_last "
                f"{self.dataloader_drop_last}). Resume with the dataset and batch settings it was "
                "saved with.")
        order_epoch = state.get("order_epoch", epoch)  # saved before crew kept it: epochs reshuffled
        if consumed == batches:
            epoch, consumed = epoch + 1, 0
        self._resume_at(epoch, consumed)
        self._base_seed = state.get("base_seed")
        self._order_epoch = epoch if self.reshuffle else order_epoch

    def restart_epoch(self, state: dict) -> None:
        """DeepSpeed's resume: the next `iter()` replays the epoch `state` was saved in from its first
        batch, for the script to skip what it consumed itself, and draws nothing new from the global
        RNG (the uninterrupted loader drew that epoch's number before its first batch). A state saved
        at the end of an epoch starts the next one."""
        finished = state.get("batches_consumed", 0) >= len(self)
        self.load_state_dict(state if finished else {**state, "batches_consumed": 0})
        self._replay_seed = not finished

    def skip_to_step(self, micro_steps: int) -> None:
        """Make the next `iter()` start after `micro_steps` micro batches counted from epoch 0."""
        self._resume_at(*split_micro_steps(micro_steps, len(self)))
        self._base_seed = None  # not known: the resumed epoch draws a fresh one

    def _resume_at(self, epoch: int, consumed: int) -> None:
        logger.debug("data loader resumes at epoch %s after %s micro batches", epoch, consumed)
        self._pending = (epoch, consumed)
        self.epoch, self._consumed, self._batches = epoch, consumed, None
        self.data_sampler.set_by_user = False


class RepeatingLoader:
    """DeepSpeed's `deepspeed.utils.RepeatingLoader`: restart the loader when it runs out.

    With crew's DataLoader each restart is the next epoch (in DeepSpeed's order: see DataLoader).
    """

    def __init__(self, loader) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
