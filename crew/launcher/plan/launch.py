"""What a launch resolves to before anything starts: the hosts, the launcher, the plan, the job spec,
and how each node's agent (or the doctor's probe) is started.

`crew run`, `crew plan`, `crew doctor` and `crew sync` all start from `resolve(args)`. Free of torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from crew.errors import LaunchError, PlanError
from crew.launcher.transport import mpi, runners
from crew.launcher.plan import dsflags, slurm
from crew.launcher.plan.env import gather_env
from crew.launcher.plan.hostfile import Host, is_number, read_hostfile
from crew.launcher.plan.plan import NodePlan, Plan, build_plan, is_local_name, select_hosts
from crew.launcher.plan.ports import free_port
from crew.launcher.transport.protocol import JobSpec, NodeSpec

LOCAL_HOST = "localhost"
NO_SCRIPT = "<script>"  # the program of a job spec built without one (`crew doctor` with no script named)
SHOWN_NODES = 8  # crew run's layout lists this many nodes at most, unless --verbose
CONSOLE_ENV = "CREW_CONSOLE"


@dataclass(frozen=True)
class Launch:
    """Everything resolved from the options, before anything starts."""

    launcher: str
    hosts: list[Host]
    plan: Plan
    ssh_args: tuple[str, ...]  # PDSH_SSH_ARGS_APPEND's words, then --ssh_args
    launcher_args: tuple[str, ...] = ()  # --launcher_args, for pdsh, srun or mpirun
    venv_script: str | None = None  # --venv_script, sourced on every node before the agent (ssh, pdsh, srun)
    notes: tuple[dsflags.Note, ...] = ()  # what crew says of DeepSpeed's flags before it starts
    spares: tuple[Host, ...] = ()  # --min_nodes: the hosts beyond --num_nodes, to take a lost node's place


def resolve(args: argparse.Namespace) -> Launch:
    dsflags.refuse_unsupported(args)
    args, notes = dsflags.requested(args)  # --no_ssh: standalone
    on_slurm = _uses_slurm(args)
    if on_slurm:
        hosts = slurm.allocation_hosts(os.environ, args.num_gpus)
    elif args.hostfile:
        hosts = read_hostfile(args.hostfile)
    else:  # args.machines: the nodes of an Accelerate config with several machines and no hostfile (accelerate.py)
        hosts = getattr(args, "machines", None) or [_this_machine(args)]
    if args.num_nodes is not None and args.num_nodes > 1 and not (args.hostfile or on_slurm):
        raise PlanError(f"--num_nodes {args.num_nodes} needs a --hostfile listing that many hosts.")
    per_host_gpus = args.num_gpus if args.hostfile or on_slurm else None  # else _this_machine applied it
    source = "the allocation (SLURM_JOB_NODELIST)" if on_slurm else "the hostfile"
    chosen = select_hosts(hosts, args.include, args.exclude, args.num_nodes, per_host_gpus, source)
    spares = select_hosts(hosts, args.include, args.exclude, None, per_host_gpus, source)[len(chosen):] \
        if getattr(args, "min_nodes", None) else []
    hosts, spares = _with_ssh_port(chosen, args.ssh_port), _with_ssh_port(spares, args.ssh_port)
    launcher = "slurm" if on_slurm else _choose_launcher(args, hosts)
    if launcher == "local" and args.launcher in mpi.MPI_RUNNERS:
        notes.append(("info", f"--launcher {args.launcher}: one node, this machine: its ranks start without mpirun, "
                              "as under DeepSpeed (--force_multi starts mpirun anyway)"))
    launcher, launcher_args, launcher_notes = dsflags.settle_launcher(launcher, args)
    venv, venv_notes = dsflags.venv_script(args, launcher)
    ssh_args = dsflags.ssh_args(os.environ, args.ssh_args)
    master_addr = args.master_addr or _default_master(launcher, hosts[0], ssh_args)
    if launcher == "standalone" and len(hosts) > 1 and not args.master_port:
        raise PlanError("--launcher standalone on several nodes needs --master_port: each node "
                        "plans on its own and all must agree on the port.")
    port = args.master_port or free_port()
    env = gather_env(os.environ, Path.home(), Path.cwd(), args.env)
    notes += [*dsflags.binding_notes(args), *launcher_notes, *venv_notes]
    return Launch(launcher, hosts, build_plan(hosts, master_addr, port, env), ssh_args, launcher_args, venv,
                  tuple(notes), tuple(spares))


def _with_ssh_port(hosts: list[Host], port: int | None) -> list[Host]:
    """--ssh_port for the hosts that give none in the hostfile."""
    return [h if h.ssh_port or not port else Host(h.name, h.slots, port) for h in hosts]


def relaunch(launch: Launch, hosts: list[Host], master_addr: str | None, master_port: int | None) -> Launch:
    """The same launch on other hosts (an elastic restart without a lost node, or with a spare in its place):
    the master is the first host unless --master_addr named one, on --master_port or a new free port."""
    master = master_addr or _default_master(launch.launcher, hosts[0], launch.ssh_args)
    plan = build_plan(hosts, master, master_port or free_port(), launch.plan.env)
    return dataclasses.replace(launch, hosts=hosts, plan=plan)


def _uses_slurm(args: argparse.Namespace) -> bool:
    """--launcher slurm; or, inside an allocation (SLURM_JOB_ID), no --launcher and no --hostfile. Its
    nodes then come from Slurm, and one srun starts every node's agent."""
    if args.launcher != "slurm" and (args.launcher or args.hostfile or not slurm.in_allocation(os.environ)):
        return False
    if args.hostfile:
        raise PlanError("--launcher slurm takes its nodes from the allocation (SLURM_JOB_NODELIST): leave "
                        "out --hostfile, or use --launcher ssh with it.")
    if not slurm.in_allocation(os.environ):
        raise LaunchError("--launcher slurm: this shell is not inside a Slurm allocation (SLURM_JOB_ID is "
                          "not set). Run crew inside one: 'salloc -N 2' and then 'crew run ...', or "
                          "'crew run ...' in an sbatch script.")
    if args.node_rank is not None:
        raise PlanError("--node_rank is for --launcher standalone; under Slurm each node's agent finds "
                        "its node by name. Leave out --node_rank.")
    slurm.check_step(os.environ)
    return True


def _this_machine(args: argparse.Namespace) -> Host:
    """No hostfile: one node, this machine; its GPUs, or --num_gpus CPU processes."""
    if args.num_gpus is not None and args.num_gpus < 1:
        raise PlanError(f"--num_gpus {args.num_gpus}: must be at least 1.")
    devices = local_devices() or list(range(args.num_gpus or 1))
    count = args.num_gpus or len(devices)
    if count > len(devices):
        raise PlanError(f"--num_gpus {count}: this machine has only {len(devices)} GPU(s) visible.")
    return Host(LOCAL_HOST, tuple(devices[:count]))


def local_devices() -> list[int]:
    """GPU ids visible here, found without importing torch (CUDA_VISIBLE_DEVICES, /dev/nvidiaN)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",") if part.strip()]
        return [int(i) for i in ids] if all(map(is_number, ids)) else list(range(len(ids)))
    found = (re.fullmatch(r"nvidia(\d+)", p.name) for p in Path("/dev").glob("nvidia*"))
    return sorted(int(m.group(1)) for m in found if m)


def _choose_launcher(args: argparse.Namespace, hosts: list[Host]) -> str:
    launcher = args.launcher
    if launcher is None:
        launcher = "local" if not args.hostfile or (one_node_here(hosts) and not args.force_multi) else "ssh"
    if launcher in mpi.MPI_RUNNERS and not args.force_multi and (not args.hostfile or one_node_here(hosts)):
        return "local"  # as DeepSpeed: one node, this machine, runs without mpirun (resolve says so)
    if launcher == "local" and len(hosts) > 1:
        raise PlanError(f"--launcher local runs one node, but the plan has {len(hosts)}. "
                        "Use --launcher ssh, or --num_nodes 1.")
    if launcher == "standalone" and args.node_rank is None:
        raise PlanError("--launcher standalone needs --node_rank K: run the same command on each "
                        "node with K = 0, 1, ... in hostfile order.")
    if args.node_rank is not None and not 0 <= args.node_rank < len(hosts):
        raise PlanError(f"--node_rank {args.node_rank}: the plan has nodes 0..{len(hosts) - 1}.")
    return launcher


def one_node_here(hosts: list[Host]) -> bool:
    return len(hosts) == 1 and is_local_name(hosts[0].name, socket.gethostname())


def _default_master(launcher: str, first: Host, ssh_args: tuple[str, ...]) -> str:
    if launcher == "local":
        return "127.0.0.1"
    if launcher in ("ssh", "pdsh", *mpi.MPI_RUNNERS):
        return runners.resolve_ssh_host(first.name, first.ssh_port, ssh_args)
    return first.name


def job_spec(launch: Launch, args: argparse.Namespace, restart_count: int = 0,
             console: str | None = None) -> JobSpec:
    """The job every agent gets. `console`: CREW_CONSOLE for the ranks, "tty" when crew's stdout is a
    terminal (the engine then draws its step line as a progress bar), else "plain"; the user's own
    (--env, .deepspeed_env) wins."""
    plan = launch.plan
    cwd = os.getcwd()
    env = {CONSOLE_ENV: console, **plan.env} if console else plan.env
    mode = "module" if args.module else "exec" if args.no_python else "python"
    return JobSpec(
        job_id=uuid.uuid4().hex[:8],
        nodes=tuple(NodeSpec(n.host, n.slots, n.ranks) for n in plan.nodes),
        master_addr=plan.master_addr, master_port=plan.master_port,
        program=(args.script or NO_SCRIPT, *getattr(args, "script_args", [])),
        cwd=cwd, mode=mode, env=env, local_rank_arg=not args.no_local_rank,
        as_deepspeed=getattr(args, "as_deepspeed", False),
        log_dir=os.path.join(cwd, args.log_dir) if args.log_dir else None,
        restart_count=restart_count, init_timeout=getattr(args, "init_timeout", None) or 0.0,
        line_max=slurm.LINE_MAX if launch.launcher == "slurm" else 0,
        bind_cores=bool(args.bind_cores_to_rank or args.bind_core_list), bind_core_list=args.bind_core_list or None,
        save_pid=os.getpid() if args.save_pid else 0,
        stall_report=getattr(args, "stall_report", 0.0), collective_timeout=getattr(args, "collective_timeout", 0.0),
        preempt_grace=getattr(args, "preempt_grace", 120.0))


def agent_launches(launch: Launch, job: JobSpec, args: argparse.Namespace,
                   module: str = runners.AGENT_MODULE, extra: tuple[str, ...] = ()):
    """How each node's agent (or another crew module, e.g. the doctor's probe) gets started. The agent's
    Python is this one, at the same path, unless --python names another (as DeepSpeed, --venv_script or
    not: `--python python3` takes the one the script puts on PATH). Under an MPI launcher the doctor's probes go
    over ssh, to the same hosts: mpirun's own ssh must reach them, and ssh says why when it cannot."""
    ports = [node.ssh_port for node in launch.plan.nodes]
    venv = launch.venv_script
    python = args.python or sys.executable
    if launch.launcher == "ssh":
        return runners.ssh_launches(job, python, ports, launch.ssh_args, module, extra, venv=venv)
    if launch.launcher == "pdsh":
        return runners.pdsh_launches(job, python, ports, launch.ssh_args, module, extra, venv=venv,
                                     launcher_args=launch.launcher_args)
    if launch.launcher in mpi.MPI_RUNNERS and module != runners.AGENT_MODULE:  # the doctor's probes: over ssh
        return runners.ssh_launches(job, python, ports, launch.ssh_args, module, extra, venv=venv)
    if launch.launcher in mpi.MPI_RUNNERS:
        return runners.mpi_launches(job, python, ports, launch.launcher, mpi.mpirun_for(launch.launcher),
                                    launch.ssh_args, extra, venv, launch.launcher_args)
    if launch.launcher == "slurm":
        options = [*slurm.srun_options(os.environ), *launch.launcher_args]
        return runners.slurm_launches(job, python, options, module, extra, venv=venv)
    return runners.local_launches(job, python, args.node_rank or 0, module, extra)


def format_layout(launch: Launch, job_id: str | None = None, verbose: bool = True) -> str:
    """The job's header line and one line per node; past SHOWN_NODES nodes (unless `verbose`), the first
    few and the last, and a count of the ones between."""
    plan = launch.plan
    head = f"job {job_id} · " if job_id else ""
    lines = [f"{head}{plan.world_size} rank(s) on {len(plan.nodes)} node(s) · launcher "
             f"{launch.launcher} · master {plan.master_addr}:{plan.master_port}"]
    nodes = list(plan.nodes)
    if not verbose and len(nodes) > SHOWN_NODES:
        hidden = nodes[SHOWN_NODES - 2:-1]
        slots = sorted({len(node.slots) for node in hidden})
        each = f"{slots[0]} rank(s) each" if len(slots) == 1 else f"{slots[0]}-{slots[-1]} ranks each"
        lines += [_layout_line(node) for node in nodes[:SHOWN_NODES - 2]]
        lines.append(f"  ... nodes {hidden[0].node_rank}-{hidden[-1].node_rank} ({len(hidden)} more, "
                     f"{each}; --verbose lists every node)")
        nodes = nodes[-1:]
    lines += [_layout_line(node) for node in nodes]
    return "\n".join(lines)


def _layout_line(node: NodePlan) -> str:
    port = f" (ssh port {node.ssh_port})" if node.ssh_port else ""
    ranks = f"{node.ranks[0]}-{node.ranks[-1]}" if len(node.ranks) > 1 else f"{node.ranks[0]}"
    devices = ",".join(map(str, node.slots))
    return f"  node {node.node_rank}: {node.host}{port} → ranks {ranks} → devices {devices}"


def remote_nodes(launch: Launch) -> list[tuple[str, int | None]]:
    """(host, ssh port) of each node `crew sync` copies to over ssh; none for the local and standalone
    launchers. Under Slurm, the allocation's nodes (those sharing this filesystem are skipped)."""
    if launch.launcher not in ("ssh", "pdsh", "slurm", *mpi.MPI_RUNNERS):
        return []
    return [(node.host, node.ssh_port) for node in launch.plan.nodes]
