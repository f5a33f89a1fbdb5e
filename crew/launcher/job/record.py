"""`<log_dir>/crew_job.json`: what a job was and how it ended, for a person or a program to read later.

`crew run --log_dir DIR` writes it on this machine when the job starts and again when it ends, each time
to a temporary file renamed over the last one, so that a reader never sees half a file. A restarted job
(--max_restarts) rewrites it for each attempt, keeping the list of restarts. Under the standalone
launcher every node runs its own `crew run`: node K > 0 writes `crew_job.node<K>.json`, so that on a
shared filesystem none overwrites another's. The fields:

- `job_id`, `command` (crew's own command line, as a list), `cwd`, `launcher`, `restart_count`
- `started_at`, `ended_at`: ISO 8601 with the UTC offset (`ended_at` is null while the job runs)
- `world_size`, `nodes`: one {`host`, `ranks`} per node, and once every node's ranks started, its
  `startup_s`: {`connect`, `agent`, `spawn`, `total`} (the console shows only the slowest few)
- `status`: `running`, `succeeded`, `failed`, `interrupted`, or `preempted` (a preemption notice, and the
  ranks saved a checkpoint: exit code 75, the same command resumes)
- `exit_codes`: {rank: code} for the ranks whose node reported them, as a shell shows a code (128+N for
  signal N; the ranks crew stopped after a failure show 143, SIGTERM)
- `first_failure`: null, or {`rank`, `host`, `exit_code`, `signal`, `message`}; `rank` is null when the
  failure was not one rank's (the ranks did not all join, a node's agent or ssh connection ended)
- `exit_code`: crew run's exit code (null while the job runs)
- `outputs` (once the job ended): what global rank 0's engine wrote, as its node's agent found it (crew/outputs.py):
  {`kind`: `checkpoint` (`path`: the save dir, `tag`: its newest tag), `monitor` (`path`: the folder, `writer`:
  `csv_monitor` or `tensorboard`) or `weights` (`path`: save_16bit_model's file), `host`: rank 0's node}
- `restarts`: one entry per restart (--max_restarts), oldest first: `at`, `after_exit_code`, `failure` (the
  first line of what ended the attempt), `lost` (hosts whose agent or ssh connection ended without their
  ranks' codes), `continued` and, when it did, the `world_size` and `nodes` of the next attempt; with
  --min_nodes also `left_out` ({host: why} for the nodes that failed the re-check), `joined` (spares that
  came in) and `recheck_s`
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crew.launcher.transport.protocol import JobSpec

RECORD_FILE = "crew_job.json"


@dataclass(frozen=True)
class FirstFailure:
    exit_code: int
    message: str
    rank: int | None = None
    host: str | None = None
    signal: str | None = None


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class JobRecord:
    """The record of one job in `log_dir`; write problems are said once and never stop the job."""

    def __init__(self, log_dir: str | Path, command: list[str], launcher: str,
                 say: Callable[[str], None], node_rank: int | None = None):
        name = f"crew_job.node{node_rank}.json" if launcher == "standalone" and node_rank else RECORD_FILE
        self.path = Path(log_dir) / name
        self.command, self.launcher, self.say = command, launcher, say
        self.data: dict = {}
        self.restarts: list[dict] = []  # kept across attempts: start() begins each attempt's record
        self._failed_to_write = False

    def start(self, job: JobSpec) -> None:
        self.data = {
            "job_id": job.job_id, "command": self.command, "cwd": job.cwd, "launcher": self.launcher,
            "restart_count": job.restart_count, "started_at": now_iso(), "ended_at": None,
            "world_size": job.world_size,
            "nodes": [{"host": node.host, "ranks": list(node.ranks)} for node in job.nodes],
            "status": "running", "exit_codes": {}, "first_failure": None, "exit_code": None,
            "restarts": self.restarts}
        self._write()

    def restarted(self, entry: dict) -> None:
        """A restart (or the decision not to make one) after the attempt this record holds."""
        self.restarts.append(entry)
        self._write()

    def startup(self, times: dict[int, dict]) -> None:
        """Every node's start-up seconds (connect, agent, spawn, total), which the console sums up."""
        for node, entry in enumerate(self.data.get("nodes", [])):
            if node in times:
                entry["startup_s"] = {k: v for k, v in times[node].items() if k != "host"}
        self._write()

    def finish(self, exit_code: int, status: str, codes: dict[int, int],
               failure: FirstFailure | None, outputs: list[dict] = ()) -> None:
        self.data.update({
            "outputs": list(outputs),
            "ended_at": now_iso(), "status": status, "exit_code": exit_code,
            "exit_codes": {str(rank): codes[rank] for rank in sorted(codes)},
            "first_failure": None if failure is None else {
                "rank": failure.rank, "host": failure.host, "exit_code": failure.exit_code,
                "signal": failure.signal, "message": failure.message}})
        self._write()

    def _write(self) -> None:
        temp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{RECORD_FILE}.")
            with os.fdopen(fd, "w") as handle:
                json.dump(self.data, handle, indent=2)
                handle.write("\n")
            os.chmod(temp, 0o644)  # mkstemp makes it 0600; the rank logs beside it are readable too
            os.replace(temp, self.path)
        except OSError as exc:
            if temp is not None:
                Path(temp).unlink(missing_ok=True)
            if not self._failed_to_write:
                self.say(f"cannot write the job record {self.path}: {exc}. The job goes on without it.")
            self._failed_to_write = True
