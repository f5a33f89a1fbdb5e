"""Unequal per-rank micro batches (train_micro_batch_size_per_rank): config, split, coverage, math.

The multi-process tests use real gloo ranks; "slow" ranks sleep per sample in forward.
"""

from __future__ import annotations

import ast
import copy
import itertools
import logging
import re
import time
from collections import Counter

import pytest
import torch
from dist import run_parts, run_ranks

from crew.errors import ConfigError, CrewError
from crew.runtime import balance, batch
from crew.runtime.config import Config
from crew.runtime.data import DataLoader

SAMPLES = 96


# -- the split ----------------------------------------------------------------------------------

def test_allocate_splits_evenly_for_equal_speeds_and_by_speed_otherwise():
    assert batch.allocate(16, [1.0, 1.0]) == [8, 8]
    assert batch.allocate(30, [1.0] * 4) == [8, 8, 7, 7]
    assert batch.allocate(16, [1.0, 3.0]) == [12, 4]
    assert batch.allocate(16, [3.0, 1.0]) == [4, 12]
    assert batch.allocate(5, [1.0, 1000.0, 1000.0]) == [3, 1, 1]  # every rank keeps a sample


@pytest.mark.parametrize("costs", [[1.0, 2.5, 0.7], [0.3, 0.3, 1.9], [2.0, 1.1, 1.3]])
def test_allocate_minimises_the_slowest_rank(costs):
    total = 11
    best = min(max(s * c for s, c in zip(sizes, costs, strict=True))
               for sizes in itertools.product(range(1, total), repeat=3) if sum(sizes) == total)
    sizes = batch.allocate(total, costs)
    assert sum(sizes) == total
    assert max(s * c for s, c in zip(sizes, costs, strict=True)) == pytest.approx(best)


def test_auto_moves_at_once_first_then_on_two_windows_and_backs_off_when_moves_do_not_pay():
    """The decision rule alone, fed per-sample times as the ranks' pooled medians would be."""
    balancer = balance.Balancer([8, 8], auto=True, rank=0, device=torch.device("cpu"))
    balancer._decide(5, [1.0, 3.0])
    assert balancer.sizes == [12, 4]                       # the first decision needs one window
    balancer._decide(10, [1.0, 3.0])                       # 12 x 1 = 4 x 3: it paid, nothing to move
    assert balancer.sizes == [12, 4] and balancer._window == balance.WINDOW
    balancer._decide(14, [3.0, 1.0])                       # one window says swap: not yet
    assert balancer.sizes == [12, 4]
    balancer._decide(18, [3.0, 1.0])                       # the second agrees
    assert balancer.sizes == [4, 12]
    balancer._decide(23, [9.0, 3.0])                       # slowest 36 again, not the 12 promised
    assert balancer._window == 2 * balance.WINDOW
    for step in range(6):                                  # the same, over and over: capped
        balancer._promised = (36.0, 12.0)
        balancer._decide(30 + step, [9.0, 3.0])
    assert balancer._window == balance.MAX_WINDOW


# -- the config key --------------------------------------------------------------------------------

def resolve(world_size: int = 2, **keys) -> Config:
    return Config.from_dict(keys, world_size)


def test_a_list_sets_each_rank_and_keeps_train_batch_size_global():
    config = resolve(train_batch_size=32, train_micro_batch_size_per_rank=[12, 4])
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (32, 2)
    assert config.train_micro_batch_size_per_rank == (12, 4)
    assert config.train_micro_batch_size_per_gpu is None and not config.auto_balance
    assert resolve(train_micro_batch_size_per_rank=[5, 3], gradient_accumulation_steps=3).train_batch_size == 24
    assert resolve(train_micro_batch_size_per_rank=(5, 3)).train_micro_batch_size_per_rank == (5, 3)


def test_auto_starts_from_the_even_split_of_the_global_batch():
    config = resolve(4, train_batch_size=30, train_micro_batch_size_per_rank="auto")
    assert config.auto_balance and config.train_micro_batch_size_per_rank == (8, 8, 7, 7)
    config = resolve(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                     train_micro_batch_size_per_rank="auto")
    assert config.train_batch_size == 16 and config.train_micro_batch_size_per_rank == (4, 4)


def suggested_list(message: str) -> list[int]:
    return ast.literal_eval(re.search(r"e\.g\. (\[[0-9, ]+\])", message).group(1))


@pytest.mark.parametrize("keys, expected", [
    ({"train_micro_batch_size_per_rank": [12, 4, 3]}, "has 3 entries but the job has 2 ranks"),
    ({"train_micro_batch_size_per_rank": [12, 0]}, "train_micro_batch_size_per_rank[1] is 0"),
    ({"train_micro_batch_size_per_rank": [-2, 4]}, "train_micro_batch_size_per_rank[0] is -2"),
    ({"train_micro_batch_size_per_rank": [12.0, 4]}, "train_micro_batch_size_per_rank[0] is 12.0"),
    ({"train_micro_batch_size_per_rank": [12, 4], "train_batch_size": 48, "gradient_accumulation_steps": 2},
     "takes 16 samples per micro step, x gradient_accumulation_steps 2 = 32 per optimizer step, but "
     "train_batch_size is 48"),
])
def test_bad_lists_name_the_key_and_a_valid_setting(keys, expected):
    with pytest.raises(ConfigError) as caught:
        resolve(**keys)
    message = str(caught.value)
    assert expected in message
    fixed = dict(keys, train_micro_batch_size_per_rank=suggested_list(message))
    assert resolve(**fixed).train_micro_batch_size_per_rank == tuple(suggested_list(message))


@pytest.mark.parametrize("keys, expected", [
    ({"train_micro_batch_size_per_rank": "fast"}, 'must be a list with one micro batch size per global rank'),
    ({"train_micro_batch_size_per_rank": [12, 4], "train_micro_batch_size_per_gpu": 8},
     "Remove train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_rank": "auto"}, "set train_batch_size (e.g. 16)"),
    ({"train_micro_batch_size_per_rank": "auto", "train_batch_size": 1}, "Set train_batch_size to 2"),
    ({"train_micro_batch_size_per_rank": [12, 4], "train_batch_size": 30},
     "Set train_batch_size to 16 (or remove it), or keep it and give sizes that sum to 30"),
])
def test_other_bad_settings_say_how_to_fix_them(keys, expected):
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_rank") as caught:
        resolve(**keys)
    assert expected in str(caught.value)


# -- the loader: coverage --------------------------------------------------------------------------

def indices_dataset(count: int) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(count))


def loaders(count: int, sizes: list[int], drop_last: bool = False, reshuffle: bool = False) -> list[DataLoader]:
    return [DataLoader(indices_dataset(count), sizes, len(sizes), rank, drop_last=drop_last, reshuffle=reshuffle)
            for rank in range(len(sizes))]


def epoch_micro_steps(ranks: list[DataLoader]) -> list[list[list[int]]]:
    """[micro step][rank] -> the indices that rank took."""
    return [[batch[0].tolist() for batch in step] for step in zip(*ranks, strict=True)]


@pytest.mark.parametrize("sizes", [[5, 3], [2, 5, 1], [1, 1, 6]])
def test_an_epoch_takes_every_sample_exactly_once(sizes):
    ranks = loaders(SAMPLES, sizes)
    assert len({len(loader) for loader in ranks}) == 1
    steps = epoch_micro_steps(ranks)
    for step in steps:
        assert [len(part) for part in step] == sizes
    taken = [i for step in steps for part in step for i in part]
    assert sorted(taken) == list(range(SAMPLES))


def test_a_short_last_micro_step_is_padded_or_dropped_the_same_on_every_rank():
    padded = [i for step in epoch_micro_steps(loaders(30, [5, 3])) for part in step for i in part]
    assert len(padded) == 32 and set(padded) == set(range(30))
    assert sum(n - 1 for n in Counter(padded).values()) == 2
    dropped = [i for step in epoch_micro_steps(loaders(30, [5, 3], drop_last=True)) for part in step for i in part]
    assert len(dropped) == 24 == len(set(dropped))


def test_epochs_repeat_their_order_unless_reshuffled():
    ranks = loaders(SAMPLES, [5, 3])
    assert epoch_micro_steps(ranks) == epoch_micro_steps(ranks)  # DeepSpeed's: no set_epoch, same order
    ranks = loaders(SAMPLES, [5, 3], reshuffle=True)
    first, second = epoch_micro_steps(ranks), epoch_micro_steps(ranks)
    assert first != second


def test_a_new_split_mid_epoch_still_takes_every_sample_once():
    ranks = loaders(SAMPLES, [5, 3])
    iterators = [iter(loader) for loader in ranks]
    taken = [next(it)[0].tolist() for _ in range(4) for it in iterators]
    for loader in ranks:
        loader.set_micro_batch_sizes([2, 6])
    rest = [[batch[0].tolist() for batch in loader] for loader in ranks]
    assert [len(part) for part in rest[0][:1] + rest[1][:1]] == [2, 6]
    flat = [i for part in taken for i in part] + [i for rank in rest for part in rank for i in part]
    assert sorted(flat) == list(range(SAMPLES))


def test_a_mid_epoch_resume_continues_at_the_same_global_micro_step():
    uninterrupted = epoch_micro_steps(loaders(SAMPLES, [5, 3]))
    ranks = loaders(SAMPLES, [5, 3])
    for loader in ranks:
        loader.load_state_dict({"epoch": 0, "batches_consumed": 7})
    assert epoch_micro_steps(ranks) == uninterrupted[7:]


def test_only_a_per_rank_loader_takes_a_new_split():
    with pytest.raises(CrewError, match="train_micro_batch_size_per_rank"):
        DataLoader(indices_dataset(8), 4, 2, 0).set_micro_batch_sizes([6, 2])


# -- the update equals one process taking the global batch ----------------------------------------

def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class Delayed(torch.nn.Module):
    """The model, after sleeping `delay_ms[0]` per sample: an artificially slow device."""

    def __init__(self, delay_ms: list[float]):
        super().__init__()
        self.inner, self.delay_ms = make_model(), delay_ms

    def forward(self, inputs):
        time.sleep(self.delay_ms[0] * len(inputs) / 1e3)
        return self.inner(inputs)


def make_dataset(count: int = SAMPLES) -> torch.utils.data.TensorDataset:
    inputs = torch.randn(count, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True) ** 2)


def ds_config(shares, accumulation: int = 1, clipping: float = 0.0, optimizer: str = "AdamW", **extra) -> dict:
    params = {"lr": 0.01, "weight_decay": 0.1} if optimizer == "AdamW" else {"lr": 0.01}
    return {"train_micro_batch_size_per_rank": shares, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": clipping, "steps_per_print": 1000,
            "optimizer": {"type": optimizer, "params": params}, **extra}


def one_process(steps: int, global_batch: int, clipping: float, optimizer: str = "AdamW",
                count: int = SAMPLES) -> dict:
    """The reference: one process taking each global batch whole, in the loader's epoch-0 order."""
    model = make_model()
    if optimizer == "AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = make_dataset(count)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        inputs, targets = dataset[order[step * global_batch:(step + 1) * global_batch]]
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        if clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train_steps(engine, batches, steps: int, on_step=None) -> None:
    for step in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(batches)
            assert len(inputs) == engine.train_micro_batch_size_per_gpu()
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
        if on_step:
            on_step(step)


def train_shares(rank: int, ds: dict, steps: int) -> dict:
    import crew

    engine, _, loader, _ = crew.initialize(model=make_model(), config=ds, training_data=make_dataset())
    train_steps(engine, iter(loader), steps)
    with crew.runtime.zero.stage3.shards_visible():  # at stage 3, DTensor shards: gather them (a collective)
        state = engine.module.state_dict()
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in state.items()}


def assert_same_params(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6)


SHARES_STEPS = 6
STAGE3 = {"zero_optimization": {"stage": 3}}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every two-rank check of this file in the same two processes (one start); the parts are defined below."""
    folder = str(tmp_path_factory.mktemp("shares_checkpoint"))
    return run_parts({"[5, 3] {}": (train_shares, ds_config([5, 3], 2, 0.5), SHARES_STEPS),
                      f"[5, 3] {STAGE3}": (train_shares, ds_config([5, 3], 2, 0.5, **STAGE3), SHARES_STEPS),
                      "auto": (train_auto, [[1.0, 3.0], [3.0, 1.0]], AUTO_STEPS),
                      "save_resume": (train_save_resume, folder, 6), "errors": (initialize_errors,)}, 2)


@pytest.mark.parametrize("sizes, extra", [([5, 3], {}), ([2, 5, 1], {}), ([5, 3], STAGE3)])
def test_unequal_shares_give_the_update_of_one_process_taking_the_global_batch(job, sizes, extra):
    steps, global_batch = SHARES_STEPS, sum(sizes) * 2
    expected = one_process(steps, global_batch, clipping=0.5)
    ranks = job[f"{sizes} {extra}"] if len(sizes) == 2 else run_ranks(
        train_shares, len(sizes), ds_config(sizes, 2, 0.5, **extra), steps)
    for params in ranks:
        assert_same_params(params, expected)


def test_weighting_by_samples_matters_for_this_data():
    """Guards the test above: averaging the two ranks' mean losses equally gives another update."""
    model, dataset = make_model(), make_dataset()
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    inputs, targets = dataset[order[:8]]
    whole = torch.autograd.grad(torch.nn.functional.mse_loss(model(inputs), targets), list(model.parameters()))
    parts = [torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows]) for rows in (slice(0, 5), slice(5, 8))]
    equal = torch.autograd.grad((parts[0] + parts[1]) / 2, list(model.parameters()))
    assert not torch.allclose(whole[0], equal[0], rtol=1e-3)


# -- "auto" ------------------------------------------------------------------------------------

class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train_auto(rank: int, delays: list[list[float]], steps: int) -> dict:
    """Rank speeds from delays[0] (ms per sample); from step steps // 2 on, from delays[1]."""
    import crew

    lines = Collect()
    logging.getLogger("crew").addHandler(lines)
    delay = [delays[0][rank]]
    model = Delayed(delay)
    engine, _, loader, _ = crew.initialize(model=model, config=ds_config("auto", optimizer="SGD",
                                                                         train_batch_size=16),
                                           training_data=make_dataset(16 * steps))
    history = []

    def record(step):
        history.append(list(engine.balancer.sizes))
        if step + 1 == steps // 2:
            delay[0] = delays[1][rank]
    train_steps(engine, iter(loader), steps, record)
    return {"history": history, "lines": lines.lines,
            "params": {name.removeprefix("inner."): value for name, value in model.state_dict().items()}}


AUTO_STEPS = 48


def test_auto_moves_samples_to_the_faster_rank_and_follows_a_drift_without_changing_the_math(job):
    steps = AUTO_STEPS
    ranks = job["auto"]
    history = ranks[0]["history"]
    assert ranks[1]["history"] == history
    assert history[0] == [8, 8]
    settled, drifted = history[steps // 2 - 1], history[-1]
    assert abs(settled[0] - 12) <= 1 and abs(drifted[0] - 4) <= 1, history
    assert any(line.startswith("auto balance at step") and "micro batch per rank [" in line
               for line in ranks[0]["lines"]), ranks[0]["lines"]
    expected = one_process(steps, 16, clipping=0.0, optimizer="SGD", count=16 * steps)
    for result in ranks:
        assert_same_params(result["params"], expected)


def train_save_resume(rank: int, folder: str, steps: int) -> dict:
    import crew

    delay = [[1.0, 3.0][rank]]
    config = ds_config("auto", optimizer="SGD", train_batch_size=16, checkpoint={"resume_data_position": True})

    def start():
        model = Delayed(delay)
        engine, _, loader, _ = crew.initialize(model=model, config=config,
                                               training_data=make_dataset(16 * 2 * steps))
        return model, engine, iter(loader)

    model, engine, batches = start()
    train_steps(engine, batches, steps)
    saved_sizes = list(engine.balancer.sizes)
    engine.save_checkpoint(folder, tag="half")
    train_steps(engine, batches, steps)
    uninterrupted = copy.deepcopy(model.state_dict())

    model, engine, batches = start()
    engine.load_checkpoint(folder, tag="half")
    resumed_sizes = list(engine.balancer.sizes)
    train_steps(engine, batches, steps)
    return {"saved": saved_sizes, "resumed": resumed_sizes, "uninterrupted": uninterrupted,
            "params": copy.deepcopy(model.state_dict())}


def test_a_checkpoint_keeps_the_shares_and_the_data_position(job):
    for result in job["save_resume"]:
        assert result["saved"] == result["resumed"] != [8, 8]
        assert_same_params(result["params"], result["uninterrupted"])


def initialize_errors(rank: int) -> list[str]:
    import crew

    messages = []
    for config, data in [(ds_config("auto", train_batch_size=16), None),
                         (ds_config("auto", train_batch_size=16, zero_optimization={"stage": 3}), make_dataset())]:
        try:
            crew.initialize(model=make_model(), config=config, training_data=data)
        except ConfigError as error:
            messages.append(str(error))
    return messages


def test_auto_needs_crew_s_loader_and_ddp(job):
    for messages in job["errors"]:
        assert len(messages) == 2
        assert "pass initialize(training_data=your_dataset)" in messages[0]
        assert "needs ZeRO stage 0, 1 or 2" in messages[1] and "[8, 8]" in messages[1]
