"""No silent hangs: the join watch, the init timeout report, stacks of stuck ranks, collective timeouts.

The first half tests the parts on their own with real sockets and real faulthandler dumps; the second
runs real jobs (gloo) through `crew run`, locally and across the loopback ssh nodes.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import crew, ranks_saying, wait_until_gone, write_script

from crew.launcher.node import joinwatch

from crew.launcher.node import stacks
from crew.launcher.node.joinwatch import CONNECTING, JOINED, LISTENING, NOT_CONNECTED

# --------------------------------------------------------------------------------------------
# joinwatch: /proc with real sockets


@pytest.mark.parametrize("text, expected", [
    ("0100007F:7389", ("127.0.0.1", 29577)),
    ("0300007F:0050", ("127.0.0.3", 80)),
    ("00000000:0016", ("0.0.0.0", 22)),
    ("0000000000000000FFFF00000200007F:B51A", ("127.0.0.2", 46362)),   # IPv4-mapped
    ("00000000000000000000000001000000:1F90", ("::1", 8080)),
    ("00000000000000000000000000000000:0000", ("::", 0)),
])
def test_decode_address(text, expected):
    assert joinwatch.decode_address(text) == expected


def inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


@pytest.fixture
def store_like():
    """A listener with a full accept queue, one connected client, and clients left in SYN_SENT."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)  # a full queue drops further SYNs: what a firewall that drops looks like
    port = server.getsockname()[1]
    clients = []
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        try:
            client.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        clients.append(client)
    time.sleep(0.2)
    yield server, clients, port
    for sock in (server, *clients):
        sock.close()


def test_classify_real_sockets(store_like):
    server, (joined, connecting, _), port = store_like
    conns = joinwatch.tcp_connections(os.getpid())
    assert joinwatch.classify(conns, {inode(joined)}, port) == joinwatch.Seen(JOINED, f"127.0.0.1:{port}")
    assert joinwatch.classify(conns, {inode(connecting)}, port) == joinwatch.Seen(CONNECTING,
                                                                                   f"127.0.0.1:{port}")
    assert joinwatch.classify(conns, {inode(server)}, port) == joinwatch.Seen(LISTENING)
    # rank 0: its store listens, and its own client is connected to it: joined wins
    assert joinwatch.classify(conns, {inode(server), inode(joined)}, port).state == JOINED
    assert joinwatch.classify(conns, {inode(connecting), inode(server)}, port).state == CONNECTING
    assert joinwatch.classify(conns, {inode(joined)}, port + 1).state == NOT_CONNECTED  # another port
    assert joinwatch.classify(conns, set(), port).state == NOT_CONNECTED


def test_socket_inodes_of_this_process(store_like):
    server, clients, _ = store_like
    assert {inode(server), *map(inode, clients)} <= joinwatch.socket_inodes(os.getpid())
    assert joinwatch.socket_inodes(2 ** 22 + 12345) == set()  # no such process


HOLDER = """
    import os, socket, sys, time
    port, connect = int(sys.argv[1]), sys.argv[2] == "1"
    if os.fork() == 0:                 # a helper of the rank, in the rank's session, holds the socket
        sock = socket.create_connection(("127.0.0.1", port)) if connect else None
        print("ready", flush=True)
        time.sleep(60)
    time.sleep(60)
"""


@pytest.mark.parametrize("connect, state", [(True, JOINED), (False, NOT_CONNECTED)])
def test_observe_looks_at_the_whole_session_of_a_rank(tmp_path, connect, state):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        script = write_script(tmp_path, "holder.py", HOLDER)
        proc = subprocess.Popen([sys.executable, str(script), str(port), "1" if connect else "0"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert proc.stdout.readline() == "ready\n"
            assert joinwatch.observe({5: proc.pid}, port) == {
                5: joinwatch.Seen(state, f"127.0.0.1:{port}" if connect else None)}
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("state, remote, rank0, taken, in_init, expected", [
    (CONNECTING, "10.0.0.1:29500", JOINED, False, False,
     "connecting to 10.0.0.1:29500 with no answer: a firewall drops it, or 10.0.0.1 is not reachable "
     "from n1 (set --master_addr to an address of the first node that every node can reach; check "
     "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME)"),
    (LISTENING, None, LISTENING, True, True, "its store listens on port 29500, but it has not connected "
     "to 10.0.0.1:29500 itself: 10.0.0.1 may not be an address of n1"),
    (NOT_CONNECTED, None, JOINED, True, False, "not connected to 10.0.0.1:29500: it has not called "
     "init_process_group (still in start-up code, or stuck before it: see where it was below)"),
    (NOT_CONNECTED, None, JOINED, False, False, "it has not called init_process_group (still in start-up "
     "code, or stuck before it), or its connections are refused"),
    (NOT_CONNECTED, None, JOINED, True, True, "in init_process_group, but its connections to "
     "10.0.0.1:29500 are refused or reset: 10.0.0.1 is not rank 0's node as seen from n1"),
    (NOT_CONNECTED, None, NOT_CONNECTED, True, True, "waiting for rank 0's store at 10.0.0.1:29500, which "
     "does not listen: rank 0 has not called init_process_group"),
])
def test_missing_cause(state, remote, rank0, taken, in_init, expected):
    assert expected in joinwatch.missing_cause(state, remote, "n1", "10.0.0.1", 29500, rank0, taken, in_init)


# --------------------------------------------------------------------------------------------
# stacks: a real faulthandler dump

STUCK = """
    import sys, threading, time

    def helper():
        time.sleep(60)

    def wait_here():
        print("ready", flush=True)
        time.sleep(60)                                        # line 9

    threading.Thread(target=helper, name="helper", daemon=True).start()
    wait_here()                                               # line 12
"""


def test_parse_a_real_faulthandler_dump(tmp_path):
    script = write_script(tmp_path, "stuck.py", STUCK)
    proc = subprocess.Popen([sys.executable, "-u", str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.5)  # from print() on to the sleep on line 9
    resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, 0))
    proc.send_signal(signal.SIGABRT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGABRT
    threads = stacks.parse_dump(["earlier output", *err.splitlines()])
    assert len(threads) == 2
    helper, main = threads
    assert [(f.func, f.line) for f in main.frames] == [("wait_here", 9), ("<module>", 12)]
    assert main.frames[0].file == str(script)
    assert helper.frames[0].func == "helper" and helper.frames[0].line == 5
    assert stacks.main_frames(threads) == main.frames
    place = stacks.where(main.frames, str(tmp_path))
    assert place == stacks.Where(None, "stuck.py:9 in wait_here")
    assert stacks.describe(place) == "at stuck.py:9 in wait_here"


def test_parse_dump_without_a_dump():
    assert stacks.parse_dump(["hello", "Traceback (most recent call last):"]) is None
    assert stacks.main_frames([]) == ()
    assert stacks.where((), "/x") is None


SITE = "/venv/lib/python3.11/site-packages/torch/distributed"


def frames(*spec):
    return [stacks.Frame(file, line, func) for file, line, func in spec]


def test_where_names_the_torch_distributed_call_and_the_scripts_line():
    stack = frames((f"{SITE}/rendezvous.py", 199, "_create_c10d_store"),
                   (f"{SITE}/distributed_c10d.py", 1892, "init_process_group"),
                   (f"{SITE}/c10d_logger.py", 83, "wrapper"),
                   ("/job/lib/setup.py", 4, "setup"),
                   ("/job/train.py", 3, "<module>"))
    place = stacks.where(stack, "/job")
    assert place == stacks.Where("torch.distributed init_process_group", "lib/setup.py:4 in setup")
    assert stacks.describe(place) == ("waiting in torch.distributed init_process_group, called from "
                                      "lib/setup.py:4 in setup")
    # outside the job's directory (and inside installed packages under it): the outermost frame
    assert stacks.where(frames(("/opt/x.py", 2, "f"), ("/opt/main.py", 9, "main")), "/job").location == \
        "/opt/main.py:9 in main"
    assert stacks.where(frames(("/job/.venv/lib/python3.11/site-packages/m.py", 1, "f"),
                               ("/job/t.py", 5, "<module>")), "/job").location == "t.py:5 in <module>"
    ddp = stacks.where(frames(("/v/torch/autograd/graph.py", 1, "_engine_run_backward"),
                              ("/job/t.py", 5, "step")), "/job")
    assert ddp.in_collective and "backward" in ddp.call


def test_parse_traceback_of_a_timed_out_rank():
    tail = ["[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "/job/coll.py", line 6, in <module>',
            "[rank0]:     dist.all_reduce(torch.ones(1))",
            f'[rank0]:   File "{SITE}/c10d_logger.py", line 83, in wrapper',
            "[rank0]:     return func(*args, **kwargs)",
            f'[rank0]:   File "{SITE}/distributed_c10d.py", line 3252, in all_reduce',
            "[rank0]:     work.wait()",
            "[rank0]: RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
            "recv operation to complete"]
    parsed = stacks.parse_traceback(tail)
    assert [f.func for f in parsed] == ["all_reduce", "wrapper", "<module>"]
    place = stacks.where(parsed, "/job")
    assert stacks.describe(place, "timed out") == ("timed out in torch.distributed all_reduce, called from "
                                                    "coll.py:6 in <module>")
    assert stacks.looks_like_collective_timeout(tail)


@pytest.mark.parametrize("line, expected", [
    ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv", True),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for "
     "600027 milliseconds before timing out.", True),
    ("torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
     True),
    ("torch.distributed.DistStoreError: wait timeout after 300000ms, keys: /default_pg/0//cuda//0", True),
    ("RuntimeError: CUDA error: out of memory", False),
    ("ValueError: bad config", False),
    ("fatal: rank 2 gives up at step 3", False),
])
def test_looks_like_collective_timeout(line, expected):
    assert stacks.looks_like_collective_timeout(["Traceback (most recent call last):", line]) is expected


def test_rank_lists_and_grouping():
    assert stacks.rank_list([3]) == "rank 3"
    assert stacks.rank_list([6, 0, 1, 2, 3, 9, 10]) == "ranks 0-3, 6, 9-10"
    assert stacks.group_lines([(2, "b", "x"), (0, "a", "x"), (1, "a", "x"), (3, "b", "y")]) == [
        "ranks 0-1 (a): x", "rank 2 (b): x", "rank 3 (b): y"]


def test_reports_stay_short_on_many_nodes():
    waiting = [(rank, f"127.0.0.{rank // 2 + 2}", "waiting in all_reduce (train.py:10)") for rank in range(128)]
    lines = stacks.group_lines([*waiting, (128, "127.0.1.1", "in step (train.py:12)")])
    assert lines == ["ranks 0-127 (64 nodes, e.g. 127.0.0.2, 127.0.0.3, 127.0.0.4): waiting in all_reduce "
                     "(train.py:10)", "rank 128 (127.0.1.1): in step (train.py:12)"]
    scattered = stacks.rank_list(range(0, 400, 2))
    assert scattered.startswith("ranks 0, 2, 4, ") and scattered.endswith(", … (200 ranks)") and len(scattered) < 90


# --------------------------------------------------------------------------------------------
# real jobs

NEVER_INIT = """
    import datetime, os, time
    import torch.distributed as dist
    if os.environ["RANK"] == os.environ.get("STUCK_RANK", "1"):
        time.sleep(60)                                        # line 5: never calls init
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("PG_TIMEOUT", 60))))
    dist.destroy_process_group()
"""


def assert_nothing_left(folder):
    assert not wait_until_gone(folder, timeout=10), "ranks left running"


def test_a_rank_that_never_calls_init_is_named_with_its_stack(job_dir):
    write_script(job_dir, "script.py", NEVER_INIT)
    result = crew("run", "--num_gpus", "2", "--init_timeout", "3", "--log_dir", "logs", "script.py",
                  cwd=job_dir, timeout=60)
    assert result.code == 124, result.err
    master = next(word for word in result.err.split() if word.startswith("127.0.0.1:"))
    assert f"ranks did not all join the process group at {master} within 3 s (--init_timeout): " \
           "joined: rank 0 (localhost); missing: rank 1 (localhost)." in result.err
    report = result.err.split("the process group did not form")[1]
    assert f"not every rank joined within 3 s (--init_timeout); master {master}" in report
    assert "  joined: rank 0 (localhost)\n" in report
    assert (f"  missing: rank 1 on localhost: not connected to {master}: it has not called init_process_group "
            "(still in start-up code, or stuck before it: see where it was below)") in report
    assert "  rank 0 (localhost): waiting in torch.distributed init_process_group, called from " \
           "script.py:6 in <module>" in report
    assert "  rank 1 (localhost): at script.py:5 in <module>" in report
    assert "Raise --init_timeout if start-up legitimately takes this long" in report
    assert "0 disables the check" in report
    for rank, line in ((0, 6), (1, 5)):
        log = (job_dir / "logs" / f"rank{rank}.log").read_text()
        assert "Fatal Python error: Aborted" in log
        assert f'File "{job_dir / "script.py"}", line {line} in <module>' in log
    assert "Traceback" not in result.err
    assert result.seconds < 30
    assert_nothing_left(job_dir)


def test_ranks_that_join_in_time_are_not_stopped(job_dir):
    write_script(job_dir, "ok.py", """
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        value = torch.ones(1)
        dist.all_reduce(value)
        time.sleep(3)                       # longer than --init_timeout: no false alarm
        dist.barrier()
        print("sum", value.item())
        dist.destroy_process_group()
    """)
    result = crew("run", "--num_gpus", "2", "--init_timeout", "2", "ok.py", cwd=job_dir, timeout=60)
    assert result.code == 0, result.err
    assert "all 2 ranks joined the process group" in result.err
    assert "did not all join" not in result.err and "Fatal Python error" not in result.err
    assert ranks_saying(result.out, "sum 2.0") == [0, 1]


def test_a_job_that_never_uses_the_master_port_gets_a_warning_not_a_stop(job_dir):
    write_script(job_dir, "solo.py", "import time; time.sleep(4); print('finished')\n")
    result = crew("run", "--num_gpus", "2", "--init_timeout", "1", "solo.py", cwd=job_dir, timeout=60)
    assert result.code == 0, result.err
    assert ranks_saying(result.out, "finished") == [0, 1]
    assert "no rank has connected to the master" in result.err and "crew keeps waiting" in result.err


def test_init_timeout_zero_disables_the_watch(job_dir):
    write_script(job_dir, "quick.py", "print('done')\n")
    result = crew("run", "--num_gpus", "2", "--init_timeout", "0", "quick.py", cwd=job_dir)
    assert result.code == 0 and "joined" not in result.err


COLLECTIVE = """
    import datetime, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(60)                                        # line 5: late for the all_reduce
    dist.all_reduce(torch.ones(1))                            # line 6
"""


def test_a_collective_timeout_names_the_rank_that_did_not_arrive(job_dir):
    write_script(job_dir, "coll.py", COLLECTIVE)
    result = crew("run", "--num_gpus", "2", "--log_dir", "logs", "coll.py", cwd=job_dir, timeout=60)
    assert result.code == 1, result.err  # rank 0's own exit code
    assert "localhost rank 0 (local 0) exited with code 1 (first failure)" in result.err
    report = result.err.split("rank 0 timed out in a torch.distributed operation.")[1]
    assert "  rank 0 (localhost): timed out in torch.distributed all_reduce, called from coll.py:6 in " \
           "<module>" in report
    assert "  rank 1 (localhost): at coll.py:5 in <module>" in report
    assert "did not arrive: rank 1 (localhost) at coll.py:5 in <module>" in report
    assert "Fatal Python error: Aborted" in (job_dir / "logs" / "rank1.log").read_text()
    assert result.seconds < 30
    assert_nothing_left(job_dir)


def test_never_init_across_ssh_nodes_names_the_host(cluster, job_dir):
    write_script(job_dir, "script.py", NEVER_INIT)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)),
                  "--skip_preflight", "--init_timeout", "3", "script.py", cwd=job_dir, timeout=60)
    assert result.code == 124, result.err
    report = result.err.split("the process group did not form")[1]
    assert "; master 127.0.0.2:" in report
    assert "  joined: rank 0 (127.0.0.2)\n" in report
    assert "  missing: rank 1 on 127.0.0.3: not connected to 127.0.0.2:" in report
    assert "it has not called init_process_group" in report
    assert "  rank 0 (127.0.0.2): waiting in torch.distributed init_process_group" in report
    assert "  rank 1 (127.0.0.3): at script.py:5 in <module>" in report
    assert 1 in ranks_saying(result.err, "Fatal Python error: Aborted")  # with rank 0's, if in time
    assert_nothing_left(job_dir)


@pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh not installed (apt-get install pdsh)")
def test_never_init_under_pdsh_reports_the_join_states_without_stacks(cluster, job_dir):
    write_script(job_dir, "script.py", NEVER_INIT)
    result = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "--launcher",
                  "pdsh", "--skip_preflight", "--init_timeout", "3", "script.py", cwd=job_dir, timeout=60)
    assert result.code == 124, result.err
    assert "Stopping the job; the report follows." in result.err
    report = result.err.split("the process group did not form")[1]
    assert "  joined: rank 0 (127.0.0.2)\n" in report
    assert "  missing: rank 1 on 127.0.0.3: not connected to 127.0.0.2:" in report
    assert "no stacks: the pdsh launcher gives the agents no stdin" in report
    assert "Fatal Python error" not in result.err
    assert_nothing_left(job_dir)


def test_rank_zero_stuck_before_init_is_named_when_torch_times_out(job_dir):
    # Nobody reaches the master port while rank 0 (the store) is stuck: crew only warns (it cannot tell
    # such a job from one that does not use torch.distributed), torch's own timeout ends the wait, and
    # crew then takes the stacks and names rank 0 as the one that did not arrive.
    write_script(job_dir, "script.py", NEVER_INIT)
    result = crew("run", "--num_gpus", "2", "--init_timeout", "2", "script.py", cwd=job_dir, timeout=60,
                  env={"STUCK_RANK": "0", "PG_TIMEOUT": "4"})
    assert result.code == 1, result.err
    assert "no rank has connected to the master" in result.err
    report = result.err.split("rank 1 timed out in a torch.distributed operation.")[1]
    assert "  rank 1 (localhost): timed out in torch.distributed init_process_group, called from " \
           "script.py:6 in <module>" in report
    assert "did not arrive: rank 0 (localhost) at script.py:5 in <module>" in report
    assert_nothing_left(job_dir)
