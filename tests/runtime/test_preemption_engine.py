"""crew's `preemption` config key, in one process: the notice's flag, where the save goes, the exit codes.
The launcher path and the multi-rank agreement run for real in tests/launcher/test_preemption.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import crew
from crew.errors import PREEMPTED_EXIT_CODE, PREEMPTED_MARK, ConfigError
from crew.runtime import preemption
from crew.runtime.config import Config
from crew.runtime.preemption import Notice, Preemption, tag_after

CONFIG = {"train_batch_size": 2, "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture
def notice(monkeypatch):
    """A fresh process flag for the test; the signal handlers it installs are put back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in preemption.NOTICE_SIGNALS}
    fresh = Notice()
    monkeypatch.setattr(preemption, "_NOTICE", fresh)
    yield fresh
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def engine_with(**sections):
    torch.manual_seed(0)
    engine, *_ = crew.initialize(model=torch.nn.Linear(3, 1), config={**CONFIG, **sections})
    return engine


def step(engine) -> None:
    loss = engine(torch.ones(2, 3)).sum()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("last_tag, last_steps, steps, expected", [
    (None, 10, 17, "global_step17"),           # DeepSpeed's default tag
    ("global_step10", 10, 17, "global_step17"),
    ("step10", 10, 17, "step17"),
    ("epoch1_step10", 10, 17, "epoch1_step17"),
    ("step100", 10, 17, "step100"),            # no whole number 10 in it: the same name, replaced
    ("pytorch_model", 10, 17, "pytorch_model"),  # Accelerate's save_state loads this name
    ("s1_1", 1, 4, "s1_1"),                    # the number twice: which one counts steps is not known
])
def test_the_tag_follows_the_scripts_naming(last_tag, last_steps, steps, expected):
    assert tag_after(last_tag, last_steps, steps) == expected


def test_where_the_save_goes(tmp_path):
    watch = Preemption(None, torch.device("cpu"), Notice())
    assert "has not called engine.save_checkpoint yet" in watch.target(5)
    assert 'preemption.save_dir' in watch.target(5)
    client_state = {"epoch": 1}
    watch.remember(tmp_path / "ckpt", None, client_state, 3)
    client_state["epoch"] = 2  # the script changes its dict after the save: the save's own copy counts
    assert watch.target(5) == (tmp_path / "ckpt", "global_step5", {"epoch": 1})
    watch.remember(tmp_path / "out" / "checkpoint-3", None, {}, 3)
    assert "Hugging Face Trainer checkpoint" in watch.target(5) and "enable_jit_checkpoint" in watch.target(5)
    configured = Preemption(str(tmp_path / "pre"), torch.device("cpu"), Notice())
    assert configured.target(5) == (tmp_path / "pre", "global_step5", {})


def test_config_section_is_checked():
    assert Config.from_dict(CONFIG, 1).preemption.enabled is False
    assert Config.from_dict({**CONFIG, "preemption": {"enabled": True}}, 1).preemption.save_dir is None
    with pytest.raises(ConfigError, match=r"preemption.enabled \"yes\": expected true or false"):
        Config.from_dict({**CONFIG, "preemption": {"enabled": "yes"}}, 1)
    with pytest.raises(ConfigError, match=r"preemption true: expected an object"):
        Config.from_dict({**CONFIG, "preemption": True}, 1)
    with pytest.raises(ConfigError, match=r"preemption.save_dir '' names no folder"):
        Config.from_dict({**CONFIG, "preemption": {"enabled": True, "save_dir": ""}}, 1)


def test_a_notice_saves_at_the_end_of_the_step_with_the_last_client_state(tmp_path, notice, capfd):
    calls = []
    signal.signal(signal.SIGUSR1, lambda number, frame: calls.append(number))  # the script's own, kept
    engine = engine_with(preemption={"enabled": True})
    assert signal.getsignal(signal.SIGTERM) == notice._on_signal
    step(engine)
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"seen": 1})
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second notice changes nothing
    assert notice.signal == "SIGUSR1" and calls == [signal.SIGUSR1]
    with pytest.raises(SystemExit) as stopped:
        step(engine)
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    err = capfd.readouterr().err
    assert "crew: SIGUSR1 received: finishing this optimizer step, then saving a checkpoint" in err
    assert f"{PREEMPTED_MARK}{tmp_path / 'ckpt' / 'global_step2'}" in err
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    resumed = engine_with()
    path, client_state = resumed.load_checkpoint(tmp_path / "ckpt")
    assert (resumed.global_steps, client_state) == (2, {"seen": 1})
    assert torch.equal(resumed.module.weight, engine.module.weight)


def test_a_notice_before_any_save_exits_as_a_stopped_job(tmp_path, notice, capfd):
    engine = engine_with(preemption={"enabled": True})
    notice._on_signal(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as stopped:
        step(engine)
    assert stopped.value.code == 143
    assert "crew: preempted at step 1: nothing could be saved: the script has not called engine.save_checkpoint" \
        in capfd.readouterr().err


def test_off_nothing_is_installed_and_steps_go_on(tmp_path, notice):
    before = signal.getsignal(signal.SIGTERM)
    engine = engine_with()
    assert engine._preemption is None and signal.getsignal(signal.SIGTERM) == before
    notice.signal = "SIGTERM"  # even a flag set elsewhere is not looked at
    step(engine)
    assert engine.global_steps == 1
