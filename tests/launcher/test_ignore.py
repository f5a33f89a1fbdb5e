""".crewignore matching (gitignore syntax) and the file walk, checked against git itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from crew.errors import CrewError
from crew.launcher.transport.ignore import DEFAULT_PATTERNS, is_ignored, list_files, parse_rule, parse_rules

# (rules, path, is_dir, excluded?) read "with RULES, PATH (a folder when is_dir) is excluded?"
CASES = [
    ("*.log", "app.log", False, True),
    ("*.log", "logs/deep/app.log", False, True),
    ("*.log", "app.log.txt", False, False),
    ("build/", "build", True, True),
    ("build/", "src/build", True, True),
    ("build/", "build", False, False),  # a file named build: the trailing / means folders only
    ("/build", "build", False, True),
    ("/build", "src/build", False, False),  # anchored by the leading /
    ("doc/*.txt", "doc/a.txt", False, True),
    ("doc/*.txt", "doc/x/a.txt", False, False),  # * does not cross /
    ("doc/*.txt", "sub/doc/a.txt", False, False),  # a middle / anchors too
    ("a?c", "abc", False, True),
    ("a?c", "a/c", False, False),
    ("**/logs", "logs", True, True),
    ("**/logs", "x/y/logs", True, True),
    ("**/logs/debug.log", "x/logs/debug.log", False, True),
    ("abc/**", "abc/x/y", False, True),
    ("abc/**", "abc", True, False),
    ("a/**/b", "a/b", False, True),
    ("a/**/b", "a/x/y/b", False, True),
    ("a/**/b", "a/xb", False, False),
    ("x**y", "x/y", False, False),  # ** away from a / is a plain *
    ("[abc].txt", "b.txt", False, True),
    ("[abc].txt", "d.txt", False, False),
    ("[!abc].txt", "d.txt", False, True),
    ("[^abc].txt", "a.txt", False, False),
    ("[a-c]x", "bx", False, True),
    ("[[:digit:]]*.csv", "7days.csv", False, True),
    ("[[:digit:]]*.csv", "days.csv", False, False),
    ("[]]x", "]x", False, True),
    ("a[/]b", "a/b", False, False),  # a class never matches /
    ("[a", "[a", False, False),  # unclosed class: matches nothing, as in git
    ("\\#notes", "#notes", False, True),
    ("#notes", "#notes", False, False),  # a comment
    ("\\!important", "!important", False, True),
    ("trailing   ", "trailing", False, True),
    ("space\\ ", "space ", False, True),
    ("space\\ ", "space", False, False),
    ("\\*", "*", False, True),
    ("\\*", "x", False, False),
    ("*.pyc\n!keep.pyc", "keep.pyc", False, False),
    ("!keep.pyc\n*.pyc", "keep.pyc", False, True),  # the last matching rule wins
    ("\n\n   \n# only comments", "anything", False, False),
]


@pytest.mark.parametrize("rules, path, is_dir, excluded", CASES)
def test_rule_table(rules, path, is_dir, excluded):
    assert is_ignored(parse_rules(rules), path, is_dir) is excluded


def test_blank_and_comment_lines_are_no_rules():
    assert parse_rule("") is None and parse_rule("# x") is None and parse_rule("   ") is None
    assert parse_rule("!") is None and parse_rule("/") is None
    assert parse_rule("x\\") is None  # a trailing backslash: matches nothing (git)
    rule = parse_rule("!build/")
    assert rule.negate and rule.dir_only


def make_tree(root: Path, files: list[str]) -> None:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def test_defaults_prune_and_crewignore_can_undo_them(tmp_path):
    make_tree(tmp_path, ["main.py", "pkg/mod.py", "pkg/__pycache__/mod.cpython-312.pyc", "x.pyc",
                         ".git/HEAD", ".venv/bin/python", "crew.egg-info/PKG-INFO", ".ruff_cache/x",
                         ".crew-sync-marker-1234", "sub/.git/config"])
    assert list_files(tmp_path) == ["main.py", "pkg/mod.py"]
    (tmp_path / ".crewignore").write_text("!.venv/\n/pkg/\n")
    assert list_files(tmp_path) == [".crewignore", ".venv/bin/python", "main.py"]


def test_excluded_folder_is_never_walked(tmp_path, monkeypatch):
    make_tree(tmp_path, ["data/big.bin", "data/keep.txt", "data/sub/x", "run.py"])
    (tmp_path / ".crewignore").write_text("data/\n!data/keep.txt\n")
    walked = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: walked.append(path) or scandir(path))
    assert list_files(tmp_path) == [".crewignore", "run.py"]  # git's rule: keep.txt stays out
    assert walked == [str(tmp_path)]


def test_symlinks_are_listed_not_followed(tmp_path):
    make_tree(tmp_path, ["real/a.txt"])
    (tmp_path / "link_dir").symlink_to("real")
    (tmp_path / "link_file").symlink_to("real/a.txt")
    (tmp_path / "dangling").symlink_to("nowhere")
    os.mkfifo(tmp_path / "fifo")  # neither file nor link: not copied
    assert list_files(tmp_path) == ["dangling", "link_dir", "link_file", "real/a.txt"]
    (tmp_path / ".crewignore").write_text("link_dir/\n")  # a link is not a folder for "dir/" rules
    assert "link_dir" in list_files(tmp_path)


def test_unreadable_folder_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every folder")
    make_tree(tmp_path, ["secret/x"])
    (tmp_path / "secret").chmod(0)
    try:
        with pytest.raises(CrewError, match="cannot list .*secret.*crewignore"):
            list_files(tmp_path)
    finally:
        (tmp_path / "secret").chmod(0o755)


# The oracle: git decides what `git ls-files --others --exclude-standard` shows for the same rules.
ORACLE_FILES = [
    "a.txt", "b.py", "b.pyc", "build/out.bin", "build/keep.txt", "src/build/x.o", "src/main.py",
    "src/util/helper.py", "src/util/data.json", "docs/readme.md", "docs/api/index.md",
    "docs/api/deep/a.md", "logs/2024/app.log", "logs/debug.log", "app.log", "foo", "dir/foo/bar",
    "sp ace.txt", "trail ", "#hash", "!bang", "[x].txt", "x.txt", "y.txt", "abc/def/ghi.c", "abc.c",
    ".env", ".hidden/secret", "nested/.env", "data/raw/1.csv", "data/raw/2.csv", "data/processed/1.csv",
    "a/b", "a/x/b", "a/x/y/b", "a/xb", "pkg/__pycache__/n.pyc", ".venv/lib/x.py", "crew.egg-info/PKG-INFO",
    "Makefile", "makefile.bak", "7z.bin", "deep/er/still/file.tmp", "deep/keep.tmp", "q?.txt", "qa.txt",
]
ORACLE_RULES = [
    "", "*.txt", "*.py\n!src/**/*.py", "build/", "build/*\n!build/keep.txt", "build/\n!build/keep.txt",
    "/build", "**/build", "src/**", "src/**/\n!src/main.py", "docs/**/*.md", "docs/*", "docs/*/",
    "logs/", "*.log\n!logs/debug.log", "**/logs/**/*.log", "foo", "foo/", "dir/foo", "/foo",
    "sp ace.txt", "sp\\ ace.txt", "trail\\ ", "trail", "trail ", "\\#hash", "#hash", "\\!bang", "!bang",
    "\\[x\\].txt", "[x].txt", "[xy].txt", "[!x].txt", "[a-c].*", "[[:alpha:]].txt", "?.txt", "q\\?.txt",
    ".*", ".*\n!.env", "**/.env", "/.env", "data/**/1.csv", "data/*/1.csv", "data/\n!data/raw/",
    "data/*\n!data/raw/\ndata/raw/2.csv", "a/**/b", "a/*/b", "**/b", "a/**", "a/x/**/b",
    "!.venv/", "!*.egg-info/", "!__pycache__/\n*.pyc", "[Mm]akefile", "*.bak\n!makefile.bak", "*/",
    "*", "*\n!*/\n!*.py", "**", "deep/**/*.tmp", "*.tmp\n!deep/*.tmp", "deep/er/", "er/still",
    "[0-9]*", "*.[ch]", "abc/", "abc*", "/*.c", "a\\", "[z-a].txt", "x**t",
]


def git_listing(repo: Path) -> list[str]:
    out = subprocess.run(["git", "-c", "core.excludesFile=/dev/null", "-c", "core.quotePath=false",
                          "ls-files", "--others", "--exclude-standard", "-z"],
                         cwd=repo, capture_output=True, check=True).stdout
    return sorted(os.fsdecode(name) for name in out.split(b"\0") if name)


@pytest.mark.skipif(not shutil.which("git"), reason="git is not installed")
def test_matches_git_on_many_patterns(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    make_tree(tmp_path, ORACLE_FILES)
    (tmp_path / "link_to_src").symlink_to("src")
    (tmp_path / ".git" / "info" / "exclude").write_text("")
    mismatches = []
    for rules in ORACLE_RULES:
        (tmp_path / ".crewignore").write_text(rules + "\n")
        (tmp_path / ".gitignore").write_text("\n".join(DEFAULT_PATTERNS) + "\n" + rules + "\n")
        ours = [name for name in list_files(tmp_path) if name != ".gitignore"]
        theirs = [name for name in git_listing(tmp_path) if name != ".gitignore"]
        if ours != theirs:
            mismatches.append(f"{rules!r}: only crew {sorted(set(ours) - set(theirs))}, "
                              f"only git {sorted(set(theirs) - set(ours))}")
    assert not mismatches, "\n".join(mismatches)
