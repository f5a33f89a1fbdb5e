"""Reading a DeepSpeed config file: strict JSON, else hjson as DeepSpeed reads it; a key twice is an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crew.errors import ConfigError


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (looked for {path.absolute()}). "
                          "Check the --deepspeed_config or config= path.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file: {err}.") from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, path))
    except json.JSONDecodeError as err:
        message = f"{path}, line {err.lineno}, column {err.colno}: invalid JSON: {err.msg}"
        if not text.strip():  # hjson reads an empty file as {}: surely a mistake
            raise ConfigError(f"{message} (the file is empty).") from None
        data = _read_hjson(text, path, message)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object {{...}}, got {_json_type(data)}.")
    return data


def _read_hjson(text: str, path: Path, json_error: str) -> Any:
    """DeepSpeed reads config files with hjson (comments, trailing commas, unquoted keys); so does crew when
    the optional hjson package is installed."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"{json_error}. DeepSpeed reads config files as hjson (comments, trailing commas): "
                          "`pip install hjson` and crew does too, or make the file plain JSON.") from None
    try:
        return hjson.loads(text, object_pairs_hook=lambda pairs: _no_duplicates(pairs, path))
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"{json_error}; nor is it hjson (line {err.lineno}, column {err.colno}: {err.msg}).") \
            from None


def _no_duplicates(pairs: list[tuple[str, Any]], path: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"{path}: key '{key}' appears twice in one object (DeepSpeed refuses this "
                              "too); keep one.")
        seen[key] = value
    return seen
