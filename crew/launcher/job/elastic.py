"""Elastic restarts: `crew run --max_restarts N --min_nodes M` continues without a lost node.

After a failed attempt, every node the job may use is checked again with the preflight's quick checks (ssh,
Python, versions, the script): the job's nodes and the spares (hostfile nodes beyond --num_nodes), each
judged on its own. The next attempt runs on the first of those that pass, in hostfile order, as many as the
job started with; with fewer than M the job ends. The master moves to the first node that passed (unless
--master_addr named one), on a new port.

Every rank of every attempt gets CREW_START_WORLD_SIZE, the world the job started on: the engine then keeps
the config's train_batch_size on a smaller world by accumulating more (crew/runtime/batch.py). The script
itself resumes through its own load_checkpoint, which reads a checkpoint at any world size.

DeepSpeed 0.19 has no elastic training any more; its old flags --min_elastic_nodes and --max_elastic_nodes
mean --min_nodes and --num_nodes here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from crew.errors import PlanError
from crew.launcher.job.record import now_iso
from crew.launcher.job.run import JobRun
from crew.launcher.plan.hostfile import Host
from crew.launcher.plan.launch import Launch, relaunch

START_WORLD_ENV = "CREW_START_WORLD_SIZE"  # crew/runtime/config.py reads it
ELASTIC_LAUNCHERS = ("ssh", "pdsh", "local")


def settle_options(args: argparse.Namespace) -> None:
    """--max_elastic_nodes (DeepSpeed's old spelling) is --num_nodes: the nodes used, the rest spares."""
    most = getattr(args, "max_elastic_nodes", None)
    if most is None:
        return
    if args.num_nodes is not None and args.num_nodes != most:
        raise PlanError(f"--max_elastic_nodes {most} and --num_nodes {args.num_nodes} disagree: both say how many "
                        "nodes the job uses (the hostfile's other nodes are spares). Give one of them.")
    args.num_nodes = most


def check(args: argparse.Namespace, launch: Launch) -> None:
    """--min_nodes against the resolved launch, before anything starts."""
    least = args.min_nodes
    if least is None:
        return
    nodes = len(launch.hosts)
    if launch.launcher not in ELASTIC_LAUNCHERS:
        where = ("Under Slurm the allocation decides the nodes: resubmit with sbatch --requeue instead."
                 if launch.launcher == "slurm" else "Each standalone node runs its own crew run.")
        raise PlanError(f"--min_nodes works with the ssh and pdsh launchers (a hostfile), not --launcher "
                        f"{launch.launcher}. {where}")
    if not 1 <= least <= nodes:
        raise PlanError(f"--min_nodes {least}: the job starts on {nodes} node(s), so it must be 1 to {nodes}. "
                        "Nodes beyond --num_nodes in the hostfile are spares, not part of the start.")
    if not args.max_restarts:
        raise PlanError(f"--min_nodes {least} needs --max_restarts N (N >= 1): it says what a restart may continue "
                        "on, and without restarts there are none.")


@dataclass
class Elastic:
    """The job across attempts: the world it started on, and the nodes it may use."""

    args: argparse.Namespace
    start: Launch

    @property
    def env(self) -> dict[str, str]:
        return {START_WORLD_ENV: str(self.start.plan.world_size)}

    def next_launch(self, launch: Launch, run: JobRun, say) -> tuple[Launch | None, dict]:
        """Re-check the nodes after a failed attempt: the launch to continue on (None: too few pass), and
        the restart's entry for crew_job.json."""
        entry = restart_entry(launch, run)
        if entry["lost"]:
            say(f"lost: {', '.join(entry['lost'])} (its agent or ssh connection ended without its ranks' exit "
                "codes). Checking every node again before the restart.")
        candidates = [*self.start.hosts, *self.start.spares]
        healthy, problems, seconds = _recheck(launch, candidates, self.args)
        chosen = healthy[:len(self.start.hosts)]
        entry.update(left_out=problems, recheck_s=round(seconds, 2))
        for host, why in problems.items():
            say(f"re-check: {host} left out: {why}")
        if len(chosen) < self.args.min_nodes:
            say(f"only {len(chosen)} node(s) passed the re-check, fewer than --min_nodes {self.args.min_nodes}: "
                "not restarting.")
            return None, {**entry, "continued": False}
        new = relaunch(launch, chosen, self.args.master_addr, self.args.master_port)
        before = {h.name for h in launch.hosts}
        joined = [h.name for h in chosen if h.name not in before]
        world = new.plan.world_size
        say(f"continuing on {len(chosen)} node(s), {world} rank(s) (the job started with "
            f"{self.start.plan.world_size})" + (f"; spare(s) joining: {', '.join(joined)}" if joined else "") + ".")
        return new, {**entry, "continued": True, "joined": joined, "world_size": world,
                     "nodes": [h.name for h in chosen]}


def lost_nodes(launch: Launch, run: JobRun) -> list[str]:
    """The hosts whose ranks started and whose agents then ended without reporting the ranks' exit codes: the
    node, or the way to it, went away (a rank's own failure is reported, and its node is not lost)."""
    return [node.host for node in launch.plan.nodes if node.node_rank in run.started and node.node_rank not in run.done]


def restart_entry(launch: Launch, run: JobRun) -> dict:
    """What crew_job.json's `restarts` says of every restart: when, after what, which nodes were lost."""
    return {"at": now_iso(), "after_exit_code": run.failure.exit_code if run.failure else None,
            "failure": run.failure.message.splitlines()[0] if run.failure else None, "lost": lost_nodes(launch, run)}


def _recheck(launch: Launch, candidates: list[Host], args: argparse.Namespace) -> tuple[list[Host], dict, float]:
    """(the hosts that pass, {host: why not} for the others, seconds)."""
    from crew.launcher.preflight import doctor

    if launch.launcher == "local":
        return candidates, {}, 0.0  # this machine: nothing to reach
    probe_launch = relaunch(launch, candidates, args.master_addr, args.master_port)
    reports, seconds = doctor.recheck(probe_launch, args)
    healthy = [candidates[r.node] for r in reports if r.ok]
    problems = {candidates[r.node].name: "; ".join(_why(c) for c in r.checks.values() if c.status == "fail")
                for r in reports if not r.ok}
    return healthy, problems, seconds


def _why(check) -> str:
    return check.detail if check.detail.startswith(f"{check.name}:") else f"{check.name}: {check.detail}"
