"""A census of the DeepSpeed names the libraries built on DeepSpeed touch, and what crew does for each.

    .venv/bin/python tools/deepspeed_census.py                   # the default libraries, docs/ rewritten
    .venv/bin/python tools/deepspeed_census.py trl x.whl --out /tmp/c  # packages, folders, wheels, sdists
    .venv/bin/python tools/deepspeed_census.py --candidates      # DeepSpeed attributes used but not curated

It reads the libraries' Python source with `ast` (nothing is imported from them) and finds three kinds of
names: `import deepspeed.X` / `from deepspeed.X import Y` (module, name), attribute chains on names bound
to DeepSpeed (`deepspeed.zero.Init`, `dist.get_rank` after `from deepspeed import comm as dist`), and the
DeepSpeed-specific attributes read on engines, optimizers, parameters and modules (ATTRIBUTES in
deepspeed_crew_check.py) in files that mention deepspeed. Chains are cut where DeepSpeed's modules end,
which needs DeepSpeed's source (--deepspeed-src, default: an installed deepspeed or /opt/dsvenv).
Writes docs/deepspeed_names.json and docs/deepspeed-names.md; tests/deepspeed/test_census.py checks the json.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deepspeed_crew_check import ATTRIBUTES, describe  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_LIBRARIES = ["transformers", "accelerate", "peft", "trl", "lightning", "llamafactory"]
LLAMAFACTORY = "llamafactory==0.9.5"
# Receivers that hold an engine in the libraries' code; a generic attribute name (`module`, `optimizer`)
# counts only on one of them, so `self.optimizer` of a Trainer is not taken for DeepSpeed's.
DEEPSPEED_PYTHON = pathlib.Path("/opt/dsvenv/bin/python")
ENGINE_RECEIVERS = ("engine", "deepspeed", "model_wrapped", "ds_model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", help=f"packages or paths (default: {' '.join(DEFAULT_LIBRARIES)})")
    parser.add_argument("--deepspeed-src", type=pathlib.Path, help="DeepSpeed's package folder")
    parser.add_argument("--out", type=pathlib.Path,
                        help="folder for the json and md (default: docs/, for the default libraries only)")
    parser.add_argument("--deepspeed-python", type=pathlib.Path, default=DEEPSPEED_PYTHON if DEEPSPEED_PYTHON.exists()
                        else None, help="a python with real DeepSpeed, to mark which names it has (default: "
                        f"{DEEPSPEED_PYTHON} when present; none: the column is left out)")
    parser.add_argument("--candidates", action="store_true",
                        help="list DeepSpeed attributes the libraries use that ATTRIBUTES does not curate")
    args = parser.parse_args(argv)
    if args.out is None and args.sources and not args.candidates:
        parser.error("with SOURCES, pass --out DIR: docs/ holds the census of the default libraries")
    args.out = args.out or ROOT / "docs"
    ds_src = args.deepspeed_src or find_deepspeed_source()
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {name: files for name, files in collect(args.sources or DEFAULT_LIBRARIES, tmp)}
    if args.candidates:
        print_candidates(libraries, ds_src)
        return 0
    names = census(libraries, DeepSpeedModules(ds_src))
    versions = {lib: version for lib, (version, _) in libraries.items()}
    from deepspeed_crew_check import check_all  # imports torch and crew: only when writing the tables
    verdicts = check_all(names)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deepspeed_names.json").write_text(json.dumps(
        {"libraries": versions, "names": names}, indent=1) + "\n")
    if args.deepspeed_python:
        in_deepspeed = probe_real_deepspeed(args.deepspeed_python, args.out / "deepspeed_names.json")
        for entry in names:
            entry["in_deepspeed"] = in_deepspeed[entry["name"]]
        (args.out / "deepspeed_names.json").write_text(json.dumps(
            {"libraries": versions, "names": names}, indent=1) + "\n")
    (args.out / "deepspeed-names.md").write_text(markdown(names, versions, verdicts))
    counts = defaultdict(int)
    for verdict in verdicts.values():
        counts[verdict[0]] += 1
    print(f"{len(names)} names from {', '.join(f'{k} {v}' for k, v in versions.items())}: {dict(counts)}")
    return 0


def probe_real_deepspeed(python: pathlib.Path, census_file: pathlib.Path) -> dict[str, bool]:
    """name -> whether DeepSpeed itself has it (tools/deepspeed_reference.py, one CPU rank under torchrun)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "found.json"
        command = [str(python), "-m", "torch.distributed.run", "--nproc_per_node", "1",
                   str(ROOT / "tools" / "deepspeed_reference.py"), str(census_file), str(out)]
        run = subprocess.run(command, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"deepspeed_census: {' '.join(command)} failed:\n{run.stderr[-3000:]}")
        return json.loads(out.read_text())


# ---- sources -------------------------------------------------------------------------------------------


def find_deepspeed_source() -> pathlib.Path:
    spec = importlib.util.find_spec("deepspeed")
    if spec and spec.origin and "crew" not in spec.origin:
        return pathlib.Path(spec.origin).parent
    found = sorted(pathlib.Path("/opt/dsvenv/lib").glob("python*/site-packages/deepspeed"))
    if not found:
        sys.exit("deepspeed_census: DeepSpeed's source is needed to cut attribute chains where its modules "
                 "end; pass --deepspeed-src PATH/TO/site-packages/deepspeed (pip download deepspeed==0.19.8).")
    return found[0]


def collect(sources: list[str], tmp: str):
    """(library, (version, {relative path: text})) for each package name, folder, wheel or sdist."""
    for source in sources:
        path = pathlib.Path(source)
        if path.exists():
            yield library_name(path), (_version_of(path), read_path(path))
            continue
        spec = importlib.util.find_spec(source)
        if spec is None and source == "llamafactory":
            wheel = download(LLAMAFACTORY, tmp)
            yield "llamafactory", (LLAMAFACTORY.split("==")[1], read_path(wheel))
            continue
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"deepspeed_census: {source!r} is neither an installed package nor a path; install it or "
                     f"pass the folder, wheel or sdist that holds its source.")
        folder = pathlib.Path(list(spec.submodule_search_locations)[0])
        yield source, (importlib.metadata.version(source), read_path(folder, prefix=source))


def download(requirement: str, tmp: str) -> pathlib.Path:
    """The wheel of `requirement`, without its dependencies (LLaMA-Factory is not a crew dependency)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement]
    if subprocess.run(command).returncode != 0:
        sys.exit(f"deepspeed_census: `{' '.join(command)}` failed; download it yourself and pass the file.")
    return next(pathlib.Path(tmp).glob("*.whl"), None) or next(pathlib.Path(tmp).glob("*.tar.gz"))


def _version_of(path: pathlib.Path) -> str:
    """The version in a wheel's or sdist's name (llamafactory-0.9.5-py3-none-any.whl); a folder's name."""
    parts = path.name.removesuffix(".tar.gz").split("-")
    return parts[1] if len(parts) > 1 and parts[1][:1].isdigit() else path.name


def library_name(path: pathlib.Path) -> str:
    return path.name.split("-")[0].split(".")[0].lower()


def read_path(path: pathlib.Path, prefix: str | None = None) -> dict[str, str]:
    if path.is_dir():
        base = prefix or path.name
        return {f"{base}/{p.relative_to(path)}": p.read_text(errors="replace") for p in sorted(path.rglob("*.py"))}
    if path.suffix == ".whl" or path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            return {n: archive.read(n).decode(errors="replace") for n in archive.namelist() if n.endswith(".py")}
    with tarfile.open(path) as archive:
        return {m.name.split("/", 1)[1]: archive.extractfile(m).read().decode(errors="replace")
                for m in archive.getmembers() if m.isfile() and m.name.endswith(".py")}


# ---- scanning ------------------------------------------------------------------------------------------


class DeepSpeedModules:
    """Which dotted names are DeepSpeed modules (from its source tree): where a chain's module part ends."""

    def __init__(self, src: pathlib.Path):
        self.modules = {"deepspeed"}
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            self.modules.add(".".join(("deepspeed",) + parts))
        for _ in range(2):  # an alias of an alias
            self.modules |= set(self._module_aliases(src))

    def _module_aliases(self, src: pathlib.Path):
        """`deepspeed.zero`, which is `from .runtime import zero` in deepspeed/__init__.py: a module too."""
        for path in src.rglob("__init__.py"):
            package = ".".join(("deepspeed",) + path.relative_to(src).parent.parts)
            for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                source = ".".join(filter(None, (base, node.module)))
                for alias in node.names:
                    if f"{source}.{alias.name}" in self.modules:
                        yield f"{package}.{alias.asname or alias.name}"

    def cut(self, chain: list[str]) -> str:
        """deepspeed.utils.logger.info -> deepspeed.utils.logger; an enum member or constant stays on."""
        end = 1
        while end < len(chain) and ".".join(chain[:end + 1]) in self.modules:
            end += 1
        if end < len(chain):
            end += 1  # the name in the module
            if end < len(chain) and chain[end - 1][:1].isupper() and chain[end].isupper():
                end += 1  # ZeroParamStatus.AVAILABLE
        return ".".join(chain[:end])

    def kind(self, dotted: str) -> str:
        return "module" if dotted in self.modules else "name"


class Scanner(ast.NodeVisitor):
    """DeepSpeed names in one file, with scope-aware bindings (`dist` may be torch's in one function and
    DeepSpeed's comm in another)."""

    def __init__(self, modules: DeepSpeedModules):
        self.modules = modules
        self.scopes: list[dict[str, str]] = [{}]
        self.found: list[tuple[str, int]] = []

    def bind(self, name: str, dotted: str | None) -> None:
        if dotted is None:
            self.scopes[-1].pop(name, None)
            if any(name in scope for scope in self.scopes[:-1]):
                self.scopes[-1][name] = ""  # shadowed here
        else:
            self.scopes[-1][name] = dotted

    def lookup(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name] or None
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "deepspeed" or alias.name.startswith("deepspeed."):
                self.found.append((alias.name, node.lineno))
                self.bind(alias.asname or "deepspeed", alias.name if alias.asname else "deepspeed")
            else:
                self.bind(alias.asname or alias.name.split(".")[0], None)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        ours = node.level == 0 and (module == "deepspeed" or module.startswith("deepspeed."))
        for alias in node.names:
            dotted = f"{module}.{alias.name}" if ours else None
            if dotted:
                self.found.append((dotted, node.lineno))
            self.bind(alias.asname or alias.name, dotted)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        root = self.lookup(base.id) if isinstance(base, ast.Name) else None
        if root:
            self.found.append((self.modules.cut(root.split(".") + chain), node.lineno))
            return  # the inner attributes are prefixes of this chain
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.bind(target.id, None)

    def _scoped(self, node) -> None:
        self.scopes.append({})
        arguments = getattr(node, "args", None)
        if isinstance(arguments, ast.arguments):  # a parameter named `dist` or `deepspeed` shadows the module
            for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
                self.bind(arg.arg, None)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _scoped


def attribute_uses(tree: ast.AST, source: str, mentions_deepspeed: bool) -> list[tuple[str, int]]:
    """The curated DeepSpeed attributes a file reads: `.ds_numel`, `engine.module`, `hasattr(p, "ds_shape")`.
    DeepSpeed-only names (ds_*, *zero*) count in every file (PEFT's layers test `ds_shape` without
    mentioning deepspeed); the others only in files that mention it."""
    found = []
    for node in ast.walk(tree):
        name, receiver = _attribute_read(node)
        spec = ATTRIBUTES.get(name)
        if spec is None or not (mentions_deepspeed or _deepspeed_only(name)):
            continue
        if spec.get("engine_receiver"):
            text = (ast.get_source_segment(source, receiver) or "").lower()
            if not any(hint in text for hint in ENGINE_RECEIVERS):
                continue
        found.append((f".{name}", node.lineno))
    return found


def _attribute_read(node: ast.AST) -> tuple[str | None, ast.AST | None]:
    if isinstance(node, ast.Attribute):
        return node.attr, node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[1].value, node.args[0]
    return None, None


ATTRIBUTE_BUILTINS = ("getattr", "hasattr", "setattr")


def _deepspeed_only(name: str) -> bool:
    return name.startswith("ds_") or "zero" in name or name in ("partition_numel", "parameter_offload")


def scan_file(text: str, modules: DeepSpeedModules) -> list[tuple[str, int]]:
    mentions = "deepspeed" in text.lower()
    if not mentions and "ds_" not in text and "zero" not in text and "partition_numel" not in text:
        return []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    found = attribute_uses(tree, text, mentions)
    if mentions:
        scanner = Scanner(modules)
        scanner.visit(tree)
        found += scanner.found
    return found


def census(libraries: dict, modules: DeepSpeedModules) -> list[dict]:
    uses: dict[str, set[str]] = defaultdict(set)
    for _, files in libraries.values():
        for path, text in files.items():
            for name, line in scan_file(text, modules):
                uses[name].add(f"{path}:{line}")
    names = []
    for name in sorted(uses):
        kind = "attribute" if name.startswith(".") else modules.kind(name)
        entry = {"name": name, "kind": kind, "used_by": sorted(uses[name], key=_path_line)}
        if kind == "attribute":
            entry["owner"] = ATTRIBUTES[name[1:]]["owner"]
        names.append(entry)
    return names


def _path_line(use: str):
    path, _, line = use.rpartition(":")
    return path, int(line)


def print_candidates(libraries: dict, ds_src: pathlib.Path) -> None:
    """Attribute names DeepSpeed's engine, ZeRO optimizers and parameters define that the libraries' files
    mentioning deepspeed read, not in ATTRIBUTES: to review when the libraries move (most are generic)."""
    defined = set()
    for rel in ("runtime/engine.py", "runtime/zero/stage3.py", "runtime/zero/stage_1_and_2.py",
                "runtime/zero/parameter_offload.py", "runtime/zero/partition_parameters.py"):
        for node in ast.walk(ast.parse((ds_src / rel).read_text())):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                defined.add(node.name)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
    import torch
    defined -= set(dir(torch.nn.Module)) | set(dir(torch.optim.Optimizer)) | set(dir(torch.Tensor))
    counts: dict[str, list[str]] = defaultdict(list)
    for _, files in libraries.values():
        for path, text in files.items():
            if "deepspeed" not in text.lower():
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in defined and node.attr not in ATTRIBUTES:
                    counts[node.attr].append(f"{path}:{node.lineno}")
    for name, where in sorted(counts.items(), key=lambda item: -len(item[1])):
        print(f"{len(where):5d}  .{name:40s} {', '.join(where[:3])}")


# ---- the table -----------------------------------------------------------------------------------------


def markdown(names: list[dict], versions: dict, verdicts: dict) -> str:
    libs = ", ".join(f"{lib} {version}" for lib, version in versions.items())
    lines = [
        "# DeepSpeed names the libraries built on DeepSpeed use, and what crew does for each",
        "",
        f"Generated by `tools/deepspeed_census.py` from the source of {libs} (DeepSpeed 0.19.8's names). "
        "Rerun it when those libraries move; `tests/deepspeed/test_census.py` fails when a name below is "
        "neither provided by crew nor refused with an error that names it.",
        "",
        "Kinds: `module` (`import deepspeed.X`), `name` (`from deepspeed.X import Y`, `deepspeed.X.Y`), "
        "`attribute` (read on a DeepSpeed engine, ZeRO optimizer, parameter or module; the owner and the "
        "ZeRO stages at which DeepSpeed has it are given). crew: **provided** (imported, or found on a real "
        "crew engine at those stages), **refused** (the error crew raises) "
        "or **missing**. \"In DeepSpeed 0.19.8\": imported, or found on a real DeepSpeed engine at those stages "
        "(tools/deepspeed_reference.py, run with DeepSpeed's own python on one CPU rank).",
        "",
        "| name | kind | used by | in DeepSpeed 0.19.8 | crew |",
        "|---|---|---|---|---|",
    ]
    for entry in names:
        real = {True: "yes", False: "**no**", None: "not checked"}[entry.get("in_deepspeed")]
        lines.append(f"| `{entry['name']}` | {entry['kind']}{_owner(entry)} | {_used_by(entry['used_by'])} | {real} | "
                     f"{describe(verdicts[entry['name']])} |")
    return "\n".join(lines) + "\n"


def _owner(entry: dict) -> str:
    if entry["kind"] != "attribute":
        return ""
    spec = ATTRIBUTES[entry["name"][1:]]
    return f" of {spec['owner']} (ZeRO {','.join(map(str, spec['stages']))})"


def _used_by(uses: list[str], shown: int = 3) -> str:
    text = ", ".join(uses[:shown]).replace("|", "\\|")
    more = len(uses) - shown
    return text + (f" and {more} more" if more > 0 else "")


if __name__ == "__main__":
    raise SystemExit(main())
