"""Count the collectives one process makes: calls, payload bytes and bus bytes by kind.

No crew import: the same file measures crew (its .venv) and DeepSpeed (another venv).

    counter = CommCounter()
    counter.install()            # before deepspeed.initialize: DeepSpeed keeps torch's all-gather function then
    ...                          # start-up and warm-up steps: not counted
    with counter.measure():      # one optimizer step, all its micro steps
        ...
    counter.summary()            # {kind: {"calls", "payload_bytes", "bus_bytes"}, "barrier": {...}, "check": {...}}

Two sources, one window:

* Wrappers around every collective on `torch.distributed` and `torch.distributed.distributed_c10d` (FSDP2
  and DeepSpeed's deepspeed/comm/torch.py look them up there at call time). Only the outermost call counts
  (`all_gather_into_tensor` calls `all_gather_single`). They give the payload and the group's size n.
  Calls made inside `_coalescing_manager` (torch's, as DeepSpeed's all_gather_coalesced uses it) add their
  bytes and count as one call per block: the backend gets one `*_coalesced_` op, as the profiler shows.
  `all_reduce_coalesced`, `all_gather_coalesced`, `batch_isend_irecv`: one call each, for the same reason.
* torch.profiler over the same window: every `c10d::` / `_c10d_functional::` op. An op outside any wrapped
  call was issued from C++ (DDP's reducer calls the process group directly): it is added to the counts, its
  payload read from the backend's own event (`gloo:all_reduce [[4160]] float`, its start inside the op's
  span), its group taken as the whole world. `check` says how many ops each source saw, by kind.

Payload: the size nccl-tests calls S (all_reduce, broadcast, reduce: the tensor; all_gather: the output;
reduce_scatter, all_to_all: the input). Bus bytes: nccl-tests' factors with n ranks in the group:
all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all / gather / scatter (n-1)/n, broadcast /
reduce / p2p 1. Barriers are counted apart, with no bytes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
         "scatter", "p2p")


def _numel_bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_numel_bytes(t) for t in tensors or ())


def _n(bound) -> int:
    return bound.get("n", 1)


# name -> (kind, payload in bytes from the call's bound arguments; "n" is the group's size)
_SIZES: dict[str, tuple[str, Callable[[dict], int]]] = {
    "all_reduce": ("all_reduce", lambda a: _numel_bytes(a["tensor"])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _numel_bytes(a["tensors"])),
    "reduce": ("reduce", lambda a: _numel_bytes(a["tensor"])),
    "broadcast": ("broadcast", lambda a: _numel_bytes(a["tensor"])),
    "all_gather": ("all_gather", lambda a: _numel_bytes(a["tensor_list"])),
    "all_gather_single": ("all_gather", lambda a: _numel_bytes(a["output_tensor"])),
    "all_gather_into_tensor": ("all_gather", lambda a: _numel_bytes(a["output_tensor"])),
    "_all_gather_base": ("all_gather", lambda a: _numel_bytes(a["output_tensor"])),
    "all_gather_coalesced": ("all_gather", lambda a: sum(_numel_bytes(t) for t in a["output_tensor_lists"])),
    "reduce_scatter": ("reduce_scatter", lambda a: _numel_bytes(a["input_list"])),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _numel_bytes(a["input"])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _numel_bytes(a["input"])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: _numel_bytes(a["input"])),
    "all_to_all_single": ("all_to_all", lambda a: _numel_bytes(a["input"])),
    "all_to_all": ("all_to_all", lambda a: _numel_bytes(a["input_tensor_list"])),
    "gather": ("gather", lambda a: _numel_bytes(a["tensor"]) * _n(a)),
    "scatter": ("scatter", lambda a: _numel_bytes(a["tensor"]) * _n(a)),
    "send": ("p2p", lambda a: _numel_bytes(a["tensor"])),
    "recv": ("p2p", lambda a: _numel_bytes(a["tensor"])),
    "isend": ("p2p", lambda a: _numel_bytes(a["tensor"])),
    "irecv": ("p2p", lambda a: _numel_bytes(a["tensor"])),
    "batch_isend_irecv": ("p2p", lambda a: sum(_numel_bytes(op.tensor) for op in a["p2p_op_list"])),
    "barrier": ("barrier", lambda a: 0),
    "monitored_barrier": ("barrier", lambda a: 0),
}

# the profiler's op names (c10d:: and funcol's _c10d_functional::, without the namespace) -> kind
_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "reduce_": "reduce", "broadcast_": "broadcast", "broadcast": "broadcast",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "gather_": "gather", "scatter_": "scatter", "send": "p2p", "recv_": "p2p", "recv_any_source_": "p2p",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
_NAMESPACES = ("c10d::", "_c10d_functional::")
_BACKEND_EVENTS = ("gloo:", "nccl:")
_MARK = "commcount::"
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
                "short int": 2, "unsigned char": 1, "signed char": 1, "bool": 1, "c10::complex<float>": 8}


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for a collective over n ranks."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


def op_kind(name: str) -> str | None:
    """The kind of a profiler event's name, None when it is no collective (wait_tensor, anything else)."""
    for namespace in _NAMESPACES:
        if name.startswith(namespace):
            return _OPS.get(name[len(namespace):])
    return None


class CommCounter:
    """Counts one window's collectives on this rank (see the module's docstring)."""

    def __init__(self) -> None:
        self._originals: dict[tuple[object, str], object] = {}
        self._local = threading.local()
        self.counting = False
        self._profiling = False
        self.reset()

    def reset(self) -> None:
        self.calls: Counter = Counter()
        self.payload: Counter = Counter()
        self.bus: Counter = Counter()
        self.check: dict = {}

    # ---------------------------------------------------------------------------------------------- patching

    def install(self) -> None:
        """Wrap the collectives; idempotent. Counting starts only inside measure()."""
        if self._originals:
            return
        wrappers = {}
        for name in [*_SIZES, "_coalescing_manager"]:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrappers[name] = (original, self._coalescing(original) if name == "_coalescing_manager"
                              else self._wrap(name, original))
        for module in (dist, c10d):
            for name, (original, wrapper) in wrappers.items():
                if getattr(module, name, None) is original:
                    self._originals[(module, name)] = original
                    setattr(module, name, wrapper)

    def uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _wrap(self, name: str, original: Callable) -> Callable:
        kind, size = _SIZES[name]
        signature = inspect.signature(original)
        group_of = "group" if "group" in signature.parameters else None

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not self.counting or self._depth():
                return self._nested(original, args, kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            n = dist.get_world_size(bound.get(group_of)) if group_of else dist.get_world_size()
            self._add(kind, size({**bound, "n": n}), n)
            with self._marked(kind):
                return self._nested(original, args, kwargs)
        return wrapper

    def _nested(self, original: Callable, args, kwargs):
        self._local.depth = self._depth() + 1
        try:
            return original(*args, **kwargs)
        finally:
            self._local.depth -= 1

    def _add(self, kind: str, payload: int, n: int) -> None:
        block = getattr(self._local, "coalesced", None)
        if kind == "barrier":
            self.calls[kind] += 1
            return
        if block is not None:
            block.add(kind)  # one call for the block, counted when it ends
        else:
            self.calls[kind] += 1
        self.payload[kind] += payload
        self.bus[kind] += payload * bus_factor(kind, n)

    def _marked(self, kind: str):
        if not self._profiling:
            return contextlib.nullcontext()
        return torch.profiler.record_function(_MARK + kind)

    def _coalescing(self, original: Callable) -> Callable:
        @contextlib.contextmanager
        @functools.wraps(original)
        def coalescing(*args, **kwargs):
            if not self.counting or self._depth() or getattr(self._local, "coalesced", None) is not None:
                with original(*args, **kwargs) as manager:
                    yield manager
                return
            self._local.coalesced = kinds = set()
            try:
                with self._marked("coalesced"), original(*args, **kwargs) as manager:
                    yield manager
            finally:
                self._local.coalesced = None
                for kind in kinds:
                    self.calls[kind] += 1
        return coalescing

    # ---------------------------------------------------------------------------------------------- measuring

    @contextlib.contextmanager
    def measure(self, profile: bool = True) -> Iterator[CommCounter]:
        """Count what runs inside (the counts start from zero); with `profile`, under torch.profiler too."""
        self.install()
        self.reset()
        profiler = None
        if profile:
            from torch.profiler import ProfilerActivity
            profiler = torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            profiler.__enter__()
        self.counting, self._profiling = True, profile
        try:
            yield self
        finally:
            self.counting = self._profiling = False
            if profiler is not None:
                profiler.__exit__(None, None, None)
                self._cross_check(profiler.events())

    def _cross_check(self, events) -> None:
        """Adds the ops no wrapper saw (issued from C++) and fills `check`."""
        world = dist.get_world_size()
        wrapped = Counter({kind: count for kind, count in self.calls.items() if count})
        seen, unseen = Counter(), Counter()
        ops = sorted((e for e in events if op_kind(e.name) and not _under_op(e)), key=lambda e: e.time_range.start)
        backend = sorted((e for e in events if e.name.startswith(_BACKEND_EVENTS)), key=lambda e: e.time_range.start)
        for event, work in zip(ops, _claim(ops, backend)):
            kind = op_kind(event.name)
            if _under(event, _MARK):
                seen[kind] += 1
                continue
            unseen[kind] += 1
            self.calls[kind] += 1
            if kind != "barrier":
                payload = _event_bytes(work) * (world if kind == "all_gather" else 1)
                self.payload[kind] += payload
                self.bus[kind] += payload * bus_factor(kind, world)
        self.check = {"profiler_ops": dict(seen + unseen), "wrapped_calls": dict(wrapped),
                      "issued_from_cpp": dict(unseen), "agree": wrapped == seen}

    def summary(self) -> dict:
        kinds = {kind: {"calls": self.calls[kind], "payload_bytes": self.payload[kind],
                        "bus_bytes": self.bus[kind]} for kind in KINDS if self.calls[kind] or self.payload[kind]}
        return {**kinds, "barrier": {"calls": self.calls["barrier"]}, "check": self.check}


def _under(event, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def _under_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if op_kind(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _claim(ops: list, backend: list) -> list:
    """The backend's event (gloo's, NCCL's) of each op, in order: the earliest unclaimed one that started after
    the op did. A gloo work's event starts when a worker thread takes it from the queue, in the order queued,
    often after the op returned: start times alone cannot pair them."""
    claimed, pairs, start = set(), [], 0
    for op in ops:
        match = next((i for i in range(start, len(backend)) if i not in claimed
                      and backend[i].time_range.start >= op.time_range.start), None)
        if match is not None:
            claimed.add(match)
            while start in claimed:
                start += 1
        pairs.append(None if match is None else backend[match])
    return pairs


def _event_bytes(work) -> int:
    """The input bytes the backend's event records (gloo: an all-gather's local piece, a reduce-scatter's
    whole input)."""
    if work is None:
        return 0
    return sum(_shape_bytes(shape, dtype) for shape, dtype in zip(work.input_shapes, work.input_dtypes))


def _shape_bytes(shape, dtype: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPE_BYTES.get(dtype, 4) if shape else 0
