"""Stalls, the launcher's side: say where every rank is once one has waited too long in a collective.

A rank stuck in its own code (a loop, a slow data path, a branch the others did not take) leaves the
others waiting in their next collective until torch's timeout, 30 minutes by default, and a job that just
sits there says nothing. The agents' samplers (node/sampler.py) send a `places` event per look: each rank
busy, blocked (where, for how long) or exited. `StallWatch` follows them. Once a rank has been blocked
inside torch.distributed (or in backward, where DDP all-reduces) for `stall_report` seconds, it asks the
agents where every rank is (WHERE_COMMAND), and a moment later says it: who waits where, who did not
arrive, and what ends the job. The job goes on; when every rank has moved again it says the stall is over.
With `collective_timeout`, a stall that lasts that long ends the job (exit code 124), with every rank's
stack (hangs.HangWatch's report). Waiting in init_process_group is the join watch's (`--init_timeout`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from crew.launcher.console.ranges import rank_list
from crew.launcher.node import stacks

ANSWER_WAIT_S = 3.0  # after asking the agents where their ranks are, the report waits this long at most
CHECK_S = 1.0
_JOINING = "torch.distributed init_process_group"


@dataclass
class Place:
    """A rank's last state from its agent, and when it came."""

    state: str  # busy, blocked, exited
    call: str | None
    at: str | None
    for_s: float
    code: int | None
    received: float


def format_duration(seconds: float) -> str:
    """`45s`, `3m05s`, `1h02m`."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StallWatch:
    def __init__(self, hosts: dict[int, str], nodes: int, report_after: float, end_after: float,
                 can_ask: bool, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.hosts, self.nodes = hosts, nodes
        self.report_after, self.end_after, self.can_ask = report_after, end_after, can_ask
        self.say, self.clock = say, clock
        self.places: dict[int, Place] = {}  # each rank's latest
        self.answers: dict[int, Place] = {}  # each rank's place when the agents were last asked (where)
        self.stalled_since: float | None = None  # the stall now going on, reported or about to be
        self.reported = False
        self._report_due: float | None = None
        self._answered: set[int] = set()
        self._next_check = 0.0

    # -- events ----------------------------------------------------------------------------------

    def on_places(self, event: dict) -> None:
        now = self.clock()
        for entry in event["ranks"]:
            place = Place(entry["state"], entry.get("call"), entry.get("at"), entry.get("for_s", 0.0),
                          entry.get("code"), now)
            self.places[entry["rank"]] = place
            if event.get("where"):
                self.answers[entry["rank"]] = place
        if event.get("where"):
            self._answered.add(event["node"])

    def node_done(self, event: dict) -> None:
        """A node's `done`: its ranks have all ended, whatever its sampler said last."""
        now = self.clock()
        for rank, code in event["codes"].items():
            self.places[int(rank)] = Place("exited", None, None, 0.0, code, now)

    # -- the clock -------------------------------------------------------------------------------

    def deadline(self) -> float | None:
        """When `check` wants to run next; None while there is nothing to watch."""
        if not (self.report_after or self.end_after) or not self.places:
            return None
        return min(self._next_check, self._report_due or self._next_check)

    def check(self) -> str | None:
        """Look at the places: returns "ask" when the agents should be asked where every rank is, "end"
        when the stall has lasted `end_after`; prints the report and the stall's end itself."""
        now = self.clock()
        self._next_check = now + CHECK_S
        longest = max(self.waited(now).values(), default=0.0)
        if self.end_after and longest >= self.end_after:
            return "end"
        action = None
        if self.stalled_since is None and self._to_report(longest):
            self.stalled_since, self._answered, self.answers = now - longest, set(), {}
            self._report_due = now + ANSWER_WAIT_S if self.can_ask else now
            action = "ask" if self.can_ask else None
        if self._report_due is not None and (now >= self._report_due or len(self._answered) >= self.nodes):
            self._report_due = None
            if self._to_report(longest):
                self.reported = True
                self.say(self.report(now))
            else:  # it cleared while the agents answered: nothing to say
                self.stalled_since = None
        elif self.reported and longest < self.report_after:
            self.say(f"the stall is over: every rank moved on after {format_duration(now - self.stalled_since)}.")
            self.stalled_since, self.reported = None, False
        return action

    def _to_report(self, longest: float) -> bool:
        """A wait this long is said: past --stall_report, when that comes before --collective_timeout."""
        before_the_end = not self.end_after or self.report_after < self.end_after
        return bool(self.report_after) and before_the_end and longest >= self.report_after

    def waited(self, now: float) -> dict[int, float]:
        """Each rank blocked in a collective (or backward): how long, as of `now`."""
        return {rank: p.for_s + now - p.received for rank, p in self.places.items()
                if p.state == "blocked" and p.call and p.call != _JOINING}

    # -- what is said ----------------------------------------------------------------------------

    def report(self, now: float) -> str:
        waited = self.waited(now)
        longest = max(waited.values(), default=0.0)
        calls = {self.places[rank].call for rank in waited}
        lines = [f"stall: {rank_list(sorted(waited))} waited up to {format_duration(longest)} in "
                 f"{' / '.join(sorted(calls))}; the job goes on. Where each rank is:"]
        items = [(rank, self.hosts.get(rank, "?"), self._describe(rank, waited)) for rank in sorted(self.hosts)]
        lines += [f"  {line}" for line in stacks.group_lines(items)]
        late = sorted(rank for rank in self.hosts if rank not in waited)
        if late:
            lines.append(f"did not arrive: {rank_list(late)} (the waiting ranks need every rank in that collective).")
        ending = (f"crew ends the job after {format_duration(self.end_after)} of this (--collective_timeout)"
                  if self.end_after else "torch's collective timeout ends the job (crew run --collective_timeout "
                  "SECONDS ends it sooner)")
        lines.append(f"Nothing is stopped: {ending}. --stall_report SECONDS sets when this is said (0: never).")
        return "\n".join(lines)

    def _describe(self, rank: int, waited: dict[int, float]) -> str:
        place = self.answers.get(rank) or self.places.get(rank)
        if place is None:
            return "no word from its node yet"
        if place.state == "exited":
            return "exited" if place.code is None else f"exited (code {place.code})"
        where = stacks.Where(place.call, place.at) if place.at else None
        if rank in waited:
            return stacks.describe(where, "waiting")
        if where is None:
            return f"{place.state}, no stack (not a Python rank, or it did not answer)"
        state = "running" if place.state == "busy" else "blocked"
        return stacks.describe(where, state) if where.call else f"{state} at {where.location}"
