"""`crew sync` and `crew run --sync`: copy the working directory (or named paths) to every node.

Each folder or file goes to the same absolute path on every node reached over ssh, with the same ssh
settings `crew run` uses (runners.SSH_OPTIONS, --ssh_args, the hostfile's ports). A folder's files are
those `ignore.list_files` gives: everything but what its `.crewignore` (gitignore syntax) and the
built-in rules exclude. Copies use rsync where it is installed here (and on the node: otherwise tar
for that node), else tar over ssh.

Nodes that already see the same files (this machine itself, or a shared filesystem such as NFS) are
found with a marker file of a random name and skipped: copying files onto themselves can truncate
them, and is wasted work anyway.

A sync only adds and updates files: it never deletes a file on a node, even one that is gone here.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from crew.errors import LaunchError
from crew.launcher.transport import runners
from crew.launcher.transport.ignore import SYNC_MARKER_PREFIX, list_files

STDERR_LINES = 6  # the last lines of a failing command's stderr that the error quotes
_NOT_SSH = re.compile("No such file or directory|No module named")


@dataclass(frozen=True)
class Item:
    """One copy: `files` (posix, relative to `folder`) go to the same `folder` on every node."""

    folder: str  # absolute
    files: tuple[str, ...]
    size: int  # bytes


@dataclass
class NodeResult:
    host: str
    port: int | None
    files: int = 0
    size: int = 0
    seconds: float = 0.0
    tools: list[str] = field(default_factory=list)
    changed: int | None = None  # files rsync reported as sent (None: not known, e.g. tar)
    shared: list[str] = field(default_factory=list)  # folders this node sees as they are here
    error: str | None = None


class CopyFailed(Exception):
    def __init__(self, what: str, code: int, stderr: str):
        super().__init__(what)
        self.what, self.code, self.stderr = what, code, stderr


def sync_nodes(nodes: Sequence[tuple[str, int | None]], paths: Sequence[str], cwd: Path,
               ssh_args: Sequence[str], tool: str, say: Callable[[str], None]) -> None:
    """Copy `paths` (default: `cwd`) to the same absolute paths on `nodes`; raise LaunchError naming
    every node that failed, once all the others are done."""
    roots = [_existing(name, cwd) for name in paths] or [Path(cwd)]
    if not nodes:
        say("nothing to copy: the plan runs on this machine only.")
        return
    if tool not in ("auto", "rsync", "tar"):
        raise LaunchError(f"--sync_tool {tool}: use auto, rsync or tar.")
    if tool == "rsync" and not shutil.which("rsync"):
        raise LaunchError("--sync_tool rsync: rsync is not installed on this machine. Install it "
                          "(Debian/Ubuntu: apt-get install rsync), or use --sync_tool tar.")
    use_rsync = tool == "rsync" or (tool == "auto" and shutil.which("rsync") is not None)
    items = resolve_items(roots)
    unique_nodes = list(dict.fromkeys((host, port) for host, port in nodes))
    lock = threading.Lock()

    def report(text: str) -> None:
        with lock:
            say(text)

    total = sum(len(item.files) for item in items)
    where = ", ".join(item.folder for item in items)
    report(f"syncing {total} file(s) ({_mb(sum(item.size for item in items))}) from {where} to "
           f"{len(unique_nodes)} node(s)")
    markers = _make_markers(items)
    try:
        with ThreadPoolExecutor(max_workers=min(32, len(unique_nodes))) as pool:
            results = list(pool.map(
                lambda node: _sync_node(node[0], node[1], items, markers, tuple(ssh_args), use_rsync, report),
                unique_nodes))
    finally:
        _remove(markers)
    failed = [r for r in results if r.error]
    if failed:
        raise LaunchError(f"crew sync: could not copy to {len(failed)} of {len(results)} node(s) "
                          "(the others are done):\n" + "\n".join(r.error for r in failed))


def _existing(name: str, cwd: Path) -> Path:
    """`name` resolved against `cwd` (not following links), which must exist."""
    path = Path(os.path.abspath(os.path.join(cwd, name)))
    if not (path.exists() or path.is_symlink()):
        raise LaunchError(f"crew sync: {name} does not exist (looked in {cwd}). Name files or folders "
                          "that exist here; each is copied to the same path on every node.")
    return path


def resolve_items(roots: Sequence[Path]) -> list[Item]:
    """What to copy: a folder's files (as its .crewignore says), or a file (or link) alone."""
    items: dict[tuple[str, tuple[str, ...]], Item] = {}
    for path in roots:
        if path.is_dir():
            folder, files = path, tuple(list_files(path))
        else:
            folder, files = path.parent, (path.name,)
        size = sum(_size(folder / f) for f in files)
        items.setdefault((str(folder), files), Item(str(folder), files, size))
    return list(items.values())


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _make_markers(items: list[Item]) -> dict[str, str]:
    """A new empty file of a random name in each folder: a node that sees it shares the folder."""
    markers: dict[str, str] = {}
    try:
        for folder in dict.fromkeys(item.folder for item in items):
            marker = os.path.join(folder, f"{SYNC_MARKER_PREFIX}{secrets.token_hex(8)}")
            with open(marker, "x"):
                pass
            markers[folder] = marker
    except OSError as exc:
        _remove(markers)
        raise LaunchError(
            f"crew sync: cannot create a marker file in {exc.filename} ({exc.strerror}). crew writes "
            "one there for a moment to tell which nodes share the folder (and must not get a copy "
            "onto itself); make the folder writable, or copy from a writable one.") from exc
    return markers


def _remove(markers: dict[str, str]) -> None:
    for marker in markers.values():
        try:
            os.unlink(marker)
        except OSError:
            pass


def _sync_node(host: str, port: int | None, items: list[Item], markers: dict[str, str],
               ssh_args: tuple[str, ...], use_rsync: bool, report: Callable[[str], None]) -> NodeResult:
    result = NodeResult(host, port)
    try:
        shared = _shared_folders(host, port, markers, ssh_args)
        result.shared = [folder for folder in markers if folder in shared]
        todo = [item for item in items if item.folder not in shared]
        if not todo:
            report(f"{host}: sees the same files as this machine (shared filesystem or this machine): "
                   "nothing to copy")
            return result
        for folder in result.shared:
            report(f"{host}: sees {folder} as this machine does (shared filesystem): not copied")
        started = time.monotonic()
        for item in todo:
            if use_rsync:
                try:
                    changed = _rsync(host, port, item, ssh_args)
                    result.changed = (result.changed or 0) + changed if changed is not None else None
                    _add_tool(result, "rsync")
                except CopyFailed as exc:
                    if not _rsync_missing(exc):
                        raise
                    report(f"{host}: rsync is not installed there; copying with tar instead (install "
                           "rsync there for faster repeat syncs)")
                    use_rsync = False
            if not use_rsync:
                _tar(host, port, item, ssh_args)
                _add_tool(result, "tar")
            result.files += len(item.files)
            result.size += item.size
        result.seconds = time.monotonic() - started
        changed = f" ({result.changed} new or changed)" if result.changed is not None else ""
        report(f"{host}: copied {result.files} files ({_mb(result.size)}) with {' and '.join(result.tools)} "
               f"in {result.seconds:.1f} s{changed}")
    except CopyFailed as exc:
        result.error = _describe_failure(host, port, exc)
    return result


def _add_tool(result: NodeResult, tool: str) -> None:
    if tool not in result.tools:
        result.tools.append(tool)


def _ssh_command(port: int | None, ssh_args: Sequence[str]) -> list[str]:
    """The ssh client and options `crew run` uses (runners.ssh_argv), without the host and command."""
    return ["ssh", *runners.SSH_OPTIONS, *ssh_args, *(["-p", str(port)] if port else [])]


def _run(what: str, argv: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, stdin=None if stdin is not None
                              else subprocess.DEVNULL)
    except OSError as exc:
        raise CopyFailed(what, 127, f"{argv[0]}: {exc.strerror}") from exc
    return done


def _shared_folders(host: str, port: int | None, markers: dict[str, str],
                    ssh_args: tuple[str, ...]) -> set[str]:
    """The folders whose marker file `host` sees: one ssh for all of them."""
    folders = list(markers)
    command = "; ".join(f"if test -e {shlex.quote(markers[f])}; then echo crew-sync-same; "
                        "else echo crew-sync-other; fi" for f in folders)
    done = _run("ssh (checking for a shared filesystem)", runners.ssh_argv(host, port, ssh_args, command))
    answers = [word for word in done.stdout.decode(errors="replace").split() if word.startswith("crew-sync-")]
    if done.returncode != 0 or len(answers) != len(folders):
        raise CopyFailed("ssh (checking for a shared filesystem)", done.returncode,
                         done.stderr.decode(errors="replace"))
    return {folder for folder, answer in zip(folders, answers) if answer == "crew-sync-same"}


def _remote_path(host: str, path: str) -> str:
    return f"[{host}]:{path}" if ":" in host else f"{host}:{path}"


def _file_list(item: Item) -> bytes:
    return b"".join(os.fsencode(name) + b"\0" for name in item.files)


def _rsync(host: str, port: int | None, item: Item, ssh_args: tuple[str, ...]) -> int | None:
    """Copy one item with rsync (its --rsync-path makes the folder first); the count of files sent."""
    destination = shlex.quote(item.folder)
    argv = ["rsync", "-a", "--stats", "--files-from=-", "--from0", "--protect-args",
            "-e", shlex.join(_ssh_command(port, ssh_args)),
            f"--rsync-path=mkdir -p {destination} && rsync",
            item.folder.rstrip("/") + "/", _remote_path(host, item.folder.rstrip("/") + "/")]
    done = _run("rsync", argv, _file_list(item))
    if done.returncode != 0:
        raise CopyFailed("rsync", done.returncode, done.stderr.decode(errors="replace"))
    sent = re.search(r"Number of regular files transferred: ([\d,.]+)", done.stdout.decode(errors="replace"))
    return int(re.sub(r"\D", "", sent.group(1))) if sent else None


def _rsync_missing(exc: CopyFailed) -> bool:
    """rsync ran here but the node has none: its shell said so (exit 127, or rsync's code 12)."""
    said = re.search(r"rsync: (command )?not found|rsync: No such file", exc.stderr)
    return exc.code == 127 or (exc.code == 12 and said is not None)


def _tar(host: str, port: int | None, item: Item, ssh_args: tuple[str, ...]) -> None:
    """tar here, piped over ssh into tar there (which makes the folder first)."""
    folder = shlex.quote(item.folder)
    remote = f"mkdir -p {folder} && tar -xf - -C {folder}"
    with tempfile.TemporaryFile() as names, tempfile.TemporaryFile() as tar_err:
        names.write(_file_list(item))
        names.seek(0)
        try:
            tar = subprocess.Popen(["tar", "-C", item.folder, "-cf", "-", "--null", "-T", "-"],
                                   stdin=names, stdout=subprocess.PIPE, stderr=tar_err)
        except OSError as exc:
            raise CopyFailed("tar", 127, f"tar: {exc.strerror}") from exc
        try:
            ssh = subprocess.Popen(runners.ssh_argv(host, port, ssh_args, remote), stdin=tar.stdout,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            tar.kill()
            tar.wait()
            raise CopyFailed("ssh", 127, f"ssh: {exc.strerror}") from exc
        finally:
            tar.stdout.close()  # ssh holds it now; tar gets SIGPIPE if ssh dies
        _, ssh_err = ssh.communicate()
        tar_code = tar.wait()
        tar_err.seek(0)
        local_err = tar_err.read().decode(errors="replace")
    if ssh.returncode != 0:
        raise CopyFailed("ssh ... tar -x", ssh.returncode, ssh_err.decode(errors="replace"))
    if tar_code != 0:
        raise CopyFailed("tar -c (here)", tar_code, local_err)


def _describe_failure(host: str, port: int | None, exc: CopyFailed) -> str:
    lines = [line for line in exc.stderr.splitlines() if line.strip()][-STDERR_LINES:]
    text = f"  {host}: {exc.what} failed (exit code {exc.code})"
    text += "".join(f"\n    {line}" for line in lines) if lines else " with no message"
    # ssh's own failures; runners' fixes for a missing Python or module do not apply to a copy
    fix = runners.ssh_fix([line for line in lines if not _NOT_SSH.search(line)], host, port)
    if fix is None and exc.code == 255:
        fix = f"ssh to {host} failed. Check that 'ssh {f'-p {port} ' if port else ''}{host} true' works."
    if fix is None and any("No space left" in line for line in lines):
        fix = f"the disk on {host} is full. Free space there, or add large files to .crewignore."
    return text + (f"\n    fix: {fix}" if fix else "")
