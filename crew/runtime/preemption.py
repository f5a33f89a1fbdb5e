"""crew's `"preemption": {"enabled": true, "save_dir": null}`: on a preemption notice (SIGTERM or SIGUSR1, from
`crew run`'s agents, a Kubernetes pod's stop, a Slurm `--signal`), finish the optimizer step, save, exit 75.

    initialize()      installs the handlers (main thread only): a notice only sets a flag and says one line
    engine.step()     at the end of each optimizer step, one all_reduce (MAX) of the flag tells every rank
                      whether any was signalled; if so every rank saves with engine.save_checkpoint and
                      the process exits with PREEMPTED_EXIT_CODE (75)

Where it saves: the configured `save_dir`, else the folder of the script's last save_checkpoint call, with
the client_state of that call and a tag of its naming (`tag_after`), `latest` pointing at it, so that the
script's own `load_checkpoint(save_dir)` resumes there. Signalled before any save and with no save_dir
configured, nothing can be saved: the ranks say so and exit as a stopped job does (143). Off (DeepSpeed has
no such key), nothing is installed and a step costs nothing more.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from crew.errors import PREEMPTED_EXIT_CODE, PREEMPTED_MARK, STOPPED_EXIT_CODE
from crew.log import warn_once
from crew.runtime import comm

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Hugging Face Trainer's folders (output_dir/checkpoint-N): its own state (trainer_state.json, step, data
# position) lies beside the engine's, and a save by the engine alone would leave the two disagreeing.
TRAINER_FOLDER = re.compile(r"checkpoint-\d+")


@dataclass(frozen=True)
class LastSave:
    """The script's last engine.save_checkpoint call."""

    save_dir: Path
    tag: str | None
    global_steps: int
    client_state: dict


class Notice:
    """The process's preemption flag. One per process, since signal handlers are: every engine reads it."""

    def __init__(self):
        self.signal: str | None = None
        self._installed = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            warn_once("preemption.enabled: initialize() runs outside the main thread, where Python cannot "
                      "install signal handlers; a SIGTERM stops this rank at once, as without the key.")
            return
        for sig in NOTICE_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._installed = True

    def _on_signal(self, number: int, frame) -> None:
        # Only a flag and one line (os.write: a print here could re-enter one the signal interrupted). A second
        # notice changes nothing: the agent that relays one kills the rank after its grace period.
        if self.signal is None:
            self.signal = signal.Signals(number).name
            if os.environ.get("LOCAL_RANK", "0") == "0":
                os.write(2, f"crew: {self.signal} received: finishing this optimizer step, then saving a "
                            "checkpoint (preemption.enabled)\n".encode())
        previous = self._previous.get(number)
        if callable(previous):  # a handler the script (or a library) installed before initialize()
            previous(number, frame)


_NOTICE = Notice()


class Preemption:
    """One engine's side: where to save, and the check at the end of each optimizer step."""

    def __init__(self, save_dir: str | None, device: torch.device, notice: Notice):
        self.save_dir = save_dir
        self.notice = notice
        self.last_save: LastSave | None = None
        self._flag = torch.zeros(1, device=device)

    def remember(self, save_dir, tag, client_state: dict | None, global_steps: int) -> None:
        """A save_checkpoint call: its folder, tag and a copy of its client_state (the script may change the
        dict it passed)."""
        self.last_save = LastSave(Path(save_dir).absolute(), None if tag is None else str(tag), global_steps,
                                  copy.deepcopy(client_state or {}))

    def signalled_anywhere(self) -> bool:
        """Whether any rank has had a notice: one all_reduce (MAX) of a one-element flag (none for one rank)."""
        if comm.get_world_size() == 1 or not torch.distributed.is_initialized():
            return self.notice.signal is not None
        self._flag.fill_(1.0 if self.notice.signal else 0.0)
        comm.all_reduce(self._flag, op=comm.ReduceOp.MAX)
        return bool(self._flag.item())

    def after_step(self, engine) -> None:
        """At the end of an optimizer step: if any rank had a notice, every rank saves and exits."""
        if not self.signalled_anywhere():
            return
        target = self.target(engine.global_steps)
        if isinstance(target, str):
            _say_rank0(f"crew: preempted at step {engine.global_steps}: nothing could be saved: {target}. "
                       "Everything since the script's last save is lost; exiting as a stopped job (143).")
            raise SystemExit(STOPPED_EXIT_CODE)
        save_dir, tag, client_state = target
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)
        _say_rank0(f"{PREEMPTED_MARK}{save_dir / tag}")
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def target(self, global_steps: int) -> tuple[Path, str, dict] | str:
        """(save_dir, tag, client_state) for the preemption's checkpoint, or why there is none."""
        last = self.last_save
        client_state = last.client_state if last is not None else {}
        if self.save_dir is not None:
            return Path(self.save_dir).absolute(), f"global_step{global_steps}", client_state
        if last is None:
            return ("the script has not called engine.save_checkpoint yet and the config names no "
                    "preemption.save_dir. Set \"preemption\": {\"enabled\": true, \"save_dir\": \"DIR\"} to save "
                    "there (the script must load_checkpoint it when it starts)")
        if TRAINER_FOLDER.fullmatch(last.save_dir.name):
            return (f"the last save went to {last.save_dir}, a Hugging Face Trainer checkpoint, whose "
                    "trainer_state.json a save by the engine alone would contradict. For a Trainer use "
                    "TrainingArguments(enable_jit_checkpoint=True) instead of crew's preemption key")
        return last.save_dir, tag_after(last.tag, last.global_steps, global_steps), client_state


def tag_after(last_tag: str | None, last_steps: int, global_steps: int) -> str:
    """The tag the script would give a save at `global_steps`, from its last one: DeepSpeed's default
    global_step<N> when it gave none; its own tag with the step number once in it moved on (`step100` at step 100
    -> `step130`); else the same tag, replaced (atomically, as every save), since the script loads that name."""
    if last_tag is None:
        return f"global_step{global_steps}"
    number = re.compile(rf"(?<!\d){last_steps}(?!\d)")
    if len(number.findall(last_tag)) == 1:
        return number.sub(str(global_steps), last_tag)
    return last_tag


def _say_rank0(line: str) -> None:
    if comm.get_rank() == 0:
        os.write(2, (line + "\n").encode())


def make(config, device: torch.device) -> Preemption | None:
    """The engine's preemption watch when the config enables it (installing the handlers), else None."""
    if not config.preemption.enabled:
        return None
    _NOTICE.install()
    return Preemption(config.preemption.save_dir, device, _NOTICE)
