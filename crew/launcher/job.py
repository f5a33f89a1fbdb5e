"""Run one job: start every node's agent, merge their output, stop them all on the first failure.

The launcher holds each agent's stdin open for the life of the job. Closing it is how the launcher
says "stop", and it is also what the agents see if the launcher dies, however it dies.

No silent hangs: the agents report each rank's join state (`joinwatch`). When not every rank has joined
the process group `init_timeout` seconds after the first one reached the master port, the launcher asks
every agent for its ranks' stacks (a `stacks` line on stdin), which stops the job, and then says which
ranks joined, which did not, where each rank was and what to do (exit code 124). A rank failing with a
collective timeout gets the same: the stacks of the ranks still running, and the ranks that did not
arrive. pdsh gives the agents no stdin: there the job is stopped with the join report but no stacks.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from crew.launcher import joinwatch, stacks
from crew.launcher.joinwatch import CONNECTING, EXITED, JOINED, LISTENING, NOT_CONNECTED
from crew.launcher.proc import die_with_parent, signal_tree
from crew.launcher.protocol import STACKS_COMMAND, JobSpec, decode_event
from crew.launcher.runners import AgentLaunch, ssh_fix

STOP_WAIT_S = 15.0  # after asking agents to stop: their grace period plus this, then SIGKILL
AGENT_TAIL_LINES = 20
HANG_EXIT_CODE = 124  # as timeout(1): the ranks did not all join within --init_timeout


@dataclass
class Agent:
    launch: AgentLaunch
    proc: subprocess.Popen
    started_at: float
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=AGENT_TAIL_LINES))


@dataclass
class Failure:
    code: int
    message: str


class Console:
    """The launcher's stdout (rank output) and stderr (ranks' stderr and crew's own messages)."""

    def __init__(self, out: BinaryIO, err: BinaryIO):
        self.out, self.err, self._lock = out, err, threading.Lock()

    def write(self, stream: BinaryIO, data: bytes) -> None:
        with self._lock:
            try:
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):
                pass  # our own terminal or pipe is gone; keep tearing down regardless

    def say(self, text: str) -> None:
        self.write(self.err, "".join(f"crew: {line}\n" for line in text.splitlines()).encode())


class JobRun:
    def __init__(self, job: JobSpec, launches: list[AgentLaunch], console: Console,
                 ports: dict[int, int | None] | None = None):
        self.job, self.launches, self.console = job, launches, console
        self.ports = ports or {}
        self.events: queue.Queue = queue.Queue()
        self.agents: list[Agent] = []
        self.failure: Failure | None = None
        self.interrupted: str | None = None
        self.started: dict[int, dict] = {}
        self.done: set[int] = set()
        self._stop_deadline: float | None = None
        self._t0 = time.monotonic()
        # Join watch: which ranks this launcher runs, their last `join` event, when to give up.
        self.hosts = {rank: job.nodes[n].host for launch in launches for n in launch.node_ranks
                      for rank in job.nodes[n].ranks}
        self.node_of = {rank: n for launch in launches for n in launch.node_ranks for rank in job.nodes[n].ranks}
        self.joins: dict[int, dict] = {}
        self._watching = job.init_timeout > 0 and job.world_size > 1
        self._reached_at: float | None = None  # when a rank first joined, listened or connected
        self._all_started_at: float | None = None
        self._warned_unjoined = False
        # A hang being reported ("init" or "collective"): the stacks the agents send, and its report.
        self.hang: str | None = None
        self._hang_joins: dict[int, dict] = {}
        self._hang_failed: dict | None = None
        self.rank_stacks: dict[int, dict] = {}

    def run(self) -> int:
        handlers = self._install_signal_handlers()
        try:
            for launch in self.launches:
                if self.failure is None:
                    self._start(launch)
            self._supervise()
            if self.hang:
                self.console.say(self._hang_report())
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return self._exit_code()

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(
                sig, lambda num, _: self.events.put(("signal", None, signal.Signals(num).name)))
        return previous

    def _start(self, launch: AgentLaunch) -> None:
        env = {**os.environ, **launch.env} if launch.env else None
        # Own session: a Ctrl-C reaches only `crew run`, which then stops every node in order.
        # Dies with `crew run`: pdsh would outlive it (it ignores SIGPIPE), keeping nodes busy.
        try:
            proc = subprocess.Popen(launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, start_new_session=True,
                                    preexec_fn=die_with_parent)
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
                self.console.write(self.console.out, line)
            else:
                self.events.put(("event", index, event))

    def _read_stderr(self, index: int) -> None:
        agent = self.agents[index]
        for line in agent.proc.stderr:
            agent.stderr_tail.append(line.decode(errors="replace").rstrip())
            self.console.write(self.console.err, line)

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

    # ---------------------------------------------------------------------------------------
    # join watch

    def _join_deadline(self) -> float | None:
        """When to give up on the ranks that have not joined; None while there is nothing to wait for.

        init_timeout after the first rank reached the master port. When none has (yet), init_timeout
        after every node started; that deadline only warns: a job whose ranks never use the master
        port (no torch.distributed, or init_method file://) may well be fine.
        """
        if not self._watching or self.failure is not None or self.interrupted is not None:
            return None
        start = self._reached_at
        if start is None and not self._warned_unjoined:
            start = self._all_started_at
        return None if start is None else start + self.job.init_timeout

    def _state(self, rank: int, joins: dict[int, dict] | None = None) -> str | None:
        event = (self.joins if joins is None else joins).get(rank)
        return event["state"] if event else None

    def _on_join(self, event: dict) -> None:
        if not self._watching:
            return
        self.joins[event["rank"]] = event
        if event["state"] in (JOINED, LISTENING, CONNECTING) and self._reached_at is None:
            self._reached_at = time.monotonic()
        states = [self._state(rank) for rank in self.hosts]
        if all(state in (JOINED, EXITED) for state in states):
            self._watching = False
            if all(state == JOINED for state in states):
                self.console.say(
                    f"all {len(states)} ranks joined the process group (master {self.job.master_addr}:"
                    f"{self.job.master_port}) {time.monotonic() - self._t0:.2f}s after the start")

    def _on_join_deadline(self) -> None:
        missing = [rank for rank in self.hosts if self._state(rank) not in (JOINED, EXITED)]
        timeout = f"{self.job.init_timeout:g} s (--init_timeout)"
        master = f"{self.job.master_addr}:{self.job.master_port}"
        if self._reached_at is None:
            self._warned_unjoined = True
            self.console.say(
                f"no rank has connected to the master {master} within {timeout}: if the script uses "
                "torch.distributed, every rank is still before init_process_group (or cannot reach the "
                "master). crew keeps waiting: it stops a job when some ranks joined and others did not "
                "(init_process_group's own timeout ends a wait for a master that never answers).")
            return
        joined = [rank for rank in self.hosts if self._state(rank) == JOINED]
        self.hang, self._hang_joins = "init", dict(self.joins)
        stacks_possible = self._stacks_possible()
        then = ("Collecting every rank's Python stack (SIGABRT; faulthandler prints it) before stopping "
                "the job; the report follows." if stacks_possible else
                "Stopping the job; the report follows.")
        self._fail(HANG_EXIT_CODE,
                   f"ranks did not all join the process group at {master} within {timeout}: "
                   f"joined: {self._ranks_at(joined)}; missing: {self._ranks_at(missing)}. {then}",
                   with_stacks=stacks_possible)

    def _ranks_at(self, ranks: list[int]) -> str:
        """`ranks 0-1 (a), rank 2 (b)`, or `none`."""
        items = [(rank, self.hosts.get(rank, "?"), "") for rank in ranks]
        return ", ".join(f"{stacks.rank_list(group)} ({host})" for group, host, _ in stacks.grouped(items)) or "none"

    def _stacks_possible(self) -> bool:
        """Whether every agent can be asked for stacks: not under pdsh, whose agents have no stdin."""
        return all(agent.launch.spec_on_stdin for agent in self.agents)

    def _hang_report(self) -> str:
        return self._init_report() if self.hang == "init" else self._collective_report()

    def _places(self) -> dict[int, stacks.Where | None]:
        """Where each rank that sent its stack was."""
        return {rank: stacks.where([stacks.Frame(*frame) for frame in event["frames"]], self.job.cwd)
                for rank, event in self.rank_stacks.items()}

    def _where_lines(self, places: dict[int, stacks.Where | None], verbs: dict[int, str]) -> list[str]:
        items = [(rank, self.hosts.get(rank, "?"), stacks.describe(place, verbs.get(rank, "waiting")))
                 for rank, place in places.items()]
        if not items:
            return ["no stack came back: the ranks had ended, or their agents did not answer."]
        logs = f", and in {self.job.log_dir}/rank<N>.log" if self.job.log_dir else ""
        return [f"where each rank was (full stacks above{logs}):",
                *(f"  {line}" for line in stacks.group_lines(items))]

    def _init_report(self) -> str:
        """Which ranks joined, which did not and why (join state, and stack when taken), where each was."""
        job, joins = self.job, self._hang_joins
        master = joinwatch.format_address(job.master_addr, job.master_port)
        places = self._places()
        rank0 = self._state(0, joins) if 0 in self.hosts else None
        joined = [rank for rank in self.hosts if self._state(rank, joins) == JOINED]
        lines = [f"the process group did not form: not every rank joined within {job.init_timeout:g} s "
                 f"(--init_timeout); master {master} (MASTER_ADDR:MASTER_PORT).",
                 f"  joined: {self._ranks_at(joined)}"]
        missing = []
        for rank, host in self.hosts.items():
            event = joins.get(rank) or {}
            state = event.get("state")
            if state == JOINED:
                continue
            if state is None and self.node_of[rank] not in self.started:
                cause = "its node's agent had not started (ssh still connecting?)"
            elif state == EXITED:
                cause = f"it ended (code {event.get('code')}) before it was seen joining"
            else:
                place = places.get(rank)
                cause = joinwatch.missing_cause(
                    state or NOT_CONNECTED, event.get("remote"), host, job.master_addr, job.master_port,
                    rank0, stack_taken=place is not None, in_init=bool(place and place.in_collective))
            missing.append((rank, host, cause))
        lines += [f"  missing: {stacks.rank_list(ranks)} on {host}: {cause}"
                  for ranks, host, cause in stacks.grouped(missing)]
        if self._stacks_possible():
            lines += self._where_lines(places, {})
        else:
            lines.append("no stacks: the pdsh launcher gives the agents no stdin to ask them with "
                         "(--launcher ssh does).")
        lines.append("Raise --init_timeout if start-up legitimately takes this long (imports, data loading "
                     "before init_process_group); 0 disables the check.")
        return "\n".join(lines)

    def _collective_report(self) -> str:
        """Where each rank was when one timed out in a collective; the ranks that were not in one."""
        failed = self._hang_failed or {}
        rank = failed.get("rank")
        places = self._places()
        verbs = {}
        tail = failed.get("stderr_tail", ())
        dump = stacks.parse_dump(tail)  # NCCL's watchdog aborts the rank: faulthandler's dump, if any
        own = stacks.where(stacks.main_frames(dump) if dump else stacks.parse_traceback(tail), self.job.cwd)
        if rank is not None and own is not None:
            places[rank], verbs[rank] = own, "timed out"
        lines = [f"rank {rank} timed out in a torch.distributed operation."]
        if places:
            lines += self._where_lines(places, verbs)
        if not self._stacks_possible():
            lines.append("no stacks from the other nodes: the pdsh launcher gives the agents no stdin to ask "
                         "them with (--launcher ssh does).")
        late = [(r, self.hosts.get(r, "?"), place.location) for r, place in places.items()
                if place is not None and not place.in_collective and r != rank]
        if late:
            lines.append("did not arrive: " + "; ".join(f"{stacks.rank_list(ranks)} ({host}) at {where}"
                                                        for ranks, host, where in stacks.grouped(late)))
            call = own.call if own and own.call else "the collective"
            lines.append(f"The other ranks waited for them in {call} until its timeout: see what kept them "
                         "(slow start-up or data loading, a rank-dependent branch, an extra step).")
        elif len(places) == len(self.hosts) and all(places.values()):
            lines.append("every rank was inside torch.distributed: check that all ranks call the same "
                         "collectives in the same order with the same tensor shapes.")
        gone = sorted(set(self.hosts) - set(places))
        if gone and self._stacks_possible():
            lines.append(f"no stack from {stacks.rank_list(gone)}: ended before a stack could be taken.")
        return "\n".join(lines)

    def _on_event(self, index: int, event: dict) -> None:
        kind = event.get("event")
        if kind == "started":
            self.started[event["node"]] = {**event, "at": time.monotonic(),
                                           "agent_at": self.agents[index].started_at}
            if set(self.node_of.values()) <= set(self.started) and self._all_started_at is None:
                self._all_started_at = time.monotonic()
            if len(self.started) == len(self.job.nodes):
                self._report_startup()
        elif kind == "join":
            self._on_join(event)
        elif kind == "stack":
            self.rank_stacks[event["rank"]] = event
        elif kind == "rank_failed":
            timeout = bool(event.get("collective_timeout")) and self.failure is None and self.interrupted is None
            message = _describe_rank_failure(event)
            if timeout:
                self.hang, self._hang_failed = "collective", event
                if self._stacks_possible():
                    message += ("\nIt timed out in a torch.distributed operation: collecting the stacks of "
                                "the ranks still running (SIGABRT; faulthandler prints them) to see who did "
                                "not arrive.")
            self._fail(_exit_code(event["code"]), message, with_stacks=timeout)
        elif kind == "error":
            self._fail(1, f"{event['host']}: {event['message']}")
        elif kind == "done":
            self.done.add(event["node"])

    def _on_agent_exit(self, agent: Agent) -> None:
        missing = [n for n in agent.launch.node_ranks if n not in self.done]
        if missing and self.failure is None and self.interrupted is None:
            code = agent.proc.returncode
            self._fail(_exit_code(code) or 1, self._describe_agent_failure(agent, code))

    def _on_signal(self, name: str) -> None:
        if self.interrupted is not None:
            self.console.say(f"{name} again: killing every node's agent now.")
            self._kill_agents()
            return
        self.interrupted = name
        self.console.say(f"{name} received: stopping every rank on every node.")
        self._stop_all()

    def _fail(self, code: int, message: str, with_stacks: bool = False) -> None:
        if self.failure is not None or self.interrupted is not None:
            return
        self.failure = Failure(code, message)
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
            return self.failure.code
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
