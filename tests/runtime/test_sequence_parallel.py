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


class GatherLosses(torch.autograd.Function):
    """torch.distributed.nn.functional.all_gather, which transformers uses, but whose gloo backward scatters from
    group ranks as if they were world ranks (a hang for an SP group past ranks 0..sp-1)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[torch.distributed.get_rank(ctx.group)], None


def sp_loss(batch: dict, outputs, group) -> torch.Tensor:
    """transformers' deepspeed_sp_compute_loss: the SP ranks' losses, weighted by their counted tokens."""
    losses = GatherLosses.apply(outputs.loss, group)
    good = (batch["shift_labels"] != -100).view(-1).sum()
    counts = GatherLosses.apply(good, group)
    return (torch.where(counts > 0, losses, torch.zeros_like(losses)) * counts).sum() / counts.sum().clamp(min=1)


def train_sp(rank: int, stage: int, sp: int) -> dict:
    """One step under SP `sp` at ZeRO `stage`; the largest differences from the one-process reference."""
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
        seq_length=SEQ, seq_length_is_variable=True)
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
                  crew.deepspeed.utils.groups._get_sequence_data_parallel_world_size())
    finally:
        restore_sdpa()
    return {"loss": total.item() / world, "ref_loss": expected["loss"], "layout": layout,
            "grad_error": max(_relative(grads[n], expected["grads"][n]) for n in grads),
            "step_error": max((after[n] - expected["after"][n]).abs().max().item() for n in after),
            "grad_norm": sum(g.norm().item() for g in expected["grads"].values())}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm().clamp(min=1e-12)).item()


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
    first = list(loader)
    second = list(loader)  # StopIteration reset the wrapped iterator: a second epoch
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
    return run_parts({"stage 0": (train_sp, 0, 2), "stage 3": (train_sp, 3, 2), "adapter": (adapter_batches,),
                      "errors": (sp_errors,)}, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return run_parts({"sp 2 stage 2": (train_sp, 2, 2), "sp 4 stage 1": (train_sp, 1, 4)}, 4)


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
    assert results[0]["layout"] == (2, 2, 2)


@pytest.mark.parametrize("part, layout", [("sp 2 stage 2", (2, 2, 4)), ("sp 4 stage 1", (4, 4, 4))])
def test_four_ranks_equal_one_process(four_ranks, part, layout):
    """SP 2 x DP 2 (a global batch of two samples), and SP 4, where each of the 2 kv heads is replicated."""
    results = four_ranks[part]
    assert_equals_one_process(results)
    assert results[0]["layout"] == layout
