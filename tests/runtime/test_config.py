"""crew.runtime.config: DeepSpeed's batch rules, strict types and ranges, unknown keys, "auto", load_config."""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import math
import sys
import warnings
from pathlib import Path

import pytest

from crew.errors import ConfigError
from crew.runtime.batch import BatchSizeError, resolve_batch_sizes
from crew.runtime.config import Config, ConfigWarning, ignored_keys, load_config

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
SHORT = {"tb": TB, "mb": MB, "gas": GAS}


def batch(config: Config) -> tuple[int, int, int]:
    return config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --- batch triple ---------------------------------------------------------------------------------

# All 8 present/absent combinations of (tb, mb, gas); given values agree: mb 4, gas 2, tb 8 x world.
# Expected results follow DeepSpeed's _set_batch_related_parameters; None = it refuses.
RESOLUTION = [
    (("tb", "mb", "gas"), lambda w: (8 * w, 4, 2)),
    (("tb", "mb"), lambda w: (8 * w, 4, 2)),
    (("tb", "gas"), lambda w: (8 * w, 4, 2)),
    (("mb", "gas"), lambda w: (8 * w, 4, 2)),
    (("tb",), lambda w: (8 * w, 8, 1)),       # grad accum defaults to 1, micro = tb / world
    (("mb",), lambda w: (4 * w, 4, 1)),       # grad accum defaults to 1, tb = micro x world
    (("gas",), lambda w: None),
    ((), lambda w: None),
]


@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("given, expected", RESOLUTION, ids=["+".join(r[0]) or "none" for r in RESOLUTION])
def test_batch_resolution_all_combinations(given, expected, world_size, no_warnings):
    values = {"tb": 8 * world_size, "mb": 4, "gas": 2}
    data = {SHORT[k]: values[k] for k in given}
    if expected(world_size) is None:
        with pytest.raises(BatchSizeError, match=f"world size {world_size}"):
            Config.from_dict(data, world_size=world_size)
    else:
        assert batch(Config.from_dict(data, world_size=world_size)) == expected(world_size)


def deepspeed_reference(tb, mb, gas, world_size):
    """DeepSpeedConfig._set_batch_related_parameters + _batch_assertion (DeepSpeed 0.19), ported."""
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world_size
    elif tb is not None and gas is not None:
        mb = tb // world_size // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * world_size
    elif tb is not None:
        gas, mb = 1, tb // world_size
    elif mb is not None:
        tb, gas = mb * world_size, 1
    else:
        return None  # "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
    if tb > 0 and mb > 0 and gas > 0 and tb == mb * gas * world_size:
        return tb, mb, gas
    return None


def test_batch_resolution_matches_deepspeed_on_a_grid():
    checked = refused = 0
    for tb, mb, gas, world_size in itertools.product(range(1, 41), range(1, 6), range(1, 5), (1, 2, 3, 4, 8)):
        for keep in itertools.product((True, False), repeat=3):
            args = [v if k else None for v, k in zip((tb, mb, gas), keep)]
            expected = deepspeed_reference(*args, world_size)
            try:
                got = resolve_batch_sizes(*args, world_size)
            except BatchSizeError:
                got = None
                refused += 1
            assert got == expected, (args, world_size)
            checked += 1
    assert checked == 32000 and 0 < refused < checked


# (given, world size, fragments the message must contain, suggestions)
BATCH_ERRORS = [
    ({TB: 32, MB: 4, GAS: 2}, 8, ["train_batch_size 32", "world size 8", "= 64", "Set train_batch_size to 64",
                                  "gradient_accumulation_steps to 1", "train_micro_batch_size_per_gpu to 2"],
     [{TB: 64}, {TB: None}, {GAS: 1}, {MB: 2}]),
    ({TB: 48, MB: 4, GAS: 2}, 8, ["train_batch_size 48", "world size 8", "Set train_batch_size to 64",
                                  "train_micro_batch_size_per_gpu to 3"], [{TB: 64}, {TB: None}, {MB: 3}]),
    ({TB: 30, MB: 4, GAS: 2}, 2, ["train_batch_size 30", "Set train_batch_size to 16"], [{TB: 16}, {TB: None}]),
    ({TB: 30}, 4, ["train_batch_size 30", "world size 4", "28 or 32", MB], [{TB: 28}, {TB: 32}]),
    ({TB: 2}, 8, ["train_batch_size 2", "world size 8", "to 8", MB], [{TB: 8}]),
    ({TB: 30, MB: 4}, 4, ["train_batch_size 30", "train_micro_batch_size_per_gpu 4", "world size 4", "16 or 32", GAS],
     [{TB: 16}, {TB: 32}]),
    ({TB: 8, MB: 4}, 4, ["train_batch_size 8", "world size 4", "to 16", GAS], [{TB: 16}]),
    ({TB: 30, GAS: 4}, 2, ["train_batch_size 30", "gradient_accumulation_steps 4", "world size 2", "24 or 32", MB],
     [{TB: 24}, {TB: 32}]),
    ({}, 2, [TB, MB, "world size 2", '"train_micro_batch_size_per_gpu": 1'], [{MB: 1}]),
    ({GAS: 4}, 8, [TB, MB, "gradient_accumulation_steps 4", "train_batch_size 32 at world size 8"], [{MB: 1}]),
    ({TB: "auto", MB: "auto", GAS: "auto"}, 8, ['"auto"', TB, MB, "world size 8"], [{MB: 1}]),
]


@pytest.mark.parametrize("given, world_size, fragments, suggestions", BATCH_ERRORS)
def test_batch_errors_name_keys_world_size_and_values_that_agree(given, world_size, fragments, suggestions):
    with pytest.raises(BatchSizeError) as caught:
        Config.from_dict(given, world_size=world_size, source="ds.json")
    message = str(caught.value)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)
    assert message.startswith("ds.json: ")
    for fragment in fragments:
        assert fragment in message
    assert caught.value.suggestions == suggestions
    for suggestion in suggestions:
        fixed = dict(given)
        for key, value in suggestion.items():
            assert key in message
            if value is None:
                fixed.pop(key)
            else:
                assert str(value) in message
                fixed[key] = value
        config = Config.from_dict(fixed, world_size=world_size)
        assert config.train_batch_size == (config.train_micro_batch_size_per_gpu
                                           * config.gradient_accumulation_steps * world_size)


def test_mismatch_message_is_the_style_guide_sentence():
    with pytest.raises(BatchSizeError) as caught:
        Config.from_dict({TB: 32, MB: 4, GAS: 2}, world_size=8, source="ds.json")
    assert str(caught.value).startswith(
        "ds.json: train_batch_size 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x "
        "world size 8 = 64. Set train_batch_size to 64 or remove it and crew will derive it. Or keep 32 and set "
        "gradient_accumulation_steps to 1 or train_micro_batch_size_per_gpu to 2.")


@pytest.mark.parametrize("given, world_size, expected", [
    ({TB: "auto", MB: 4, GAS: "auto"}, 2, (8, 4, 1)),
    ({TB: 64, MB: "auto", GAS: 2}, 4, (64, 8, 2)),
    ({TB: "auto", MB: 2, GAS: 3}, 8, (48, 2, 3)),
])
def test_auto_batch_keys_count_as_omitted(given, world_size, expected, no_warnings):
    config = Config.from_dict(given, world_size=world_size)
    assert batch(config) == expected
    assert config.raw == given


# --- types and ranges -----------------------------------------------------------------------------

WRONG_TYPES = [
    ({TB: "16"}, ['train_batch_size "16"', "expected an integer", "write 16 without quotes"]),
    ({MB: 2.5}, ["train_micro_batch_size_per_gpu 2.5", "expected an integer"]),
    ({MB: 2.0}, ["train_micro_batch_size_per_gpu 2.0", "expected an integer", "(write 2)"]),
    ({GAS: True}, ["gradient_accumulation_steps true", "expected an integer"]),
    ({"fp16": {"enabled": "yes"}}, ['fp16.enabled "yes"', "expected true or false"]),
    ({"fp16": {"enabled": "true"}}, ['fp16.enabled "true"', "write true without quotes"]),
    ({"fp16": "on"}, ['fp16 "on"', "expected an object"]),
    ({"bf16": {"enabled": 1}}, ["bf16.enabled 1", "expected true or false"]),
    ({"bfloat16": {"enabled": 1}}, ["bfloat16.enabled 1", "expected true or false"]),
    ({"gradient_clipping": "1.0"}, ['gradient_clipping "1.0"', "expected a number", "write 1.0 without"]),
    ({"zero_optimization": {"stage": "2"}}, ['zero_optimization.stage "2"', "write 2 without quotes"]),
    ({"optimizer": "adam"}, ['optimizer "adam"', "expected an object"]),
    ({"optimizer": {"params": {"lr": 0.001}}}, ["optimizer.type is required but missing"]),
    ({"scheduler": {"type": 5}}, ["scheduler.type 5", "expected a string"]),
    ({"steps_per_print": 1.5}, ["steps_per_print 1.5", "expected an integer"]),
    ({"wall_clock_breakdown": "false"}, ['wall_clock_breakdown "false"', "write false without quotes"]),
]

OUT_OF_RANGE = [
    ({TB: 0}, ["train_batch_size 0", "must be > 0"]),
    ({TB: -8}, ["train_batch_size -8", "must be > 0"]),
    ({MB: 0}, ["train_micro_batch_size_per_gpu 0", "must be > 0"]),
    ({GAS: -1}, ["gradient_accumulation_steps -1", "must be > 0"]),
    ({"gradient_clipping": -0.5}, ["gradient_clipping -0.5", "must be >= 0"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage 4", "must be <= 3"]),
    ({"zero_optimization": {"stage": -1}}, ["zero_optimization.stage -1", "must be >= 0"]),
    ({"fp16": {"loss_scale_window": 0}}, ["fp16.loss_scale_window 0", "must be >= 1"]),
    ({"fp16": {"loss_scale": -1}}, ["fp16.loss_scale -1", "must be >= 0"]),
    ({"fp16": {"loss_scale": float("inf")}}, ["fp16.loss_scale Infinity", "finite"]),
    ({"fp16": {"hysteresis": 0}}, ["fp16.hysteresis 0", "must be >= 1"]),
    ({"fp16": {"min_loss_scale": 0}}, ["fp16.min_loss_scale 0", "must be > 0"]),
    ({"fp16": {"initial_scale_power": -1}}, ["fp16.initial_scale_power -1", "must be >= 0"]),
    ({"gradient_predivide_factor": 0}, ["gradient_predivide_factor 0", "must be > 0"]),
    ({"steps_per_print": 0}, ["steps_per_print 0", "must be >= 1"]),
]


@pytest.mark.parametrize("patch, fragments", WRONG_TYPES + OUT_OF_RANGE)
def test_bad_values_name_the_dotted_key_and_the_value(patch, fragments):
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({MB: 2, **patch}, world_size=2, source="ds.json")
    message = str(caught.value)
    assert message.startswith("ds.json: ")
    for fragment in fragments:
        assert fragment in message
    assert "pydantic" not in message.lower() and "validation error" not in message.lower()
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({MB: 2, "fp16": {"enabled": "yes", "loss_scale_window": 0}}, world_size=1)
    assert "fp16.enabled" in str(caught.value) and "fp16.loss_scale_window" in str(caught.value)


def test_fp16_and_bf16_together_is_an_error():
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        Config.from_dict({MB: 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, world_size=1)


@pytest.mark.parametrize("world_size", [0, -2, 2.0, True, "2"])
def test_world_size_must_be_a_positive_int(world_size):
    with pytest.raises(ConfigError, match="world_size"):
        Config.from_dict({MB: 1}, world_size=world_size)


def test_config_must_be_a_dict():
    with pytest.raises(ConfigError, match="JSON object"):
        Config.from_dict([{MB: 1}], world_size=1)


# --- defaults and values --------------------------------------------------------------------------


def test_defaults_are_deepspeeds(no_warnings):
    config = Config.from_dict({MB: 1}, world_size=1)
    assert config.gradient_clipping == 1.0  # GRADIENT_CLIPPING_DEFAULT in deepspeed/runtime/constants.py
    assert config.steps_per_print == 10     # DeepSpeed 0.19 says None (never); crew's engine prints
    for never in (None, math.inf):  # an explicit null (DeepSpeed: never), Infinity (what Accelerate writes)
        assert Config.from_dict({MB: 1, "steps_per_print": never}, world_size=1).steps_per_print == math.inf
    assert (config.prescale_gradients, config.gradient_predivide_factor) == (False, 1.0)
    assert (config.wall_clock_breakdown, config.dataloader_drop_last) == (False, False)
    assert config.optimizer is None and config.scheduler is None
    assert config.fp16.model_dump() == {
        "enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
        "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
    assert config.bf16.enabled is False and config.zero_optimization.stage == 0
    assert (config.world_size, config.source) == (1, "<dict>")


def test_values_are_read(no_warnings):
    data = {TB: 16, MB: 2, "steps_per_print": 5, "gradient_clipping": 0, "prescale_gradients": True,
            "gradient_predivide_factor": 2, "wall_clock_breakdown": True, "dataloader_drop_last": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 8, "loss_scale_window": 50,
                     "hysteresis": 1, "consecutive_hysteresis": True, "min_loss_scale": 0.5, "auto_cast": True},
            "zero_optimization": {"stage": 3}}
    config = Config.from_dict(data, world_size=4, source="ds.json")
    assert batch(config) == (16, 2, 2) and config.source == "ds.json"
    assert (config.steps_per_print, config.gradient_clipping, config.gradient_predivide_factor) == (5, 0, 2)
    assert config.prescale_gradients and config.wall_clock_breakdown and config.dataloader_drop_last
    assert ignored_keys(config) == ["prescale_gradients", "gradient_predivide_factor", "wall_clock_breakdown"]
    assert config.optimizer.type == "AdamW" and config.optimizer.params == {"lr": 0.001, "betas": [0.9, 0.95]}
    assert config.scheduler.type == "WarmupLR" and config.scheduler.params == {"warmup_num_steps": 10}
    assert config.fp16.model_dump() == {
        "enabled": True, "auto_cast": True, "loss_scale": 128, "initial_scale_power": 8,
        "loss_scale_window": 50, "hysteresis": 1, "consecutive_hysteresis": True, "min_loss_scale": 0.5}
    assert config.zero_optimization.stage == 3


def test_bfloat16_is_the_legacy_name_of_bf16(no_warnings):
    assert Config.from_dict({MB: 1, "bfloat16": {"enabled": True}}, world_size=1).bf16.enabled is True


def test_bf16_wins_over_bfloat16_like_deepspeed():
    with pytest.warns(ConfigWarning, match="Remove 'bfloat16'"):
        config = Config.from_dict({MB: 1, "bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, 1)
    assert config.bf16.enabled is False
    assert ignored_keys(config) == ["bfloat16"]


@pytest.mark.parametrize("legacy, stage", [(True, 1), (False, 0)])
def test_zero_optimization_as_a_bool_is_deepspeeds_legacy_form(legacy, stage):
    with pytest.warns(ConfigWarning, match="deprecated"):
        config = Config.from_dict({MB: 1, "zero_optimization": legacy}, world_size=1)
    assert config.zero_optimization.stage == stage


def test_other_zero_keys_are_kept(no_warnings):
    config = Config.from_dict({MB: 1, "zero_optimization": {"stage": 2, "overlap_comm": True}}, 1)
    assert config.zero_optimization.model_extra == {"overlap_comm": True}


# --- unknown keys and keys crew does not implement ------------------------------------------------

UNKNOWN = [
    ({"train_batch_sise": 16}, "train_batch_sise", "train_batch_size"),
    ({"gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping"),
    ({"optimiser": {"type": "Adam"}}, "optimiser", "optimizer"),
    ({"tensorbord": {"enabled": True}}, "tensorbord", "tensorboard"),
    ({"fp16": {"enable": True}}, "fp16.enable", "fp16.enabled"),
    ({"fp16": {"loss_scale_windows": 100}}, "fp16.loss_scale_windows", "fp16.loss_scale_window"),
    ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "zero_optimization.stage"),
    ({"zero_optimization": {"offload_optimiser": {}}}, "zero_optimization.offload_optimiser",
     "zero_optimization.offload_optimizer"),
    ({"optimizer": {"type": "Adam", "param": {}}}, "optimizer.param", "optimizer.params"),
    ({"completely_unrelated_xyz": 1}, "completely_unrelated_xyz", None),
]


@pytest.mark.parametrize("patch, key, suggestion", UNKNOWN)
def test_unknown_keys_warn_with_did_you_mean(patch, key, suggestion, caplog):
    with pytest.warns(ConfigWarning) as record, caplog.at_level(logging.WARNING, logger="crew.runtime.config"):
        Config.from_dict({MB: 1, **patch}, world_size=1, source="ds.json")
    messages = [str(w.message) for w in record if issubclass(w.category, ConfigWarning)]
    assert len(messages) == 1 and messages[0].startswith(f"ds.json: unknown key '{key}'")
    if suggestion:
        assert messages[0].endswith(f"did you mean '{suggestion}'?")
    else:
        assert "did you mean" not in messages[0]
    assert record[0].filename == __file__  # the warning points at the caller, not at crew
    assert [r.getMessage() for r in caplog.records] == messages


def test_trls_dotted_keys_are_ignored_silently_and_a_warning_is_logged_once_per_process(caplog, capsys):
    # TRL's prepare_deepspeed writes "zero_optimization.reduce_bucket_size" etc. at the top level; DeepSpeed
    # ignores them without a word. A warning repeated by each engine a script builds is logged once, and
    # Python's own display of ConfigWarning (a second copy of the logged line) is off unless a filter asks.
    dotted = {"zero_optimization.reduce_bucket_size": 1024, "zero_optimization.stage3_prefetch_bucket_size": 9.0}
    with warnings.catch_warnings(record=True) as record, caplog.at_level(logging.WARNING,
                                                                         logger="crew.runtime.config"):
        warnings.simplefilter("always")
        Config.from_dict({MB: 1, **dotted}, world_size=1)
        assert record == [] and caplog.records == []
        for _ in range(2):
            Config.from_dict({MB: 1, "zero_optimisation_typo_once": 1}, world_size=1)
    assert len(record) == 2  # programs that record ConfigWarning still get every one
    assert [r.getMessage() for r in caplog.records] == ["<dict>: unknown key 'zero_optimisation_typo_once' is "
                                                        "ignored; did you mean 'zero_optimization'?"]
    warnings.warn("shown?", ConfigWarning, stacklevel=1)  # the module's default filter: not displayed
    assert "shown?" not in capsys.readouterr().err


DEEPSPEED_ONLY = [
    ("flops_profiler", {"enabled": False}),
    ("timers", {"throughput": {"enabled": True}}),
    ("comms_logger", {"enabled": False}), ("aio", {"block_size": 1048576}), ("autotuning", {"enabled": False}),
    ("amp", {"enabled": False}), ("elasticity", {"enabled": False}),
    ("compression_training", {}), ("data_efficiency", {"enabled": False}), ("sparse_attention", {"mode": "fixed"}),
    ("pipeline", {"stages": "auto"}), ("comet", {"enabled": False}),
    ("zero_allow_untested_optimizer", True), ("memory_breakdown", False), ("torch_autocast", {"enabled": False}),
]


@pytest.mark.parametrize("key, value", DEEPSPEED_ONLY)
def test_deepspeed_keys_crew_does_not_implement_are_accepted_and_listed(key, value, no_warnings):
    config = Config.from_dict({MB: 1, key: value}, world_size=1)
    assert ignored_keys(config) == [key]


def test_ignored_keys_inside_sections_in_the_users_order(no_warnings):
    data = {"flops_profiler": {}, MB: 1, "fp16": {"enabled": True, "fused_mode": True},
            "bf16": {"immediate_grad_update": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "sub_group_size": 5},
            "activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": False}}
    assert ignored_keys(Config.from_dict(data, world_size=1)) == [
        "flops_profiler", "fp16.fused_mode", "bf16.immediate_grad_update",
        "zero_optimization.sub_group_size",  # offload_optimizer: crew/runtime/zero/ reads it
        "activation_checkpointing.partition_activations"]  # deepspeed.checkpointing reads the rest


def test_a_plain_config_ignores_nothing(no_warnings):
    assert ignored_keys(Config.from_dict({MB: 1, "fp16": {"enabled": True}}, world_size=1)) == []


@pytest.mark.parametrize("patch, key, field", [
    ({"gradient_clipping": "auto"}, "gradient_clipping", lambda c: c.gradient_clipping == 1.0),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled", lambda c: c.fp16.enabled is False),
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage", lambda c: c.zero_optimization.stage == 0),
])
def test_auto_elsewhere_warns_and_keeps_the_default(patch, key, field):
    with pytest.warns(ConfigWarning, match=f'{key} is "auto"'):
        config = Config.from_dict({MB: 1, **patch}, world_size=1)
    assert field(config)


def test_auto_in_keys_crew_does_not_implement_is_left_alone(no_warnings):
    config = Config.from_dict({MB: 1, "zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}, 1)
    assert config.zero_optimization.model_extra == {"allgather_bucket_size": "auto"}


# --- the user's dict ------------------------------------------------------------------------------


def test_the_users_dict_is_not_mutated():
    data = {TB: "auto", MB: 2, "zero_optimization": True, "bfloat16": {"enabled": True},
            "fp16": {"enabled": "auto", "fused_mode": True}, "gradient_clipping": "auto",
            "optimizer": {"type": "Adam", "params": {"lr": "auto"}}, "typo_key": 1}
    before = copy.deepcopy(data)
    with pytest.warns(ConfigWarning):
        config = Config.from_dict(data, world_size=2)
    assert data == before
    assert config.raw == before and config.raw is not data and config.raw["fp16"] is not data["fp16"]
    config.raw["fp16"]["enabled"] = True
    data["optimizer"]["params"]["lr"] = 1.0
    assert data["fp16"]["enabled"] == "auto" and config.optimizer.params["lr"] == "auto"


# --- load_config ----------------------------------------------------------------------------------


@pytest.fixture
def ds_json(tmp_path: Path) -> Path:
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}')
    return path


def test_load_config_from_a_dict():
    config = load_config({MB: 2}, world_size=4)
    assert batch(config) == (8, 2, 1) and config.source == "<dict>" and config.world_size == 4


@pytest.mark.parametrize("as_type", [str, Path])
def test_load_config_from_a_path(ds_json, as_type):
    config = load_config(as_type(ds_json), world_size=2)
    assert batch(config) == (12, 3, 2) and config.source == str(ds_json)


def test_load_config_params_when_no_config():
    assert load_config(config_params={MB: 5}).train_micro_batch_size_per_gpu == 5


def test_load_config_prefers_config_over_config_params():
    assert load_config({MB: 1}, config_params={MB: 5}).train_micro_batch_size_per_gpu == 1


def test_load_config_from_args(ds_json):
    args = argparse.Namespace(deepspeed=True, deepspeed_config=str(ds_json), local_rank=0)
    before = vars(args).copy()
    config = load_config(args=args, world_size=1)
    assert batch(config) == (6, 3, 2) and config.source == str(ds_json)
    assert vars(args) == before


@pytest.mark.parametrize("kwargs, argument", [({"config": {MB: 1}}, "config="),
                                              ({"config_params": {MB: 1}}, "config_params=")])
def test_load_config_refuses_a_config_given_twice(ds_json, kwargs, argument):
    args = argparse.Namespace(deepspeed_config=str(ds_json))
    with pytest.raises(ConfigError) as caught:
        load_config(args=args, **kwargs)
    message = str(caught.value)
    assert "--deepspeed_config" in message and str(ds_json) in message and argument in message
    assert "Drop one" in message


@pytest.mark.parametrize("args", [None, argparse.Namespace(deepspeed_config=None), object()])
def test_load_config_args_without_a_config_are_fine(args):
    assert load_config({MB: 1}, args=args).train_micro_batch_size_per_gpu == 1


@pytest.mark.parametrize("args", [None, argparse.Namespace(deepspeed=True, deepspeed_config=None)])
def test_load_config_without_any_config_says_how_to_pass_one(args):
    with pytest.raises(ConfigError) as caught:
        load_config(args=args)
    assert "--deepspeed_config" in str(caught.value) and "config=" in str(caught.value)


def test_load_config_reads_the_legacy_deepscale_config(ds_json):
    args = argparse.Namespace(deepscale_config=str(ds_json), deepspeed_config=None)
    before = vars(args).copy()
    with pytest.warns(ConfigWarning, match="deprecated"):
        assert load_config(args=args).gradient_accumulation_steps == 2
    assert vars(args) == before


def test_load_config_refuses_deepscale_and_deepspeed_config(ds_json):
    args = argparse.Namespace(deepscale_config=str(ds_json), deepspeed_config=str(ds_json))
    with pytest.raises(ConfigError, match="drop --deepscale_config"):
        load_config(args=args)


def test_load_config_accepts_a_config_and_re_resolves_it_for_another_world_size():
    config = load_config({TB: 16}, world_size=2)
    assert load_config(config, world_size=2) is config
    assert batch(load_config(config, world_size=4)) == (16, 4, 1)


def test_load_config_refuses_other_types():
    with pytest.raises(ConfigError, match="path or a dict, got int"):
        load_config(5)


@pytest.mark.parametrize("text, fragments", [
    ('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true},,\n}', ["line 3, column 29", "invalid JSON",
                                                                     "nor is it hjson (line 3, column 29"]),
    ("", ["line 1, column 1", "invalid JSON", "the file is empty"]),
    ('{"train_batch_size": 8, "train_batch_size": 16}', ["'train_batch_size' appears twice"]),
    ('[{"train_batch_size": 8}]', ["must be a JSON object", "got a list"]),
])
def test_load_config_file_errors(tmp_path, text, fragments):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(str(path))
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert caught.value.__cause__ is None


def test_a_config_file_is_read_as_hjson_as_deepspeed_reads_it(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text('{\n  // DeepSpeed reads hjson\n  "train_batch_size": 8,\n  "fp16": {enabled: true},\n}')
    assert load_config(path, world_size=1).raw == {"train_batch_size": 8, "fp16": {"enabled": True}}
    monkeypatch.setitem(sys.modules, "hjson", None)  # the optional package missing: the error says so
    with pytest.raises(ConfigError, match=r"line 2, column 3: invalid JSON: .*`pip install hjson`"):
        load_config(path, world_size=1)


def test_load_config_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="no such config file") as caught:
        load_config(str(path))
    assert str(path) in str(caught.value)


def test_load_config_directory(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)


def test_checkpoint_section_keep_last_and_deepspeed_keys():
    config = Config.from_dict({"train_batch_size": 4, "checkpoint": {
        "keep_last": 3, "tag_validation": "Warn"}}, world_size=1)
    assert config.checkpoint.keep_last == 3
    assert ignored_keys(config) == ["checkpoint.tag_validation"]
    assert Config.from_dict({"train_batch_size": 4}, world_size=1).checkpoint.keep_last is None
    with pytest.raises(ConfigError, match="checkpoint.keep_last 0 is out of range"):
        Config.from_dict({"train_batch_size": 4, "checkpoint": {"keep_last": 0}}, world_size=1)


def test_the_engine_page_lists_every_key_without_effect():
    from conftest import REPO

    from crew.runtime import config as module

    page = (REPO / "docs" / "engine.md").read_text()  # the manual's list of "config keys ... no effect"
    keys = set(module._DEEPSPEED_ONLY) | set(module._TYPED_NO_EFFECT)
    keys |= {f"{name}.{key}" for name, (_, deepspeed_only) in module._SECTIONS.items()
             if name not in ("zero_optimization", "bfloat16") for key in deepspeed_only}
    assert sorted(key for key in keys if f"`{key}`" not in page) == []
