"""Ulysses sequence parallelism (crew/runtime/ulysses, DeepSpeed's ulysses_sp names) against one process.

A tiny Llama (4 heads, 2 kv heads) trains one step under SP, fed by UlyssesSPDataLoaderAdapter, with the loss
gathered over the SP group as transformers' deepspeed_sp_compute_loss does; its loss, every gradient and the
weights after the step must equal one process's on the same global batch (crew's rule at every ZeRO stage).
The one-process reference is computed in each rank before the wrapper is registered, as registering replaces
transformers' "sdpa" for the whole process.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dist import run_parts

SEQ = 16
LR = 0.1


def tiny_llama(attention: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=256, attn_implementation=attention))


def samples(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, SEQ), generator=generator) for _ in range(count)]


def reference(model, batch: list[torch.Tensor]) -> dict:
    """One process, one SGD step on the mean of the samples' losses."""
    model = copy.deepcopy(model)
    losses = [model(input_ids=x, labels=x).loss for x in batch]
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    after = {name: (p - LR * p.grad).detach() for name, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "after": after}


def restore_sdpa() -> None:
    """Undo register_with_transformers (the next part registers again) and forget the SP layout."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from crew.runtime import parallel
    if "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    parallel.reset()


class ListLoader:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def sp_loss(batch: dict, outputs, group) -> torch.Tensor:
    """transformers' deepspeed_sp_compute_loss: the SP ranks' losses, weighted by their counted tokens, with the
    same differentiable all-gather (its gloo backward fails in a group past rank 0 without crew's gloo_fix)."""
    from torch.distributed.nn.functional import all_gather
    losses = torch.stack(all_gather(outputs.loss, group=group))
    good = (batch["shift_labels"] != -100).view(-1).sum()
    counts = torch.stack(all_gather(good, group=group))
    return (torch.where(counts > 0, losses, torch.zeros_like(losses)) * counts).sum() / counts.sum().clamp(min=1)


def train_sp(rank: int, stage: int, sp: int, variable: bool = True) -> dict:
    """One step under SP `sp` at ZeRO `stage`; the largest differences from the one-process reference.
    variable=False: registered for a fixed seq_length (seq_length_is_variable=False)."""
    import crew
    import crew.deepspeed.utils
    from crew.deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_grad
    from crew.runtime.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    crew.init_distributed("gloo")
    world = torch.distributed.get_world_size()
    model, data = tiny_llama(), samples(world)
    expected = reference(model, data[::sp])  # a micro step: SP rank 0's sample of each SP group
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1,
        seq_length=SEQ, seq_length_is_variable=variable)
    try:
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": LR}},
                  "sequence_parallel_size": sp}
        engine, *_ = crew.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
        mine = {"input_ids": data[rank], "labels": data[rank].clone(), "position_ids": torch.arange(SEQ)[None]}
        group = groups._get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter(ListLoader([mine]), sp_rank=mpu.get_sequence_parallel_rank(),
                                            sp_group=mpu.get_sequence_parallel_group(),
                                            sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu")
        batch = next(iter(loader))
        batch["labels"] = batch["shift_labels"]
        loss = sp_loss(batch, engine(**batch), group)
        engine.backward(loss)
        params = dict(engine.module.named_parameters())
        grads = {name: safe_get_full_grad(p) for name, p in params.items()}
        engine.step()
        after = {name: safe_get_full_fp32_param(p) for name, p in params.items()}
        loss = loss.item()
        # the loss over all SP groups: the mean of the samples' losses
        total = torch.tensor([loss])
        torch.distributed.all_reduce(total)
        layout = (engine.sequence_parallel_size, torch.distributed.get_world_size(engine.seq_parallel_group),
                  engine.dp_world_size, engine.seq_dp_world_size,
                  crew.deepspeed.utils.groups._get_sequence_data_parallel_world_size())
    finally:
        restore_sdpa()
    return {"loss": total.item() / world, "ref_loss": expected["loss"], "layout": layout,
            "grad_error": max(_relative(grads[n], expected["grads"][n]) for n in grads),
            "step_error": max((after[n] - expected["after"][n]).abs().max().item() for n in after),
            "grad_norm": sum(g.norm().item() for g in expected["grads"].values())}


def sp_resume(rank: int, stage: int, sp: int, folder: str) -> dict:
    """Two Adam steps under SP straight, against one step, save_checkpoint, a fresh engine's load_checkpoint and the
    second step: the weights after must be the same, bit for bit, as must the loaded step count and client state."""
    import crew
    from crew.deepspeed.utils import safe_get_full_fp32_param
    from crew.runtime.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    crew.init_distributed("gloo")
    world = torch.distributed.get_world_size()
    data = samples(2 * world)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "sequence_parallel_size": sp}

    def engine_for():
        model = tiny_llama()
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, seq_length=SEQ)
        engine, *_ = crew.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
        return engine, mpu

    def step(engine, mpu, index):
        ids = data[index * world + rank]
        loader = UlyssesSPDataLoaderAdapter(
            ListLoader([{"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)[None]}]),
            sp_rank=mpu.get_sequence_parallel_rank(), sp_group=mpu.get_sequence_parallel_group(),
            sp_world_size=sp, device="cpu")
        batch = next(iter(loader))
        batch["labels"] = batch["shift_labels"]
        engine.backward(sp_loss(batch, engine(**batch), mpu.get_sequence_parallel_group()))
        engine.step()

    def weights(engine):
        return {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}

    try:
        straight, mpu = engine_for()
        step(straight, mpu, 0)
        straight.save_checkpoint(folder, client_state={"seen": 1})
        step(straight, mpu, 1)
        expected = weights(straight)
        restore_sdpa()
        resumed, mpu = engine_for()
        path, client_state = resumed.load_checkpoint(folder)
        loaded_step = resumed.global_steps
        step(resumed, mpu, 1)
        got = weights(resumed)
    finally:
        restore_sdpa()
    moved = max((expected[n] - tiny_llama().state_dict()[n]).abs().max().item() for n in expected)
    return {"differ": [n for n in expected if not torch.equal(expected[n], got[n])], "moved": moved,
            "client_state": client_state, "loaded_step": loaded_step, "path": path}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def eval_bypass(rank: int) -> float:
    """disable_in_eval=True: a model in eval mode attends over each rank's whole batch, as one process."""
    import crew
    from crew.runtime.ulysses import UlyssesSPAttentionHF
    crew.init_distributed("gloo")
    model = tiny_llama().eval()
    x = samples(1)[0]
    with torch.no_grad():
        expected = model(input_ids=x).logits
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, disable_in_eval=True)
        try:
            got = model(input_ids=x, position_ids=torch.arange(SEQ)[None]).logits
        finally:
            restore_sdpa()
    return (got - expected).abs().max().item()


def indivisible(rank: int) -> str:
    from crew.runtime.ulysses import UlyssesSPAttentionHF
    try:
        UlyssesSPAttentionHF.register_with_transformers(tiny_llama(), "sdpa", 3, 1)
    except Exception as error:  # noqa: BLE001 - the test reads it
        return f"{type(error).__name__}: {error}"
    return "no error"


def comm_calls(rank: int) -> dict:
    """deepspeed.comm's calls that Ulysses code makes, on 2 ranks."""
    import crew
    from crew.runtime import comm
    crew.init_distributed("gloo")
    out = torch.empty(2)
    comm.all_to_all_single(out, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    objects = [None, None]
    comm.all_gather_object(objects, {"rank": rank})
    broadcast = [f"from {rank}"]
    comm.broadcast_object_list(broadcast, src=1)
    group = comm.new_group([0, 1])
    return {"swapped": out.tolist(), "objects": objects, "broadcast": broadcast,
            "global": comm.get_global_rank(group, 1), "ranks": comm.get_all_ranks_from_group(group)}


def adapter_batches(rank: int) -> dict:
    """Two ranks' batches of different lengths (8 and 12 tokens) through the adapter, two epochs."""
    import crew
    from crew.runtime import parallel
    from crew.runtime.ulysses import UlyssesSPDataLoaderAdapter
    crew.init_distributed("gloo")
    parallel.init_sequence_parallel(2)
    length = 8 + 4 * rank
    batch = {"input_ids": torch.arange(length)[None] + 100 * rank, "labels": torch.arange(length)[None] + 100 * rank,
             "position_ids": torch.arange(length)[None], "tag": f"from {rank}"}
    loader = UlyssesSPDataLoaderAdapter(ListLoader([batch]), sp_rank=rank, sp_group=parallel.sequence_parallel_group(),
                                        sp_world_size=2, device="cpu")
    try:
        first = list(loader)
        second = list(loader)  # StopIteration reset the wrapped iterator: a second epoch
    finally:
        parallel.reset()
    return {"len": len(loader), "first": first, "second_len": len(second)}


def sp_errors(rank: int) -> dict:
    """Each bad input's message, as seen on every rank (2 ranks)."""
    import crew
    from crew.deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from crew.runtime.ulysses import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    crew.init_distributed("gloo")
    seen = {}

    def message(key, fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - the test reads which and what
            seen[key] = f"{type(error).__name__}: {error}"
        else:
            seen[key] = None

    model = tiny_llama()
    register = UlyssesSPAttentionHF.register_with_transformers
    message("eager", lambda: register(tiny_llama("eager"), "eager", 2, 1))
    message("mismatch", lambda: register(model, "flex_attention", 2, 1))
    message("no config", lambda: register(torch.nn.Linear(2, 2), "sdpa", 2, 1))
    message("fixed length", lambda: register(model, "sdpa", 2, 1, seq_length_is_variable=False))
    message("world < sp", lambda: register(model, "sdpa", 3, 1))
    message("not initialized", mpu.get_sequence_parallel_group)
    seen["size 1"] = register(model, "sdpa", 1, 1)  # SP off: nothing registered, no mpu
    mpu.initialize_sequence_parallel(2)
    group = mpu.get_sequence_parallel_group()
    attention = dict(attn=None, batch_size=1, attn_head_size=16, num_hidden_layers=2, process_group=group)
    message("heads", lambda: UlyssesSPAttentionHF(attn_head_count=3, kv_head_count=1, **attention))
    message("kv heads", lambda: UlyssesSPAttentionHF(attn_head_count=6, kv_head_count=3, **attention))
    wrapper = UlyssesSPAttentionHF(attn_head_count=4, kv_head_count=2, seq_length_is_variable=True, **attention)
    q = torch.zeros(1, 4, 4, 16)
    message("no position_ids", lambda: wrapper(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None))

    def adapt(batch):
        return next(iter(UlyssesSPDataLoaderAdapter(ListLoader([batch]), rank, group, 2, "cpu")))

    ids = torch.arange(15)[None]
    message("seqlen", lambda: adapt({"input_ids": ids, "labels": ids, "position_ids": ids}))
    message("no positions", lambda: adapt({"input_ids": ids, "labels": ids}))
    message("config vs mpu", lambda: crew.initialize(model=tiny_llama(), mpu=mpu, config={
        "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4}))
    restore_sdpa()
    return seen


@pytest.fixture(scope="module")
def two_ranks():
    return run_parts({"stage 0": (train_sp, 0, 2), "stage 3": (train_sp, 3, 2, False), "eval": (eval_bypass,),
                      "adapter": (adapter_batches,), "errors": (sp_errors,), "comm": (comm_calls,)}, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp_resume")
    return run_parts({"sp 2 stage 2": (train_sp, 2, 2), "sp 4 stage 1": (train_sp, 1, 4),
                      "sp 3": (indivisible,), "resume stage 2": (sp_resume, 2, 2, str(folder / "stage2")),
                      "resume stage 3": (sp_resume, 3, 2, str(folder / "stage3"))}, 4)


def assert_equals_one_process(results: list[dict]) -> None:
    for result in results:
        assert result["grad_norm"] > 1e-3  # the check below compares gradients that are there
        assert result["loss"] == pytest.approx(result["ref_loss"], abs=1e-5)
        assert result["grad_error"] < 1e-5
        assert result["step_error"] < 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_two_ranks_sp2_equal_one_process(two_ranks, stage):
    results = two_ranks[f"stage {stage}"]
    assert_equals_one_process(results)
    assert results[0]["layout"] == (2, 2, 1, 2, 2)


@pytest.mark.parametrize("part, layout", [("sp 2 stage 2", (2, 2, 2, 4, 4)), ("sp 4 stage 1", (4, 4, 1, 4, 4))])
def test_four_ranks_equal_one_process(four_ranks, part, layout):
    """SP 2 x DP 2 (a global batch of two samples), and SP 4, where each of the 2 kv heads is replicated."""
    results = four_ranks[part]
    assert_equals_one_process(results)
    assert results[0]["layout"] == layout


@pytest.mark.parametrize("stage", [2, 3])
def test_sp2_dp2_resumes_from_a_checkpoint_bit_for_bit(four_ranks, stage):
    """ZeRO's shards are over all 4 ranks (DeepSpeed's sequence-data-parallel group), the batch over 2."""
    for result in four_ranks[f"resume stage {stage}"]:
        assert result["moved"] > 1e-3  # the steps changed the weights being compared
        assert result["differ"] == []
        assert result["loaded_step"] == 1 and result["client_state"] == {"seen": 1}
        assert result["path"].endswith("global_step1")


def test_comm_calls_of_ulysses_code(two_ranks):
    for rank, seen in enumerate(two_ranks["comm"]):
        assert seen["swapped"] == [rank, 10.0 + rank]
        assert seen["objects"] == [{"rank": 0}, {"rank": 1}]
        assert seen["broadcast"] == ["from 1"]
        assert (seen["global"], seen["ranks"]) == (1, [0, 1])


def test_comm_calls_without_a_process_group():
    from crew.runtime import comm
    out, objects = torch.empty(2), [None]
    comm.all_to_all_single(out, torch.tensor([3.0, 4.0]))
    comm.all_gather_object(objects, "mine")
    assert out.tolist() == [3.0, 4.0] and objects == ["mine"] and comm.get_global_rank(None, 0) == 0


def test_size_one_registers_nothing(two_ranks):
    assert [seen["size 1"] for seen in two_ranks["errors"]] == [None, None]


def test_eval_mode_bypasses_sp_with_disable_in_eval(two_ranks):
    assert max(two_ranks["eval"]) < 1e-5


def test_sp_size_must_divide_the_world(four_ranks):
    for seen in four_ranks["sp 3"]:
        assert "world_size (4) is not divisible by sequence_parallel_size 3" in seen
        assert "multiple of 3 ranks" in seen


def test_adapter_shards_each_ranks_batch_in_turn(two_ranks):
    """Rank 0 draws 8 tokens, rank 1 12: micro step 0 is rank 0's batch in halves of 4, step 1 rank 1's in 6s."""
    for rank, result in enumerate(two_ranks["adapter"]):
        assert result["len"] == 2 and result["second_len"] == 2
        first, second = result["first"]
        assert "labels" not in first and first["tag"] == "from 0" and second["tag"] == "from 1"
        assert first["input_ids"].tolist() == [list(range(4 * rank, 4 * rank + 4))]
        assert first["position_ids"].tolist() == [list(range(4 * rank, 4 * rank + 4))]
        assert first["shift_labels"].tolist() == [[1, 2, 3, 4] if rank == 0 else [5, 6, 7, -100]]
        assert second["input_ids"].tolist() == [list(range(100 + 6 * rank, 106 + 6 * rank))]
        assert second["shift_labels"][0, -1].item() == (-100 if rank == 1 else 106)


@pytest.mark.parametrize("case, words", [
    ("eager", ["'eager'", "4D attention_mask", "'sdpa'"]),
    ("mismatch", ["'flex_attention'", "LlamaForCausalLM", "attn_implementation='sdpa'", "same value"]),
    ("no config", ["Linear", "transformers config", "PreTrainedModel"]),
    ("fixed length", ["seq_length_is_variable=False", "seq_length="]),
    ("world < sp", ["world_size (2) is less than sequence_parallel_size 3", "at least 3 ranks"]),
    ("not initialized", ["not initialized", "register_with_transformers"]),
    ("heads", ["3 attention heads", "size 2", "divisor"]),
    ("kv heads", ["3 key/value heads", "size 2", "vice versa"]),
    ("no position_ids", ["without position_ids", "torch.arange(seq_len)", "UlyssesSPDataLoaderAdapter"]),
    ("seqlen", ["seqlen=15", "sp-size=2", "multiple of 2"]),
    ("no positions", ["no 'position_ids'", "'input_ids'", "collator"]),
    ("config vs mpu", ["sequence_parallel_size = 4", "2"]),
])
def test_bad_input_gets_a_clear_error(two_ranks, case, words):
    for seen in two_ranks["errors"]:
        assert seen[case] is not None, f"{case}: no error"
        for word in words:
            assert word in seen[case], seen[case]


# -- tiled compute: one process, no group ---------------------------------------------------------------

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def mlp_forward(module, x):
    return module(x)


def grads_of(fn, module, x) -> tuple:
    """fn's output and the gradients of x and the module's weights, for a fixed incoming gradient."""
    x = x.detach().requires_grad_(True)
    module.zero_grad()
    out = fn(x)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape) if out.dim() else torch.tensor(1.0)
    (out * weight).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def assert_same(actual: tuple, expected: tuple) -> None:
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(actual[2], expected[2]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 2])
def test_tiled_mlp_and_autograd_mlp_equal_the_plain_mlp(batch):
    from crew.runtime.ulysses import AutogradComputeMLP, TiledMLP
    module, x = Mlp(), torch.randn(batch, 10, 8, generator=torch.Generator().manual_seed(2))
    plain = grads_of(module, module, x)
    params = list(module.parameters())
    assert_same(grads_of(lambda t: TiledMLP.apply(mlp_forward, module, t, 3, params), module, x), plain)
    assert_same(grads_of(lambda t: AutogradComputeMLP.apply(mlp_forward, module, t), module, x), plain)
    assert all(p.ds_grad_is_ready for p in params)  # DeepSpeed ZeRO's flag, left set after the last tile


def test_sequence_tiled_compute_equals_untiled():
    from crew.runtime.ulysses import sequence_tiled_compute
    module, x = Mlp(), torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, 1)

    def fn(hidden, scale, offset):
        return module(hidden) * scale + offset

    plain = grads_of(lambda t: fn(t, mask, 0.5), module, x)
    tiled = grads_of(lambda t: sequence_tiled_compute(fn, 10, 4, {"hidden": t, "scale": mask}, {"offset": 0.5},
                                                      "hidden", list(module.parameters()), 1, None), module, x)
    assert_same(tiled, plain)
    summed = grads_of(lambda t: sequence_tiled_compute(fn, 10, 4, {"hidden": t, "scale": mask}, {"offset": 0.5},
                                                       "hidden", None, 1, "sum"), module, x)
    assert_same(summed, grads_of(lambda t: fn(t, mask, 0.5).sum(), module, x))
    with pytest.raises(ValueError, match="'max'"):
        sequence_tiled_compute(fn, 10, 4, {"hidden": x, "scale": mask}, {"offset": 0.5}, "hidden",
                               output_reduction="max")


def test_tiled_fused_logits_loss_equals_untiled():
    from crew.runtime.ulysses import TiledFusedLogitsLoss
    torch.manual_seed(4)
    head, x = torch.nn.Linear(8, 32), torch.randn(2, 12, 8)
    y = torch.randint(0, 32, (2, 12))

    def loss_fn(module, hidden, labels):
        return torch.nn.functional.cross_entropy(module(hidden).view(-1, 32), labels.view(-1))

    # 24 tokens in 4 tiles of 6: the mean of the tiles' means is the mean
    plain = grads_of(lambda t: loss_fn(head, t, y), head, x)
    tiled = grads_of(lambda t: TiledFusedLogitsLoss.apply(loss_fn, head, t, y, None, 4, [head.weight, head.bias],
                                                          "mean"), head, x)
    assert_same(tiled, plain)
    # as DeepSpeed's: backward scales x's gradient by the incoming one; the weights' were made in forward, unscaled
    x3 = x.detach().requires_grad_(True)
    (TiledFusedLogitsLoss.apply(loss_fn, head, x3, y, None, 4, [], "mean") * 3).backward()
    torch.testing.assert_close(x3.grad, plain[1] * 3, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="batch/seq dims must match"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y[:, :5], None, 4, [], "mean")
