"""`make compat`: the Python and torch versions crew promises (pyproject.toml), each pair tried for real.

For each (python, torch) pair: a throwaway venv under .compat/py<python>-torch<torch>/ (kept and reused once
complete), that torch from PyPI with crew (editable, this checkout) and its runtime dependencies, pytest,
pytest-timeout, hjson and safetensors; no Hugging Face stack. Then a quick subset of the tests, and a table of
the figures. Exits 1 when any pair fails. docs/versions.md says why these pairs and keeps the last table.

    python3 tools/compat.py                        # every pair of the plan
    python3 tools/compat.py --torch 2.11.0         # the pairs with that torch (--python 3.10: that Python)
    python3 tools/compat.py --torch 2.9.1 --python 3.12   # a pair outside the plan
    python3 tools/compat.py --list                 # the plan, nothing run
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENVS = REPO / ".compat"

# (python, torch): the floor (pyproject.toml) on the oldest Python, the torch the lent GPU machines ship, and the
# newest torch pip may install here (/etc/xdg/pip/constraints.txt caps it) on Python 3.11 and the newest Python.
PLAN = [("3.10", "2.9.0"), ("3.11", "2.11.0"), ("3.11", "2.14.1"), ("3.13", "2.14.1")]

# A local multi-process `crew run`, the engine at ZeRO 0-3 in bf16/fp16, checkpoints (stage 3's are DCP) saved,
# loaded and resumed, `--as_deepspeed` under an unchanged DeepSpeed script, config validation, the torch floor.
QUICK = [
    "tests/launcher/test_launch_local.py::test_each_rank_sees_the_torchrun_environment",
    "tests/launcher/test_launch_local.py::test_first_failure_stops_all_ranks_and_is_reported",
    "tests/test_deepspeed_script.py",
    "tests/runtime/test_engine.py",
    "tests/runtime/test_zero.py",
    "tests/runtime/checkpoint/test_checkpoint.py",
    "tests/runtime/checkpoint/test_zero_checkpoint.py",
    "tests/deepspeed/test_as_deepspeed.py",
    "tests/runtime/test_config.py",
    "tests/runtime/test_torch_versions.py",
]
# pytest, and the two small packages of the test extra that QUICK's config and export tests read
TEST_PACKAGES = ["pytest>=8", "pytest-timeout>=2", "hjson>=3.1", "safetensors>=0.4"]


def find_python(version: str) -> str:
    """An interpreter for `version` ("3.10"): a pyenv one, else python3.10 on PATH (a pyenv shim may not run)."""
    candidates = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")), reverse=True)
    for python in [*candidates, shutil.which(f"python{version}")]:
        if python and subprocess.run([python, "-c", ""], capture_output=True).returncode == 0:
            return python
    sys.exit(f"compat: no Python {version} here (~/.pyenv/versions/{version}.* or python{version} on PATH)")


def install(python: str, torch: str, venv: Path) -> float:
    """Make the venv, or complete one made with other packages; the seconds it took (0: already complete)."""
    wanted = [f"torch=={torch}", "-e", str(REPO), *TEST_PACKAGES]
    done = venv / "complete"  # what the venv was made with, written once pip succeeded
    if done.exists() and done.read_text() == " ".join(wanted):
        return 0.0
    started = time.monotonic()
    if not (venv / "bin/python").exists():
        subprocess.run([find_python(python), "-m", "venv", str(venv)], check=True)
    # An exact pin: the machine's constraint file (a torch cap) must not veto it; pip then checks it against
    # crew's own torch>= line, so a torch below the floor stops here, as it would for a user.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", *wanted], check=True, env=env)
    done.write_text(" ".join(wanted))
    return time.monotonic() - started


def run_quick(venv: Path) -> tuple[dict, float, str]:
    """The quick subset in the venv: counts by outcome, seconds, the log's path."""
    log = venv / "pytest.log"
    started = time.monotonic()
    with open(log, "w") as out:
        subprocess.run([str(venv / "bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *QUICK],
                       cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    summary = log.read_text().strip().splitlines()[-1] if log.stat().st_size else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    counts["failed"] = counts.get("failed", 0) + counts.pop("error", 0) + counts.pop("errors", 0)
    if not counts.get("passed") and not counts["failed"]:
        counts["failed"] = 1  # pytest itself did not run (an import error before collection)
    return counts, seconds, str(log)


def installed_versions(venv: Path) -> str:
    probe = "import platform, torch; print(platform.python_version(), torch.__version__)"
    return subprocess.run([str(venv / "bin/python"), "-c", probe], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", help="only this torch (a pair outside the plan with --python)")
    parser.add_argument("--python", help="only this Python, e.g. 3.10")
    parser.add_argument("--list", action="store_true", help="print the plan and the tests, run nothing")
    args = parser.parse_args()
    pairs = [(p, t) for p, t in PLAN if args.python in (None, p) and args.torch in (None, t)]
    if not pairs and args.python and args.torch:
        pairs = [(args.python, args.torch)]
    if args.list or not pairs:
        print("pairs (python, torch):", ", ".join(f"{p} + {t}" for p, t in pairs) or "none matches")
        print("tests:", *QUICK, sep="\n  ")
        return 0 if pairs else 2
    rows, failed = [], False
    for python, torch in pairs:
        venv = VENVS / f"py{python}-torch{torch}"
        print(f"compat: Python {python} + torch {torch} in {venv.relative_to(REPO)}", flush=True)
        try:
            install_s = install(python, torch, venv)
        except subprocess.CalledProcessError as error:
            rows.append((python, torch, "install failed", "", "", "", ""))
            print(f"compat: install failed ({error})", flush=True)
            failed = True
            continue
        counts, test_s, log = run_quick(venv)
        versions = installed_versions(venv).split() or [python, torch]
        rows.append((*versions, counts.get("passed", 0), counts["failed"], counts.get("skipped", 0),
                     f"{test_s:.0f}", f"{install_s:.0f}" if install_s else "reused"))
        if counts["failed"]:
            failed = True
            print(f"compat: failures, see {log}", flush=True)
    print_table(rows)
    return 1 if failed else 0


def print_table(rows: list[tuple]) -> None:
    header = ("python", "torch", "passed", "failed", "skipped", "test s", "install s")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
