"""Checksums: a save hashes every file as it writes it (layout.HashingWriter, no second read) and
lists them in the tag's manifest, "files": {path in the tag: {"bytes": n, "crc32": hex}}; a load
verifies each file before it reads it. A checkpoint from a crew before checksums has no "files" and
loads unchecked. Ranks that read the same file on one machine (the replicated parts, at stages 0-2)
share the work out: each file is hashed once per machine, not once per rank."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from crew.runtime import comm
from crew.runtime.checkpoint.collective import all_gather
from crew.runtime.checkpoint.layout import CHECKSUM, MANIFEST, CheckpointError, Crc32, manifest_damaged, other_tags

_CHUNK = 1 << 20


class Verifier:
    """Checks the files of one tag folder against its manifest, each once."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.files = manifest.get("files")  # None: saved by a crew without checksums
        self.checked: set[str] = set()
        if self.files is not None and not (isinstance(self.files, dict) and all(
                isinstance(entry, dict) and isinstance(entry.get("bytes"), int) for entry in self.files.values())):
            raise CheckpointError(manifest_damaged(folder / MANIFEST, 'has a "files" entry that is not '
                                                   '{"bytes": <size>, "crc32": <hex>}'))

    def check(self, path: Path) -> None:
        """CheckpointError unless `path` has the size and checksum its save recorded."""
        if self.files is None:
            return
        name = path.relative_to(self.folder).as_posix()
        if name in self.checked:
            return
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(self._message(path, f"is not one of the files that checkpoint "
                                                      f"'{self.folder.name}' lists in its {MANIFEST}"))
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise CheckpointError(self._message(path, f"cannot be read ({exc.strerror})")) from None
        if size != entry["bytes"]:
            raise CheckpointError(self._message(path, f"is damaged: it has {size} bytes, the save wrote "
                                                      f"{entry['bytes']}"))
        expected = entry.get(CHECKSUM)
        if expected is not None and file_digest(path) != expected:
            raise CheckpointError(self._message(path, f"is damaged: its {CHECKSUM} differs from the one "
                                                      "its save recorded (the bytes changed on disk or in a copy)"))
        self.checked.add(name)

    def checked_elsewhere(self, path: Path) -> None:
        """Another rank checks `path` (the same file), before any rank reads it."""
        self.checked.add(path.relative_to(self.folder).as_posix())

    def _message(self, path: Path, problem: str) -> str:
        return (f"{path} {problem}. Restore it from a copy of checkpoint '{self.folder.name}', or load "
                f"another complete tag with load_checkpoint(..., tag=...) "
                f"({other_tags(self.folder.parent, but=self.folder.name)}).")


def file_digest(path: Path) -> str:
    digest, buffer = Crc32(), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def identity(path: Path, shared: bool = False) -> tuple:
    """(machine, device, inode, name, size): the same for every rank that reads this very file. The name
    too: some network filesystems (FUSE, 9p) give different files the same inode number. A `shared` file
    (a ZeRO-3 shard: such a checkpoint is on a filesystem every node shares) is one file for every rank
    of every node: it is checked once in the whole job."""
    status = path.stat()
    if shared:
        return "shared", 0, 0, path.name, status.st_size
    return _machine(), status.st_dev, status.st_ino, path.name, status.st_size


def share_out(identities: list[tuple]) -> list[bool]:
    """For each file this rank reads (by identity), whether this rank checks it: a file that several
    ranks read is checked by one of them, spread by bytes. A collective; every rank computes the
    same answer."""
    readers: dict[tuple, list[int]] = {}
    for rank, files in enumerate(all_gather(identities)):
        for file in files:
            readers.setdefault(file, []).append(rank)
    hashed: dict[int, int] = {}
    checker = {}
    for file in sorted(readers, key=lambda file: (-file[-1], file)):  # the largest first
        checker[file] = min(readers[file], key=lambda rank: (hashed.get(rank, 0), rank))
        hashed[checker[file]] = hashed.get(checker[file], 0) + file[-1]
    return [checker[file] == comm.get_rank() for file in identities]


@functools.cache
def _machine() -> str:
    """The running kernel: device and inode numbers name a file only within one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: no file is known to be another rank's too
        return f"process {os.getpid()} on {socket.gethostname()}"
