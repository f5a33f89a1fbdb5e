"""The job benchmarks/comm.py runs: a DeepSpeed script (deepspeed.initialize with a config dict, Adam, an MLP) that
counts the collectives of one optimizer step per configuration with tests/commcount.py.

The same file runs under DeepSpeed (torchrun from DeepSpeed's venv) and under `crew run --as_deepspeed`. One job
runs several configurations one after the other (one start-up for all): each builds its model and engine,
makes --measure_step optimizer steps untouched (start-up, DeepSpeed's stage-3 trace on the first step), counts
the next one (all its micro steps), then drops the engine. Each rank writes
`<out>/<tag>.rank<r>.json`: per configuration the counts, the parameter count, and ru_maxrss after it (only
the first configuration's is its own: a job's first configuration is the one whose RSS is reported).
"""

import argparse
import gc
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # commcount: no crew import

import commcount  # noqa: E402

COUNTER = commcount.CommCounter()
COUNTER.install()  # before deepspeed.initialize: DeepSpeed keeps torch's all-gather function from then on

import torch  # noqa: E402

import deepspeed  # noqa: E402  (crew under --as_deepspeed)

BLOCKS, MICRO_BATCH = 3, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model(width: int) -> torch.nn.Module:
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*layers)


def param_count(width: int) -> int:
    return BLOCKS * (8 * width * width + 5 * width)


def ds_config(run: dict) -> dict:
    zero = {"stage": run["stage"], **run.get("zero", {})}
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": run["ga"],
            "steps_per_print": 10**9, "bf16": {"enabled": run["dtype"] == "bf16"},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": zero}


def optimizer_step(engine, width: int, dtype: torch.dtype, ga: int, generator: torch.Generator) -> None:
    for _ in range(ga):
        inputs = torch.randn(MICRO_BATCH, width, generator=generator).to(dtype)
        loss = engine(inputs).float().pow(2).mean()
        engine.backward(loss)
        engine.step()


def measure(run: dict, width: int, measure_step: int) -> dict:
    """Builds the engine, steps `measure_step` times, counts the next optimizer step."""
    config, dtype = ds_config(run), DTYPES[run["dtype"]]
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=run["stage"] == 3):
        model = make_model(width)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
    for _ in range(measure_step):
        optimizer_step(engine, width, dtype, run["ga"], generator)
    with COUNTER.measure():
        optimizer_step(engine, width, dtype, run["ga"], generator)
    del engine, model
    gc.collect()
    return {**run, "counts": COUNTER.summary(), "params": param_count(width),
            "dtype_bytes": torch.tensor([], dtype=dtype).element_size(),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--runs", required=True, help="JSON list of {stage, dtype, ga, variant, zero}")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--measure_step", type=int, default=3)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = [measure(run, args.width, args.measure_step) for run in json.loads(args.runs)]
    rank = int(os.environ.get("RANK", 0))
    (Path(args.out) / f"{args.tag}.rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
