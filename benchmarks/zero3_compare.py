"""A Hugging Face Trainer script at ZeRO stage 3, unchanged, under DeepSpeed 0.19.8 and under crew: per-step
losses of a tiny model, and per-rank memory of a ~100M-parameter model built by from_pretrained under zero.Init.

    .venv/bin/python benchmarks/zero3_compare.py --deepspeed_python /path/to/venv-with-deepspeed/bin/python
        [--parts losses,memory] [--engines deepspeed,crew] [--steps 12] [--big_steps 2] [--repeat 1]
        [--mmap_threshold BYTES]

The script (benchmarks/_hf_zero3.py) is in the shape of transformers' DeepSpeed docs: a ZeRO-3 config with
"auto" values, fp32, TrainingArguments(deepspeed=dict) before from_pretrained (so the model is built under
deepspeed.zero.Init and loaded through transformers' ZeRO-3 path), Trainer. Both engines run it with 2 ranks
on this machine's CPU: DeepSpeed as its users start it, `deepspeed --num_gpus 2 train.py ...`
(DS_ACCELERATOR=cpu), crew as `crew run --as_deepspeed --num_gpus 2 train.py ...`. On a machine without
GPUs, Accelerate (which Trainer runs on) counts a world of one per rank and DeepSpeed's batch-size check
stops a 2-rank run; DeepSpeed's ranks get crew's rank site (standard library only) on their path with
CREW_DEEPSPEED_ON_CPU=1, which hands Accelerate gloo over the launched ranks exactly as under --as_deepspeed
(benchmarks/hf_compare.py ran DeepSpeed with 1 process).

* losses: a tiny GPT-2 (2 layers, width 32, vocabulary 100) written with save_pretrained, --steps optimizer
  steps (micro batch 4, accumulation 2, AdamW, WarmupLR, clipping 1.0), evaluated at the start and the end:
  loss, grad norm and learning rate per step side by side, against the issue's bound (1e-4 relative).
* memory: a GPT-2 of 100.6M parameters (12 layers, width 768, vocabulary 20000, 256 positions; 384 MiB in
  fp32), --big_steps steps of micro batch 2 x 32 tokens, built (a) by from_pretrained under zero.Init and
  (b) outside it (from_pretrained before TrainingArguments: no HfDeepSpeedConfig yet, every rank builds the
  whole model and deepspeed.initialize partitions it), per engine, --repeat times (interleaved; medians).
  Per rank, after the imports, after from_pretrained, after deepspeed.initialize (Trainer's on_train_begin)
  and at the end: resident memory (VmRSS), its peak so far (resource.getrusage ru_maxrss), and the bytes of
  the tensors alive (a gc census of distinct storages: what the process holds, without the freed memory
  glibc's malloc keeps, which is most of the gap between the two and varies from run to run); and the
  parameter elements the rank holds right after from_pretrained (its ZeRO partitions plus every
  parameter's .data). Two things to read the figures by: transformers' ZeRO-3 loading path reads the whole
  checkpoint on rank 0 (map_location "cpu"; "meta" on the others), so rank 0 touches the whole model's
  bytes under either engine; and outside zero.Init the weights from_pretrained returns are views of the
  memory-mapped safetensors file, resident only once touched (by deepspeed.initialize).

glibc's malloc serves a block from its heap, and keeps it there once freed, when the block is below its mmap
threshold, which grows (up to 32 MiB) each time a larger mmap-ed block is freed. A step that allocates and
frees many large buffers then leaves them resident: `--mmap_threshold 131072` fixes the threshold at glibc's
starting value (MALLOC_MMAP_THRESHOLD_) for both engines' ranks, so that the peak shows what they use.

Exits 1 when the losses miss the bound or a run fails. One repeat takes about 4 minutes and 3 GB a rank at
most on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _jobs import run_job  # beside this script: on its sys.path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_hf_zero3.py"
LOSS_BOUND = 1e-4  # the bound between DeepSpeed and crew, fp32
MODELS = {"tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 32},
          "gpt2-100m": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 20000, "n_positions": 256}}


@dataclass
class Engine:
    name: str
    command: list[str]  # the launcher and its options, up to the script
    env: dict
    extra: list[str]  # script options of this engine's runs


@dataclass
class Run:
    ranks: list[dict]  # per rank, what _hf_zero3.py recorded
    wall: float

    def steps(self) -> dict[int, dict]:
        return {e["step"]: e for e in self.ranks[0]["log_history"] if "loss" in e}

    def evals(self) -> list[float]:
        return [e["eval_loss"] for e in self.ranks[0]["log_history"] if "eval_loss" in e]


def engines(args: argparse.Namespace) -> list[Engine]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    site = HERE.parent / "crew" / "launcher" / "node" / "site"  # Accelerate gets gloo, as crew's ranks do
    paths = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    deepspeed = Engine("deepspeed", [str(Path(args.deepspeed_python).parent / "deepspeed"), "--num_gpus", "2"],
                       {**env, "DS_ACCELERATOR": "cpu", "CREW_DEEPSPEED_ON_CPU": "1", "PYTHONPATH": paths}, [])
    crew = Engine("crew", [str(Path(sys.executable).parent / "crew"), "run", "--as_deepspeed", "--num_gpus", "2"],
                  env, [])
    return [engine for engine in (deepspeed, crew) if engine.name in args.engines.split(",")]


def write_pretrained(folder: Path, name: str) -> Path:
    """A GPT-2 of MODELS[name], initialised from seed 0, written with save_pretrained."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = folder / name
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODELS[name], bos_token_id=0, eos_token_id=0))
    model.save_pretrained(path)
    return path


def launch(engine: Engine, folder: Path, label: str, pretrained: Path, options: list[str]) -> Run | None:
    out, record = folder / f"{engine.name}-{label}", folder / f"{engine.name}-{label}.json"
    command = [*engine.command, str(SCRIPT), str(pretrained), str(out), "--record", str(record), *options,
               *engine.extra]
    started = time.time()
    proc = run_job(command, cwd=folder, env=engine.env, timeout=1800)
    wall = time.time() - started
    records = [record.with_name(f"{record.stem}.rank{rank}{record.suffix}") for rank in range(2)]
    if proc.returncode or not all(r.exists() for r in records):
        print(f"\n{engine.name} ({label}) failed with code {proc.returncode}: {' '.join(command)}\n"
              f"{(proc.stdout + proc.stderr)[-3000:]}")
        return None
    return Run([json.loads(r.read_text()) for r in records], wall)


def rel_diff(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def fmt(value, spec: str = ".6f") -> str:
    return "-" if value is None else format(value, spec)


def compare_losses(args: argparse.Namespace, folder: Path, runs: dict[str, Run | None]) -> bool:
    """The per-step table of the tiny model; True when both ran and every loss is within LOSS_BOUND."""
    names = [name for name, run in runs.items() if run]
    steps = {name: runs[name].steps() for name in names}
    print(f"\n## Losses: tiny GPT-2 from_pretrained under zero.Init, fp32, 2 ranks, {args.steps} optimizer steps "
          "(loss: the mean over the step's micro batches and ranks)")
    head = "| step |" + "".join(f" {n} loss |" for n in names) + (" rel diff |" if len(names) == 2 else "") \
        + "".join(f" {n} grad norm |" for n in names) + (" rel diff |" if len(names) == 2 else "") \
        + "".join(f" {n} lr |" for n in names)
    print(head + "\n" + "|---" * head.count(" |") + "|")
    worst = {"loss": 0.0, "norm": 0.0, "lr": 0.0}
    for step in sorted(set().union(*(s.keys() for s in steps.values()))):
        entries = [steps[n].get(step, {}) for n in names]
        row = f"| {step} |" + "".join(f" {fmt(e.get('loss'))} |" for e in entries)
        pair = len(names) == 2 and all(entries)
        if pair:
            worst["loss"] = max(worst["loss"], rel_diff(entries[0]["loss"], entries[1]["loss"]))
            worst["lr"] = max(worst["lr"], abs(entries[0]["learning_rate"] - entries[1]["learning_rate"]))
        if len(names) == 2:
            row += f" {fmt(rel_diff(entries[0]['loss'], entries[1]['loss']) if pair else None, '.2e')} |"
        row += "".join(f" {fmt(e.get('grad_norm'))} |" for e in entries)
        if len(names) == 2:
            norms = [e.get("grad_norm") for e in entries]
            diff = rel_diff(*norms) if None not in norms else None
            worst["norm"] = max(worst["norm"], diff or 0.0)
            row += f" {fmt(diff, '.2e')} |"
        print(row + "".join(f" {fmt(e.get('learning_rate'), '.6g')} |" for e in entries))
    for name in names:
        evals = runs[name].evals()
        print(f"{name}: eval loss at the start {fmt(evals[0])}, at the end {fmt(evals[-1])}; wall "
              f"{runs[name].wall:.1f} s")
    if len(names) < 2:
        return False
    counts = [len(steps[n]) for n in names]
    evals = [runs[n].evals() for n in names]
    within = worst["loss"] <= LOSS_BOUND and counts[0] == counts[1] == args.steps and \
        all(rel_diff(a, b) <= LOSS_BOUND for a, b in zip(*evals, strict=True))
    print(f"max rel loss diff {worst['loss']:.2e} (bound {LOSS_BOUND:g}: {'ok' if within else 'OVER'}), "
          f"max rel grad-norm diff {worst['norm']:.2e}, max abs lr diff {worst['lr']:.2e}, eval losses "
          + ", ".join(f"{rel_diff(a, b):.2e}" for a, b in zip(*evals, strict=True)) + " rel apart")
    return within


def median_of(records: list[dict], mark: str, kind: str) -> float:
    return statistics.median(record["marks"][mark][kind] for record in records)


def print_memory(runs: dict[tuple[str, str], list[Run]], numel: int, threshold: int) -> None:
    """Per engine, build and rank: the median over the repeats of each figure (the peak at the end: its range)."""
    repeats = max(len(r) for r in runs.values())
    print(f"\n## Memory per rank: GPT-2 of {numel / 1e6:.1f}M parameters ({numel * 4 / 2**20:.0f} MiB in fp32), "
          f"ZeRO-3, fp32 AdamW, 2 ranks; MiB: RSS now / the peak so far / live tensors, median of {repeats} runs; "
          f"glibc's mmap threshold {threshold or 'its default (dynamic)'}")
    head = ("| engine | model built | rank | after imports | after from_pretrained | after deepspeed.initialize "
            "| at the end | peak range | held after from_pretrained | wall s |")
    print(head + "\n" + "|---" * head.count(" |") + "|")
    for (engine, built), done in runs.items():
        if not done:
            print(f"| {engine} | {built} | - | failed | | | | | | |")
            continue
        for rank in range(2):
            records = [run.ranks[rank] for run in done]
            cells = [" / ".join(f"{median_of(records, mark, kind):.0f}" for kind in ("rss", "peak", "tensors"))
                     for mark in ("imported", "loaded", "initialized", "end")]
            peaks = [r["marks"]["end"]["peak"] for r in records]
            print(f"| {engine} | {built} | {rank} | {' | '.join(cells)} | {min(peaks):.0f}-{max(peaks):.0f} "
                  f"| {records[0]['held'] / 1e6:.1f}M of {records[0]['numel'] / 1e6:.1f}M "
                  f"| {statistics.median(run.wall for run in done):.0f} |")
    print("\nPeak at the end, the larger rank, median (MiB):")
    for built in ("zero.Init", "outside"):
        peaks = {engine: statistics.median(max(r["marks"]["end"]["peak"] for r in run.ranks) for run in done)
                 for (engine, b), done in runs.items() if b == built and done}
        print(f"- built {built}: " + ", ".join(f"{engine} {peak:.0f}" for engine, peak in peaks.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed_python", required=True, help="a Python with deepspeed 0.19.8 and the HF stack")
    parser.add_argument("--parts", default="losses,memory", help="which of: losses, memory")
    parser.add_argument("--engines", default="deepspeed,crew", help="which of: deepspeed, crew")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps of the tiny model")
    parser.add_argument("--big_steps", type=int, default=2, help="optimizer steps of the 100M model")
    parser.add_argument("--repeat", type=int, default=1, help="runs per engine and build of the 100M model")
    parser.add_argument("--mmap_threshold", type=int, default=0,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for every rank (0: glibc's default, a threshold that "
                             "grows as large blocks are freed)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="crew-zero3-compare-"))
    print(f"working in {folder}")
    ok = True
    parts = args.parts.split(",")
    if "losses" in parts:
        tiny = write_pretrained(folder, "tiny")
        runs = {e.name: launch(e, folder, "tiny", tiny, ["--steps", str(args.steps), "--evaluate"])
                for e in engines(args)}
        ok = compare_losses(args, folder, runs) and ok
    if "memory" in parts:
        big = write_pretrained(folder, "gpt2-100m")
        options = ["--steps", str(args.big_steps), "--length", "32", "--batch", "2"]
        builds = {"zero.Init": [], "outside": ["--outside_init"]}
        runs: dict[tuple[str, str], list[Run]] = {(e.name, built): [] for built in builds for e in engines(args)}
        for repeat in range(args.repeat):  # interleaved: drift in the machine's load hits every mode alike
            for (name, built), done in runs.items():
                engine = next(e for e in engines(args) if e.name == name)
                run = launch(engine, folder, f"big-{built}-{repeat}", big, options + builds[built])
                ok = ok and run is not None
                done += [run] if run else []
        numel = next((done[0].ranks[0]["numel"] for done in runs.values() if done), 0)
        print_memory(runs, numel, args.mmap_threshold)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
