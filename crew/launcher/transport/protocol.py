"""The contract between `crew run` and the node agents it starts.

The launcher hands every agent the same `JobSpec` as one JSON line (on stdin, or base64 in argv for pdsh,
which has no stdin). Values travel as JSON, never through a shell, so no hostname, path or environment
value is ever interpreted by one. The agent answers on its stdout: rank output lines (always prefixed
`[host:rank] `) and event lines that start with EVENT_MARK, which no prefixed line can. A rank's
progress-bar update (text it ended with a bare carriage return, see `streams`) comes as
`PROGRESS_MARK[host:rank] text`, on the agent's stream of the same kind as the rank's.

After the spec, the launcher keeps the agent's stdin open: closing it means "stop", and a line
STACKS_COMMAND means "stop every rank with its Python stack first" (see agent.Supervisor), and a line
WHERE_COMMAND "say where every rank is now, without stopping it" (a `places` event, node/sampler), and a line
PREEMPT_COMMAND "a preemption notice: let the ranks finish their step and save" (agent.Supervisor). An agent
started with --preflight first sends a `probe` event (the quick checks' facts, as the doctor's probe)
and starts nothing until a line GO_COMMAND arrives: the launcher sends it once every node's facts
passed, and closes stdin instead when one did not. Events, as {"event": KIND, ...}: `probe`, `started`,
`join` (node, host, rank, state as in joinwatch, remote: the master address it is connected or
connecting to), `rank_failed` (..., collective_timeout: its stderr says a torch.distributed operation
timed out), `stack` (node, host, rank, dumped, threads, frames: the main thread's [file, line,
function], innermost first), `places` (node, host, where: answering WHERE_COMMAND, ranks: each rank's
state busy/blocked/exited, for_s blocked, call and at when its stack was taken), `preempt` (node, host,
reason: the agent is passing a preemption notice to its ranks), `error`, `alive`, `done` (..., checkpoint:
where a preempted rank 0 saved).

Under srun (`--node_rank slurm`) one srun carries every node's agent: its stdin reaches all of them
(`--input=all`: the spec, `stacks`, `go` and EOF alike), each agent finds its node by name
(`slurm_node`), and, since srun merges its tasks' output in 1 KiB messages, an agent sends any line
longer than the spec's `line_max` as pieces (`split_long_lines`) that the launcher joins (`whole_lines`).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace

EVENT_MARK = b"\x1ecrew-event "
PROGRESS_MARK = b"\x1ecrew-progress "
STACKS_COMMAND = b"stacks"
WHERE_COMMAND = b"where"  # a stall report is being written: send every rank's place now (`places`)
GO_COMMAND = b"go"  # after the merged preflight: every node passed, start the ranks
PREEMPT_COMMAND = b"preempt"  # a preemption notice: SIGTERM to each rank's own process, SIGKILL after preempt_grace
PIECE_MARK = b"\x1ecrew-piece "  # PIECE_MARK NODE +|. TEXT: part of a long line; "." ends it
AGENT_MODULE = "crew.launcher.node.agent"
SLURM_NODE_RANK = "slurm"  # --node_rank under srun: the agent finds its node by SLURMD_NODENAME
MPI_NODE_RANK = "mpi"  # --node_rank under mpirun: the agent's MPI rank (one per node, in plan order) is its node
# (rank, size) variables by MPI: OpenMPI, PMIx, MPICH/Intel MPI (Hydra's PMI), MVAPICH2
MPI_RANK_VARIABLES = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMIX_RANK", None),
                      ("PMI_RANK", "PMI_SIZE"), ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"))


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
    line_max: int = 0  # agents send longer output lines in pieces (srun); 0: as they are
    bind_cores: bool = False  # --bind_cores_to_rank: each local rank its own block of cores (node/binding)
    bind_core_list: str | None = None  # --bind_core_list: the cores to divide (default: the physical ones)
    save_pid: int = 0  # --save_pid: `crew run`'s pid; each agent keeps its own in /tmp/<it>.deepspeed
    stall_report: float = 90.0  # say where every rank is once one has waited this long in a collective; 0: off
    collective_timeout: float = 0.0  # the launcher ends a stall that lasts this long; 0: torch's own timeout
    preempt_grace: float = 120.0  # after a preemption notice: seconds the ranks get to finish a step and save

    @property
    def stall_watch_s(self) -> float:
        """How long a rank may wait in a collective before the launcher reports (or ends) it; 0: no watch
        (nor for a world of one rank, which has no one to wait for)."""
        if self.world_size < 2:
            return 0.0
        return min((s for s in (self.stall_report, self.collective_timeout) if s > 0), default=0.0)

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


def split_long_lines(data: bytes, node: int, line_max: int) -> bytes:
    """`data` (whole lines) with each line longer than `line_max` bytes cut into piece lines of at most
    `line_max` bytes, tagged with the node, so that lines from several nodes merged by srun can be told
    apart and joined again."""
    if not line_max or len(data) <= line_max:
        return data
    out = []
    for line in data.splitlines(keepends=True):
        if len(line) <= line_max:
            out.append(line)
            continue
        body = line.removesuffix(b"\n")
        size = line_max - len(PIECE_MARK) - len(str(node)) - 4
        for start in range(0, len(body), size):
            more = b"+" if start + size < len(body) else b"."
            out.append(PIECE_MARK + str(node).encode() + b" " + more + b" " + body[start:start + size] + b"\n")
    return b"".join(out)


def whole_lines(lines: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of an agent stream with the pieces of `split_long_lines` joined again, each whole line
    where its last piece was."""
    pending: dict[bytes, list[bytes]] = {}
    for line in lines:
        parts = line[len(PIECE_MARK):].split(b" ", 2) if line.startswith(PIECE_MARK) else []
        if len(parts) != 3 or parts[1] not in (b"+", b"."):
            yield line
            continue
        node, more, text = parts
        pending.setdefault(node, []).append(text.removesuffix(b"\n"))
        if more == b".":
            yield b"".join(pending.pop(node)) + b"\n"


def node_arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line every runner gives a node-side crew module (the agent, the doctor's probe)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--job", help="job id, for `ps` readers; the spec carries the real one")
    parser.add_argument("--node_rank", type=_node_rank, required=True,
                        help=f"this node's index in the spec, or '{SLURM_NODE_RANK}': find it by SLURMD_NODENAME, "
                             f"or '{MPI_NODE_RANK}': the MPI rank mpirun gave this process")
    parser.add_argument("--spec_b64", help="the job spec in base64 (default: one JSON line on stdin)")
    parser.add_argument("--watch", choices=("stdin", "stdout"), default="stdin",
                        help="how to notice the launcher is gone: stdin EOF, or stdout hang-up (pdsh)")
    return parser


def _node_rank(text: str) -> int | str:
    if text in (SLURM_NODE_RANK, MPI_NODE_RANK):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a node index, '{SLURM_NODE_RANK}' or '{MPI_NODE_RANK}'") from None


def read_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> JobSpec:
    """The spec from --spec_b64, or its line on stdin (read unbuffered: stdin stays the launcher's).
    `--node_rank slurm` is resolved here: args.node_rank becomes this node's index (`slurm_node`)."""
    if args.spec_b64:
        job = JobSpec.from_b64(args.spec_b64)
    else:
        line = b""
        while not line.endswith(b"\n") and (chunk := os.read(0, 1)):
            line += chunk
        job = JobSpec.from_json(line)
    if args.node_rank == SLURM_NODE_RANK:
        found = slurm_node(job, os.environ)
        if isinstance(found, str):
            parser.error(found)
        args.node_rank, job = found
    elif args.node_rank == MPI_NODE_RANK:
        found = mpi_node(job, os.environ)
        if isinstance(found, str):
            parser.error(found)
        args.node_rank = found
    if not 0 <= args.node_rank < len(job.nodes):
        parser.error(f"--node_rank {args.node_rank} is not in 0..{len(job.nodes) - 1}")
    return job


def slurm_node(job: JobSpec, environ: Mapping[str, str]) -> tuple[int, JobSpec] | str:
    """Under srun: this node's index in the job, found by name (SLURM_NODEID counts in Slurm's order, not
    the plan's), and the job with this node's device ids taken from the step's CUDA_VISIBLE_DEVICES:
    slot i is the step's i-th GPU, which need not be GPU i on a node shared with other jobs. A string
    says why there is no such node."""
    name = environ.get("SLURMD_NODENAME")
    hosts = [node.host for node in job.nodes]
    if not name:
        return (f"--node_rank {SLURM_NODE_RANK}: SLURMD_NODENAME is not set, so this is no task started by "
                "srun. Start it with srun (crew run --launcher slurm does).")
    if name not in hosts:
        return (f"--node_rank {SLURM_NODE_RANK}: this node ({name}, SLURMD_NODENAME) is not one of the "
                f"job's nodes ({', '.join(hosts)}).")
    index = hosts.index(name)
    node = job.nodes[index]
    ids = [part.strip() for part in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if not ids or not all(i.isascii() and i.isdigit() for i in ids):
        return index, job  # no GPUs here (CPU ranks), or ids crew cannot map (UUIDs, MIG)
    if len(ids) <= max(node.slots):
        return (f"this node ({name}) has the GPUs {','.join(ids)} in this job (CUDA_VISIBLE_DEVICES), too few "
                f"for its slots {','.join(map(str, node.slots))}. Pass --num_gpus {len(ids)}, or ask Slurm for "
                "more GPUs per node.")
    mapped = replace(node, slots=tuple(int(ids[slot]) for slot in node.slots))
    return index, replace(job, nodes=(*job.nodes[:index], mapped, *job.nodes[index + 1:]))


def mpi_node(job: JobSpec, environ: Mapping[str, str]) -> int | str:
    """Under mpirun (one process per node, in the plan's order): this node's index, the MPI rank mpirun gave
    this process. A string says why there is none: no MPI rank variable, or a world of another size (e.g.
    --launcher_args that changed -n)."""
    for rank_name, size_name in MPI_RANK_VARIABLES:
        rank = environ.get(rank_name, "")
        if not rank:
            continue
        size = environ.get(size_name or "", str(len(job.nodes)))
        if not (rank.isascii() and rank.isdigit() and size.isascii() and size.isdigit()):
            return f"--node_rank {MPI_NODE_RANK}: {rank_name}={rank!r}, {size_name}={size!r} are no MPI rank and size."
        if int(size) != len(job.nodes):
            return (f"--node_rank {MPI_NODE_RANK}: mpirun started {size} process(es) ({size_name}), but the job has "
                    f"{len(job.nodes)} node(s): one agent per node is needed. Leave -n/-np/-ppn out of "
                    "--launcher_args.")
        return int(rank)
    names = ", ".join(name for name, _ in MPI_RANK_VARIABLES)
    return (f"--node_rank {MPI_NODE_RANK}: none of {names} is set, so this is no process started by mpirun. "
            "Start it with mpirun (crew run --launcher openmpi|mpich|impi|mvapich does).")


def mpi_identity(environ: Mapping[str, str]) -> list[str]:
    """The variables that give this process its MPI rank and size: the agent's, not its ranks' (a rank that
    read them would take the node's index for its own rank)."""
    names = {name for pair in MPI_RANK_VARIABLES for name in pair if name}
    prefixes = ("OMPI_COMM_WORLD_", "MV2_COMM_WORLD_")
    return [name for name in environ if name in names or name.startswith(prefixes)
            or name in ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_UNIVERSE_SIZE")]
