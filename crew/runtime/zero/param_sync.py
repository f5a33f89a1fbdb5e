"""Stages 1-2 after the optimizer step: each rank has updated the parameters it owns (ZeroRedundancyOptimizer's
whole-parameter split) and every rank needs them all, whole and equal.

    all-gather  each owner's parameters flattened end to end into its share, padded to the largest share and
                all-gathered: bus bytes (n-1) x the largest share, as DeepSpeed 0.19.8 all-gathers its flat
                partitions (whose split is even: crew's is by whole parameters, so it can be uneven)
    broadcast   from each owner in turn: bus bytes 1 x every share, which beats the all-gather where one share
                dwarfs the others

and in between: all-gather as many elements of each share as the smaller shares hold, and the larger shares'
owners broadcast their rest. Of these the one that sends the fewest bytes, a call counting as CALL_BYTES (an
even split: one all-gather; 6 equal weights on 4 ranks, shares 2:2:1:1: an all-gather of one weight's size
and two broadcasts, 5/6 of the parameter bytes where either alone sends all of them). Either way few calls:
flat buffers per dtype and device, in chunks of the bucket size, not one per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

OWN_COLLECTIVE = 1 << 20  # elements: a tensor this large is broadcast in place, in a collective of its own
CALL_BYTES = 1 << 18  # a call costs about what sending 256 KiB does (20 us at 100 Gbit/s): near-ties go to fewer
Scratch = Callable[[torch.dtype, torch.device, int], "torch.Tensor | None"]  # a spare flat buffer, if one is kept


def sync_from_owners(shares: list[list[torch.Tensor]], chunk_elements: int, scratch: Scratch | None = None,
                     group=None) -> None:
    """`shares[r]`: the tensors rank r of `group` (None: the world) owns and has updated (the same list on every
    rank). Afterwards every rank holds every owner's values. `scratch` may lend the all-gather's output buffer."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    for per_rank in _by_kind(shares, world):
        lengths = [sum(tensor.numel() for tensor in tensors) for tensors in per_rank]
        contiguous = all(tensor.is_contiguous() for tensors in per_rank for tensor in tensors)
        piece, calls = _gather_plan(lengths, chunk_elements, per_rank) if contiguous else (0, 0)
        if calls:
            _all_gather(per_rank, piece, calls, scratch, group)
        for owner, tensors in enumerate(per_rank):  # what the all-gather left out: the owner broadcasts it
            rest = [tensor.detach().view(-1)[start:start + count] if count < tensor.numel() else tensor
                    for tensor, start, _, count in _spans(tensors, piece * calls, lengths[owner])]
            if rest:
                broadcast_flat(rest, owner, chunk_elements, group=group)


def _gather_plan(lengths: list[int], chunk_elements: int, per_rank: list[list[torch.Tensor]]) -> tuple[int, int]:
    """(piece, calls): all-gather `calls` x `piece` elements of every owner's share, the owners broadcasting
    whatever their share has beyond that. Of the share sizes (and 0: broadcasts only) the one that sends the
    fewest bus bytes, a call counted as CALL_BYTES more: an even split all-gathers all; a lopsided one (one
    parameter that dwarfs the rest) all-gathers the small shares' size and broadcasts the large one's rest."""
    world = len(lengths)
    size = next(tensor for tensors in per_rank for tensor in tensors).element_size()
    best = (sum(lengths) * size + CALL_BYTES * sum(map(bool, lengths)), 0, 0)  # broadcasts only
    for share in set(lengths) - {0}:
        calls = math.ceil(share * world / chunk_elements)
        piece = math.ceil(share / calls)
        beyond = [length - piece * calls for length in lengths if length > piece * calls]
        cost = ((world - 1) * piece * calls + sum(beyond)) * size + CALL_BYTES * (calls + len(beyond))
        best = min(best, (cost, -piece, calls))
    return -best[1], best[2]


def _by_kind(shares: list[list[torch.Tensor]], world: int) -> list[list[list[torch.Tensor]]]:
    """The shares split by (dtype, device): [kind][owner] -> tensors."""
    kinds: dict[tuple, list[list[torch.Tensor]]] = {}
    for owner, tensors in enumerate(shares):
        for tensor in tensors:
            kinds.setdefault((tensor.dtype, tensor.device), [[] for _ in range(world)])[owner].append(tensor)
    return list(kinds.values())


@torch.no_grad()
def _all_gather(per_rank: list[list[torch.Tensor]], piece: int, calls: int, scratch: Scratch | None,
                group=None) -> None:
    """`calls` all-gathers of `piece` elements from each rank: call k carries elements [k x piece, (k+1) x
    piece) of each owner's share (its tensors end to end, zeros past its end)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sample = next(tensor for tensors in per_rank for tensor in tensors)
    wire = _wire_device() or sample.device
    out = scratch(sample.dtype, wire, world * piece) if scratch is not None else None
    if out is None:
        out = torch.empty(world * piece, dtype=sample.dtype, device=wire)
    send = torch.empty(piece, dtype=sample.dtype, device=wire)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it
    for call in range(calls):
        low = call * piece
        send.zero_()
        for tensor, start, at, count in _spans(per_rank[rank], low, low + piece):
            send[at:at + count].copy_(tensor.detach().view(-1)[start:start + count])
        gather(out, send, group=group)
        for owner, tensors in enumerate(per_rank):
            if owner != rank:
                received = out[owner * piece:(owner + 1) * piece]
                for tensor, start, at, count in _spans(tensors, low, low + piece):
                    tensor.detach().view(-1)[start:start + count].copy_(received[at:at + count])


def _spans(tensors: list[torch.Tensor], low: int, high: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
    """(tensor, first element in it, where that lands in the piece, element count) for each part of the
    tensors laid end to end that falls in [low, high)."""
    offset = 0
    for tensor in tensors:
        first, last = max(low, offset), min(high, offset + tensor.numel())
        if first < last:
            yield tensor, first - offset, first - low, last - first
        offset += tensor.numel()


class GatheringZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """Stage 1 in fp32: torch's ZeroRedundancyOptimizer, the owners' parameters brought back by
    sync_from_owners (one all-gather) instead of one broadcast per parameter."""

    def __init__(self, params, *, chunk_elements: int, **kwargs) -> None:
        self._chunk_elements = chunk_elements
        self._sync_group = kwargs.get("process_group")
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def _sync_params(self) -> None:
        shares = [[param for group in groups for param in group["params"]] for groups in self._partition_parameters()]
        sync_from_owners(shares, self._chunk_elements, group=self._sync_group)


def broadcast_flat(tensors: list[torch.Tensor], source: int, chunk_elements: int,
                   keep: bool = True, group=None) -> list[torch.Tensor]:
    """Broadcast `tensors` from rank `source` of `group` (None: the world) into the same tensors elsewhere (unless
    not `keep`: then only their shapes matter): each large one in place, the others flattened in chunks of one
    dtype (one collective per chunk, not one per tensor). Returns them."""
    receiving = dist.get_rank(group) != source
    handles = []
    wire = _wire_device()
    for tensor in (t for t in tensors if t.numel() >= OWN_COLLECTIVE):  # the same choice on every rank
        if not receiving:
            buffer = tensor.detach().contiguous().to(wire or tensor.device)
        elif keep and tensor.is_contiguous() and wire in (None, tensor.device):
            buffer = tensor.detach()
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=wire or tensor.device)
        handles.append((tensor, buffer, dist.broadcast(buffer, group=group, group_src=source, async_op=True)))
        if not keep:
            handles.pop()[2].wait()  # not kept: one at a time
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in (t for t in tensors if t.numel() < OWN_COLLECTIVE):
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for (dtype, device), same_kind in by_kind.items():
        for chunk in chunks(same_kind, chunk_elements):
            if not receiving:
                flat = torch.cat([tensor.detach().reshape(-1) for tensor in chunk]).to(wire or device)
            else:
                flat = torch.empty(sum(t.numel() for t in chunk), dtype=dtype, device=wire or device)
            dist.broadcast(flat, group=group, group_src=source)
            if receiving and keep:
                offset = 0
                for tensor in chunk:
                    tensor.detach().copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
    for tensor, buffer, work in handles:
        work.wait()
        if receiving and buffer.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(buffer)
    return tensors


def _wire_device() -> torch.device | None:
    """Where broadcast_flat's buffers must be for the process group: the GPU under NCCL alone, which sends no CPU
    tensor (offload_optimizer keeps the fp32 masters on the CPU); None where the backend takes them as they are."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return None


def chunks(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    chunk, size = [], 0
    for tensor in tensors:
        if chunk and size + tensor.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(tensor)
        size += tensor.numel()
    if chunk:
        yield chunk
