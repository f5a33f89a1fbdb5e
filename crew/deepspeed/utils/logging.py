"""`deepspeed.utils.logging` (DeepSpeed 0.19.8's deepspeed/utils/logging.py): the logger DeepSpeed logs to,
which is crew's (so Lightning's `deepspeed.utils.logging.logger.setLevel(...)` quiets crew as it quiets
DeepSpeed), and the rank-aware helpers around it. `deepspeed.utils.logger` is the same object."""

from __future__ import annotations

import functools
import json
import logging
import os

from crew.log import logger
from crew.runtime import comm

__all__ = ["get_current_level", "get_dist_msg", "get_log_level_from_string", "log_dist", "log_dist_once",
           "log_levels", "logger", "print_dist", "print_json_dist", "set_log_level_from_string", "should_log_le",
           "warning_once"]

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def get_dist_msg(message: str, ranks=None) -> str | None:
    """Every rank logs before the process group exists; after, the ranks listed (ranks[0] == -1: all of
    them), and none for ranks None or []."""
    if not comm.is_initialized():
        return f"[Rank -1] {message}"
    rank = comm.get_rank()
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message: str, ranks=None) -> None:
    """log_dist's choice of ranks, printed whatever the logger's level."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


@functools.cache
def _log_dist_once(message: str, ranks: tuple | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks=None, level: int = logging.INFO) -> None:
    _log_dist_once(message, tuple(ranks) if ranks is not None else None, level)


@functools.cache
def warning_once(*args, **kwargs) -> None:
    logger.warning(*args, **kwargs)


def print_json_dist(message: dict, ranks=None, path=None) -> None:
    """Writes `message` (with its rank added) as JSON to `path` on the ranks get_dist_msg picks."""
    if get_dist_msg("", ranks) is None:
        return
    message["rank"] = comm.get_rank() if comm.is_initialized() else -1
    with open(path, "w") as outfile:
        json.dump(message, outfile)
        outfile.flush()
        os.fsync(outfile.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels. Valid log levels are "
                         f"{list(log_levels)}.")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Sets the level of `custom_logger` (default: DeepSpeed's logger, crew's) and of its handlers."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when the logger's level is at or below `max_log_level_str` ("info": INFO or DEBUG)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


# DeepSpeed hangs these on its logger; libraries call logger.warning_once(...).
logger.warning_once = warning_once
logger.log_dist_once = log_dist_once
