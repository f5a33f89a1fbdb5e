"""The house rules of crew's tree: no import circle between its modules (imports inside functions
count too), no module over MAX_LINES, and imports run one way: cli -> launcher and runtime; launcher
and runtime -> the shared leaves (errors, log, outputs, units); never launcher <-> runtime."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

MAX_LINES = 600
MAX_FOLDER_MODULES = 20  # a folder past this many modules gets subpackages by stage
LEAVES = ("crew.errors", "crew.log", "crew.outputs", "crew.units")
# importer -> the crew modules it must not reach (a name covers its submodules)
FORBIDDEN = {
    "crew.launcher": ("crew.runtime", "crew.deepspeed", "crew.cli", "crew.comm", "crew.config", "crew.zero"),
    "crew.runtime": ("crew.launcher", "crew.cli"),
}


def modules_of(root: Path, package: str = "crew") -> dict[str, Path]:
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted((root / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The crew modules `name` imports anywhere in its file; `from a import b` counts a and a.b."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + ".") and target != "crew":
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = modules_of(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def oversized(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    return [(name, count) for name, path in modules_of(root).items()
            if (count := len(path.read_text().splitlines())) > limit]


def crowded(root: Path, limit: int = MAX_FOLDER_MODULES) -> list[tuple[str, int]]:
    """Folders of crew holding more than `limit` modules of their own (__init__.py not counted)."""
    folders = [root / "crew", *(p for p in (root / "crew").rglob("*") if p.is_dir() and p.name != "__pycache__")]
    counts = [(str(f.relative_to(root)), len([m for m in f.glob("*.py") if m.name != "__init__.py"])) for f in folders]
    return sorted((name, count) for name, count in counts if count > limit)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the direction: launcher <-> runtime, either into the CLI, a leaf into a non-leaf."""
    found = []
    for name, targets in graph.items():
        for target in targets:
            banned = [b for importer, bs in FORBIDDEN.items() if _within(name, importer) for b in bs]
            if any(_within(target, b) for b in banned) or (name in LEAVES and target not in LEAVES):
                found.append(f"{name} imports {target}")
    return sorted(found)


# -- crew itself -----------------------------------------------------------------------------------

def test_no_import_circle_in_crew():
    assert circles(import_graph(REPO)) == []


def test_no_module_over_the_line_limit():
    assert oversized(REPO) == []


def test_no_folder_over_the_module_limit():
    assert crowded(REPO) == []


def test_imports_run_one_way():
    assert wrong_way(import_graph(REPO)) == []


# -- the checks themselves find what they look for -------------------------------------------------

def write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checks_see_a_circle_hidden_in_a_function_and_a_long_module(tmp_path):
    root = write_package(tmp_path, {
        "crew/__init__.py": "",
        "crew/runtime/__init__.py": "",
        "crew/runtime/engine.py": "from crew.runtime import zero\n",
        "crew/runtime/zero.py": "def owners():\n    from crew.runtime.engine import live\n",
        "crew/runtime/config.py": "from . import batch\n",
        "crew/runtime/batch.py": "x = 1\n" * (MAX_LINES + 1),
        "crew/launcher/__init__.py": "",
        "crew/launcher/preflight/doctor.py": "from crew.runtime.batch import x\n",
        "crew/errors.py": "import crew.log\n",
        "crew/log.py": "from crew.runtime import config\n",
    })
    graph = import_graph(root)
    assert circles(graph) == [["crew.runtime.engine", "crew.runtime.zero"]]
    assert graph["crew.runtime.config"] == {"crew.runtime.batch"}  # relative import resolved
    assert oversized(root) == [("crew.runtime.batch", MAX_LINES + 1)]
    assert crowded(root, limit=2) == [("crew/runtime", 4)]
    assert wrong_way(graph) == ["crew.launcher.preflight.doctor imports crew.runtime.batch",
                                "crew.log imports crew.runtime",
                                "crew.log imports crew.runtime.config"]  # a leaf may import a leaf


def test_a_package_importing_its_own_modules_is_no_circle(tmp_path):
    root = write_package(tmp_path, {
        "crew/__init__.py": "",
        "crew/runtime/__init__.py": "",
        "crew/runtime/checkpoint/__init__.py": "from crew.runtime.checkpoint.saving import save\n",
        "crew/runtime/checkpoint/saving.py": "from crew.runtime.checkpoint.layout import NAME\n",
        "crew/runtime/checkpoint/layout.py": "NAME = 'x'\n",
    })
    assert circles(import_graph(root)) == []


# -- the documented names did not move --------------------------------------------------------------

def test_documented_import_paths_are_the_runtime_modules():
    import crew
    import crew.comm
    import crew.config
    import crew.zero
    from crew.config import Config
    from crew.zero import GatheredParameters, Init

    assert crew.comm is importlib.import_module("crew.runtime.comm")
    assert crew.zero is importlib.import_module("crew.runtime.zero")
    assert Config is importlib.import_module("crew.runtime.config").Config
    assert (Init, GatheredParameters) == (crew.zero.Init, crew.zero.GatheredParameters)
    for name in crew.__all__:
        assert getattr(crew, name) is not None
    assert issubclass(crew.ConfigError, ValueError)


@pytest.mark.parametrize("module", ["crew", "crew.cli", "crew.launcher.node.agent", "crew.launcher.preflight.probe"])
def test_the_launching_side_does_not_import_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
