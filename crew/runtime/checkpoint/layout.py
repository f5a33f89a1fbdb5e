"""What a tag folder holds and how its files are written and read: the file names, CheckpointError,
atomic writes, and reading a tag's manifest, `latest` and model state files."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from crew.errors import CrewError
from crew.runtime.checkpoint.state import merge_state

MANIFEST = "crew_checkpoint.json"
MODEL_STATES = "model_states.{part}-of-{parts}.pt"
CLIENT_STATE = "client_state.pt"
ENGINE_STATE = "engine_state.pt"  # stages 2-3: what is not in the sharded folder
SHARDED_DIR = "sharded"
REPLICATED, SHARDED = "replicated", "sharded"  # the manifest's "format"
_RENAME_EXCHANGE = 2


class CheckpointError(CrewError):
    """A checkpoint that cannot be written or read; says which file and what differs."""


# -- files --------------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Recorder:
    """A file wrapper that keeps the OSError of a failed write (disk full, quota), which torch's
    serialiser would otherwise turn into an opaque 'enforce fail ... unexpected pos'."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.handle.flush()


def write_atomic(path: Path, data: bytes | None = None, obj: Any = None) -> None:
    """Write under a temporary name, fsync, rename: `path` is either the old or the new file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            recorder = _Recorder(handle)
            try:
                torch.save(obj, recorder) if obj is not None else recorder.write(data)
                handle.flush()
            except Exception:
                if recorder.error is not None:
                    raise recorder.error from None
                raise
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


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

def read_latest(load_dir: Path) -> str | None:
    try:
        return (Path(load_dir) / "latest").read_text().strip() or None
    except OSError:
        return None


def read_manifest(folder: Path) -> dict:
    manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else {}
    manifest.setdefault("format", REPLICATED)  # checkpoints from before ZeRO stages 1-3
    manifest.setdefault("zero_stage", 0)
    if manifest["format"] not in (REPLICATED, SHARDED):
        raise CheckpointError(f"{folder / MANIFEST}: unknown checkpoint format "
                              f"{manifest['format']!r}; it was written by a newer crew, upgrade crew")
    return manifest


def model_state_files(manifest: dict) -> list[str]:
    parts = manifest.get("model_states_parts", 1)
    return [MODEL_STATES.format(part=part, parts=parts) for part in range(parts)]


def read_model_states(folder: Path, manifest: dict) -> dict:
    return merge_state([read(folder / name) for name in model_state_files(manifest)])
