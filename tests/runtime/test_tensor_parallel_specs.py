"""AutoTP's layer specs without processes: `tensor_parallel.partition_config` / `preset_model` (specs.py), fused
sub-parameter slices (subparams.py) and what a model is split by (autotp.partitioning, spec_split.check).

DeepSpeed 0.19.8's own output is the reference: its presets (tensor_parallel_data/presets.json) and a real
DeepSpeed AutoTP checkpoint of Phi-3 with gate_up_proj split as [2, -1] (tensor_parallel_data/phi3_partition_config),
both made by tensor_parallel_data/make_fixtures.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crew.errors import ConfigError
from crew.runtime.tensor_parallel import autotp, spec_split, specs
from crew.runtime.tensor_parallel.config import parse
from crew.runtime.tensor_parallel.subparams import weight_layout

DATA = Path(__file__).parent / "checkpoint" / "tensor_parallel_data"
GATE_UP = "model.layers.0.mlp.gate_up_proj.weight"


def _tuples(shape):
    return None if shape is None else tuple(tuple(d) if isinstance(d, list) else d for d in shape)


@pytest.mark.parametrize("name", ["llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3"])
def test_every_preset_is_deepspeeds(name):
    theirs = json.loads((DATA / "presets.json").read_text())[name]
    ours = specs.resolve(name, None).layer_specs
    assert [(s.patterns, s.partition_type, s.shape, s.partition_dim, s.gather_output, s.grad_allreduce)
            for s in ours] == [(tuple(t["patterns"]), t["partition_type"], _tuples(t["shape"]), t["partition_dim"],
                                t["gather_output"], t["grad_allreduce"]) for t in theirs]


def test_a_partition_config_goes_in_front_of_the_preset_unless_use_default_specs_is_false():
    mine = {"patterns": [r"^lm_head\.weight$"], "partition_type": "column", "gather_output": True}
    merged = specs.resolve("llama", {"layer_specs": [mine]})
    assert len(merged.layer_specs) == 5 and merged.layer_specs[0].gather_output
    assert merged.find("lm_head.weight", None).gather_output
    assert merged.find("model.layers.3.self_attn.o_proj.weight", None).partition_type == "row"
    alone = specs.resolve("llama", {"layer_specs": [mine], "use_default_specs": False})
    assert len(alone.layer_specs) == 1 and alone.find("model.layers.3.self_attn.o_proj.weight", None) is None
    typed = specs.parse({"layer_specs": [{"patterns": [".*"], "model_types": ["Llama"]}]})
    assert typed.find("x.weight", "llama") is not None and typed.find("x.weight", "qwen2") is None


@pytest.mark.parametrize("section, words", [
    ({"preset_model": "gpt9"}, ["tensor_parallel.preset_model = 'gpt9'", "phi3"]),
    ({"partition_config": []}, ["tensor_parallel.partition_config", "dictionary"]),
    ({"partition_config": {"layer_specs": {"patterns": []}}}, ["partition_config.layer_specs must be a list"]),
    ({"partition_config": {"layer_specs": [{"patterns": ".*o_proj"}]}},
     ["partition_config.layer_specs[0].patterns must be a list"]),
    ({"partition_config": {"layer_specs": [{"patterns": ["(o_proj"]}]}},
     ["layer_specs[0].patterns: '(o_proj' is not a regular expression"]),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"]}, {"patterns": ["b"], "partition_type": "diagonal"}]}},
     ["layer_specs[1].partition_type = 'diagonal'", "column, row, skip"]),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "shape": [0, -1]}]}},
     ["layer_specs[0].shape = [0, -1]", "-1"]),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "shape": [2, -1], "partition_dim": 2}]}},
     ["layer_specs[0].partition_dim = 2 is out of range for shape [2, -1]"]),
    ({"partition_config": {"layer_specs": [{"patterns": ["a"], "shape": [2, [4, 4]], "partition_dim": 0}]}},
     ["layer_specs[0].shape", "only allowed at partition_dim (0)"]),
    ({"partition_config": {"strict_mode": "yes"}}, ["partition_config.strict_mode = 'yes'", "true or false"]),
])
def test_a_bad_spec_names_its_key(section, words):
    with pytest.raises(ConfigError) as caught:
        parse({"autotp_size": 2, **section})
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_fused_slices_are_deepspeeds():
    """Each rank's gate_up_proj ([2, -1]) in DeepSpeed's checkpoint is crew's cut of the whole weight."""
    whole = torch.load(DATA / "phi3_partition_config" / "expected.pt", weights_only=True)["state_dict"][GATE_UP]
    slices = [torch.load(DATA / "phi3_partition_config" / "t2" / f"mp_rank_0{t}_model_states.pt",
                         weights_only=True)["module"][GATE_UP] for t in range(2)]
    layout = weight_layout(tuple(whole.shape), (2, -1), 0, GATE_UP)
    assert [torch.equal(layout.cut(whole, 2, t), slices[t]) for t in range(2)] == [True, True]
    assert not torch.equal(whole.chunk(2)[0], slices[0])  # not a plain split of the rows
    assert torch.equal(layout.join(slices), whole)


def test_fused_cuts_are_deepspeeds_wherever_they_split_evenly():
    """subparams.json: each rank's slice of arange weights as DeepSpeed 0.19.8's SubParamLinearLayer cuts them, at TP
    2 and 4; where a sub-parameter does not divide, DeepSpeed splits unevenly and crew refuses (spec_split.check)."""
    compared = 0
    for case in json.loads((DATA / "subparams.json").read_text()):
        layout = weight_layout(tuple(case["weight"]), _tuples(case["shape"]), case["dim"], "w")
        if any(size % case["tp"] for size in layout.sizes):
            continue
        whole = torch.arange(case["weight"][0] * case["weight"][1]).reshape(case["weight"])
        assert [layout.cut(whole, case["tp"], t).tolist() for t in range(case["tp"])] == case["slices"], case
        compared += 1
    assert compared == 8


def test_unequal_sub_parameters_are_cut_each_on_its_own():
    """[[4, 2, 2], -1] (q, k, v of a grouped-query attention) on TP 2: each rank q's half, k's and v's."""
    whole = torch.arange(8 * 3).reshape(8, 3)
    layout = weight_layout((8, 3), ((4, 2, 2), -1), 0, "qkv")
    rows = [layout.cut(whole, 2, t)[:, 0] // 3 for t in range(2)]
    assert rows[0].tolist() == [0, 1, 4, 6] and rows[1].tolist() == [2, 3, 5, 7]
    assert torch.equal(layout.join([layout.cut(whole, 2, t) for t in range(2)]), whole)
    columns = weight_layout((3, 8), (-1, (2, 6)), 1, "row")  # a row split of fused inputs
    assert columns.cut(torch.arange(24).reshape(3, 8), 2, 1)[0].tolist() == [1, 5, 6, 7]
    with pytest.raises(ConfigError, match="does not fit the weight of shape"):
        weight_layout((8, 3), ((4, 2, 1), -1), 0, "qkv")


def _tiny(kind: str, **sizes):
    import transformers
    config_cls, model_cls = {"phi3": ("Phi3Config", "Phi3ForCausalLM"), "mixtral": ("MixtralConfig",
                             "MixtralForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
                             "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
                             "falcon": ("FalconConfig", "FalconForCausalLM"),
                             "bloom": ("BloomConfig", "BloomForCausalLM")}[kind]
    config = getattr(transformers, config_cls)(**{"vocab_size": 32, **sizes})
    return getattr(transformers, model_cls)(config)


PHI3 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
            pad_token_id=0)


@pytest.mark.parametrize("kind, sizes, section, words", [
    ("phi3", PHI3, None, ["Phi3ForCausalLM's Hugging Face tp_plan uses ['rowwise_split_input']",
                          "DeepSpeed 0.19.8", "partition_config.layer_specs"]),
    ("mixtral", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=2), None, ["'moe_tp_experts'", "'packed_colwise'"]),
    ("gpt2", dict(n_embd=16, n_layer=1, n_head=4), None, ["GPT2LMHeadModel", "AutoTP not supported",
                                                           "partition_config"]),
    ("bloom", dict(hidden_size=16, n_layer=1, n_head=4), None, ["transformer.h.0.self_attention.query_key_value'",
                                                                 "ALiBi", "DeepSpeed 0.19.8 fails there too"]),
    ("phi3", PHI3, {"preset_model": "phi3"}, ["model.layers.0.self_attn.qkv_proj' (Linear",
                                              "Phi3Attention slices q, k and v", "skip"]),
    ("phi3", PHI3, {"partition_config": {"layer_specs": [{"patterns": [r".*embed_tokens\.weight$"]}]}},
     ["'model.embed_tokens' (Embedding", "is an embedding", "\"skip\""]),
    ("phi3", PHI3, {"partition_config": {"layer_specs": [
        {"patterns": [r".*gate_up_proj\.weight$"], "shape": [2, -1], "gather_output": True}]}},
     ["gather_output with a shape"]),
    ("phi3", PHI3, {"partition_config": {"layer_specs": [
        {"patterns": [r".*gate_up_proj\.weight$"], "shape": [3, -1]}]}}, ["64 rows do not make 3 equal"]),
    ("phi3", PHI3, {"partition_config": {"layer_specs": [
        {"patterns": [r".*gate_up_proj\.weight$"], "shape": [[34, 30], -1]}]}},
     ["a sub-parameter of 34 along dim 0", "autotp_size = 4"]),
    ("phi3", PHI3, {"partition_config": {"strict_mode": True, "layer_specs": [{"patterns": [".*proj.*"]}]}},
     ["partition_config.strict_mode: no layer spec matches 'lm_head.weight'"]),
    ("phi3", PHI3, {"partition_config": {"layer_specs": [{"patterns": [".*lm_head.*"], "partition_type": "row"}]}},
     ["a row-parallel output head"]),
    ("phi3", {**PHI3, "tie_word_embeddings": True}, {"partition_config": {"layer_specs": [
        {"patterns": [r"^lm_head\.weight$"], "partition_type": "column"}]}},
     ["'lm_head' (Linear", "shares its weight with an embedding", "gather_output"]),
])
def test_what_crew_cannot_split_is_refused_before_anything_is(kind, sizes, section, words):
    model = _tiny(kind, **sizes)
    size = 4 if "[34, 30]" in str(section) else 2
    with pytest.raises(ConfigError) as caught:
        autotp.check_model(model, size, parse({"autotp_size": size, **(section or {})}))
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_a_hugging_face_tp_plan_becomes_deepspeeds_specs():
    model = _tiny("gpt_neox", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = autotp.partitioning(model, parse({"autotp_size": 2}))
    split = {path: (spec.partition_type, spec.gather_output) for path, _, spec in spec_split.targets(model, config)}
    assert split == {"gpt_neox.layers.0.attention.query_key_value": ("column", False),
                     "gpt_neox.layers.0.attention.dense": ("row", False),
                     "gpt_neox.layers.0.mlp.dense_h_to_4h": ("column", False),
                     "gpt_neox.layers.0.mlp.dense_4h_to_h": ("row", False), "lm_head": ("column", True)}
    assert autotp.partitioning(_tiny("phi3", **PHI3), parse({"autotp_size": 2, "preset_model": "phi3"})) is not None


def test_deepspeeds_parser_splits_falcon_and_shrinks_its_head_counts():
    """No tp_plan: DeepSpeed's heuristic (the linear before the norm and Falcon's self_attention.dense by row)."""
    sizes = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, bias=True, tie_word_embeddings=False)
    model = _tiny("falcon", multi_query=False, **sizes)
    config = autotp.partitioning(model, parse({"autotp_size": 2}))
    found = spec_split.targets(model, config)
    assert {path: spec.partition_type for path, _, spec in found} == {
        "transformer.h.0.self_attention.query_key_value": "column", "transformer.h.0.self_attention.dense": "row",
        "transformer.h.0.mlp.dense_h_to_4h": "column", "transformer.h.0.mlp.dense_4h_to_h": "row"}
    shrunk = spec_split.shrinkable(model, config, {path for path, _, _ in found})
    assert ("transformer.h.0.self_attention", "num_heads", 4) in shrunk
    assert not any(path in ("transformer", "transformer.h.0") for path, _, _ in shrunk)  # outside the layers' insides
    with pytest.raises(ConfigError, match=r"'transformer.h.0.self_attention'.num_kv_heads \(1\)"):
        autotp.check_model(_tiny("falcon", multi_query=True, **sizes), 2, parse({"autotp_size": 2}))


def test_specs_split_what_deepspeeds_layers_cut_and_check_only_that():
    """Without a shape a column layer cuts rows and a row layer columns whatever partition_dim says (DeepSpeed's
    layers ignore it there): the check is on that dim. Head counts are checked only where a split linear is above
    them, so a model whose attention a spec keeps whole may have 1 key-value head. An empty partition_config is
    none, as DeepSpeed's `if self.partition_config:`."""
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(8, 6)  # 6 rows: not 4 equal parts; 8 columns would be
    sideways = {"layer_specs": [{"patterns": [r"^proj\.weight$"], "partition_type": "column", "partition_dim": 1}]}
    with pytest.raises(ConfigError, match=r"along dim 0 \(6\)"):
        autotp.check_model(model, 4, parse({"autotp_size": 4, "partition_config": sideways}))

    import transformers
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32))
    mlp_only = {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.self_attn\..*"], "partition_type": "skip"},
        {"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.(gate|up)_proj\.weight$"], "partition_type": "column"}]}
    autotp.check_model(llama, 2, parse({"autotp_size": 2, "partition_config": mlp_only}))  # no error
    with pytest.raises(ConfigError, match="num_key_value_heads"):  # split by name: the attention is split
        autotp.check_model(llama, 2, parse({"autotp_size": 2}))
    assert specs.resolve(None, {}) is None and specs.resolve("llama", {}) == specs.resolve("llama", None)
