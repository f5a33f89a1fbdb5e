"""crew's logger: INFO to stdout like DeepSpeed's, from rank 0 unless asked, each warning once."""

from __future__ import annotations

import functools
import logging
import os
import sys


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time (redirected, captured), not the one at import."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


logger = logging.getLogger("crew")
# A handler or level the application set on "crew" before importing crew stays; crew's own is added once.
if not any(isinstance(handler, _CurrentStdout) for handler in logger.handlers):
    _handler = _CurrentStdout()
    _handler.setFormatter(logging.Formatter("[crew] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log_rank0(message: str, *args) -> None:
    if _rank() == 0:
        logger.info(message, *args)


@functools.cache
def warn_once(message: str) -> None:
    if _rank() == 0:
        logger.warning(message)
