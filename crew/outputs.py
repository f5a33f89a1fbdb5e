"""Where a job's results went, for the line `crew run` ends with: the engine's checkpoints and monitor folders.

The node agent names a file in OUTPUTS_FILE_ENV for global rank 0 only. Rank 0's engine appends one JSON line to
it per checkpoint saved and per monitor opened: {"kind": "checkpoint", "path": SAVE_DIR, "tag": TAG} or
{"kind": "monitor", "path": FOLDER, "writer": "csv_monitor"}, paths absolute. When the ranks have ended the agent
reads it (`read`), sends what it found in its `done` event and removes the file. A rank started by anything
else has no such variable and writes nothing; a write that fails is ignored, since the closing line is a
convenience and never a reason to stop training.
"""

from __future__ import annotations

import json
import os

OUTPUTS_FILE_ENV = "CREW_OUTPUTS_FILE"
MAX_ENTRIES = 32  # checkpoints and weights: a script that saves to a new folder every step sends its last few


def report(kind: str, path: str | os.PathLike, **fields) -> None:
    """Rank 0: `path` (made absolute) holds an output of `kind` ("checkpoint", "monitor")."""
    target = os.environ.get(OUTPUTS_FILE_ENV)
    if not target:
        return
    line = json.dumps({"kind": kind, "path": os.path.abspath(path), **fields})
    try:
        with open(target, "a") as file:
            file.write(line + "\n")
    except OSError:
        pass


def read(path: str | os.PathLike) -> list[dict]:
    """The outputs listed in the file at `path`, one per (kind, path) with its last fields (a checkpoint folder
    keeps its newest tag): the monitors, then the other outputs oldest first by their last report, at most
    MAX_ENTRIES of them; [] when there is no file. Damaged lines are skipped."""
    found: dict[tuple[str, str], dict] = {}
    try:
        with open(path) as file:
            lines = file.readlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
            key = (str(entry["kind"]), str(entry["path"]))
        except (ValueError, TypeError, KeyError):
            continue
        found[key] = {**found.pop(key, {}), **entry}
    monitors = [entry for entry in found.values() if entry["kind"] == "monitor"]
    return monitors + [entry for entry in found.values() if entry["kind"] != "monitor"][-MAX_ENTRIES:]
