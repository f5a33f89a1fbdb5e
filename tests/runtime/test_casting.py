"""The model's tensors under bf16/fp16, as DeepSpeed 0.19.8 casts them: parameters take the training dtype,
buffers keep theirs unless data_types says otherwise (crew/runtime/casting.py)."""

from __future__ import annotations

import pytest
import torch

from crew.errors import ConfigError
from crew.runtime.casting import cast_buffers, cast_parameters


class Rotary(torch.nn.Module):
    """A transformers-like model: an fp32 rotary buffer, a norm layer, a buffer its class keeps in fp32."""

    _keep_in_fp32_modules_strict = ["router_bias"]

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
        self.register_buffer("router_bias", (torch.linspace(5, 5.01, 8)).bfloat16())

    def forward(self, x):
        return self.norm(self.linear(x)) * self.inv_freq[:4].to(x.dtype)


def dtypes(model):
    return {name: tensor.dtype for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parameters_take_the_dtype_and_buffers_keep_theirs_as_in_deepspeed(dtype):
    model = Rotary()
    inv_freq = model.inv_freq.clone()
    cast_parameters(model, dtype)
    cast_buffers(model, dtype, None)
    seen = dtypes(model)
    assert {seen[n] for n in ("linear.weight", "linear.bias", "norm.weight", "norm.bias")} == {dtype}
    assert seen["inv_freq"] == torch.float32 and torch.equal(model.inv_freq, inv_freq)  # not rounded
    assert seen["router_bias"] == torch.float32  # the class's _keep_in_fp32_modules_strict: back to fp32
    assert seen["norm.running_mean"] == seen["norm.running_var"] == dtype  # torch wants them as the weights
    assert seen["norm.num_batches_tracked"] == torch.int64
    assert model(torch.randn(3, 4, dtype=dtype)).dtype == dtype  # the norm layer runs (DeepSpeed's fails)


def test_buffer_dtype_casts_every_buffer_but_those_kept_in_fp32():
    model = Rotary()
    cast_buffers(model, torch.bfloat16, {"buffer_dtype": "bfloat16", "keep_in_fp32_modules": ["inv_freq"]})
    seen = dtypes(model)
    assert seen["inv_freq"] == torch.float32  # kept by the list, which replaces the class's own
    assert seen["router_bias"] == seen["norm.running_mean"] == torch.bfloat16
    assert seen["norm.num_batches_tracked"] == torch.int64


def test_an_empty_keep_list_keeps_nothing_and_fp16_adds_the_non_strict_list():
    model = Rotary()
    cast_buffers(model, torch.bfloat16, {"keep_in_fp32_modules": []})
    assert model.router_bias.dtype == torch.bfloat16  # left as loaded
    model = Rotary()
    model._keep_in_fp32_modules = ["inv_freq"]
    model.inv_freq = model.inv_freq.half()
    cast_buffers(model, torch.bfloat16, None)
    assert model.inv_freq.dtype == torch.float16  # _keep_in_fp32_modules counts under fp16 only
    cast_buffers(model, torch.float16, None)
    assert model.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("section, words", [
    ({"buffer_dtype": "int8"}, "data_types.buffer_dtype is 'int8'"),
    ({"keep_in_fp32_modules": "all"}, "data_types.keep_in_fp32_modules is 'all'"),
])
def test_bad_data_types_values_name_the_key(section, words):
    with pytest.raises(ConfigError, match=words):
        cast_buffers(Rotary(), torch.bfloat16, section)


def test_of_data_types_only_param_dtype_is_reported_as_without_effect():
    from crew.runtime.config import Config, ignored_keys

    base = {"train_micro_batch_size_per_gpu": 1}
    acting = Config.from_dict({**base, "data_types": {"buffer_dtype": "bf16", "grad_accum_dtype": "fp32"}}, 1)
    assert not [key for key in ignored_keys(acting) if key.startswith("data_types")]
    assert ignored_keys(Config.from_dict({**base, "data_types": {"param_dtype": "bf16"}}, 1)) == \
        ["data_types.param_dtype"]
