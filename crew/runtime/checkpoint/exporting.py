"""Weights as one state dict file: save_16bit_model (in the training dtype, from a running engine)
and `crew export` (fp32, from a checkpoint on disk)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from crew import outputs
from crew.runtime import comm
from crew.runtime.checkpoint import deepspeed_format
from crew.runtime.checkpoint.collective import agree, attempt
from crew.runtime.checkpoint.deepspeed_files import is_deepspeed_tag
from crew.runtime.checkpoint.integrity import Verifier
from crew.runtime.checkpoint.layout import (
    CREW_STATE,
    DEEPSPEED_LAYOUT,
    MANIFEST,
    SHARDED,
    SHARDED_DIR,
    CheckpointError,
    model_state_files,
    read,
    read_latest,
    read_manifest,
    read_model_states,
    write_atomic,
)
from crew.runtime.checkpoint.state import fp32_module_state


def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Rank 0 writes the module's weights in its training dtype (16-bit under fp16/bf16); at
    stage 3 they are gathered from the shards first (a collective). With
    exclude_frozen_parameters, parameters that do not require grad are left out (buffers stay)."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded  # DCP: only stage 3 pays its import
    from crew.runtime.checkpoint import tensor_parallel
    gathered = None
    if tensor_parallel.size() > 1:  # the whole weights, HF's names (DeepSpeed writes rank 0's slices here at
        gathered = tensor_parallel.whole_state(engine, torch.float32)  # stages 0-2; at 3 whole, as crew)
    elif engine.zero.shards_params:
        gathered = checkpoint_sharded.full_module_state(engine.module)
    problem = None
    if comm.get_rank() == 0:
        dtype = engine.precision.dtype
        frozen = {name for name, param in engine.module.named_parameters() if not param.requires_grad} \
            if exclude_frozen_parameters else set()
        state = {name: value.to(dtype) if value.is_floating_point() else value
                 for name, value in (gathered if gathered is not None else fp32_module_state(engine)).items()
                 if name not in frozen}
        problem = attempt(write_state_dict, state, Path(save_dir) / save_filename)
        if problem is None:
            outputs.report("weights", Path(save_dir) / save_filename)
    agree(problem, f"save_16bit_model({save_dir}, {save_filename})")
    return True


def write_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".safetensors":
        write_atomic(path, obj=state)
        return
    try:
        from safetensors.torch import save as to_safetensors
    except ImportError:
        raise CheckpointError(f"{path}: writing .safetensors needs the safetensors package: "
                              "pip install 'crew[safetensors]' (or use a .bin/.pt name)") from None
    write_atomic(path, data=to_safetensors({k: v.contiguous() for k, v in state.items()}))


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """`crew export`: a save dir (its `latest`) or a tag folder -> one fp32 state dict file. A
    sharded checkpoint (stage 3) is consolidated here, in this one process; so is DeepSpeed's (its fp32
    master weights)."""
    folder = Path(checkpoint)
    if not (folder / MANIFEST).is_file() and not _deepspeeds(folder):
        tag = read_latest(folder)
        if tag is None:
            raise CheckpointError(f"{folder} is neither a checkpoint tag folder (no {MANIFEST}, no DeepSpeed "
                                  "mp_rank_00_model_states.pt) nor a save dir with a 'latest' file")
        folder = folder / tag
    write_state_dict(read_fp32_module(folder), Path(out))
    return folder


def _deepspeeds(folder: Path) -> bool:
    """A tag DeepSpeed wrote (not crew's in DeepSpeed's layout whose manifest is missing: an incomplete one)."""
    return is_deepspeed_tag(folder) and not (folder / CREW_STATE).is_file()


def read_fp32_module(folder: Path) -> dict[str, torch.Tensor]:
    """A tag folder's whole module state, floating-point tensors in fp32, whatever its ZeRO stage."""
    from crew.runtime.checkpoint import sharded as checkpoint_sharded  # DCP: only stage 3 pays its import
    if _deepspeeds(folder):
        return deepspeed_format.read_fp32_module(folder)
    manifest = read_manifest(folder)
    verifier = Verifier(folder, manifest)
    if manifest["format"] == DEEPSPEED_LAYOUT:  # crew's checkpoint in DeepSpeed's files
        for name in manifest.get("files") or {}:
            if name.endswith("_states.pt"):
                verifier.check(folder / name)
        verifier.check(folder / CREW_STATE)
        extras = read(folder / CREW_STATE)
        groups = [group.get("params") for group in extras.get("optimizer_groups") or []
                  if group.get("params")]  # DeepSpeed's files leave out the groups with no parameters
        named = groups and all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in groups)
        split = (extras.get("tensor_parallel") or {}).get("dims")  # AutoTP: the dims its slices join along
        module = deepspeed_format.read_fp32_module(folder, groups if named else None, split)
    elif manifest["format"] == SHARDED:
        module, _ = checkpoint_sharded.read_full(folder / SHARDED_DIR, verifier)
    else:
        for name in model_state_files(manifest):
            verifier.check(folder / name)
        module = read_model_states(folder, manifest)["module"]
    return {name: value.float() if value.is_floating_point() else value for name, value in module.items()}
