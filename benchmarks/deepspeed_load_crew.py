"""Real DeepSpeed 0.19.8 loads crew's checkpoints and trains on with crew's own next losses (a check run by hand).

crew (2 ranks, gloo) trains a small MLP 3 steps at ZeRO stages 0-3 (fp32 and bf16; DeepSpeed's "Adam" with
torch_adam true and false, and with offload_optimizer at stages 1-3), saves, and records its next 3 losses; then
DeepSpeed (its venv, same config, same model and batches) loads each checkpoint with load_checkpoint and trains 3
steps. The table shows the largest relative difference between the two; fp32 should agree to ~1e-6.

    .venv/bin/python benchmarks/deepspeed_load_crew.py [--dsvenv /opt/dsvenv] [--out /tmp/ds_load_crew]
        [--only stage1_fp32_torchadam,...]

FusedAdam's CPU build and DeepSpeedCPUAdam are C++ ops DeepSpeed compiles on first use (a minute each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
SAVE_AT, END = 3, 6
# DeepSpeed's "Adam" builds torch's AdamW with torch_adam, else FusedAdam (its CPU build here), and with
# offload_optimizer DeepSpeedCPUAdam (ZeRO only)
OPTIMIZERS = ("torchadam", "fusedadam", "cpuadam")
CASES = {f"stage{stage}_{precision}_{kind}": (stage, precision, kind) for stage in (0, 1, 2, 3)
         for precision in ("fp32", "bf16") for kind in OPTIMIZERS if stage or kind != "cpuadam"}


def config(stage: int, precision: str, kind: str) -> dict:
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if kind == "cpuadam" else {})}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01,
                                                     "torch_adam": kind == "torchadam"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5}},
            "zero_optimization": zero, "bf16": {"enabled": precision == "bf16"}}


def model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def steps(engine, rank: int, until: int) -> list[float]:
    import torch

    losses = []
    while engine.global_steps < until:
        generator = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
        inputs = torch.randn(4, 8, generator=generator)
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), inputs.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def worker(side: str, out: Path, names: list[str]) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    if side == "crew":
        import crew

        for name in names:
            engine, *_ = crew.initialize(model=model(), config=config(*CASES[name]))
            steps(engine, rank, SAVE_AT)
            engine.save_checkpoint(out / name, client_state={"saved_by": "crew"})
            results[name] = {"losses": steps(engine, rank, END)}
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        for name in names:
            net = model()
            engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config(*CASES[name]))
            path, client = engine.load_checkpoint(out / name)
            results[name] = {"losses": steps(engine, rank, END), "loaded": path, "optimizer": type(
                engine.optimizer).__name__, "client_saved_by": (client or {}).get("saved_by")}
    (out / f"{side}_rank{rank}.json").write_text(json.dumps(results))


def run(side: str, python: Path, out: Path, names: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if side == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    command = [str(python.parent / "torchrun"), "--standalone", "--nproc_per_node", "2", str(HERE), "--worker", side,
               "--out", str(out), "--only", ",".join(names)]
    subprocess.run(command, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsvenv", default="/opt/dsvenv")
    parser.add_argument("--out", default="/tmp/ds_load_crew")
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    names = args.only.split(",") if args.only else list(CASES)
    if args.worker:
        worker(args.worker, out, names)
        return
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run("crew", Path(sys.executable), out, names)
    run("deepspeed", Path(args.dsvenv) / "bin" / "python", out, names)
    print(f"{'case':28} {'DeepSpeed optimizer':24} {'max rel diff':>12}  crew losses / DeepSpeed's (rank 0)")
    for name in names:
        crew_runs = [json.loads((out / f"crew_rank{r}.json").read_text())[name] for r in (0, 1)]
        ds_runs = [json.loads((out / f"deepspeed_rank{r}.json").read_text())[name] for r in (0, 1)]
        diff = max(abs(a - b) / abs(a) for c, d in zip(crew_runs, ds_runs) for a, b in zip(c["losses"], d["losses"]))
        assert ds_runs[0]["client_saved_by"] == "crew", ds_runs[0]
        print(f"{name:28} {ds_runs[0]['optimizer']:24} {diff:12.2e}  "
              f"{[round(x, 6) for x in crew_runs[0]['losses']]} / {[round(x, 6) for x in ds_runs[0]['losses']]}")


if __name__ == "__main__":
    main()
