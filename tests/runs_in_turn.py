# Runs several scripts (or one script with several argvs) one after the other in the same ranks: one start of
# the ranks instead of one per run. Usage: `crew run ... runs_in_turn.py [--local_rank=N] RUNS_JSON`, where
# RUNS_JSON maps a run's name to its [script, *args] (the launcher's --local_rank is added to each). Each
# rank prints `run NAME on rank R` before a run's output and `run NAME failed on rank R` (then the traceback,
# on stderr) if the run raised, so a test can split the job's output per run, rank by rank (split_runs).
import json
import os
import re
import runpy
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

RANK_LINE = re.compile(r"\[[^\]]+:(\d+)\] (.*)")  # a line of crew run's output
RUN_LINE = re.compile(r"run (\S+) on rank \d+")


def main() -> None:
    launcher_args = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank")]
    (runs_json,) = [arg for arg in sys.argv[1:] if arg not in launcher_args]
    runs, rank = json.loads(Path(runs_json).read_text()), os.environ["RANK"]
    for name, (script, *args) in runs.items():
        print(f"run {name} on rank {rank}", flush=True)
        sys.argv = [script, *args, *launcher_args]
        sys.path[0] = str(Path(script).resolve().parent)  # as `python script` puts it
        try:
            runpy.run_path(script, run_name="__main__")
        except Exception:
            print(f"run {name} failed on rank {rank}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
        if dist.is_initialized():
            dist.barrier()  # the next run starts on every rank after this one has ended on every rank


def split_runs(out: str, names) -> dict[str, tuple[str, bool]]:
    """The lines of crew run's output `out` that each run printed (every rank's lines after its own `run NAME on
    rank R`: each rank's lines keep their order) and whether that run failed on some rank."""
    lines: dict[str, list[str]] = {name: [] for name in names}
    failed = dict.fromkeys(names, False)
    current: dict[str, str] = {}
    for line in out.splitlines():
        if not (match := RANK_LINE.match(line)):
            continue
        rank, text = match.groups()
        if started := RUN_LINE.fullmatch(text):
            current[rank] = started.group(1)
        elif rank in current:
            failed[current[rank]] |= text.startswith(f"run {current[rank]} failed")
            lines[current[rank]].append(line)
    return {name: ("\n".join(lines[name]), failed[name]) for name in names}


if __name__ == "__main__":
    main()
