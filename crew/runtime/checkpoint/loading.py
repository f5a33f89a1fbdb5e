"""load: every rank reads the tag, checks that it fits the model, converts the optimizer state
between ZeRO stages (by parameter name) and loads it into the engine."""

from __future__ import annotations

import random
from pathlib import Path

import numpy
import torch

from crew.log import log_rank0, logger
from crew.runtime import comm
from crew.runtime.checkpoint import deepspeed_format, tensor_parallel
from crew.runtime.checkpoint.collective import agree, all_gather, attempt, same_everywhere, where
from crew.runtime.checkpoint.deepspeed_files import is_deepspeed_tag
from crew.runtime.checkpoint.integrity import Verifier, identity, share_out
from crew.runtime.checkpoint.layout import (
    CLIENT_STATE,
    CREW_STATE,
    DEEPSPEED_LAYOUT,
    ENGINE_STATE,
    MANIFEST,
    SHARDED,
    SHARDED_DIR,
    CheckpointError,
    model_state_files,
    other_tags,
    read,
    read_latest,
    read_manifest,
    read_model_states,
)
from crew.runtime.checkpoint.state import groups_by_name, merge_by_name
from crew.runtime.zero.stage3 import shards_visible


def load(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
         load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    load_dir = Path(load_dir).absolute()
    from_latest = tag is None
    tag = str(tag) if tag is not None else _agreed_latest(load_dir)
    if tag is None:  # as DeepSpeed: a warning, nothing loaded
        if comm.get_rank() == 0:
            logger.warning("no checkpoint to load: %s has no 'latest' file (pass tag= to choose one)",
                           load_dir)
        return None, None
    agree(same_everywhere(tag, "tag"), f"load_checkpoint({load_dir})")
    folder = load_dir / str(tag)
    what = f"load_checkpoint({load_dir}, tag={tag})"
    optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    states: dict = {}
    # a DeepSpeed 0.19 checkpoint (not crew's in its layout): read into the same states (deepspeed_format.py)
    if is_deepspeed_tag(folder) and not (folder / CREW_STATE).is_file():
        agree(attempt(deepspeed_format.read_for_load, engine, folder, states, load_optimizer_states,
                      load_lr_scheduler_states, load_module_only), what)
    else:
        agree(attempt(_locate, engine, folder, states, from_latest), what)
        agree(attempt(_verify, states, share_out(states.get("identities", []))), what)
        agree(attempt(_read_all, engine, folder, states, optimizer, load_optimizer_states,
                      load_lr_scheduler_states, load_module_only), what)
    agree(attempt(_check_fits, engine, states, folder, load_module_strict), what)
    if optimizer:
        agree(attempt(_prepare_optimizer_state, engine, states, folder), what)
    # every rank gets here or none: the sharded load below is a collective
    agree(attempt(_load_weights, engine, states, folder, load_module_strict, optimizer,
                  load_module_only, custom_load_fn), what)
    _load_the_rest(engine, states, load_lr_scheduler_states and not load_module_only, load_module_only)
    log_rank0("loaded checkpoint %s (global step %d)", folder, engine.global_steps)
    if getattr(engine, "training_dataloader", None) is not None and states["rank"] is not None \
            and not load_module_only:
        log_rank0(_data_position_line(engine.crew_config.checkpoint.resume_data_position))
    return str(folder), states["client"]


def _data_position_line(resume: bool) -> str:
    if resume:
        return ("data loader: resumes where the checkpoint stopped (checkpoint.resume_data_position); "
                "a script that skips the batches it consumed must not also do so now")
    return ("data loader: starts its epoch from the beginning, as DeepSpeed's does, for the script to skip "
            "what it consumed; \"checkpoint\": {\"resume_data_position\": true} makes crew resume it instead")


def _agreed_latest(load_dir: Path) -> str | None:
    """The tag `latest` names, the same on every rank; a damaged `latest`, or nodes that disagree,
    fail every rank."""
    found: list = []
    agree(attempt(lambda: found.append(read_latest(load_dir))), f"load_checkpoint({load_dir})")
    seen = all_gather((found[0], where()))
    tags = {tag for tag, _ in seen}
    if len(tags) > 1:
        listed = "; ".join(f"{where}: {tag or 'no latest file'}" for tag, where in seen)
        raise CheckpointError(
            f"load_checkpoint({load_dir}): the ranks see different 'latest' tags ({listed}). The "
            "save dir is not shared between nodes and the nodes' copies differ: copy the newest "
            "checkpoint to every node, or pass tag= with one that every node has.")
    return tags.pop()


def _locate(engine, folder: Path, states: dict, from_latest: bool) -> None:
    """The manifest, and the files this rank reads, each there (states["reads"])."""
    _check_complete(folder, from_latest)
    manifest = read_manifest(folder)
    verifier = Verifier(folder, manifest)  # checks the manifest's "files" before they name what to read
    sharded = manifest["format"] == SHARDED
    if manifest["format"] == DEEPSPEED_LAYOUT:  # DeepSpeed's files: every rank reads every optimizer file
        listed = manifest.get("files") or {path.name: {} for path in folder.glob("*_states.pt")}
        names = [CREW_STATE] + sorted(name for name in listed if name.endswith("_states.pt"))
    else:
        names = [CLIENT_STATE]
        names += [ENGINE_STATE, f"{SHARDED_DIR}/.metadata"] if sharded else model_state_files(manifest)
    if sharded:  # every rank may read a piece of any shard file (replicated tensors are in one of them)
        names += [name for name in manifest.get("files") or {} if name.startswith(f"{SHARDED_DIR}/__")]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{folder} lacks {', '.join(missing)}: on a node without a shared filesystem, the save "
            "dir holds only what that node's ranks wrote; load on the same placement, or share it")
    rank_file = folder / f"rank{comm.get_rank()}.pt"
    same_world = manifest.get("world_size") == comm.get_world_size()
    if same_world and not rank_file.is_file():
        saved_on = manifest.get("hosts", [])[comm.get_rank()] if manifest.get("hosts") else "?"
        raise CheckpointError(
            f"{rank_file} is missing (rank {comm.get_rank()} was saved on {saved_on}): the save dir "
            "is not shared between nodes; load with the same ranks on the same hosts, or copy it")
    reads = [folder / name for name in names] + ([rank_file] if same_world else [])
    states.update(manifest=manifest, verifier=verifier, reads=reads,
                  identities=[identity(path, shared=path.parent.name == SHARDED_DIR) for path in reads],
                  rank_file=rank_file if same_world else None)


def _verify(states: dict, mine: list[bool]) -> None:
    """This rank's share of the files the ranks read; the agree that follows covers the rest."""
    for path, checks in zip(states["reads"], mine, strict=True):
        if checks:
            states["verifier"].check(path)
        else:
            states["verifier"].checked_elsewhere(path)


def _read_all(engine, folder: Path, states: dict, optimizer: bool, load_optimizer_states: bool = True,
              load_lr_scheduler_states: bool = True, module_only: bool = False) -> None:
    manifest = states["manifest"]
    if manifest["format"] == DEEPSPEED_LAYOUT:
        _read_deepspeed_layout(engine, folder, states, load_optimizer_states, load_lr_scheduler_states, module_only)
        return
    sharded = manifest["format"] == SHARDED
    states["model"] = read(folder / ENGINE_STATE) if sharded else read_model_states(folder, manifest)
    if sharded:
        _read_shards(engine, folder / SHARDED_DIR, states, optimizer)
    else:
        states["shapes"] = {name: tuple(value.shape) for name, value in states["model"]["module"].items()}
    states["client"] = read(folder / CLIENT_STATE)
    states["rank"] = read(states["rank_file"]) if states["rank_file"] is not None else None


def _read_deepspeed_layout(engine, folder: Path, states: dict, load_optimizer_states: bool,
                           load_lr_scheduler_states: bool, module_only: bool) -> None:
    """crew's checkpoint in DeepSpeed's files: the fp32 weights and the optimizer state reassembled by name from
    DeepSpeed's files (deepspeed_format.py), in crew's own param groups with each parameter's own step, and the
    rest from crew_state.pt and rank<R>.pt: the resume is exact, and client_state what the save was given.
    (Not read_for_load's conversion into the live optimizer: that is for DeepSpeed's own runs, whose groups
    leave out the parameters DeepSpeed does not step; crew's keep them.)"""
    extras = read(folder / CREW_STATE)
    groups = extras.get("optimizer_groups")
    positions = [group["params"] for group in groups if group["params"]] if groups else None  # DeepSpeed's groups
    wanted = load_optimizer_states and not module_only and engine.optimizer is not None and groups

    def states_of(tag):
        module = deepspeed_format.module_state(tag, deepspeed_format.fp32_params(tag, positions))
        if not wanted:
            return module, None
        return module, (deepspeed_format._stage0_optimizer(tag, positions) if tag.stage == 0
                        else deepspeed_format._zero_optimizer(tag))

    tp = extras.get("tensor_parallel") or {"size": 1}
    tag, module, saved = tensor_parallel.read_tags(engine, folder, tp["size"], tp.get("dims"), states_of,
                                                     deepspeed_format._Tag)
    optimizer = None
    if wanted:
        saved = saved["state"]
        steps = extras["optimizer_steps"]
        stepped = [name for name in saved if name in steps] if steps else list(saved)  # crew's had no state else
        optimizer = {"state": {name: {**saved[name], **({"step": steps[name]} if name in steps else {})}
                               for name in stepped}, "param_groups": groups}
    model = tag.model
    shadowed = extras["client_shadowed"]
    steps_done = int(model.get("global_steps") or 0)
    states.update(
        model={"module": module, "optimizer": optimizer, "lr_scheduler": model.get("lr_scheduler"),
               "precision": extras["precision"], "global_steps": steps_done,
               "global_samples": int(model.get("global_samples") or 0),
               **{key: extras[key] for key in ("micro_steps", "boundary_override", "micro_batch_sizes", "world_size")}},
        shapes={name: tuple(value.shape) for name, value in module.items()},
        client={key: shadowed[key] if key in shadowed else model[key] for key in extras["client_keys"]},
        module_file=tag.model_file,
        rank=read(states["rank_file"]) if states["rank_file"] is not None else None)


def _check_complete(folder: Path, from_latest: bool) -> None:
    """The tag folder exists and its save finished (the manifest is written last)."""
    tag = (f"{folder.parent / 'latest'} names checkpoint tag '{folder.name}', which" if from_latest
           else f"checkpoint tag '{folder.name}'")
    fix = ("write a complete tag into it, or pass tag= to load_checkpoint" if from_latest
           else "pass a complete tag")
    if not folder.is_dir():
        raise CheckpointError(
            f"{tag} is not in {folder.parent} ({other_tags(folder.parent)}): {fix}. If other ranks "
            "found it, the save dir is not shared between nodes.")
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"{tag} is incomplete: {folder} has no {MANIFEST}, which a save writes last (a save that did "
            f"not finish, or a folder crew did not write) ({other_tags(folder.parent, but=folder.name)}): "
            f"{fix}.")


def _read_shards(engine, folder: Path, states: dict, optimizer: bool) -> None:
    """A sharded checkpoint: only its shapes for a sharded engine (which reads its own pieces
    later), everything, whole, for an engine at stage 0-2."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded  # DCP: only stage 3 pays its import
    if engine.zero.shards_params:
        states["shapes"] = checkpoint_sharded.saved_module_shapes(folder, states["verifier"])
        return
    module, optimizer_tensors = checkpoint_sharded.read_full(folder, states["verifier"], with_optimizer=optimizer)
    states["model"]["module"] = module
    states["model"]["optimizer"]["state_tensors"] = optimizer_tensors
    states["shapes"] = {name: tuple(value.shape) for name, value in module.items()}


def _check_fits(engine, states: dict, folder: Path, strict: bool) -> None:
    sharded = states["manifest"]["format"] == SHARDED
    path = states.get("module_file") or folder / (SHARDED_DIR if sharded else "model_states.*")
    with shards_visible():  # stage 3: the DTensors' whole shapes
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
    0-2 (by index) and 3 (by parameter name) it is converted by parameter name."""
    saved, manifest = states["model"], states["manifest"]
    if manifest["format"] == deepspeed_format.DEEPSPEED:  # by parameter name, whole
        states["optimizer"] = saved["optimizer"] if engine.zero.shards_params else \
            _by_index(saved["optimizer"], folder, manifest, engine)
        return
    by_name = manifest["format"] == SHARDED
    if engine.zero.shards_params == by_name:
        states["optimizer"] = saved["optimizer"]
        return
    if by_name:  # a sharded checkpoint into a stage 0-2 engine
        whole = {"state": merge_by_name(saved["optimizer"]["state_tensors"], saved["optimizer"]["state_other"]),
                 "param_groups": saved["optimizer"]["param_groups"]}
        states["optimizer"] = _by_index(whole, folder, manifest, engine)
    else:  # a stage 0-2 checkpoint into a sharded engine
        states["optimizer"] = _by_name(saved["optimizer"], saved.get("optimizer_param_names"),
                                       folder, manifest, engine)
    log_rank0("%s was saved at ZeRO stage %d (%s); loading it at stage %d: optimizer state matched by "
              "parameter name", folder, manifest["zero_stage"], manifest["format"], engine.zero.stage)


def _cross_stage_error(folder: Path, manifest: dict, engine, reason: str) -> CheckpointError:
    saved_stage, stage = manifest["zero_stage"], engine.zero.stage
    return CheckpointError(
        f"{folder} was saved at ZeRO stage {saved_stage} and this engine runs stage {stage}, but "
        f"the optimizer state cannot be matched by parameter name: {reason}. Load it at stage "
        f"{saved_stage}, or take the weights only: load_checkpoint(..., load_optimizer_states=False), "
        "or `crew export` it and load the file with model.load_state_dict.")


def _by_name(state: dict, names: list[str] | None, folder: Path, manifest: dict, engine) -> dict:
    """An optimizer state dict by index (stages 0-2) -> by parameter name."""
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
    mine = groups_by_name(engine)
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
                  module_only: bool, custom_load_fn=None) -> None:
    """Module, precision and (when `optimizer`) optimizer state; a collective at stage 3."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded  # DCP: only stage 3 pays its import
    saved = states["model"]
    optimizer_state = states["optimizer"] if optimizer else None
    if engine.zero.shards_params:
        if custom_load_fn is not None:
            raise CheckpointError("load_checkpoint(custom_load_fn=...) at ZeRO stage 3 is not supported yet: crew "
                                  "loads the shards by parameter name. Load at stage 0-2, or drop custom_load_fn.")
        if states["manifest"]["format"] == SHARDED:
            checkpoint_sharded.load(engine.module, engine.optimizer, folder / SHARDED_DIR, strict,
                                    optimizer_state, states["verifier"])
        else:
            checkpoint_sharded.load_full(engine.module, engine.optimizer, saved["module"],
                                         optimizer_state, strict)
    elif custom_load_fn is not None:  # DeepSpeed's hook: the caller puts the saved state into the module
        custom_load_fn(src=saved["module"], dst=engine.module)
    else:
        engine.module.load_state_dict(saved["module"], strict=strict)
    if not module_only:
        engine.precision.load_state_dict(saved["precision"])
    if engine.zero.shards_params:
        return  # the sharded fp32 parameters are the master weights
    for name, param in engine.module.named_parameters():
        if name in saved["module"]:
            engine.precision.master_of(param).copy_(saved["module"][name])
    if optimizer_state is not None and optimizer_state["param_groups"]:  # none: saved by a model-only engine
        _load_into_same_groups(engine.optimizer, optimizer_state)


def _load_into_same_groups(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """torch's load_state_dict puts new dicts in param_groups. At stages 1-2 those are the client optimizer's
    own dicts, and a scheduler built on it outside the engine (Accelerate's) sets the lr in them, as under
    DeepSpeed, which loads the client optimizer itself: the saved values go into the same dicts."""
    groups = optimizer.param_groups
    optimizer.load_state_dict(state)
    if optimizer.param_groups is not groups:
        for group, loaded in zip(groups, optimizer.param_groups, strict=True):
            group.update(loaded)
        optimizer.param_groups[:] = groups


def _load_the_rest(engine, states: dict, scheduler: bool, module_only: bool) -> None:
    saved = states["model"]
    if scheduler and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if module_only:
        return
    engine.global_steps = saved["global_steps"]
    engine.global_samples = saved["global_samples"]
    engine.micro_steps = saved["micro_steps"]
    engine._boundary_override = saved.get("boundary_override")  # set_gradient_accumulation_boundary's, sticky
    if engine.balancer is not None:  # before the loader's position: that is counted in micro steps
        engine.balancer.restore(saved.get("micro_batch_sizes"))
    if states["manifest"]["format"] == deepspeed_format.DEEPSPEED and "crew_version" not in states["manifest"]:
        log_rank0("DeepSpeed checkpoint (ZeRO stage %d, %d ranks) loaded at stage %d on %d ranks; DeepSpeed saves "
                  "no RNG states or data position", states["manifest"]["zero_stage"], saved["world_size"],
                  engine.zero.stage, comm.get_world_size())
        return
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
        if engine.crew_config.checkpoint.resume_data_position:
            loader.load_state_dict(state["dataloader"])
        else:
            loader.restart_epoch(state["dataloader"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
