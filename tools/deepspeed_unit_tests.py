"""DeepSpeed's own unit tests (tests/unit/ of a DeepSpeed checkout) run against crew's `deepspeed` shim.

    python tools/deepspeed_unit_tests.py DS_SRC [FILE ...] [--reference /opt/dsvenv/bin/python] [--json OUT]

DS_SRC is a DeepSpeed source checkout (or its tests/ folder); FILEs are paths under tests/unit/ (default: the
public-API subset below, the part that runs on a CPU under DeepSpeed itself). Each file runs in its own pytest
process with crew/deepspeed/shim first on PYTHONPATH, so DeepSpeed's tests (and the processes their
DistributedTest spawns) `import deepspeed` and get crew. `--reference PYTHON` runs the same files first under an
interpreter with real DeepSpeed, for a side-by-side table: a test that fails there on a CPU is out of scope.
Not part of `make test`: the project never fetches DeepSpeed; see `make ds-unit DS_SRC=...`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "crew" / "deepspeed" / "shim"

# The public API a DeepSpeed user reaches (initialize, config, lr schedules, checkpointing, ZeRO, zero.Init,
# comm) in files that DeepSpeed itself passes on a CPU; see docs/benchmarks.md, "DeepSpeed's own unit tests".
DEFAULT_FILES = [
    "runtime/test_ds_config_dict.py",
    "runtime/test_ds_config_model.py",
    "runtime/test_ds_initialize.py",
    "runtime/test_lr_schedulers.py",
    "runtime/test_runtime_utils.py",
    "runtime/zero/test_zero_config.py",
    "runtime/zero/test_zero_context.py",
    "runtime/zero/test_zero_context_return.py",
    "runtime/zero/test_zero_context_ancestry.py",
    "runtime/zero/test_zero_nesting_init.py",
    "runtime/zero/test_zero_dynamic_class.py",
    "checkpoint/test_latest_checkpoint.py",
    "checkpoint/test_tag_validation.py",
    "checkpoint/test_lr_scheduler.py",
    "checkpoint/test_other_optimizer.py",
    "comm/test_dist.py",
    "utils/test_partition_balanced.py",
    "utils/test_get_optim_files.py",
]

# sitecustomize.py, first on every process's path (pytest and the ranks DistributedTest spawns). DeepSpeed's
# tests import DeepSpeed internals at the top of a file (simple_model.py: deepspeed.pipe and deepspeed.moe.layer;
# test_ds_config_dict.py: deepspeed.runtime.zero.config, ...), which crew refuses at import, so one such line would
# fail every test of the file at collection. Here those imports succeed and each name refuses on use with crew's
# message (a test that calls one fails with it; isinstance against one is False): each test fails for itself.
STANDIN_MODULES = ["pipe", "moe.layer", "runtime.config_utils", "runtime.precision_config", "runtime.fp16",
                   "runtime.fp16.fused_optimizer", "runtime.fp16.unfused_optimizer", "runtime.zero.config",
                   "runtime.zero.stage_1_and_2", "utils.groups"]
STANDIN_NAMES = {"runtime.zero.stage3": ["DeepSpeedZeroOptimizer_Stage3"],
                 "runtime.zero.partition_parameters": ["MultipleAllGatherHandles", "partitioned_param_data_shape"]}
STANDINS = """
import importlib, importlib.abc, importlib.util, sys, types
import deepspeed  # crew's shim: installs `import deepspeed` -> crew
from crew.deepspeed.alias import crew_module_for
from crew.deepspeed.errors import UnsupportedAttribute, UnsupportedModule, unsupported

MODULES = {modules!r}
NAMES = {names!r}


def refusing(dotted):
    def __init__(self, *args, **kwargs):
        raise UnsupportedAttribute(unsupported(dotted) + " [stand-in of deepspeed_unit_tests.py]",
                                   name=dotted.rpartition(".")[2], obj=None)
    return type(dotted.rpartition(".")[2], (), {{"__init__": __init__, "__module__": "deepspeed_unit_tests"}})


class StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = refusing(self.__name__.removeprefix("deepspeed.") + "." + name)
        setattr(self, name, value)
        return value


class Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = StandIn(spec.name, "a stand-in of deepspeed_unit_tests.py: every name refuses on use")
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.removeprefix("deepspeed.") not in MODULES:
            return None
        try:
            crew_module_for(name)
            return None  # crew has it now: crew answers
        except UnsupportedModule:
            return importlib.util.spec_from_loader(name, Loader(), is_package=True)


sys.meta_path.insert(0, Finder())
for module, names in NAMES.items():
    target = importlib.import_module("deepspeed." + module)
    for name in names:
        if not hasattr(target, name):
            setattr(target, name, refusing(module + "." + name))
""".format(modules=STANDIN_MODULES, names=STANDIN_NAMES)  # noqa: UP032 (the template has braces of its own)

TEST_REQUIREMENTS = ["hjson", "numpy"]  # what DeepSpeed's tests import beside deepspeed, torch and pytest
OUTCOMES = ("passed", "failed", "error", "skipped")
VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
BOILERPLATE = re.compile(r" is not supported by crew: crew runs data-parallel .*? lists what it provides\)\.")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tests_dir(src: Path) -> Path:
    for candidate in (src / "tests", src):
        if (candidate / "unit" / "common.py").is_file():
            return candidate
    sys.exit(f"error: {src} holds no DeepSpeed tests/unit/common.py; "
             f"pass a DeepSpeed source checkout (git clone https://github.com/deepspeedai/DeepSpeed)")


def stage(tests: Path, into: Path) -> Path:
    """A copy of tests/ alone: DeepSpeed's conftest puts the folder above tests/ on sys.path, where a full
    checkout's deepspeed/ package would shadow the shim in every spawned rank."""
    staged = into / "tests"
    shutil.copytree(tests, staged, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return staged


def environment(staged: Path, shim: bool, args) -> dict:
    # LOCAL_SIZE: the device count of DeepSpeed's CPU accelerator (and crew's); a test asking for more ranks skips.
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_UNITTEST_TIMEOUT=str(args.timeout), LOCAL_SIZE=str(args.ranks),
               PYTHONDONTWRITEBYTECODE="1")
    if shim:
        standins = staged.parent / "standins"
        standins.mkdir(exist_ok=True)
        (standins / "sitecustomize.py").write_text(STANDINS)
        paths = [str(standins), str(SHIM), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    return env


def importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def run_file(python: str, staged: Path, rel: str, shim: bool, args) -> dict:
    xml = staged.parent / f"{re.sub(r'[^A-Za-z0-9]', '_', rel)}.{'crew' if shim else 'ref'}.xml"
    xml.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"unit/{rel}", "--junitxml", str(xml)]
    cmd += shlex.split(args.pytest_args)
    if importable(python, "pytest_timeout"):
        cmd += ["--timeout", str(args.timeout)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=staged, env=environment(staged, shim, args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=args.file_timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None or timed_out:  # timed out or interrupted: pytest and the ranks it spawned
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    if timed_out:
        out, _ = proc.communicate()
    tests = parse_junit(xml) if xml.is_file() else parse_verbose(out)
    counts = {k: sum(t["outcome"] == k for t in tests) for k in OUTCOMES}
    result = {"file": rel, "seconds": round(time.monotonic() - started, 1), "timed_out": timed_out,
              "complete": xml.is_file(), "counts": counts, "tests": tests}
    if not tests:
        result["note"] = ANSI.sub("", out).strip().splitlines()[-5:] if out.strip() else ["no output"]
    return result


def parse_junit(xml: Path) -> list[dict]:
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = first_line(node)
                break
        tests.append({"name": name, "outcome": outcome, "message": message})
    return tests


def first_line(node) -> str:
    """The error itself: the message, or for a collection error the last `E ` line of its traceback."""
    message = (node.get("message") or "").strip()
    errors = [line[1:].strip() for line in (node.text or "").splitlines() if line.startswith("E ")]
    if errors and (not message or message.startswith(("collection failure", "failed on setup"))):
        message = errors[-1]
    message = BOILERPLATE.sub(" is not supported by crew", (message.splitlines() or [""])[0])
    return message[:300]


def parse_verbose(out: str) -> list[dict]:
    """What a killed pytest printed before the kill (DeepSpeed's conftest forces -v)."""
    names = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
             "XFAIL": "skipped"}
    tests = []
    for line in ANSI.sub("", out).splitlines():
        match = VERBOSE_LINE.match(line.strip())
        if match:
            tests.append({"name": match[1], "outcome": names[match[2]], "message": ""})
    return tests


def cell(result: dict | None) -> str:
    if result is None:
        return "-"
    c = result["counts"]
    text = f"{c['passed']}/{c['failed']}/{c['skipped']}/{c['error']}"
    if not result.get("complete", True):  # killed: only what its verbose lines said before
        text += " T/O" if result["timed_out"] else " killed"
    return text + ("" if result["tests"] else " (none)")


def table(files: list[str], crew: dict, ref: dict) -> str:
    width = max(len(f) for f in files + ["total"])
    lines = [f"{'file (pass/fail/skip/error)':<{width}}  {'DeepSpeed (CPU)':>18}  {'crew':>18}"]
    for f in files:
        lines.append(f"{f:<{width}}  {cell(ref.get(f)):>18}  {cell(crew.get(f)):>18}")
    for label, results in (("DeepSpeed", ref), ("crew", crew)):
        if results:
            total = {k: sum(r["counts"][k] for r in results.values()) for k in OUTCOMES}
            lines.append(f"total {label}: " + ", ".join(f"{v} {k}" for k, v in total.items()))
    return "\n".join(lines)


def failures(results: dict, ref: dict) -> str:
    lines = []
    for f, result in results.items():
        passed_there = {t["name"] for t in ref.get(f, {}).get("tests", []) if t["outcome"] == "passed"}
        for t in result["tests"]:
            if t["outcome"] in ("failed", "error"):
                scope = "" if not ref else ("  [passes under DeepSpeed]" if t["name"] in passed_there
                                            else "  [not passing under DeepSpeed either]")
                name = t["name"].removeprefix("unit.").split(".")[-1]  # the class (or module) and the test
                lines.append(f"{f}::{name}: {t['message']}{scope}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ds_src", type=Path, help="a DeepSpeed source checkout (or its tests/ folder)")
    parser.add_argument("files", nargs="*", help="paths under tests/unit/ (default: the public-API subset)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with crew (default: this one)")
    parser.add_argument("--reference", metavar="PYTHON", help="also run each file under this interpreter's real "
                        "DeepSpeed (DS_ACCELERATOR=cpu), e.g. /opt/dsvenv/bin/python")
    parser.add_argument("--reference_only", action="store_true", help="run only under --reference's DeepSpeed")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (DS_UNITTEST_TIMEOUT, and "
                        "pytest-timeout when installed)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks a test may start (LOCAL_SIZE, the CPU "
                        "accelerator's device count): tests asking for more skip, as under DeepSpeed on a CPU")
    parser.add_argument("--file_timeout", type=int, default=900, help="seconds per file before it is killed")
    parser.add_argument("--pytest_args", default="", help="more pytest arguments, e.g. \"-k 'not Fp16'\"")
    parser.add_argument("--json", type=Path, help="write every test's outcome and message here")
    parser.add_argument("--quiet", action="store_true", help="only the table, not each failure's message")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through run_file's cleanup of its pytest

    files = [f.removeprefix("tests/").removeprefix("unit/") for f in args.files] or DEFAULT_FILES
    tests = tests_dir(args.ds_src.resolve())
    missing = [f for f in files if not (tests / "unit" / f).exists()]
    if missing:
        sys.exit(f"error: not in {tests / 'unit'}: {', '.join(missing)}")
    missing = [m for m in TEST_REQUIREMENTS if not importable(args.python, m)]
    if missing and not args.reference_only:
        print(f"note: DeepSpeed's tests import {', '.join(missing)}, which {args.python} lacks: files that import "
              f"it fail at collection (pip install {' '.join(missing)})", file=sys.stderr)
    crew, ref = {}, {}
    with tempfile.TemporaryDirectory(prefix="ds-unit-") as tmp:
        staged = stage(tests, Path(tmp))
        for f in files:
            if args.reference:
                ref[f] = run_file(args.reference, staged, f, shim=False, args=args)
                print(f"DeepSpeed {f}: {cell(ref[f])} in {ref[f]['seconds']} s", flush=True)
            if args.reference_only:
                continue
            crew[f] = run_file(args.python, staged, f, shim=True, args=args)
            print(f"crew      {f}: {cell(crew[f])} in {crew[f]['seconds']} s", flush=True)
    print()
    print(table(files, crew, ref))
    if not args.quiet and (report := failures(crew, ref)):
        print("\ncrew failures:\n" + report)
    if args.json:
        args.json.write_text(json.dumps({"crew": crew, "deepspeed": ref}, indent=1))
    return 0 if all(r["counts"]["failed"] + r["counts"]["error"] == 0 and r["tests"] for r in crew.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
