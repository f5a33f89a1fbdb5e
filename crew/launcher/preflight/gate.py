"""The preflight of `crew run` over ssh, merged into the agents' start: one ssh connection and one Python
start per node, where a separate probe would cost two.

Every node's agent (started with --preflight) sends its quick facts in a `probe` event and waits. Once
every node has answered, or failed to (ssh refused, no Python there, no answer in time), the judge
(`doctor.preflight_judge`) compares them as the doctor does. Only then does any node start a rank: the
launcher sends each agent "go", or closes every agent's stdin when a node failed, so that nothing starts
anywhere. This module keeps the answers; `job.JobRun` does the talking.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# facts by node, (exit code, stderr lines) by node that sent none, seconds -> (passed, what to say)
Judge = Callable[[dict[int, dict], dict[int, tuple[int, list[str]]], float], tuple[bool, str]]
# Per node, from its agent's start: for a node that took the ssh login but hangs (ssh itself gives up on
# an unreachable one after 10 s). At 128 loopback nodes on 2 cores, healthy ones took over 20 s.
TIMEOUT_S = 60.0


class PreflightGate:
    def __init__(self, nodes: int, judge: Judge, timeout: float = TIMEOUT_S):
        self.nodes, self.judge, self.timeout = nodes, judge, timeout
        self.facts: dict[int, dict] = {}
        self.unreached: dict[int, tuple[int, list[str]]] = {}
        self.began = time.monotonic()
        self.decided_at: float | None = None

    @property
    def waiting(self) -> bool:
        return self.decided_at is None

    def on_probe(self, event: dict) -> None:
        self.facts[event["node"]] = event

    def on_exit(self, node_ranks: tuple[int, ...], code: int, stderr: list[str], timed_out: bool) -> None:
        """An agent ended before the verdict: its nodes failed, even one that had sent its facts."""
        said = [*stderr, *([f"no answer within {self.timeout:.0f} s (timed out)"] if timed_out else [])]
        for node in node_ranks:
            self.facts.pop(node, None)
            self.unreached[node] = (code, said)

    def decide(self) -> tuple[bool, str] | None:
        """The verdict, once, as soon as every node has answered or failed; None before (and after)."""
        if not self.waiting or len(self.facts) + len(self.unreached) < self.nodes:
            return None
        self.decided_at = time.monotonic()
        return self.judge(self.facts, self.unreached, self.decided_at - self.began)
