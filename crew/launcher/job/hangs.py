"""No silent hangs, the launcher's side: when to give up on ranks that do not all join, and the report.

`JobRun` (job.py) feeds a `HangWatch` the agents' events: `started` (a node's agent is up), `join` (a
rank's join state, from the agent's `joinwatch.JoinWatch`), `stack` (a rank's main-thread frames) and a
`rank_failed` with collective_timeout. The watch says until when to wait for the ranks that have not
joined (`deadline`) and what then (`on_deadline`: a warning only while no rank reached the master port,
else the failure message of a hang). JobRun stops the job (asking the agents for stacks when
`stacks_possible`) and, at the end, prints `report()`: which ranks joined, which did not and why, where
each rank was and what to do; or, after a collective timeout, the ranks that did not arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from crew.launcher.node import joinwatch

from crew.launcher.node import stacks
from crew.launcher.node.joinwatch import CONNECTING, EXITED, JOINED, LISTENING, NOT_CONNECTED
from crew.launcher.transport.protocol import JobSpec
from crew.launcher.transport.runners import AgentLaunch

HANG_EXIT_CODE = 124  # as timeout(1): the ranks did not all join within --init_timeout


class HangWatch:
    """The join states of the ranks this launcher runs, the stacks received, and the report of a hang."""

    def __init__(self, job: JobSpec, launches: Sequence[AgentLaunch], say: Callable[[str], None],
                 info: Callable[[str], None] | None = None):
        self.job, self.say, self.info = job, say, info or say  # info: lines --log_level warning drops
        self.hosts = {rank: job.nodes[n].host for launch in launches for n in launch.node_ranks
                      for rank in job.nodes[n].ranks}
        self.node_of = {rank: n for launch in launches for n in launch.node_ranks for rank in job.nodes[n].ranks}
        # Whether every agent can be asked for stacks: not under pdsh, whose agents have no stdin.
        self.stacks_possible = all(launch.spec_on_stdin for launch in launches)
        self.joins: dict[int, dict] = {}  # each rank's last `join` event
        self.started_nodes: set[int] = set()
        self._watching = job.init_timeout > 0 and job.world_size > 1
        self._t0 = time.monotonic()
        self._reached_at: float | None = None  # when a rank first joined, listened or connected
        self._all_started_at: float | None = None
        self._warned_unjoined = False
        # A hang being reported ("init" or "collective"): the stacks the agents send, and its report.
        self.hang: str | None = None
        self._hang_joins: dict[int, dict] = {}
        self._hang_failed: dict | None = None
        self.rank_stacks: dict[int, dict] = {}

    # ---------------------------------------------------------------------------------------
    # events

    def node_started(self, node: int) -> None:
        self.started_nodes.add(node)
        if set(self.node_of.values()) <= self.started_nodes and self._all_started_at is None:
            self._all_started_at = time.monotonic()

    def on_join(self, event: dict) -> None:
        if not self._watching:
            return
        self.joins[event["rank"]] = event
        if event["state"] in (JOINED, LISTENING, CONNECTING) and self._reached_at is None:
            self._reached_at = time.monotonic()
        states = [self._state(rank) for rank in self.hosts]
        if all(state in (JOINED, EXITED) for state in states):
            self._watching = False
            if all(state == JOINED for state in states):
                self.info(f"all {len(states)} ranks joined the process group (master {self.job.master_addr}:"
                         f"{self.job.master_port}) {time.monotonic() - self._t0:.2f}s after the start")

    def on_stack(self, event: dict) -> None:
        self.rank_stacks[event["rank"]] = event

    def on_collective_timeout(self, event: dict) -> str:
        """A rank timed out in a collective (`rank_failed` event): what to add to its failure message."""
        self.hang, self._hang_failed = "collective", event
        if not self.stacks_possible:
            return ""
        return ("\nIt timed out in a torch.distributed operation: collecting the stacks of the ranks still "
                "running (SIGABRT; faulthandler prints them) to see who did not arrive.")

    # ---------------------------------------------------------------------------------------
    # the join deadline

    def deadline(self) -> float | None:
        """When to give up on the ranks that have not joined; None while there is nothing to wait for.

        init_timeout after the first rank reached the master port. When none has (yet), init_timeout
        after every node started; that deadline only warns: a job whose ranks never use the master
        port (no torch.distributed, or init_method file://) may well be fine.
        """
        if not self._watching:
            return None
        start = self._reached_at
        if start is None and not self._warned_unjoined:
            start = self._all_started_at
        return None if start is None else start + self.job.init_timeout

    def on_deadline(self) -> str | None:
        """At the deadline: warn and return None when no rank reached the master port; else record the
        hang and return the message to stop the job with (exit code HANG_EXIT_CODE)."""
        missing = [rank for rank in self.hosts if self._state(rank) not in (JOINED, EXITED)]
        timeout = f"{self.job.init_timeout:g} s (--init_timeout)"
        master = f"{self.job.master_addr}:{self.job.master_port}"
        if self._reached_at is None:
            self._warned_unjoined = True
            self.say(f"no rank has connected to the master {master} within {timeout}: if the script uses "
                     "torch.distributed, every rank is still before init_process_group (or cannot reach the "
                     "master). crew keeps waiting: it stops a job when some ranks joined and others did not "
                     "(init_process_group's own timeout ends a wait for a master that never answers).")
            return None
        joined = [rank for rank in self.hosts if self._state(rank) == JOINED]
        self.hang, self._hang_joins = "init", dict(self.joins)
        then = ("Collecting every rank's Python stack (SIGABRT; faulthandler prints it) before stopping "
                "the job; the report follows." if self.stacks_possible else
                "Stopping the job; the report follows.")
        return (f"ranks did not all join the process group at {master} within {timeout}: "
                f"joined: {self._ranks_at(joined)}; missing: {self._ranks_at(missing)}. {then}")

    def _state(self, rank: int, joins: dict[int, dict] | None = None) -> str | None:
        event = (self.joins if joins is None else joins).get(rank)
        return event["state"] if event else None

    # ---------------------------------------------------------------------------------------
    # the report

    def report(self) -> str | None:
        """The report of the hang, None when there was none."""
        if not self.hang:
            return None
        if self.hang == "stall":
            return self._stall_report()
        return self._init_report() if self.hang == "init" else self._collective_report()

    def _ranks_at(self, ranks: list[int]) -> str:
        """`ranks 0-1 (a), rank 2 (b)`, or `none`."""
        items = [(rank, self.hosts.get(rank, "?"), "") for rank in ranks]
        return ", ".join(f"{stacks.rank_list(group)} ({host})" for group, host, _ in stacks.merged(items)) or "none"

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
        joined = [rank for rank in self.hosts if self._state(rank, joins) == JOINED]
        lines = [f"the process group did not form: not every rank joined within {job.init_timeout:g} s "
                 f"(--init_timeout); master {master} (MASTER_ADDR:MASTER_PORT).",
                 f"  joined: {self._ranks_at(joined)}"]
        lines += [f"  missing: {stacks.rank_list(ranks)} on {host}: {cause}"
                  for ranks, host, cause in stacks.merged(self._missing(places))]
        if self.stacks_possible:
            lines += self._where_lines(places, {})
        else:
            lines.append("no stacks: the pdsh launcher gives the agents no stdin to ask them with "
                         "(--launcher ssh does).")
        lines.append("Raise --init_timeout if start-up legitimately takes this long (imports, data loading "
                     "before init_process_group); 0 disables the check.")
        return "\n".join(lines)

    def _missing(self, places: dict[int, stacks.Where | None]) -> list[tuple[int, str, str]]:
        """(rank, host, why it is not in the process group) for each rank not seen joining."""
        joins = self._hang_joins
        rank0 = self._state(0, joins) if 0 in self.hosts else None
        missing = []
        for rank, host in self.hosts.items():
            event = joins.get(rank) or {}
            if event.get("state") != JOINED:
                missing.append((rank, host, self._missing_cause(rank, host, event, places.get(rank), rank0)))
        return missing

    def _missing_cause(self, rank: int, host: str, event: dict, place: stacks.Where | None,
                       rank0: str | None) -> str:
        state = event.get("state")
        if state is None and self.node_of[rank] not in self.started_nodes:
            return "its node's agent had not started (ssh still connecting?)"
        if state == EXITED:
            return f"it ended (code {event.get('code')}) before it was seen joining"
        return joinwatch.missing_cause(
            state or NOT_CONNECTED, event.get("remote"), host, self.job.master_addr, self.job.master_port,
            rank0, stack_taken=place is not None, in_init=bool(place and place.in_collective))

    def on_stall_end(self) -> None:
        """The launcher ends a stall (--collective_timeout): the stacks it asks for make the report."""
        self.hang = "stall"

    def _stall_report(self) -> str:
        places = self._places()
        lines = self._where_lines(places, {}) if self.stacks_possible else [
            "no stacks: the pdsh launcher gives the agents no stdin to ask them with (the stall report above "
            "says where the ranks were)."]
        late = [(r, self.hosts.get(r, "?"), place.location) for r, place in places.items()
                if place is not None and not place.in_collective]
        if late:
            lines.append("did not arrive: " + "; ".join(f"{stacks.rank_list(ranks)} ({host}) at {where}"
                                                       for ranks, host, where in stacks.merged(late)))
        return "\n".join(lines)

    def _collective_report(self) -> str:
        """Where each rank was when one timed out in a collective; the ranks that were not in one."""
        failed = self._hang_failed or {}
        rank = failed.get("rank")
        places = self._places()
        verbs = {}
        own = self._timed_out_place(failed)
        if rank is not None and own is not None:
            places[rank], verbs[rank] = own, "timed out"
        lines = [f"rank {rank} timed out in a torch.distributed operation."]
        if places:
            lines += self._where_lines(places, verbs)
        if not self.stacks_possible:
            lines.append("no stacks from the other nodes: the pdsh launcher gives the agents no stdin to ask "
                         "them with (--launcher ssh does).")
        lines += self._arrival_lines(places, rank, own)
        gone = sorted(set(self.hosts) - set(places))
        if gone and self.stacks_possible:
            lines.append(f"no stack from {stacks.rank_list(gone)}: ended before a stack could be taken.")
        return "\n".join(lines)

    def _timed_out_place(self, failed: dict) -> stacks.Where | None:
        """Where the rank that timed out was, from its stderr tail: NCCL's watchdog aborts the rank, so
        faulthandler's dump if there is one, else its traceback."""
        tail = failed.get("stderr_tail", ())
        dump = stacks.parse_dump(tail)
        return stacks.where(stacks.main_frames(dump) if dump else stacks.parse_traceback(tail), self.job.cwd)

    def _arrival_lines(self, places: dict[int, stacks.Where | None], rank: int | None,
                       own: stacks.Where | None) -> list[str]:
        """The ranks that were not in a collective when `rank` timed out in one; or that all were."""
        late = [(r, self.hosts.get(r, "?"), place.location) for r, place in places.items()
                if place is not None and not place.in_collective and r != rank]
        if late:
            call = own.call if own and own.call else "the collective"
            return ["did not arrive: " + "; ".join(f"{stacks.rank_list(ranks)} ({host}) at {where}"
                                                   for ranks, host, where in stacks.merged(late)),
                    f"The other ranks waited for them in {call} until its timeout: see what kept them "
                    "(slow start-up or data loading, a rank-dependent branch, an extra step)."]
        if len(places) == len(self.hosts) and all(places.values()):
            return ["every rank was inside torch.distributed: check that all ranks call the same "
                    "collectives in the same order with the same tensor shapes."]
        return []
