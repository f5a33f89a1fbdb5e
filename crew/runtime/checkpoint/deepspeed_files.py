"""The files of a DeepSpeed 0.19 checkpoint tag and reading them safely, without deepspeed installed.

    <tag>/
      mp_rank_00_model_states.pt                 stages 0-2: the module (in its training dtype), the
                                                 counters, the scheduler, client_state's keys, and at stage 0
                                                 the optimizer (with the fp32 copies under bf16/fp16)
      zero_pp_rank_<r>_mp_rank_00_model_states.pt
                                                 stage 3, one a rank: the same, with empty parameters
      [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
                                                 stages 1-3, one a rank (bf16_ under bf16): that rank's
                                                 partition of the flat fp32 weights and optimizer state

DeepSpeed pickles a few of its own objects into these files (deepspeed/runtime/engine.py
_save_checkpoint, _save_zero_checkpoint). They are read with torch.load(weights_only=True) and an
allow-list that maps exactly those names onto the stand-ins below, so deepspeed need not be installed
and a file that names any other class is refused before anything in it runs.
"""

from __future__ import annotations

import enum
import pickle
from pathlib import Path
from typing import Any

import torch

from crew.runtime.checkpoint.layout import MANIFEST, CheckpointError

MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_STATES = ("zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                "zero_pp_rank_{rank}_mp_rank_00optim_states.pt")  # the last: DeepSpeed's old spelling


class ZeroStageEnum(enum.IntEnum):
    """deepspeed.runtime.zero.config.ZeroStageEnum: the ZeRO stage in an optimizer file."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Attributes:
    """A DeepSpeed object pickled with its attributes: read back as those attributes, nothing runs."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScaler(_Attributes):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler (cur_scale, dynamic)."""


class DynamicLossScaler(_Attributes):
    """deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (cur_scale, cur_iter, last_overflow_iter,
    cur_hysteresis, ...)."""


class fragment_address(_Attributes):  # noqa: N801 - DeepSpeed's class name, which tools reached by it see
    """deepspeed.utils.tensor_fragment.fragment_address (numel, start): where a parameter lies in a
    rank's partition; crew works it out from the parameter shapes instead."""


FragmentAddress = fragment_address


STAND_INS = [
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def is_deepspeed_tag(folder: Path) -> bool:
    """A tag folder DeepSpeed wrote (its model states file; no crew manifest)."""
    folder = Path(folder)
    return not (folder / MANIFEST).is_file() and (
        (folder / MODEL_STATES).is_file() or (folder / ZERO3_MODEL_STATES.format(rank=0)).is_file())


def read(path: Path) -> Any:
    """torch.load(weights_only=True) with DeepSpeed's classes as stand-ins; a CheckpointError naming the file
    and the class when it names any other."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the DeepSpeed checkpoint {path.parent} is incomplete "
                              "(a save that did not finish, or files not copied)")
    with torch.serialization.safe_globals(STAND_INS):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch's long weights_only message, or a damaged file
            foreign = _foreign_classes(path)
            if foreign:
                raise CheckpointError(_foreign_message(path, foreign)) from None
            raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                                  "it is truncated, corrupted or not a DeepSpeed checkpoint file") from None


def _foreign_classes(path: Path) -> list[str]:
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (OSError, RuntimeError, pickle.UnpicklingError, ValueError):
        return []


def _foreign_message(path: Path, names: list[str]) -> str:
    allowed = ", ".join(name.rsplit(".", 1)[1] for _, name in STAND_INS)
    return (f"{path} holds a pickled {', '.join(names)}, which crew does not load: unpickling a class can run "
            f"code from the file, so crew reads DeepSpeed checkpoints with torch.load(weights_only=True) and "
            f"allows only tensors, plain Python values and DeepSpeed's own {allowed}. If the object came from "
            "your client_state (an argparse.Namespace, say), save it as plain values (vars(args)) instead; to "
            "move an existing checkpoint, load it with DeepSpeed where you trust the file and save it again "
            "without that object.")


def optim_files(folder: Path, world_size: int, mp: int = 0) -> list[Path]:
    """The optimizer file of each of the `world_size` (data-parallel) ranks that saved a ZeRO checkpoint, in rank
    order, of TP rank `mp`."""
    found = []
    for rank in range(world_size):
        candidates = [folder / pattern.format(rank=rank).replace("mp_rank_00", f"mp_rank_{mp:02d}")
                      for pattern in OPTIM_STATES]
        present = [path for path in candidates if path.is_file()]
        if not present:
            raise CheckpointError(
                f"{folder} lacks {candidates[0].name} (or {candidates[1].name}): the DeepSpeed checkpoint was "
                f"saved by {world_size} ranks and each writes one; copy the whole tag folder, or load the weights "
                "only with load_checkpoint(..., load_optimizer_states=False) where the module file holds them "
                "(ZeRO stages 0-2)")
        found.append(present[0])
    return found


def refuse_unsupported(folder: Path, tensor_parallel: bool = False) -> None:
    """Model-parallel (unless `tensor_parallel`: AutoTP's, tensor_parallel.py) and expert (MoE) checkpoints: files
    crew does not read."""
    parallel = [] if tensor_parallel else sorted(path.name for path in folder.glob("*mp_rank_0[1-9]*")
                                                 if path.is_file())
    experts = sorted(path.name for path in folder.glob("*expert_*") if path.is_file())
    layers = sorted(path.name for path in folder.glob("layer_*-model_states.pt"))
    for names, what in ((parallel, "tensor (model) parallel ranks"), (experts, "mixture-of-experts layers"),
                        (layers, "pipeline-parallel layers")):
        if names:
            raise CheckpointError(
                f"{folder} holds {names[0]}: a DeepSpeed checkpoint with {what}, which crew does not read (it "
                "reads ZeRO stages 0-3 of data-parallel training). Convert it to one fp32 state dict with "
                "DeepSpeed's zero_to_fp32.py or ds_to_universal.py, then load that into the model.")
