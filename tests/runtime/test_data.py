"""crew.runtime.data: DeepSpeed's training loader on every rank, its epochs (or reshuffled ones), resume
without reading."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

from crew.errors import ConfigError, CrewError
from crew.runtime.data import (
    DataLoader,
    RepeatingLoader,
    batches_per_epoch,
    samples_per_rank,
    split_micro_steps,
)

N = 23        # not a multiple of 2 or 3, so DistributedSampler pads
MICRO = 5     # leaves a short last batch for every world size below, so drop_last matters
SHAPES = [(w, r) for w in (1, 2, 3) for r in range(w)]


class Items(Dataset):
    """Item i is tensor([i, 100 + i]); counts which indices __getitem__ was asked for."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.reads: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads[i] += 1
        return torch.tensor([i, 100 + i])


class Stream(IterableDataset):
    """Has a length, as many streaming datasets do; still not something DistributedSampler can index."""

    def __iter__(self):
        return iter(range(4))

    def __len__(self) -> int:
        return 4



def position(state: dict) -> dict:
    """The loader position, without the RNG seed that state_dict() also carries."""
    return {key: state[key] for key in ("epoch", "batches_consumed")}

def tagged_collate(items):
    """A collate the default one cannot be mistaken for: a dict with a marker and reversed rows."""
    return {"tag": "mine", "rows": torch.stack(items[::-1])}


def deepspeed_reference(dataset, world_size, rank, drop_last, collate_fn=None, epoch=None):
    """What DeepSpeed's deepspeed_io()/DeepSpeedDataLoader build for initialize(training_data=...)."""
    sampler = DistributedSampler(dataset=dataset, num_replicas=world_size, rank=rank)
    if epoch is not None:
        sampler.set_epoch(epoch)
    kwargs = {} if collate_fn is None else {"collate_fn": collate_fn}
    return torch.utils.data.DataLoader(dataset, batch_size=MICRO, pin_memory=False, sampler=sampler,
                                       num_workers=0, drop_last=drop_last, **kwargs)


def ids(batches) -> list[list[int]]:
    """Each batch's sample indices (column 0), whatever the collate returned."""
    return [(b["rows"] if isinstance(b, dict) else b)[:, 0].tolist() for b in batches]


def loader(world_size=1, rank=0, drop_last=False, dataset=None, **kwargs) -> DataLoader:
    return DataLoader(dataset or Items(), MICRO, world_size, rank, drop_last=drop_last, **kwargs)


def run(dl: DataLoader, epochs: int) -> list[list[list[int]]]:
    return [ids(dl) for _ in range(epochs)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size,rank", SHAPES)
def test_epoch0_equals_deepspeed(world_size, rank, drop_last):
    ours = loader(world_size, rank, drop_last)
    reference = deepspeed_reference(Items(), world_size, rank, drop_last)
    got, want = list(ours), list(reference)
    assert len(got) == len(want) == len(ours) == len(reference)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size,rank", SHAPES)
def test_collate_fn_is_used(world_size, rank, drop_last):
    got = list(loader(world_size, rank, drop_last, collate_fn=tagged_collate))
    want = list(deepspeed_reference(Items(), world_size, rank, drop_last, collate_fn=tagged_collate))
    assert got and all(b["tag"] == "mine" for b in got)
    assert [b["rows"].tolist() for b in got] == [b["rows"].tolist() for b in want]


@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_counts(drop_last):
    # 23 samples on 2 ranks -> 12 each (one padded): 2 full batches + 2 left over.
    dl = loader(2, 1, drop_last)
    sizes = [len(b) for b in dl]
    assert sizes == ([5, 5] if drop_last else [5, 5, 2])
    assert len(dl) == len(sizes)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_epoch_repeats_deepspeeds_order_by_default(world_size):
    for r in range(world_size):
        reference = deepspeed_reference(Items(), world_size, r, False)  # DeepSpeedDataLoader: no set_epoch
        assert run(loader(world_size, r), 3) == [ids(reference) for _ in range(3)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epochs_reshuffle_and_each_covers_the_dataset(world_size):
    per_rank = [run(loader(world_size, r, reshuffle=True), 3) for r in range(world_size)]
    for epoch in range(3):
        flat = [i for r in range(world_size) for batch in per_rank[r][epoch] for i in batch]
        counts = collections.Counter(flat)
        padded = samples_per_rank(N, world_size) * world_size
        assert set(counts) == set(range(N))
        assert len(flat) == padded
        assert sum(c - 1 for c in counts.values()) == padded - N   # the padding, as DistributedSampler pads
        for r in range(world_size):  # and it is exactly DistributedSampler at that epoch
            assert per_rank[r][epoch] == ids(deepspeed_reference(Items(), world_size, r, False, epoch=epoch))
    for r in range(world_size):
        assert per_rank[r][1] != per_rank[r][0]
        assert per_rank[r][2] != per_rank[r][1]


def test_seed_changes_the_order():
    assert ids(loader(seed=0)) != ids(loader(seed=1))


def test_epoch_attribute_and_user_set_epoch():
    dl = loader(2, 0)
    assert dl.epoch == 0
    list(dl)
    list(dl)
    assert dl.epoch == 1
    # DeepSpeed users often call data_sampler.set_epoch(e) themselves; that epoch is the one served.
    dl.data_sampler.set_epoch(7)
    assert ids(dl) == ids(deepspeed_reference(Items(), 2, 0, False, epoch=7))
    assert dl.epoch == 7
    assert ids(dl) == ids(deepspeed_reference(Items(), 2, 0, False, epoch=7))  # DeepSpeed keeps epoch 7
    assert dl.epoch == 8
    reshuffled = loader(2, 0, reshuffle=True)
    reshuffled.data_sampler.set_epoch(7)
    assert [ids(reshuffled), ids(reshuffled)] == [ids(deepspeed_reference(Items(), 2, 0, False, epoch=e))
                                                  for e in (7, 8)]


def consume(dl: DataLoader, k: int) -> None:
    """Take k micro batches from the running epochs, starting a new epoch whenever one runs out."""
    it = iter(dl)
    for _ in range(k):
        try:
            next(it)
        except StopIteration:
            it = iter(dl)
            next(it)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1), (3, 2)])
def test_resume_matches_uninterrupted_and_never_reads_skipped(world_size, rank, drop_last):
    batches = len(loader(world_size, rank, drop_last))
    full = [b for epoch in run(loader(world_size, rank, drop_last), 4) for b in epoch]
    for k in range(2 * batches + 1):           # every point in epochs 0 and 1, boundaries included
        first = loader(world_size, rank, drop_last)
        consume(first, k)
        state = first.state_dict()
        in_epoch = (k - 1) // batches if k else 0    # a finished epoch stays current until iter() again
        assert position(state) == {"epoch": in_epoch, "batches_consumed": k - in_epoch * batches}

        data = Items()
        second = loader(world_size, rank, drop_last, dataset=data)
        second.load_state_dict(state)
        epoch = second.epoch
        resumed = ids(second) + ids(second)
        assert second.epoch == epoch + 1
        assert resumed == full[k:k + len(resumed)]
        assert len(resumed) == 2 * batches - k % batches
        # Only what was yielded was read: the skipped samples never reached __getitem__.
        assert sum(data.reads.values()) == sum(len(b) for b in resumed)


@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1)])
def test_restart_epoch_replays_the_saved_epoch_without_drawing_from_the_rng(world_size, rank):
    batches = len(loader(world_size, rank))
    full = run(loader(world_size, rank), 3)
    for k in range(1, 2 * batches + 1):
        first = loader(world_size, rank)
        consume(first, k)
        state, rng = first.state_dict(), torch.get_rng_state()
        second = loader(world_size, rank)
        second.restart_epoch(state)
        epoch = (k - 1) // batches
        finished = k % batches == 0
        assert ids(second) == full[epoch + finished]  # the saved epoch, whole; or, finished, the next
        assert torch.equal(torch.get_rng_state(), rng) != finished  # a new epoch draws its number


def test_state_dict_roundtrip_before_iterating():
    dl = loader(2, 0)
    assert position(dl.state_dict()) == {"epoch": 0, "batches_consumed": 0}
    dl.load_state_dict({"epoch": 3, "batches_consumed": 1})
    assert position(dl.state_dict()) == {"epoch": 3, "batches_consumed": 1}
    assert ids(dl) == ids(deepspeed_reference(Items(), 2, 0, False, epoch=3))[1:]
    assert position(dl.state_dict()) == {"epoch": 3, "batches_consumed": len(dl)}


def test_load_state_dict_rejects_bad_states():
    dl = loader(2, 0)
    with pytest.raises(CrewError, match="lacks"):
        dl.load_state_dict({"epoch": 0})
    with pytest.raises(CrewError, match="3 per epoch"):
        dl.load_state_dict({"epoch": 0, "batches_consumed": 4})
    with pytest.raises(CrewError, match=">= 0"):
        dl.load_state_dict({"epoch": -1, "batches_consumed": 0})


@pytest.mark.parametrize("drop_last", [False, True])
def test_skip_to_step_across_epoch_boundary(drop_last):
    batches = len(loader(3, 1, drop_last))
    full = [b for epoch in run(loader(3, 1, drop_last), 6) for b in epoch]
    for steps in (batches - 1, batches, batches + 1, 2 * batches + 1):
        data = Items()
        dl = loader(3, 1, drop_last, dataset=data)
        dl.skip_to_step(steps)
        assert dl.epoch == steps // batches
        rest = ids(dl) + ids(dl)
        assert rest == full[steps:steps + len(rest)]
        assert len(rest) == 2 * batches - steps % batches
        assert sum(data.reads.values()) == sum(len(b) for b in rest)


def test_skip_to_step_errors():
    with pytest.raises(CrewError, match=">= 0"):
        loader().skip_to_step(-1)
    tiny = DataLoader(Items(3), 5, 1, 0, drop_last=True)
    assert len(tiny) == 0 and list(tiny) == []
    with pytest.raises(CrewError, match="no micro batch"):
        tiny.skip_to_step(1)


@pytest.mark.parametrize("reshuffle", [False, True])
def test_repeating_loader_moves_through_epochs(reshuffle):
    dl = loader(2, 1, reshuffle=reshuffle)
    repeated = RepeatingLoader(dl)
    got = [next(repeated)[:, 0].tolist() for _ in range(2 * len(dl) + 1)]
    orders = [epoch if reshuffle else None for epoch in range(3)]  # DeepSpeed's: the same order again
    want = [b for epoch in orders for b in ids(deepspeed_reference(Items(), 2, 1, False, epoch=epoch))]
    assert got == want[:len(got)]
    assert dl.epoch == 2


def collate_in_worker(items):
    info = torch.utils.data.get_worker_info()
    return {"worker": None if info is None else info.id, "rows": torch.stack(items)}


@pytest.mark.cuda  # pinned memory only with CUDA; the order is checked everywhere
def test_num_workers_and_pin_memory_keep_the_order():
    dl = loader(2, 0, num_workers=2, pin_memory=torch.cuda.is_available(), collate_fn=collate_in_worker)
    batches = list(dl)
    assert {b["worker"] for b in batches} == {0, 1}
    assert ids(batches) == ids(deepspeed_reference(Items(), 2, 0, False))


def test_iterable_dataset_is_refused():
    with pytest.raises(CrewError, match="IterableDataset") as err:
        loader(dataset=Stream())
    assert "Stream" in str(err.value) and "map-style" in str(err.value) and "DataLoader" in str(err.value)
    with pytest.raises(CrewError, match="map-style"):
        DataLoader(object(), 1, 1, 0)


@pytest.mark.parametrize("micro", [0, -1, 1.5, True])
def test_micro_batch_must_be_positive_int(micro):
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        DataLoader(Items(), micro, 1, 0)


@pytest.mark.parametrize("world_size,rank", [(2, 2), (2, -1), (0, 0)])
def test_rank_and_world_size_are_checked(world_size, rank):
    with pytest.raises(CrewError):
        DataLoader(Items(), 1, world_size, rank)


def test_pure_functions_match_torch():
    for n in range(30):
        for world_size in (1, 2, 3, 4, 7):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=0)
            assert samples_per_rank(n, world_size) == len(sampler)
            for micro in (1, 2, 3, 5):
                for drop_last in (False, True):
                    ref = torch.utils.data.DataLoader(range(n), batch_size=micro, sampler=sampler,
                                                      drop_last=drop_last)
                    assert batches_per_epoch(n, world_size, micro, drop_last) == len(ref) == len(list(ref))
    assert split_micro_steps(0, 4) == (0, 0)
    assert split_micro_steps(9, 4) == (2, 1)
    assert split_micro_steps(8, 4) == (2, 0)


def test_a_resume_keeps_the_epoch_order_the_script_set():
    def rest_of_epoch(dl: DataLoader) -> list[list[int]]:
        batches = []
        while (batch := next(dl, None)) is not None:
            batches.append(batch)
        return ids(batches)

    dl = loader(2, 0)
    dl.data_sampler.set_epoch(3)
    first = next(iter(dl))
    state = dl.state_dict()
    rest, following = rest_of_epoch(dl), ids(dl)  # the next epoch: still epoch 3's order
    assert ids([first]) + rest == following == ids(deepspeed_reference(Items(), 2, 0, False, epoch=3))
    resumed = loader(2, 0)
    resumed.load_state_dict(state)
    assert (ids(resumed), ids(resumed)) == (rest, following)
