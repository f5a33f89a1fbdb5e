"""Which files of a folder `crew sync` copies (and the doctor compares): everything but what `.crewignore` excludes.

`.crewignore` uses .gitignore syntax: `#` comments, `!` negation, a trailing `/` for folders only, a `/` at
the start or in the middle to anchor a pattern to the folder, `*`, `?`, `[a-z]`, `**/`, `/**` and `/**/`.
Built-in rules (`.git/`, `__pycache__/`, `.venv/`, ...) come first, so a `.crewignore` line like `!.venv/`
can undo one; the last matching rule wins. As in git, a file inside an excluded folder stays excluded:
ignored folders are never walked. Each pattern becomes one regular expression over the path relative to
the folder, in posix form.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from crew.errors import CrewError

IGNORE_FILE = ".crewignore"
SYNC_MARKER_PREFIX = ".crew-sync-marker-"  # sync.py's marker files; never copied nor compared
DEFAULT_PATTERNS = (".git/", "__pycache__/", "*.pyc", ".venv/", ".pytest_cache/", ".mypy_cache/",
                    ".ruff_cache/", "*.egg-info/", f"{SYNC_MARKER_PREFIX}*")

_POSIX_CLASSES = {"alnum": "a-zA-Z0-9", "alpha": "a-zA-Z", "blank": " \\t", "cntrl": "\\x00-\\x1f\\x7f",
                  "digit": "0-9", "graph": "!-~", "lower": "a-z", "print": " -~",
                  "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"), "space": " \\t\\n\\r\\f\\v",
                  "upper": "A-Z", "xdigit": "0-9A-Fa-f"}


@dataclass(frozen=True)
class Rule:
    pattern: str  # the line as written (for messages)
    regex: re.Pattern
    negate: bool
    dir_only: bool

    def matches(self, path: str, is_dir: bool) -> bool:
        return (is_dir or not self.dir_only) and self.regex.fullmatch(path) is not None


def _trim_trailing_spaces(line: str) -> str:
    """Drop trailing spaces, except those escaped with a backslash (git's rule)."""
    end, i = 0, 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line):
            i += 2
            end = i
        else:
            i += 1
            if line[i - 1] != " ":
                end = i
    return line[:end]


def _bracket(pattern: str, start: int) -> tuple[str, int] | None:
    """The regex for the class `[...]` opening at `start`, and the index after it; None if unclosed."""
    i = start + 1
    negate = i < len(pattern) and pattern[i] in "!^"
    i += negate
    items, first = [], True
    while i < len(pattern):
        char = pattern[i]
        if char == "]" and not first:
            body = "".join(items)
            if not body:  # only reversed ranges: git's class matches no character then
                return ("[^/]" if negate else "(?!)"), i + 1
            return (f"[^/{body}]" if negate else f"(?!/)[{body}]"), i + 1
        first = False
        if char == "[" and pattern.startswith("[:", i):
            close = pattern.find(":]", i + 2)
            name = pattern[i + 2:close] if close > 0 else ""
            if name in _POSIX_CLASSES:
                items.append(_POSIX_CLASSES[name])
                i = close + 2
                continue
        if char == "\\" and i + 1 < len(pattern):
            i += 1
            char = pattern[i]
        if pattern.startswith("-", i + 1) and i + 2 < len(pattern) and pattern[i + 2] != "]":
            high = pattern[i + 2]
            skip = 3
            if high == "\\" and i + 3 < len(pattern):
                high, skip = pattern[i + 3], 4
            items.append(f"{re.escape(char)}-{re.escape(high)}" if char <= high else "")
            i += skip
            continue
        items.append(re.escape(char))
        i += 1
    return None


def _translate(pattern: str) -> str | None:
    """The regex body for a glob whose `*`, `?` and `[...]` never match `/`; None if it can match nothing."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "*":
            j = i
            while j < len(pattern) and pattern[j] == "*":
                j += 1
            at_start = i == 0 or pattern[i - 1] == "/"
            if j - i >= 2 and at_start and j == len(pattern):
                out.append(".*")  # "abc/**" (everything inside) or a lone "**"
            elif j - i >= 2 and at_start and pattern[j] == "/":
                out.append("(?:.*/)?")  # "**/x" and "a/**/b": zero or more folders
                j += 1
            else:
                out.append("[^/]*")
            i = j
        elif char == "?":
            out.append("[^/]")
            i += 1
        elif char == "[":
            found = _bracket(pattern, i)
            if found is None:
                return None  # git: an unclosed class matches nothing
            out.append(found[0])
            i = found[1]
        elif char == "\\":
            if i + 1 == len(pattern):
                return None  # git: a trailing backslash matches nothing
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(char))
            i += 1
    return "".join(out)


def parse_rule(line: str) -> Rule | None:
    """One line of a .crewignore as a Rule; None for blank lines, comments and patterns matching nothing."""
    text = _trim_trailing_spaces(line.removesuffix("\n").removesuffix("\r"))
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    body = text[1:] if negate else text
    dir_only = body.endswith("/")
    body = body[:-1] if dir_only else body
    anchored = "/" in body
    body = body[1:] if body.startswith("/") else body
    if not body:
        return None
    regex = _translate(body)
    if regex is None:
        return None
    if not anchored:
        regex = "(?:.*/)?" + regex
    return Rule(text, re.compile(regex, re.DOTALL), negate, dir_only)


def parse_rules(text: str) -> list[Rule]:
    return [rule for line in text.removeprefix("\ufeff").split("\n") if (rule := parse_rule(line))]


def load_rules(root: Path) -> list[Rule]:
    """The built-in rules, then those of root/.crewignore when it exists."""
    rules = parse_rules("\n".join(DEFAULT_PATTERNS))
    path = Path(root, IGNORE_FILE)
    try:
        rules += parse_rules(path.read_text(encoding="utf-8", errors="surrogateescape"))
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CrewError(f"cannot read {path}: {exc.strerror}.") from exc
    return rules


def is_ignored(rules: list[Rule], path: str, is_dir: bool) -> bool:
    """Whether the last rule matching `path` (posix, relative to the root) excludes it."""
    for rule in reversed(rules):
        if rule.matches(path, is_dir):
            return not rule.negate
    return False


def list_files(root: Path) -> list[str]:
    """Sorted posix paths, relative to `root`, of the files and symlinks not excluded by the rules.

    Ignored folders are pruned, not walked; symlinked folders are listed as links, not followed.
    """
    rules = load_rules(root)
    found: list[str] = []

    def walk(folder: str, prefix: str) -> None:
        try:
            with os.scandir(folder) as entries:
                listed = list(entries)
        except OSError as exc:
            raise CrewError(f"cannot list {folder}: {exc.strerror}. Add it to {Path(root, IGNORE_FILE)} "
                            "(e.g. '/name/') if it need not be copied.") from exc
        for entry in listed:
            path = prefix + entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_ignored(rules, path, is_dir):
                continue
            if is_dir:
                walk(entry.path, path + "/")
            elif entry.is_symlink() or entry.is_file(follow_symlinks=False):
                found.append(path)

    walk(str(root), "")
    return sorted(found)
