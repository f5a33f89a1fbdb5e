"""`python -m crew.launcher.node.agent`: one per node per job, started by `crew run` through a runner.

It starts the node's ranks, streams their output as whole lines prefixed `[host:rank] ` (progress-bar
updates marked as such: `streams`), writes one log file per rank when asked (every byte as the rank
wrote it), and owns teardown. It stops every rank (SIGTERM to each rank's process group, SIGKILL after a
grace period) when a rank fails, when it is signalled, and when its connection to the launcher closes
(stdin EOF, or stdout hang-up under pdsh), so that even a launcher killed with SIGKILL leaves nothing
running on this node. Only the process groups of its own ranks are signalled. A preemption notice (a
`preempt` line from the launcher, SIGUSR1 to the agent, or a rank that exits 75 after the ranks agreed on
another node's notice) is gentler: SIGTERM to each rank's own process, which with crew's `preemption` config
key finishes its step, saves and exits 75, and SIGKILL only after the spec's `preempt_grace`.

While its ranks have not all joined the process group a `joinwatch.JoinWatch` watches their sockets and
sends a `join` event whenever a rank's state changes. A `stacks` line from the launcher on stdin (and a
rank that fails with a collective timeout) makes it stop the ranks with SIGABRT instead: faulthandler,
which every rank has on (PYTHONFAULTHANDLER=1), prints each thread's stack to the rank's stderr, and the
agent sends a `stack` event per rank with the main thread's frames (`stacks`). Under pdsh there is no
stdin, so no `stacks` line can arrive: there the launcher stops the job without stacks. While the ranks
run, a `sampler.Sampler` looks at them for stalls (`places` events; a `where` line asks it at once).
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

import crew
from crew import outputs
from crew.errors import PREEMPTED_EXIT_CODE, PREEMPTED_MARK
from crew.launcher.node import binding, pidfile, sampler, stacks
from crew.launcher.node.joinwatch import JoinWatch
from crew.launcher.transport.proc import seconds_since_exec, signal_group
from crew.launcher.transport.protocol import (GO_COMMAND, PREEMPT_COMMAND, PROGRESS_MARK, STACKS_COMMAND,
                                              MPI_NODE_RANK, WHERE_COMMAND, JobSpec, NodeSpec, mpi_identity,
                                              node_arguments, read_job)
from crew.launcher.node.ranks import Output, Rank
from crew.launcher.node.streams import IDLE_FLUSH_S, PROGRESS, Item, StreamSplitter

KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel before giving up on a rank
HEARTBEAT_S = 2.0
STDERR_DRAIN_S = 1.0  # after a rank ends, how long to wait for the rest of its stderr
DEEPSPEED_SHIM = str(Path(crew.__file__).parent / "deepspeed" / "shim")
RANK_SITE = str(Path(__file__).parent / "site")  # its sitecustomize runs first in every rank


def rank_env(job: JobSpec, node_rank: int, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    """The environment of one rank: the torchrun/DeepSpeed variables on top of the job's env."""
    node = job.nodes[node_rank]
    env = {**base, **job.env}
    env.update({
        "RANK": str(node.ranks[local_rank]),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(job.world_size),
        "LOCAL_WORLD_SIZE": str(len(node.ranks)),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(len(job.nodes)),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, node.slots)),
        "CREW_JOB_ID": job.job_id,
        "CREW_HOST": node.host,
        "CREW_RESTART_COUNT": str(job.restart_count),
    })
    # As torchrun: N ranks each running a thread per core oversubscribe the node many times over.
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // len(node.ranks))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # SIGABRT prints every thread's stack: see Supervisor
    # Without a GPU Accelerate's state finds no backend and says world size 1 (its state.py). ACCELERATE_USE_CPU
    # makes it MULTI_CPU over gloo, but drops a DeepSpeed config: under --as_deepspeed crew's rank site gives
    # Accelerate gloo instead (site/sitecustomize.py).
    if not has_gpu():
        if job.as_deepspeed:
            env["CREW_DEEPSPEED_ON_CPU"] = "1"
        else:
            env.setdefault("ACCELERATE_USE_CPU", "true")
    # as_deepspeed: this node's crew answers `import deepspeed` (crew/deepspeed/alias.py)
    shim = DEEPSPEED_SHIM if job.as_deepspeed else None
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [RANK_SITE, shim, env.get("PYTHONPATH")]))
    return env


def has_gpu() -> bool:
    """A GPU on this node, seen without importing torch: NVIDIA's /dev/nvidiaN, or ROCm's /dev/kfd."""
    return Path("/dev/kfd").exists() or any(p.name[6:].isdigit() for p in Path("/dev").glob("nvidia[0-9]*"))


def rank_argv(job: JobSpec, local_rank: int) -> list[str]:
    """The rank's command line; Python ranks run on the agent's own interpreter."""
    target, *args = job.program
    head = {"python": [sys.executable, "-u", target],
            "module": [sys.executable, "-u", "-m", target], "exec": [target]}[job.mode]
    local_rank_flag = [f"--local_rank={local_rank}"] if job.local_rank_arg else []
    return [*head, *local_rank_flag, *args]


def preflight(job: JobSpec, node_rank: int) -> str | None:
    """What would stop the ranks from starting here, said plainly; None when all is well."""
    host = job.nodes[node_rank].host
    if not Path(job.cwd).is_dir():
        return (f"working directory {job.cwd} does not exist on {host}. crew runs every node in the "
                f"launching directory: copy the code to the same path on {host} (crew sync, or crew run "
                "--sync).")
    target = Path(job.cwd, job.program[0])
    if job.mode == "python" and not target.is_file():
        return (f"script {target} not found on {host}. Copy the code to the same path on every "
                "node (crew sync, or crew run --sync), or put it on a shared filesystem.")
    if node_rank == 0:
        return _master_port_problem(job.master_port, host)
    return None


def _master_port_problem(port: int, host: str) -> str | None:
    # Rank 0 (on node 0) listens on the master port; SO_REUSEADDR as torch's store does, so a
    # port left in TIME_WAIT by the last job counts as free.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return (f"master port {port} is already in use on {host} ({exc.strerror}). Pass a free "
                    "--master_port, or leave it out and crew picks a free one.")
    return None


def spawn(job: JobSpec, node_rank: int, bindings: list[binding.Binding] | None = None) -> list[Rank]:
    node = job.nodes[node_rank]
    log_dir = Path(job.cwd, job.log_dir) if job.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    ranks: list[Rank] = []
    try:
        for local_rank, rank in enumerate(node.ranks):
            log = open(log_dir / f"rank{rank}.log", "ab", buffering=0) if log_dir else None
            bound = bindings[local_rank] if bindings else None  # --bind_cores_to_rank
            env = binding.rank_threads(rank_env(job, node_rank, local_rank, dict(os.environ)), job.env, bound)
            outputs_file = _outputs_file(job) if rank == 0 else None
            if outputs_file:
                env[outputs.OUTPUTS_FILE_ENV] = outputs_file
            read_end, write_end = sampler.stack_pipe() if job.stall_watch_s else (None, None)
            try:
                proc = subprocess.Popen(
                    rank_argv(job, local_rank), cwd=job.cwd,
                    env={**env, **sampler.rank_stacks_env(write_end)} if write_end is not None else env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=() if write_end is None else (write_end,),
                    start_new_session=True, preexec_fn=binding.preexec(bound))
            except OSError:
                if read_end is not None:
                    os.close(read_end)
                if outputs_file:
                    os.unlink(outputs_file)
                raise
            finally:
                if write_end is not None:
                    os.close(write_end)  # the rank holds it now
            ranks.append(Rank(rank, local_rank, proc, log, stack_pipe=read_end, outputs_file=outputs_file))
    except OSError:
        for started in ranks:
            signal_group(started.proc.pid, signal.SIGKILL)
        raise
    return ranks


def _outputs_file(job: JobSpec) -> str | None:
    """A new private file for rank 0's list of outputs (made here: O_EXCL, mode 0600, so that no one else's
    file or link can be there first); None when none can be made, which only costs the closing line."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"crew-{job.job_id}-", suffix=".outputs")
    except OSError:
        return None
    os.close(fd)
    return path


def _outputs(ranks: list[Rank]) -> list[dict]:
    """What rank 0's engine listed (crew/outputs.py), its file removed."""
    found = []
    for rank in ranks:
        if rank.outputs_file:
            found += outputs.read(rank.outputs_file)
            with contextlib.suppress(OSError):
                os.unlink(rank.outputs_file)
    return found


def pump(rank: Rank, stream: BinaryIO, fd_out: int, prefix: bytes, output: Output) -> None:
    """Copy one rank stream to the agent's stream of the same kind: whole lines prefixed `[host:rank] `,
    progress-bar updates marked as such (`streams`), and every byte unchanged to the rank's log."""
    splitter, fd = StreamSplitter(), stream.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if splitter.wants_idle() and not poller.poll(IDLE_FLUSH_S * 1000):
            _emit(rank, splitter.idle(), b"", fd_out, prefix, output)
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        _emit(rank, *splitter.feed(chunk), fd_out, prefix, output)
    _emit(rank, *splitter.close(), fd_out, prefix, output)
    stream.close()
    if fd_out == 2:
        rank.stderr_done.set()


def _emit(rank: Rank, items: list[Item], raw: bytes, fd_out: int, prefix: bytes, output: Output) -> None:
    data = []
    for index, (kind, text) in enumerate(items):
        if kind == PROGRESS:
            if index + 1 == len(items) or items[index + 1][0] != PROGRESS:  # else superseded at once
                data.append(PROGRESS_MARK + prefix + text + b"\n")
            continue
        data.append(prefix + text + b"\n")
        if fd_out == 2:
            _note_stderr(rank, text.decode(errors="replace"))
    if data or raw:
        output.write(fd_out, b"".join(data), rank.log, raw)


def _note_stderr(rank: Rank, text: str) -> None:
    rank.stderr_tail.append(text)
    if not rank.said_timeout and stacks.looks_like_collective_timeout((text,)):
        rank.said_timeout = True  # NCCL's watchdog says it, then aborts: the tail may lose the line
    if rank.dump is not None:
        rank.dump.append(text)
    if text.startswith(PREEMPTED_MARK):
        rank.checkpoint = text[len(PREEMPTED_MARK):]


def watch_launcher(events: queue.Queue, output: Output, watch_stdin: bool, on_where=None) -> None:
    """Post the launcher's commands (stdin lines after the spec: `stacks`; `where` calls `on_where`), and a
    stop when its end closes: stdin EOF, or stdout hang-up (pdsh).

    Without stdin (pdsh) a heartbeat line goes up every few seconds: if `crew run` is gone (and
    pdsh with it), the ssh client's write to pdsh fails, it exits, and the hang-up reaches here.
    """
    poller = select.poll()
    if watch_stdin:
        poller.register(0, select.POLLIN)
    poller.register(1, 0)  # errors and hang-ups only
    pending = b""
    while True:
        ready = poller.poll(None if watch_stdin else HEARTBEAT_S * 1000)
        if not ready:
            output.event("alive")
        for fd, _ in ready:
            if fd == 0 and (data := os.read(0, 65536)):
                *lines, pending = (pending + data).split(b"\n")
                pending = pending[-1024:]  # stray bytes: keep no more than a command's worth
                for line in lines:
                    if line.strip() == STACKS_COMMAND:
                        events.put(("stacks", "the launcher asked for every rank's stack"))
                    elif line.strip() == WHERE_COMMAND and on_where:
                        on_where()
                    elif line.strip() == PREEMPT_COMMAND:
                        events.put(("preempt", "crew run passed on a preemption notice"))
                continue  # anything else is ignored
            reason = "the launcher closed the connection" if fd == 0 else "the launcher is gone"
            events.put(("stop", reason))
            return


class Supervisor:
    """Waits for the ranks; on the first failure or a stop, takes every rank's group down."""

    def __init__(self, job: JobSpec, node_rank: int, ranks: list[Rank], output: Output,
                 events: queue.Queue, joins: JoinWatch | None = None, looks: sampler.Sampler | None = None):
        self.job, self.node, self.ranks = job, job.nodes[node_rank], ranks
        self.node_rank, self.output, self.events, self.joins = node_rank, output, events, joins
        self.looks = looks
        self.failure: Rank | None = None
        self.stop_reason: str | None = None
        self.preempted = False
        self._deadline: float | None = None
        self._killed = False

    def run(self) -> int:
        live = len(self.ranks)
        while live:
            try:
                kind, value = self.events.get(timeout=self._time_left())
            except queue.Empty:
                if self._killed:
                    break  # unkillable (D state): report what we have rather than hang
                self._signal_all(signal.SIGKILL)
                continue
            if kind == "exit":
                live -= 1
                self._on_exit(value)
            elif kind == "stop":
                self._stop(value)
            elif kind == "stacks":
                self._collect_stacks(value)
            elif kind == "signal":
                self._stop(value, escalate=True)
            elif kind == "preempt":
                self._preempt(value)
        self._signal_all(signal.SIGKILL)  # stray grandchildren left in a rank's group
        return self._exit_code()

    def _time_left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _on_exit(self, rank: Rank) -> None:
        if self.joins:
            self.joins.exited(rank)
        if rank.code == PREEMPTED_EXIT_CODE and self.failure is None:
            # the ranks agreed on a notice another node had first: let this node's others finish their save too
            self._preempt(f"rank {rank.rank} saved a checkpoint and exited (preempted)")
        if rank.code != 0 and self.failure is None and self.stop_reason is None:
            self.failure = rank
            rank.stderr_done.wait(STDERR_DRAIN_S)  # its last words (the error) may still be on the way
            timeout = rank.said_timeout
            self._report_failure(rank, timeout)
            if timeout:  # the others are likely stuck in the collective: see where, before they go
                self._collect_stacks(f"rank {rank.rank} timed out in a torch.distributed operation")
            else:
                self._stop(f"rank {rank.rank} failed")

    def _collect_stacks(self, reason: str) -> None:
        """Stop every live rank with SIGABRT, so that faulthandler prints its stack first.

        Only the rank's own process is sent SIGABRT (its helpers would interleave their dumps with
        it); no core file is written (RLIMIT_CORE 0). The rest of each group goes with SIGKILL at the
        end, and a rank still there after the grace period gets SIGKILL as in any stop.
        """
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self.stop_watching()
        for rank in self.ranks:
            if rank.proc.poll() is not None:
                continue
            rank.dump = []
            try:
                resource.prlimit(rank.proc.pid, resource.RLIMIT_CORE, (0, 0))
            except (OSError, ValueError):
                pass
            try:
                os.kill(rank.proc.pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        self._deadline = time.monotonic() + self.job.grace_s

    def _stop(self, reason: str, escalate: bool = False) -> None:
        if self.stop_reason is not None:
            if escalate:  # signalled again (a second Ctrl-C): no more grace
                self._signal_all(signal.SIGKILL)
            return
        self.stop_reason = reason
        self.stop_watching()
        self._signal_all(signal.SIGTERM)
        self._deadline = time.monotonic() + self.job.grace_s

    def _preempt(self, reason: str) -> None:
        """A preemption notice: SIGTERM to each rank's own process only (the DataLoader workers in its group
        keep serving the step it finishes), SIGKILL to every group after --preempt_grace. A rank whose config
        enables preemption saves and exits 75; one without a handler stops at once, as on any stop."""
        if self.stop_reason is not None:
            return
        self.stop_reason, self.preempted = f"preempted: {reason}", True
        self.stop_watching()  # a save is no stall
        self.output.event("preempt", node=self.node_rank, host=self.node.host, reason=reason)
        for rank in self.ranks:
            if rank.proc.poll() is None:
                try:
                    os.kill(rank.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        self._deadline = time.monotonic() + self.job.preempt_grace

    def stop_watching(self) -> None:
        """The ranks are being stopped: no more join states, no more looks at them."""
        if self.joins:
            self.joins.stopped.set()
        if self.looks:
            self.looks.stop()

    def _signal_all(self, sig: signal.Signals) -> None:
        for rank in self.ranks:
            signal_group(rank.proc.pid, sig)
        if sig == signal.SIGKILL:
            self._killed = True
            self._deadline = time.monotonic() + KILL_WAIT_S

    def _report_failure(self, rank: Rank, timeout: bool = False) -> None:
        code = rank.code
        self.output.event(
            "rank_failed", node=self.node_rank, host=self.node.host, rank=rank.rank,
            local_rank=rank.local_rank, code=code,
            signal=signal.Signals(-code).name if code < 0 else None,
            stderr_tail=list(rank.stderr_tail),
            log=rank.log.name if rank.log else None, collective_timeout=timeout)

    def report_stacks(self) -> None:
        """One `stack` event per rank that was sent SIGABRT: its main thread's frames, innermost first.

        Called once every pump is done, so each dump is complete.
        """
        for rank in self.ranks:
            if rank.dump is None:
                continue
            threads = stacks.parse_dump(rank.dump)
            frames = stacks.main_frames(threads or [])
            self.output.event(
                "stack", node=self.node_rank, host=self.node.host, rank=rank.rank,
                dumped=threads is not None, threads=len(threads or []),
                frames=[[f.file, f.line, f.func] for f in frames],
                log=rank.log.name if rank.log else None)

    def _exit_code(self) -> int:
        if self.failure is not None:
            code = self.failure.code
            return 128 - code if code < 0 else code
        if self.preempted and any(rank.code == PREEMPTED_EXIT_CODE for rank in self.ranks):
            return PREEMPTED_EXIT_CODE
        return 0 if self.stop_reason is None else 128 + signal.SIGTERM


def await_go(job: JobSpec, node_rank: int, output: Output) -> float | None:
    """The merged preflight (`crew run` over ssh): send this node's quick facts (`probe`), then wait for
    the launcher's verdict on every node's. The seconds waited on "go"; None when the launcher said
    no (stdin closed): then nothing starts here."""
    from crew.launcher.preflight.probe import probe

    output.event("probe", **probe(job, node_rank, full=False, save_dir=None, others_done=threading.Event()),
                 boot_s=round(seconds_since_exec(), 3))
    asked = time.monotonic()
    line = b""
    while not line.endswith(b"\n") and (chunk := os.read(0, 1)):  # unbuffered: later lines are the watch's
        line += chunk
    return time.monotonic() - asked if line.strip() == GO_COMMAND else None


def run(job: JobSpec, node_rank: int, watch_stdin: bool, wait_for_go: bool = False, under_mpi: bool = False) -> int:
    events: queue.Queue = queue.Queue()
    output = Output(lambda: events.put(("stop", "the launcher is gone")), node_rank, job.line_max)
    # Open MPI's mpirun passes crew's stop on as SIGUSR2 (its SIGTERM kills a second later)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, *((signal.SIGUSR2,) if under_mpi else ())):
        signal.signal(sig, lambda num, _: events.put(("signal", signal.Signals(num).name)))
    # Slurm's --signal=USR1@N (without B:) signals the step's tasks: these agents
    signal.signal(signal.SIGUSR1, lambda num, _: events.put(("preempt", "SIGUSR1 to the crew agent")))
    node = job.nodes[node_rank]
    waited_s = 0.0
    if wait_for_go and (waited_s := await_go(job, node_rank, output)) is None:
        return 0
    bindings = binding.for_node(job, node_rank)  # a str: why the cores cannot be divided
    problem = preflight(job, node_rank) or (bindings if isinstance(bindings, str) else None)
    if problem:
        output.event("error", node=node_rank, host=node.host, message=problem)
        return 1
    started = time.monotonic()
    boot_s = seconds_since_exec() - waited_s
    try:
        ranks = spawn(job, node_rank, bindings)
    except OSError as exc:
        output.event("error", node=node_rank, host=node.host,
                     message=f"cannot start the ranks on {node.host}: {exc}")
        return 1
    output.event("started", node=node_rank, host=node.host, pids=[r.proc.pid for r in ranks],
                 boot_s=round(boot_s, 3), spawn_s=round(time.monotonic() - started, 3),
                 waited_s=round(waited_s, 3), **binding.event_fields(bindings))
    joins = JoinWatch(job, node_rank, ranks, output) if job.init_timeout > 0 and job.world_size > 1 else None
    looks = sampler.Sampler(ranks, output, node_rank, node.host, job.cwd, sampler.look_interval(job.stall_watch_s),
                            every_stack=not watch_stdin) if job.stall_watch_s else None
    pumps = _start_threads(ranks, node, output, events, watch_stdin, joins, looks)
    supervisor = Supervisor(job, node_rank, ranks, output, events, joins, looks)
    code = supervisor.run()
    supervisor.stop_watching()
    for thread in pumps:
        thread.join(timeout=2.0)  # a daemon that escaped its group may hold a pipe open
    supervisor.report_stacks()
    for rank in ranks:
        if rank.log:
            rank.log.close()
    output.event("done", node=node_rank, host=node.host,
                 codes={r.rank: r.code for r in ranks}, exit_code=code, stop_reason=supervisor.stop_reason,
                 checkpoint=next((r.checkpoint for r in ranks if r.checkpoint), None), outputs=_outputs(ranks))
    return code


def _start_threads(ranks: list[Rank], node: NodeSpec, output: Output, events: queue.Queue, watch_stdin: bool,
                   joins: JoinWatch | None = None, looks: sampler.Sampler | None = None) -> list[threading.Thread]:
    def start(target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    pumps = []
    for rank in ranks:
        prefix = f"[{node.host}:{rank.rank}] ".encode()
        pumps.append(start(pump, rank, rank.proc.stdout, 1, prefix, output))
        pumps.append(start(pump, rank, rank.proc.stderr, 2, prefix, output))
        start(lambda r: (r.proc.wait(), events.put(("exit", r))), rank)
    start(watch_launcher, events, output, watch_stdin, looks.ask if looks else None)
    if joins:
        start(joins.run)
    if looks:
        start(looks.run)
    return pumps


def main(argv: list[str] | None = None) -> int:
    parser = node_arguments("python -m crew.launcher.node.agent", "crew's per-node agent (started by `crew run`).")
    parser.add_argument("--preflight", action="store_true",
                        help="send the quick checks' facts first, and start the ranks only on 'go' (stdin)")
    args = parser.parse_args(argv)
    if args.preflight and args.watch != "stdin":
        parser.error("--preflight needs the launcher's stdin (--watch stdin)")
    under_mpi = args.node_rank == MPI_NODE_RANK
    job = read_job(parser, args)  # resolves --node_rank slurm (or mpi) into this node's index
    if under_mpi:  # the ranks get crew's RANK/WORLD_SIZE..., never this agent's MPI rank as theirs
        for name in mpi_identity(os.environ):
            del os.environ[name]
    with pidfile.saved(job.save_pid):  # --save_pid
        code = run(job, args.node_rank, watch_stdin=args.watch == "stdin", wait_for_go=args.preflight,
                   under_mpi=under_mpi)
    # Under mpirun the codes travel in `done`: a non-zero exit would make mpirun abort the other nodes' agents
    # itself (Open MPI: SIGKILL a second after SIGTERM), overtaking crew's orderly stop of every node.
    return 0 if under_mpi else code

if __name__ == "__main__":
    sys.exit(main())
