"""The contract between `crew run` and the node agents it starts.

The launcher hands every agent the same `JobSpec` as one JSON line (on stdin, or base64 in argv for pdsh,
which has no stdin). Values travel as JSON, never through a shell, so no hostname, path or environment
value is ever interpreted by one. The agent answers on its stdout: rank output lines (always prefixed
`[host:rank] `) and event lines that start with EVENT_MARK, which no prefixed line can. A rank's
progress-bar update (text it ended with a bare carriage return, see `streams`) comes as
`PROGRESS_MARK[host:rank] text`, on the agent's stream of the same kind as the rank's.

After the spec, the launcher keeps the agent's stdin open: closing it means "stop", and a line
STACKS_COMMAND means "stop every rank with its Python stack first" (see agent.Supervisor). An agent
started with --preflight first sends a `probe` event (the quick checks' facts, as the doctor's probe)
and starts nothing until a line GO_COMMAND arrives: the launcher sends it once every node's facts
passed, and closes stdin instead when one did not. Events, as {"event": KIND, ...}: `probe`, `started`,
`join` (node, host, rank, state as in joinwatch, remote: the master address it is connected or
connecting to), `rank_failed` (..., collective_timeout: its stderr says a torch.distributed operation
timed out), `stack` (node, host, rank, dumped, threads, frames: the main thread's [file, line,
function], innermost first), `error`, `alive`, `done`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
from dataclasses import asdict, dataclass, field

EVENT_MARK = b"\x1ecrew-event "
PROGRESS_MARK = b"\x1ecrew-progress "
STACKS_COMMAND = b"stacks"
GO_COMMAND = b"go"  # after the merged preflight: every node passed, start the ranks
AGENT_MODULE = "crew.launcher.agent"


@dataclass(frozen=True)
class NodeSpec:
    host: str
    slots: tuple[int, ...]  # device ids
    ranks: tuple[int, ...]  # global ranks, one per slot


@dataclass(frozen=True)
class JobSpec:
    """Everything an agent needs; the same for every node, which picks its own by node rank."""

    job_id: str
    nodes: tuple[NodeSpec, ...]
    master_addr: str
    master_port: int
    program: tuple[str, ...]  # script (or module, or executable) and its arguments
    cwd: str
    mode: str = "python"  # "python": python -u SCRIPT; "module": python -u -m MODULE; "exec": SCRIPT
    env: dict[str, str] = field(default_factory=dict)
    local_rank_arg: bool = True
    log_dir: str | None = None
    grace_s: float = 5.0
    restart_count: int = 0
    init_timeout: float = 600.0  # seconds for every rank to join the process group; 0: no limit
    as_deepspeed: bool = False  # ranks get crew's `deepspeed` shim first on PYTHONPATH

    @property
    def world_size(self) -> int:
        return sum(len(node.ranks) for node in self.nodes)

    def to_line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    def to_b64(self) -> str:
        return base64.b64encode(self.to_line().rstrip()).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        data = json.loads(text)
        data["nodes"] = tuple(
            NodeSpec(n["host"], tuple(n["slots"]), tuple(n["ranks"])) for n in data["nodes"])
        data["program"] = tuple(data["program"])
        return cls(**data)

    @classmethod
    def from_b64(cls, text: str) -> JobSpec:
        return cls.from_json(base64.b64decode(text))


def encode_event(kind: str, **fields) -> bytes:
    return EVENT_MARK + json.dumps({"event": kind, **fields}).encode() + b"\n"


def decode_event(line: bytes) -> dict | None:
    """The event carried by an agent output line, or None for an ordinary output line."""
    if not line.startswith(EVENT_MARK):
        return None
    try:
        return json.loads(line[len(EVENT_MARK):])
    except ValueError:
        return None


def node_arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line every runner gives a node-side crew module (the agent, the doctor's probe)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--job", help="job id, for `ps` readers; the spec carries the real one")
    parser.add_argument("--node_rank", type=int, required=True)
    parser.add_argument("--spec_b64", help="the job spec in base64 (default: one JSON line on stdin)")
    parser.add_argument("--watch", choices=("stdin", "stdout"), default="stdin",
                        help="how to notice the launcher is gone: stdin EOF, or stdout hang-up (pdsh)")
    return parser


def read_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> JobSpec:
    """The spec from --spec_b64, or its line on stdin (read unbuffered: stdin stays the launcher's)."""
    if args.spec_b64:
        job = JobSpec.from_b64(args.spec_b64)
    else:
        line = b""
        while not line.endswith(b"\n") and (chunk := os.read(0, 1)):
            line += chunk
        job = JobSpec.from_json(line)
    if not 0 <= args.node_rank < len(job.nodes):
        parser.error(f"--node_rank {args.node_rank} is not in 0..{len(job.nodes) - 1}")
    return job
