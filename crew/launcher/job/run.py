"""Run one job: start every node's agent, merge their output, stop them all on the first failure.

The launcher holds each agent's stdin open for the life of the job. Closing it is how the launcher
says "stop", and it is also what the agents see if the launcher dies, however it dies.

No silent hangs: the agents report each rank's join state (`joinwatch`), which a `hangs.HangWatch`
follows. When not every rank has joined the process group `init_timeout` seconds after the first one
reached the master port, the launcher asks every agent for its ranks' stacks (a `stacks` line on stdin),
which stops the job, and then prints the watch's report: which ranks joined, which did not, where each
rank was and what to do (exit code 124). A rank failing with a collective timeout gets the same: the
stacks of the ranks still running, and the ranks that did not arrive. pdsh gives the agents no stdin:
there the job is stopped with the join report but no stacks. This module does the wiring; the join
states, the deadline and the report texts live in `hangs`; what the ranks' lines look like on crew's
stdout and stderr (merged, progress bars drawn or thinned) in `console`; the job's record in `record`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

from crew.errors import PREEMPTED_EXIT_CODE
from crew.launcher.job import preempt
from crew.launcher.node import binding
from crew.launcher.transport import mpi, runners
from crew.launcher.console.console import Console
from crew.launcher.preflight.gate import PreflightGate
from crew.launcher.job.hangs import HANG_EXIT_CODE, HangWatch
from crew.launcher.job.holds import Holds, TaskEnd, srun_task_end
from crew.launcher.job.stalls import StallWatch, format_duration
from crew.launcher.transport.proc import signal_tree
from crew.launcher.transport.protocol import (GO_COMMAND, PREEMPT_COMMAND, PROGRESS_MARK, STACKS_COMMAND,
                                              WHERE_COMMAND, JobSpec, decode_event, whole_lines)
from crew.launcher.job.record import FirstFailure, JobRecord
from crew.launcher.transport.runners import AgentLaunch, ssh_fix

STOP_WAIT_S = 15.0  # after asking agents to stop: their grace period plus this, then SIGKILL
AGENT_TAIL_LINES = 20
# At most this many agents connecting at once (pdsh's -f; --fanout): the rest start as those send their
# preflight facts (or, without a preflight, report their ranks started), so the launcher's ssh handshakes
# and the nodes' Python start-ups overlap boundedly.
FANOUT = 32
LINE_MAX = 200  # crew's own lines stay this short whatever the node count (--verbose: every node)
SLOWEST = 3


@dataclass
class Agent:
    launch: AgentLaunch
    proc: subprocess.Popen
    started_at: float
    connecting: bool = True  # until its nodes report their facts (preflight) or ranks started, or it ends
    held: list[bytes] | None = None  # its stderr lines while the preflight decides: said only if it passes
    timed_out: bool = False  # killed for not answering the preflight in time
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=AGENT_TAIL_LINES))


class JobRun:
    def __init__(self, job: JobSpec, launches: list[AgentLaunch], console: Console,
                 ports: dict[int, int | None] | None = None, record: JobRecord | None = None,
                 verbose: bool = False, fanout: int = FANOUT, gate: PreflightGate | None = None):
        self.job, self.launches, self.console, self.gate = job, launches, console, gate
        self.ports, self.record, self.verbose = ports or {}, record, verbose
        self.fanout = max(1, fanout)
        self.pending = collections.deque(launches)  # not started yet: the fan-out window is full
        self.connecting = 0  # agents started that have not answered yet (Agent.connecting)
        self.all_started_at: float | None = None  # monotonic: every node reported its ranks started
        self.finished_at: float | None = None  # monotonic: every agent has exited
        self.events: queue.Queue = queue.Queue()
        self.agents: list[Agent] = []
        self.failure: FirstFailure | None = None
        self.codes: dict[int, int] = {}  # each rank's exit code, from its node's `done`
        self.interrupted: str | None = None
        self.preempted: str | None = None  # the line that said why the ranks were asked to save and exit
        self.checkpoint: str | None = None  # where the preempted ranks saved
        self.outputs: list[dict] = []  # rank 0's checkpoints and monitor folders (crew/outputs.py), from `done`
        self.status = "running"  # then succeeded, failed, interrupted or preempted (as in crew_job.json)
        self.raw_codes: dict[int, int | None] = {}  # each rank's exit as its agent saw it (-N: signal N)
        self.started: dict[int, dict] = {}
        self.done: set[int] = set()
        self.ended: set[int] = set()  # nodes whose agent process has exited
        self.holds = Holds()  # an outside stop or srun's word on a task's end, until the nodes' own come
        self._stop_deadline: float | None = None
        self._held_lock = threading.Lock()
        self.hangs = HangWatch(job, launches, console.say, console.info)  # join states, stacks, a hang's report
        own_nodes = len({node for launch in launches for node in launch.node_ranks})  # standalone: one
        self.stalls = StallWatch(self.hangs.hosts, own_nodes, job.stall_report, job.collective_timeout,
                                 self.hangs.stacks_possible, console.say) if job.stall_watch_s else None

    def run(self) -> int:
        handlers = self._install_signal_handlers()
        self.console.begin(sum(len(self.job.nodes[n].ranks) for a in self.launches for n in a.node_ranks))
        if self.record:
            self.record.start(self.job)
        try:
            self._start_more()
            self._supervise()
            self.finished_at = time.monotonic()
            if self.stalls and self.stalls.reported and not self._stopping():
                self.stalls.check()  # the ranks moved on and ended before the next look: say the stall is over
            report = self.hangs.report()
            if report:
                self.console.say(report)
            if self.preempted and not self.failure:
                self.console.say(preempt.closing_line(self.raw_codes, self.checkpoint, self.job.preempt_grace))
        finally:
            self.console.end()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        code = self._exit_code()
        self.status = "failed" if self.failure else "preempted" if code == PREEMPTED_EXIT_CODE \
            else "interrupted" if self.interrupted or self.preempted else "succeeded"
        if self.record:
            self.record.finish(code, self.status, self.codes, self.failure, self.outputs)
        return code

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            previous[sig] = signal.signal(
                sig, lambda num, _: self.events.put(("signal", None, signal.Signals(num).name)))
        return previous

    def _start_more(self) -> None:
        """Start agents until the window is full. In this (the main) thread: a child's parent-death
        signal follows the thread that started it, so a worker thread's end would kill its ssh."""
        while self.pending and self.connecting < self.fanout and not self._stopping():
            self._start(self.pending.popleft())
        if self._stopping():
            self.pending.clear()

    def _connected(self, agent: Agent) -> None:
        if agent.connecting:
            agent.connecting = False
            self.connecting -= 1

    def _start(self, launch: AgentLaunch) -> None:
        try:
            proc = runners.start(launch)
        except OSError as exc:
            self._fail(127, f"{launch.label}: cannot start '{launch.argv[0]}' ({exc.strerror}). "
                       "Install it on this machine (ssh: apt-get install openssh-client), or pass "
                       "--python with an interpreter that exists.")
            return
        agent = Agent(launch, proc, time.monotonic(), held=[] if self.gate else None)
        index = len(self.agents)
        self.agents.append(agent)
        self.connecting += 1
        if launch.spec_on_stdin:
            try:
                proc.stdin.write(self.job.to_line())
                proc.stdin.flush()
            except OSError:
                pass  # it died at once; its stderr says why
        readers = [self._thread(self._read_stdout, index), self._thread(self._read_stderr, index)]
        self._thread(self._wait, index, readers)

    def _thread(self, target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    def _read_stdout(self, index: int) -> None:
        for line in whole_lines(self.agents[index].proc.stdout):
            event = decode_event(line)
            if event is None:
                self.console.agent_line(1, line)
            else:
                self.events.put(("event", index, event))

    def _read_stderr(self, index: int) -> None:
        agent = self.agents[index]
        for line in whole_lines(agent.proc.stderr):
            if not line.startswith(PROGRESS_MARK):
                agent.stderr_tail.append(line.decode(errors="replace").rstrip())
            if agent.launch.label == "srun" and (end := srun_task_end(line.decode(errors="replace"))):
                self.events.put(("task_end", index, end))  # crew says it, or quotes it (holds)
                continue
            if agent.launch.label == "mpirun" and len(self.started) < len(self.job.nodes) and \
                    (host := mpi.ssh_failure(line.decode(errors="replace"))) is not None:
                self.events.put(("ssh_failed", index, (line.decode(errors="replace").strip(), host)))
            with self._held_lock:
                if agent.held is not None:
                    agent.held.append(line)
                    continue
            if self._stopping() and line.startswith(agent.launch.chatter):
                continue  # srun on its tasks' ends: crew has said it, and the tail keeps it
            self.console.agent_line(2, line)

    def _wait(self, index: int, readers: list[threading.Thread]) -> None:
        for reader in readers:
            reader.join()
        self.agents[index].proc.wait()
        self.events.put(("exited", index, None))

    def _supervise(self) -> None:
        running = len(self.agents)
        while running or self.pending:
            try:
                kind, index, value = self.events.get(timeout=self._time_left())
            except queue.Empty:
                kind = None
            if kind == "event":
                self._on_event(index, value)
            elif kind == "exited":
                running -= 1
                self._connected(self.agents[index])
                self._on_agent_exit(self.agents[index])
            elif kind == "signal":
                self._on_signal(value)
            elif kind == "task_end":
                self._on_task_end(self.agents[index], value)
            elif kind == "ssh_failed":
                self._on_mpi_ssh_failure(*value)
            self._judge_held()
            before = len(self.agents)
            self._start_more()
            running += len(self.agents) - before
            now = time.monotonic()
            if self._stop_deadline is not None and now >= self._stop_deadline:
                self._kill_agents()
            preflight_deadline = self._preflight_deadline()
            if preflight_deadline is not None and now >= preflight_deadline:
                self._on_preflight_deadline()
            join_deadline = self._join_deadline()
            if join_deadline is not None and now >= join_deadline:
                self._on_join_deadline()
            stall_check = self._stall_deadline()
            if stall_check is not None and now >= stall_check:
                self._on_stall_check()

    def _time_left(self) -> float | None:
        deadlines = [d for d in (self._stop_deadline, self._join_deadline(), self._preflight_deadline(),
                                 self.holds.deadline(), self._stall_deadline()) if d is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _stopping(self) -> bool:
        return self.failure is not None or self.interrupted is not None or self.preempted is not None

    def _join_deadline(self) -> float | None:
        """When to give up on the ranks that have not joined (`HangWatch.deadline`); None once stopping."""
        return None if self._stopping() else self.hangs.deadline()

    def _stall_deadline(self) -> float | None:
        return None if self._stopping() or not self.stalls else self.stalls.deadline()

    def _on_stall_check(self) -> None:
        """Ask every agent where its ranks are, or end a stall that lasted --collective_timeout."""
        action = self.stalls.check()
        if action == "ask":
            self._tell_agents(WHERE_COMMAND)
        elif action == "end":
            self.hangs.on_stall_end()
            then = ("Collecting every rank's Python stack (SIGABRT; faulthandler prints it) before stopping the "
                    "job; the report follows." if self.hangs.stacks_possible else "Stopping the job.")
            self._fail(HANG_EXIT_CODE, f"the stall lasted {format_duration(self.job.collective_timeout)} "
                       f"(--collective_timeout). {then}", with_stacks=self.hangs.stacks_possible)

    def _tell_agents(self, command: bytes) -> None:
        for agent in self.agents:
            if command == PREEMPT_COMMAND and agent.launch.stop_signal:  # mpirun passes SIGUSR1 on to every agent
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent.proc.pid, signal.SIGUSR1)
            elif agent.launch.spec_on_stdin:
                try:
                    agent.proc.stdin.write(command + b"\n")
                    agent.proc.stdin.flush()
                except (OSError, ValueError):
                    pass  # it has just ended: its exit says so

    def _on_join_deadline(self) -> None:
        message = self.hangs.on_deadline()
        if message:
            self._fail(HANG_EXIT_CODE, message, with_stacks=self.hangs.stacks_possible)

    def _on_event(self, index: int, event: dict) -> None:
        kind = event.get("event")
        if kind == "probe" and self.gate and self.gate.waiting:
            self.gate.on_probe(event)
            if all(node in self.gate.facts for node in self.agents[index].launch.node_ranks):
                self._connected(self.agents[index])  # srun: every node of it
            self._open_gate()
        elif kind == "started":
            agent = self.agents[index]
            self.started[event["node"]] = {**event, "at": time.monotonic(), "agent_at": agent.started_at}
            self.hangs.node_started(event["node"])
            if all(node in self.started for node in agent.launch.node_ranks):
                self._connected(agent)
            if len(self.started) == len(self.job.nodes):
                self.all_started_at = time.monotonic()
                self._report_startup()
        elif kind == "join":
            self.hangs.on_join(event)
        elif kind == "places" and self.stalls:
            self.stalls.on_places(event)
        elif kind == "stack":
            self.hangs.on_stack(event)
        elif kind == "preempt" and not self._stopping():  # an agent had the notice (Slurm's step signal)
            self._preempt(f"preemption notice ({event['host']}: {event['reason']}): passing it to every node.")
        elif kind == "rank_failed":
            timeout = bool(event.get("collective_timeout")) and not self._stopping()
            message = _describe_rank_failure(event)
            if timeout:
                message += self.hangs.on_collective_timeout(event)
            self._fail(_exit_code(event["code"]), message, with_stacks=timeout, rank=event["rank"],
                       host=event["host"], signal=event.get("signal"))
        elif kind == "error":
            self._fail(1, f"{event['host']}: {event['message']}", host=event["host"])
        elif kind == "done":
            self.done.add(event["node"])
            if self.stalls:
                self.stalls.node_done(event)
            self.codes.update({int(rank): _exit_code(code) for rank, code in event["codes"].items()
                               if code is not None})
            self.raw_codes.update({int(rank): code for rank, code in event["codes"].items()})
            self.checkpoint = self.checkpoint or event.get("checkpoint")
            self.outputs += [dict(entry, host=event["host"]) for entry in event.get("outputs") or ()]
            self.holds.reported(event["node"])
            if event.get("exit_code") and not self._stopping():  # stopped by someone else: not a success
                self.holds.outside_stop(event)  # unless a rank failure elsewhere is on its way (holds)

    def _on_agent_exit(self, agent: Agent) -> None:
        if self.gate and self.gate.waiting:
            if not self._stopping():
                self.gate.on_exit(agent.launch.node_ranks, agent.proc.returncode, list(agent.stderr_tail),
                                  agent.timed_out)
                self._open_gate()
            return
        self.ended.update(agent.launch.node_ranks)
        missing = [n for n in agent.launch.node_ranks if n not in self.done]
        if missing and not self._stopping() and self.holds.outside is None:
            code = agent.proc.returncode
            self._fail(_exit_code(code) or 1, self._describe_agent_failure(agent, code),
                       host=agent.launch.label)

    def _on_mpi_ssh_failure(self, line: str, host: str) -> None:
        """mpirun's ssh to a node failed: its agent will never start (Hydra would wait for it forever)."""
        port = next((self.ports.get(n) for n, node in enumerate(self.job.nodes) if node.host == host), None)
        fix = ssh_fix([line], host or "that node", port)
        message = f"mpirun could not log in to {host or 'a node'} over ssh ({line})."
        self._fail(255, f"{message} {fix}" if fix else message, host=host or "mpirun")

    def _on_task_end(self, agent: Agent, end: TaskEnd) -> None:
        for node in agent.launch.node_ranks:
            if self.job.nodes[node].host in end.hosts and node not in self.done:
                self.holds.task_end(node, end)

    def _judge_held(self) -> None:
        """End the job on what `holds` kept back, once it falls due."""
        if self._stopping():
            self.holds.clear()
            return
        outside, ended = self.holds.due(settled=len(self.done | self.ended) == len(self.job.nodes))
        if outside is not None:
            self._fail(outside["exit_code"], _describe_outside_stop(outside), host=outside["host"])
        for node, end in ended:
            self._on_silent_end(node, end)

    def _on_silent_end(self, node: int, end: TaskEnd) -> None:
        """srun says a node's agent ended, and it never said `done`: it died, or never started."""
        agent = next(a for a in self.agents if node in a.launch.node_ranks)
        if self.gate and self.gate.waiting:
            self.gate.on_exit((node,), end.code, list(agent.stderr_tail), False)
            self._open_gate()
        elif not self._stopping():
            host = self.job.nodes[node].host
            self._fail(end.code, self._describe_agent_failure(agent, end.code, host, f"(srun: {end.status})"),
                       host=host)

    def _open_gate(self) -> None:
        """Every node has answered the preflight: start all their ranks, or none."""
        verdict = None if self._stopping() else self.gate.decide()
        if verdict is None:
            return
        passed, text = verdict
        if not passed:
            self._fail(1, text)  # closes every agent's stdin: they end without starting a rank
            return
        self.console.info(text)
        for agent in self.agents:
            try:
                agent.proc.stdin.write(GO_COMMAND + b"\n")
                agent.proc.stdin.flush()
            except (OSError, ValueError):
                pass  # it has just died: its exit says so
            with self._held_lock:
                held, agent.held = agent.held or [], None
            for line in held:
                self.console.agent_line(2, line)

    def _preflight_deadline(self) -> float | None:
        """When the first agent still silent on the preflight is given up on."""
        if not self.gate or not self.gate.waiting or self._stopping():
            return None
        silent = [a.started_at for a in self.agents if a.connecting and not a.timed_out]
        return min(silent) + self.gate.timeout if silent else None

    def _on_preflight_deadline(self) -> None:
        now = time.monotonic()
        for agent in self.agents:
            if agent.connecting and not agent.timed_out and now >= agent.started_at + self.gate.timeout:
                agent.timed_out = True
                signal_tree(agent.proc.pid, agent.launch.kill_signal)  # its exit tells the gate

    def _on_signal(self, name: str) -> None:
        if self.interrupted is not None or self.preempted is not None:
            self.console.say(f"{name} again: killing every node's agent now.")
            self._kill_agents()
            return
        self.interrupted = name
        if name in preempt.NOTICE_SIGNALS and self.agents and all(a.launch.spec_on_stdin or a.launch.stop_signal
                                                                  for a in self.agents):
            self._preempt(preempt.notice_line(name, self.job.preempt_grace))
            return
        self.console.say(f"{name} received: stopping every rank on every node.")
        self._stop_all()

    def _preempt(self, line: str) -> None:
        """Say `line` and pass a preemption notice to every agent (`preempt`): the ranks get --preempt_grace."""
        self.preempted = line
        self.console.say(line)
        self._stop_deadline = time.monotonic() + self.job.preempt_grace + STOP_WAIT_S
        self._tell_agents(PREEMPT_COMMAND)

    def _fail(self, code: int, message: str, with_stacks: bool = False, **where) -> None:
        """The first failure stops the job; `where`: the rank, host and signal, when known."""
        if self._stopping():
            return
        self.failure = FirstFailure(code, message, **where)
        self.console.say(message)
        self._stop_all(with_stacks)

    def _stop_all(self, with_stacks: bool = False) -> None:
        """Stop every agent: close its stdin, after a `stacks` line if `with_stacks` (then each agent stops
        its ranks with SIGABRT, so that they print their stacks first). pdsh: SIGTERM, never stacks."""
        self._stop_deadline = time.monotonic() + self.job.grace_s + STOP_WAIT_S
        for agent in self.agents:
            if agent.launch.spec_on_stdin:
                try:
                    if with_stacks and not agent.proc.stdin.closed:
                        agent.proc.stdin.write(STACKS_COMMAND + b"\n")
                        agent.proc.stdin.flush()
                except (OSError, ValueError):
                    pass
                try:
                    agent.proc.stdin.close()
                except (OSError, ValueError):
                    pass
            elif agent.launch.stop_signal:  # mpirun, alone: it passes the signal to every agent and waits for them
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent.proc.pid, agent.launch.stop_signal)
            else:  # pdsh: its agents watch their stdout, which ends with pdsh's ssh clients
                signal_tree(agent.proc.pid, signal.SIGTERM)

    def _kill_agents(self) -> None:
        for agent in self.agents:
            signal_tree(agent.proc.pid, agent.launch.kill_signal)  # srun: SIGTERM, on which it kills its tasks
        self._stop_deadline = None

    def _report_startup(self) -> None:
        times = startup_times(self.started)
        for line in [*startup_lines(times, self.verbose), *binding.startup_lines(self.started, self.verbose)]:
            self.console.info(line)
        if self.record:
            self.record.startup(times)

    def _describe_agent_failure(self, agent: Agent, code: int, node_host: str | None = None,
                                how: str | None = None) -> str:
        """`node_host`: the one node it was about, where the agent served several (srun)."""
        tail = "\n".join(f"    {line}" for line in agent.stderr_tail) or "    (nothing)"
        host = node_host or agent.launch.label
        where = host if node_host or len(agent.launch.node_ranks) == 1 else "the nodes"  # pdsh, srun: all
        fix = ssh_fix(agent.stderr_tail, where, self.ports.get(agent.launch.node_ranks[0]))
        message = f"{host}: the crew agent ended {how or f'with code {code}'} before its ranks finished."
        if fix:
            message += " " + fix
        return f"{message}\n  Its last stderr lines:\n{tail}"

    def _exit_code(self) -> int:
        if self.failure is not None:
            return self.failure.exit_code
        if self.preempted is not None:
            return preempt.exit_code(self.raw_codes)
        if self.interrupted is not None:
            return 128 + signal.Signals[self.interrupted].value
        return 0


def startup_times(started: dict[int, dict]) -> dict[int, dict]:
    """Each node's start-up, from its `started` event: ssh connect, the agent's Python start and imports,
    its wait for the other nodes' preflight, spawning its ranks, and the total from the launcher's start
    of its agent."""
    times = {}
    for node, info in sorted(started.items()):
        total = info["at"] - info["agent_at"]
        waited = info.get("waited_s", 0.0)
        times[node] = {"host": info["host"], "total": round(total, 3),
                       "connect": round(max(0.0, total - info["boot_s"] - waited - info["spawn_s"]), 3),
                       "agent": info["boot_s"], "waited": waited, "spawn": info["spawn_s"]}
    return times


def startup_lines(times: dict[int, dict], verbose: bool = False) -> list[str]:
    """`all N node(s) started` in one line of at most LINE_MAX characters: every node's times when they
    fit, else the medians and the slowest nodes; --verbose adds one line per node."""
    def node_text(t: dict) -> str:
        return (f"{t['host']}: connect {t['connect']:.2f}s, agent {t['agent']:.2f}s, "
                f"ranks spawned {t['spawn']:.2f}s")

    slowest = max(t["total"] for t in times.values())
    head = f"all {len(times)} node(s) started in {slowest:.2f}s"
    line = f"{head} (" + "; ".join(node_text(t) for t in times.values()) + ")"
    if len(line) > LINE_MAX or verbose:
        def median(key: str) -> float:
            return statistics.median(t[key] for t in times.values())

        line = (f"{head}; per node (median): connect {median('connect'):.2f}s, agent {median('agent'):.2f}s, "
                f"ranks spawned {median('spawn'):.2f}s")
        ranked = sorted(times.values(), key=lambda t: -t["total"])
        line = fit_list(line + "; slowest: ", [f"{t['host']} {t['total']:.2f}s" for t in ranked[:SLOWEST]])
    if not verbose:
        return [line]
    def waited(t: dict) -> str:
        return f", waited {t['waited']:.2f}s for the other nodes' preflight" if t.get("waited") else ""

    return [line, *(f"  node {node}: {node_text(t)}{waited(t)}, total {t['total']:.2f}s"
                    for node, t in times.items())]


def fit_list(head: str, items: list[str], limit: int = LINE_MAX) -> str:
    """`head` and as many of `items` as fit in `limit` characters, with how many were left out."""
    line = head
    for count, item in enumerate(items):
        more = f" (+{len(items) - count - 1} more)" if count + 1 < len(items) else ""
        candidate = line + (", " if count else "") + item
        if len(candidate + more) > limit and count:
            return line + f" (+{len(items) - count} more)"
        line = candidate
    return line[:limit]


def _exit_code(code: int) -> int:
    """A shell's view of a process's end: N for exit(N), 128+S for signal S."""
    return 128 - code if code < 0 else code


def _describe_outside_stop(event: dict) -> str:
    """An agent that stopped its ranks though crew did not ask (a signal to it: scancel, a Slurm time limit,
    a kill by hand)."""
    why = event.get("stop_reason") or f"exit code {event['exit_code']}"
    return (f"{event['host']}: the crew agent stopped every rank there ({why}) without crew asking: a Slurm "
            "job cancelled (scancel) or past its time limit, or a signal sent by hand.")


def _describe_rank_failure(event: dict) -> str:
    where = f"{event['host']} rank {event['rank']} (local {event['local_rank']})"
    if event.get("signal"):
        how = f"was killed by {event['signal']} (signal {-event['code']})"
        if event["signal"] == "SIGKILL":
            how += "; if crew did not send it, the kernel's out-of-memory killer may have (dmesg)"
    else:
        how = f"exited with code {event['code']}"
    lines = [f"{where} {how} (first failure)."]
    if event.get("stderr_tail"):
        lines.append("  Last stderr lines:")
        lines += [f"    {line}" for line in event["stderr_tail"]]
    if event.get("log"):
        lines.append(f"  Log: {event['log']}")
    return "\n".join(lines)
