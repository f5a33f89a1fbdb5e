"""Hostfile text -> hosts.

Two line forms, mixable in one file:

    worker-1 slots=4                  # DeepSpeed / OpenMPI form; ssh settings from ~/.ssh/config
    10.0.0.7:2222 slots=2 gpu=0,1     # ssh port and explicit device ids on the line itself

Every error names the file, the line and the fix.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from crew.errors import HostfileError

KNOWN_KEYS = ("slots", "gpu")
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_IPV6_WITH_PORT = re.compile(r"\[([0-9A-Fa-f:.%]+)\](?::(.*))?")
_FORM = "'<host>[:<ssh port>] slots=<n> [gpu=<id>,<id>,...]'"


def is_number(text: str | None) -> bool:
    """ASCII digits only: str.isdigit() also accepts '²', which int() then rejects."""
    return bool(text) and text.isascii() and text.isdigit()


def is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Host:
    """One node: its name (as ssh reaches it), ssh port if given, and the device ids it offers."""

    name: str
    slots: tuple[int, ...]
    ssh_port: int | None = None


def read_hostfile(path: str | Path) -> list[Host]:
    """Parse the hostfile at `path`; a missing or unreadable file is a HostfileError."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise HostfileError(
            f"hostfile {path} not found (--hostfile). Check the path, or leave out --hostfile "
            "to run on this machine only."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"hostfile {path} cannot be read: {exc}") from None
    return parse_hostfile(text, str(path))


def parse_hostfile(text: str, path: str = "<hostfile>") -> list[Host]:
    """Parse hostfile text; `path` only appears in error messages."""
    hosts: list[Host] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path}, line {number}"
        host = _parse_line(line, where)
        if host.name in first_line:
            raise HostfileError(
                f"{where}: host '{host.name}' is already listed on line {first_line[host.name]}. "
                "List each host once, with all of its slots on that line."
            )
        first_line[host.name] = number
        hosts.append(host)
    if not hosts:
        raise HostfileError(
            f"hostfile {path} lists no hosts. Add one line per machine, e.g. 'worker-1 slots=4' "
            "or '10.0.0.7:2222 slots=2 gpu=0,1'."
        )
    return hosts


def _parse_line(line: str, where: str) -> Host:
    first, *fields = line.split()
    name, port = _parse_address(first, where, line)
    values = _parse_fields(fields, where, line)
    if "slots" not in values:
        example = f"slots={len(values['gpu'].split(','))}" if "gpu" in values else "slots=<n>"
        raise HostfileError(
            f"{where}: '{line}' has no slots. Add {example} (the number of processes to run on "
            f"{name}); the line form is {_FORM}."
        )
    count = _parse_slot_count(values["slots"], where)
    devices = _parse_devices(values["gpu"], count, where) if "gpu" in values else tuple(range(count))
    return Host(name=name, slots=devices, ssh_port=port)


def _parse_address(token: str, where: str, line: str) -> tuple[str, int | None]:
    if "=" in token:
        raise HostfileError(f"{where}: '{line}' does not start with a host name; expected {_FORM}.")
    if "@" in token:
        raise HostfileError(
            f"{where}: user names are not allowed in a hostfile ('{token}'). Put 'User <name>' "
            "under 'Host <host>' in ~/.ssh/config instead."
        )
    bracketed = _IPV6_WITH_PORT.fullmatch(token)
    if bracketed and is_ipv6(bracketed.group(1)):
        return bracketed.group(1), _parse_port(bracketed.group(2), where, token)
    if is_ipv6(token):  # a bare IPv6 address, no port
        return token, None
    if token.count(":") > 1:
        raise HostfileError(
            f"{where}: '{token}' is not a valid host name, '<host>:<ssh port>' or IPv6 address. "
            "Write an IPv6 address with a port as '[fe80::1]:2222'.")
    name, _, port = token.partition(":")
    if not _HOST_NAME.fullmatch(name):
        raise HostfileError(
            f"{where}: '{name}' is not a valid host name (letters, digits, '.', '-' and '_'; "
            f"it may not start with '-'). Expected {_FORM}."
        )
    return name, _parse_port(port, where, token) if ":" in token else None


def _parse_port(text: str | None, where: str, token: str) -> int | None:
    if text is None:
        return None
    if not is_number(text) or not 1 <= int(text) <= 65535:
        raise HostfileError(
            f"{where}: ssh port '{text}' in '{token}' is not a port number (1-65535). "
            "Write '<host>:<ssh port>', e.g. '10.0.0.7:2222'."
        )
    return int(text)


def _parse_fields(fields: list[str], where: str, line: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq or not key or not value:
            raise HostfileError(f"{where}: cannot read '{field}' in '{line}'; expected {_FORM}.")
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f" Did you mean '{close[0]}={value}'?" if close else ""
            raise HostfileError(
                f"{where}: unknown key '{key}' in '{line}'; known keys are slots and gpu.{hint}"
            )
        if key in values:
            raise HostfileError(f"{where}: '{key}' is given twice in '{line}'. Keep one.")
        values[key] = value
    return values


def _parse_slot_count(text: str, where: str) -> int:
    if not is_number(text) or int(text) == 0:
        raise HostfileError(
            f"{where}: slots={text} is not a positive whole number. Set slots to the number of "
            "processes (usually GPUs) to run on this host, e.g. slots=4."
        )
    return int(text)


def _parse_devices(text: str, count: int, where: str) -> tuple[int, ...]:
    ids = text.split(",")
    if not all(is_number(part) for part in ids):
        raise HostfileError(
            f"{where}: gpu={text} must be device ids separated by commas, e.g. gpu=0,1."
        )
    devices = tuple(int(part) for part in ids)
    if len(set(devices)) != len(devices):
        raise HostfileError(f"{where}: gpu={text} names a device twice. List each device once.")
    if len(devices) != count:
        raise HostfileError(
            f"{where}: gpu={text} lists {len(devices)} device(s) but slots={count}. Make them "
            f"agree: slots={len(devices)}, or list {count} device ids in gpu=."
        )
    return devices
