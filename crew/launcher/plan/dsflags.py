"""DeepSpeed 0.19.8 launcher flags that crew takes with DeepSpeed's meaning, done crew's way: what they
change in the launch (the launcher, pdsh's and srun's arguments, the ssh options) and what crew says of
them. Used by `launch.resolve`; the bindings themselves are the agent's (node/binding.py).

- --no_ssh: every node started by hand with its --node_rank: crew's standalone launcher.
- --launcher_args: pdsh's, srun's or mpirun's own arguments. With a hostfile and no --launcher, DeepSpeed's launcher
  is pdsh, so crew uses pdsh then too; crew's ssh launcher takes ssh options from --ssh_args instead.
- --venv_script: sourced on every node before crew's agent starts (ssh, pdsh, srun); not on this machine.
- --bind_core_list: asks for binding (--bind_cores_to_rank), which DeepSpeed would need as well.
- --log_level/-q: how much of crew's own lines (console.Console.info) are said.
- --autotuning: DeepSpeed's autotuner is not part of crew.
- PDSH_SSH_ARGS_APPEND: the ssh options users give DeepSpeed's pdsh; crew's ssh connections use them too.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping

from crew.errors import PlanError
from crew.launcher.node.binding import LIST_FLAG, parse_range_list

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEEPSPEED_MASTER_PORT = 29500  # DeepSpeed's --master_port default (TORCH_DISTRIBUTED_DEFAULT_PORT)
PDSH_SSH_ENV = "PDSH_SSH_ARGS_APPEND"
Note = tuple[str, str]  # (level, text): "info" lines go with --log_level warning and above; "warning" stays


def split_words(text: str, where: str) -> tuple[str, ...]:
    """Shell words of `text` (a flag's value), or an error naming `where`."""
    try:
        return tuple(shlex.split(text or ""))
    except ValueError as exc:
        raise PlanError(f"{where} {text!r}: cannot be split into words ({exc}). Fix the quoting.") from None


def ssh_args(environ: Mapping[str, str], flag_value: str) -> tuple[str, ...]:
    """crew's extra ssh client arguments: PDSH_SSH_ARGS_APPEND's words (as DeepSpeed's pdsh launcher
    passes them to ssh), then --ssh_args."""
    return (*split_words(environ.get(PDSH_SSH_ENV, ""), PDSH_SSH_ENV), *split_words(flag_value, "--ssh_args"))


def refuse_unsupported(args: argparse.Namespace) -> None:
    if args.autotuning:
        raise PlanError(f"--autotuning {args.autotuning}: DeepSpeed's autotuner is not part of crew. Run the "
                        f"tuning with DeepSpeed's own launcher (deepspeed --autotuning {args.autotuning} ...), then "
                        "train with crew run --deepspeed_config on the config it wrote "
                        "(autotuning_results/ds_config_optimal.json).")
    if args.bind_core_list:
        parse_range_list(args.bind_core_list)  # its syntax, here; the cores are checked on each node


def requested(args: argparse.Namespace) -> tuple[argparse.Namespace, list[Note]]:
    """`args` as resolve reads them: --no_ssh is --launcher standalone (a copy; `args` is not changed)."""
    if not args.no_ssh:
        return args, []
    if args.launcher not in (None, "standalone"):
        raise PlanError(f"--no_ssh and --launcher {args.launcher} cannot be used together: --no_ssh starts "
                        "this node only (crew's standalone launcher). Leave out one of them.")
    if args.node_rank is None:
        raise PlanError("--no_ssh needs --node_rank K: run the same command on each node with K = 0, 1, ... "
                        "in hostfile order.")
    notes: list[Note] = []
    port = args.master_port
    if port is None:  # every node must agree, and DeepSpeed's fixed default does
        port = DEEPSPEED_MASTER_PORT
        notes.append(("info", f"--no_ssh: master port {port} (DeepSpeed's default; every node must use the same)"))
    return argparse.Namespace(**{**vars(args), "launcher": "standalone", "master_port": port}), notes


def settle_launcher(chosen: str, args: argparse.Namespace) -> tuple[str, tuple[str, ...], list[Note]]:
    """The launcher after --launcher_args, the words it gets, and what to say about them."""
    words = split_words(args.launcher_args, "--launcher_args")
    if not words:
        return chosen, (), []
    if chosen == "ssh" and args.launcher == "ssh":
        raise PlanError(f"--launcher_args {args.launcher_args!r}: these are pdsh's, srun's or mpirun's arguments, and "
                        "--launcher ssh runs no pdsh. Give ssh options with --ssh_args \"...\", or use "
                        "--launcher pdsh.")
    if chosen == "ssh":
        return "pdsh", words, [("info", "--launcher_args: starting the nodes with pdsh, DeepSpeed's launcher "
                                        "for a hostfile (--launcher ssh with --ssh_args for ssh options)")]
    if chosen in ("local", "standalone"):
        return chosen, (), [("warning", f"--launcher_args ignored: the {chosen} launcher starts this machine's "
                                        "ranks itself, with no pdsh or srun (as DeepSpeed on one node)")]
    return chosen, words, []


def venv_script(args: argparse.Namespace, launcher: str) -> tuple[str | None, list[Note]]:
    """The --venv_script path the nodes source (absolute: the remote shell starts elsewhere), or a note
    that this machine's launch does not source it."""
    if not args.venv_script:
        return None, []
    path = os.path.abspath(os.path.expanduser(args.venv_script))
    if launcher in ("local", "standalone"):
        return None, [("warning", f"--venv_script {args.venv_script} not sourced: the {launcher} launcher starts "
                                  "the ranks from this shell, in its environment (as DeepSpeed on one node); "
                                  f"activate it here first (. {shlex.quote(path)})")]
    return path, []


def binding_notes(args: argparse.Namespace) -> list[Note]:
    if args.bind_core_list and not args.bind_cores_to_rank:
        return [("info", f"{LIST_FLAG} {args.bind_core_list}: binding each rank to a block of these cores "
                         "(--bind_cores_to_rank; DeepSpeed ignores the list without it)")]
    return []


def log_level(args: argparse.Namespace) -> argparse.Namespace:
    """-q is --log_level error; debug lists every node as --verbose does (a copy; `args` is not changed)."""
    level = "error" if getattr(args, "quiet", False) else getattr(args, "log_level", "info")
    verbose = getattr(args, "verbose", False) or level == "debug"
    return argparse.Namespace(**{**vars(args), "log_level": level, "verbose": verbose})
