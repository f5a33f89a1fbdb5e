"""The README and the manual (docs/, mkdocs.yml): every relative link resolves, to a file and to a heading or
anchor in it; every page is in mkdocs.yml's nav; every command-line flag a page mentions exists; the README
stays a front page. The markdown is read here, without mkdocs: headings get python-markdown's toc ids, which
is what mkdocs builds the pages with."""

from __future__ import annotations

import argparse
import re
import shlex
import unicodedata
from functools import cache
from pathlib import Path

import pytest
from conftest import REPO

from crew.cli import build_parser

DOCS = REPO / "docs"
README_MAX_LINES = 200

# Flags of other programs that the pages show, by program: any other `--flag` must be crew's or a script's.
OTHER_PROGRAMS_FLAGS = {
    "--deepspeed", "--deepspeed_config",  # a DeepSpeed training script's (deepspeed.add_config_arguments)
    "--local_rank",  # what DeepSpeed's launcher and crew run pass to the script
    "--checkpoint_dir",  # a training script's own save folder, which crew doctor reads
    "--fp16",  # the Accelerate example script's own option (docs/accelerate.md)
    "--backend",  # UER-py's pretrain.py
    "--offload", "--lora_dim", "--only_optimize_lora", "--gradient_checkpointing", "--dtype",  # DeepSpeed-Chat main.py
    "--nnodes",  # torchrun
    "--cpu",  # accelerate launch
    "--nodes", "--ntasks", "--ntasks-per-node", "--nodelist", "--whole", "--input", "--kill-on-bad-exit",  # srun
    "--export", "--chdir", "--overlap", "--gres", "--gpus-per-task", "--pty",  # srun
    "--gpus-per-node", "--cpus-per-task", "--signal", "--requeue",  # sbatch, salloc
    "--batch",  # scancel
    "--no-deps", "--only-binary", "--python-version", "--platform", "--no-index", "--target",  # pip
    "--host", "--mca", "--allow-run-as-root", "--prefix", "--version", "--stdin", "--bind-to",  # mpirun (Open MPI)
    "--hostfil",  # misspelt on purpose: docs/launch.md shows crew's "did you mean --hostfile?"
}

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)([\s\S]+?)\1")
_LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXPLICIT_ID = re.compile(r"\{\s*#([\w-]+)[^}]*\}\s*$")
_HTML_ID = re.compile(r"<a\s[^>]*\b(?:id|name)=[\"']([^\"']+)[\"']")
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_CREW_COMMAND = re.compile(r"\bcrew (run|plan|doctor|sync|export|estimate|plot|config)\b")
_SCRIPT = re.compile(r"\b((?:benchmarks|tools)/\w+\.py)\b")
_COMMAND_END = re.compile(r"\s(?:#|\||&&|;)\s")  # a comment or the next shell command ends a command


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def split_code(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code block lines): fenced blocks, and indented blocks that start after a blank line."""
    prose, code = [], []
    fenced = indented = False
    previous_blank = True
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif fenced:
            code.append(line)
        elif line.startswith("    ") and (indented or previous_blank):
            indented = True
            code.append(line)
        else:
            indented = indented and not line.strip()
            prose.append(line)
        previous_blank = not line.strip()
    return prose, code


def slugify(value: str) -> str:
    """python-markdown's toc.slugify, which mkdocs uses for heading ids."""
    value = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def heading_text(markdown: str) -> str:
    """A heading's text as toc sees it: code spans' contents, links' texts, no emphasis or tags."""
    text = _CODE_SPAN.sub(lambda m: m[2].strip(), markdown)
    text = _LINK.sub(lambda m: m[1], text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"(\*\*|__|\*)", "", text)


@cache
def anchors(page: Path) -> frozenset[str]:
    prose, _ = split_code(page.read_text())
    found: set[str] = set()
    for line in prose:
        found.update(_HTML_ID.findall(line))
        heading = _HEADING.match(line)
        if not heading:
            continue
        explicit = _EXPLICIT_ID.search(heading[2])
        if explicit:
            found.add(explicit[1])
            continue
        slug = slugify(heading_text(heading[2]))
        base, count = slug, 0
        while slug in found or not slug:  # toc.unique: a repeated id gets _1, _2, ...
            count += 1
            slug = f"{base}_{count}"
        found.add(slug)
    return frozenset(found)


def links(page: Path) -> list[str]:
    prose, _ = split_code(page.read_text())
    text = _CODE_SPAN.sub("", "\n".join(prose))
    return [target for _, target in _LINK.findall(text)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading or anchor '{anchor}' in {linked.name}")
    return broken


def nav_pages() -> list[str]:
    """The .md files mkdocs.yml's nav names (one `Title: page.md` per line)."""
    text = (REPO / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return re.findall(r"^\s*-\s*(?:[^:\n]+:|\"[^\"]*\":)?\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE)


@cache
def subcommands() -> dict[str, argparse.ArgumentParser]:
    """crew's real parser, a subparser per subcommand (run, plan, doctor, ...)."""
    choices = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(choices.choices)


@cache
def crew_options() -> dict[str, dict[str, argparse.Action]]:
    """Each subcommand's options, DeepSpeed's launcher flags among them: {'run': {'--hostfile': action}, ...}."""
    return {name: {option: action for action in sub._actions for option in action.option_strings}
            for name, sub in subcommands().items()}


@cache
def script_source(path: str) -> str:
    return (REPO / path).read_text() if (REPO / path).is_file() else ""


@cache
def known_flags() -> frozenset[str]:
    flags = {option for options in crew_options().values() for option in options}
    for script in [*(REPO / "benchmarks").glob("*.py"), *(REPO / "tools").glob("*.py")]:
        flags.update(re.findall(r"[\"'](--[A-Za-z][\w-]*)", script.read_text()))
    return frozenset(flags | OTHER_PROGRAMS_FLAGS)


def words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an apostrophe in prose ("crew run's"): plain words are enough
        return text.split()


def crew_command_problems(subcommand: str, text: str) -> tuple[list[str], str]:
    """Flags of `crew SUBCOMMAND text` that the subcommand lacks, and the text left after its own options
    (a script's arguments, the rest of a sentence): those flags are checked as any other."""
    options = crew_options()[subcommand]
    stops_at_script = any(action.dest == "script" for action in subcommands()[subcommand]._actions)
    problems: list[str] = []
    tokens = words(text)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        bare = token.strip("[]")
        if bare.startswith("-") and len(bare) > 1 and bare[1] != " " and re.match(r"--?[A-Za-z]", bare):
            name = re.match(r"--?[A-Za-z][\w-]*", bare)[0]
            action = options.get(name)
            if action is None:
                problems.append(f"crew {subcommand} has no option {name}")
            elif action.nargs != 0 and "=" not in bare:
                i += 1  # its value
        elif token.startswith("[") or token.endswith("]"):
            pass  # a placeholder: [LAUNCH OPTIONS], [ARGS]
        elif stops_at_script:
            return problems, " ".join(tokens[i + 1:])
        i += 1
    return problems, ""


def flag_problems(code: str) -> list[str]:
    """Every flag in one code span or code line: crew's per subcommand, a script's in its source, the rest
    among every flag crew, the scripts and the listed other programs have."""
    problems: list[str] = []
    marks = sorted([*_CREW_COMMAND.finditer(code), *_SCRIPT.finditer(code)], key=lambda m: m.start())
    rest = [code[:marks[0].start()] if marks else code]
    for mark, following in zip(marks, [*marks[1:], None]):
        segment = code[mark.end():following.start() if following else len(code)]
        end = _COMMAND_END.search(segment)
        command, after = (segment[:end.start()], segment[end.start():]) if end else (segment, "")
        if mark.re is _CREW_COMMAND:
            found, left = crew_command_problems(mark[1], command)
            problems += found
            rest += [left, after]
        else:
            source = script_source(mark[1])
            problems += [f"{mark[1]} has no {flag}" for flag in _FLAG.findall(command)
                         if flag.startswith("--") and flag not in source]
            rest.append(after)
    for flag in _FLAG.findall(" ".join(rest)):
        if flag.startswith("--") and flag not in known_flags():
            problems.append(f"{flag} is no flag of crew, of a script in benchmarks/ or tools/, or of the programs "
                            "tests/test_docs.py lists")
    return problems


def code_texts(page: Path) -> list[str]:
    """The page's code spans (a span may run over a line break within its paragraph) and code lines."""
    prose, code = split_code(page.read_text())
    paragraphs = "\n".join(prose).split("\n\n")
    return [span.replace("\n", " ") for text in paragraphs for _, span in _CODE_SPAN.findall(text)] + code


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_flag_mentioned_exists(page):
    problems = [f"{text.strip()!r}: {problem}" for text in code_texts(page) for problem in flag_problems(text)]
    assert problems == []


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = nav_pages()
    on_disk = sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk
    assert len(nav) == len(set(nav))


def test_the_readme_is_a_front_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_checks_catch_what_they_should(tmp_path):
    """A broken link, a missing anchor, an unknown flag: each is found (so a passing run means something)."""
    page = tmp_path / "page.md"
    page.write_text("# A `crew run` heading\n\n[ok](#a-crew-run-heading) [gone](nowhere.md) [bad](#nope)\n")
    assert len(broken_links(page)) == 2
    assert flag_problems("crew run --hostfile hosts --num_gpus 2 train.py --deepspeed") == []
    assert flag_problems("crew run --hostfil hosts train.py") == ["crew run has no option --hostfil"]
    assert flag_problems("crew plot runs --json") == ["crew plot has no option --json"]
    assert flag_problems("crew run train.py --no_such_flag")[0].startswith("--no_such_flag is no flag")
    assert flag_problems("python benchmarks/zero.py --no_such_flag") == ["benchmarks/zero.py has no --no_such_flag"]
    assert slugify(heading_text("ZeRO: `zero_optimization.stage` 0-3")) == "zero-zero_optimizationstage-0-3"
    assert slugify(heading_text("A lost node: `--min_nodes`")) == "a-lost-node-min_nodes"
