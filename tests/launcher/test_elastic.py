"""Elastic restarts (`crew run --max_restarts N --min_nodes M`): a node lost mid-run, over real loopback ssh
nodes; the job continues on the nodes that pass a re-check (a spare first, then fewer nodes) with the same
global batch, the unchanged DeepSpeed script resuming through its own load_checkpoint."""

from __future__ import annotations

import json

import pytest
from conftest import crew, start_crew, wait_for_file, write_script

from crew.cli import main
from crew.runtime.batch import BatchSizeError, resolve_after_world_change

TOTAL_STEPS = 9
KILL_AFTER = {0: 3, 1: 6}  # attempt -> the step after whose checkpoint a node is lost

TRAIN = f"""
    import argparse, json, os, time
    import torch
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    inputs = torch.randn(64, 4)
    data = [(x, x.sum(0, keepdim=True)) for x in inputs]
    model = torch.nn.Linear(4, 1)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=data)
    engine.load_checkpoint("ckpt")
    attempt = int(os.environ["CREW_RESTART_COUNT"])
    kill_after = {KILL_AFTER!r}.get(attempt)
    while engine.global_steps < {TOTAL_STEPS}:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            stepped = engine.global_steps
            engine.step()
            if engine.global_steps == stepped:
                continue
            engine.save_checkpoint("ckpt", client_state={{"attempt": attempt}})
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(engine(inputs), inputs.sum(1, keepdim=True))  # all the data
            if engine.global_rank == 0:
                with open("steps.jsonl", "a") as log:
                    log.write(json.dumps({{"attempt": attempt, "step": engine.global_steps,
                                          "world": engine.world_size, "tbs": engine.train_batch_size(),
                                          "gas": engine.gradient_accumulation_steps(),
                                          "loss": loss.item()}}) + "\\n")
            if engine.global_steps == kill_after and engine.global_rank == 0:
                open(f"ready{{attempt}}", "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(f"killed{{attempt}}") and time.monotonic() < deadline:
                    time.sleep(0.05)
            if engine.global_steps >= {TOTAL_STEPS}:
                break
"""


def test_lost_nodes_a_spare_joins_then_the_job_shrinks_keeping_the_global_batch(make_cluster, job_dir):
    cluster = make_cluster(3)
    first, lost_first, spare = cluster.addresses
    write_script(job_dir, "train.py", TRAIN)
    (job_dir / "ds.json").write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                                 "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}))
    proc = start_crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                      "--num_nodes", "2", "--min_nodes", "1", "--max_restarts", "2", "--log_dir", "logs",
                      "--as_deepspeed", "train.py", "--deepspeed", "--deepspeed_config", "ds.json", cwd=job_dir)
    try:
        for attempt, address in ((0, lost_first), (1, spare)):
            wait_for_file(job_dir / f"ready{attempt}", timeout=90)
            cluster.lose_node(address)
            (job_dir / f"killed{attempt}").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    steps = [json.loads(line) for line in (job_dir / "steps.jsonl").read_text().splitlines()]
    by_attempt = {a: [s for s in steps if s["attempt"] == a] for a in range(3)}
    assert [s["step"] for s in steps] == list(range(1, TOTAL_STEPS + 1))  # each resumed from its checkpoint
    assert {(s["world"], s["gas"]) for s in by_attempt[0] + by_attempt[1]} == {(2, 2)}  # the spare took over
    assert {(s["world"], s["gas"]) for s in by_attempt[2]} == {(1, 4)}  # one rank accumulates twice as long
    assert {s["tbs"] for s in steps} == {8}
    losses = [s["loss"] for s in steps]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses  # on all the data
    assert f"lost: {lost_first}" in err and f"re-check: {lost_first} left out: ssh:" in err
    assert f"spare(s) joining: {spare}" in err
    assert "continuing on 1 node(s), 1 rank(s) (the job started with 2)" in err
    assert "train_batch_size 8 kept, gradient_accumulation_steps 2 -> 4" in out + err
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    restarts = record["restarts"]
    assert [r["lost"] for r in restarts] == [[lost_first], [spare]]
    assert [r["world_size"] for r in restarts] == [2, 1]
    assert [r["nodes"] for r in restarts] == [[first, spare], [first]]
    assert restarts[0]["joined"] == [spare] and lost_first in restarts[1]["left_out"]
    assert record["status"] == "succeeded" and record["restart_count"] == 2 and record["world_size"] == 1


def test_too_few_nodes_after_the_recheck_ends_the_job_and_says_so(make_cluster, job_dir):
    cluster = make_cluster(2)
    write_script(job_dir, "train.py", TRAIN)
    (job_dir / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                                 "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}))
    proc = start_crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                      "--min_elastic_nodes", "2", "--max_restarts", "3", "--log_dir", "logs",
                      "--as_deepspeed", "train.py", "--deepspeed", "--deepspeed_config", "ds.json", cwd=job_dir)
    try:
        wait_for_file(job_dir / "ready0", timeout=90)
        cluster.lose_node(cluster.addresses[1])
        (job_dir / "killed0").touch()
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "only 1 node(s) passed the re-check, fewer than --min_nodes 2: not restarting." in err
    assert "restarting the job" not in err
    restarts = json.loads((job_dir / "logs" / "crew_job.json").read_text())["restarts"]
    assert len(restarts) == 1 and restarts[0]["continued"] is False
    assert restarts[0]["lost"] == [cluster.addresses[1]]


def test_a_node_down_at_the_start_is_left_out_after_the_preflight_refuses_it(make_cluster, job_dir):
    cluster = make_cluster(3)
    cluster.stop_node(cluster.addresses[2])
    write_script(job_dir, "where.py", """
        import os
        open(f"rank{os.environ['RANK']}-of-{os.environ['WORLD_SIZE']}-on-{os.environ['CREW_HOST']}", "w").close()
    """)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "--min_nodes", "2",
                  "--max_restarts", "1", "where.py", cwd=job_dir)
    assert result.code == 0, result.err
    assert "preflight found problems; no rank was started" in result.err
    assert f"re-check: {cluster.addresses[2]} left out: ssh: connect to host" in result.err
    assert sorted(p.name for p in job_dir.glob("rank*")) == [f"rank0-of-2-on-{cluster.addresses[0]}",
                                                             f"rank1-of-2-on-{cluster.addresses[1]}"]


@pytest.mark.parametrize("argv, words", [
    (["--min_nodes", "3", "--max_restarts", "1"], "--min_nodes 3: the job starts on 2 node(s)"),
    (["--min_nodes", "1"], "--min_nodes 1 needs --max_restarts N"),
    (["--min_nodes", "1", "--max_restarts", "1", "--launcher", "standalone", "--node_rank", "0",
      "--master_port", "29500"], "not --launcher standalone"),
    (["--max_elastic_nodes", "1", "--num_nodes", "2"], "--max_elastic_nodes 1 and --num_nodes 2 disagree"),
])
def test_elastic_options_that_cannot_work_are_refused_before_anything_starts(here, capsys, argv, words):
    (here / "hosts").write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    (here / "train.py").write_text("")
    assert main(["run", "-H", "hosts", *argv, "train.py"]) == 2
    assert words in capsys.readouterr().err


def test_max_elastic_nodes_is_num_nodes_and_the_rest_are_spares(here):
    (here / "hosts").write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n127.0.0.4 slots=1\n")
    result = crew("plan", "-H", "hosts", "--max_elastic_nodes", "2", "--json", cwd=here)
    assert result.code == 0, result.err
    assert [n["host"] for n in json.loads(result.out)["nodes"]] == ["127.0.0.2", "127.0.0.3"]


@pytest.mark.parametrize("given, world, start, triple, said", [
    ((32, 4, None), 2, 4, (32, 4, 4), "train_batch_size 32 kept, gradient_accumulation_steps 2 -> 4"),
    ((32, 4, 2), 2, 4, (32, 4, 4), "train_batch_size 32 kept"),  # all three given: accumulation gives way
    ((None, 4, 2), 2, 4, (16, 4, 2), "the global batch is 16 (was 32). Set train_batch_size"),
    ((16, 4, 2), 2, 4, (16, 4, 2), "the global batch is 16."),  # fits only this world (a HF script's fill-in)
])
def test_a_changed_world_keeps_train_batch_size_by_accumulating_more(given, world, start, triple, said):
    resolved, note = resolve_after_world_change(*given, world, start)
    assert resolved == triple
    assert said in note


def test_a_train_batch_size_no_accumulation_can_keep_names_one_that_would():
    with pytest.raises(BatchSizeError, match=r"cannot be kept on 3 rank\(s\).*e\.g\. 24 for 4 and 3 ranks"):
        resolve_after_world_change(16, 2, None, 3, 4, "ds.json")
