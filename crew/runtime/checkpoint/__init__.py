"""Checkpoints with DeepSpeed's semantics (tag folders, a `latest` file, client_state, every rank
calls), written so that no crash can destroy the last good one.

    save_dir/
      latest                  the newest complete tag; written last, after every rank finished
      <tag>/
        model_states.<i>-of-<k>.pt
                              ZeRO stages 0-1: fp32 module, optimizer (whole, with the parameter
                              names), scheduler, precision, counters, config, version. Stage 0: k
                              byte-balanced parts written in parallel by k ranks (the state is
                              replicated, so each rank serialises and fsyncs only its part); stage 1:
                              one part, by the rank the optimizer state is consolidated to
        sharded/              ZeRO stages 2-3: model and optimizer shards by parameter name, one DCP
                              checkpoint written by all ranks in parallel (crew/runtime/checkpoint/sharded.py)
        engine_state.pt       stages 2-3: all the rest (optimizer param groups, scheduler, ...)
        client_state.pt       the user's client_state
        rank<R>.pt            rank R's RNG states and data loader position
        crew_checkpoint.json  manifest: world size, placement, ZeRO stage, format, version (its
                              presence = complete)

A tag is built in `.<tag>.partial-<token>` and renamed into place only when every rank has written
and fsynced its files, so a kill at any moment leaves the previous checkpoint and `latest` intact.
Without a shared filesystem each node's ranks write the node's own copy of the shared files
(stages 0-1; a sharded checkpoint needs a filesystem every node shares). Both formats load on any
world size and at any stage: stage 0-1 engines read a sharded checkpoint whole, stage 2-3 engines
place a whole one into their shards; the optimizer state moves between them by parameter name.
Loading uses torch.load(weights_only=True).
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import random
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy
import torch

from crew import __version__
from crew.errors import CrewError
from crew.log import log_rank0, warn_once
from crew.runtime import comm

MANIFEST = "crew_checkpoint.json"
MODEL_STATES = "model_states.{part}-of-{parts}.pt"
CLIENT_STATE = "client_state.pt"
ENGINE_STATE = "engine_state.pt"  # stages 2-3: what is not in the sharded folder
SHARDED_DIR = "sharded"
REPLICATED, SHARDED = "replicated", "sharded"  # the manifest's "format"
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")
_RENAME_EXCHANGE = 2


class CheckpointError(CrewError):
    """A checkpoint that cannot be written or read; says which file and what differs."""


# -- collective error handling ------------------------------------------------------------------

def _where() -> str:
    return f"rank {comm.get_rank()} on {os.environ.get('CREW_HOST') or socket.gethostname()}"


def _all_gather(value: Any) -> list:
    """`value` from every rank, in rank order (a collective; [value] without a process group)."""
    if comm.get_world_size() == 1 or not torch.distributed.is_initialized():
        return [value]
    values = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def _agree(problem: str | None, what: str) -> None:
    """Every rank raises the same error if any rank had a problem: nobody waits on a dead rank."""
    found = [p for p in _all_gather(problem) if p]
    if found:
        shown = "\n  ".join(found[:8]) + (f"\n  ... and {len(found) - 8} more" if len(found) > 8 else "")
        raise CheckpointError(f"{what} failed on {len(found)} rank(s):\n  {shown}")


def _attempt(action, *args) -> str | None:
    """None, or what went wrong on this rank: every rank must reach the next _agree."""
    try:
        action(*args)
    except (OSError, RuntimeError, ValueError, CrewError) as exc:
        return f"{_where()}: {exc}"
    except Exception as exc:  # e.g. a KeyError from torch's state dict code: still no hang
        return f"{_where()}: {type(exc).__name__}: {exc}"
    return None


# -- files --------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Recorder:
    """A file wrapper that keeps the OSError of a failed write (disk full, quota), which torch's
    serialiser would otherwise turn into an opaque 'enforce fail ... unexpected pos'."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.handle.flush()


def _write_atomic(path: Path, data: bytes | None = None, obj: Any = None) -> None:
    """Write under a temporary name, fsync, rename: `path` is either the old or the new file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            recorder = _Recorder(handle)
            try:
                torch.save(obj, recorder) if obj is not None else recorder.write(data)
                handle.flush()
            except Exception:
                if recorder.error is not None:
                    raise recorder.error from None
                raise
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _read(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or corrupted file fails in many ways inside torch
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
                              "it is truncated, corrupted or not a crew checkpoint") from None


def _swap_into_place(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`; an existing `final` is exchanged atomically, then removed."""
    if not final.exists():
        os.rename(staging, final)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, bytes(staging), -100, bytes(final), _RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), f"cannot replace {final} atomically")
    shutil.rmtree(staging, ignore_errors=True)  # holds the old checkpoint now


# -- save ---------------------------------------------------------------------------------------

def default_tag(engine) -> str:
    return f"global_step{engine.global_steps}"


def save(engine, save_dir: str | os.PathLike, tag: str | None = None,
         client_state: dict | None = None, save_latest: bool = True) -> bool:
    save_dir = Path(save_dir).absolute()
    tag = str(tag) if tag is not None else default_tag(engine)
    if engine.micro_steps % engine.gradient_accumulation_steps():
        warn_once("save_checkpoint in the middle of gradient accumulation: the gradients of the "
                  "micro steps since the last optimizer step are not saved, so a resume repeats "
                  "them. Save right after the engine.step() that ends an accumulation.")
    _agree(_tag_problem(tag), "save_checkpoint")
    _agree(_same_everywhere(tag, "tag"), "save_checkpoint")
    token = _broadcast_token()
    staging = save_dir / f".{tag}.partial-{token}"
    shared = _detect_shared(save_dir, staging, token)
    what = f"save_checkpoint({save_dir}, tag={tag})"
    sharded = engine.zero.shards_params
    if sharded and not shared:
        shutil.rmtree(staging, ignore_errors=True)  # each node's own, holding only the marker
        raise CheckpointError(
            f"{what}: ZeRO stage 2/3 checkpoints are written as one sharded checkpoint; save_dir "
            f"must be on a filesystem every node shares, and {save_dir} is not (each node sees "
            "only its own files there). Point save_dir at a shared filesystem (NFS, Lustre, ...).")
    part, parts = _my_part(shared, split=engine.zero.stage == 0)
    optimizer_state = None if sharded else _whole_optimizer_state(engine, writer=part is not None)
    _agree(_attempt(_write_files, engine, staging, client_state or {}, part, parts, optimizer_state),
           what)
    if sharded:
        _agree(_attempt(_write_shards, engine, staging), what)
    hosts = _placement()  # a collective: every rank, before only the writers go on
    comm.barrier()  # every rank's files are on disk before any tag appears
    problem = None
    if part == 0:  # the rank that wrote the shared files commits
        problem = _attempt(_commit, engine, staging, save_dir, tag, save_latest, hosts,
                           None if sharded else parts)
    _agree(problem, what)
    log_rank0("saved checkpoint %s", save_dir / tag)
    return True


def _tag_problem(tag: str) -> str | None:
    if _TAG.fullmatch(tag):
        return None
    return (f"tag '{tag}' is not a valid folder name: use letters, digits and '_.+=-', not starting "
            "with '.' or '-' (the default is global_step<N>)")


def _same_everywhere(value: str, name: str) -> str | None:
    values = _all_gather(value)
    if len(set(values)) > 1:
        return f"{_where()}: the ranks passed different {name}s: {values}; pass the same on every rank"
    return None


def _broadcast_token() -> str:
    token = [secrets.token_hex(4)]
    if comm.get_world_size() > 1 and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(token, src=0)
    return token[0]


def _detect_shared(save_dir: Path, staging: Path, token: str) -> bool:
    """Whether every rank sees rank 0's files in save_dir (one filesystem) or only its own."""
    marker = staging / f".shared-{token}"
    if comm.get_rank() == 0:
        _agree(_attempt(lambda: (staging.mkdir(parents=True), marker.touch())), "save_checkpoint")
    else:
        _agree(None, "save_checkpoint")
    shared = marker.exists()
    if not shared:
        staging.mkdir(parents=True, exist_ok=True)
    return all(_all_gather(shared))


def _my_part(shared: bool, split: bool) -> tuple[int | None, int]:
    """Which part of the shared files this rank writes (None: only its own rank file). On one
    filesystem all ranks share the work when `split` (stage 0), else rank 0 writes them; without
    one, each node's ranks write the node's own full copy (in parts, or its first rank alone)."""
    if shared:
        if split:
            return comm.get_rank(), comm.get_world_size()
        return (0 if comm.get_rank() == 0 else None), 1
    parts = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if split else 1
    local = comm.get_local_rank()
    return (local if local < parts else None), parts


def _whole_optimizer_state(engine, writer: bool) -> dict | None:
    """The optimizer's state dict on the ranks that write it. ZeroRedundancyOptimizer (stage 1)
    holds 1/N of it on each rank: it is consolidated on each writer in turn (a collective)."""
    optimizer = engine.optimizer
    if not hasattr(optimizer, "consolidate_state_dict"):
        return optimizer.state_dict() if writer else None
    state = None
    for rank in _all_gather(comm.get_rank() if writer else None):
        if rank is None:
            continue
        optimizer.consolidate_state_dict(to=rank)
        if rank == comm.get_rank():
            state = optimizer.state_dict()
            optimizer._all_state_dicts = []  # else the whole state stays on this rank after the save
    return state


def _write_files(engine, staging: Path, client_state: dict, part: int | None, parts: int,
                 optimizer_state: dict | None) -> None:
    """client_state, this rank's part of the replicated state (stages 0-1), its rank file."""
    if part == 0:
        _write_atomic(staging / CLIENT_STATE, data=_client_state_bytes(client_state))
    if part is not None and not engine.zero.shards_params:
        shard = split_state(_engine_state(engine, optimizer_state), parts)[part]
        _write_atomic(staging / MODEL_STATES.format(part=part, parts=parts), obj=shard)
    _write_atomic(staging / f"rank{comm.get_rank()}.pt", obj=_rank_state(engine))


def _write_shards(engine, staging: Path) -> None:
    """Stages 2-3: every rank its shards (a collective), then rank 0 the replicated rest."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded

    optimizer_other = checkpoint_sharded.save(engine.module, engine.optimizer, staging / SHARDED_DIR)
    if comm.get_rank() == 0:
        groups = _groups_by_name(engine)
        if groups is None:
            raise CheckpointError("the optimizer steps tensors that are not parameters of the model; a "
                                  "ZeRO stage 2/3 checkpoint stores optimizer state by parameter name")
        rest = _common_state(engine)
        rest["optimizer"] = {"param_groups": groups, "state_other": optimizer_other}
        _write_atomic(staging / ENGINE_STATE, obj=rest)


def split_state(state: dict, parts: int) -> list[dict]:
    """Spread the module's tensors and the optimizer's per-parameter states over `parts` dicts,
    balanced by bytes; part 0 also holds everything else. The same on every rank (replicated state,
    deterministic order), so each rank can write its own part."""
    items = [("module", k, v) for k, v in state["module"].items()]
    items += [("optimizer_state", k, v) for k, v in state["optimizer"]["state"].items()]
    shards = [{"module": {}, "optimizer_state": {}} for _ in range(parts)]
    loads = [0] * parts
    for kind, key, value in sorted(items, key=lambda item: -_nbytes(item[2])):
        lightest = loads.index(min(loads))
        shards[lightest][kind][key] = value
        loads[lightest] += _nbytes(value)
    rest = {k: v for k, v in state.items() if k != "module"}
    rest["optimizer"] = {k: v for k, v in state["optimizer"].items() if k != "state"}
    shards[0].update(rest, module_keys=list(state["module"]))
    return shards


def merge_state(shards: list[dict]) -> dict:
    state = {k: v for k, v in shards[0].items() if k not in ("module", "optimizer_state", "module_keys")}
    module = {k: v for shard in shards for k, v in shard["module"].items()}
    state["module"] = {key: module[key] for key in shards[0]["module_keys"]}
    optimizer_state = {k: v for shard in shards for k, v in shard["optimizer_state"].items()}
    state["optimizer"] = {**state["optimizer"], "state": dict(sorted(optimizer_state.items()))}
    return state


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _client_state_bytes(client_state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"client_state cannot be loaded safely ({str(exc).splitlines()[0][:200]}). Keep it to "
            "tensors, numbers, strings, lists, tuples and dicts.") from None
    return buffer.getvalue()


def _engine_state(engine, optimizer_state: dict) -> dict:
    """Stages 0-1: everything but the rank files, whole."""
    return {
        "module": fp32_module_state(engine),
        "optimizer": optimizer_state,
        "optimizer_param_names": optimizer_param_names(engine),  # to load it at stages 2-3
        **_common_state(engine),
    }


def _common_state(engine) -> dict:
    precision_state = engine.precision.state_dict()
    precision_state.pop("master_params", None)  # the fp32 module carries them, once
    return {
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "precision": precision_state,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "micro_batch_sizes": engine.balancer.sizes if engine.balancer else None,
        "world_size": engine.world_size,
        "zero_stage": engine.zero.stage,
        "config": engine.config.raw,
        "crew_version": __version__,
    }


def optimizer_param_names(engine) -> list[str] | None:
    """The module's name for each tensor the optimizer steps (its fp32 master under fp16/bf16 at
    stages 0-1), in param_groups order; None when one of them is not a module parameter."""
    names = {id(engine.precision.master_of(param)): name
             for name, param in engine.module.named_parameters()}
    found = [names.get(id(param)) for group in engine.optimizer.param_groups for param in group["params"]]
    return None if None in found else found


def _groups_by_name(engine) -> list[dict] | None:
    """The optimizer's param groups with parameter names in place of tensors (None: see
    optimizer_param_names)."""
    names = optimizer_param_names(engine)
    if names is None:
        return None
    position = iter(names)
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": [next(position) for _ in group["params"]]}
            for group in engine.optimizer.param_groups]


def fp32_module_state(engine) -> dict[str, torch.Tensor]:
    """The module's state dict with every parameter as its fp32 master value."""
    masters = {name: engine.precision.master_of(param)
               for name, param in engine.module.named_parameters()}
    state = engine.module.state_dict()
    return {name: (masters[name] if name in masters else value).detach().to(
        torch.float32 if value.is_floating_point() else value.dtype).cpu()
        for name, value in state.items()}


def _rank_state(engine) -> dict:
    np_state = numpy.random.get_state()
    loader = getattr(engine, "training_dataloader", None)
    return {
        "rank": comm.get_rank(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": random.getstate(),
        "numpy_rng": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "dataloader": loader.state_dict() if loader is not None else None,
    }


def _commit(engine, staging: Path, save_dir: Path, tag: str, save_latest: bool,
            hosts: list[str], parts: int | None) -> None:
    """Manifest, rename into place, `latest`, keep_last. `parts`: None for a sharded checkpoint."""
    manifest = {"tag": tag, "world_size": engine.world_size, "global_steps": engine.global_steps,
                "crew_version": __version__, "hosts": hosts, "zero_stage": engine.zero.stage,
                "format": SHARDED if parts is None else REPLICATED}
    if parts is not None:
        manifest["model_states_parts"] = parts
    _write_atomic(staging / MANIFEST, data=json.dumps(manifest, indent=1).encode())
    for marker in staging.glob(".shared-*"):
        marker.unlink()
    if (staging / SHARDED_DIR).is_dir():
        _fsync_dir(staging / SHARDED_DIR)
    _fsync_dir(staging)
    _swap_into_place(staging, save_dir / tag)
    _fsync_dir(save_dir)
    if save_latest:
        _write_atomic(save_dir / "latest", data=tag.encode())
        _fsync_dir(save_dir)
    _remove_stale(save_dir, tag, engine.config.checkpoint.keep_last)


def _placement() -> list[str]:
    return _all_gather(os.environ.get("CREW_HOST") or socket.gethostname())


def _remove_stale(save_dir: Path, current: str, keep_last: int | None) -> None:
    """Leftovers of interrupted saves, and complete tags beyond `keep_last` (never `latest`'s)."""
    for leftover in save_dir.glob(".*.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last is None:
        return
    latest = read_latest(save_dir)
    tags = sorted((p for p in save_dir.iterdir() if (p / MANIFEST).is_file()),
                  key=lambda p: (p / MANIFEST).stat().st_mtime)
    for old in tags[:-keep_last]:
        if old.name not in (current, latest):
            shutil.rmtree(old, ignore_errors=True)
            log_rank0("keep_last %d: removed checkpoint %s", keep_last, old)


# -- load ---------------------------------------------------------------------------------------

def read_latest(load_dir: Path) -> str | None:
    try:
        return (Path(load_dir) / "latest").read_text().strip() or None
    except OSError:
        return None


def load(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
         load_lr_scheduler_states=True, load_module_only=False):
    load_dir = Path(load_dir).absolute()
    tag = str(tag) if tag is not None else _agreed_latest(load_dir)
    if tag is None:
        log_rank0("no checkpoint to load: %s has no 'latest' file (pass tag= to choose one)", load_dir)
        return None, None
    _agree(_same_everywhere(tag, "tag"), f"load_checkpoint({load_dir})")
    folder = load_dir / str(tag)
    what = f"load_checkpoint({load_dir}, tag={tag})"
    optimizer = load_optimizer_states and not load_module_only
    states: dict = {}
    _agree(_attempt(_read_all, engine, folder, states, optimizer), what)
    _agree(_attempt(_check_fits, engine, states, folder, load_module_strict), what)
    if optimizer:
        _agree(_attempt(_prepare_optimizer_state, engine, states, folder), what)
    # every rank gets here or none: the sharded load below is a collective
    _agree(_attempt(_load_weights, engine, states, folder, load_module_strict, optimizer,
                    load_module_only), what)
    _load_the_rest(engine, states, load_lr_scheduler_states and not load_module_only, load_module_only)
    log_rank0("loaded checkpoint %s (global step %d)", folder, engine.global_steps)
    return str(folder), states["client"]


def _agreed_latest(load_dir: Path) -> str | None:
    """The tag `latest` names, the same on every rank; nodes that disagree fail every rank."""
    seen = _all_gather((read_latest(load_dir), _where()))
    tags = {tag for tag, _ in seen}
    if len(tags) > 1:
        listed = "; ".join(f"{where}: {tag or 'no latest file'}" for tag, where in seen)
        raise CheckpointError(
            f"load_checkpoint({load_dir}): the ranks see different 'latest' tags ({listed}). The "
            "save dir is not shared between nodes and the nodes' copies differ: copy the newest "
            "checkpoint to every node, or pass tag= with one that every node has.")
    return tags.pop()


def _read_manifest(folder: Path) -> dict:
    manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else {}
    manifest.setdefault("format", REPLICATED)  # checkpoints from before ZeRO stages 1-3
    manifest.setdefault("zero_stage", 0)
    if manifest["format"] not in (REPLICATED, SHARDED):
        raise CheckpointError(f"{folder / MANIFEST}: unknown checkpoint format "
                              f"{manifest['format']!r}; it was written by a newer crew, upgrade crew")
    return manifest


def _read_all(engine, folder: Path, states: dict, optimizer: bool) -> None:
    if not folder.is_dir():
        raise CheckpointError(_missing_tag_message(folder))
    manifest = _read_manifest(folder)
    sharded = manifest["format"] == SHARDED
    names = [MANIFEST, CLIENT_STATE]
    names += [ENGINE_STATE, f"{SHARDED_DIR}/.metadata"] if sharded else _model_state_files(manifest)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{folder} lacks {', '.join(missing)}: on a node without a shared filesystem, the save "
            "dir holds only what that node's ranks wrote; load on the same placement, or share it")
    states["manifest"] = manifest
    states["model"] = _read(folder / ENGINE_STATE) if sharded else read_model_states(folder, manifest)
    if sharded:
        _read_shards(engine, folder / SHARDED_DIR, states, optimizer)
    else:
        states["shapes"] = {name: tuple(value.shape) for name, value in states["model"]["module"].items()}
    states["client"] = _read(folder / CLIENT_STATE)
    rank_file = folder / f"rank{comm.get_rank()}.pt"
    same_world = manifest.get("world_size") == comm.get_world_size()
    if same_world and not rank_file.is_file():
        saved_on = manifest.get("hosts", [])[comm.get_rank()] if manifest.get("hosts") else "?"
        raise CheckpointError(
            f"{rank_file} is missing (rank {comm.get_rank()} was saved on {saved_on}): the save dir "
            "is not shared between nodes; load with the same ranks on the same hosts, or copy it")
    states["rank"] = _read(rank_file) if same_world else None


def _read_shards(engine, folder: Path, states: dict, optimizer: bool) -> None:
    """A sharded checkpoint: only its shapes for a sharded engine (which reads its own pieces
    later), everything, whole, for an engine at stage 0-1."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded

    if engine.zero.shards_params:
        states["shapes"] = checkpoint_sharded.saved_module_shapes(folder)
        return
    module, optimizer_tensors = checkpoint_sharded.read_full(folder, with_optimizer=optimizer)
    states["model"]["module"] = module
    states["model"]["optimizer"]["state_tensors"] = optimizer_tensors
    states["shapes"] = {name: tuple(value.shape) for name, value in module.items()}


def _model_state_files(manifest: dict) -> list[str]:
    parts = manifest.get("model_states_parts", 1)
    return [MODEL_STATES.format(part=part, parts=parts) for part in range(parts)]


def read_model_states(folder: Path, manifest: dict) -> dict:
    return merge_state([_read(folder / name) for name in _model_state_files(manifest)])


def _missing_tag_message(folder: Path) -> str:
    available = sorted(p.name for p in folder.parent.glob("*") if (p / MANIFEST).is_file())
    listed = ", ".join(available) if available else "none"
    return (f"checkpoint tag '{folder.name}' not found in {folder.parent} (complete tags there: "
            f"{listed}); if other ranks found it, the save dir is not shared between nodes")


def _check_fits(engine, states: dict, folder: Path, strict: bool) -> None:
    sharded = states["manifest"]["format"] == SHARDED
    path = folder / (SHARDED_DIR if sharded else "model_states.*")
    expected = {name: tuple(value.shape) for name, value in engine.module.state_dict().items()}
    saved = states["shapes"]
    differ = [f"{name}: saved {shape}, model {expected[name]}"
              for name, shape in saved.items() if name in expected and shape != expected[name]]
    if differ:
        raise CheckpointError(f"{path} does not fit this model: " + "; ".join(differ[:5]))
    if strict:
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"{path} does not fit this model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]} (load_module_strict=False loads the keys that match)")


def _prepare_optimizer_state(engine, states: dict, folder: Path) -> None:
    """states["optimizer"]: the saved optimizer state in the form this engine loads. Between stages
    0-1 (by index) and 2-3 (by parameter name) it is converted by parameter name."""
    saved, manifest = states["model"], states["manifest"]
    by_name = manifest["format"] == SHARDED
    if engine.zero.shards_params == by_name:
        states["optimizer"] = saved["optimizer"]
        return
    if by_name:  # a sharded checkpoint into a stage 0-1 engine
        whole = {"state": merge_by_name(saved["optimizer"]["state_tensors"], saved["optimizer"]["state_other"]),
                 "param_groups": saved["optimizer"]["param_groups"]}
        states["optimizer"] = _by_index(whole, folder, manifest, engine)
    else:  # a stage 0-1 checkpoint into a sharded engine
        states["optimizer"] = _by_name(saved["optimizer"], saved.get("optimizer_param_names"),
                                       folder, manifest, engine)
    log_rank0("%s was saved at ZeRO stage %d; loading it at stage %d: optimizer state matched by "
              "parameter name", folder, manifest["zero_stage"], engine.zero.stage)


def merge_by_name(first: dict, second: dict) -> dict:
    """Two {name: {key: value}} dicts (optimizer state by parameter name) as one."""
    return {name: {**first.get(name, {}), **second.get(name, {})}
            for name in list(first) + [name for name in second if name not in first]}


def _cross_stage_error(folder: Path, manifest: dict, engine, reason: str) -> CheckpointError:
    saved_stage, stage = manifest["zero_stage"], engine.zero.stage
    return CheckpointError(
        f"{folder} was saved at ZeRO stage {saved_stage} and this engine runs stage {stage}, but "
        f"the optimizer state cannot be matched by parameter name: {reason}. Load it at stage "
        f"{saved_stage}, or take the weights only: load_checkpoint(..., load_optimizer_states=False), "
        "or `crew export` it and load the file with model.load_state_dict.")


def _by_name(state: dict, names: list[str] | None, folder: Path, manifest: dict, engine) -> dict:
    """An optimizer state dict by index (stages 0-1) -> by parameter name."""
    if names is None:
        raise _cross_stage_error(folder, manifest, engine, "the checkpoint has no parameter names "
                                 "(saved by an older crew, or an optimizer over tensors outside the model)")
    return {"state": {names[index]: value for index, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                             for group in state["param_groups"]]}


def _by_index(state: dict, folder: Path, manifest: dict, engine) -> dict:
    """An optimizer state dict by parameter name -> by index, for this engine's optimizer, whose
    param groups must hold the same parameters in the same order (load_state_dict matches by
    position)."""
    mine = _groups_by_name(engine)
    if mine is None:
        raise _cross_stage_error(folder, manifest, engine, "this engine's optimizer steps tensors "
                                 "that are not parameters of the model")
    groups = [group["params"] for group in mine]
    saved_groups = [group["params"] for group in state["param_groups"]]
    if saved_groups != groups:
        raise _cross_stage_error(folder, manifest, engine, f"the saved param groups {saved_groups} "
                                 f"differ from this optimizer's {groups}")
    index = {name: i for i, name in enumerate(name for group in groups for name in group)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


@torch.no_grad()
def _load_weights(engine, states: dict, folder: Path, strict: bool, optimizer: bool,
                  module_only: bool) -> None:
    """Module, precision and (when `optimizer`) optimizer state; a collective at stages 2-3."""
    saved = states["model"]
    optimizer_state = states["optimizer"] if optimizer else None
    if engine.zero.shards_params:
        from crew.runtime.checkpoint import sharded as checkpoint_sharded

        if states["manifest"]["format"] == SHARDED:
            checkpoint_sharded.load(engine.module, engine.optimizer, folder / SHARDED_DIR, strict,
                                    optimizer_state)
        else:
            checkpoint_sharded.load_full(engine.module, engine.optimizer, saved["module"],
                                         optimizer_state, strict)
    else:
        engine.module.load_state_dict(saved["module"], strict=strict)
    if not module_only:
        engine.precision.load_state_dict(saved["precision"])
    if engine.zero.shards_params:
        return  # the sharded fp32 parameters are the master weights
    for name, param in engine.module.named_parameters():
        if name in saved["module"]:
            engine.precision.master_of(param).copy_(saved["module"][name])
    if optimizer_state is not None:
        engine.optimizer.load_state_dict(optimizer_state)


def _load_the_rest(engine, states: dict, scheduler: bool, module_only: bool) -> None:
    saved = states["model"]
    if scheduler and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if module_only:
        return
    engine.global_steps = saved["global_steps"]
    engine.global_samples = saved["global_samples"]
    engine.micro_steps = saved["micro_steps"]
    if engine.balancer is not None:  # before the loader's position: that is counted in micro steps
        engine.balancer.restore(saved.get("micro_batch_sizes"))
    if states["rank"] is None:
        log_rank0("checkpoint was saved on %d ranks, this run has %d: model, optimizer and "
                  "scheduler are loaded; per-rank RNG and data positions start fresh",
                  saved["world_size"], comm.get_world_size())
        return
    _restore_rank_state(engine, states["rank"])


def _restore_rank_state(engine, state: dict) -> None:
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    random.setstate(_as_tuples(state["python_rng"]))
    kind, keys, *rest = state["numpy_rng"]
    numpy.random.set_state((kind, keys.numpy(), *rest))
    loader = getattr(engine, "training_dataloader", None)
    if loader is not None and state["dataloader"] is not None:
        loader.load_state_dict(state["dataloader"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# -- export -------------------------------------------------------------------------------------

def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
    """Rank 0 writes the module's weights in its training dtype (16-bit under fp16/bf16); at
    stages 2-3 they are gathered from the shards first (a collective)."""
    gathered = None
    if engine.zero.shards_params:
        from crew.runtime.checkpoint import sharded as checkpoint_sharded

        gathered = checkpoint_sharded.full_module_state(engine.module)
    problem = None
    if comm.get_rank() == 0:
        dtype = engine.precision.dtype
        state = {name: value.to(dtype) if value.is_floating_point() else value
                 for name, value in (gathered if gathered is not None else fp32_module_state(engine)).items()}
        problem = _attempt(write_state_dict, state, Path(save_dir) / save_filename)
    _agree(problem, f"save_16bit_model({save_dir}, {save_filename})")
    return True


def write_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".safetensors":
        _write_atomic(path, obj=state)
        return
    try:
        from safetensors.torch import save as to_safetensors
    except ImportError:
        raise CheckpointError(f"{path}: writing .safetensors needs the safetensors package: "
                              "pip install 'crew[safetensors]' (or use a .bin/.pt name)") from None
    _write_atomic(path, data=to_safetensors({k: v.contiguous() for k, v in state.items()}))


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """`crew export`: a save dir (its `latest`) or a tag folder -> one fp32 state dict file. A
    sharded checkpoint (stages 2-3) is consolidated here, in this one process."""
    folder = Path(checkpoint)
    if not (folder / MANIFEST).is_file():
        tag = read_latest(folder)
        if tag is None:
            raise CheckpointError(f"{folder} is neither a checkpoint tag folder (no {MANIFEST}) "
                                  "nor a save dir with a 'latest' file")
        folder = folder / tag
    manifest = _read_manifest(folder)
    if manifest["format"] == SHARDED:
        from crew.runtime.checkpoint import sharded as checkpoint_sharded

        module, _ = checkpoint_sharded.read_full(folder / SHARDED_DIR)
    else:
        module = read_model_states(folder, manifest)["module"]
    write_state_dict({name: value.float() if value.is_floating_point() else value
                      for name, value in module.items()}, Path(out))
    return folder
