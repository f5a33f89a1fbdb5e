"""The job benchmarks/deepspeed_roundtrip.py runs, unchanged, under real DeepSpeed (torchrun, /opt/dsvenv) and
under crew (`crew run --as_deepspeed`): `import deepspeed` is one or the other. Every phase loops over the cases
(ZeRO stage x precision) in one pair of processes and writes <out>/<phase>.json from rank 0:

    ds_save    DeepSpeed trains K steps and saves A/<case>; a fresh engine loads A and trains M steps
    crew       crew loads A, trains the same M steps, saves B/<case> (its fp32 masters beside, masters.pt) and
               trains M more steps
    ds_load    DeepSpeed loads B and trains those M more steps
    tools      one process, no process group: the tools read B (DeepSpeed's zero_to_fp32 and ds_to_universal, and
               Lightning's converter, in /opt/dsvenv; Lightning's converter on crew's shim in crew's venv)

A case that fails records its error (type and first line) and the job goes on to the next case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

K_STEPS, M_STEPS, MICRO, ACCUMULATION, WORLD = 3, 3, 4, 2, 2


# the DeepSpeed fixtures' model (odd sizes: the flat partitions and stage-3 slices need padding; a buffer), plain
# torch, importable under either engine
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime" / "checkpoint" / "deepspeed_data"))
from make_checkpoints import TinyModel  # noqa: E402


def config(stage: int, precision: str) -> dict:
    """The issue's setup: DeepSpeed's "Adam" (on a CPU it builds its CPU Adam for it) and WarmupDecayLR."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02,
                                                               "warmup_num_steps": 4, "total_num_steps": 20}},
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}


def batch(step: int, micro_step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro_step + rank)
    inputs = torch.randn(MICRO, 9, generator=generator)
    return inputs, inputs[:, :5].sin() + 0.1 * torch.randn(MICRO, 5, generator=generator)


def engine_for(deepspeed, stage: int, precision: str, seed: int):
    torch.manual_seed(seed)
    model = TinyModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, precision))
    return engine


def train(engine, steps: range, precision: str) -> list[float]:
    """Each optimizer step's loss: its micro steps' losses averaged over the micro steps and the ranks."""
    import deepspeed.comm as dist
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    losses = []
    for step in steps:
        total = torch.zeros(())
        for micro_step in range(ACCUMULATION):
            inputs, targets = batch(step, micro_step, dist.get_rank())
            loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), targets)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (ACCUMULATION * dist.get_world_size()))
    return losses


def masters(engine) -> dict[str, torch.Tensor]:
    """The fp32 master weights by name (a collective at stages 1-3), and the buffer."""
    from deepspeed.utils import safe_get_full_fp32_param
    weights = {name: safe_get_full_fp32_param(param).detach().float().cpu().clone()
               for name, param in engine.module.named_parameters()}
    weights["scale"] = engine.module.scale.detach().float().cpu().clone()
    return weights


def failure(error: BaseException) -> str:
    """The error's type and first line; where it was raised when it has no message (a bare assert)."""
    message = (str(error).strip().splitlines() or [""])[0][:300]
    if not message:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        message = f"at {Path(frame.filename).name}:{frame.lineno} {frame.line}"
    return f"{type(error).__name__}: {message}"


def run_phase(phase: str, out: Path, cases: list[str]) -> None:
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for case in cases:
        stage, precision = int(case[5]), case.split("_")[1]
        try:
            results[case] = globals()[f"_{phase}"](deepspeed, out, case, stage, precision)
        except Exception as error:  # reported in the table, the next case runs
            results[case] = {"error": failure(error)}
        dist.barrier()
    if dist.get_rank() == 0:
        (out / f"{phase}.json").write_text(json.dumps(results, indent=1))


def _ds_save(deepspeed, out, case, stage, precision) -> dict:
    engine = engine_for(deepspeed, stage, precision, seed=0)
    saved = train(engine, range(K_STEPS), precision)
    engine.save_checkpoint(str(out / "A" / case))
    engine = engine_for(deepspeed, stage, precision, seed=99)
    engine.load_checkpoint(str(out / "A" / case))
    return {"saved": saved, "resume": train(engine, range(K_STEPS, K_STEPS + M_STEPS), precision)}


def _crew(deepspeed, out, case, stage, precision) -> dict:
    engine = engine_for(deepspeed, stage, precision, seed=99)
    engine.load_checkpoint(str(out / "A" / case))
    resume = train(engine, range(K_STEPS, K_STEPS + M_STEPS), precision)
    engine.save_checkpoint(str(out / "B" / case))
    weights = masters(engine)
    if deepspeed.comm.get_rank() == 0:
        torch.save(weights, out / "B" / case / "masters.pt")
    return {"resume": resume, "next": train(engine, range(K_STEPS + M_STEPS, K_STEPS + 2 * M_STEPS), precision)}


def _ds_load(deepspeed, out, case, stage, precision) -> dict:
    engine = engine_for(deepspeed, stage, precision, seed=99)
    path, _ = engine.load_checkpoint(str(out / "B" / case))
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {out / 'B' / case}")
    return {"next": train(engine, range(K_STEPS + M_STEPS, K_STEPS + 2 * M_STEPS), precision)}


# -- tools, one process --------------------------------------------------------------------------------------

def max_difference(state: dict, expected: dict) -> float:
    """The largest absolute difference over the expected tensors (inf when a name is missing)."""
    worst = 0.0
    for name, value in expected.items():
        if name not in state:
            return float("inf")
        got = state[name]
        if isinstance(got, dict):  # ds_to_universal's fp32.pt: {"param": ..., ...}
            got = got["param"]
        got = got.float().reshape(-1)[:value.numel()].view(value.shape)
        worst = max(worst, (got - value).abs().max().item())
    return worst


def verdict(read, crews: Path, theirs: Path, expected: dict) -> str:
    """A tool on crew's checkpoint: "ok" when it gives crew's fp32 masters bitwise; "n/a" when it fails on
    DeepSpeed's own checkpoint of the case too (zero_to_fp32 and ds_to_universal read ZeRO 1-3 only)."""
    try:
        difference = max_difference(read(crews), expected)
    except Exception as error:  # reported in the table
        try:
            read(theirs)
        except Exception as same:  # the tool does not read DeepSpeed's own either
            return f"n/a (fails on DeepSpeed's own too: {type(same).__name__})"
        return f"FAILED ({failure(error)[:120]})"
    return "ok" if difference == 0 else f"differs by {difference:.2e}"


def tools(out: Path, cases: list[str], which: str) -> None:
    readers = {"lightning": _lightning} if which == "crew" else {
        "zero_to_fp32": _zero_to_fp32, "lightning": _lightning, "ds_to_universal": _universal}
    results = {}
    for case in cases:
        crews, theirs = out / "B" / case, out / "A" / case
        if (crews / "masters.pt").is_file():
            expected = torch.load(crews / "masters.pt", weights_only=True)
            results[case] = {}
            for tool, read in readers.items():
                compared = {k: v for k, v in expected.items() if tool != "ds_to_universal" or k != "scale"}
                name = f"{tool}_on_crew" if which == "crew" else tool  # ds_to_universal: parameters only
                results[case][name] = verdict(read, crews, theirs, compared)
    (out / f"tools_{which}.json").write_text(json.dumps(results, indent=1))


def _lightning(folder: Path) -> dict:
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    with tempfile.TemporaryDirectory() as scratch:
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), Path(scratch) / "model.pt")
        return torch.load(Path(scratch) / "model.pt", weights_only=False)["state_dict"]


def _zero_to_fp32(folder: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    with tempfile.TemporaryDirectory() as scratch:
        convert_zero_checkpoint_to_fp32_state_dict(str(folder), scratch, max_shard_size=None)
        return torch.load(Path(scratch) / "pytorch_model.bin", weights_only=True)


def _universal(folder: Path) -> dict:
    """ds_to_universal (--inject_missing_state: the universal_checkpoint_info Megatron adds); its fp32 weights."""
    tag = (folder / "latest").read_text().strip()
    with tempfile.TemporaryDirectory() as scratch:
        run = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                              str(folder / tag), "--output_folder", scratch, "--num_extract_workers", "1",
                              "--num_merge_workers", "1", "--inject_missing_state"], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError((run.stderr.strip().splitlines() or ["no output"])[-1])
        zero = Path(scratch) / "zero"
        weights = {path.parent.name: torch.load(path, weights_only=False) for path in zero.glob("*/fp32.pt")}
        if not weights:
            raise RuntimeError(f"ds_to_universal wrote no {zero}/<param>/fp32.pt")
        return weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["ds_save", "crew", "ds_load", "tools"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cases", required=True, help="comma-separated, e.g. stage0_fp32,stage3_bf16")
    parser.add_argument("--which", choices=["deepspeed", "crew"], default="deepspeed")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = args.cases.split(",")
    if args.phase == "tools":
        tools(args.out, cases, args.which)
    else:
        run_phase(args.phase, args.out, cases)


if __name__ == "__main__":
    main()
