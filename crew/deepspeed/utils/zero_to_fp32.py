"""`deepspeed.utils.zero_to_fp32` on crew's checkpoints: the fp32 weights of a checkpoint saved at
any ZeRO stage (0-3), as a state dict, a file, or loaded into a model. One process, no process group;
the shards of a stage 2-3 checkpoint are consolidated here (as `crew export` does)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from crew.log import warn_once
from crew.runtime.checkpoint import CheckpointError, export, read_latest
from crew.runtime.checkpoint.deepspeed_files import is_deepspeed_tag
from crew.runtime.checkpoint.exporting import read_fp32_module
from crew.runtime.checkpoint.layout import MANIFEST

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "get_model_state_file", "get_optim_files", "load_state_dict_from_zero_checkpoint"]

_FILE_SUFFIXES = (".bin", ".pt", ".safetensors")


def _tag_folder(checkpoint_dir, tag=None) -> Path:
    """checkpoint_dir/tag, the tag from checkpoint_dir/latest when None; CheckpointError naming the
    folder when either is missing."""
    folder = Path(checkpoint_dir)
    if tag is None:
        tag = read_latest(folder)
        if tag is None:
            raise CheckpointError(f"Unable to find 'latest' file at {folder / 'latest'}: pass tag= (the name "
                                  f"of a checkpoint folder in {folder}) or the save dir of a crew checkpoint")
    tagged = folder / str(tag)
    if not (tagged / MANIFEST).is_file() and not is_deepspeed_tag(tagged):
        raise CheckpointError(f"{tagged} is not a crew or DeepSpeed checkpoint (no {MANIFEST}, no "
                              f"mp_rank_00_model_states.pt): no tag {tag!r} in {folder}")
    return tagged


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict[str, torch.Tensor]:
    """The checkpoint's module state, floating-point tensors in fp32, on the CPU. crew's checkpoints
    keep frozen parameters with the rest and exclude_frozen_parameters does not drop them; lazy_mode
    is accepted and the tensors are real ones (`.contiguous()` on them works as in DeepSpeed)."""
    _frozen_kept(exclude_frozen_parameters)
    return read_fp32_module(_tag_folder(checkpoint_dir, tag))


def _frozen_kept(exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        warn_once("zero_to_fp32: exclude_frozen_parameters has no effect on crew's checkpoints, which do not "
                  "record which parameters were frozen: every parameter is in the state dict.")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None,
                                               exclude_frozen_parameters=False) -> Path:
    """Write the fp32 weights to output_dir/pytorch_model.bin (model.safetensors with
    safe_serialization). crew writes one file and does not shard it (max_shard_size is ignored). A
    path ending in .bin, .pt or .safetensors is the file itself (DeepSpeed's older signature)."""
    _frozen_kept(exclude_frozen_parameters)
    out = Path(output_dir)
    if out.suffix not in _FILE_SUFFIXES:
        out = out / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    export(_tag_folder(checkpoint_dir, tag), out)
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into `model`, moved to the CPU (strict=False); returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def get_model_state_file(checkpoint_dir, zero_stage) -> str:
    """DeepSpeed's: the tag folder's module states file (rank 0's at stage 3). Lightning's
    convert_zero_checkpoint_to_fp32_state_dict reads it for its own keys."""
    folder = _deepspeed_folder(checkpoint_dir)
    name = "mp_rank_00_model_states.pt" if zero_stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not (folder / name).exists():
        raise FileNotFoundError(f"can't find model states file at '{folder / name}'")
    return str(folder / name)


def get_optim_files(checkpoint_dir) -> list[str]:
    """DeepSpeed's: the tag folder's `*_optim_states.pt` files, in rank order."""
    folder = _deepspeed_folder(checkpoint_dir)
    found = sorted((str(path) for path in folder.glob("*_optim_states.pt")), key=_natural)
    if not found:
        raise FileNotFoundError(f"can't find *_optim_states.pt files in directory '{folder}'")
    return found


def _deepspeed_folder(checkpoint_dir) -> Path:
    """A DeepSpeed tag folder; a crew one is named as such, with what reads it (it has no DeepSpeed files)."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    if (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"{folder} is a crew checkpoint: it has no DeepSpeed model/optim states files. Read its weights with "
            "get_fp32_state_dict_from_zero_checkpoint(save_dir) or `crew export SAVE_DIR OUT`.")
    return folder


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)


if __name__ == "__main__":
    _main(sys.argv[1:])
