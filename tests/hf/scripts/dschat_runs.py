# Runs dschat_sft.py once per configuration, one after the other in the same ranks: one job start instead of
# one per configuration. Usage: dschat_runs.py [--local_rank=N] RUNS_JSON, where
# RUNS_JSON maps a name to that run's argv (the launcher's --local_rank is added to each). Each rank prints
# `dschat run NAME on rank R` before a run's output and `dschat run NAME failed on rank R` (then the
# traceback, on stderr) if the run raised, so the test can split the job's output per run, rank by rank.
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

SCRIPT = str(Path(__file__).with_name("dschat_sft.py"))


def main() -> None:
    launcher_args = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank")]
    (runs_json,) = [arg for arg in sys.argv[1:] if arg not in launcher_args]
    runs, rank = json.loads(Path(runs_json).read_text()), os.environ["RANK"]
    for name, argv in runs.items():
        print(f"dschat run {name} on rank {rank}", flush=True)
        sys.argv = [SCRIPT, *argv, *launcher_args]
        try:
            runpy.run_path(SCRIPT, run_name="__main__")
        except Exception:
            print(f"dschat run {name} failed on rank {rank}", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
        if dist.is_initialized():
            dist.barrier()  # the next run starts on every rank after this one has ended on every rank


if __name__ == "__main__":
    main()
