"""ZeRO stage 3 checkpoints (and the stage 2 ones of earlier crew versions, whose stage 2 was FSDP2
too): the FSDP2-sharded model and optimizer state, by parameter name, in one
torch.distributed.checkpoint (DCP) folder inside the tag (crew/runtime/checkpoint/ does the rest).

    <tag>/sharded/
      .metadata              global shapes, and where each piece of every tensor lies (rank 0)
      __<rank>_0.distcp      the pieces of rank <rank>'s shards, written by it in parallel

Keys are "model.<parameter or buffer name>" and "optim.<parameter name>.<state key>". Only tensors
go in (DCP loads them with weights_only=True); the optimizer's param groups and any non-tensor state
travel in the tag's replicated file. DCP reads `.metadata` with a plain pickle.load, which would let
a crafted checkpoint run code: crew reads it with an unpickler that accepts only DCP's metadata
classes. Every file is hashed as DCP writes it (its stream goes through layout.HashingWriter) and
checked, when the tag's manifest lists it, before DCP reads it (integrity.Verifier).
Shapes are global, so the folder loads on any world size: at stage 3 each rank reads only the pieces
its own shards need; `read_full` loads whole tensors with no process group, for `crew export` and for
engines at stages 0-2.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from crew.runtime.checkpoint.integrity import Verifier
from crew.runtime.checkpoint.layout import CheckpointError, HashingWriter
from crew.runtime.checkpoint.state import merge_by_name
from crew.runtime.zero.stage3 import shards_visible

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # any: DCP's metadata dataclasses
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "pathlib._local":  # where Python 3.13 pickles pathlib's classes from; read on any Python
            module = "pathlib"
        names = _METADATA_GLOBALS.get(module, ())
        allowed = (names is None or name in names or (module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint's metadata")
        return super().find_class(module, name)


class _Reader(FileSystemReader):
    """DCP's file reader: each file checked against the manifest before it is read, `.metadata`
    read with the restricted unpickler."""

    def __init__(self, folder: Path, verifier: Verifier):
        super().__init__(folder)
        self.verifier = verifier

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        self.verifier.check(Path(path))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:  # the files this rank reads pieces of; each is checked whole, once
            self.verifier.check(Path(self.path) / self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)


class _HashingFileSystem(FileSystem):
    """DCP's file system, recording the size and checksum of each file written: {name: entry}."""

    def __init__(self, written: dict):
        super().__init__()
        self.written = written

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            writer = HashingWriter(stream)
            yield writer
        # DCP writes `.metadata` as `.metadata.tmp`, then renames it
        self.written[Path(path).name.removesuffix(".tmp")] = writer.entry()


class _Writer(FileSystemWriter):
    def __init__(self, folder: Path, written: dict):
        super().__init__(folder)
        self.fs = _HashingFileSystem(written)


@shards_visible()
def save(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, written: dict,
         exclude_frozen: bool = False) -> dict:
    """Write this rank's shards (a collective), their sizes and checksums into `written` by file
    name; returns the optimizer's non-tensor state by name. `exclude_frozen`: not the parameters that
    do not require grad (a PEFT base model)."""
    tensors, other = _split(_optimizer_state(module, optimizer))
    model = get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=exclude_frozen))
    if exclude_frozen:  # a frozen tied weight comes back under its second name
        for name, param in module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                model.pop(name, None)
    with _dcp_errors(folder):
        dcp.save({"model": model, "optim": tensors},
                 storage_writer=_Writer(folder, written))
    return other


@contextlib.contextmanager
def _dcp_errors(folder: Path) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException, with every rank's failure) as a CheckpointError."""
    try:
        yield
    except dcp.CheckpointException as exc:
        failures = "; ".join(f"rank {rank}: {_described(failure)}"
                             for rank, failure in sorted(exc.failures.items()))
        raise CheckpointError(f"{folder}: {failures}") from None


def _described(failure) -> str:
    error = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(error, CheckpointError):  # crew's own: whole, it says what to do
        return str(error)
    return f"{type(error).__name__}: {str(error)[:300]}"


def _optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    # An optimizer that has not stepped yet has no state; get_optimizer_state_dict would create it
    # with a step at lr 0, which changes the training that follows (Adam's step count).
    if not optimizer.state:
        return {}
    return get_optimizer_state_dict(module, optimizer)["state"]


def _split(state: dict) -> tuple[dict, dict]:
    """{name: {key: value}} -> (the tensors, the other values), both by name."""
    tensors = {name: {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
               for name, entry in state.items()}
    other = {name: {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
             for name, entry in state.items()}
    return tensors, {name: entry for name, entry in other.items() if entry}


def saved_entries(folder: Path, verifier: Verifier) -> dict:
    """{flat key: its metadata} of the tensors in a sharded folder (reads only .metadata)."""
    try:
        return _Reader(folder, verifier).read_metadata().state_dict_metadata
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or foreign file fails in many ways inside the unpickler
        raise CheckpointError(f"{folder / '.metadata'} cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); it is truncated, corrupted or not a crew "
                              "checkpoint") from None


def saved_module_shapes(folder: Path, verifier: Verifier) -> dict[str, tuple[int, ...]]:
    return {key[len("model."):]: tuple(meta.size) for key, meta in saved_entries(folder, verifier).items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


@shards_visible()
def load(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, strict: bool,
         optimizer_rest: dict | None, verifier: Verifier) -> None:
    """Load the shards this rank's parameters (and, given `optimizer_rest`, its optimizer state)
    need, whatever world size (and FSDP2 stage) wrote them. A collective."""
    entries = saved_entries(folder, verifier)
    model = get_model_state_dict(module)
    if not strict:
        model = {key: value for key, value in model.items() if f"model.{key}" in entries}
    wanted = {"model": model}
    has_optimizer_state = any(key.startswith("optim.") for key in entries)
    if optimizer_rest is not None and has_optimizer_state:
        wanted["optim"], _ = _split(get_optimizer_state_dict(module, optimizer)["state"])
        _check_optimizer_keys(wanted["optim"], entries, folder)
    with _dcp_errors(folder):
        dcp.load(wanted, storage_reader=_Reader(folder, verifier))
    if optimizer_rest is None:
        set_model_state_dict(module, wanted["model"], options=StateDictOptions(strict=strict))
        return
    state = merge_by_name(wanted.get("optim", {}), optimizer_rest["state_other"])
    _set_both(module, optimizer, wanted["model"], {"state": state, "param_groups": optimizer_rest["param_groups"]},
              StateDictOptions(strict=strict))


def _check_optimizer_keys(state: dict, entries: dict, folder: Path) -> None:
    missing = [f"{name}.{key}" for name, entry in state.items() for key in entry
               if f"optim.{name}.{key}" not in entries]
    if missing:
        raise CheckpointError(
            f"{folder} has no optimizer state for {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}: it was saved with another optimizer or model. "
            "Load with load_optimizer_states=False (or load_module_only=True) to take the weights only.")


@shards_visible()
def load_full(module: torch.nn.Module, optimizer: torch.optim.Optimizer, module_state: dict,
              optimizer_state: dict | None, strict: bool) -> None:
    """Load whole tensors (every rank holds them all, e.g. from a stage 0-2 checkpoint) into the
    shards: module state by name, optimizer state by parameter name (None: module only)."""
    options = StateDictOptions(full_state_dict=True, strict=strict)
    if optimizer_state is None:
        set_model_state_dict(module, module_state, options=options)
        return
    _set_both(module, optimizer, module_state, optimizer_state, options)


def _set_both(module: torch.nn.Module, optimizer: torch.optim.Optimizer, module_state: dict,
              optimizer_state: dict, options: StateDictOptions) -> None:
    groups = list(optimizer.param_groups)
    # DSD takes one param group without parameters at most (a LoRA run's can have several): they take nothing
    stepping = [group for group in groups if group["params"]] or groups
    if stepping is not groups:
        optimizer_state = {**optimizer_state, "param_groups": [group for group in optimizer_state["param_groups"]
                                                               if group["params"]]}
    optimizer.param_groups[:] = stepping
    try:
        set_state_dict(module, optimizer, model_state_dict=module_state, optim_state_dict=optimizer_state,
                       options=options)
        for group, loaded in zip(stepping, optimizer.param_groups, strict=True):
            if group is not loaded:  # the saved values into the same dicts: a scheduler outside holds them
                group.update(loaded)
    finally:
        optimizer.param_groups[:] = groups
    if not optimizer_state["state"]:  # saved before the first step: drop the state set_state_dict
        optimizer.state.clear()       # made up (a step at lr 0), or Adam would count that step


def read_full(folder: Path, verifier: Verifier, with_optimizer: bool = False) -> tuple[dict, dict]:
    """Whole tensors in one process, no process group: (module state, optimizer state by name)."""
    wanted = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in saved_entries(folder, verifier).items()
              if isinstance(meta, TensorStorageMetadata)
              and (key.startswith("model.") or (with_optimizer and key.startswith("optim.")))}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        with _dcp_errors(folder):
            dcp.load(wanted, storage_reader=_Reader(folder, verifier), no_dist=True)
    module, optimizer = {}, {}
    for key, value in wanted.items():
        kind, rest = key.split(".", 1)
        if kind == "model":
            module[rest] = value
        else:  # parameter names have dots, optimizer state keys (exp_avg, step, ...) do not
            name, entry = rest.rsplit(".", 1)
            optimizer.setdefault(name, {})[entry] = value
    return module, optimizer


@shards_visible()
def full_module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole module state on rank 0 (on the CPU), an empty dict elsewhere. A collective."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
