"""Which environment variables travel from the launching shell to every rank on every node.

As DeepSpeed: variables whose names start with NCCL_, PYTHON, CUDA_, UCX_ or FI_, then the
`.deepspeed_env` files in the home directory and the working directory (KEY=VALUE lines; the file name
can be changed with DS_ENV_FILE), then `--env KEY=VALUE`; later sources win. Unlike DeepSpeed, values are
never run through a shell: `A=$(whoami)` arrives as the nine characters `$(whoami)`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from crew.errors import CrewError

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "CUDA_", "UCX_", "FI_")
ENV_FILE = ".deepspeed_env"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def gather_env(environ: Mapping[str, str], home: Path, cwd: Path,
               env_flags: Iterable[str] = ()) -> dict[str, str]:
    """The variables every rank gets, in increasing precedence."""
    env = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    name = environ.get("DS_ENV_FILE", ENV_FILE)
    for folder in dict.fromkeys([home.resolve(), cwd.resolve()]):  # once if cwd is home
        path = folder / name
        if path.is_file():
            env.update(read_env_file(path))
    env.update(parse_env_flags(env_flags))
    return env


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines, '#' comments and a leading 'export ' are allowed."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CrewError(f"{path} cannot be read ({exc}). Fix its permissions or remove it.") from None
    env = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        key, value = _split(line, f"{path}, line {number}", "KEY=VALUE")
        env[key] = _unquote(value.strip())
    return env


def parse_env_flags(flags: Iterable[str]) -> dict[str, str]:
    """--env KEY=VALUE, VALUE exactly as the shell passed it."""
    return dict(_split(flag, f"--env {flag}", "--env KEY=VALUE") for flag in flags)


def _split(text: str, where: str, form: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not _NAME.fullmatch(key):
        raise CrewError(
            f"{where}: expected {form} with a variable name of letters, digits and '_', "
            f"got '{text}'."
        )
    return key, value


def _unquote(value: str) -> str:
    """Drop one pair of matching outer quotes, as DeepSpeed's remote shell would; nothing else."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value
