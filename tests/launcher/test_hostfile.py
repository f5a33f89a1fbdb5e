"""Hostfile parsing: accepted forms, and every error naming the file, the line and the fix."""

from __future__ import annotations

import pytest

from crew.errors import HostfileError
from crew.launcher.plan.hostfile import Host, parse_hostfile, read_hostfile

FILE = "cluster.hosts"


def parse(text: str) -> list[Host]:
    return parse_hostfile(text, FILE)


def error_of(text: str) -> str:
    with pytest.raises(HostfileError) as info:
        parse(text)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# accepted forms

@pytest.mark.parametrize("text, expected", [
    ("worker-1 slots=4", [Host("worker-1", (0, 1, 2, 3))]),
    ("10.0.0.7:2222 slots=2 gpu=0,1", [Host("10.0.0.7", (0, 1), 2222)]),
    ("node slots=2 gpu=6,3", [Host("node", (6, 3))]),             # gpu order is kept
    ("node gpu=4,5 slots=2", [Host("node", (4, 5))]),             # keys in any order
    ("[fe80::1]:2222 slots=1", [Host("fe80::1", (0,), 2222)]),
    ("[::1] slots=2", [Host("::1", (0, 1))]),
    ("fe80::1 slots=2", [Host("fe80::1", (0, 1))]),               # bare IPv6, no port
    ("2001:db8::7 slots=1 gpu=3", [Host("2001:db8::7", (3,))]),
    ("a_b.example.com:65535 slots=1", [Host("a_b.example.com", (0,), 65535)]),
    ("h:1 slots=1", [Host("h", (0,), 1)]),
    ("  indented   slots=1  \t", [Host("indented", (0,))]),
])
def test_single_line_forms(text, expected):
    assert parse(text) == expected


def test_comments_blank_lines_and_mixed_forms():
    text = """
# a full-line comment

worker-1 slots=2          # inline comment
   # an indented comment
10.0.0.7:2222 slots=2 gpu=2,3#no space before the comment
[fe80::5]:22 slots=1
fe80::6 slots=1 gpu=7

"""
    assert parse(text) == [
        Host("worker-1", (0, 1)),
        Host("10.0.0.7", (2, 3), 2222),
        Host("fe80::5", (0,), 22),
        Host("fe80::6", (7,)),
    ]


def test_crlf_line_endings():
    assert parse("a slots=1\r\nb slots=2\r\n") == [Host("a", (0,)), Host("b", (0, 1))]


def test_read_hostfile_reads_the_file(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nw1 slots=1\nw2:2200 slots=2 gpu=1,0\n")
    assert read_hostfile(path) == [Host("w1", (0,)), Host("w2", (1, 0), 2200)]
    assert read_hostfile(str(path)) == read_hostfile(path)


# --------------------------------------------------------------------------------------------
# errors: (hostfile text, line number of the error, words the message must contain)

LINE_ERRORS = [
    # missing or bad slots
    ("node1", 1, ["has no slots", "slots=<n>"]),
    ("ok slots=1\nnode2 gpu=0,1,2", 2, ["has no slots", "slots=3"]),
    ("node1 gpu=5", 1, ["has no slots", "slots=1"]),
    ("node1 slots=0", 1, ["slots=0", "positive whole number"]),
    ("node1 slots=-1", 1, ["slots=-1", "positive whole number"]),
    ("node1 slots=abc", 1, ["slots=abc", "positive whole number"]),
    ("node1 slots=1.5", 1, ["slots=1.5", "positive whole number"]),
    ("node1 slots=²", 1, ["slots=²", "positive whole number"]),
    ("node1 slots=", 1, ["cannot read 'slots='"]),
    # gpu ids
    ("node1 slots=2 gpu=0", 1, ["gpu=0", "lists 1 device", "slots=2", "slots=1"]),
    ("node1 slots=1 gpu=0,1,2", 1, ["lists 3 device", "slots=1", "slots=3"]),
    ("node1 slots=2 gpu=1,1", 1, ["gpu=1,1", "twice"]),
    ("node1 slots=2 gpu=a,b", 1, ["gpu=a,b", "separated by commas", "gpu=0,1"]),
    ("node1 slots=2 gpu=0,", 1, ["gpu=0,", "separated by commas"]),
    ("node1 slots=1 gpu=-1", 1, ["gpu=-1", "separated by commas"]),
    # keys
    ("node1 slot=8", 1, ["unknown key 'slot'", "Did you mean 'slots=8'"]),
    ("node1 slots=2 gpus=0,1", 1, ["unknown key 'gpus'", "Did you mean 'gpu=0,1'"]),
    ("node1 slots=2 color=red", 1, ["unknown key 'color'", "slots and gpu"]),
    ("node1 slots=2 slots=2", 1, ["'slots' is given twice", "Keep one"]),
    ("node1 slots=2 gpu=0,1 gpu=0,1", 1, ["'gpu' is given twice"]),
    # unreadable lines
    ("node1 slots", 1, ["cannot read 'slots'", "slots=<n>"]),
    ("node1 4", 1, ["cannot read '4'"]),
    ("\n\nslots=4", 3, ["does not start with a host name", "<host>"]),
    ("=x slots=1", 1, ["does not start with a host name"]),
    # user@host, ssh option injection, bad names
    ("root@node1 slots=1", 1, ["user names are not allowed", "root@node1", "~/.ssh/config"]),
    ("-oProxyCommand=x slots=1", 1, ["host name"]),
    ("-bad slots=1", 1, ["'-bad' is not a valid host name", "may not start with '-'"]),
    ("-bad:22 slots=1", 1, ["'-bad' is not a valid host name"]),
    ("-1::2 slots=1", 1, ["'-1::2'", "host name"]),               # IPv6-shaped, still an option
    ("no/slash slots=1", 1, ["'no/slash' is not a valid host name"]),
    # ssh ports
    ("node1:0 slots=1", 1, ["port '0'", "1-65535"]),
    ("node1:70000 slots=1", 1, ["port '70000'", "1-65535"]),
    ("node1:ssh slots=1", 1, ["port 'ssh'", "1-65535"]),
    ("node1: slots=1", 1, ["port ''", "1-65535"]),
    ("[fe80::1]:0 slots=1", 1, ["port '0'", "1-65535"]),
    ("[fe80::1]:x slots=1", 1, ["port 'x'", "1-65535"]),
]


@pytest.mark.parametrize("text, line, words", LINE_ERRORS,
                         ids=[case[0].strip().splitlines()[-1] for case in LINE_ERRORS])
def test_line_errors_name_file_line_and_fix(text, line, words):
    message = error_of(text)
    assert FILE in message
    assert f"line {line}" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("text, first, second", [
    ("a slots=1\nb slots=1\na slots=2", 1, 3),
    ("# c\nnode:22 slots=1\n\nnode:2222 slots=1", 2, 4),      # same host, other ssh port
    ("[fe80::1]:22 slots=1\nfe80::1 slots=1", 1, 2),
])
def test_duplicate_host_names_both_lines(text, first, second):
    message = error_of(text)
    assert FILE in message
    assert f"line {second}" in message
    assert f"already listed on line {first}" in message
    assert "List each host once" in message


@pytest.mark.parametrize("text", ["", "\n\n   \n", "# only\n  # comments\n", "#a slots=1"])
def test_no_hosts(text):
    message = error_of(text)
    assert FILE in message
    assert "lists no hosts" in message
    assert "slots=" in message                                 # shows an example line


def test_missing_file_names_flag(tmp_path):
    missing = tmp_path / "nope" / "hosts"
    with pytest.raises(HostfileError) as info:
        read_hostfile(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "not found" in message
    assert "--hostfile" in message


def test_directory_is_a_hostfile_error(tmp_path):
    with pytest.raises(HostfileError, match="cannot be read"):
        read_hostfile(tmp_path)


def test_error_from_read_hostfile_names_the_real_path(tmp_path):
    path = tmp_path / "my_hosts"
    path.write_text("good slots=1\nbad slots=0\n")
    with pytest.raises(HostfileError) as info:
        read_hostfile(path)
    assert f"hostfile {path}, line 2" in str(info.value)
