"""Ulysses sequence parallelism and AutoTP tensor parallelism on CPU ranks: step time and peak memory per rank,
crew's engine beside plain torch DDP and DeepSpeed 0.19.8.

4 ranks (gloo, one thread each) on this machine, fp32, AdamW (lr 1e-4, clip 1.0), ZeRO stage 0 (--stage),
micro batch 1; each configuration is a job of its own (a fresh process per rank, so that its memory is its own).

(a) Ulysses SP on a small Llama (hidden 256, 2 layers, 4 heads of 64, 4 kv heads, MLP 1024, vocab 1024,
    2.6M parameters, transformers' "sdpa" attention), one sequence of L tokens per SP group and step, for
    L = 256, 1k, 4k, 8k:
    * ddp: plain torch DistributedDataParallel, the whole sequence on each rank (4 sequences a step);
    * crew sp1 / deepspeed sp1: the engine without SP (4 sequences a step);
    * crew spN / deepspeed spN, N = 2, 4: UlyssesSPAttentionHF.register_with_transformers + initialize(mpu=)
      + UlyssesSPDataLoaderAdapter, the loss gathered over the SP group as transformers'
      deepspeed_sp_compute_loss does (4 / N sequences a step, each split over N ranks);
    the script is the same for crew (`crew run --as_deepspeed`: `import deepspeed` is crew) and DeepSpeed.
(b) AutoTP on a larger Llama (hidden 512, 4 layers, 8 heads, 4 kv heads, MLP 2048: 15.7M parameters), one
    sequence of 512 tokens per TP group and step: `"tensor_parallel": {"autotp_size": N}` in the config,
    N = 1, 2, 4 (N = 1: data parallelism over the 4 ranks), and plain DDP.

Memory: the rank's resident set. After set-up (imports, model, engine, data) the kernel's high-water mark is
reset (`echo 5 > /proc/self/clear_refs`); "set-up" is the RSS at that moment (the parameters: sharded under
TP), "step peak" the high-water mark over the warm-up and timed steps minus it: the gradients, the Adam
state (made at the first step, the same for every SP size), and what grows with the tokens a rank holds:
activations kept for the backward, attention and MLP temporaries, logits, the all-to-all buffers. glibc
serves large tensors with mmap and returns them at once, so the high-water mark follows the live bytes
within a few MiB; the figure is the largest over the ranks. torch has no allocator statistics on the CPU.

Step time: the median over the timed steps on rank 0; tokens/s = tokens trained per step (all ranks) / step
time. 4 ranks share this machine's 2 cores: the times show how the work splits, not a GPU's speed.
"rank 0 loss": rank 0's first step trains the same sequence in every SP configuration (the first of its
SP group), so the figure must agree down a column of one length (it does across libraries too).

    .venv/bin/python benchmarks/parallel.py --quick       # L = 256, 1k, 4k; 1 warm-up + 2 timed steps
    .venv/bin/python benchmarks/parallel.py               # L up to 8k; 1 warm-up + 3 timed steps
    .venv/bin/python benchmarks/parallel.py --deepspeed-python /opt/dsvenv/bin/python   # DeepSpeed beside
    .venv/bin/python benchmarks/parallel.py --only sp     # or tp
    .venv/bin/python benchmarks/parallel.py --only tp --stage 3   # the engines at ZeRO 3 (TP slices sharded too)

Memory: up to about 1.5 GB per rank at 8k tokens without SP.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

RANKS, LR, CLIP = 4, 1e-4, 1.0
SP_SIZES, TP_SIZES = (1, 2, 4), (1, 2, 4)
MIB = 2**20
SP_MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4}
TP_MODEL = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4}
VOCAB, TP_LENGTH = 1024, 512


# --------------------------------------------------------------------------------------------------
# the worker: one process per rank


def status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def reset_peak() -> int:
    """Resets the kernel's RSS high-water mark; returns the RSS now, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS") * 1024


def llama(shape: dict, length: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**shape, vocab_size=VOCAB, max_position_embeddings=max(length, 256),
                                        attn_implementation="sdpa"))


def sample(seed: int, index: int, length: int) -> dict:
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1000 * seed + index))
    return {"input_ids": ids, "position_ids": torch.arange(length)[None], "labels": ids.clone()}


def ds_config(tp: int = 1, stage: int = 0) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def ddp_step(model, batches):
    """Plain torch: DDP with its defaults, clip_grad_norm_, AdamW."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)

    def step() -> float:
        batch = next(batches)
        loss = ddp(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def engine_step(model, batches, config: dict, mpu=None):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)

    def step() -> float:
        batch = next(batches)
        loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


class _GatherLosses(torch.autograd.Function):
    """torch.distributed.nn.functional.all_gather's values and gradient (each rank gets the sum over the group
    of its slot's gradients, as its reduce-scatter backward gives on NCCL). Its gloo backward is an all-to-all
    made of scatters whose source is the group rank passed as a global rank (torch 2.13): it fails on any SP
    group that does not start at rank 0, so it cannot run here with SP 2 on 4 ranks."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(gathered, tensor.contiguous(), group=group)
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[torch.distributed.get_rank(ctx.group)], None


def sp_engine_step(model, rank: int, sp: int, length: int, count: int):
    """Ulysses SP as Accelerate and Trainer set it up, and deepspeed_sp_compute_loss's loss."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1,
        seq_length=length, seq_length_is_variable=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(), mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    # each rank's loader gives its own sequences; the adapter trains them in turn over the SP group
    loader = [sample(rank, i, length) for i in range(-(-count // sp))]
    batches = iter(UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                              sp_world_size=sp, device=torch.device("cpu")))

    def step() -> float:
        batch = next(batches)
        batch["labels"] = batch["shift_labels"]
        loss = engine(**batch).loss
        losses = _GatherLosses.apply(loss, group)
        goods = _GatherLosses.apply((batch["shift_labels"] != -100).sum(), group)
        loss = (losses * goods).sum() / goods.sum().clamp(min=1)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def worker(args) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    count = args.warmup + args.steps
    if args.library == "ddp":
        torch.distributed.init_process_group("gloo")
    else:
        import deepspeed

        deepspeed.init_distributed("gloo")
    if args.kind == "sp":
        model = llama(SP_MODEL, args.length)
        if args.library != "ddp" and args.size > 1:
            step = sp_engine_step(model, rank, args.size, args.length, count)
        else:
            batches = iter([sample(rank, i, args.length) for i in range(count)])
            step = (ddp_step(model, batches) if args.library == "ddp" else
                    engine_step(model, batches, ds_config(stage=args.stage)))
    else:  # tp: the ranks of a TP group (contiguous, as DeepSpeed's) train the same sequence
        model = llama(TP_MODEL, TP_LENGTH)
        batches = iter([sample(rank // args.size, i, TP_LENGTH) for i in range(count)])
        step = ddp_step(model, batches) if args.library == "ddp" else engine_step(model, batches,
                                                                                  ds_config(args.size, args.stage))
    setup = reset_peak()
    times, losses = [], []
    for _ in range(count):
        started = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - started)
    result = {"times": times[args.warmup:], "loss": losses[0], "setup": setup,
              "peak": status_kib("VmHWM") * 1024 - setup}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------------
# the harness


def command(library: str, args, deepspeed_python: str | None) -> tuple[list[str], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if library == "deepspeed":
        torchrun = str(Path(deepspeed_python).parent / "torchrun")
        return [torchrun, "--standalone", "--nproc_per_node", str(RANKS), __file__], {**env, "DS_ACCELERATOR": "cpu"}
    crew = [sys.executable, "-m", "crew", "run", "--num_gpus", str(RANKS)]
    return crew + (["--as_deepspeed"] if library == "crew" else []) + [__file__], env


def run_one(kind: str, library: str, size: int, length: int, args) -> list[dict] | str:
    """One job of RANKS ranks; each rank's figures, or why it failed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _jobs import run_job

    with tempfile.TemporaryDirectory() as out:
        argv, env = command(library, args, args.deepspeed_python)
        argv += ["--worker", "--kind", kind, "--library", library, "--size", str(size), "--length", str(length),
                 "--warmup", str(args.warmup), "--steps", str(args.steps), "--stage", str(args.stage), "--out", out]
        done = run_job(argv, None, env, args.timeout)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
            return f"failed (exit {done.returncode}): {(lines or done.stderr.splitlines() or [''])[-1][-200:]}"
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(RANKS)]


def libraries(args) -> list[str]:
    return ["crew"] + (["deepspeed"] if args.deepspeed_python else [])


def row(label: str, size: int, tokens: int, result: list[dict] | str) -> str:
    dp = RANKS // size
    if isinstance(result, str):
        return f"{label:<14} {size:>3} {dp:>3} | {result}"
    step = statistics.median(result[0]["times"])
    setup = max(r["setup"] for r in result) / MIB
    peak = max(r["peak"] for r in result) / MIB
    return (f"{label:<14} {size:>3} {dp:>3} | {tokens:>7} {step:8.3f} {tokens / step:9.0f} | {setup:7.0f} "
            f"{peak:7.0f} | {result[0]['loss']:.5f}")


HEADER = (f"{'mode':<14} {'{}':>3} {'DP':>3} | {'tokens':>7} {'step s':>8} {'tokens/s':>9} | {'set-up':>7} "
          f"{'step pk':>7} | rank 0 loss")


def sp_table(args) -> None:
    print(f"(a) Ulysses SP: {SP_MODEL}, vocab {VOCAB}; {RANKS} ranks; memory MiB per rank (largest rank)")
    print(HEADER.format("SP"))
    for length in args.lengths:
        print(f"-- L = {length} tokens " + "-" * 60)
        print(row("ddp", 1, RANKS * length, run_one("sp", "ddp", 1, length, args)), flush=True)
        for library in libraries(args):
            for sp in SP_SIZES:
                result = run_one("sp", library, sp, length, args)
                print(row(f"{library} sp{sp}", sp, RANKS // sp * length, result), flush=True)


def tp_table(args) -> None:
    print(f"(b) AutoTP: {TP_MODEL}, vocab {VOCAB}; {RANKS} ranks, {TP_LENGTH} tokens per TP group and step; "
          "memory MiB per rank (largest rank)")
    print(HEADER.format("TP"))
    print(row("ddp", 1, RANKS * TP_LENGTH, run_one("tp", "ddp", 1, TP_LENGTH, args)), flush=True)
    for library in libraries(args):
        for tp in TP_SIZES:
            result = run_one("tp", library, tp, TP_LENGTH, args)
            print(row(f"{library} tp{tp}", tp, RANKS // tp * TP_LENGTH, result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 256, 1k, 4k and 2 timed steps")
    parser.add_argument("--lengths", default="256,1024,4096,8192", help="SP sequence lengths (tokens)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per job (default 3)")
    parser.add_argument("--only", choices=("sp", "tp"), help="one of the two tables")
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3),
                        help="the engines' ZeRO stage (default 0; ddp rows are plain DDP whatever it is)")
    parser.add_argument("--deepspeed_python", "--deepspeed-python", default=None,
                        help="a Python with deepspeed 0.19.8 (e.g. /opt/dsvenv/bin/python): its rows beside crew's")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.lengths, args.steps = "256,1024,4096", 2
    args.lengths = [int(x) for x in args.lengths.split(",")]
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {RANKS} CPU ranks (gloo, 1 thread each) on {os.cpu_count()} cores; fp32, "
          f"AdamW lr {LR}, clip {CLIP}, ZeRO {args.stage}, micro batch 1; {args.warmup} warm-up + {args.steps} "
          "timed steps; "
          f"DeepSpeed: {args.deepspeed_python or 'not run (--deepspeed-python)'}")
    if args.only in (None, "sp"):
        sp_table(args)
    if args.only in (None, "tp"):
        tp_table(args)
    print("set-up = RSS once the model, engine and data are built; step pk = the RSS high-water mark over the "
          "steps above set-up\n(gradients, Adam state, activations, temporaries, communication buffers); "
          "tokens = trained per step, all ranks")
    print(f"benchmark wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
