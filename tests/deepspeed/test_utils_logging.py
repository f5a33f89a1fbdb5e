"""`deepspeed.utils.logging`: DeepSpeed 0.19.8's module of that name (Lightning's strategies call
`deepspeed.utils.logging.logger.setLevel(...)`), whose `logger` is `deepspeed.utils.logger`, crew's; the
standard library's `logging` stays itself."""

from __future__ import annotations

import logging
import sys

import pytest

import crew.deepspeed
import crew.deepspeed.utils as utils
from crew.deepspeed.alias import crew_module_for
from crew.deepspeed.utils import logging as ds_logging


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_module_deepspeed_names_is_crews_and_the_standard_library_is_untouched():
    assert crew_module_for("deepspeed.utils.logging") == "crew.deepspeed.utils.logging"
    assert utils.logging is ds_logging and ds_logging.logger is utils.logger is crew.deepspeed.logger
    assert logging is sys.modules["logging"] and not hasattr(logging, "log_dist")
    assert ds_logging.log_levels["warning"] == logging.WARNING


def test_levels_once_only_helpers_and_errors_behave_as_deepspeeds():
    logger, saved = ds_logging.logger, (ds_logging.logger.level, [h.level for h in ds_logging.logger.handlers])
    handler = _Lines()
    logger.addHandler(handler)
    try:
        ds_logging.set_log_level_from_string("error")
        assert logger.level == logging.ERROR and all(h.level == logging.ERROR for h in logger.handlers)
        assert not ds_logging.should_log_le("info") and ds_logging.should_log_le("critical")
        ds_logging.set_log_level_from_string("info")
        for _ in range(3):
            ds_logging.log_dist_once("once only")  # no process group: every rank logs, as rank -1
            logger.warning_once("a warning once")
        assert handler.lines == ["[Rank -1] once only", "a warning once"]
        assert ds_logging.get_dist_msg("m", ranks=[0]) == "[Rank -1] m"
        with pytest.raises(ValueError, match="verbose is not one of the valid logging levels.*'debug', 'info'"):
            ds_logging.get_log_level_from_string("verbose")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        for level, existing in zip(saved[1], logger.handlers):
            existing.setLevel(level)
