"""The `crew` command: parse the options and hand off, to the launcher (run, plan, doctor, sync), to
the runtime's offline tools (export, estimate), or to crew.plot (plot).

Every launch option accepts DeepSpeed's spelling (`--num_gpus`) and the dashed one (`--num-gpus`),
and takes its default from a `CREW_<NAME>` environment variable when set (e.g. CREW_HOSTFILE).
This module, and all it imports, stays free of torch: only the ranks import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from crew import __version__, precheck, wizard
from crew.cliparser import CrewParser
from crew.errors import PREEMPTED_EXIT_CODE, CrewError
from crew.launcher.transport import mpi, runners
from crew.launcher.plan.hostfile import is_number
from crew.launcher.console.console import Console
from crew.launcher.preflight.gate import PreflightGate
from crew.launcher.job.run import FANOUT, JobRun
from crew.launcher.plan import dsflags
from crew.launcher.plan.launch import (Launch, agent_launches, format_layout, job_spec, local_devices, remote_nodes,
                                       resolve)
from crew.launcher.job import elastic, preempt, summary
from crew.launcher.job.record import JobRecord
from crew.launcher.job.timing import Timing
from crew.units import parse_bytes, parse_count


def _option(parser: argparse.ArgumentParser, *names: str, **kwargs) -> None:
    """An option under its DeepSpeed name, its dashed twin, and a CREW_<NAME> env default."""
    spellings = []
    for name in names:
        spellings.append(name)
        if name.startswith("--") and "_" in name:
            spellings.append(name.replace("_", "-"))
    dest = kwargs.get("dest") or next(n for n in names if n.startswith("--"))[2:]
    env_value = os.environ.get(f"CREW_{dest.upper()}")
    if env_value is not None and kwargs.get("action") not in ("append", "store_true"):
        kwargs["default"] = env_value
    elif env_value is not None and kwargs.get("action") == "store_true":
        kwargs["default"] = env_value.lower() in ("1", "true", "yes")
    parser.add_argument(*spellings, dest=dest, **kwargs)


def _port(text: str) -> int:
    if not is_number(text) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number (1-65535)")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds >= 0 (0 turns the check off)")
    return value


def _window(text: str) -> int:
    if not is_number(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number >= 1")
    return int(text)


def _count(text: str) -> int:
    if not is_number(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number >= 0")
    return int(text)


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launch options")
    _option(group, "-H", "--hostfile", help="hosts to run on: '<host>[:<ssh port>] slots=N "
            "[gpu=0,1]' per line. Without it, the job runs on this machine only.")
    _option(group, "-i", "--include", default="",
            help="use only these hosts/devices, e.g. 'worker-1:0,2@worker-2'")
    _option(group, "-e", "--exclude", default="", help="leave out these hosts/devices, same form")
    _option(group, "--num_nodes", type=int, help="use the first N hosts of the hostfile")
    _option(group, "--num_gpus", "--nproc_per_node", type=int,
            help="ranks per node: the first N slots of each host")
    _option(group, "--master_addr", help="address rank 0 listens on (default: the first node)")
    _option(group, "--master_port", type=_port, help="port rank 0 listens on (default: a free one)")
    _option(group, "--launcher", choices=runners.RUNNERS,
            help="how to start each node: local (no hostfile), ssh (hostfile), pdsh, standalone, "
                 "slurm (inside an allocation without a hostfile: one srun for every node), openmpi, mpich, "
                 "impi, mvapich (one mpirun starts every node's agent)")
    _option(group, "--force_multi", action="store_true",
            help="use ssh even for a one-node hostfile naming this machine")
    _option(group, "--node_rank", type=int, help="standalone: which node of the plan this is")
    _option(group, "--no_local_rank", action="store_true",
            help="do not pass --local_rank=N to the script (LOCAL_RANK is set either way)")
    _option(group, "--module", action="store_true", help="SCRIPT is a module: python -m SCRIPT")
    _option(group, "--as_deepspeed", action="store_true",
            help="the script's `import deepspeed` (and its submodules) means crew, on every rank")
    _option(group, "--no_python", action="store_true",
            help="SCRIPT is an executable: run it directly, not with python")
    _option(group, "--env", action="append", default=[], metavar="KEY=VALUE",
            help="set a variable for every rank on every node (repeatable)")
    _option(group, "--log_dir", "--enable_each_rank_log", metavar="DIR",
            help="also write each rank's output to DIR/rank<N>.log on its node")
    _option(group, "--max_restarts", type=_count, default=0,
            help="restart the whole job up to N times after a failure")
    _option(group, "--min_nodes", "--min_elastic_nodes", type=_window, metavar="M",
            help="with --max_restarts: before each restart check every node again and continue on those that "
                 "pass (hostfile nodes beyond --num_nodes are spares), as long as at least M do; the config's "
                 "train_batch_size is kept by accumulating more")
    _option(group, "--max_elastic_nodes", type=_window, metavar="N",
            help="DeepSpeed's old spelling of --num_nodes for an elastic job: use N nodes, the rest are spares")
    _option(group, "--ssh_port", type=_port, help="ssh port for hosts that give none in the hostfile")
    _option(group, "--ssh_args", default="",
            help="extra ssh client arguments, e.g. \"-i ~/.ssh/cluster -F ssh_config\"")
    _option(group, "--python",
            help="Python on every node that runs crew's agent and the ranks (default: this one, at the same "
                 "path; `python3`: the one on the node's PATH, e.g. after --venv_script)")
    _option(group, "--fanout", type=_window, default=FANOUT, metavar="N",
            help=f"at most N nodes connecting at once, like pdsh's -f (default {FANOUT}); the rest start as "
                 "those report their ranks started")
    _option(group, "--verbose", action="store_true",
            help="list every node in crew's own lines (start-up times, the layout, the doctor's rows); "
                 "by default many nodes are summed up: counts and the slowest few")
    _option(group, "--config_file", metavar="ACCELERATE_CONFIG.yaml",
            help="Accelerate's launch config (as `accelerate launch --config_file`): machines, processes, main "
                 "process, DeepSpeed launcher keys and the ACCELERATE_* variables; options given here win")
    _add_deepspeed_options(group)


def _add_deepspeed_options(group) -> None:
    """The rest of DeepSpeed 0.19.8's launcher flags, with its meaning (crew/launcher/plan/dsflags.py)."""
    _option(group, "--bind_cores_to_rank", action="store_true",
            help="give each rank of a node its own block of cores (cores // ranks; OMP_NUM_THREADS set to it) "
                 "and, on a NUMA machine, its memory on their node; no numactl needed")
    _option(group, "--bind_core_list", metavar="1,3-5,7",
            help="the cores to divide among a node's ranks (default: one per physical core); implies "
                 "--bind_cores_to_rank")
    _option(group, "--no_ssh", action="store_true",
            help="start this node only, as --launcher standalone: run the same command on each node with "
                 "its --node_rank")
    _option(group, "--no_ssh_check", action="store_true",
            help="crew run: skip the preflight (as --skip_preflight), which is where crew checks ssh")
    _option(group, "--venv_script", metavar="PATH",
            help="a script sourced on every node before crew's agent starts (ssh, pdsh, slurm), e.g. a "
                 "venv's bin/activate; not on a local or standalone launch, which use this shell")
    _option(group, "--launcher_args", default="", metavar="\"ARGS\"",
            help="arguments for pdsh, srun or mpirun, one quoted string; with a hostfile and no --launcher they "
                 "mean pdsh (DeepSpeed's launcher)")
    _option(group, "--log_level", choices=dsflags.LOG_LEVELS, default="info",
            help="crew's own lines: warning and above leave out the informational ones (layout, start-up "
                 "times), keeping warnings, failures and reports; debug is --verbose. Rank output is all kept")
    _option(group, "-q", "--quiet", action="store_true", help="as --log_level error")
    _option(group, "--save_pid", action="store_true",
            help="each node's agent writes its pid to /tmp/<pid of this crew>.deepspeed while it runs and "
                 "prints 'launcher pid: N'")
    _option(group, "--autotuning", choices=("tune", "run"),
            help="refused: DeepSpeed's autotuner is not part of crew; tune with DeepSpeed's launcher, then "
                 "train with crew on the config it wrote")


def cmd_plan(args: argparse.Namespace) -> int:
    launch = resolve(args)
    _say_notes(launch, *_stderr_say(args))
    job = job_spec(launch, args)
    launches = agent_launches(launch, job, args)
    command = {n: list(a.argv) for a in launches for n in a.node_ranks}
    if args.json:
        data = {**launch.plan.to_json(), "launcher": launch.launcher}
        if launch.spares:
            data["spares"] = [{"host": h.name, "ssh_port": h.ssh_port, "slots": list(h.slots)} for h in launch.spares]
        for node_rank, node in enumerate(data["nodes"]):
            node["command"] = command.get(node_rank)
        print(json.dumps(data, indent=2))
        return 0
    print(format_layout(launch, verbose=True))
    if launch.spares:
        print(f"  spares (--min_nodes): {', '.join(h.name for h in launch.spares)}")
    for name, value in launch.plan.env.items():
        print(f"  env {name}={shlex.quote(value)}")
    for a in launches:
        env = "".join(f"{name}={shlex.quote(value)} " for name, value in (a.env or {}).items())
        print(f"  command ({a.label}): {env}{shlex.join(a.argv)}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if not args.script:
        raise CrewError("crew run: name the training script, e.g. crew run train.py --deepspeed")
    timing = Timing()
    launch = resolve(args)
    elastic.check(args, launch)
    precheck.check_run(args, launch.launcher, launch.plan.world_size)  # before any rank or connection
    _check_mpi(launch)
    console = Console(sys.stdout.buffer, sys.stderr.buffer, level=args.log_level)
    _say_notes(launch, console.say, console.info)
    if args.sync:
        sync_code(launch, args, [], console.info)
    first_preflight = launch.launcher in ("pdsh", *mpi.MPI_RUNNERS)  # no stdin to the agents; over ssh: the gate
    if not (args.skip_preflight or args.no_ssh_check) and first_preflight:
        from crew.launcher.preflight import doctor

        said: list[str] = []
        code = doctor.preflight(launch, args, said.append, args.verbose)
        if said:
            (console.say if code else console.info)("\n".join(said))
        if code:
            return code
        timing.mark("preflight")
    code, run, restarts = _run_attempts(launch, args, console, timing)
    timing.mark("exit")
    job = run.job
    console.say(summary.closing_line(summary.Ending(
        job_id=job.job_id, status=run.status, exit_code=code, world_size=job.world_size, nodes=len(job.nodes),
        wall_s=timing.elapsed(), launcher=launch.launcher, cwd=job.cwd, failure=run.failure,
        outputs=tuple(run.outputs), log_dir=job.log_dir, restarts=restarts)))
    if timing.enabled:
        console.say(timing.line())
    if code == PREEMPTED_EXIT_CODE:
        preempt.requeue_slurm_job(console.say)  # in an sbatch job: Slurm ends this one at once, so last
    return code


def _run_attempts(launch: Launch, args: argparse.Namespace, console: Console,
                  timing: Timing) -> tuple[int, JobRun, int]:
    """(exit code, the last attempt's run, how many restarts came before it)."""
    ports = {node.node_rank: node.ssh_port for node in launch.plan.nodes}
    growing = elastic.Elastic(args, launch) if args.min_nodes else None
    if growing:
        launch = dataclasses.replace(launch, plan=dataclasses.replace(
            launch.plan, env={**launch.plan.env, **growing.env}))
    record = JobRecord(os.path.join(os.getcwd(), args.log_dir), ["crew", *sys.argv[1:]], launch.launcher,
                       console.say, args.node_rank) if args.log_dir else None
    for attempt in range(args.max_restarts + 1):
        job = job_spec(launch, args, restart_count=attempt, console="tty" if console.tty else "plain")
        console.info(format_layout(launch, job.job_id, args.verbose))
        if job.as_deepspeed:
            console.info("--as_deepspeed: `import deepspeed` is crew on every rank")
        gate = _preflight_gate(launch, job, args) if attempt == 0 else None
        run = JobRun(job, agent_launches(launch, job, args, extra=("--preflight",) if gate else ()), console,
                     ports, record, args.verbose, args.fanout, gate)
        code = run.run()
        if gate and gate.decided_at is not None:
            timing.mark("preflight", gate.decided_at)
        if run.all_started_at is not None:
            timing.mark("agents up", run.all_started_at)
        timing.mark("ranks done", run.finished_at)
        if code in (0, PREEMPTED_EXIT_CODE) or run.interrupted or attempt == args.max_restarts:
            break
        launch = _next_launch(launch, run, growing, args, console.say, record)
        if launch is None:
            break
        ports = {node.node_rank: node.ssh_port for node in launch.plan.nodes}
        console.say(f"restarting the job ({attempt + 1} of {args.max_restarts}).")
    return code, run, attempt


def _next_launch(launch: Launch, run: JobRun, growing: elastic.Elastic | None, args: argparse.Namespace, say,
                 record: JobRecord | None) -> Launch | None:
    """Where the next attempt runs: the same nodes, or (--min_nodes) those that pass a re-check; None: stop."""
    if growing is None:
        new, entry = launch, elastic.restart_entry(launch, run)
    else:
        new, entry = growing.next_launch(launch, run, say)
        if new is not None and new.plan.world_size != launch.plan.world_size:
            try:
                precheck.check_run(args, new.launcher, new.plan.world_size, growing.start.plan.world_size)
            except CrewError as exc:
                say(f"cannot continue on {new.plan.world_size} rank(s): {exc}")
                new, entry = None, {**entry, "continued": False, "why_not": str(exc)}
    if new is not None:
        entry = {"continued": True, "world_size": new.plan.world_size,
                 "nodes": [node.host for node in new.plan.nodes], **entry}
    if record:
        record.restarted(entry)
    return new


def _preflight_gate(launch: Launch, job, args: argparse.Namespace) -> PreflightGate | None:
    """Over ssh and srun (whose stdin reaches every node), the agents run the preflight's quick checks and
    wait for the verdict (one ssh login per node); pdsh and mpirun give them no stdin to wait on, so there it
    runs first, on its own, over ssh (cmd_run)."""
    if args.skip_preflight or args.no_ssh_check or launch.launcher not in ("ssh", "slurm"):
        return None
    from crew.launcher.preflight import doctor

    return PreflightGate(len(job.nodes), doctor.preflight_judge(launch, job, args.verbose))


def _check_mpi(launch: Launch) -> None:
    """An MPI launcher: the right mpirun is here, and it can take these hosts and ssh options."""
    if launch.launcher in mpi.MPI_RUNNERS:
        mpi.check(launch.launcher)
        mpi.validate(launch.launcher, [node.host for node in launch.plan.nodes],
                     [node.ssh_port for node in launch.plan.nodes], runners.SSH_OPTIONS, launch.ssh_args)


def _say_notes(launch: Launch, say, info) -> None:
    """What crew says of DeepSpeed's flags (dsflags)."""
    for level, text in launch.notes:
        (info if level == "info" else say)(text)


def _stderr_say(args: argparse.Namespace):
    """`crew: ` lines on stderr, without a console: (say, info), info silent above --log_level info."""
    def say(text: str) -> None:
        print(f"crew: {text}", file=sys.stderr)
    return say, say if args.log_level in ("debug", "info") else (lambda text: None)


def sync_code(launch: Launch, args: argparse.Namespace, paths: list[str], say) -> None:
    from crew.launcher.transport import sync

    sync.sync_nodes(remote_nodes(launch), paths, Path.cwd(), launch.ssh_args, args.sync_tool, say)


def cmd_sync(args: argparse.Namespace) -> int:
    launch = resolve(args)
    sync_code(launch, args, args.paths, _stderr_say(args)[1])
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from crew.launcher.preflight import doctor

    launch = resolve(args)
    _check_mpi(launch)
    return doctor.run_doctor(launch, args)


def cmd_export(args: argparse.Namespace) -> int:
    from crew.runtime.checkpoint import export  # torch is needed here only

    folder = export(args.checkpoint_dir, args.out)
    print(f"crew: wrote {args.out} (fp32 state dict) from {folder}", file=sys.stderr)
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from crew.runtime import estimate  # torch only for --model, inside count_parameters

    num_params = estimate.count_parameters(args.model) if args.model else parse_count(args.params)
    world_size = estimate.world_size_from(args.world_size, args.num_gpus, args.num_nodes,
                                          len(local_devices()))
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    rows = estimate.model_states_per_rank(num_params, world_size, args.precision)
    if args.json:
        data = [{**vars(row), **({"fits": estimate.fit(row, memory)} if memory else {})} for row in rows]
        print(json.dumps({"num_params": num_params, "world_size": world_size, "precision": args.precision,
                          "device_memory": memory, "rows": data}, indent=2))
    else:
        print(estimate.format_table(rows, num_params, world_size, args.precision, memory))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from crew.plot import plot_dirs  # matplotlib (and tensorboard) only here

    print(f"crew: wrote {plot_dirs(args.dirs, args.out).path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = CrewParser(prog="crew", description="Train PyTorch models on many "
                                     "processes across many machines (DeepSpeed-compatible).")
    parser.add_argument("--version", action="version", version=f"crew {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="launch SCRIPT on every slot of the world",
                              allow_abbrev=False)
    add_launch_options(run)
    _option(run, "--init_timeout", type=_seconds, default=600.0, metavar="SECONDS",
            help="stop the job, with a report and each rank's stack, when not every rank has joined "
                 "the process group this many seconds after the first one reached the master port "
                 "(when none does, crew only warns); 0: no check (default: 600)")
    _option(run, "--stall_report", type=_seconds, default=90.0, metavar="SECONDS",
            help="when a rank has waited this long in a torch.distributed operation (or in backward), say "
                 "where every rank is, without stopping anything; 0: never (default: 90)")
    _option(run, "--collective_timeout", type=_seconds, default=0.0, metavar="SECONDS",
            help="end the job, with every rank's stack, once such a wait has lasted this long (default: 0, "
                 "left to torch's own collective timeout, 30 minutes unless the script sets another)")
    _option(run, "--preempt_grace", type=_seconds, default=120.0, metavar="SECONDS",
            help="on SIGTERM or SIGUSR1 (a preemption notice) each rank gets SIGTERM and this long to finish its "
                 "step and save (with \"preemption\": {\"enabled\": true} in its config) before SIGKILL "
                 "(default: 120)")
    _option(run, "--skip_preflight", action="store_true",
            help="start without the quick check of every node (ssh, versions, script hash)")
    _option(run, "--sync", action="store_true",
            help="first copy the working directory to every node (as `crew sync`)")
    _option(run, "--sync_tool", choices=("auto", "rsync", "tar"), default="auto",
            help="how --sync copies: rsync when installed (auto), or tar over ssh")
    run.add_argument("script", nargs="?", help="training script (or module, or executable)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=cmd_run)
    doctor = commands.add_parser("doctor", help="check every node of the plan (ssh, versions, code, "
                                 "devices, master port, interfaces, disk) and print each fix",
                                 allow_abbrev=False)
    add_launch_options(doctor)
    _option(doctor, "--json", action="store_true", help="print the checks as JSON")
    _option(doctor, "--save_dir", metavar="DIR", help="where checkpoints go: check free disk there "
            "(default: the script's --save_dir/--output_dir/--checkpoint_dir argument, if any)")
    _option(doctor, "--min_free_disk", default="10GB", metavar="SIZE",
            help="least free space wanted in the save dir (default: 10GB)")
    doctor.add_argument("script", nargs="?", help="training script: checked to be the same everywhere")
    doctor.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (read for a "
                        "save dir)")
    doctor.set_defaults(handler=cmd_doctor)
    sync = commands.add_parser("sync", help="copy the working directory (or PATHS) to the same path "
                               "on every node, honouring .crewignore", allow_abbrev=False)
    add_launch_options(sync)
    _option(sync, "--sync_tool", choices=("auto", "rsync", "tar"), default="auto",
            help="how to copy: rsync when installed (auto), or tar over ssh")
    sync.add_argument("paths", nargs="*", help="files or folders to copy (default: the working "
                      "directory)")
    sync.set_defaults(handler=cmd_sync)
    plan = commands.add_parser("plan", help="print the resolved world; start nothing",
                               allow_abbrev=False)
    add_launch_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("script", nargs="?", help="training script, to show the full command")
    plan.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    plan.set_defaults(handler=cmd_plan)
    export = commands.add_parser(
        "export", help="write one fp32 state dict (loadable by model.load_state_dict) from a checkpoint "
                       "of any ZeRO stage")
    export.add_argument("checkpoint_dir", help="a save_dir (its 'latest' tag is used) or a tag folder")
    export.add_argument("out", help="output file; a .safetensors name writes safetensors")
    export.set_defaults(handler=cmd_export)
    est = commands.add_parser("estimate", help="per-rank memory for model states at ZeRO stages 0-3, "
                              "with and without CPU offload", allow_abbrev=False)
    source = est.add_mutually_exclusive_group(required=True)
    _option(source, "--params", help="parameter count, e.g. 7B, 1.3e9, 350M, 125k")
    _option(source, "--model", metavar="MODULE:FACTORY", help="count the parameters of the model that "
            "FACTORY() returns (built on the meta device; imports torch)")
    _option(est, "--world_size", type=int, help="ranks in all (or --num_gpus and --num_nodes)")
    _option(est, "--num_gpus", type=int, help="ranks per node (default: this machine's GPUs, or 1)")
    _option(est, "--num_nodes", type=int, help="nodes (default: 1)")
    _option(est, "--precision", choices=("fp32", "fp16", "bf16"), default="bf16",
            help="training precision, with Adam (default: bf16)")
    _option(est, "--device_memory", metavar="SIZE", help="memory per device, e.g. 80GB (binary units); "
            "adds a column for what fits with 20%% left for activations")
    _option(est, "--json", action="store_true", help="print the rows as JSON (bytes)")
    est.set_defaults(handler=cmd_estimate)
    plot = commands.add_parser("plot", help="draw loss, lr and samples/s against samples from csv_monitor "
                               "or tensorboard output into a PNG, one line per run", allow_abbrev=False)
    plot.add_argument("dirs", nargs="+", metavar="DIR", help="a monitor's output_path/job_name, or an "
                      "output_path whose job folders are the runs; several DIRs are overlaid")
    plot.add_argument("-o", "--out", metavar="FILE.png", help="where to write the PNG (default: the "
                      "first DIR's name + .png, in the current folder)")
    plot.set_defaults(handler=cmd_plot)
    config = commands.add_parser("config", help="questions and answers that write a hostfile, a launch "
                                 "config (Accelerate's format) and a DeepSpeed JSON, then run crew doctor on "
                                 "them", allow_abbrev=False)
    wizard.add_options(config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_level"):  # -q is --log_level error; debug means --verbose
        args = dsflags.log_level(args)
    if getattr(args, "module", False) and getattr(args, "no_python", False):
        print("crew: error: --module and --no_python cannot be used together.", file=sys.stderr)
        return 2
    try:
        if getattr(args, "config_file", None):
            from crew.launcher.plan.accelerate import apply_config_file

            apply_config_file(args, lambda text: print(f"crew: {text}", file=sys.stderr), args.command == "run")
        if hasattr(args, "max_elastic_nodes"):
            elastic.settle_options(args)
        return args.handler(args)
    except CrewError as exc:
        print(f"crew: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
