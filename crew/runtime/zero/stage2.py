"""ZeRO stage 2 as DeepSpeed's: whole parameters on every rank, partitioned gradients and optimizer state.

Each trainable parameter has one owner rank, ZeroRedundancyOptimizer's split (whole parameters, balanced
by size). The owner alone keeps its gradient, its fp32 master copy (under fp16/bf16) and its optimizer
state; every rank keeps every parameter whole, so `model.parameters()` and `model.state_dict()` are the
full, equal tensors on every rank. Stage 1 under fp16/bf16 (or with offload_optimizer: the masters on the
CPU) uses the same optimizer without the gradient hooks: DDP averages the gradients there; with
use_multi_rank_bucket_allreduce false stage 1 uses the hooks too, at the accumulation boundary only.

    backward   each parameter's gradient, as autograd finishes it (a post-accumulate-grad hook), is
               copied from `.grad` into its bucket's flat buffer (laid out owner by owner); a full bucket
               is averaged over the ranks in one all-reduce (with use_multi_rank_bucket_allreduce false,
               as DeepSpeed's: one reduce of each owner's slice into that owner; buckets go out in a fixed
               order, so the ranks' collectives always match) and the owners add their parts to an
               accumulator, the other ranks drop them. This happens on every micro step, as in
               DeepSpeed's stage 2, so accumulation holds only the owned gradients. At the end of the
               backward that ends an accumulation the accumulators become the owned parameters' `.grad`.
    step       the global gradient norm is summed in float64 (gradnorm.py) from the owned gradients (equal on every
               rank, for clipping and get_global_grad_norm); under fp16 an inf/nan on any rank skips
               the step on all; each rank steps its own parameters, then all-gathers them (param_sync.py).

Buckets hold reduce_bucket_size elements (DeepSpeed's default 5e8, so models below that reduce once, at
the end of the backward): one is reduced while the next one fills, in flat buffers kept from one backward
to the next (_BufferPool).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from crew.errors import CrewError
from crew.log import log_rank0
from crew.runtime.zero.param_sync import broadcast_flat, chunks, sync_from_owners

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "GradientPartition", "PartitionedOptimizer", "broadcast_flat",
           "broadcast_module", "chunks", "partition"]

DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size
IN_FLIGHT = 1  # buckets being reduced while the next one fills (double buffering, as DeepSpeed's)


class _BufferPool:
    """The buckets' flat buffers, kept from one backward to the next (on a CPU a fresh buffer of hundreds of MB
    costs its page faults every time): as many as are in flight at once, each as large as the largest bucket
    of its kind. Between backwards the optimizer step may borrow one (param_sync's all-gather)."""

    def __init__(self, buckets: list[_Bucket]) -> None:
        self._size: dict[tuple, int] = {}
        for bucket in buckets:
            self._size[bucket.kind] = max(self._size.get(bucket.kind, 0), bucket.numel)
        self._free: dict[tuple, list[torch.Tensor]] = {kind: [] for kind in self._size}

    def take(self, kind: tuple) -> torch.Tensor:
        free = self._free[kind]
        return free.pop() if free else torch.empty(self._size[kind], dtype=kind[0], device=kind[1])

    def give(self, buffer: torch.Tensor) -> None:
        free = self._free[(buffer.dtype, buffer.device)]
        if len(free) <= IN_FLIGHT:  # one launched, one filling: more than that only when gradients come out of order
            free.append(buffer)

    def lend(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor | None:
        """A kept buffer of `numel` elements, for use before the next backward (grown if it is smaller: the
        all-gather's padding); None where no buffer of that kind is kept."""
        free = self._free.get((dtype, device))
        if not free:
            return None
        if free[0].numel() < numel:
            free[0] = torch.empty(numel, dtype=dtype, device=device)
        return free[0][:numel]


class _Bucket:
    """A run of parameters (one dtype and device) whose gradients are reduced together in one flat buffer
    (a pooled one), laid out owner by owner, so that each owner's part is one slice of it."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.kind = (dtype, device)
        self.params: list[torch.Tensor] = []
        self.owners: list[int] = []
        self.offsets: list[int] = []
        self.slices: list[tuple[int, int, int]] = []  # (owner, start, end) in the flat buffer
        self.numel = 0
        self.filled: list[bool] = []
        self.buffer: torch.Tensor | None = None  # the pooled buffer, while a backward uses it
        self.works: list = []

    def place(self, param: torch.Tensor, owner: int) -> None:
        self.params.append(param)
        self.owners.append(owner)
        self.numel += param.numel()
        self.filled.append(False)

    def lay_out(self) -> None:
        """Each owner's gradients next to each other, in owner order."""
        self.offsets, start = [0] * len(self.params), 0
        for owner in sorted(set(self.owners)):
            first = start
            for index in (i for i, rank in enumerate(self.owners) if rank == owner):
                self.offsets[index] = start
                start += self.params[index].numel()
            self.slices.append((owner, first, start))

    def reduced(self, index: int) -> torch.Tensor:
        start = self.offsets[index]
        return self.buffer[start:start + self.params[index].numel()].view_as(self.params[index])

    def add(self, index: int, grad: torch.Tensor, pool: _BufferPool) -> None:
        if self.filled[index]:
            raise CrewError(f"ZeRO stage 2: a gradient of a {tuple(grad.shape)} parameter arrived twice in "
                            "one backward; crew reduces each parameter's gradient once per backward.")
        if self.buffer is None:
            self.buffer = pool.take(self.kind)
        self.reduced(index).copy_(grad)
        self.filled[index] = True

    @property
    def complete(self) -> bool:
        return all(self.filled)

    def launch(self, world_size: int, pool: _BufferPool, to_owners: bool, group=None) -> None:
        """Average over the ranks (async): into every rank (all-reduce), or with `to_owners` each owner's
        slice into its owner only (a reduce per owner). A gradient that did not come here counts as zero."""
        if self.buffer is None:
            self.buffer = pool.take(self.kind)
        for index, filled in enumerate(self.filled):
            if not filled:
                self.reduced(index).zero_()
        flat = self.buffer[:self.numel]
        flat.div_(world_size)  # first, as DDP does: the sum of fp16 gradients stays in range
        if to_owners:
            self.works = [dist.reduce(flat[start:end], group=group, group_dst=owner, async_op=True)
                          for owner, start, end in self.slices]
        else:
            self.works = [dist.all_reduce(flat, group=group, async_op=True)]

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def release(self, pool: _BufferPool) -> None:
        if self.buffer is not None:
            pool.give(self.buffer)
        self.buffer, self.works = None, []
        self.filled = [False] * len(self.params)


def _plan_buckets(owners: list[tuple[torch.Tensor, int]], capacity: int) -> list[_Bucket]:
    """Buckets in the order autograd usually finishes the gradients (the reverse of the parameters')."""
    buckets: list[_Bucket] = []
    open_by_kind: dict[tuple, _Bucket] = {}
    for param, owner in reversed(owners):
        kind = (param.dtype, param.device)
        bucket = open_by_kind.get(kind)
        if bucket is None or (bucket.numel and bucket.numel + param.numel() > capacity):
            bucket = open_by_kind[kind] = _Bucket(param.dtype, param.device)
            buckets.append(bucket)
        bucket.place(param, owner)
    for bucket in buckets:
        bucket.lay_out()
    return buckets


class GradientPartition:
    """Stage 2's gradients: reduced on every backward, kept by the rank that owns the parameter (with
    `boundary_only`, stage 1's: added up whole in `.grad` and reduced at the accumulation boundary only)."""

    def __init__(self, owners: list[tuple[torch.Tensor, int]], bucket_elements: int, device: torch.device,
                 to_owners: bool = False, boundary_only: bool = False, group=None) -> None:
        self.group = group  # the data-parallel group (None: the world); owners are its ranks
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self.to_owners = to_owners  # use_multi_rank_bucket_allreduce false: reduce each owner's slice to it
        # stage 1: gradients accumulate whole in .grad over the micro steps and are reduced at the boundary only
        self.boundary_only = boundary_only
        self._taking = True  # the hooks take the gradients in this backward
        self._published = False  # the owned reduced gradients are in .grad (a boundary passed, no step yet)
        self.owned = [param for param, owner in owners if owner == self.rank]
        self._owned_ids = {id(param) for param in self.owned}
        self.buckets = _plan_buckets(owners, bucket_elements)
        self.pool = _BufferPool(self.buckets)
        self._slot = {id(param): (order, index) for order, bucket in enumerate(self.buckets)
                      for index, param in enumerate(bucket.params)}
        self._accumulated: dict[int, torch.Tensor] = {}
        self._next = 0  # the next bucket to launch: in order, so every rank's collectives match
        self._launched: list[_Bucket] = []
        self._reducing = False  # a backward's reduction is under way (its end callback is queued)
        self._reduced = False  # the buckets went out during the current engine.backward
        self.on_ready: Callable[[], None] | None = None  # the balancer's "gradients ready" mark
        self._handles = []
        hook = functools.partial(_hook, weakref.ref(self))
        for param, _ in owners:
            param._crew_gradient_partition = id(self)  # the newest engine's partition takes the gradient
            self._handles.append(param.register_post_accumulate_grad_hook(hook))

    # -- one backward --------------------------------------------------------------------------

    @contextlib.contextmanager
    def reducing(self, boundary: bool) -> Iterator[None]:
        """Around engine.backward: every rank reduces every bucket once; on the accumulation boundary
        the owned parameters get their accumulated gradients as `.grad`. With `boundary_only`, a backward off
        the boundary leaves its gradients in `.grad`, where autograd adds them up."""
        if self._published or not self.boundary_only:  # else .grad holds this rank's own sums, to be reduced
            self._reclaim()
        self._published = False
        if self.boundary_only and not boundary:
            self._taking = False
            try:
                yield
            finally:
                self._taking = True
            return
        self._reduced = False
        try:
            yield
        except BaseException:
            self._abandon()
            raise
        if not self._reduced:  # no gradient reached this rank: the others still reduce, and so must it
            self._finish()
        if boundary:
            for param in self.owned:
                grad = self._accumulated.pop(id(param), None)
                if grad is not None:
                    param.grad = grad
            self._published = True

    def take(self, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook: this micro step's gradient of `param` goes to its bucket."""
        if not self._reducing:
            self._reducing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        grad, param.grad = param.grad, None
        order, index = self._slot[id(param)]
        if order < self._next:
            raise CrewError("ZeRO stage 2: a gradient arrived after its bucket was reduced; crew reduces "
                            "each parameter's gradient once per backward.")
        self.buckets[order].add(index, grad, self.pool)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        if self.on_ready is not None:
            self.on_ready()
        bucket.launch(self.world_size, self.pool, self.to_owners, self.group)
        self._next += 1
        self._launched.append(bucket)
        while len(self._launched) > IN_FLIGHT:
            self._keep_owned(self._launched.pop(0))

    def _finish(self) -> None:
        """End of a backward: launch what is left (in order) and keep the owned parts."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        while self._launched:
            self._keep_owned(self._launched.pop(0))
        self._next, self._reducing, self._reduced = 0, False, True

    @torch.no_grad()
    def _keep_owned(self, bucket: _Bucket) -> None:
        bucket.wait()
        for index, param in enumerate(bucket.params):
            if id(param) in self._owned_ids:
                reduced = bucket.reduced(index)
                total = self._accumulated.get(id(param))
                # out of the flat buffer, which the next bucket reuses
                self._accumulated[id(param)] = reduced.clone() if total is None else total.add_(reduced)
        bucket.release(self.pool)

    def _reclaim(self) -> None:
        """Owned gradients published at a boundary and not stepped yet go back to the accumulator,
        so that a second backward adds to them instead of reducing them again."""
        for param in self.owned:
            if param.grad is not None:
                total = self._accumulated.get(id(param))
                self._accumulated[id(param)] = param.grad if total is None else total.add_(param.grad)
                param.grad = None

    def _abandon(self) -> None:
        for bucket in self.buckets:
            bucket.wait()
            bucket.release(self.pool)
        self._launched, self._next, self._reducing = [], 0, False

    # -- step and teardown ----------------------------------------------------------------------

    def clear(self) -> None:
        """zero_grad: the accumulated gradients go too."""
        self._accumulated.clear()
        self._published = False

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The owned `param`'s gradient reduced so far: its .grad at the boundary, else the accumulator."""
        return param.grad if param.grad is not None else self._accumulated.get(id(param))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._accumulated.clear()


def _hook(partition_ref: weakref.ref, param: torch.Tensor) -> None:
    """A parameter's gradient hook; an engine initialised again on the same model without destroy()
    leaves its hooks behind, and only the newest engine's partition acts."""
    partition = partition_ref()
    if partition is not None and partition._taking and param.grad is not None and \
            getattr(param, "_crew_gradient_partition", None) == id(partition):
        partition.take(param)


# -- the optimizer -------------------------------------------------------------------------------

class PartitionedOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer for stage 2: each rank steps the parameters it owns (their fp32 masters
    under fp16/bf16, which only the owner keeps: the other ranks hold a stand-in without storage in
    their place), then every rank gathers the model's parameters from their owners."""

    def __init__(self, groups: list[dict], optimizer_class: type, model_param_of: dict[int, torch.Tensor],
                 before_broadcast: Callable[[], None], bucket_elements: int, **defaults) -> None:
        self._model_param_of = model_param_of  # id(optimizer tensor) -> the model parameter it updates
        self._before_broadcast = before_broadcast
        self._bucket_elements = bucket_elements
        self.grads: GradientPartition | None = None
        self.stand_ins: dict[int, torch.Tensor] = {}  # id(stand-in) -> its model parameter
        super().__init__(groups, optimizer_class=optimizer_class, **defaults)

    def model_param(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._model_param_of.get(id(tensor), tensor)

    def owners(self) -> list[tuple[torch.Tensor, int]]:
        """(optimizer tensor, owner rank), in param_groups order."""
        rank_of = self._param_to_rank
        return [(tensor, rank_of[tensor]) for group in self.param_groups for tensor in group["params"]]

    @torch.no_grad()
    def _sync_params(self) -> None:
        """After the local step: the owned masters go into the model's parameters, which every rank gathers
        from their owners (ZeroRedundancyOptimizer would broadcast the optimizer's tensors one by one)."""
        self._before_broadcast()
        shares = [[self.model_param(tensor) for group in groups for tensor in group["params"]]
                  for groups in self._partition_parameters()]
        sync_from_owners(shares, self._bucket_elements, self.grads.pool.lend if self.grads is not None else None,
                         group=self.process_group)

    @torch.no_grad()
    def gather_masters(self, keep: bool) -> dict[int, torch.Tensor]:
        """Every partitioned fp32 master, whole: {id(model parameter): tensor} where `keep` (a
        collective; ranks that do not keep receive each piece and drop it)."""
        gathered: dict[int, torch.Tensor] = {}
        if not self._model_param_of:  # fp32: no masters (the same on every rank)
            return gathered
        for rank, groups in enumerate(self._partition_parameters()):
            tensors = [tensor for group in groups for tensor in group["params"]
                       if id(tensor) in self._model_param_of]
            receive = keep and rank != self.rank
            pieces = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors] if receive else tensors
            broadcast_flat(pieces, rank, self._bucket_elements, keep=keep, group=self.process_group)
            if keep:
                gathered.update((id(self.model_param(tensor)), piece) for tensor, piece in zip(tensors, pieces))
        return gathered

    @torch.no_grad()
    def from_owner(self, param: torch.Tensor, grad: bool = False) -> torch.Tensor | None:
        """Model parameter `param`'s fp32 master (with `grad`: its gradient reduced so far, as the
        model dtype holds it, loss scale included) from the rank that owns it, as an fp32 copy on
        every rank: a collective, for deepspeed.utils' safe_get_full_fp32_param / safe_get_full_grad.
        None on every rank when the optimizer does not step `param`, or it has no gradient."""
        if not hasattr(self, "_tensor_by_param"):
            self._tensor_by_param = {id(self.model_param(t)): t for group in self.param_groups
                                     for t in group["params"]}
        tensor = self._tensor_by_param.get(id(param))
        if tensor is None:
            return None
        owner, value = self._param_to_rank[tensor], None
        if self.rank == owner:
            value = tensor if not grad else self.grads.gradient(param) if self.grads else param.grad
        present = torch.tensor([value is not None], dtype=torch.uint8, device=param.device)
        dist.broadcast(present, group=self.process_group, group_src=owner)
        if not present.item():
            return None
        whole = value.detach().float().to(param.device, copy=True) if value is not None else \
            torch.empty(param.shape, dtype=torch.float32, device=param.device)  # on the wire's device (offload)
        dist.broadcast(whole, group=self.process_group, group_src=owner)
        return whole

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self.grads is not None:
            self.grads.clear()

    def destroy(self) -> None:
        """engine.destroy(): the gradient hooks go (a second initialize on the same model adds its own)."""
        if self.grads is not None:
            self.grads.remove()


# -- building it -----------------------------------------------------------------------------------

def partition(optimizer: torch.optim.Optimizer, optimizer_class: type, defaults: dict, precision,
              bucket_elements: int | None, device: torch.device, reduce_gradients: bool = True,
              to_owners: bool = False, stage: int = 2, group=None) -> PartitionedOptimizer:
    """Stage 2 from a built optimizer (over fp32 masters under fp16/bf16): who owns what, the masters
    of other ranks' parameters freed, the gradient hooks installed."""
    elements = bucket_elements or DEFAULT_BUCKET_ELEMENTS
    groups = optimizer.param_groups
    # ZeroRedundancyOptimizer's own split, read from a throwaway one built over the same groups
    defaults = dict(defaults, process_group=group)  # the owners: ranks of the data-parallel group
    probe = ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, **defaults)
    owner_of = {id(tensor): rank for tensor, rank in probe._param_to_rank.items()}
    del probe
    pairs = precision.master_pairs() if precision is not None else []  # none: fp32
    model_param_of = {id(master): param for param, master in pairs}
    stand_ins = _replace_others_masters(groups, owner_of, model_param_of, dist.get_rank(group))
    if stand_ins:
        precision.drop_masters(stand_ins.values())
    model_param_of.update(stand_ins)
    before_broadcast = precision.copy_master_to_model if precision is not None else lambda: None
    zero = PartitionedOptimizer(groups, optimizer_class, model_param_of, before_broadcast, elements, **defaults)
    zero.stand_ins = stand_ins
    if {id(tensor): rank for tensor, rank in zero._param_to_rank.items()} != owner_of:
        raise CrewError("ZeRO stage 2: ZeroRedundancyOptimizer split the stand-ins of other ranks' "
                        f"fp32 masters differently from the masters (torch {torch.__version__}). Train "
                        "with zero_optimization.stage 1, or in fp32.")
    owners = [(zero.model_param(tensor), rank) for tensor, rank in zero.owners()]
    trainable = [(param, rank) for param, rank in owners if param.requires_grad]
    if zero.world_size > 1 and reduce_gradients:
        zero.grads = GradientPartition(trainable, elements, device, to_owners, boundary_only=stage == 1, group=group)
    mine = sum(param.numel() for param, rank in owners if rank == zero.rank)
    log_rank0("ZeRO stage %d: whole parameters on every rank; %soptimizer state of %d of %d elements on rank "
              "0%s%s", stage, "gradients and " if stage == 2 else "", mine,
              sum(param.numel() for param, _ in owners), " (fp32 masters too)" if stand_ins else "",
              f", reduced in buckets of up to {elements} elements{' to their owners' if to_owners else ''}"
              f"{' at the accumulation boundary' if stage == 1 else ''}" if reduce_gradients else "")
    return zero


def _replace_others_masters(groups: list[dict], owner_of: dict[int, int],
                            model_param_of: dict[int, torch.Tensor], rank: int) -> dict[int, torch.Tensor]:
    """In `groups` (in place, so a scheduler holding them still sets the lr used), each fp32 master
    that another rank owns becomes a stand-in of its shape with no storage. Returns {id(stand-in):
    the model parameter}; `model_param_of` keeps only the masters that stay."""
    stand_ins: dict[int, torch.Tensor] = {}
    for group in groups:
        for index, tensor in enumerate(group["params"]):
            if id(tensor) not in model_param_of or owner_of[id(tensor)] == rank:
                continue
            stand_in = torch.nn.Parameter(torch.zeros((), dtype=tensor.dtype, device=tensor.device)
                                          .expand(tensor.shape), requires_grad=tensor.requires_grad)
            group["params"][index] = stand_in
            owner_of[id(stand_in)] = owner_of.pop(id(tensor))
            stand_ins[id(stand_in)] = model_param_of.pop(id(tensor))  # the master goes: no stale id
    return stand_ins


def broadcast_module(module: torch.nn.Module, bucket_elements: int | None, group=None) -> None:
    """Rank 0's parameters and buffers (of `group`, None: the world) on every rank of it, as DDP (and
    DeepSpeed's engine) do at start."""
    tensors = [t for t in _tensors(module) if not t.is_meta]
    with torch.no_grad():
        broadcast_flat(tensors, 0, bucket_elements or DEFAULT_BUCKET_ELEMENTS, group=group)


def _tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from (buffer for buffer in module.buffers() if buffer is not None)
