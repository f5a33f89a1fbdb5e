"""`deepspeed.utils.zero_to_fp32` as DeepSpeed 0.19.8 has it: the fp32 weights of a ZeRO checkpoint folder
as a state dict, as files (sharded with Hugging Face's file names and index), or loaded into a model; the
helpers Lightning's converter imports (get_model_state_file, get_optim_files, ...); the command line
`python -m crew.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`. One process, no process group.

Written from DeepSpeed's deepspeed/utils/zero_to_fp32.py: the same names, signatures, return values, key
order and errors, on checkpoints in DeepSpeed's layout (written by DeepSpeed or by crew). Where crew differs:
- files are read with torch.load(weights_only=True) and an allow-list of DeepSpeed's pickled classes
  (crew/runtime/checkpoint/deepspeed_files.py): a file naming any other class is a CheckpointError, not run;
- a stage-0 folder (no optimizer files, where DeepSpeed fails with a TypeError) gives its module's weights,
  in fp32 (the fp32 copies under bf16/fp16; FusedAdam's flat copies only where crew's crew_state.pt names
  them), as do the folders of earlier crew versions (crew_checkpoint.json, no DeepSpeed files), any stage;
- max_shard_size splits as huggingface_hub's split_torch_state_dict_into_shards does, without needing it.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from crew.log import logger, warn_once
from crew.runtime.checkpoint.deepspeed_files import MODEL_STATES, ZERO3_MODEL_STATES, read
from crew.runtime.checkpoint.layout import MANIFEST, CheckpointError

__all__ = ["GatheredTensor", "convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_checkpoint_files", "get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file",
           "get_model_state_files", "get_optim_files", "load_state_dict_from_zero_checkpoint", "parse_model_states",
           "parse_optim_states", "to_torch_tensor", "zero3_partitioned_param_info", "zero_model_state"]

debug = 0
device = torch.device("cpu")
OUTPUT_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                      "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int


class LatestNotFound(CheckpointError, ValueError):
    """No `latest` file and no tag: DeepSpeed raises ValueError here, crew's callers catch CheckpointError."""


class TagNotFound(CheckpointError, FileNotFoundError):
    """The tag folder is missing: DeepSpeed's FileNotFoundError, and a CheckpointError."""


@dataclass
class zero_model_state:  # noqa: N801 - DeepSpeed's name
    buffers: dict
    param_shapes: list
    shared_params: list
    ds_version: str | None
    frozen_param_shapes: dict | None
    frozen_param_fragments: dict | None


def _resolve_output_dtype(dtype) -> torch.dtype:
    requested = dtype
    if isinstance(dtype, str):
        dtype = OUTPUT_DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    if dtype not in set(OUTPUT_DTYPE_NAMES.values()):
        supported = ", ".join(sorted(OUTPUT_DTYPE_NAMES))
        raise ValueError(f"Unsupported output dtype {requested!r}. Choose one of: {supported}")
    return dtype


def atoi(text):
    return int(text) if text.isdigit() else text


def natural_keys(text):
    """Sort key for human order: rank 2 before rank 10."""
    return [atoi(part) for part in re.split(r"(\d+)", text)]


# -- the files of a tag folder ---------------------------------------------------------------------------------

def get_model_state_file(checkpoint_dir, zero_stage):
    """The tag folder's model states file: mp_rank_00_model_states.pt at stages 0-2, rank 0's at stage 3."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = MODEL_STATES if zero_stage <= 2 else ZERO3_MODEL_STATES.format(rank=0)
    file = os.path.join(checkpoint_dir, name)
    if not os.path.exists(file):
        raise FileNotFoundError(f"can't find model states file at '{file}'")
    return file


def get_checkpoint_files(checkpoint_dir, glob_pattern):
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_keys)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir):
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir):
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _refuse_autoep_zero3(state: dict, file) -> None:
    layers = state.get("ds_autoep_layers", state.get("autoep_layers"))
    if isinstance(layers, list) and any(isinstance(entry, dict) and entry.get("checkpoint_format") ==
                                        "zero3_partitioned" for entry in layers):
        raise NotImplementedError(f"{file}: zero_to_fp32 does not support AutoEP ZeRO-3 partition-native checkpoints "
                                  "(expert parameters are partitioned over expert replica groups). Use DeepSpeed's "
                                  "ds_to_universal.py for expert-aware conversion.")


def parse_model_states(files) -> list[zero_model_state]:
    """Each model states file's buffers (floating ones in fp32), parameter shapes by group, shared and frozen
    parameters."""
    states = []
    for file in files:
        state = read(Path(file))
        if not isinstance(state, dict):
            raise ValueError(f"{file} is not a model state checkpoint")
        _refuse_autoep_zero3(state, file)
        if "buffer_names" not in state:
            raise ValueError(f"{file} is not a model state checkpoint")
        if state.get("param_shapes") is None:
            raise ValueError(f"{file} has no parameter shapes: it was saved without a ZeRO optimizer (stage 0) and "
                             "its module holds the weights; get_fp32_state_dict_from_zero_checkpoint reads them")
        buffer_names = state["buffer_names"]
        buffers = {name: value.float() if value.is_floating_point() else value
                   for name, value in state["module"].items() if name in buffer_names}
        states.append(zero_model_state(buffers=buffers, param_shapes=state["param_shapes"],
                                       shared_params=[[k, v] for k, v in state["shared_params"].items()],
                                       ds_version=state.get("ds_version"),
                                       frozen_param_shapes=state.get("frozen_param_shapes"),
                                       frozen_param_fragments=state.get("frozen_param_fragments")))
    return states


def parse_optim_states(files, ds_checkpoint_dir):
    """(zero_stage, world_size, each rank's fp32 flat groups, param_alignment_paddings) of the optimizer files."""
    states = []
    for file in files:
        state = read(Path(file))
        state["optimizer_state_dict"].pop("optimizer_state_dict", None)  # the moments: not needed here
        states.append(state["optimizer_state_dict"])
    if "zero_stage" not in states[0]:
        raise ValueError(f"{files[0]} is not a zero checkpoint")
    zero_stage = states[0]["zero_stage"]
    world_size = states[0]["partition_count"]
    if isinstance(world_size, list):  # ZeRO-2 expert groups may partition over fewer ranks
        world_size = max(world_size)
    if world_size != len(files):
        raise ValueError(
            f"Expected {world_size} of '*_optim_states.pt' under '{ds_checkpoint_dir}' but found {len(files)} files. "
            "Possibly due to an overwrite of an old checkpoint, or a checkpoint didn't get saved by one or more "
            "processes.")
    if zero_stage <= 2:
        key = "single_partition_of_fp32_groups"
    elif zero_stage == 3:
        key = "fp32_flat_groups"
    else:
        raise ValueError(f"unknown zero stage {zero_stage}")
    return zero_stage, world_size, [state[key] for state in states], states[0].get("param_alignment_paddings")


# -- the flat fp32 groups -> tensors by name -------------------------------------------------------------------

def _zero2_state_dict(world_size, flat_groups, model_states, exclude_frozen_parameters, alignment_paddings):
    """Stages 1-2: each group's partitions joined (rank order) and cut in param_shapes order, each parameter
    followed by its alignment padding; the group's end is checked to within DeepSpeed's 2*world_size padding."""
    first = model_states[0]
    state_dict = OrderedDict(first.buffers)
    if not exclude_frozen_parameters and first.frozen_param_shapes:
        for name in first.frozen_param_shapes:
            state_dict[name] = first.frozen_param_fragments[name]
    align = 2 * world_size
    for group, shapes in enumerate(first.param_shapes):
        flat = torch.cat([rank_groups[group] for rank_groups in flat_groups], 0)
        paddings = None if alignment_paddings is None else alignment_paddings[group]
        if paddings is not None and len(paddings) != len(shapes):
            raise ValueError(f"Expected {len(shapes)} parameter alignment paddings for group {group}, "
                             f"but found {len(paddings)}")
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            state_dict[name] = flat.narrow(0, offset, numel).view(shape)
            offset += numel + (paddings[index] if paddings is not None else 0)
        offset, available = (align * math.ceil(n / align) for n in (offset, flat.numel()))
        if offset != available:
            raise ValueError(f"consumed {offset} numels out of {available} - something is wrong")
    return state_dict


def zero3_partitioned_param_info(unpartitioned_numel, world_size):
    """(numel of each rank's partition, padding of the last) of a parameter at stage 3."""
    remainder = unpartitioned_numel % world_size
    padding_numel = (world_size - remainder) if remainder else 0
    return math.ceil(unpartitioned_numel / world_size), padding_numel


class GatheredTensor:
    """A stage-3 parameter not yet assembled (lazy_mode): `.contiguous()` gathers its partition from each rank's
    flat groups (a partition may run over the end of one sub-group into the next)."""

    def __init__(self, flat_groups, flat_groups_offset, offset, partitioned_numel, shape):
        self.flat_groups = flat_groups
        self.flat_groups_offset = flat_groups_offset
        self.offset = offset
        self.partitioned_numel = partitioned_numel
        self.shape = shape
        self.dtype = self.flat_groups[0][0].dtype

    def contiguous(self):
        end = self.offset + self.partitioned_numel
        bounds = self.flat_groups_offset
        chunks = []
        for rank_groups in self.flat_groups:
            for group in range(len(bounds) - 1):
                low, high = max(self.offset, bounds[group]), min(end, bounds[group + 1])
                if low < high:
                    chunks.append(rank_groups[group][low - bounds[group]:high - bounds[group]])
        return torch.cat(chunks, 0)[:self.shape.numel()].view(self.shape).contiguous()


def _zero3_state_dict(world_size, flat_groups, model_states, exclude_frozen_parameters):
    """Stage 3: every parameter padded to a multiple of the world size, each rank holding 1/world of it, one
    after the other in param_shapes order (the groups' dicts merged)."""
    first = model_states[0]
    state_dict = OrderedDict(first.buffers)
    if not exclude_frozen_parameters and first.frozen_param_shapes:
        for name, shape in first.frozen_param_shapes.items():
            pieces = tuple(state.frozen_param_fragments[name] for state in model_states)
            state_dict[name] = torch.cat(pieces, 0).narrow(0, 0, shape.numel()).view(shape)
    shapes = {name: shape for group in first.param_shapes for name, shape in group.items()}
    bounds = [0]
    for flat in flat_groups[0]:
        bounds.append(bounds[-1] + flat.numel())
    offset = 0
    for name, shape in shapes.items():
        partitioned_numel, _ = zero3_partitioned_param_info(shape.numel(), world_size)
        state_dict[name] = GatheredTensor(flat_groups, bounds, offset, partitioned_numel, shape)
        offset += partitioned_numel
    if offset * world_size != bounds[-1] * world_size:
        raise ValueError(f"consumed {offset * world_size} numels out of {bounds[-1] * world_size} - something is wrong")
    return state_dict


def _state_dict_of_tag(ds_checkpoint_dir, exclude_frozen_parameters):
    print(f"Processing zero checkpoint '{ds_checkpoint_dir}'")
    model_states = parse_model_states(get_model_state_files(ds_checkpoint_dir))
    print(f"Parsing checkpoint created by deepspeed=={model_states[0].ds_version}")
    zero_stage, world_size, flat_groups, paddings = parse_optim_states(get_optim_files(ds_checkpoint_dir),
                                                                       ds_checkpoint_dir)
    print(f"Detected checkpoint of type zero stage {zero_stage}, world_size: {world_size}")
    if zero_stage <= 2:
        state_dict = _zero2_state_dict(world_size, flat_groups, model_states, exclude_frozen_parameters, paddings)
    else:
        state_dict = _zero3_state_dict(world_size, flat_groups, model_states, exclude_frozen_parameters)
    for name, shared_with in model_states[0].shared_params:
        if shared_with in state_dict:
            state_dict[name] = state_dict[shared_with]
    return state_dict


def _whole_module(tag_dir: Path, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor] | None:
    """Stage 0 (the module file names no parameter shapes) or an earlier crew's folder: the module's weights in
    fp32; None for a ZeRO folder in DeepSpeed's layout."""
    from crew.runtime.checkpoint import exporting

    if (tag_dir / MODEL_STATES).is_file():
        if read(tag_dir / MODEL_STATES).get("param_shapes") is not None:
            return None
    elif (tag_dir / ZERO3_MODEL_STATES.format(rank=0)).is_file() or not (tag_dir / MANIFEST).is_file():
        return None
    module = exporting.read_fp32_module(tag_dir)  # as `crew export`: crew's own files name stage 0's flat copies
    if exclude_frozen_parameters:
        warn_once(f"zero_to_fp32: {tag_dir} does not record which parameters were frozen (a stage-0 checkpoint or "
                  "one of an earlier crew): exclude_frozen_parameters has no effect, every parameter is returned")
    return module


# -- public entry points ---------------------------------------------------------------------------------------

def to_torch_tensor(state_dict, return_empty_tensor=False, dtype=None):
    """The state dict with every GatheredTensor assembled (`dtype`: floating-point tensors cast to it; empty
    tensors of the right shape with return_empty_tensor). Names sharing one tensor keep sharing it."""
    if dtype is not None:
        dtype = _resolve_output_dtype(dtype)
    result, converted = {}, {}
    for name, tensor in state_dict.items():
        if id(tensor) in converted:
            result[name] = result[converted[id(tensor)]]
            continue
        converted[id(tensor)] = name
        target = dtype if tensor.dtype.is_floating_point else None
        if return_empty_tensor:
            result[name] = torch.empty(tensor.shape, dtype=target or tensor.dtype)
        else:
            value = tensor.contiguous()
            result[name] = value.to(dtype=target) if target else value
    return result


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The checkpoint's fp32 weights (and buffers) by name, on the CPU: checkpoint_dir/tag, the tag read from
    checkpoint_dir/latest when None. lazy_mode: stage-3 parameters are GatheredTensors, assembled by
    `.contiguous()` one at a time (less memory)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise LatestNotFound(f"Unable to find 'latest' file at {latest}: pass tag= (the name of a checkpoint "
                                 f"folder in {checkpoint_dir}) or the folder save_checkpoint wrote into")
        with open(latest) as file:
            tag = file.read().strip()
    ds_checkpoint_dir = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(ds_checkpoint_dir):
        raise TagNotFound(f"Directory '{ds_checkpoint_dir}' doesn't exist: no tag {tag!r} in {checkpoint_dir}")
    whole = _whole_module(Path(ds_checkpoint_dir), exclude_frozen_parameters)
    if whole is not None:
        return whole
    state_dict = _state_dict_of_tag(ds_checkpoint_dir, exclude_frozen_parameters)
    return state_dict if lazy_mode else to_torch_tensor(state_dict)


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    unit = size.strip()[-2:].upper()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"Unit '{unit}' not supported. Supported units are TB, GB, MB, KB. Got '{size}'.")
    return int(float(size.strip()[:-2].strip()) * _SIZE_UNITS[unit])


def _split_into_shards(state_dict: dict, weights_name: str, max_shard_size) -> tuple[dict, dict]:
    """huggingface_hub's split_torch_state_dict_into_shards on DeepSpeed's empty tensors: in key order, a new
    shard when the next tensor would overflow this one, a tensor larger than the limit alone; names sharing a
    tensor go with the first. Returns ({file: [names]}, the index's metadata) (no index: one file)."""
    limit = _parse_size(max_shard_size)
    shards, current, current_size, total = [], [], 0, 0
    sharing: dict[int, list[str]] = {}
    for name, tensor in state_dict.items():
        if id(tensor) in sharing:
            sharing[id(tensor)].append(name)
            continue
        sharing[id(tensor)] = [name]
        size = tensor.untyped_storage().nbytes()
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    for names in sharing.values():
        shard = next(shard for shard in shards if names[0] in shard)
        shard.extend(names[1:])
    pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    if len(shards) == 1:
        return {pattern.format(suffix=""): shards[0]}, {"total_size": total}
    return ({pattern.format(suffix=f"-{index + 1:05d}-of-{len(shards):05d}"): names
             for index, names in enumerate(shards)}, {"total_size": total})


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the checkpoint's weights (floating-point ones in `dtype`) into output_dir: pytorch_model.bin
    (model.safetensors with safe_serialization), or shards of at most max_shard_size named
    pytorch_model-00001-of-0000N.bin with pytorch_model.bin.index.json (max_shard_size=None: one file)."""
    dtype = _resolve_output_dtype(dtype)
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError:
            print("If you want to use `safe_serialization`, please `pip install safetensors`")
            raise
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters,
                                                          lazy_mode=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    index = None
    if max_shard_size is not None:
        empty = to_torch_tensor(state_dict, return_empty_tensor=True, dtype=dtype)
        files, metadata = _split_into_shards(empty, weights_name, max_shard_size)
        if len(files) > 1:
            weight_map = {name: file for file, names in files.items() for name in names}
            index = {"metadata": metadata, "weight_map": weight_map}
    else:
        files = {weights_name: list(state_dict)}
    os.makedirs(output_dir, exist_ok=True)
    for file, names in files.items():
        shard = to_torch_tensor({name: state_dict[name] for name in names}, dtype=dtype)
        path = os.path.join(output_dir, file)
        if safe_serialization:
            save_file(shard, path, metadata={"format": "pt"})
        else:
            torch.save(shard, path)
        for name in names:  # each shard's tensors freed once written (refcounts: no gc.collect, 0.2 s a shard)
            del state_dict[name]
        del shard
    if index is not None:
        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        with open(os.path.join(output_dir, index_name), "w", encoding="utf-8") as file:
            file.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """convert_zero_checkpoint_to_state_dict in fp32."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32,
                                                 max_shard_size=max_shard_size, safe_serialization=safe_serialization,
                                                 tag=tag, exclude_frozen_parameters=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (strict=False); returns it."""
    logger.info("Extracting fp32 weights")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    logger.info("Overwriting model with fp32 weights")
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def _main(argv: list[str] | None = None) -> None:
    global debug
    parser = argparse.ArgumentParser(description="The fp32 weights of a ZeRO checkpoint, as state dict files.")
    parser.add_argument("checkpoint_dir", type=str, help="path to the desired checkpoint folder, e.g., "
                        "path/checkpoint-12")
    parser.add_argument("output_dir", type=str, help="directory to the pytorch fp32 state_dict output files "
                        "(e.g. path/checkpoint-12-output/)")
    parser.add_argument("--max_shard_size", type=str, default="5GB", help="the largest shard before a new one "
                        "starts: digits followed by a unit (like `5MB`)")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="save with `safetensors` instead of torch.save (pickle)")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="checkpoint tag used as a unique identifier for checkpoint. e.g., global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="enable debug")
    args = parser.parse_args(argv)
    debug = args.debug
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)


if __name__ == "__main__":
    _main()
