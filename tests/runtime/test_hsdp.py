"""Stage 3 within groups (`mics_shard_size`, `zero_hpz_partition_size`: HSDP on a 2-D mesh), on 4 gloo ranks over
2 loopback ssh nodes x 2: the same losses as plain stage 3, and every all-gather and reduce-scatter stays inside a
node, counted; a checkpoint saved under HSDP loads back (crew/runtime/zero/hsdp.py)."""

from __future__ import annotations

import json

import pytest
from conftest import crew, write_script

from crew.errors import ConfigError
from crew.runtime.zero import hsdp

STEPS = 6

# Each rank trains plain stage 3, then stage 3 in groups of 2, in one process (two engines, one job start),
# counting the process groups of FSDP2's collectives (which all go through these three calls); each engine saves
# after step 3, loads that checkpoint back and trains on.
TRAIN = """
    import json
    import torch, torch.distributed as dist
    import crew

    seen = {}
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        def spy(*args, _name=name, _call=getattr(dist, name), **kwargs):
            group = kwargs.get("group") or dist.group.WORLD
            seen.setdefault(_name, set()).add(tuple(dist.get_process_group_ranks(group)))
            return _call(*args, **kwargs)
        setattr(dist, name, spy)

    def train(section, folder):
        seen.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                      for _ in range(3)], torch.nn.Linear(16, 1))
        data = torch.randn(64, 16)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                  # every parameter sharded (these are all under stage3_param_persistence_threshold)
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **section}}
        engine, _, _, _ = crew.initialize(model=model, model_parameters=model.parameters(), config=config)
        rank, losses = dist.get_rank(), []
        for step in range(1, STEPS + 1):
            for micro in range(2):
                start = ((step * 2 + micro) * 4 + rank) * 2 % 60
                x = data[start:start + 2]
                loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
            if step == 3:
                engine.save_checkpoint(folder)
                engine.load_checkpoint(folder)
        return {"losses": losses, "seen": {k: sorted(v) for k, v in seen.items()}}

    crew.init_distributed()
    runs = {"plain": train({}, "plain"), "grouped": train({"mics_shard_size": 2}, "grouped")}
    json.dump(runs, open(f"rank{dist.get_rank()}.json", "w"))
""".replace("STEPS", str(STEPS))


def test_groups_per_node_give_plain_stage3s_losses_with_every_gather_inside_a_node(make_cluster, job_dir):
    cluster = make_cluster(2)
    write_script(job_dir, "train.py", TRAIN)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=2)), "train.py",
                  cwd=job_dir)
    assert result.code == 0, result.err[-3000:]
    runs = [json.loads((job_dir / f"rank{r}.json").read_text()) for r in range(4)]
    plain, grouped = [r["plain"] for r in runs], [r["grouped"] for r in runs]
    for rank in range(4):
        assert grouped[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5, abs=1e-6)
    nodes = [[0, 1], [2, 3]]
    assert all(r["seen"]["all_gather_single"] == [[0, 1, 2, 3]] for r in plain)
    assert all(r["seen"]["all_gather_single"] == [nodes[rank // 2]] for rank, r in enumerate(grouped))
    assert all(r["seen"]["reduce_scatter_single"] == [nodes[rank // 2]] for rank, r in enumerate(grouped))
    across = [[rank % 2, rank % 2 + 2] for rank in range(4)]  # the gradient shards' all-reduce between nodes
    assert all(across[rank] in r["seen"]["all_reduce"] for rank, r in enumerate(grouped))
    assert "fully_shard within groups of 2 ranks, replicated 2 times (HSDP)" in result.out + result.err


@pytest.mark.parametrize("extra, world, size", [
    ({}, 8, None), ({"mics_shard_size": -1, "zero_hpz_partition_size": 1}, 8, None),
    ({"mics_shard_size": 4}, 8, 4), ({"zero_hpz_partition_size": 2}, 8, 2),
    ({"mics_shard_size": 8}, 8, None),  # one group of the whole world: plain stage 3
    ({"mics_shard_size": 4, "zero_hpz_partition_size": 4}, 8, 4),
])
def test_the_group_size_from_either_key(extra, world, size):
    assert hsdp.group_size(extra, world) == size


@pytest.mark.parametrize("extra, words", [
    ({"mics_shard_size": 3}, "mics_shard_size 3 does not divide the world size 8"),
    ({"zero_hpz_partition_size": 0}, "zero_hpz_partition_size is 0"),
    ({"mics_shard_size": "2"}, "mics_shard_size is '2'"),
    ({"mics_shard_size": 2, "zero_hpz_partition_size": 4}, "disagree"),
])
def test_group_sizes_that_cannot_work_name_the_key(extra, words):
    with pytest.raises(ConfigError, match=words):
        hsdp.group_size(extra, 8)


def test_the_keys_have_no_effect_below_stage_3():
    assert hsdp.no_effect({"mics_shard_size": 2, "zero_hpz_partition_size": 1}) == ["zero_optimization.mics_shard_size"]
