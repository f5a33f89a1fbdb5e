"""Checkpoint save and load time: crew's engine vs plain torch.save / torch.load (vs DeepSpeed when
installed).

The model is 24 x Linear(2048, 2048) (100.7M fp32 parameters), trained one AdamW step through
`crew.initialize` on 2 CPU ranks (gloo) so that the optimizer state exists: module state dict
(0.4 GB) + optimizer state dict (exp_avg, exp_avg_sq: 0.8 GB) = 1.2 GB. In one `crew run` job,
each rank builds it, then each repetition times these cases, rotating their order from one
repetition to the next so that machine drift hits all of them alike:

* crew: `engine.save_checkpoint(dir, tag)` on every rank, timed on rank 0 from a barrier before
  the call to its return: state dicts, torch.save under temporary names (each file's crc32 computed
  from the bytes as they are written), fsync of every file, a barrier, the rename of the staging
  folder into place and `latest` (atomic and durable). The model is trained at ZeRO stage 0, so the
  tag holds DeepSpeed's one mp_rank_00_model_states.pt (module and optimizer, written by rank 0; crew
  before 0.2 wrote this replicated state as byte-balanced parts, one a rank, in parallel), crew_state.pt
  and the rank files. Then `engine.load_checkpoint(dir)`, also on every rank, timed on rank 0: every
  rank checks the size and crc32 of the files it reads against the manifest (a read of each file, the
  work shared among the ranks of a machine), torch.load(weights_only=True)s the model states and its
  rank file, matches the optimizer state to the parameters and loads them into module, optimizer and
  counters.
* plain torch.save: rank 0 alone does `torch.save({"module": module.state_dict(), "optimizer":
  optimizer.state_dict()}, path)` (no fsync: the data may still be in the page cache when it
  returns, and a crash mid-write leaves a truncated file under the final name). Load: rank 0 does
  `torch.load(path, weights_only=True)` and load_state_dict into module and optimizer, the same
  work crew's load does (the torch.load part alone is printed below the table).
* plain + fsync: the same torch.save into an open file, then flush and os.fsync: durable, but
  still not atomic. It shows what durability alone costs on this disk.
* deepspeed (when installed): `save_checkpoint` / `load_checkpoint` of DeepSpeed's engine, in a job
  of its own (same model, config and timing).

--warmup repetitions (default 1) of every case run first, untimed: in a VM the first touch of
fresh memory (page cache, the loaded tensors) is slow and would land on whichever case comes first.
Before every case the previous case's files are removed and os.sync() flushes the page cache's
dirty pages (untimed), so that no case pays for another's write-back. The cache itself cannot be
dropped without root: every load reads a file that was just written, from a warm page cache. The
table shows medians over --repeat repetitions; the ratio lines also give best run / best run: on a
busy 2-core machine the page-cache writes vary by 2x from run to run, and the minimum is the least
disturbed. MB/s is the checkpoint's size on disk (all files of all ranks, 1 MB = 10^6 bytes) over
the time. Below it, crew's save and load are split into phases (rank 0, exclusive time, medians),
measured by wrapping functions of crew.runtime.checkpoint's modules, torch.save and os.fsync in the
benchmark's worker while crew saves and loads (crew itself is unchanged).

The target from the issue: crew's save within 1.2x of plain torch.save, while keeping atomicity.

    .venv/bin/python benchmarks/checkpoint.py               # 1 warm-up + 3 repetitions, under /tmp
    .venv/bin/python benchmarks/checkpoint.py --repeat 7 --json checkpoint.json
    .venv/bin/python benchmarks/checkpoint.py --dir /mnt/nvme/tmp   # another filesystem

Memory: about 3 GB per rank at the peak of a load (model, optimizer state and the loaded copy),
plus 1.2 GB of page cache for the files; disk: 1.2 GB at a time (one case's files).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH, DEPTH, MICRO_BATCH, LR = 2048, 24, 8, 1e-3
TAG = "bench"
TARGET = 1.2
CASES = ["crew", "plain", "plain + fsync"]  # the order of the first repetition; then rotated


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------------
# phases of crew's save and load: exclusive time per wrapped function (rank 0)

# label: the wrapped functions as "module.name", in the module that looks the name up when crew calls
# it; module: saving, loading, layout, integrity, deepspeed_writing or deepspeed_format of
# crew.runtime.checkpoint, or torch, os, comm. The
# The crc32 of a save is computed inside the writes (in "torch.save (serialise + write)"); that of a load
# is its own phase
SAVE_PHASES = {
    "state dicts": ["saving._engine_state", "saving._rank_state", "saving._client_state_bytes",
                    "saving.fp32_module_state", "saving.groups_by_name", "saving._steps",
                    "deepspeed_writing.model_states", "deepspeed_writing.as_deepspeeds"],
    "torch.save (serialise + write)": ["torch.save"],
    "os.fsync (files + folders)": ["os.fsync"],
    "barrier (wait for all ranks)": ["comm.barrier"],
    "other collectives": ["saving.agree", "saving._broadcast_token", "saving._detect_shared", "saving._placement",
                          "saving.same_everywhere", "saving.all_gather"],
    "commit (manifest, rename, latest)": ["saving._commit", "saving._remove_stale"],
}
LOAD_PHASES = {
    "verify crc32 (read + checksum)": ["integrity.file_digest"],
    "torch.load (weights_only)": ["loading.read", "layout.read", "deepspeed_format.read"],
    "DeepSpeed's layout -> by name": ["deepspeed_format.fp32_params", "deepspeed_format.module_state",
                                      "deepspeed_format._stage0_optimizer", "deepspeed_format._zero_optimizer",
                                      "loading._prepare_optimizer_state"],
    "check shapes": ["loading._check_fits"],
    "load into module + optimizer": ["loading._load_weights", "loading._load_the_rest"],
    "collectives": ["loading.agree"],
}


class Phases:
    """Wraps functions for the duration of a `with`; each wrapper adds its exclusive time (its own
    time minus that of wrapped functions it calls) to its label."""

    def __init__(self, phases: dict[str, list[str]]):
        self.phases = phases
        self.times: dict[str, float] = {label: 0.0 for label in phases}
        self._stack: list[list[float]] = []

    def _wrap(self, label: str, function):
        def wrapper(*args, **kwargs):
            frame = [0.0]  # time spent in wrapped callees
            self._stack.append(frame)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self._stack.pop()
                self.times[label] += elapsed - frame[0]
                if self._stack:
                    self._stack[-1][0] += elapsed
        return wrapper

    @contextlib.contextmanager
    def installed(self):
        import torch

        from crew.runtime import comm

        owners = {name: importlib.import_module(f"crew.runtime.checkpoint.{name}")
                  for name in ("saving", "loading", "layout", "integrity", "deepspeed_writing", "deepspeed_format")}
        owners.update(torch=torch, os=os, comm=comm)
        patched = []
        for label, names in self.phases.items():
            for name in names:
                module, _, attribute = name.partition(".")
                owner = owners[module]
                original = getattr(owner, attribute, None)
                if original is None:  # crew changed: a phase timed as 0 would hide the time in "other"
                    raise RuntimeError(f"benchmarks/checkpoint.py: {name} is gone; update SAVE_PHASES/LOAD_PHASES")
                patched.append((owner, attribute, original))
                setattr(owner, attribute, self._wrap(label, original))
        try:
            yield self
        finally:
            for owner, attribute, original in reversed(patched):
                setattr(owner, attribute, original)


# --------------------------------------------------------------------------------------------------
# the worker: one rank of the `crew run` job


def worker(module_name: str, repeat: int, warmup: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    deepspeed = importlib.import_module(module_name)
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config())
    inputs = torch.randn(MICRO_BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    engine.backward(torch.nn.functional.mse_loss(engine(inputs), inputs))
    engine.step()  # AdamW's exp_avg and exp_avg_sq exist from here on

    rank = dist.get_rank()
    root_path = Path(root)
    instrument = module_name == "crew"

    def fresh(folder: Path) -> None:
        """Untimed: remove every earlier case's files, flush dirty pages, line the ranks up."""
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root_path, ignore_errors=True)
            folder.mkdir(parents=True)
            os.sync()
        dist.barrier()

    def engine_case() -> dict:
        folder = root_path / module_name
        fresh(folder)
        save_phases, load_phases = Phases(SAVE_PHASES), Phases(LOAD_PHASES)
        with save_phases.installed() if instrument else contextlib.nullcontext():
            dist.barrier()
            started = time.perf_counter()
            engine.save_checkpoint(str(folder), tag=TAG)
            saved = time.perf_counter() - started
        size = folder_bytes(folder)
        dist.barrier()
        with load_phases.installed() if instrument else contextlib.nullcontext():
            dist.barrier()
            started = time.perf_counter()
            path, _ = engine.load_checkpoint(str(folder))
            loaded = time.perf_counter() - started
        if path is None:
            raise RuntimeError(f"load_checkpoint({folder}) found no checkpoint")
        gc.collect()
        result = {"save_s": saved, "load_s": loaded, "bytes": size}
        if instrument:
            result["save_phases"], result["load_phases"] = save_phases.times, load_phases.times
        return result

    def plain_case(fsync: bool) -> dict:
        folder = root_path / ("plain-fsync" if fsync else "plain")
        fresh(folder)
        result = {}
        if rank == 0:
            path = folder / "checkpoint.pt"
            started = time.perf_counter()
            state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
            if fsync:
                with open(path, "wb") as handle:
                    torch.save(state, handle)
                    handle.flush()
                    synced = time.perf_counter()
                    os.fsync(handle.fileno())
                result["fsync_s"] = time.perf_counter() - synced
            else:
                torch.save(state, path)
            result["save_s"] = time.perf_counter() - started
            del state
            result["bytes"] = folder_bytes(folder)
            started = time.perf_counter()
            state = torch.load(path, map_location="cpu", weights_only=True)
            result["torch_load_s"] = time.perf_counter() - started
            engine.module.load_state_dict(state["module"])
            engine.optimizer.load_state_dict(state["optimizer"])
            result["load_s"] = time.perf_counter() - started
            del state
            gc.collect()
        dist.barrier()
        return result

    cases = {module_name: engine_case}
    if module_name == "crew":
        cases.update({"plain": lambda: plain_case(False), "plain + fsync": lambda: plain_case(True)})
    order = list(cases)
    for name in order * warmup:  # untimed: the first touch of fresh memory is slow in a VM
        cases[name]()
    results: dict[str, list[dict]] = {name: [] for name in order}
    for i in range(repeat):
        for name in order[i % len(order):] + order[:i % len(order)]:
            results[name].append(cases[name]())
    fresh(root_path)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


# --------------------------------------------------------------------------------------------------
# the harness


def launch(module_name: str, repeat: int, warmup: int, root: Path, timeout: float) -> dict | str:
    crew = Path(sys.executable).parent / "crew"
    out = root / f"{module_name}-results.json"
    argv = [str(crew), "run", "--num_gpus", "2", __file__, "--worker", module_name,
            "--repeat", str(repeat), "--warmup", str(warmup), "--dir", str(root / "work"),
            "--out", str(out)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # `crew run` stops its ranks on SIGTERM (and they die with it anyway)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        return f"timed out after {timeout:.0f} s; stderr tail:\n{_tail(stderr)}"
    if proc.returncode != 0 or not out.is_file():
        return f"failed (exit {proc.returncode}); stderr tail:\n{_tail(stderr)}"
    return json.loads(out.read_text())


def _tail(text, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join("    " + line for line in (text or "").strip().splitlines()[-lines:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of every case")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed repetitions of every case first (default 1)")
    parser.add_argument("--dir", help="folder to write the checkpoints under (default: /tmp)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per job (default 300 + 120 per repetition, warm-up included)")
    parser.add_argument("--json", help="also write every run's times and phases to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.repeat, args.warmup, args.dir, args.out)
        return 0
    timeout = args.timeout or 300 + 120 * (args.repeat + args.warmup)
    root = Path(tempfile.mkdtemp(prefix="crew-checkpoint-bench-", dir=args.dir or "/tmp"))
    jobs = ["crew"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    results: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    try:
        for job in jobs:
            result = launch(job, args.repeat, args.warmup, root, timeout)
            if isinstance(result, str):
                failures[job] = result
            else:
                results.update(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "failures": failures}, indent=1))
    print_table(results, failures, args, root.parent)
    return 1 if failures else 0


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def print_table(results: dict[str, list[dict]], failures: dict[str, str], args, where: Path) -> None:
    params = DEPTH * (WIDTH * WIDTH + WIDTH)
    print(f"model: {DEPTH} x Linear({WIDTH}, {WIDTH}) = {params / 1e6:.1f}M fp32 params, AdamW "
          f"after one step; 2 CPU ranks (gloo); medians of {args.repeat} repetition(s); "
          f"files under {where}")
    print("load times read files just written: warm page cache (dropping it needs root)")
    header = (f"{'case':<14} | {'MB':>6} | {'save s':>6} | {'save MB/s':>9} | {'load s':>6} | "
              f"{'load MB/s':>9} | {'save runs s':>17}")
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    for case in [*CASES, "deepspeed"]:
        if case in failures:
            print(f"{case:<14} | {failures[case].splitlines()[0]}")
            print(failures[case].split("\n", 1)[1] if "\n" in failures[case] else "")
            continue
        if case not in results:
            missing = "not installed" if case == "deepspeed" else "no run (the crew job failed)"
            print(f"{case:<14} | {missing}")
            continue
        runs = results[case]
        save, load, size = _median(runs, "save_s"), _median(runs, "load_s"), _median(runs, "bytes")
        medians[case] = save
        per_run = ", ".join(f"{run['save_s']:.2f}" for run in runs)
        print(f"{case:<14} | {size / 1e6:6.0f} | {save:6.2f} | {size / 1e6 / save:9.0f} | "
              f"{load:6.2f} | {size / 1e6 / load:9.0f} | {per_run:>17}")
    if "crew" in medians:
        for case, name in (("plain", "plain torch.save"), ("plain + fsync", "torch.save + fsync")):
            if case in medians:
                best = (min(run["save_s"] for run in results["crew"])
                        / min(run["save_s"] for run in results[case]))
                print(f"crew save / {name}: {medians['crew'] / medians[case]:.2f} "
                      f"(target <= {TARGET}; best run / best run: {best:.2f})")
    fsync_label = "os.fsync (files + folders)"
    if "plain" in medians and "crew" in results and fsync_label in results["crew"][0].get(
            "save_phases", {}):
        unsynced = statistics.median(run["save_s"] - run["save_phases"][fsync_label]
                                     for run in results["crew"])
        print(f"crew save less its measured os.fsync time / plain torch.save: "
              f"{unsynced / medians['plain']:.2f}")
    if "crew" in results and "save_phases" in results["crew"][0]:
        print_phases("crew save", results["crew"], "save_phases", "save_s")
        print_phases("crew load", results["crew"], "load_phases", "load_s")
    if "plain + fsync" in results:
        runs = results["plain + fsync"]
        fsync = _median(runs, "fsync_s")
        print(f"plain + fsync save: os.fsync {fsync:.2f} s of {_median(runs, 'save_s'):.2f} s")
    if "plain" in results:
        runs = results["plain"]
        print(f"plain load: torch.load {_median(runs, 'torch_load_s'):.2f} s of "
              f"{_median(runs, 'load_s'):.2f} s (the rest: load_state_dict)")


def print_phases(title: str, runs: list[dict], key: str, total_key: str) -> None:
    total = _median(runs, total_key)
    print(f"{title}, rank 0, by phase (exclusive time, median s, share of the median total "
          f"{total:.2f} s):")
    shown = 0.0
    for label in runs[0][key]:
        value = statistics.median(run[key][label] for run in runs)
        shown += value
        print(f"  {label:<34} {value:6.2f}  {value / total:4.0%}")
    other = statistics.median(run[total_key] - sum(run[key].values()) for run in runs)
    print(f"  {'other (the rest)':<34} {other:6.2f}  {other / total:4.0%}")


if __name__ == "__main__":
    sys.exit(main())
