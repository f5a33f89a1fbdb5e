"""`python -m crew.launcher.preflight.probe`: what one node looks like, for `crew doctor` and `crew run`'s preflight.

Started on every node like the agent (same runner, same Python, in the job's working directory, the
same JobSpec on stdin or as base64 under pdsh). It prints one `probe` event line with the facts and
exits; the launching side compares the nodes and says what to fix. The quick mode (the preflight)
imports nothing heavy: the torch and CUDA versions are read from torch's version.py. `--full` (the
doctor) also imports torch for NCCL and the devices (where torch was built for GPUs), hashes the working
directory's files, checks the socket interfaces and the save dir, and tests the master port end to end:
node 0 listens on it and every node connects to it through the master address.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import crew
from crew.launcher.transport.protocol import JobSpec, encode_event, node_arguments, read_job, split_long_lines

GREETING = b"crew-doctor\n"
MASTER_WAIT_S = 8.0  # how long node 0 listens and the others keep trying to connect
MAX_FILES = 20000
SAMPLED_ABOVE = 64 << 20  # bigger files: hash their size and first and last MiB only
_CHUNK = 1 << 20


def versions(full: bool) -> dict:
    build = _torch_build()
    found = {"python": sys.version.split()[0], "python_path": sys.executable,
             "crew": crew.__version__, "crew_path": str(Path(crew.__file__).parent),
             "torch": build["torch"], "cuda": build["cuda"]}
    if full and found["torch"]:
        # a torch built for the CPU only (neither CUDA nor ROCm) has no GPU to count and no NCCL: no import
        found.update(_torch_runtime() if build["gpu_build"] else {"nccl": None, "devices": 0})
    return found


def _torch_build() -> dict:
    """torch's version and CUDA build from its version.py, without importing torch (seconds), and whether it
    was built for GPUs (CUDA or ROCm; when version.py cannot be read, it may have been)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return {"torch": None, "cuda": None, "gpu_build": False}
    try:
        tree = ast.parse(Path(spec.origin).with_name("version.py").read_text())
    except (OSError, SyntaxError):
        return {"torch": "unknown", "cuda": None, "gpu_build": True}
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return {"torch": values.get("__version__", "unknown"), "cuda": values.get("cuda"),
            "gpu_build": values.get("cuda") is not None or values.get("hip") is not None or "__version__" not in values}


def _torch_runtime() -> dict:
    """NCCL's version and the GPUs this node has: all of them, as the ranks' device ids count them."""
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # the agent sets it per rank from the slots
    import torch

    if not torch.cuda.is_available():
        return {"nccl": None, "devices": 0}
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return {"nccl": nccl, "devices": torch.cuda.device_count()}


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as file:
        if size <= SAMPLED_ABOVE:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
        else:
            digest.update(str(size).encode() + file.read(_CHUNK))
            file.seek(size - _CHUNK)
            digest.update(file.read(_CHUNK))
    return digest.hexdigest()


def script_hash(job: JobSpec) -> str | None:
    """The hash of the script the ranks run; None when it is not here (or is a module)."""
    path = Path(job.cwd, job.program[0])
    if job.mode == "module" or not path.is_file():
        return None
    return file_hash(path)


def manifest(root: Path) -> dict:
    """{relative path: hash} of the files `crew sync` would copy, as far as MAX_FILES."""
    from crew.launcher.transport.ignore import list_files

    names = list_files(root)
    hashes = {}
    for name in names[:MAX_FILES]:
        try:
            hashes[name] = file_hash(root / name)
        except OSError as exc:
            hashes[name] = f"unreadable: {exc.strerror}"
    return {"files": hashes, "truncated": len(names) > MAX_FILES}


def interface_problems(env: dict[str, str]) -> list[str]:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME values that match no interface on this node."""
    names = sorted(name for _, name in socket.if_nameindex())
    problems = []
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl and not _nccl_matches(nccl, names):
        problems.append(f"NCCL_SOCKET_IFNAME={nccl} matches no interface")
    gloo = env.get("GLOO_SOCKET_IFNAME")
    missing = [name for name in (gloo or "").split(",") if name and name not in names]
    if missing:
        problems.append(f"GLOO_SOCKET_IFNAME={gloo}: no interface named {', '.join(missing)}")
    return [f"{problem} (interfaces here: {', '.join(names)})" for problem in problems]


def _nccl_matches(value: str, names: list[str]) -> bool:
    """NCCL's syntax: comma-separated prefixes, '=' for exact names, a leading '^' to exclude."""
    exclude = value.startswith("^")
    exact = value.lstrip("^").startswith("=")
    wanted = [w for w in value.lstrip("^").lstrip("=").split(",") if w]
    hit = [n for n in names if any(n == w if exact else n.startswith(w) for w in wanted)]
    return bool(set(names) - set(hit)) if exclude else bool(hit)


def disk(cwd: str, save_dir: str) -> dict:
    """Free space and write access at the save dir, or at its nearest existing parent."""
    path = Path(cwd, save_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    return {"path": str(path), "free": shutil.disk_usage(path).free,
            "writable": os.access(path, os.W_OK)}


def serve_master_port(port: int, expected: int, result: dict,
                      done: Callable[[], bool]) -> threading.Thread | None:
    """Node 0: listen where rank 0's store will, and greet whoever connects.

    Until every node has connected, `done()` (the other nodes have finished), or MASTER_WAIT_S.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore
    try:
        sock.bind(("", port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        result["listen_error"] = exc.strerror or str(exc)
        return None
    thread = threading.Thread(target=_greet, args=(sock, expected, done), daemon=True)
    thread.start()
    return thread


def _greet(sock: socket.socket, expected: int, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + MASTER_WAIT_S + 2
    greeted = 0
    with sock:
        sock.settimeout(0.2)
        while greeted < expected and not done() and time.monotonic() < deadline:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(GREETING)
            greeted += 1


def reach_master(addr: str, port: int) -> str | None:
    """None when the master port answers with our greeting from here; else what went wrong.

    Refused or unanswered connections are retried (node 0 may not listen yet); once connected, the
    answer is final: anything but the greeting means another program holds the port.
    """
    deadline = time.monotonic() + MASTER_WAIT_S
    error = "no answer"
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((addr, port), timeout=2)
        except OSError as exc:
            error = exc.strerror or type(exc).__name__
            time.sleep(0.2)
            continue
        with conn:
            conn.settimeout(2)
            try:
                answer = conn.recv(len(GREETING))
            except OSError:
                answer = b""
        return None if answer == GREETING else "another program holds that port"
    return error


def probe(job: JobSpec, node_rank: int, full: bool, save_dir: str | None,
          others_done: threading.Event) -> dict:
    facts = {"node": node_rank, "hostname": socket.gethostname(), "cwd": Path(job.cwd).is_dir()}
    master: dict = {}
    server = None
    if full and node_rank == 0:  # node 0 connects to itself first; then it waits for the others
        reached = threading.Event()
        server = serve_master_port(job.master_port, len(job.nodes), master,
                                   lambda: others_done.is_set() and reached.is_set())
        if server:
            master["connect_error"] = reach_master(job.master_addr, job.master_port)
            reached.set()
    facts.update(versions(full))
    facts["script"] = script_hash(job) if facts["cwd"] else None
    if full:
        env = {**os.environ, **job.env}
        facts["interfaces"] = interface_problems(env)
        if facts["cwd"]:
            facts["manifest"] = manifest(Path(job.cwd))
        if save_dir:
            facts["disk"] = disk(job.cwd, save_dir)
        if node_rank != 0:
            master["connect_error"] = reach_master(job.master_addr, job.master_port)
        facts["master"] = master
    if server:
        server.join(timeout=MASTER_WAIT_S + 3)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = node_arguments("python -m crew.launcher.preflight.probe", "crew's node check (started by `crew doctor`).")
    parser.add_argument("--full", action="store_true", help="every check, not only the quick ones")
    parser.add_argument("--save_dir", help="where checkpoints go (relative to the job's directory)")
    args = parser.parse_args(argv)
    job = read_job(parser, args)
    others_done = threading.Event()  # the launcher closes stdin once the other nodes' probes finished
    if not args.spec_b64:  # pdsh gives no stdin: node 0 listens until every node connected, or the timeout
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), others_done.set()), daemon=True).start()
    facts = probe(job, args.node_rank, args.full, args.save_dir, others_done)
    sys.stdout.buffer.write(split_long_lines(encode_event("probe", **facts), args.node_rank, job.line_max))
    sys.stdout.flush()
    return 0

if __name__ == "__main__":
    sys.exit(main())
