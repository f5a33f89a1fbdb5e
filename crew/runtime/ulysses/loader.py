"""UlyssesSPDataLoaderAdapter: DeepSpeed 0.19.8's DataLoader wrapper that shards batches on the sequence.

Each SP rank draws its own batch from the loader it wraps; the SP group gathers them, and then works through
them one at a time, each rank taking its slice of the sequence: the first micro step is SP rank 0's batch, the
next SP rank 1's, and so on. Labels are shifted before slicing (`shift_labels`, padded with -100) and `labels` is
dropped, so the model computes no loss of its own on a slice; the caller computes it from `shift_labels`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from crew.errors import CrewError


class UlyssesBatchError(CrewError, ValueError):
    """A batch the adapter cannot shard (a ValueError too, as DeepSpeed raises)."""


_NO_POSITION_IDS = (
    "UlyssesSPDataLoaderAdapter: the batch has no 'position_ids' (keys: {keys}). Ulysses SP shards the sequence, so "
    "each token's global position has to travel with it. Have the collator add position_ids: "
    "torch.arange(seq_len) per sample for unpacked sequences, positions restarting at each document for packed ones.")


class UlyssesSPDataLoaderAdapter:
    """Wraps `dl`; yields, on each SP rank, its sequence slice of each of the SP group's batches in turn.
    Batches are dicts of [batch, seq, ...] tensors (input_ids, position_ids and labels at least) and other values,
    which are passed to every rank as they are. len() is len(dl) * sp_world_size."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size, device):
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[Any] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw one batch, gather the group's, queue this rank's slice of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh; this one ends
            raise
        if "position_ids" not in batch:
            raise UlyssesBatchError(_NO_POSITION_IDS.format(keys=sorted(batch)))
        for whole in self._gather(batch):
            self.micro_batches.append(self._slice(whole))

    def _gather(self, batch: dict) -> list[dict]:
        """Every SP rank's batch, in SP rank order."""
        lengths = self._sequence_lengths(batch["input_ids"].shape[1])
        gathered: list[dict] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                parts = self._gather_tensor(key, value.to(self.device), batch["input_ids"].shape, lengths)
            else:
                parts = [None] * self.sp_world_size
                dist.all_gather_object(parts, value, group=self.sp_group)
            for rank, part in enumerate(parts):
                gathered[rank][key] = part
        return gathered

    def _sequence_lengths(self, mine: int) -> list[int]:
        # gloo checks gather shapes strictly: a 1-element tensor, not a 0-dim one
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.sp_world_size)]
        dist.all_gather(lengths, torch.full((1,), mine, dtype=torch.int64, device=self.device), group=self.sp_group)
        return [int(length[0]) for length in lengths]

    def _gather_tensor(self, key: str, value: torch.Tensor, input_shape, lengths: list[int]) -> list[torch.Tensor]:
        if value.dim() < 2 or value.shape[1] != input_shape[1]:
            raise UlyssesBatchError(f"UlyssesSPDataLoaderAdapter: batch['{key}'] has shape {tuple(value.shape)}, but "
                                    f"input_ids has {tuple(input_shape)}: every tensor in the batch is sharded on "
                                    "dim 1 and must have the same sequence length as input_ids.")
        # padded to the longest: gloo gathers equal shapes only
        longest = max(lengths)
        padded = torch.nn.functional.pad(value, (0, longest - value.shape[1])) if value.dim() == 2 else value
        if value.dim() > 2 and longest != value.shape[1]:
            padded = torch.cat([value, value.new_zeros(value.shape[0], longest - value.shape[1], *value.shape[2:])], 1)
        parts = [torch.zeros_like(padded) for _ in lengths]
        with torch.no_grad():
            dist.all_gather(parts, padded.contiguous(), group=self.sp_group)
        return [part[:, :length] for part, length in zip(parts, lengths)]

    def _slice(self, batch: dict) -> dict:
        """This rank's share of one whole batch, with labels shifted into shift_labels."""
        length = len(batch["input_ids"][0])
        if length % self.sp_world_size:
            raise UlyssesBatchError(f"UlyssesSPDataLoaderAdapter: a batch's seqlen={length} isn't divisible by "
                                    f"sp-size={self.sp_world_size}; pad every sequence to a multiple of "
                                    f"{self.sp_world_size} (e.g. the collator's pad_to_multiple_of="
                                    f"{self.sp_world_size}).")
        if "labels" not in batch:
            raise UlyssesBatchError(f"UlyssesSPDataLoaderAdapter: the batch has no 'labels' (keys: {sorted(batch)});"
                                    " the adapter shifts them into shift_labels before slicing the sequence. Add "
                                    "labels to the batch (for causal LM, a copy of input_ids).")
        chunk = length // self.sp_world_size
        labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)
        batch["shift_labels"] = labels[..., 1:].contiguous()
        start = chunk * self.sp_rank
        # kept on the CPU: at very long sequences this queue would take GBs of accelerator memory
        return {key: value[:, start:start + chunk].cpu() if torch.is_tensor(value) else value
                for key, value in batch.items()}
