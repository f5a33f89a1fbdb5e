"""Lightning's DeepSpeedStrategy on crew's engine (`crew run --as_deepspeed`, 2 ranks on the CPU): one job
(scripts/lightning_deepspeed.py) fits `deepspeed_stage_1`, `_2`, `_3` and `DeepSpeedStrategy(config=<file>)`
for one epoch, saves (trainer.save_checkpoint or ModelCheckpoint), resumes in a fresh Trainer with
fit(ckpt_path=...) for a second epoch; then Fabric's ZeRO-2 with fabric.save/load. Every rank's loss and lr
at each step must be a one-process plain torch run's, which is what an uninterrupted run gives; at stage 3,
trainer.test after the fit and from the checkpoint must give the torch run's loss over all samples. Lightning's
convert_zero_checkpoint_to_fp32_state_dict then reads the stage-2 and stage-3 checkpoints, and some DeepSpeed wrote
(one more Python)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the Lightning test needs lightning (the test extra)")
import torch  # noqa: E402
from conftest import crew  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "hf" / "scripts" / "lightning_deepspeed.py"
CASES = ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "config", "fabric"]
SAMPLES, MICRO_BATCH, RANKS, STEPS, LR, CLIP = 24, 4, 2, 6, 0.05, 0.05  # the script's


def rank_order(rank: int, epoch: int) -> list[int]:
    """The samples a rank sees in an epoch: Lightning gives training loaders a shuffling DistributedSampler
    (seed 0, set_epoch each epoch)."""
    sampler = DistributedSampler(range(SAMPLES), num_replicas=RANKS, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def reference(clip: float | None = None, schedule: bool = True) -> list[dict]:
    """The script's model, data, AdamW and StepLR in one process: each step's batch is both ranks' micro
    batches, the gradient that of the mean loss over it; each rank's loss is the loss on its own half."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = x.sum(1, keepdim=True).sin()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    steps_per_epoch = SAMPLES // (MICRO_BATCH * RANKS)
    steps = []
    for step in range(STEPS):
        epoch, first = divmod(step, steps_per_epoch)
        halves = [rank_order(rank, epoch)[first * MICRO_BATCH:(first + 1) * MICRO_BATCH] for rank in range(RANKS)]
        losses = [F.mse_loss(net(x[half]), y[half]) for half in halves]
        optimizer.zero_grad()
        (sum(losses) / RANKS).backward()
        if clip:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        if schedule:
            scheduler.step()
        with torch.no_grad():
            whole = F.mse_loss(net(x), y).item()  # over all samples, after this step
        steps.append({"losses": [loss.item() for loss in losses], "lr": scheduler.get_last_lr()[0], "whole": whole,
                      "weights": {name: value.detach().clone() for name, value in net.state_dict().items()}})
    return steps


def test_lightning_deepspeed_strategies_train_save_and_resume(tmp_path):
    run = crew("run", "--num_gpus", "2", "--as_deepspeed", str(SCRIPT), str(tmp_path), "--cases", ",".join(CASES),
               cwd=tmp_path)
    assert run.code == 0, run.out[-3000:] + run.err[-3000:]
    # Lightning steps the scheduler it gave the engine; the engine's optimizer stepped the client's first
    assert "Detected call of `lr_scheduler.step()` before" not in run.out + run.err
    ranks = json.loads((tmp_path / "lightning.json").read_text())
    for case in CASES:
        expected = reference(CLIP if case == "config" else None, schedule=case != "fabric")
        for rank, results in enumerate(ranks):
            got = results[case]
            # Fabric steps DeepSpeed's optimizer, not the engine: its global_steps stay 0, as under DeepSpeed
            assert got["global_step"] == (0 if case == "fabric" else STEPS), case
            assert [s["step"] for s in got["steps"]] == list(range(1, STEPS + 1)), case
            losses = [s["loss"] for s in got["steps"]]
            assert losses == pytest.approx([s["losses"][rank] for s in expected], rel=1e-5, abs=1e-6), (case, rank)
            assert [s["lr"] for s in got["steps"]] == pytest.approx([s["lr"] for s in expected]), (case, rank)
            # DeepSpeed's layout under Lightning's checkpoint path: the tag Lightning names, and `latest`
            assert {"checkpoint", "latest"} <= set(got["saved"]), (case, got["saved"])
    # ZeRO-3 evaluation, a second engine: trainer.test(model) after trainer.fit(model) on the module the fit
    # sharded, then trainer.test(MyModule(), ckpt_path=<step 3>) (DeepSpeed 0.19.8 fails there: 'DeepSpeedZeRoOffload'
    # object has no attribute '_restore_from_bit16_weights'): the loss over all samples after those steps
    stage3, expected = ranks[0]["deepspeed_stage_3"], reference()
    assert stage3["test_after_fit"] == pytest.approx(expected[STEPS - 1]["whole"], rel=1e-5), stage3
    assert stage3["test_from_checkpoint"] == pytest.approx(expected[STEPS // 2 - 1]["whole"], rel=1e-5), stage3
    # Lightning's convert_zero_checkpoint_to_fp32_state_dict (DeepSpeed's zero_to_fp32 names and files) on crew's
    # checkpoints at stages 2 and 3, saved after the first epoch: the fp32 weights of those steps
    converted, fixtures = lightning_converter({"deepspeed_stage_2": tmp_path / "deepspeed_stage_2" / "epoch=0.ckpt",
                                               "deepspeed_stage_3": tmp_path / "deepspeed_stage_3" / "saved.ckpt"},
                                              tmp_path)
    for case, written in converted.items():
        assert {"epoch", "global_step", "state_dict"} <= set(written["keys"]) and written["global_step"] == 3, case
        weights = expected[STEPS // 2 - 1]["weights"]
        assert written["state_dict"].keys() == {f"net.{name}" for name in weights}, case
        for name, value in weights.items():
            got = torch.tensor(written["state_dict"][f"net.{name}"])
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=f"{case} {name}")
    # and on checkpoints real DeepSpeed wrote: the file it writes with DeepSpeed 0.19.8 (keys, weights bitwise)
    recorded = json.loads((ZERO_TO_FP32_DATA / "expected.json").read_text())["cases"]
    assert len(fixtures) == len(FIXTURES)
    for name, written in fixtures.items():
        assert written == recorded[name]["lightning"], name


ZERO_TO_FP32_DATA = REPO / "tests" / "deepspeed" / "zero_to_fp32_data"
FIXTURES = ["stage1_bf16", "stage2_fp32", "stage3_bf16_groups", "frozen_stage2_fp32", "frozen_stage3_bf16"]
CONVERT = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[3]]  # crew's shim: `import deepspeed` is crew; make_expected's recorder
from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
import make_expected
written = {}
for case, folder in json.loads(sys.argv[2]).items():
    state = convert_zero_checkpoint_to_fp32_state_dict(folder, folder + ".fp32.pt")
    written[case] = {"keys": sorted(state), "global_step": state["global_step"],
                     "state_dict": {name: value.tolist() for name, value in state["state_dict"].items()}}
folders = make_expected.cases()
fixtures = {name: make_expected.record_lightning(folders[name]) for name in json.loads(sys.argv[4])}
print(json.dumps([written, fixtures]))
"""


def lightning_converter(folders: dict, cwd: Path) -> tuple[dict, dict]:
    """Lightning's converter run on crew's shim in a fresh Python: each of `folders`' written keys and weights, and
    FIXTURES' as tests/deepspeed/zero_to_fp32_data/make_expected.py records them."""
    from crew.launcher.node.agent import DEEPSPEED_SHIM

    folders = {case: str(folder) for case, folder in folders.items()}
    proc = subprocess.run([sys.executable, "-c", CONVERT, DEEPSPEED_SHIM, json.dumps(folders), str(ZERO_TO_FP32_DATA),
                           json.dumps(FIXTURES)], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(json.loads(proc.stdout.splitlines()[-1]))
