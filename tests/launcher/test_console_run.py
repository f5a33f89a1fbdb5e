"""`crew run`'s console with real jobs: progress bars on a terminal (a pseudo-terminal) and in a file, the
same line from every rank merged, the rank logs byte for byte, and the job record in --log_dir."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil

import pytest
from conftest import STEPPER, crew, crew_command, ranks_saying, write_script
from terminal import replay, run_in_terminal

# Both ranks start together (files as a barrier), so that their lines fall in one merge window even
# on a busy machine; the window is widened for the same reason (CREW_MERGE_WINDOW).
TQDM_BARS = """
    import json, os, sys, time
    from tqdm import tqdm
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(f"ready{rank}", "w").close()
    while not all(os.path.exists(f"ready{r}") for r in range(world)):
        time.sleep(0.01)
    print("same on every rank", flush=True)
    print(f"only on rank {rank}", flush=True)
    for _ in tqdm(range(20), desc=f"bar{rank}", mininterval=0.05):
        time.sleep(0.05)
    json.dump({"CREW_CONSOLE": os.environ.get("CREW_CONSOLE")}, open(f"env{rank}.json", "w"))
"""


def in_terminal(*args: str, cwd, env: dict | None = None) -> tuple[int, bytes, list[str], int]:
    code, data = run_in_terminal(crew_command(*args), cwd, {**os.environ, **(env or {})})
    screen, column = replay(data)
    return code, data, screen, column


def check_terminal(data: bytes, screen: list[str], column: int, hosts: list[str]) -> None:
    """Bars drawn in place, each final state once; the same line merged, different lines not."""
    text = data.decode(errors="replace")
    assert "\x1b[J" in text                                    # the progress area was erased and redrawn
    for rank, host in enumerate(hosts):
        states = set(re.findall(rf"bar{rank}: +(\d+)%", text))
        assert len(states) >= 3, f"rank {rank}'s bar was not drawn as it went: {states}"
        finals = [line for line in screen if f"bar{rank}:" in line]
        assert len(finals) == 1 and finals[0].startswith(f"[{host}:{rank}] bar{rank}: 100%|"), screen
        assert "20/20" in finals[0]
        assert screen.count(f"[{host}:{rank}] only on rank {rank}") == 1
    assert ranks_saying("\n".join(screen), "same on every rank") == [0, 1], screen
    assert sum("same on every rank" in line for line in screen) == 1
    assert column == 0 and screen[-1] == ""                    # nothing left drawn below the last line


def test_a_terminal_gets_bars_drawn_in_place_and_each_line_once(job_dir):
    write_script(job_dir, "bars.py", TQDM_BARS)
    code, data, screen, column = in_terminal("run", "--num_gpus", "2", "bars.py", cwd=job_dir,
                                             env={"CREW_MERGE_WINDOW": "3"})
    assert code == 0, screen
    check_terminal(data, screen, column, ["localhost", "localhost"])
    for rank in range(2):
        assert json.loads((job_dir / f"env{rank}.json").read_text()) == {"CREW_CONSOLE": "tty"}
    assert any(line.startswith("crew: job ") for line in screen)


PDSH = pytest.mark.skipif(not shutil.which("pdsh"), reason="pdsh not installed (apt-get install pdsh)")


@pytest.mark.parametrize("launcher", ["ssh", pytest.param("pdsh", marks=PDSH)])
def test_bars_and_merged_lines_from_ranks_on_other_nodes(cluster, job_dir, launcher):
    write_script(job_dir, "bars.py", TQDM_BARS)
    code, data, screen, column = in_terminal(
        "run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "--launcher", launcher,
        "--skip_preflight", "bars.py", cwd=job_dir, env={"CREW_MERGE_WINDOW": "3"})
    assert code == 0, screen
    check_terminal(data, screen, column, ["127.0.0.2", "127.0.0.3"])


# Progress written by hand as tqdm does ("\r<state>", the newest left open), and bytes a log must keep.
HAND_BAR = """
    import json, os, sys, time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wrote = bytearray()
    def write(data):
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        wrote.extend(data)
    open(f"ready{rank}", "w").close()
    while not all(os.path.exists(f"ready{r}") for r in range(world)):
        time.sleep(0.01)
    if rank == 0:  # the job record, while the job runs
        json.dump(json.load(open("logs/crew_job.json")), open("record_running.json", "w"))
    write(b"same on every rank\\r\\n")
    write(f"only on rank {rank}\\n".encode())
    started = time.monotonic()
    for i in range(25):
        write(f"\\rbar{rank} {4 * i:3d}%".encode())
        time.sleep(0.04)
    write(f"\\rbar{rank} done\\n".encode())
    seconds = time.monotonic() - started
    write("tab\\there, \\u2588 and no line end".encode())
    open(f"wrote{rank}.bin", "wb").write(wrote)
    json.dump({"seconds": seconds, "CREW_CONSOLE": os.environ.get("CREW_CONSOLE")}, open(f"bar{rank}.json", "w"))
"""


def test_a_file_gets_bars_thinned_and_the_logs_every_byte(job_dir):
    write_script(job_dir, "bar.py", HAND_BAR)
    result = crew("run", "--num_gpus", "2", "--log_dir", "logs", "bar.py", cwd=job_dir,
                  env={"CREW_PROGRESS_INTERVAL": "0.4", "CREW_MERGE_WINDOW": "3"})
    assert result.code == 0, result.err
    for rank in range(2):
        assert (job_dir / "logs" / f"rank{rank}.log").read_bytes() == (job_dir / f"wrote{rank}.bin").read_bytes()
        seen = json.loads((job_dir / f"bar{rank}.json").read_text())
        assert seen["CREW_CONSOLE"] == "plain"
        updates = list(re.finditer(rf"^\[localhost:{rank}\] bar{rank} +(\d+)%$", result.out, re.M))
        assert 1 <= len(updates) <= seen["seconds"] / 0.4 + 2, updates  # of 25
        percents = [int(update.group(1)) for update in updates]
        assert percents == sorted(percents)
        assert result.out.count(f"[localhost:{rank}] bar{rank} done\n") == 1
        assert result.out.index(f"bar{rank} done") > updates[-1].start()  # the final state comes last
        assert ranks_saying(result.out, f"only on rank {rank}") == [rank]
    assert ranks_saying(result.out, "same on every rank") == [0, 1]
    assert ranks_saying(result.out, "tab\there, \u2588 and no line end") == [0, 1]
    assert result.out.count("same on every rank") == 1

    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    job_id = re.search(r"crew: job (\w+) ", result.err).group(1)
    assert record["job_id"] == job_id and record["command"] == ["crew", "run", "--num_gpus", "2", "--log_dir",
                                                                "logs", "bar.py"]
    [node] = record["nodes"]
    assert record["world_size"] == 2 and (node["host"], node["ranks"]) == ("localhost", [0, 1])
    assert set(node["startup_s"]) == {"connect", "agent", "waited", "spawn", "total"}  # the console shows a summary
    assert (record["status"], record["exit_code"], record["exit_codes"]) == ("succeeded", 0, {"0": 0, "1": 0})
    assert record["first_failure"] is None and record["launcher"] == "local"
    started, ended = (datetime.datetime.fromisoformat(record[k]) for k in ("started_at", "ended_at"))
    assert started <= ended and started.tzinfo is not None
    running = json.loads((job_dir / "record_running.json").read_text())
    assert (running["status"], running["exit_code"], running["ended_at"]) == ("running", None, None)
    assert running["started_at"] == record["started_at"]
    assert not [p.name for p in (job_dir / "logs").iterdir() if p.name.startswith(".")]  # no temp files


def test_the_job_record_names_the_first_failure(job_dir):
    write_script(job_dir, "step.py", STEPPER)
    result = crew("run", "--num_gpus", "2", "--log_dir", "logs", "step.py", cwd=job_dir, env={"FAIL_RANK": "1"})
    assert result.code == 7
    record = json.loads((job_dir / "logs" / "crew_job.json").read_text())
    assert (record["status"], record["exit_code"]) == ("failed", 7)
    assert record["exit_codes"] == {"0": 143, "1": 7}          # rank 0 was stopped with SIGTERM
    failure = record["first_failure"]
    assert {k: failure[k] for k in ("rank", "host", "exit_code", "signal")} == {
        "rank": 1, "host": "localhost", "exit_code": 7, "signal": None}
    assert failure["message"].startswith("localhost rank 1 (local 1) exited with code 7 (first failure).")
    assert "fatal: rank 1 gives up at step 3" in failure["message"]
