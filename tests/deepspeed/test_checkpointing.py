"""deepspeed.checkpointing (crew/deepspeed/checkpointing.py): the same gradients as no checkpointing,
the config's activation_checkpointing section read by configure(), and what each setting does."""

from __future__ import annotations

import json

import pytest
import torch

from crew.deepspeed import checkpointing
from crew.errors import ConfigError


@pytest.fixture(autouse=True)
def unconfigured(monkeypatch):
    """Each test starts as a fresh process would: defaults, not configured."""
    monkeypatch.setattr(checkpointing, "_settings", checkpointing.ActivationCheckpointingConfig())
    monkeypatch.setattr(checkpointing, "_configured", False)


def gradients(run, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """d(sum of two stacked blocks)/d(inputs, weight, bias), with `run(block, x, scale=...)` calling them."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 5).to(device)
    inputs = torch.randn(3, 5, device=device, requires_grad=True)

    def block(x, scale=None):
        return torch.tanh(layer(x)) * scale

    scale = torch.tensor(2.0, device=device)
    run(block, run(block, inputs, scale=scale), scale=scale).sum().backward()
    return inputs.grad, layer.weight.grad, layer.bias.grad


def plain(block, x, scale):
    return block(x, scale=scale)


def checkpointed(block, x, scale):
    return checkpointing.checkpoint(block, x, scale=scale)


def test_checkpoint_gives_the_plain_gradients_without_configure():
    assert all(torch.equal(a, b) for a, b in zip(gradients(plain), gradients(checkpointed), strict=True))
    assert not checkpointing.is_configured()


def test_configure_reads_the_section_of_a_config_file_and_profile_logs_each_call(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": {
        "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "profile": True}}))
    checkpointing.configure(None, deepspeed_config=str(path))
    assert checkpointing.is_configured()
    settings = checkpointing._settings
    assert settings.cpu_checkpointing and settings.synchronize_checkpoint_boundary and settings.profile
    assert all(torch.equal(a, b) for a, b in zip(gradients(plain), gradients(checkpointed), strict=True))
    lines = [line for line in capsys.readouterr().out.splitlines() if "checkpoint " in line]
    # two blocks: each timed in the forward, then once more when backward recomputes it
    assert [line.split(" of ")[0] for line in lines] == ["[crew] checkpoint forward"] * 2 + \
        ["[crew] checkpoint recompute in backward"] * 2
    assert all(line.endswith(" ms") and "of block:" in line for line in lines)

    checkpointing.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False, profile=False)
    assert not checkpointing._settings.cpu_checkpointing and not checkpointing._settings.profile  # explicit wins
    checkpointing.reset()
    assert checkpointing.is_configured() and checkpointing._settings.synchronize_checkpoint_boundary


def test_configure_errors_name_the_key_and_settings_without_effect_say_so(capsys):
    expected = r"activation_checkpointing.cpu_checkpointing \"yes\": expected true or false"
    with pytest.raises(ConfigError, match=expected):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": "yes"}})
    with pytest.raises(AssertionError, match="only available with partitioned activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(AssertionError, match="Must specify the number of layers"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True}},
                            num_checkpoints=4)
    assert checkpointing.is_configured() and checkpointing._settings.number_checkpoints == 4
    assert "activation_checkpointing.partition_activations has no effect in crew" in capsys.readouterr().out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cpu_checkpointing moves device tensors: needs CUDA")
def test_cpu_checkpointing_keeps_the_inputs_off_the_device():
    layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8)).cuda()

    def forward() -> tuple[int, torch.Tensor]:
        """The device memory one forward keeps for backward, and its output (which holds the graph)."""
        before = torch.cuda.memory_allocated()
        x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
        h = x * 1  # the first input is the caller's; only the intermediate ones can leave the device
        for layer in layers:
            h = checkpointing.checkpoint(layer, h)
        return torch.cuda.memory_allocated() - before, h

    kept = forward()[0]  # its graph is freed here: the next forward is measured alone
    checkpointing.configure(None, checkpoint_in_cpu=True)
    offloaded, h = forward()
    assert offloaded < kept - 6 * 4096 * 1024 * 4  # at least 6 of the 8 checkpointed inputs left the device
    h.sum().backward()
    assert all(layer.weight.grad is not None for layer in layers)
