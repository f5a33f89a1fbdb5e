"""What `crew run` checks on this machine before it starts anything (no rank, no ssh connection): the
script is there, and the DeepSpeed config the script is given resolves at the job's world size.

A problem is one `CrewError`, said once (`crew: error: ...`, exit code 2), instead of a failure in
every rank a few seconds after the start. Only what would surely fail in the ranks is refused:

- The script must be in the working directory (ranks start in the same folder on every node). Over
  ssh, pdsh and Slurm the nodes may have code this machine lacks: --skip_preflight leaves them to judge.
- `--deepspeed_config FILE` (or Hugging Face's `--deepspeed FILE.json`) among the script's arguments is
  read and resolved with crew's own config reader (`Config.from_dict` at the job's world size), as each
  rank's `initialize(args=args)` would, but only where the ranks run crew's engine: under --as_deepspeed,
  or for a script that imports crew and not deepspeed (DeepSpeed's own engine reads hjson and may divide
  the world by model parallelism).
  Batch keys set to "auto" (a Hugging Face integration fills them from its own arguments) leave the
  batch arithmetic to the ranks. The config's warnings (unknown keys, "auto" values) are not said here:
  the ranks say them, when they apply.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import re
import warnings
from pathlib import Path

from crew.errors import CrewError

REMOTE_LAUNCHERS = ("ssh", "pdsh", "slurm")  # the nodes may have what this machine lacks
CONFIG_FLAG = "--deepspeed_config"
HF_FLAG = "--deepspeed"  # transformers' TrainingArguments: --deepspeed ds_config.json
_HF_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BATCH_KEYS = (*_HF_BATCH_KEYS, "train_micro_batch_size_per_rank")
_IMPORTS = re.compile(r"^\s*(?:import|from)\s+(crew|deepspeed)\b", re.MULTILINE)


def check_run(args: argparse.Namespace, launcher: str, world_size: int, start_world_size: int | None = None) -> None:
    """Raise CrewError for a script or config that would fail every rank; `args`: crew run's;
    `start_world_size`: the world an elastic job started on (crew run --min_nodes), when it has changed."""
    skip = args.skip_preflight or getattr(args, "no_ssh_check", False)
    python = not (args.module or args.no_python)
    if python and not (skip and launcher in REMOTE_LAUNCHERS):
        problem = missing_script(args.script)
        if problem:
            hatch = (" If only the nodes have it, --skip_preflight starts anyway."
                     if launcher in REMOTE_LAUNCHERS else "")
            raise CrewError(f"crew run: {problem}{hatch}")
    config = config_argument(args.script_args)
    if config and not skip and (args.as_deepspeed or (python and imports_crew(Path(args.script)))):
        check_config(config, world_size, start_world_size)


def missing_script(script: str) -> str | None:
    """What is wrong with `script` (from the working directory), with close names in its folder; None
    when it is there."""
    path = Path(script)
    if path.is_file() or (path / "__main__.py").is_file():  # python runs a folder with a __main__.py
        return None
    if path.is_dir():
        return f"{script} is a folder without a __main__.py, not a script python can run."
    folder = path.parent.absolute()
    if not folder.is_dir():
        return f"script {script} not found: there is no folder {folder} on this machine."
    names = sorted(entry.name for entry in folder.iterdir() if entry.is_file())
    close = [str(path.parent / name) for name in difflib.get_close_matches(path.name, names, n=3)]
    hint = f"; did you mean {' or '.join(close)}?" if close else "."
    return f"script {script} not found in {folder} on this machine{hint}"


def config_argument(script_args: list[str]) -> str | None:
    """The FILE of `--deepspeed_config FILE` (or `=FILE`) in the script's arguments, or of Hugging Face's
    `--deepspeed FILE.json` (TrainingArguments; DeepSpeed's own --deepspeed is a switch); the last one
    wins, as in argparse."""
    found = None
    for index, arg in enumerate(script_args):
        following = script_args[index + 1] if index + 1 < len(script_args) else ""
        if arg == CONFIG_FLAG and following:
            found = following
        elif arg.startswith(CONFIG_FLAG + "="):
            found = arg.split("=", 1)[1]
        elif arg == HF_FLAG and following.endswith(".json"):
            found = following
        elif arg.startswith(HF_FLAG + "=") and arg.endswith(".json"):
            found = arg.split("=", 1)[1]
    return found or None


def imports_crew(script: Path) -> bool:
    """The script imports crew and not deepspeed: its ranks run crew's engine."""
    try:
        names = set(_IMPORTS.findall(script.read_text(errors="replace")))
    except OSError:
        return False
    return names == {"crew"}


def check_config(config: str, world_size: int, start_world_size: int | None = None) -> None:
    """Read `config` (from the working directory) and resolve it for `world_size` ranks, as a rank's
    initialize() would; CrewError on a problem."""
    from crew.runtime.config import Config, ConfigError, read_json  # pydantic, no torch

    try:
        data = read_json(Path(config))
        if any(data.get(key) == "auto" for key in _HF_BATCH_KEYS):  # filled in by the script's own arguments
            data = {k: v for k, v in data.items() if k not in _BATCH_KEYS} | {"train_micro_batch_size_per_gpu": 1}
        with _quiet():
            Config.from_dict(data, world_size, source=config, start_world_size=start_world_size)
    except ConfigError as exc:
        raise CrewError(f"{exc} Nothing was started (--skip_preflight starts without this check).") from None


@contextlib.contextmanager
def _quiet():
    """The config's warnings (unknown keys, "auto" values) are the ranks' to say, not this check's."""
    from crew.runtime.config import ConfigWarning, logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            yield
    finally:
        logger.setLevel(level)
