"""AutoTP tensor-parallel training (crew/runtime/tensor_parallel, DeepSpeed 0.19.8's names) against one process.

A tiny Llama (4 heads, 2 kv heads) trains 3 AdamW steps split over TP groups of 2; every rank's loss and every
whole weight afterwards (gathered from the slices) must equal one process's on the same samples, each data-parallel
group reading its own sample per step. 2 ranks: TP 2 alone (at ZeRO 3 too); 4 ranks: TP 2 x DP 2 at ZeRO 0-3.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import pytest
import torch

from dist import run_parts

SEQ = 8
LR = 0.1
STEPS = 3
TOL = 1e-5


def tiny(kind: str = "llama", **overrides):
    import transformers
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    sizes.update(overrides)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM"),
                             "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
                             "falcon": ("FalconConfig", "FalconForCausalLM"),
                             "mixtral": ("MixtralConfig", "MixtralForCausalLM")}[kind]
    config = getattr(transformers, config_cls)(**sizes)
    return getattr(transformers, model_cls)(config)


def samples(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, SEQ), generator=generator) for _ in range(count)]


def reference(model, data: list[torch.Tensor], dp: int, clip: float = 0.0) -> dict:
    """One process: STEPS AdamW steps, step s on the mean loss of samples [s*dp, (s+1)*dp)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        batch = [model(input_ids=x, labels=x).loss for x in data[step * dp:(step + 1) * dp]]
        losses.append([loss.item() for loss in batch])
        torch.stack(batch).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def config(world: int, tp: int = 2, stage: int = 0, zero: dict | None = None, **extra) -> dict:
    base = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1,  # DeepSpeed counts every rank
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, **(zero or {})}, "tensor_parallel": {"autotp_size": tp}}
    return {**base, **extra}


def reset() -> None:
    from crew.runtime import parallel
    from crew.runtime.tensor_parallel import setup
    parallel.reset()
    setup.reset()


def differences(engine, ref_state: dict) -> float:
    from crew.runtime.tensor_parallel import gather_full
    worst = 0.0
    for name, param in engine.module.named_parameters():
        whole = gather_full(param)
        worst = max(worst, (whole - ref_state[name]).abs().max().item())
    return worst


def train(rank: int, stage: int, tp: int = 2, clip: float = 0.0, kind: str = "llama",
          client_optimizer: bool = False, gas: int = 1, sizes: dict | None = None, zero: dict | None = None,
          under_init: bool = False) -> dict:
    """STEPS steps under TP `tp`; this rank's losses minus the reference's, and the largest weight difference."""
    import torch.distributed as dist

    import crew.deepspeed as deepspeed
    from crew.deepspeed.utils import groups
    reset()
    deepspeed.init_distributed("gloo")
    world = dist.get_world_size()
    dp = world // tp
    model = tiny(kind, **(sizes or {}))
    if under_init:  # partitioned as it is built; the reference starts from its values, gathered
        with deepspeed.zero.Init():
            built = tiny(kind, **(sizes or {}))
        assert all(deepspeed.zero.partition_parameters.is_partitioned(p) for p in built.parameters())
        with deepspeed.zero.GatheredParameters(list(built.parameters())):
            model.load_state_dict({name: value.clone() for name, value in built.state_dict().items()})
    data = samples(STEPS * dp * gas)
    ref = reference(model, data, dp * gas, clip)
    model = built if under_init else model
    # crew, as DeepSpeed, clips at 1.0 unless told
    cfg = config(world, tp, stage, zero, gradient_clipping=clip, train_batch_size=world * gas,
                 gradient_accumulation_steps=gas)
    optimizer, args = None, None
    if client_optimizer:  # tp_model_init, then the optimizer over the whole model's parameters, and the config
        deepspeed.tp_model_init(model, tp_size=tp, dtype=torch.float32, config=cfg)  # from --deepspeed_config
        cfg = {k: v for k, v in cfg.items() if k not in ("tensor_parallel", "optimizer")}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        path = Path(tempfile.mkdtemp()) / "ds_config.json"
        path.write_text(json.dumps(cfg))
        args = argparse.Namespace(deepspeed_config=str(path))
    # Trainer's way: a list of the whole model's parameters, taken before initialize splits them
    engine, built, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                               config=None if args else cfg,
                                               model_parameters=None if optimizer else list(model.parameters()))
    errors = []
    for step in range(STEPS):
        for micro in range(gas):
            index = micro * dp + rank // tp  # within the step's dp * gas samples
            x = data[step * dp * gas + index]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            errors.append(abs(loss.item() - ref["losses"][step][index]))
    split = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    pieces = {name: tuple(p.to_local().shape) for name, p in engine.module.named_parameters()
              if hasattr(p, "to_local")}  # stage 3: this rank's piece of its TP slice
    return {"loss": max(errors), "weights": differences(engine, ref["state"]), "shapes": split, "bytes": nbytes,
            "pieces": pieces,
            "mp": engine.mp_world_size, "dp": engine.dp_world_size, "autotp": engine.autotp_size(),
            "norm": float(engine.get_global_grad_norm()), "src": groups._get_broadcast_src_rank(),
            "steps_the_module": {id(p) for g in built.param_groups for p in g["params"]}
            == {id(p) for p in engine.module.parameters()}, "config_kept": "tensor_parallel" in cfg}


def by_specs(rank: int, kind: str, section: dict, sizes: dict, stage: int = 0) -> dict:
    """TP 2 split by layer specs (the section's preset_model / partition_config, or the model's tp_plan): STEPS steps
    against one process; each parameter's shape, and whether gate_up_proj holds its half of gate and of up."""
    import crew.deepspeed as deepspeed
    reset()
    deepspeed.init_distributed("gloo")
    model = tiny(kind, **sizes)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    data = samples(STEPS)
    ref = reference(model, data, 1)
    cfg = config(2, stage=stage, zero=SHARD_ALL if stage == 3 else None, gradient_clipping=0.0) | {
        "tensor_parallel": {"autotp_size": 2, **section}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    fused = "model.layers.0.mlp.gate_up_proj.weight"
    halves = None
    if fused in initial and stage == 0:  # DeepSpeed's sub-parameter rule, replayed: [gate; up] -> [gate's half r;
        mine = [part.chunk(2)[rank] for part in initial[fused].chunk(2)]  # up's half r]
        halves = torch.equal(dict(engine.module.named_parameters())[fused], torch.cat(mine))
    errors = []
    for step in range(STEPS):
        x = data[step]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        errors.append(abs(loss.item() - ref["losses"][step][0]))
    shapes = {name: (tuple(p.shape), tuple(ref["state"][name].shape)) for name, p in engine.module.named_parameters()}
    result = {"loss": max(errors), "weights": differences(engine, ref["state"]), "shapes": shapes, "halves": halves}
    reset()
    return result


def errors(rank: int) -> dict:
    """Each bad set-up's message (the same on both ranks), or None where it did not fail."""
    import crew.deepspeed as deepspeed
    from crew.runtime import parallel
    deepspeed.init_distributed("gloo")
    found = {}

    def attempt(name, model, cfg, before=None):
        reset()
        if before is not None:
            before()
        try:
            deepspeed.initialize(model=model, config=cfg)
            found[name] = None
        except Exception as exc:
            found[name] = f"{type(exc).__name__}: {exc}"

    attempt("world", tiny(), config(2, tp=3) | {"train_batch_size": 2})
    attempt("kv_heads", tiny(num_key_value_heads=1), config(2))
    attempt("unknown", torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)), config(2))
    attempt("mics", tiny(), config(2, stage=3, zero={"mics_shard_size": 1}))
    attempt("with_sp", tiny(), config(2), before=lambda: parallel.init_sequence_parallel(2))
    attempt("partition_config", tiny(), config(2) | {"tensor_parallel": {
        "autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": [".*"], "shape": [3, -1]}]}}})
    attempt("typo", tiny(), config(2) | {"tensor_parallel": {"autotp_size": 2, "tp_overlap": True}})
    attempt("fused", tiny("phi3", pad_token_id=0), config(2))
    model = tiny()
    attempt("conflict", model, config(2, tp=1), before=lambda: deepspeed.tp_model_init(model, 2, torch.float32))
    reset()
    engine, *_ = deepspeed.initialize(model=tiny(), config=config(2))
    x = samples(2)[rank]  # a different sample on each rank of the TP group
    try:
        engine(input_ids=x, labels=x)
        found["inputs"] = None
    except Exception as exc:
        found["inputs"] = f"{type(exc).__name__}: {exc}"
    reset()
    return found


def offloaded(rank: int) -> dict:
    """Stage 3 with offload_optimizer and offload_param (FSDP2's CPUOffloadPolicy), taken on CPU ranks too."""
    from crew.runtime import zero
    zero.OFFLOAD_ON_CPU = True
    offload = {"device": "cpu", "pin_memory": False}  # pinning needs a GPU
    try:
        return train(rank, 3, 2, 1.0, zero={**SHARD_ALL, "offload_optimizer": offload, "offload_param": offload})
    finally:
        zero.OFFLOAD_ON_CPU = False


def modified(rank: int) -> dict:
    """Stage 3, TP 2 x DP 2: GatheredParameters(modifier_rank=1) keeps data-parallel rank 1's changes (DeepSpeed's
    meaning under TP: a rank of the parameter's data-parallel group), each TP slice within its own group."""
    import crew.deepspeed as deepspeed
    from crew.runtime.tensor_parallel import gather_full
    reset()
    deepspeed.init_distributed("gloo")
    engine, *_ = deepspeed.initialize(model=tiny(), config=config(4, stage=3, zero=SHARD_ALL))
    weights = [engine.module.model.layers[0].self_attn.q_proj.weight, engine.module.model.norm.weight]
    before = [gather_full(w) for w in weights]
    with deepspeed.zero.GatheredParameters(weights, modifier_rank=1):
        whole = [tuple(w.shape) for w in weights]
        for w in weights:
            w.data.add_(1.0 + rank)  # rank 2 and 3 are data-parallel rank 1 of their TP slice
    (q_added, norm_added) = [gather_full(w) - b for w, b in zip(weights, before)]
    reset()
    return {"whole": whole, "q": [half.round().unique().tolist() for half in q_added.chunk(2)],
            "norm": norm_added.round().unique().tolist()}


def loader(rank: int) -> list:
    """initialize(training_data=...) under TP 2 on 2 ranks: both ranks of the TP group read the same samples."""
    import crew.deepspeed as deepspeed
    reset()
    deepspeed.init_distributed("gloo")
    data = [samples(4)[i][0] for i in range(4)]
    cfg = config(2) | {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}
    engine, _, loader, _ = deepspeed.initialize(model=tiny(), config=cfg, training_data=data)
    batches = [batch.clone() for batch in loader]
    loss = engine(input_ids=batches[0], labels=batches[0]).loss  # passes the TP group's input check
    reset()
    return [batches, loss.item()]


# stage 3: FSDP2 shards each TP slice over the dp group (threshold 0: every parameter, as in a large model), and
# with the default threshold keeps this tiny model's slices whole, reducing their gradients over the dp group
SHARD_ALL = {"stage3_param_persistence_threshold": 0}
TWO = {"llama": (train, 0), "clipped": (train, 0, 2, 1.0), "client": (train, 0, 2, 0.0, "llama", True),
       "qwen2": (train, 0, 2, 0.0, "qwen2"), "qwen3": (train, 0, 2, 0.0, "qwen3"), "errors": (errors,),
       "loader": (loader,), "whole": (train, 0, 1),
       # lm_head tied to the embedding (kept whole), biases on the row-parallel o_proj/down_proj (added once)
       "tied_biased": (train, 0, 2, 0.0, "llama", False, 1,
                       {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
       # dp 1: FSDP2 over one rank; Qwen3's q_norm / k_norm (hooked: summed over TP) stay whole, the rest sharded
       "stage3_qwen3": (train, 3, 2, 0.0, "qwen3", False, 1, None, SHARD_ALL)}
# layer specs: Phi-3's fused gate_up_proj as two sub-parameters (attention whole, as DeepSpeed needs for Phi-3);
# GPT-NeoX by its Hugging Face tp_plan (fused query_key_value by column); Falcon (no tp_plan) by DeepSpeed's
# parser; Qwen3 by preset "qwen2" with a spec in
# front of it for lm_head (q_norm / k_norm gradients summed: DeepSpeed's preset leaves them to drift apart)
PHI3_MLP = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.self_attn\..*"], "partition_type": "skip"},
    {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
     "partition_dim": 0}]}
HEAD = {"layer_specs": [{"patterns": [r"^lm_head\.weight$"], "partition_type": "column", "gather_output": True}]}
TWO.update({"phi3_fused_mlp": (by_specs, "phi3", {"partition_config": PHI3_MLP},
                               {"num_key_value_heads": 4, "pad_token_id": 0}),
            "phi3_fused_mlp_stage3": (by_specs, "phi3", {"partition_config": PHI3_MLP},
                                      {"num_key_value_heads": 4, "pad_token_id": 0}, 3),
            "gpt_neox_tp_plan": (by_specs, "gpt_neox", {}, {}),
            "falcon_heuristic": (by_specs, "falcon", {}, {"multi_query": False, "bias": True,
                                                         "tie_word_embeddings": False}),
            "qwen3_preset_merged": (by_specs, "qwen3", {"preset_model": "qwen2", "partition_config": HEAD}, {}),
            # preset "mixtral" on transformers 5's Mixtral: its experts are 3-D tensors, whole (as DeepSpeed's)
            "mixtral_preset": (by_specs, "mixtral", {"preset_model": "mixtral"}, {"num_local_experts": 2})})
# stage 0: DDP over the dp group; stage 1 accumulating 2 micro steps, stage 2 clipping (its norm over dp and tp)
FOUR = {"stage0": (train, 0), "stage1_accumulating_clipped": (train, 1, 2, 1.0, "llama", False, 2),
        "stage2_clipped": (train, 2, 2, 1.0),
        "stage3_clipped": (train, 3, 2, 1.0, "llama", False, 1, None, SHARD_ALL),
        "stage3_whole_slices_accumulating": (train, 3, 2, 0.0, "llama", False, 2), "modified": (modified,),
        "stage3_offloaded_clipped": (offloaded,),
        # built under zero.Init; clipped with slices both whole (up to 4096 elements) and sharded: the norm's mix
        "stage3_zero_init_mixed_clipped": (train, 3, 2, 1.0, "llama", False, 1, None,
                                           {"stage3_param_persistence_threshold": 4096}, True)}


@pytest.fixture(scope="module")
def two():
    return run_parts(TWO, 2)


@pytest.fixture(scope="module")
def four():
    return run_parts(FOUR, 4)


@pytest.mark.parametrize("part", ["llama", "clipped", "client", "qwen2", "qwen3", "tied_biased", "stage3_qwen3"])
def test_tp2_trains_as_one_process(two, part):
    for result in two[part]:
        assert result["loss"] < TOL and result["weights"] < TOL, result
        assert (result["mp"], result["dp"], result["autotp"]) == (2, 1, 2)


def test_each_split_linear_holds_half_its_weight(two):
    split, whole = two["llama"][0], two["whole"][0]
    for name, shape in whole["shapes"].items():
        leaf = name.split(".")[-2]
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"):
            assert split["shapes"][name] == (shape[0] // 2, shape[1]), name
        elif leaf in ("o_proj", "down_proj"):
            assert split["shapes"][name] == (shape[0], shape[1] // 2), name
        else:  # embeddings and norms: whole on every rank
            assert split["shapes"][name] == shape, name
    assert split["bytes"] < 0.6 * whole["bytes"]


def test_gradient_clipping_uses_the_whole_models_norm(two):
    norms = {result["norm"] for result in two["clipped"]}
    assert len(norms) == 1 and norms.pop() > 1.0  # the norm before clipping: clipping did act


def test_an_optimizer_built_before_initialize_steps_the_slices(two):
    assert all(result["steps_the_module"] for result in two["client"])  # the slices, not the whole weights
    assert not any(result["config_kept"] for result in two["client"])  # tp_model_init merged into a copy


def test_stage3_shards_each_tp_slice_over_the_data_parallel_group(two, four):
    dp2, dp1 = four["stage3_clipped"][0], two["stage3_qwen3"][0]
    assert dp2["pieces"]["model.layers.0.self_attn.q_proj.weight"] == (16, 64)  # 64 rows / TP 2 / DP 2
    assert dp2["pieces"]["model.layers.0.self_attn.o_proj.weight"] == (32, 32)  # 64 columns / TP 2; rows / DP 2
    assert dp2["pieces"]["model.norm.weight"] == (32,)
    assert "model.layers.0.self_attn.q_norm.weight" not in dp1["pieces"]  # hooked: whole, the hook kept
    assert dp1["pieces"]["model.layers.0.mlp.down_proj.weight"] == (64, 64)  # 128 columns / TP 2, DP 1
    assert four["stage3_whole_slices_accumulating"][0]["pieces"] == {}  # the default threshold: all whole
    mixed = four["stage3_zero_init_mixed_clipped"][0]["pieces"]
    assert "model.layers.0.self_attn.q_proj.weight" not in mixed and mixed["model.embed_tokens.weight"] == (64, 64)


def test_gathered_parameters_keep_the_modifier_data_parallel_ranks_changes(four):
    for rank, result in enumerate(four["modified"]):
        assert result["whole"] == [(32, 64), (64,)]  # this rank's TP slice whole, the norm whole
        # data-parallel rank 1 of each TP slice's group ({0, 2}: rank 2, +3; {1, 3}: rank 3, +4) on every rank
        assert result["q"] == [[3.0], [4.0]] and result["norm"] == [3.0 + rank % 2]


@pytest.mark.parametrize("part", [part for part in FOUR if part != "modified"])
def test_tp2_dp2_zero_trains_as_one_process(four, part):
    for result in four[part]:
        assert result["loss"] < TOL and result["weights"] < TOL, result
        assert (result["mp"], result["dp"]) == (2, 2)
    # DeepSpeed's broadcast source: the first rank of each rank's data-parallel group ({0, 2} and {1, 3})
    assert [result["src"] for result in four[part]] == [0, 1, 0, 1]


@pytest.mark.parametrize("name, words", [
    ("world", ["tensor_parallel.autotp_size = 3", "2 ranks"]),
    ("kv_heads", ["num_key_value_heads (1", "autotp_size"]),
    ("unknown", ["AutoTP does not know", "Sequential", "'0' (Linear)"]),
    ("mics", ["zero_optimization.mics_shard_size with tensor_parallel.autotp_size"]),
    ("with_sp", ["one of Ulysses sequence parallelism and AutoTP"]),
    ("partition_config", ["tensor_parallel.partition_config", "'model.embed_tokens' (Embedding", "\"skip\""]),
    ("typo", ["tensor_parallel.tp_overlap", "Did you mean 'tp_overlap_comm'?"]),
    ("inputs", ["Data inconsistency within the TP group", "ranks [0, 1]"]),
    ("fused", ["Phi3ForCausalLM's Hugging Face tp_plan uses ['rowwise_split_input']", "partition_config"]),
    ("conflict", ["tensor_parallel.autotp_size in config (1) and tp_model_init (2)"]),
])
def test_bad_set_ups_fail_with_a_clear_message(two, name, words):
    for found in two["errors"]:
        assert found[name] is not None and all(word in found[name] for word in words), found[name]


def test_the_loader_gives_a_tp_group_the_same_samples(two):
    (first, loss_first), (second, loss_second) = two["loader"]
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, second))
    assert loss_first == loss_second


@pytest.mark.parametrize("part", ["phi3_fused_mlp", "phi3_fused_mlp_stage3", "gpt_neox_tp_plan",
                                  "falcon_heuristic", "qwen3_preset_merged", "mixtral_preset"])
def test_a_split_by_layer_specs_trains_as_one_process(two, part):
    for result in two[part]:
        assert result["loss"] < TOL and result["weights"] < TOL, result


def test_layer_specs_split_what_deepspeed_splits(two):
    """The shapes DeepSpeed 0.19.8 gives each rank (its checkpoints of the same models, tensor_parallel_data/)."""
    phi3, neox, qwen3 = (two[part][0]["shapes"] for part in ("phi3_fused_mlp", "gpt_neox_tp_plan",
                                                              "qwen3_preset_merged"))
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"] == ((128, 64), (256, 64))
    assert phi3["model.layers.0.mlp.down_proj.weight"] == ((64, 64), (64, 128))
    assert all(mine == whole for name, (mine, whole) in phi3.items() if "self_attn" in name or "lm_head" in name)
    assert [result["halves"] for result in two["phi3_fused_mlp"]] == [True, True]
    layer = "gpt_neox.layers.0."
    assert neox[layer + "attention.query_key_value.weight"] == ((96, 64), (192, 64))
    assert neox[layer + "attention.query_key_value.bias"] == ((96,), (192,))
    assert neox[layer + "attention.dense.weight"] == ((64, 32), (64, 64))
    assert neox[layer + "attention.dense.bias"] == ((64,), (64,))  # row: whole, added once
    assert neox["lm_head.weight"] == ((64, 64), (128, 64)) and neox["gpt_neox.embed_in.weight"][0] == (128, 64)
    falcon, layer = two["falcon_heuristic"][0]["shapes"], "transformer.h.0."
    assert falcon[layer + "self_attention.query_key_value.weight"] == ((96, 64), (192, 64))
    assert falcon[layer + "self_attention.dense.weight"] == ((64, 32), (64, 64))
    assert falcon[layer + "mlp.dense_h_to_4h.weight"] == ((128, 64), (256, 64))
    assert falcon[layer + "mlp.dense_4h_to_h.weight"] == ((64, 128), (64, 256))
    assert falcon["lm_head.weight"] == ((128, 64), (128, 64))  # whole: DeepSpeed's parser leaves it in training
    assert qwen3["lm_head.weight"] == ((64, 64), (128, 64))  # the spec in front of the preset
    mixtral = two["mixtral_preset"][0]["shapes"]  # measured under DeepSpeed 0.19.8: the attention split, all else whole
    assert mixtral["model.layers.0.self_attn.q_proj.weight"] == ((32, 64), (64, 64))
    assert mixtral["model.layers.0.self_attn.o_proj.weight"] == ((64, 32), (64, 64))
    assert all(mine == whole for name, (mine, whole) in mixtral.items() if "self_attn" not in name)
    mine, whole = qwen3["model.layers.0.self_attn.q_proj.weight"]
    assert mine == (whole[0] // 2, whole[1])
    norm = qwen3["model.layers.0.self_attn.q_norm.weight"]
    assert norm[0] == norm[1]  # whole, its gradient summed over the TP group (else the weights above would differ)
