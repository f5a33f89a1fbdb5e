"""crew's engine on a CUDA device, one rank (NCCL): the same losses as on the CPU at fp32, bf16 within its
rounding, at ZeRO stages 0 and 3; a checkpoint saved on the GPU resumes on a machine without one. Skips
without CUDA; `make gpu-check` runs it (pytest -m cuda)."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")]


def train(rank: int, device: str, precision: str, stage: int, steps: slice = slice(0, 5), save: str = "",
          load: str = "", offload: str = "") -> list[float]:
    """The losses of data[steps]; `load` resumes from a checkpoint folder first, `save` writes one after;
    `offload`: "optimizer" or "param", offloaded to the CPU."""
    import crew

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    if offload:
        config["zero_optimization"][f"offload_{offload}"] = {"device": "cpu"}
    if device == "cpu":  # the reference: crew then takes gloo and the CPU, as on a machine without GPU
        torch.cuda.is_available = lambda: False
    engine, _, _, _ = crew.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.device.type == device
    if load:
        engine.load_checkpoint(load)
    data = torch.randn(5, 8, 64, generator=torch.Generator().manual_seed(1))[steps]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    losses = []
    for x in data:
        x = x.to(engine.device, dtype)
        loss = (engine(x).float() - x.float().mean(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if save:
        engine.save_checkpoint(save)
    return losses


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_on_cuda_gives_the_cpus_losses(stage):
    reference = run_ranks(train, 1, "cpu", "fp32", stage)[0]
    assert run_ranks(train, 1, "cuda", "fp32", stage)[0] == pytest.approx(reference, rel=1e-4, abs=1e-6)
    assert run_ranks(train, 1, "cuda", "bf16", stage)[0] == pytest.approx(reference, rel=5e-2, abs=1e-3)


@pytest.mark.parametrize("stage, offload", [(0, ""), (3, ""), (2, "optimizer"), (3, "param")])
def test_a_checkpoint_saved_on_cuda_resumes_on_the_cpu(stage, offload, tmp_path):
    """Saved after 3 of 5 steps on the GPU, resumed on the CPU: the last 2 steps are the GPU run's own. The tag
    holds DeepSpeed's files (the GPU run's tensors written from the device or the offloaded CPU copies)."""
    whole = run_ranks(train, 1, "cuda", "fp32", stage, slice(0, 5), "", "", offload)[0]
    first = run_ranks(train, 1, "cuda", "fp32", stage, slice(0, 3), str(tmp_path), "", offload)[0]
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    assert (tmp_path / "global_step3" / model_file).is_file()
    if stage:
        assert (tmp_path / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    rest = run_ranks(train, 1, "cpu", "fp32", stage, slice(3, 5), "", str(tmp_path))[0]
    assert first == pytest.approx(whole[:3], rel=1e-6)
    assert rest == pytest.approx(whole[3:], rel=1e-4, abs=1e-6)
