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
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from crew.launcher import runners
from crew.launcher.console import Console
from crew.launcher.hangs import HANG_EXIT_CODE, HangWatch
from crew.launcher.proc import signal_tree
from crew.launcher.protocol import PROGRESS_MARK, STACKS_COMMAND, JobSpec, decode_event
from crew.launcher.record import FirstFailure, JobRecord
from crew.launcher.runners import AgentLaunch, ssh_fix

STOP_WAIT_S = 15.0  # after asking agents to stop: their grace period plus this, then SIGKILL
AGENT_TAIL_LINES = 20


@dataclass
class Agent:
    launch: AgentLaunch
    proc: subprocess.Popen
    started_at: float
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=AGENT_TAIL_LINES))


class JobRun:
    def __init__(self, job: JobSpec, launches: list[AgentLaunch], console: Console,
                 ports: dict[int, int | None] | None = None, record: JobRecord | None = None):
        self.job, self.launches, self.console = job, launches, console
        self.ports, self.record = ports or {}, record
        self.events: queue.Queue = queue.Queue()
        self.agents: list[Agent] = []
        self.failure: FirstFailure | None = None
        self.codes: dict[int, int] = {}  # each rank's exit code, from its node's `done`
        self.interrupted: str | None = None
        self.started: dict[int, dict] = {}
        self.done: set[int] = set()
        self._stop_deadline: float | None = None
        self.hangs = HangWatch(job, launches, console.say)  # join states, stacks, the report of a hang

    def run(self) -> int:
        handlers = self._install_signal_handlers()
        self.console.begin(sum(len(self.job.nodes[n].ranks) for a in self.launches for n in a.node_ranks))
        if self.record:
            self.record.start(self.job)
        try:
            for launch in self.launches:
                if self.failure is None:
                    self._start(launch)
            self._supervise()
            report = self.hangs.report()
            if report:
                self.console.say(report)
        finally:
            self.console.end()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        code = self._exit_code()
        if self.record:
            status = "failed" if self.failure else "interrupted" if self.interrupted else "succeeded"
            self.record.finish(code, status, self.codes, self.failure)
        return code

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(
                sig, lambda num, _: self.events.put(("signal", None, signal.Signals(num).name)))
        return previous

    def _start(self, launch: AgentLaunch) -> None:
        try:
            proc = runners.start(launch)
        except OSError as exc:
            self._fail(127, f"{launch.label}: cannot start '{launch.argv[0]}' ({exc.strerror}). "
                       "Install it on this machine (ssh: apt-get install openssh-client), or pass "
                       "--python with an interpreter that exists.")
            return
        agent = Agent(launch, proc, time.monotonic())
        index = len(self.agents)
        self.agents.append(agent)
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
        for line in self.agents[index].proc.stdout:
            event = decode_event(line)
            if event is None:
                self.console.agent_line(1, line)
            else:
                self.events.put(("event", index, event))

    def _read_stderr(self, index: int) -> None:
        agent = self.agents[index]
        for line in agent.proc.stderr:
            if not line.startswith(PROGRESS_MARK):
                agent.stderr_tail.append(line.decode(errors="replace").rstrip())
            self.console.agent_line(2, line)

    def _wait(self, index: int, readers: list[threading.Thread]) -> None:
        for reader in readers:
            reader.join()
        self.agents[index].proc.wait()
        self.events.put(("exited", index, None))

    def _supervise(self) -> None:
        running = len(self.agents)
        while running:
            try:
                kind, index, value = self.events.get(timeout=self._time_left())
            except queue.Empty:
                kind = None
            if kind == "event":
                self._on_event(index, value)
            elif kind == "exited":
                running -= 1
                self._on_agent_exit(self.agents[index])
            elif kind == "signal":
                self._on_signal(value)
            now = time.monotonic()
            if self._stop_deadline is not None and now >= self._stop_deadline:
                self._kill_agents()
            join_deadline = self._join_deadline()
            if join_deadline is not None and now >= join_deadline:
                self._on_join_deadline()

    def _time_left(self) -> float | None:
        deadlines = [d for d in (self._stop_deadline, self._join_deadline()) if d is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _stopping(self) -> bool:
        return self.failure is not None or self.interrupted is not None

    def _join_deadline(self) -> float | None:
        """When to give up on the ranks that have not joined (`HangWatch.deadline`); None once stopping."""
        return None if self._stopping() else self.hangs.deadline()

    def _on_join_deadline(self) -> None:
        message = self.hangs.on_deadline()
        if message:
            self._fail(HANG_EXIT_CODE, message, with_stacks=self.hangs.stacks_possible)

    def _on_event(self, index: int, event: dict) -> None:
        kind = event.get("event")
        if kind == "started":
            self.started[event["node"]] = {**event, "at": time.monotonic(),
                                           "agent_at": self.agents[index].started_at}
            self.hangs.node_started(event["node"])
            if len(self.started) == len(self.job.nodes):
                self._report_startup()
        elif kind == "join":
            self.hangs.on_join(event)
        elif kind == "stack":
            self.hangs.on_stack(event)
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
            self.codes.update({int(rank): _exit_code(code) for rank, code in event["codes"].items()
                               if code is not None})

    def _on_agent_exit(self, agent: Agent) -> None:
        missing = [n for n in agent.launch.node_ranks if n not in self.done]
        if missing and not self._stopping():
            code = agent.proc.returncode
            self._fail(_exit_code(code) or 1, self._describe_agent_failure(agent, code),
                       host=agent.launch.label)

    def _on_signal(self, name: str) -> None:
        if self.interrupted is not None:
            self.console.say(f"{name} again: killing every node's agent now.")
            self._kill_agents()
            return
        self.interrupted = name
        self.console.say(f"{name} received: stopping every rank on every node.")
        self._stop_all()

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
            else:  # pdsh: its agents watch their stdout, which ends with pdsh's ssh clients
                signal_tree(agent.proc.pid, signal.SIGTERM)

    def _kill_agents(self) -> None:
        for agent in self.agents:
            signal_tree(agent.proc.pid, signal.SIGKILL)
        self._stop_deadline = None

    def _report_startup(self) -> None:
        parts = []
        for node_rank in sorted(self.started):
            info = self.started[node_rank]
            total = info["at"] - info["agent_at"]
            connect = max(0.0, total - info["boot_s"] - info["spawn_s"])
            parts.append(f"{info['host']}: connect {connect:.2f}s, agent {info['boot_s']:.2f}s, "
                         f"ranks spawned {info['spawn_s']:.2f}s")
        slowest = max(i["at"] - i["agent_at"] for i in self.started.values())
        self.console.say(f"all {len(self.started)} node(s) started in {slowest:.2f}s ("
                         + "; ".join(parts) + ")")

    def _describe_agent_failure(self, agent: Agent, code: int) -> str:
        tail = "\n".join(f"    {line}" for line in agent.stderr_tail) or "    (nothing)"
        host = agent.launch.label
        fix = ssh_fix(agent.stderr_tail, host, self.ports.get(agent.launch.node_ranks[0]))
        message = f"{host}: the crew agent ended with code {code} before its ranks finished."
        if fix:
            message += " " + fix
        return f"{message}\n  Its last stderr lines:\n{tail}"

    def _exit_code(self) -> int:
        if self.failure is not None:
            return self.failure.exit_code
        if self.interrupted is not None:
            return 128 + signal.Signals[self.interrupted].value
        return 0


def _exit_code(code: int) -> int:
    """A shell's view of a process's end: N for exit(N), 128+S for signal S."""
    return 128 - code if code < 0 else code


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
