"""What a tag folder holds and how its files are written and read: the file names, CheckpointError,
atomic writes that hash what they write, and reading a tag's manifest, `latest` and model state
files."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any

import torch

from crew.errors import CrewError
from crew.runtime.checkpoint.state import merge_state

MANIFEST = "crew_checkpoint.json"
MODEL_STATES = "model_states.{part}-of-{parts}.pt"
CLIENT_STATE = "client_state.pt"
ENGINE_STATE = "engine_state.pt"  # stage 3: what is not in the sharded folder
SHARDED_DIR = "sharded"
CREW_STATE = "crew_state.pt"  # DeepSpeed's layout: what crew keeps beyond DeepSpeed's files (deepspeed_writing.py)
# the manifest's "format": DeepSpeed 0.19.8's files (crew >= 0.2); crew 0.1's own files at stages 0-2, and at 3
DEEPSPEED_LAYOUT, REPLICATED, SHARDED = "deepspeed", "replicated", "sharded"
CHECKSUM = "crc32"  # the manifest's "files": {name: {"bytes": n, "crc32": hex}}; see docs/checkpoints.md
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")
_RENAME_EXCHANGE = 2
# Writes this large (tensor storages) are hashed on another core while the kernel copies them: the
# checksum then costs little more than the write itself where a core is free. A thread a write, not a
# pool: a pool's thread is gone in a forked child, and a pool refuses work at interpreter shutdown.
_OVERLAP_BYTES = 1 << 20


class Crc32:
    """zlib's CRC-32 with hashlib's interface. A checksum finds damage (bits flipped on disk or in a
    copy, a truncated file), not tampering: crc32 does that at about 6 GB/s here, sha256 at 1.8 GB/s."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hash_beside(digest: Crc32, data) -> threading.Thread | None:
    """Hash `data` on another thread while this one writes it (zlib and the write both release the GIL);
    None when no thread can start (the interpreter is shutting down): then it is hashed here after."""
    thread = threading.Thread(target=digest.update, args=(data,), name="crew-checkpoint-crc32", daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return None
    return thread


def _join(thread: threading.Thread) -> None:
    """Wait for the hashing thread even through a Ctrl-C: it reads a buffer that is freed once we return."""
    interrupted = None
    while thread.is_alive():
        try:
            thread.join()
        except BaseException as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


class CheckpointError(CrewError):
    """A checkpoint that cannot be written or read; says which file and what differs."""


# -- files --------------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """A file wrapper that hashes the bytes as they are written (the checksum in the manifest, with
    no second read of the file) and keeps the OSError of a failed write (disk full, quota), which
    torch's serialiser would otherwise turn into an opaque 'enforce fail ... unexpected pos'."""

    def __init__(self, handle):
        self.handle, self.error = handle, None
        self.digest, self.size = Crc32(), 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        beside = _hash_beside(self.digest, data) if size >= _OVERLAP_BYTES else None
        try:
            written = self.handle.write(data)
        except Exception as exc:
            self.error = exc
            raise
        finally:
            if beside is not None:
                _join(beside)  # `data` is torch's buffer, valid only during this call
        if beside is None:
            self.digest.update(data)
        self.size += size
        return written

    def flush(self) -> None:
        self.handle.flush()

    def tell(self) -> int:
        return self.handle.tell()

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()

    def entry(self) -> dict:
        """The file's line in the manifest's "files"."""
        return {"bytes": self.size, CHECKSUM: self.digest.hexdigest()}


def write_atomic(path: Path, data: bytes | None = None, obj: Any = None, pickle_module: Any = None) -> dict:
    """Write under a temporary name, fsync, rename: `path` is either the old or the new file.
    Returns its size and checksum. `pickle_module`: torch.save's (deepspeed_writing.DEEPSPEED_PICKLE)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            writer = HashingWriter(handle)
            try:
                if obj is None:
                    writer.write(data)
                elif pickle_module is None:
                    torch.save(obj, writer)
                else:
                    torch.save(obj, writer, pickle_module=pickle_module)
                handle.flush()
            except Exception:
                if writer.error is not None:
                    raise writer.error from None
                raise
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return writer.entry()


def read(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or corrupted file fails in many ways inside torch
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
                              "it is truncated, corrupted or not a crew checkpoint") from None


def swap_into_place(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`; an existing `final` is exchanged atomically, then removed."""
    if not final.exists():
        os.rename(staging, final)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, bytes(staging), -100, bytes(final), _RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), f"cannot replace {final} atomically")
    shutil.rmtree(staging, ignore_errors=True)  # holds the old checkpoint now


# -- reading a tag ------------------------------------------------------------------------------

def complete_tags(save_dir: Path) -> list[str]:
    """The tags in save_dir whose save completed (they have a manifest), oldest first."""
    def saved_at(folder: Path) -> float:
        try:
            return (folder / MANIFEST).stat().st_mtime
        except OSError:
            return 0.0
    try:
        found = [p for p in Path(save_dir).iterdir() if (p / MANIFEST).is_file()]
    except OSError:
        return []
    return [p.name for p in sorted(found, key=saved_at)]


def other_tags(save_dir: Path, but: str | None = None) -> str:
    """The complete tags in save_dir (but `but`), for a message that names save_dir or a path in it."""
    tags = [tag for tag in complete_tags(save_dir) if tag != but]
    other = "other " if but else ""
    if not tags:
        return f"the save dir holds no {other}complete tag"
    return f"{other}complete tags in the save dir, oldest first: {', '.join(tags)}"


def read_latest(load_dir: Path) -> str | None:
    """The tag `latest` names; None when there is no `latest` (nothing to load, as in DeepSpeed). A
    `latest` that is empty, unreadable or holds no tag name is a CheckpointError naming it and the
    complete tags: loading nothing would restart training from step 0 beside a good checkpoint."""
    latest = Path(load_dir) / "latest"
    try:
        with open(latest, "rb") as handle:
            tag = handle.read(4096).decode("utf-8", "replace").strip()  # a tag is short; garbage may not be
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CheckpointError(_latest_message(latest, f"cannot be read ({exc.strerror})")) from None
    if not tag:
        raise CheckpointError(_latest_message(latest, "is empty"))
    if not TAG.fullmatch(tag):
        raise CheckpointError(_latest_message(latest, f"does not hold a tag name ({tag[:80]!r})"))
    return tag


def _latest_message(latest: Path, what: str) -> str:
    tags = complete_tags(latest.parent)
    fix = (f"write the tag to resume from into it (echo {tags[-1]} > {shlex.quote(str(latest))}), or pass "
           f"load_checkpoint(..., tag='{tags[-1]}')" if tags else "remove it to start from scratch")
    return (f"{latest} {what}: it should name the checkpoint tag to load ({other_tags(latest.parent)}). "
            f"To fix it, {fix}.")


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    manifest = _parsed(path) if path.is_file() else {}
    manifest.setdefault("format", REPLICATED)  # checkpoints from before ZeRO stages 1-3
    manifest.setdefault("zero_stage", 0)
    if manifest["format"] not in (DEEPSPEED_LAYOUT, REPLICATED, SHARDED):
        raise CheckpointError(f"{path}: unknown checkpoint format "
                              f"{manifest['format']!r}; it was written by a newer crew, upgrade crew")
    return manifest


def _parsed(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        problem = f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
    except UnicodeDecodeError:
        problem = "is not JSON text (it holds binary data)"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
    else:
        if isinstance(manifest, dict):
            return manifest
        problem = f"holds a JSON {type(manifest).__name__}, not the object crew writes"
    raise CheckpointError(manifest_damaged(path, problem))


def manifest_damaged(path: Path, problem: str) -> str:
    folder = path.parent
    return (f"{path} {problem}. It is crew's manifest of checkpoint '{folder.name}', written when every "
            f"file of it was saved: restore it from a copy of that tag, or load another complete tag with "
            f"load_checkpoint(..., tag=...) ({other_tags(folder.parent, but=folder.name)}).")


def model_state_files(manifest: dict) -> list[str]:
    parts = manifest.get("model_states_parts", 1)
    return [MODEL_STATES.format(part=part, parts=parts) for part in range(parts)]


def read_model_states(folder: Path, manifest: dict) -> dict:
    return merge_state([read(folder / name) for name in model_state_files(manifest)])
