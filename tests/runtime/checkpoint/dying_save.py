"""A rank that saves twice and is killed (SIGKILL) at a chosen file of the second save, when `kill_rank`: the
job of test_checkpoint's kill tests, under crew run or in run_until_one_dies's ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch


def save_twice(rank: int, folder: str, kill_file: str, kill_rank: int) -> None:
    import crew
    import crew.runtime.checkpoint.saving as checkpoint_save  # where save looks write_atomic up

    write = checkpoint_save.write_atomic
    save_count = [0]

    def dying_write(path, *args, **kwargs):
        if save_count[0] == 2 and path.name == kill_file and rank == kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, *args, **kwargs)

    checkpoint_save.write_atomic = dying_write
    torch.manual_seed(0)
    engine, _, _, _ = crew.initialize(model=torch.nn.Linear(32, 32), config={
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for tag in ("first", "second"):
        save_count[0] += 1
        engine.backward(engine(torch.randn(4, 32)).sum())
        engine.step()
        engine.save_checkpoint(str(Path(folder) / "ckpt"), tag=tag)
