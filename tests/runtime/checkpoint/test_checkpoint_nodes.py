"""Checkpoints across nodes without a shared filesystem, through the real ssh runner.

The loopback "nodes" (127.0.0.2, 127.0.0.3) share this machine's filesystem, so each rank gives
itself a node-local save dir: at start it enters its own mount namespace and bind-mounts
job/node_<CREW_HOST> over job/ckpt. Ranks on different nodes then see different folders at the
same path, as two machines would; the test reads each node's copy through job/node_<host>.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys

import pytest
from conftest import crew, wait_until_gone, write_script
from dist import run_ranks

TRAIN = """
    import argparse, ctypes, hashlib, json, os, subprocess, sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--isolate", action="store_true", help="node-local ckpt (mount namespace)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    ckpt = os.path.join(os.getcwd(), "ckpt")

    if args.isolate:  # before torch: this rank, and only it, sees its node's folder at ckpt/
        if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS
            sys.exit("unshare(CLONE_NEWNS): " + os.strerror(ctypes.get_errno()))
        subprocess.run(["mount", "--make-rprivate", "/"], check=True)
        node_dir = os.path.join(os.getcwd(), "node_" + os.environ["CREW_HOST"])
        os.makedirs(node_dir, exist_ok=True)
        subprocess.run(["mount", "--bind", node_dir, ckpt], check=True)

    written = []  # every file this rank opens for writing under ckpt/

    def audit(event, hook_args):
        if event == "open" and isinstance(hook_args[0], (str, bytes, os.PathLike)):
            path, mode = os.fsdecode(hook_args[0]), hook_args[1] or ""
            if path.startswith(ckpt + os.sep) and any(c in mode for c in "wax+"):
                written.append(os.path.basename(path))

    sys.addaudithook(audit)

    import torch
    import crew as deepspeed

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    rank = engine.global_rank
    torch.manual_seed(100 + rank)  # data and dropout come from each rank's own RNG stream
    result = {"rank": rank, "host": os.environ["CREW_HOST"]}

    def dump():
        with open(f"{args.out}.rank{rank}.json", "w") as handle:
            json.dump(result, handle)

    if args.load:
        try:
            path, client_state = engine.load_checkpoint("ckpt")
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            dump()
            raise
        result.update(loaded=path, client_state=client_state, loaded_step=engine.global_steps)

    while engine.global_steps < args.steps:
        inputs = torch.randn(4, 8)
        loss = torch.nn.functional.mse_loss(engine(inputs), inputs.sum(dim=1, keepdim=True) ** 2)
        engine.backward(loss)
        engine.step()

    if args.save:
        engine.save_checkpoint("ckpt", client_state={"saved_at": engine.global_steps, "note": "hi"})
    digest = hashlib.sha256()
    for name, value in engine.module.state_dict().items():
        digest.update(name.encode() + value.detach().numpy().tobytes())
    result.update(steps=engine.global_steps, params_sha256=digest.hexdigest(), written=written)
    dump()
"""

HOSTS = ["127.0.0.2", "127.0.0.3"]
# DeepSpeed's model states (stage 0: the optimizer is in it) and crew's own beside them
SHARED_FILES = {"mp_rank_00_model_states.pt", "crew_state.pt", "crew_checkpoint.json"}
ONE_NODE_COPY = SHARED_FILES  # a node's first rank writes all of it


def _isolation_unavailable() -> str | None:
    probe = ("import ctypes, subprocess, sys\n"
             "if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0: sys.exit(3)\n"
             "subprocess.run(['mount', '--make-rprivate', '/'], check=True)\n")
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot probe mount namespaces: {exc}"
    if done.returncode != 0:
        return ("node-local save dirs need a private mount namespace (unshare(CLONE_NEWNS) and "
                "mount, i.e. root or CAP_SYS_ADMIN), which is not permitted here: "
                + done.stderr.decode(errors="replace").strip()[-200:])
    return None


@pytest.fixture(scope="module")
def isolation():
    reason = _isolation_unavailable()
    if reason:
        pytest.skip(reason)


def prepare(folder):
    """`folder` with the training script, the ckpt mount point and the per-node save dirs."""
    write_script(folder, "train.py", TRAIN)
    (folder / "ckpt").mkdir()
    for host in HOSTS:
        (folder / f"node_{host}").mkdir()


@pytest.fixture(scope="module")
def saved(isolation, cluster, tmp_path_factory):
    """One job of 3 steps that saves on both nodes: its folder, for every test that loads what it wrote."""
    folder = tmp_path_factory.mktemp("saved")
    prepare(folder)
    result = run_on_nodes(cluster, folder, "--steps", "3", "--save", "--out", "saved")
    left = wait_until_gone(folder, timeout=15)
    assert result.code == 0, result.err
    assert not left, f"processes left running after the save: {left}"
    return folder


@pytest.fixture
def nodes(saved, cluster, job_dir):
    """job_dir as `saved` left it: a test may damage its own copy of the nodes' save dirs."""
    shutil.copytree(saved, job_dir, dirs_exist_ok=True)
    return cluster


def run_on_nodes(cluster, job_dir, *args, hosts=HOSTS, timeout=120):
    hostfile = job_dir / "hostfile"
    hostfile.write_text("".join(f"{host}:{cluster.port} slots=1\n" for host in hosts))
    return crew("run", "--ssh_args", cluster.ssh_args, "-H", str(hostfile), "train.py",
                "--isolate", *args, cwd=job_dir, timeout=timeout)


def results(job_dir, name, world_size=2):
    return [json.loads((job_dir / f"{name}.rank{r}.json").read_text()) for r in range(world_size)]


def node_dir(job_dir, host):
    return job_dir / f"node_{host}"


def test_each_node_writes_its_own_ranks_files_to_its_local_save_dir(saved):
    job_dir, saved = saved, results(saved, "saved")
    assert [r["host"] for r in saved] == HOSTS
    assert not list((job_dir / "ckpt").iterdir()), "a rank wrote outside its node's save dir"
    for rank, host in enumerate(HOSTS):
        local = node_dir(job_dir, host)
        assert sorted(p.name for p in local.iterdir()) == ["global_step3", "latest"], host
        assert (local / "latest").read_text().strip() == "global_step3"
        tag = local / "global_step3"
        assert {p.name for p in tag.iterdir()} == ONE_NODE_COPY | {f"rank{rank}.pt"}, host
        manifest = json.loads((tag / "crew_checkpoint.json").read_text())
        assert manifest["world_size"] == 2 and manifest["hosts"] == HOSTS
        # each node's rank wrote the node's copy of the shared files
        assert any("mp_rank_00_model_states.pt" in name for name in saved[rank]["written"]), saved[rank]


def uninterrupted(rank: int, folder: str) -> None:
    """The script's 6 steps without a save or a load, in run_ranks's forked ranks: only the numbers a resumed
    run must give (one thread each, as the script sets; the ssh nodes' part is in the runs that save and load)."""
    os.chdir(folder)
    os.environ["CREW_HOST"] = HOSTS[rank]
    sys.argv = ["train.py", "--steps", "6", "--out", "straight"]
    runpy.run_path("train.py", run_name="__main__")


def test_same_placement_loads_and_resumes_bitwise(nodes, job_dir):
    resumed = run_on_nodes(nodes, job_dir, "--steps", "6", "--load", "--out", "resumed")
    assert resumed.code == 0, resumed.err
    run_ranks(uninterrupted, 2, str(job_dir))
    resumed, straight = results(job_dir, "resumed"), results(job_dir, "straight")
    for rank in range(2):
        assert resumed[rank]["loaded"] == str(job_dir / "ckpt" / "global_step3")
        assert resumed[rank]["client_state"] == {"saved_at": 3, "note": "hi"}
        assert resumed[rank]["loaded_step"] == 3 and resumed[rank]["steps"] == 6
    assert straight[0]["steps"] == 6
    digests = {r["params_sha256"] for r in resumed + straight}
    assert len(digests) == 1, "resumed training differs from an uninterrupted run of 6 steps"
    assert digests != {r["params_sha256"] for r in results(job_dir, "saved")}


def test_swapped_placement_names_the_missing_files_and_says_not_shared(nodes, job_dir):
    swapped = list(reversed(HOSTS))  # rank 0 now runs where only rank1.pt was written
    result = run_on_nodes(nodes, job_dir, "--steps", "6", "--load", "--out", "swapped",
                          hosts=swapped)
    assert result.code != 0
    assert result.seconds < 60, f"the failed load took {result.seconds:.0f}s to end the job"
    ckpt = job_dir / "ckpt" / "global_step3"
    for rank, host in enumerate(swapped):
        missing = f"{ckpt / f'rank{rank}.pt'} is missing (rank {rank} was saved on {HOSTS[rank]})"
        assert missing in result.err
        outcome = json.loads((job_dir / f"swapped.rank{rank}.json").read_text())
        assert outcome["host"] == host
        assert "CheckpointError" in outcome["error"], outcome  # every rank raised, none trained
        assert "failed on 2 rank(s)" in outcome["error"]
        for other in range(2):
            assert f"rank{other}.pt is missing" in outcome["error"]
    assert "the save dir is not shared between nodes" in result.err


def test_shared_filesystem_writes_the_shared_files_once(job_dir):
    write_script(job_dir, "train.py", TRAIN)
    result = crew("run", "--num_gpus", "2", "train.py", "--steps", "3", "--save", "--out", "local",
                  cwd=job_dir)
    assert result.code == 0, result.err
    tag = job_dir / "ckpt" / "global_step3"
    assert {p.name for p in tag.iterdir()} == SHARED_FILES | {"rank0.pt", "rank1.pt"}
    assert sorted(p.name for p in (job_dir / "ckpt").iterdir()) == ["global_step3", "latest"]
    rank0, rank1 = results(job_dir, "local")
    # DeepSpeed's layout is one model states file: rank 0 writes it and crew's state; each rank its own file
    assert sum("mp_rank_00_model_states.pt" in name for name in rank0["written"]) == 1, rank0["written"]
    assert not any("mp_rank_00" in n or "crew_state.pt" in n for n in rank1["written"]), \
        f"rank 1 wrote rank 0's files on a shared filesystem: {rank1['written']}"
    assert any("rank1.pt" in name for name in rank1["written"])


@pytest.mark.parametrize("damage", ["lost", "stale"])
def test_node_whose_latest_differs_fails_every_rank(nodes, job_dir, damage):
    """Same placement, but 127.0.0.3's save dir was emptied (a replaced node) or its `latest`
    names another tag (its commit of the newest save failed): every rank must fail, not some."""
    local = node_dir(job_dir, HOSTS[1])
    if damage == "lost":
        shutil.rmtree(local)
        local.mkdir()
    else:
        shutil.copytree(local / "global_step3", local / "global_step2")
        (local / "latest").write_text("global_step2")
    try:
        result = run_on_nodes(nodes, job_dir, "--steps", "6", "--load", "--out", "damaged",
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the load hung: the ranks disagreed on which checkpoint to load")
    assert result.code != 0, "ranks resumed from different checkpoints (or one started fresh)"
    for outcome in results(job_dir, "damaged"):  # every rank raised, naming the node that differs
        assert "CheckpointError" in outcome.get("error", ""), outcome
        assert HOSTS[1] in outcome["error"] and "not shared" in outcome["error"], outcome
