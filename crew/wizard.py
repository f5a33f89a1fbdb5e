"""`crew config`: a short question-and-answer that writes a hostfile, a launch config in Accelerate's
format and (if asked) a DeepSpeed JSON, prints the `crew run` line to use and runs `crew doctor` on the
machines.

Every question shows its default in brackets; Enter takes it; a bad answer is asked again with the
reason. `--yes` takes every default (and the values given as flags) without asking. Nothing is written
until every question is answered and every file that would be replaced may be.

The launch config has the keys `accelerate config` writes (accelerate
src/accelerate/commands/config/config_args.py, `ClusterConfig`; cluster.py), so `accelerate launch
--config_file` reads it too. With a DeepSpeed JSON, precision and the ZeRO stage are in the JSON only:
Accelerate refuses a launch config whose `deepspeed_config` block (or `mixed_precision`) repeats what
the JSON says (`DeepSpeedPlugin._deepspeed_config_checks`). Free of torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crew.errors import CrewError, HostfileError
from crew.launcher.plan.hostfile import Host, is_number, parse_hostfile, read_hostfile
from crew.launcher.plan.launch import local_devices
from crew.launcher.plan.plan import is_local_name

LAUNCH_CONFIG = "crew_accelerate.yaml"
DS_CONFIG = "ds_config.json"
HOSTFILE = "hostfile"
PRECISIONS = ("no", "fp16", "bf16")
CPU_PROCESSES = 2  # the default on a machine without GPUs
MICRO_BATCH = 4
ZERO_STAGE = 2  # Accelerate's default answer
SAVE_DIR = "checkpoints"
SCRIPT = "train.py"


class Abort(Exception):
    """The user stopped (end of input, a file not to be replaced): nothing is written."""


@dataclass
class Answers:
    hosts: list[Host] = field(default_factory=list)  # empty: this machine only, no hostfile
    hostfile: Path | None = None
    write_hostfile: bool = False
    local_slots: tuple[int, ...] = ()  # this machine: device ids, or CPU process indices
    use_cpu: bool = False
    master_addr: str | None = None  # None: crew's default (the first node), Accelerate's too
    master_port: int | None = None  # None: crew picks a free port at each start
    zero_stage: int = ZERO_STAGE
    precision: str = "bf16"
    grad_accum: int = 1
    ds_config: Path | None = None
    micro_batch: int = MICRO_BATCH
    script: str = SCRIPT
    save_dir: str = SAVE_DIR

    @property
    def world_size(self) -> int:
        return sum(len(h.slots) for h in self.hosts) if self.hosts else len(self.local_slots)


class Asker:
    """Asks on stdin/stdout; with `interactive=False` (--yes) every question takes its default."""

    def __init__(self, interactive: bool):
        self.interactive = interactive
        self.echo = interactive and not sys.stdin.isatty()  # piped answers: show them in the transcript

    def ask(self, question: str, default: Any, parse: Callable[[str], Any]) -> Any:
        shown = "" if default is None else str(default)
        while True:
            text = self._read(f"{question} [{shown}]: " if shown else f"{question}: ") if self.interactive else ""
            try:
                return parse(text.strip() or shown)
            except ValueError as exc:
                if not self.interactive:
                    raise CrewError(f"crew config --yes: {question}: {exc}") from None
                print(f"  {exc} Try again.", flush=True)

    def _read(self, prompt: str) -> str:
        try:
            text = input(prompt)
        except EOFError:
            print(flush=True)
            raise Abort(f"no answer to '{prompt.strip()}' (end of input)") from None
        if self.echo:
            print(text, flush=True)
        return text


# Answer parsers: each returns the value or raises ValueError with the reason, said to the user.

def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not is_number(text) or int(text) < low or (high is not None and int(text) > high):
            limits = f"{low}-{high}" if high is not None else f"{low} or more"
            raise ValueError(f"'{text}' is not a whole number {limits}.")
        return int(text)
    return parse


def _flag(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An answer's check as an argparse type: a bad flag value is argparse's error naming the flag."""
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return checked


def _port_or(word: str) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        if text == word:
            return None
        if is_number(text) and 1 <= int(text) <= 65535:
            return int(text)
        raise ValueError(f"'{text}' is not a port number (1-65535) or '{word}'.")
    return parse


def _choice(options: dict[str, Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if text.lower() not in options:
            raise ValueError(f"'{text}': answer one of {', '.join(options)}.")
        return options[text.lower()]
    return parse


_yes_no = _choice({"y": True, "yes": True, "n": False, "no": False})


def _path(text: str) -> Path:
    if not text:
        raise ValueError("a path is needed.")
    return Path(text).expanduser()


def _word(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text:
            raise ValueError(f"{what} is needed.")
        return text
    return parse


def _hostfile_line(line: str) -> Host:
    """One hostfile line through crew's own parser, its complaint without the file and line number."""
    try:
        return parse_hostfile(line)[0]
    except HostfileError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None


def _host(taken: set[str]) -> Callable[[str], Host]:
    def parse(text: str) -> Host:
        if not text or re.search(r"[\s#=]", text):
            raise ValueError(f"'{text}' is not a host name or address (e.g. worker-1, 10.0.0.7, 10.0.0.7:2222).")
        host = _hostfile_line(f"{text} slots=1")
        if host.name in taken:
            raise ValueError(f"{host.name} is already listed. Name each machine once.")
        return host
    return parse


def _gpu_ids(slots: int) -> Callable[[str], tuple[int, ...]]:
    return lambda text: _hostfile_line(f"h slots={slots} gpu={text.replace(' ', '')}").slots


def _address(text: str) -> str | None:
    if text == "auto":
        return None
    if not re.fullmatch(r"[A-Za-z0-9_.:%-]+", text):
        raise ValueError(f"'{text}' is not a host name or IP address (or 'auto').")
    return text


# The questions.

def ask_all(asker: Asker, args: argparse.Namespace) -> Answers:
    answers = Answers()
    several = asker.ask("Run on 1) this machine or 2) several machines (a hostfile)", 2 if args.hostfile else 1,
                        _choice({"1": False, "this": False, "2": True, "several": True}))
    if several:
        _ask_machines(asker, args, answers)
    else:
        _ask_this_machine(asker, args, answers)
    _ask_training(asker, args, answers)
    return answers


def _ask_this_machine(asker: Asker, args: argparse.Namespace, answers: Answers) -> None:
    gpus = local_devices()
    answers.use_cpu = not gpus
    if gpus:
        count = asker.ask(f"GPUs to use (this machine has {len(gpus)})", args.num_gpus or len(gpus),
                          _whole(1, len(gpus)))
        answers.local_slots = tuple(gpus[:count])
    else:
        count = asker.ask("No GPU here: CPU processes to start", args.num_gpus or CPU_PROCESSES, _whole(1))
        answers.local_slots = tuple(range(count))
    answers.master_port = asker.ask("Master port (auto: a free one at each start)", "auto", _port_or("auto"))


def _ask_machines(asker: Asker, args: argparse.Namespace, answers: Answers) -> None:
    default = args.hostfile or Path(args.output_dir, HOSTFILE)
    answers.hostfile = asker.ask("Hostfile (an existing one to use, or where to write one)", shown(default), _path)
    existing = _existing_hosts(asker, answers.hostfile)
    if existing and asker.ask(f"{shown(answers.hostfile)} lists {_summary(existing)}. Use it as it is? (y/n)",
                              "y", _yes_no):
        answers.hosts = existing
    answers.use_cpu = not asker.ask("Do the machines have GPUs? (y/n)", "y" if local_devices() else "n", _yes_no)
    if not answers.hosts:
        answers.hosts = _ask_hosts(asker, args, answers.use_cpu)
        answers.write_hostfile = True
    first = answers.hosts[0].name
    answers.master_addr = asker.ask(f"Master address, reachable from every machine (auto: {first})", "auto",
                                    _address)
    answers.master_port = asker.ask("Master port (auto: a free one at each start)", "auto", _port_or("auto"))


def _existing_hosts(asker: Asker, path: Path) -> list[Host] | None:
    """The hosts of an existing hostfile; None when there is none (or, asking, it cannot be read)."""
    if not path.exists() and not asker.interactive:
        raise CrewError(f"crew config --yes: hostfile {path} not found. --yes uses an existing hostfile; "
                        "run crew config without --yes to write one.")
    if not path.exists():
        return None
    try:
        return read_hostfile(path)
    except HostfileError as exc:
        if not asker.interactive:
            raise
        print(f"  {exc}\n  Answer the questions below to write a new one.", flush=True)
        return None


def _summary(hosts: list[Host]) -> str:
    names = ", ".join(f"{h.name} ({len(h.slots)})" for h in hosts[:4]) + (", ..." if len(hosts) > 4 else "")
    return f"{len(hosts)} machine(s), {sum(len(h.slots) for h in hosts)} slot(s): {names}"


def _ask_hosts(asker: Asker, args: argparse.Namespace, use_cpu: bool) -> list[Host]:
    count = asker.ask("How many machines", 2, _whole(1))
    hosts: list[Host] = []
    slots = args.num_gpus or len(local_devices()) or 1
    for number in range(1, count + 1):
        host = asker.ask(f"Machine {number} of {count}: host name or address", None,
                         _host({h.name for h in hosts}))
        port = asker.ask(f"  {host.name}: ssh port (default: from ~/.ssh/config, else 22)",
                         host.ssh_port or "default", _port_or("default"))
        what = "CPU processes" if use_cpu else "processes (slots, usually its GPUs)"
        slots = asker.ask(f"  {host.name}: {what}", slots, _whole(1))
        ids = tuple(range(slots))
        if not use_cpu:
            ids = asker.ask(f"  {host.name}: GPU ids", ",".join(map(str, ids)), _gpu_ids(slots))
        hosts.append(Host(host.name, ids, port))
    return hosts


def _ask_training(asker: Asker, args: argparse.Namespace, answers: Answers) -> None:
    answers.zero_stage = asker.ask("ZeRO stage (0-3)", ZERO_STAGE if args.zero_stage is None else args.zero_stage,
                                   _whole(0, 3))
    answers.precision = asker.ask("Precision (no, fp16, bf16)", args.precision or ("no" if answers.use_cpu else "bf16"),
                                  _choice({"no": "no", "fp32": "no", "fp16": "fp16", "bf16": "bf16"}))
    answers.grad_accum = asker.ask("Gradient accumulation steps", 1, _whole(1))
    if asker.ask("Write a DeepSpeed config JSON? (y/n)", "y", _yes_no):
        answers.ds_config = asker.ask("  its path", shown(Path(args.output_dir, DS_CONFIG)), _path)
        answers.micro_batch = asker.ask("  micro batch size per GPU (train_micro_batch_size_per_gpu)",
                                        MICRO_BATCH, _whole(1))
    answers.script = asker.ask("Training script (the doctor checks it is the same on every machine)",
                               args.script or SCRIPT, _word("a script"))
    answers.save_dir = asker.ask("Where checkpoints go (a folder, on every machine)", SAVE_DIR, _word("a folder"))


# What gets written.

def shown(path: str | Path) -> str:
    """A path as the files and the printed lines name it: relative to here when below here."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def hostfile_text(hosts: list[Host]) -> str:
    """crew's hostfile; the plain DeepSpeed form (`host slots=N`) where no port or device ids are needed."""
    lines = ["# written by crew config: <host>[:<ssh port>] slots=<n> [gpu=<ids>]"]
    for host in hosts:
        address = host.name
        if host.ssh_port:
            address = f"[{host.name}]:{host.ssh_port}" if ":" in host.name else f"{host.name}:{host.ssh_port}"
        gpus = "" if host.slots == tuple(range(len(host.slots))) else " gpu=" + ",".join(map(str, host.slots))
        lines.append(f"{address} slots={len(host.slots)}{gpus}")
    return "\n".join(lines) + "\n"


def ds_config(answers: Answers) -> dict:
    """A DeepSpeed config: the batch keys, the ZeRO stage and the precision; the script brings its optimizer."""
    data: dict[str, Any] = {"train_micro_batch_size_per_gpu": answers.micro_batch,
                            "gradient_accumulation_steps": answers.grad_accum,
                            "zero_optimization": {"stage": answers.zero_stage}}
    if answers.precision != "no":
        data[answers.precision] = {"enabled": True}
    return data


def launch_config(answers: Answers) -> dict:
    """Accelerate's ClusterConfig keys (num_processes counts all machines, as Accelerate does)."""
    if answers.use_cpu:
        kind = "MULTI_CPU" if answers.world_size > 1 else "NO"
    else:
        kind = "DEEPSPEED"
    data: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind,
                            "num_machines": len(answers.hosts) or 1, "num_processes": answers.world_size,
                            "machine_rank": 0}
    if answers.master_addr:
        data["main_process_ip"] = answers.master_addr
    if answers.master_port:
        data["main_process_port"] = answers.master_port
    if not answers.ds_config:  # with a JSON, Accelerate takes the precision from there only
        data["mixed_precision"] = answers.precision
    data["use_cpu"] = answers.use_cpu
    gpus = local_devices()
    if not answers.hosts and not answers.use_cpu and len(answers.local_slots) < len(gpus):
        data["gpu_ids"] = ",".join(map(str, answers.local_slots))
    if block := _deepspeed_block(answers):
        data["deepspeed_config"] = block
    return data


def _deepspeed_block(answers: Answers) -> dict:
    block: dict[str, Any] = {}
    if answers.use_cpu:
        pass  # Accelerate does not use DeepSpeed on the CPU: its keys would be ignored (crew says so)
    elif answers.ds_config:
        block["deepspeed_config_file"] = shown(answers.ds_config)
    else:
        block["zero_stage"] = answers.zero_stage
        block["gradient_accumulation_steps"] = answers.grad_accum
    if answers.hosts:
        block["deepspeed_hostfile"] = shown(answers.hostfile)
    return block


def files_for(answers: Answers, launch_path: Path) -> dict[Path, str]:
    """Every file to write, with its text; the DeepSpeed JSON checked with crew's own config reader."""
    import yaml

    files: dict[Path, str] = {}
    if answers.write_hostfile:
        files[answers.hostfile] = hostfile_text(answers.hosts)
    if answers.ds_config:
        data = ds_config(answers)
        from crew.runtime.config import Config  # pydantic, no torch

        Config.from_dict(data, world_size=answers.world_size, source=shown(answers.ds_config))
        files[answers.ds_config] = json.dumps(data, indent=2) + "\n"
    files[launch_path] = yaml.safe_dump(launch_config(answers), sort_keys=False)
    return files


def confirm_overwrite(asker: Asker, paths: list[Path], force: bool) -> None:
    for path in paths:
        if path.is_dir():
            raise CrewError(f"crew config: {shown(path)} is a folder; choose a file name (or --output_dir).")
        folder = next((p for p in path.parents if p.exists()), None)
        if folder is not None and not folder.is_dir():
            raise CrewError(f"crew config: {shown(folder)} is a file, so {shown(path)} cannot be written "
                            "under it; choose another --output_dir (or path).")
    existing = [shown(p) for p in paths if p.exists()]
    if not existing or force:
        return
    if not asker.interactive:
        raise Abort(f"{', '.join(existing)} already exist(s); with --yes, crew config replaces files only "
                    "with --force (or choose another --output_dir)")
    for name in existing:
        if not asker.ask(f"{name} exists. Replace it? (y/n)", "n", _yes_no):
            raise Abort(f"kept {name}; run again with other paths (or --output_dir)")


def write_files(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# After writing: the run lines and the doctor.

def run_lines(answers: Answers, launch_path: Path, ssh_args: str) -> list[str]:
    script = [answers.script, "--deepspeed", "--deepspeed_config", shown(answers.ds_config)] \
        if answers.ds_config else [answers.script]
    script += ["--save_dir", answers.save_dir]
    ssh = ["--ssh_args", ssh_args] if ssh_args else []
    plain = ["crew", "run", *_world_options(answers), *ssh, *script]
    return [shlex.join(["crew", "run", "--config_file", shown(launch_path), *ssh, *script]), shlex.join(plain)]


def accelerate_can_read(answers: Answers) -> bool:
    """Whether `accelerate launch` (DeepSpeed's hostfile reader) takes this hostfile: no ssh port and no
    GPU ids on its lines, which are crew's own form."""
    return all(h.ssh_port is None and h.slots == tuple(range(len(h.slots))) for h in answers.hosts)


def _world_options(answers: Answers) -> list[str]:
    if not answers.hosts:
        options = ["--num_gpus", str(len(answers.local_slots))]
    else:
        options = ["-H", shown(answers.hostfile)]
        if answers.master_addr:
            options += ["--master_addr", answers.master_addr]
    if answers.master_port:
        options += ["--master_port", str(answers.master_port)]
    return options


def needs_doctor(answers: Answers) -> bool:
    """Whether a plan of these hosts reaches any machine over ssh (a hostfile of this machine alone does not)."""
    here = socket.gethostname()
    return len(answers.hosts) > 1 or any(not is_local_name(h.name, here) for h in answers.hosts)


def doctor_options(answers: Answers, ssh_args: str) -> list[str]:
    options = ["doctor", *_world_options(answers), "--save_dir", answers.save_dir]
    return options + (["--ssh_args", ssh_args] if ssh_args else []) + [answers.script]


def run_doctor(answers: Answers, ssh_args: str) -> int:
    options = doctor_options(answers, ssh_args)
    print(f"\nChecking the machines: {shlex.join(['crew', *options])}", flush=True)
    try:
        code = subprocess.run([sys.executable, "-m", "crew", *options]).returncode
    except KeyboardInterrupt:
        code = 130
    if code:
        print(f"\ncrew config: the files are written, but crew doctor found problems (exit {code}, crew config's "
              f"too). Fix them, then check again: {shlex.join(['crew', *options])}", flush=True)
    else:
        print("\ncrew config: crew doctor found no problem.", flush=True)
    return code


def run_config(args: argparse.Namespace) -> int:
    """`crew config`: ask, write, print the run line, check the machines; the exit code says how it went."""
    asker = Asker(interactive=not args.yes)
    launch_path = Path(args.output_dir, LAUNCH_CONFIG)
    try:
        answers = ask_all(asker, args)
        files = files_for(answers, launch_path)
        confirm_overwrite(asker, list(files), args.force)
    except Abort as exc:
        print(f"crew config: {exc}. Nothing written.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncrew config: interrupted. Nothing written.", file=sys.stderr)
        return 130
    write_files(files)
    print(f"\ncrew config: wrote {', '.join(shown(p) for p in files)}")
    lines = run_lines(answers, launch_path, args.ssh_args)
    print("Run the job with (--save_dir: your script's own flag for the checkpoint folder):")
    print(f"    {lines[0]}\n  or, the same without the launch config:\n    {lines[1]}")
    if accelerate_can_read(answers):
        print(f"  Accelerate reads the launch config too: accelerate launch --config_file {shown(launch_path)} "
              f"{shlex.quote(answers.script)}", flush=True)
    else:
        print("  (accelerate launch cannot read this hostfile: ssh ports and GPU ids on its lines are crew's "
              "form)", flush=True)
    if args.no_doctor or not needs_doctor(answers):
        return 0
    return run_doctor(answers, args.ssh_args)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Ask where and how to train (this machine or several: hostfile, ssh ports, slots, GPU "
                          "ids; master address and port; ZeRO stage, precision, checkpoints), write a hostfile, "
                          f"{LAUNCH_CONFIG} (Accelerate's launch config format) and a DeepSpeed JSON, print the "
                          "`crew run` line, and run `crew doctor` on the machines. Enter takes the [default].")
    def option(name: str, **kwargs) -> None:
        parser.add_argument(name, *([name.replace("_", "-")] if "_" in name else []), **kwargs)

    parser.add_argument("-y", "--yes", action="store_true",
                        help="ask nothing: take every default and the values given below, and write")
    parser.add_argument("-H", "--hostfile", help="an existing hostfile to use (the default answer; with "
                        "--yes, several machines need one)")
    option("--output_dir", default=".", metavar="DIR", help="where new files go (default: here)")
    option("--num_gpus", type=_flag(_whole(1)), metavar="N",
           help=f"processes per machine (default: this machine's GPUs, or {CPU_PROCESSES} CPU processes)")
    option("--zero_stage", type=int, choices=range(4), help=f"ZeRO stage (default: {ZERO_STAGE})")
    parser.add_argument("--precision", choices=PRECISIONS, help="no, fp16 or bf16 (default: bf16 with GPUs)")
    parser.add_argument("--script", help=f"the training script (default: {SCRIPT})")
    option("--ssh_args", default="", help="extra ssh client arguments for crew doctor and the printed run line, "
           "e.g. \"-F cluster_ssh_config\"")
    parser.add_argument("--force", action="store_true", help="with --yes: replace files that exist")
    option("--no_doctor", action="store_true", help="do not run crew doctor on the machines at the end")
    parser.set_defaults(handler=run_config)
