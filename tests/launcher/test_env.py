"""Which variables reach the ranks: shell prefixes, .deepspeed_env files, --env; all literal."""

from __future__ import annotations

from pathlib import Path

import pytest

from crew.errors import CrewError
from crew.launcher.plan.env import gather_env, parse_env_flags, read_env_file


@pytest.fixture
def dirs(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    return home, cwd


def write(folder: Path, text: str, name: str = ".deepspeed_env") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def file_env(tmp_path: Path, text: str) -> dict[str, str]:
    return read_env_file(write(tmp_path, text))


SHELL = {
    "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "PYTHONHASHSEED": "0", "CUDA_HOME": "/cuda",
    "UCX_TLS": "tcp", "FI_PROVIDER": "efa",
    "HOME": "/root", "OMP_NUM_THREADS": "3", "PATH": "/bin", "LD_LIBRARY_PATH": "/lib",
    "MY_NCCL_X": "1", "nccl_lower": "1", "DS_ENV_FILE_UNUSED": "1",
}


def test_shell_variables_with_deepspeed_prefixes_only(dirs):
    home, cwd = dirs
    assert gather_env(SHELL, home, cwd) == {
        "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", "PYTHONHASHSEED": "0", "CUDA_HOME": "/cuda",
        "UCX_TLS": "tcp", "FI_PROVIDER": "efa"}


def test_precedence_shell_home_cwd_flags(dirs):
    home, cwd = dirs
    write(home, "A=home\nB=home\nC=home\nH=home\n")
    write(cwd, "B=cwd\nC=cwd\nW=cwd\nNCCL_DEBUG=WARN\n")
    env = gather_env({"NCCL_DEBUG": "INFO", "NCCL_ALGO": "ring", "A": "shell-not-exported"},
                     home, cwd, ["C=flag", "F=flag"])
    assert env == {"NCCL_DEBUG": "WARN", "NCCL_ALGO": "ring", "A": "home", "B": "cwd",
                   "C": "flag", "H": "home", "W": "cwd", "F": "flag"}


def test_later_env_flag_wins():
    assert parse_env_flags(["A=1", "A=2"]) == {"A": "2"}


def test_home_equal_to_cwd_reads_the_file(dirs):
    home, _ = dirs
    write(home, "A=1\n")
    assert gather_env({}, home, home) == {"A": "1"}


def test_no_files_no_flags(dirs):
    assert gather_env({"HOME": "/x"}, *dirs) == {}


def test_ds_env_file_renames_the_file(dirs):
    home, cwd = dirs
    write(home, "A=default-name\n")
    write(home, "B=home-custom\n", "custom.env")
    write(cwd, "C=cwd-custom\n", "custom.env")
    assert gather_env({"DS_ENV_FILE": "custom.env"}, home, cwd) == {
        "B": "home-custom", "C": "cwd-custom"}


@pytest.mark.parametrize("line, value", [
    ("V=hello world", "hello world"),
    ("V=  padded  ", "padded"),
    ('V="double quoted"', "double quoted"),
    ("V='single quoted'", "single quoted"),
    ("V=\"it's\"", "it's"),
    ("V='say \"hi\"'", 'say "hi"'),
    ("V=it's", "it's"),
    ("V='x\"", "'x\""),                                        # quotes that do not match stay
    ("V=\"\"", ""),
    ("V='", "'"),
    ("V=''quoted twice''", "'quoted twice'"),                  # only one pair comes off
    ("V=$(touch x)", "$(touch x)"),
    ("V=`touch x`", "`touch x`"),
    ("V=a; rm -rf /tmp/nothing", "a; rm -rf /tmp/nothing"),
    ("V=$HOME/${USER}", "$HOME/${USER}"),
    ("V=a=b=c", "a=b=c"),
    ("V=", ""),
    ("V=x # not a comment", "x # not a comment"),
    ("export V=exported", "exported"),
    ("export   V='x y'", "x y"),
    ("  V = spaced", "spaced"),
])
def test_env_file_values_arrive_literally(tmp_path, line, value):
    assert file_env(tmp_path, line + "\n") == {"V": value}


@pytest.mark.parametrize("flag, value", [
    ('V="double quoted"', '"double quoted"'),                  # --env values are not unquoted
    ("V='single'", "'single'"),
    ("V=$(touch x)", "$(touch x)"),
    ("V=`id`;ls", "`id`;ls"),
    ("V=a b", "a b"),
    ("V=a=b", "a=b"),
    ("V=", ""),
    ("V= keep spaces ", " keep spaces "),
])
def test_env_flag_values_arrive_literally(flag, value):
    assert parse_env_flags([flag]) == {"V": value}


def test_comments_blank_lines_and_crlf(tmp_path):
    text = "# comment\n\n   \n  # indented comment\nA=1\r\nexport B=2\n#C=3\n"
    assert file_env(tmp_path, text) == {"A": "1", "B": "2"}


def test_exported_name_starting_with_export_is_kept(tmp_path):
    assert file_env(tmp_path, "exporter=1\nEXPORT_X=2\n") == {"exporter": "1", "EXPORT_X": "2"}


@pytest.mark.parametrize("text, line, bad", [
    ("A=1\nNOEQUALS\n", 2, "NOEQUALS"),
    ("# c\n\nA=1\n1BAD=x\n", 4, "1BAD=x"),
    ("=value\n", 1, "=value"),
    ("A-B=1\n", 1, "A-B=1"),
    ("export\n", 1, "export"),
])
def test_bad_env_file_line_names_file_and_line(tmp_path, text, bad, line):
    path = write(tmp_path, text)
    with pytest.raises(CrewError) as info:
        read_env_file(path)
    message = str(info.value)
    assert f"{path}, line {line}" in message
    assert f"'{bad}'" in message
    assert "KEY=VALUE" in message


def test_bad_env_file_is_reported_by_gather_env(dirs):
    home, cwd = dirs
    path = write(cwd, "OK=1\nbroken line\n")
    with pytest.raises(CrewError, match=f"{path}, line 2"):
        gather_env({}, home, cwd)


@pytest.mark.parametrize("flag", ["NOEQ", "1BAD=x", "=x", "A B=1", ""])
def test_bad_env_flag(flag):
    with pytest.raises(CrewError) as info:
        parse_env_flags(["OK=1", flag])
    message = str(info.value)
    assert f"--env {flag}" in message
    assert "--env KEY=VALUE" in message


def test_unreadable_env_file_is_a_clear_error(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_bytes(b"A=\xff\xfe\n")
    with pytest.raises(CrewError, match=r"\.deepspeed_env cannot be read"):
        read_env_file(path)
