"""Records what DeepSpeed 0.19.8's own deepspeed.utils.zero_to_fp32 (and Lightning 2.6.6's converter, which
calls it) returns on DeepSpeed-written checkpoints, into expected.json beside this file. Not a test:
tests/deepspeed/test_zero_to_fp32.py runs crew's zero_to_fp32 on the same folders and compares.

    cd /work/main   # the repository root
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /opt/dsvenv/bin/python tests/deepspeed/zero_to_fp32_data/make_expected.py

/opt/dsvenv: torch 2.13.0+cpu, deepspeed 0.19.8, lightning 2.6.6, huggingface_hub, safetensors. The folders read:
every case of tests/runtime/checkpoint/deepspeed_data/ (ZeRO stages 0-3, fp32/bf16, written by its own
generator) and the cases written here ("frozen_*": a model with a frozen layer and a tied weight, which those
cases lack, at stages 2 and 3; written first by `torchrun --nproc_per_node 2 make_expected.py save`, one
optimizer step each). Tensors are recorded by dtype, shape and a sha256 of their bytes: equal digests mean
bitwise equal tensors. Paths in error messages are written relative to the case's folder ("{dir}").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "runtime" / "checkpoint" / "deepspeed_data"
FROZEN_CASES = {"frozen_stage2_fp32": (2, "fp32"), "frozen_stage3_fp32": (3, "fp32"), "frozen_stage3_bf16": (3, "bf16")}
SHARD_SIZE = "0.3KB"  # small enough that every case's weights take several shards, some tensors one alone


class FrozenTiedModel(torch.nn.Module):
    """A frozen layer (DeepSpeed's frozen_param_shapes/fragments), an output layer tied to the input one
    (shared_params), odd sizes (stage 3 pads every parameter to a multiple of the world size), a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(7, 7, bias=False)
        self.frozen = torch.nn.Linear(7, 11)
        self.mid = torch.nn.Linear(11, 7)
        self.out = torch.nn.Linear(7, 7, bias=False)
        self.out.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.frozen(self.embed(x)))))) * self.scale


def digest(tensor: torch.Tensor) -> list:
    """[dtype, shape, sha256 of the bytes]: equal for bitwise equal tensors."""
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8) if flat.numel() and flat.dtype != torch.bool else flat.to(torch.uint8)
    return [str(tensor.dtype), list(tensor.shape), hashlib.sha256(data.numpy().tobytes()).hexdigest()[:24]]


def state_summary(state: dict) -> dict:
    """A state dict as ordered [name, digest] pairs, plus which names hold the very same tensor object."""
    first = {}
    shared = []
    for name, value in state.items():
        if id(value) in first:
            shared.append([name, first[id(value)]])
        else:
            first[id(value)] = name
    return {"tensors": [[name, digest(value)] for name, value in state.items()], "same_object": shared}


def error_summary(error: BaseException, folder: Path) -> list:
    return [type(error).__name__, str(error).replace(str(folder), "{dir}")]


def output_summary(folder: Path) -> dict:
    """Each file an export wrote: tensors (in file order) and, for the index files, their JSON."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json":
            files[path.name] = json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            from safetensors.torch import load_file
            files[path.name] = state_summary(load_file(path))["tensors"]
        else:
            files[path.name] = state_summary(torch.load(path, weights_only=True))["tensors"]
    return files


def model_states_summary(states) -> list:
    return [{"buffers": state_summary(s.buffers)["tensors"],
             "param_shapes": [[[name, list(shape)] for name, shape in group.items()] for group in s.param_shapes],
             "shared_params": s.shared_params, "ds_version": s.ds_version,
             "frozen_param_shapes": None if s.frozen_param_shapes is None else
             [[name, list(shape)] for name, shape in s.frozen_param_shapes.items()],
             "frozen_param_fragments": None if s.frozen_param_fragments is None else
             state_summary(s.frozen_param_fragments)["tensors"]} for s in states]


def attempt(fn, folder: Path):
    try:
        return {"value": fn()}
    except Exception as error:  # the type and message are what is recorded
        return {"error": error_summary(error, folder)}


def record_case(z, save_dir: Path) -> dict:
    """What zero_to_fp32 module `z` gives on one checkpoint folder (run by this generator with DeepSpeed's
    module, and by the test with crew's)."""
    tag = (save_dir / "latest").read_text().strip()
    tag_dir = save_dir / tag
    names = lambda files: [Path(f).name for f in files]  # noqa: E731
    case = {
        "tag": tag,
        "model_state_files": attempt(lambda: names(z.get_model_state_files(str(tag_dir))), save_dir),
        "optim_files": attempt(lambda: names(z.get_optim_files(str(tag_dir))), save_dir),
        "model_state_file": {str(stage): attempt(lambda s=stage: Path(z.get_model_state_file(str(tag_dir), s)).name,
                                                 save_dir) for stage in (0, 3)},
        "parse_model_states": attempt(
            lambda: model_states_summary(z.parse_model_states(z.get_model_state_files(str(tag_dir)))), save_dir),
    }

    def parsed_optim():
        stage, world, groups, paddings = z.parse_optim_states(z.get_optim_files(str(tag_dir)), str(tag_dir))
        return {"zero_stage": int(stage), "world_size": world, "paddings": paddings,
                "groups": [[digest(group) for group in rank] for rank in groups]}

    case["parse_optim_states"] = attempt(parsed_optim, save_dir)
    case["state"] = attempt(lambda: state_summary(z.get_fp32_state_dict_from_zero_checkpoint(str(save_dir))),
                            save_dir)
    case["state_by_tag"] = attempt(lambda: list(z.get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag)),
                                   save_dir)
    case["exclude_frozen"] = attempt(lambda: list(z.get_fp32_state_dict_from_zero_checkpoint(
        str(save_dir), exclude_frozen_parameters=True)), save_dir)

    def lazy():
        state = z.get_fp32_state_dict_from_zero_checkpoint(str(save_dir), lazy_mode=True)
        return {"types": {name: type(value).__name__ for name, value in state.items()},
                "contiguous": state_summary({name: value.contiguous() for name, value in state.items()})["tensors"],
                "bf16": state_summary(z.to_torch_tensor(state, dtype="bf16"))["tensors"],
                "empty": [[name, str(t.dtype), list(t.shape)] for name, t in
                          z.to_torch_tensor(state, return_empty_tensor=True, dtype=torch.float16).items()]}

    case["lazy"] = attempt(lazy, save_dir)
    convert = z.convert_zero_checkpoint_to_fp32_state_dict
    for label, kwargs in {"default": {}, "sharded": {"max_shard_size": SHARD_SIZE},
                          "sharded_safe": {"max_shard_size": SHARD_SIZE, "safe_serialization": True},
                          "unsharded": {"max_shard_size": None}}.items():
        with tempfile.TemporaryDirectory() as out:
            outcome = attempt(lambda o=out, k=kwargs: convert(str(save_dir), o, **k), save_dir)
            case[f"convert_{label}"] = outcome if "error" in outcome else output_summary(Path(out))
    with tempfile.TemporaryDirectory() as out:
        outcome = attempt(lambda: z.convert_zero_checkpoint_to_state_dict(str(save_dir), out, dtype="bfloat16",
                                                                          max_shard_size=None), save_dir)
        case["convert_bf16"] = outcome if "error" in outcome else output_summary(Path(out))
    return case


def record_lightning(save_dir: Path) -> dict:
    """Lightning's convert_zero_checkpoint_to_fp32_state_dict: the keys of the file it writes and its weights."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    with tempfile.TemporaryDirectory() as out:
        def convert():
            convert_zero_checkpoint_to_fp32_state_dict(str(save_dir), Path(out) / "lightning.pt")
            written = torch.load(Path(out) / "lightning.pt", weights_only=False)
            return {"keys": sorted(written), "state_dict": state_summary(written["state_dict"])["tensors"]}
        return attempt(convert, save_dir)


def cases() -> dict[str, Path]:
    found = {path.name: path for path in sorted(FIXTURES.iterdir()) if (path / "latest").is_file()}
    found.update({name: HERE / name for name in FROZEN_CASES})
    return found


def record() -> None:
    import deepspeed
    import deepspeed.utils.zero_to_fp32 as z

    document = {"made_by": "make_expected.py", "versions": {"deepspeed": deepspeed.__version__,
                                                             "torch": torch.__version__},
                "shard_size": SHARD_SIZE, "cases": {}}
    for name, save_dir in cases().items():
        print(f"--- {name}", flush=True)
        document["cases"][name] = {**record_case(z, save_dir), "lightning": record_lightning(save_dir)}
    with tempfile.TemporaryDirectory() as empty:
        document["no_latest"] = attempt(lambda: z.get_fp32_state_dict_from_zero_checkpoint(empty), Path(empty))
        document["no_tag"] = attempt(lambda: z.get_fp32_state_dict_from_zero_checkpoint(empty, tag="nope"),
                                     Path(empty))
        document["no_folder"] = attempt(lambda: z.get_model_state_file(str(Path(empty) / "nope"), 2), Path(empty))
        document["no_files"] = attempt(lambda: z.get_optim_files(empty), Path(empty))
    document["partitioned_param_info"] = [[n, w, list(z.zero3_partitioned_param_info(n, w))]
                                          for n in (1, 7, 8, 77) for w in (1, 2, 3, 4)]
    (HERE / "expected.json").write_text(json.dumps(document, indent=1) + "\n")


def save() -> None:
    """Under torchrun: the frozen_* checkpoints, one optimizer step each."""
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    for name, (stage, precision) in FROZEN_CASES.items():
        torch.manual_seed(0)
        model = FrozenTiedModel()
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                               model_parameters=[p for p in model.parameters() if p.requires_grad])
        generator = torch.Generator().manual_seed(dist.get_rank())
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        loss = engine(torch.randn(2, 7, generator=generator).to(dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0:
            shutil.rmtree(HERE / name, ignore_errors=True)
        dist.barrier()
        engine.save_checkpoint(str(HERE / name))
        dist.barrier()
        if dist.get_rank() == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                (HERE / name / script).unlink(missing_ok=True)


def main() -> None:
    if sys.argv[1:] == ["save"]:
        save()
        return
    if sys.argv[1:] != ["record"]:
        torchrun = Path(sys.executable).parent / "torchrun"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", __file__, "save"], env=env, check=True)
    record()


if __name__ == "__main__":
    main()
