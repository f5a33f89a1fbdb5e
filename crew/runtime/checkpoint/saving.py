"""save: every rank writes its files into a staging folder, then one rank commits the tag (manifest,
rename into place, `latest`, keep_last)."""

from __future__ import annotations

import io
import json
import os
import random
import secrets
import shutil
import socket
from pathlib import Path

import numpy
import torch

from crew import __version__, outputs
from crew.log import log_rank0, warn_once
from crew.runtime import comm
from crew.runtime.checkpoint import deepspeed_writing, tensor_parallel
from crew.runtime.checkpoint.collective import agree, all_gather, attempt, same_everywhere
from crew.runtime.checkpoint.deepspeed_files import MODEL_STATES as DEEPSPEED_MODEL_STATES
from crew.runtime.checkpoint.deepspeed_files import ZERO3_MODEL_STATES
from crew.runtime.checkpoint.layout import (
    CLIENT_STATE,
    CREW_STATE,
    DEEPSPEED_LAYOUT,
    ENGINE_STATE,
    MANIFEST,
    MODEL_STATES,
    REPLICATED,
    SHARDED,
    SHARDED_DIR,
    TAG,
    CheckpointError,
    fsync_dir,
    read_latest,
    swap_into_place,
    write_atomic,
)
from crew.runtime.checkpoint.state import (
    fp32_module_state,
    gathered_masters,
    groups_by_name,
    optimizer_param_names,
    split_state,
)


def default_tag(engine) -> str:
    return f"global_step{engine.global_steps}"


def save(engine, save_dir: str | os.PathLike, tag: str | None = None,
         client_state: dict | None = None, save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    save_dir = Path(save_dir).absolute()
    tag = str(tag) if tag is not None else default_tag(engine)
    if engine.grads_pending:
        warn_once("save_checkpoint in the middle of gradient accumulation: the gradients of the "
                  "micro steps since the last optimizer step are not saved, so a resume repeats "
                  "them. Save right after the engine.step() that ends an accumulation.")
    agree(_tag_problem(tag), "save_checkpoint")
    agree(same_everywhere(tag, "tag"), "save_checkpoint")
    token = _broadcast_token()
    staging = save_dir / f".{tag}.partial-{token}"
    try:
        _save_staged(engine, save_dir, staging, token, tag, client_state, save_latest, exclude_frozen_parameters)
    except CheckpointError:
        # a failed save is one CheckpointError on every rank, once all have stopped: each removes its
        # view of the staging folder, so that a full disk is not left fuller; the previous tag and
        # `latest` were not touched. Anything else (an interrupt, a timeout) may have hit one rank
        # while another commits: its staging folder is left to the next save (_remove_stale).
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log_rank0("saved checkpoint %s", save_dir / tag)
    if comm.get_rank() == 0:
        outputs.report("checkpoint", save_dir, tag=str(tag))
    if engine.zero.stage >= 1 and comm.get_rank() == 0:
        _write_recovery_script(save_dir)
    return True


# DeepSpeed copies its zero_to_fp32.py beside the tags (stages 1-3); HF's docs tell users to run it.
RECOVERY_SCRIPT = """#!/usr/bin/env python
# Written by crew's save_checkpoint, where DeepSpeed writes its zero_to_fp32.py: the fp32 weights of the
# checkpoint in this folder (the tag in `latest`, or -t TAG) as OUTPUT_DIR/pytorch_model.bin (shards past
# --max_shard_size, model.safetensors with --safe_serialization), as DeepSpeed's script, e.g.
#     python zero_to_fp32.py . OUTPUT_DIR
# With crew installed it is `python -m crew.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`; without
# it, DeepSpeed's own (`python -m deepspeed.utils.zero_to_fp32`), which reads this folder too.
import importlib.util
import runpy

crew = importlib.util.find_spec("crew") is not None
runpy.run_module("crew.deepspeed.utils.zero_to_fp32" if crew else "deepspeed.utils.zero_to_fp32", run_name="__main__")
"""


def _write_recovery_script(save_dir: Path) -> None:
    path = save_dir / "zero_to_fp32.py"
    try:
        if not path.is_file() or path.read_text() != RECOVERY_SCRIPT:
            temporary = save_dir / f".zero_to_fp32.py.{secrets.token_hex(4)}"
            temporary.write_text(RECOVERY_SCRIPT)
            temporary.chmod(0o755)
            os.replace(temporary, path)
    except OSError as exc:  # the checkpoint itself is complete: only the convenience script is missing
        warn_once(f"save_checkpoint: could not write {path} ({exc}); convert with "
                  "`python -m crew.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT` instead")


def _save_staged(engine, save_dir: Path, staging: Path, token: str, tag: str,
                 client_state: dict | None, save_latest: bool, exclude_frozen: bool = False) -> None:
    shared = _detect_shared(save_dir, staging, token)
    what = f"save_checkpoint({save_dir}, tag={tag})"
    layout = _layout(engine)
    sharded = layout == SHARDED
    if engine.zero.shards_params and not shared:
        shutil.rmtree(staging, ignore_errors=True)  # each node's own, holding only the marker
        raise CheckpointError(
            f"{what}: a ZeRO stage 3 checkpoint is written by every rank, each its own partition, into one "
            f"tag folder; save_dir must be on a filesystem every node shares, and {save_dir} is not (each node sees "
            "only its own files there). Point save_dir at a shared filesystem (NFS, Lustre, ...).")
    if engine.zero.shards_params and engine.optimizer is None:
        raise CheckpointError(f"{what}: a model-only engine (no optimizer) cannot save a ZeRO stage 3 checkpoint "
                              "yet. Save its weights with engine.save_16bit_model(save_dir) instead.")
    whole = not engine.zero.shards_params  # stage 3 writes each rank's partition, whole state nowhere
    if tensor_parallel.size() > 1:  # each TP rank's first data-parallel rank writes that TP rank's files
        tensor_parallel.check_save(engine, shared, what)
        part, parts = (0 if tensor_parallel.data_parallel_rank() == 0 else None), 1
        optimizer_state = tensor_parallel.column_optimizer_state(engine, writer=part is not None) if whole else None
    else:
        part, parts = _my_part(shared, split=layout == REPLICATED and engine.zero.stage == 0)
        optimizer_state = _whole_optimizer_state(engine, writer=part is not None) if whole else None
    masters = gathered_masters(engine, keep=part is not None) if whole else None  # stage 2: a collective
    written: dict[str, dict] = {}  # path in the tag -> size and checksum, of this rank's files
    write = _write_deepspeed_files if layout == DEEPSPEED_LAYOUT else _write_files
    agree(attempt(write, engine, staging, client_state or {}, part, parts, optimizer_state,
                  written, exclude_frozen, masters), what)
    if sharded:
        agree(attempt(_write_shards, engine, staging, written, exclude_frozen), what)
    hosts = _placement()  # collectives: every rank, before only the writers go on
    every_rank_wrote = all_gather(written)
    comm.barrier()  # every rank's files are on disk before any tag appears
    problem = None
    if part == 0 and tensor_parallel.rank() == 0:  # the rank that wrote the shared files commits
        problem = attempt(lambda: _commit(engine, staging, save_dir, tag, save_latest, hosts, layout, parts,
                                          _files_here(staging, every_rank_wrote)))
    agree(problem, what)


def _layout(engine) -> str:
    """DeepSpeed's files (deepspeed_writing.py, deepspeed_zero3.py), but crew 0.1's layout where crew does not
    write DeepSpeed's: an optimizer that steps tensors which are not the model's parameters (DeepSpeed's files
    name them)."""
    if engine.zero.shards_params and (engine.optimizer is None or optimizer_param_names(engine) is None):
        return SHARDED  # refused below (no optimizer), or stepping tensors outside the model
    if engine.optimizer is not None and optimizer_param_names(engine) is None:
        if tensor_parallel.size() > 1:
            raise CheckpointError("save_checkpoint under tensor parallelism: the optimizer steps tensors that are "
                                  "not parameters of the model, which DeepSpeed's files cannot name; build it over "
                                  "the model's parameters")
        return REPLICATED
    return DEEPSPEED_LAYOUT


def _tag_problem(tag: str) -> str | None:
    if TAG.fullmatch(tag):
        return None
    return (f"tag '{tag}' is not a valid folder name: use letters, digits and '_.+=-', not starting "
            "with '.' or '-' (the default is global_step<N>)")


def _broadcast_token() -> str:
    token = [secrets.token_hex(4)]
    if comm.get_world_size() > 1 and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(token, src=0)
    return token[0]


def _detect_shared(save_dir: Path, staging: Path, token: str) -> bool:
    """Whether every rank sees rank 0's files in save_dir (one filesystem) or only its own."""
    marker = staging / f".shared-{token}"
    if comm.get_rank() == 0:
        agree(attempt(lambda: (staging.mkdir(parents=True), marker.touch())), "save_checkpoint")
    else:
        agree(None, "save_checkpoint")
    shared = marker.exists()
    if not shared:
        staging.mkdir(parents=True, exist_ok=True)
    return all(all_gather(shared))


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
    if optimizer is None:  # a model-only engine (initialize without an optimizer): nothing to save
        return {"state": {}, "param_groups": []} if writer else None
    if not hasattr(optimizer, "consolidate_state_dict"):
        return optimizer.state_dict() if writer else None
    state = None
    for rank in all_gather(comm.get_rank() if writer else None):
        if rank is None:
            continue
        optimizer.consolidate_state_dict(to=rank)
        if rank == comm.get_rank():
            state = optimizer.state_dict()
            optimizer._all_state_dicts = []  # else the whole state stays on this rank after the save
    return state


def _write_files(engine, staging: Path, client_state: dict, part: int | None, parts: int,
                 optimizer_state: dict | None, written: dict, exclude_frozen: bool = False,
                 masters: dict | None = None) -> None:
    """client_state, this rank's part of the replicated state (stages 0-2), its rank file."""
    if part == 0:
        written[CLIENT_STATE] = write_atomic(staging / CLIENT_STATE, data=_client_state_bytes(client_state))
    if part is not None and not engine.zero.shards_params:
        shard = split_state(_engine_state(engine, optimizer_state, exclude_frozen, masters), parts)[part]
        name = MODEL_STATES.format(part=part, parts=parts)
        written[name] = write_atomic(staging / name, obj=shard)
    name = f"rank{comm.get_rank()}.pt"
    written[name] = write_atomic(staging / name, obj=_rank_state(engine))


def _write_deepspeed_files(engine, staging: Path, client_state: dict, part: int | None, parts: int,
                           optimizer_state: dict | None, written: dict, exclude_frozen: bool = False,
                           masters: dict | None = None) -> None:
    """DeepSpeed's files and crew's own beside them (crew_state.pt). Stages 0-2: the writer (rank 0, or each
    node's first rank without a shared filesystem: then every node has every file a load there reads) writes
    them all; stage 3: every rank its own model and optimizer states (deepspeed_zero3.py, collectives). Each
    rank its rank file."""
    names = optimizer_param_names(engine)
    if engine.zero.shards_params:
        _write_zero3_files(engine, staging, client_state, written, exclude_frozen)
    if part is not None and tensor_parallel.rank() == 0:
        _client_state_bytes(client_state)  # the same check as crew's own layout: weights_only loadable
        extras = {**_common_state(engine), "optimizer_param_names": names, "client_keys": list(client_state),
                  "client_shadowed": {key: value for key, value in client_state.items()
                                      if key in deepspeed_writing.ENGINE_KEYS}}
        if engine.optimizer is not None and engine.optimizer.param_groups:
            # what DeepSpeed's files cannot say as crew has it: its groups, each parameter's own step
            extras["optimizer_groups"] = groups_by_name(engine)
            extras["optimizer_steps"] = _steps(engine, names, optimizer_state)
        if tensor_parallel.size() > 1:
            extras["tensor_parallel"] = {"size": tensor_parallel.size(), "dims": tensor_parallel.dims(engine.module)}
        written[CREW_STATE] = write_atomic(staging / CREW_STATE, obj=extras)
    if part is not None and not engine.zero.shards_params:
        fp32 = fp32_module_state(engine, masters)
        if engine.optimizer is None or not optimizer_state["param_groups"]:
            optimizer_state = names = None  # a model-only engine: DeepSpeed saves no optimizer either
        else:
            optimizer_state = deepspeed_writing.as_deepspeeds(
                engine, deepspeed_writing.kept_by_deepspeed(engine, optimizer_state, names))
        model = deepspeed_writing.model_states(engine, fp32, optimizer_state, names, exclude_frozen, client_state)
        if tensor_parallel.size() > 1:  # before client_state's keys, as DeepSpeed's _save_checkpoint
            model = deepspeed_writing.with_universal_info(model, tensor_parallel.universal_info(engine.module))
        name = tensor_parallel.model_file() if tensor_parallel.size() > 1 else DEEPSPEED_MODEL_STATES
        written[name] = write_atomic(staging / name, obj=model)
        if engine.zero.stage >= 1 and optimizer_state is not None:
            for rank, content in enumerate(deepspeed_writing.optim_states(engine, fp32, optimizer_state, names)):
                name = deepspeed_writing.optim_file(rank, engine.precision.dtype == torch.bfloat16,
                                                    tensor_parallel.rank())
                written[name] = write_atomic(staging / name, obj=content,
                                             pickle_module=deepspeed_writing.DEEPSPEED_PICKLE)
    name = f"rank{comm.get_rank()}.pt"
    written[name] = write_atomic(staging / name, obj=_rank_state(engine))


def _write_zero3_files(engine, staging: Path, client_state: dict, written: dict, exclude_frozen: bool) -> None:
    """Stage 3: this rank's zero_pp_rank_<R>_mp_rank_<t>_model_states.pt and optimizer file (collectives); R is
    the rank (under AutoTP the data-parallel rank), t the TP rank."""
    from crew.runtime.checkpoint import deepspeed_zero3

    rank, mp = tensor_parallel.zero3_ranks()
    model = {**deepspeed_zero3.zero3_model_states(engine, exclude_frozen), "optimizer": None,
             **deepspeed_writing.common_keys(engine, client_state)}
    if tensor_parallel.size() > 1:  # as DeepSpeed's _save_checkpoint: before client_state's keys
        model = deepspeed_writing.with_universal_info(model, tensor_parallel.universal_info(engine.module))
    name = ZERO3_MODEL_STATES.format(rank=rank).replace("mp_rank_00", f"mp_rank_{mp:02d}")
    written[name] = write_atomic(staging / name, obj=model)
    name = deepspeed_writing.optim_file(rank, engine.precision.dtype == torch.bfloat16, mp)
    written[name] = write_atomic(staging / name, obj=deepspeed_zero3.zero3_optim_states(engine),
                                 pickle_module=deepspeed_writing.DEEPSPEED_PICKLE)


def _steps(engine, names: list[str] | None, optimizer_state: dict | None) -> dict:
    """Each optimized parameter's own `step`, by name, as crew's optimizer holds it (int or tensor): from the
    whole state dict (stages 0-2), or the optimizer's own state (stage 3: each step is on every rank)."""
    if names is None:
        return {}
    if optimizer_state is not None:
        entries = optimizer_state["state"]
    else:
        params = [param for group in engine.optimizer.param_groups for param in group["params"]]
        entries = {index: engine.optimizer.state.get(param, {}) for index, param in enumerate(params)}
    return {names[index]: entry["step"].detach().clone().cpu() if isinstance(entry["step"], torch.Tensor)
            else entry["step"] for index, entry in entries.items() if "step" in entry}


def _write_shards(engine, staging: Path, written: dict, exclude_frozen: bool) -> None:
    """Stage 3: every rank its shards (a collective), then rank 0 the replicated rest."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded  # DCP: only stage 3 pays its import
    shards: dict[str, dict] = {}
    optimizer_other = checkpoint_sharded.save(engine.module, engine.optimizer, staging / SHARDED_DIR, shards,
                                              exclude_frozen)
    written.update({f"{SHARDED_DIR}/{name}": entry for name, entry in shards.items()})
    if comm.get_rank() == 0:
        groups = groups_by_name(engine)
        if groups is None:
            raise CheckpointError("the optimizer steps tensors that are not parameters of the model; a "
                                  "ZeRO stage 3 checkpoint stores optimizer state by parameter name")
        rest = _common_state(engine)
        rest["optimizer"] = {"param_groups": groups, "state_other": optimizer_other}
        written[ENGINE_STATE] = write_atomic(staging / ENGINE_STATE, obj=rest)


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


def _engine_state(engine, optimizer_state: dict, exclude_frozen: bool = False, masters: dict | None = None) -> dict:
    """Stages 0-2: everything but the rank files, whole. `exclude_frozen`: without the parameters that do
    not require grad (DeepSpeed's exclude_frozen_parameters; buffers stay). `masters`: stage 2's fp32
    masters gathered from their owners."""
    module = fp32_module_state(engine, masters)
    if exclude_frozen:
        frozen = {name for name, param in engine.module.named_parameters() if not param.requires_grad}
        module = {name: value for name, value in module.items() if name not in frozen}
    return {
        "module": module,
        "optimizer": optimizer_state,
        "optimizer_param_names": optimizer_param_names(engine),  # to load it at stage 3
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
        "boundary_override": engine._boundary_override,
        "micro_batch_sizes": engine.balancer.sizes if engine.balancer else None,
        "world_size": engine.world_size,
        "zero_stage": engine.zero.stage,
        "config": engine.crew_config.raw,
        "crew_version": __version__,
    }


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


def _files_here(staging: Path, every_rank_wrote: list[dict]) -> dict:
    """The manifest's "files": what the ranks that share this staging folder wrote (their rank
    file is here; without a shared filesystem, this node's ranks), and every rank's rank file, so
    that one copied over from another node checks too."""
    files = {}
    for rank, written in enumerate(every_rank_wrote):
        shares = (staging / f"rank{rank}.pt").is_file()
        files.update({name: entry for name, entry in written.items() if shares or name == f"rank{rank}.pt"})
    return dict(sorted(files.items()))


def _commit(engine, staging: Path, save_dir: Path, tag: str, save_latest: bool,
            hosts: list[str], layout: str, parts: int, files: dict) -> None:
    """Manifest, rename into place, `latest`, keep_last."""
    manifest = {"tag": tag, "world_size": engine.world_size, "global_steps": engine.global_steps,
                "crew_version": __version__, "hosts": hosts, "zero_stage": engine.zero.stage,
                "format": layout}
    if layout == REPLICATED:
        manifest["model_states_parts"] = parts
    if tensor_parallel.size() > 1:
        manifest["tensor_parallel_size"] = tensor_parallel.size()
    manifest["files"] = files
    write_atomic(staging / MANIFEST, data=json.dumps(manifest, indent=1).encode())
    for marker in staging.glob(".shared-*"):
        marker.unlink()
    if (staging / SHARDED_DIR).is_dir():
        fsync_dir(staging / SHARDED_DIR)
    fsync_dir(staging)
    swap_into_place(staging, save_dir / tag)
    fsync_dir(save_dir)
    if save_latest:
        write_atomic(save_dir / "latest", data=tag.encode())
        fsync_dir(save_dir)
    _remove_stale(save_dir, tag, engine.crew_config.checkpoint.keep_last)


def _placement() -> list[str]:
    return all_gather(os.environ.get("CREW_HOST") or socket.gethostname())


def _remove_stale(save_dir: Path, current: str, keep_last: int | None) -> None:
    """Leftovers of interrupted saves, and complete tags beyond `keep_last` (never `latest`'s)."""
    for leftover in save_dir.glob(".*.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last is None:
        return
    try:
        latest = read_latest(save_dir)
    except CheckpointError:  # damaged (save_latest=False): it names no tag to spare
        latest = None
    tags = sorted((p for p in save_dir.iterdir() if (p / MANIFEST).is_file()),
                  key=lambda p: (p / MANIFEST).stat().st_mtime)
    for old in tags[:-keep_last]:
        if old.name not in (current, latest):
            shutil.rmtree(old, ignore_errors=True)
            log_rank0("keep_last %d: removed checkpoint %s", keep_last, old)
