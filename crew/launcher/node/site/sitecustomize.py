"""crew's hook in every rank: Python runs this first in each process `crew run` starts (the agent puts this
folder first on the ranks' PYTHONPATH), then the `sitecustomize` it shadows, if there is one.

It is standard library only and does nothing a script can see, so that any Python that reaches it (a
rank, a `--no_python` wrapper's interpreter, a data-loader worker) may run it:

- **A clean exit.** A gloo work (DDP's gradient all-reduce) is destroyed in gloo's worker thread
  `pt_gloo_runloop` once it is done, and its destructor takes the GIL (the work keeps the autograd
  context, a Python object, since torch 2.x). If the script ends within those few milliseconds,
  Python is already finalizing when the thread asks for the GIL; CPython 3.11-3.13 then exits the
  thread with pthread_exit, whose unwinding through the C++ destructor aborts the process: "terminate
  called without an active exception", SIGABRT, after the job trained fine. At exit, while Python is
  still whole, this waits (the GIL released) until every gloo worker thread is idle again.
- **Stacks on request.** With CREW_STACKS=FD:SIGNAL (set by the agent), faulthandler writes the main
  thread's stack to FD when the agent sends SIGNAL, without stopping the rank: how the agent sees where
  a stalled rank waits (crew/launcher/node/sampler.py).
- **crew from where it is installed.** `import crew` (and the `deepspeed` shim's) finds the crew this
  interpreter has, never a folder named `crew/` beside the script or in the working directory.
"""

import atexit
import os
import sys
import time

GLOO_WORKER = "pt_gloo_runloop"
IDLE_WAIT_S = 3.0  # at most this long at exit; a worker busy longer is inside a collective that hangs
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238, "riscv64": 98}.get(os.uname().machine)


def _idle_ops() -> tuple[int, ...]:
    """The futex operations of an idle condition-variable wait: FUTEX_WAIT_BITSET since glibc 2.34; before
    it, plain FUTEX_WAIT, which a mutex wait uses too (two idle looks in a row tell them apart enough)."""
    try:
        major, minor = os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2]
        old = (int(major), int(minor)) < (2, 34)
    except (ValueError, OSError, IndexError, AttributeError):
        old = True
    return (9, 0) if old else (9,)


_IDLE_OPS = _idle_ops()


def idle_waiting(syscall: str) -> bool:
    """Whether /proc/<pid>/task/<tid>/syscall shows a thread blocked in a condition-variable wait with no
    timeout: a gloo worker waiting for work. Running, runnable, a timed wait (the GIL's) or a mutex wait
    is not idle."""
    fields = syscall.split()
    if len(fields) < 5 or _FUTEX is None or fields[0] != str(_FUTEX):
        return False
    try:
        op, timeout = int(fields[2], 16), int(fields[4], 16)
    except ValueError:
        return False
    return op & 0x7F in _IDLE_OPS and timeout == 0


def busy_gloo_workers(task_dir: str = "/proc/self/task") -> int:
    """How many of this process's gloo worker threads are not idle."""
    busy = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm") as comm:
                if comm.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{task_dir}/{tid}/syscall") as syscall:
                busy += not idle_waiting(syscall.read())
        except OSError:
            continue  # the thread ended
    return busy


def wait_for_gloo_workers(limit_s: float = IDLE_WAIT_S) -> float:
    """At exit: sleep (which releases the GIL) until no gloo worker thread is busy, at most `limit_s`.
    Returns the seconds waited. Costs nothing to a process without torch.distributed."""
    if "torch.distributed" not in sys.modules or _FUTEX is None:  # no gloo, or no way to tell: no wait
        return 0.0
    start, idle_looks = time.monotonic(), 0
    while idle_looks < 2 and time.monotonic() - start < limit_s:  # twice: work queued just now is not taken yet
        idle_looks = 0 if busy_gloo_workers() else idle_looks + 1
        time.sleep(0.002)
    return time.monotonic() - start


def _serve_stacks() -> None:
    spec = os.environ.pop("CREW_STACKS", "")
    fd, _, number = spec.partition(":")
    if not (fd.isdigit() and number.isdigit()):
        return
    import faulthandler
    import signal

    try:
        os.set_inheritable(int(fd), False)  # the rank's own children do not keep the agent's pipe open
        # what faulthandler puts back at exit: a signal sent just then is ignored, not the default death
        signal.signal(int(number), signal.SIG_IGN)
        faulthandler.register(int(number), file=int(fd), all_threads=False, chain=False)
    except (OSError, ValueError, RuntimeError):
        pass  # no stacks on request for this rank; the agent sees no handler and does not ask


class _AfterImport:
    """A meta path finder that lets `module` load as usual, then hands it to `patch`; once."""

    def __init__(self, module: str, patch) -> None:
        self.module, self.patch = module, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.module:
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            load, patch = spec.loader.exec_module, self.patch

            def exec_module(module):
                load(module)
                patch(module)

            spec.loader.exec_module = exec_module
        return spec


def _gloo_for_accelerate(state) -> None:
    """Accelerate's PartialState picks no backend for a rank without a GPU unless told `cpu` (which drops a
    DeepSpeed config): it then runs each rank as a world of one. Under `crew run --as_deepspeed` on such a
    machine (CREW_DEEPSPEED_ON_CPU, set by the agent), it gets gloo over the ranks crew started instead."""
    original = state.PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", state.DistributedType.MULTI_CPU
        return chosen, kind

    state.PartialState._prepare_backend = _prepare_backend


def _serve_accelerate_on_cpu() -> None:
    if os.environ.get("CREW_DEEPSPEED_ON_CPU") == "1" and "accelerate.state" not in sys.modules:
        sys.meta_path.insert(0, _AfterImport("accelerate.state", _gloo_for_accelerate))


class _Pinned:
    """A meta path finder that answers `name` with the spec it had before the script's folder (or, for
    `python -m`, the working directory) went first on sys.path, where sys.path now has only a folder of that
    name (a user's `crew/` outputs): Python would import it as an empty namespace package in place of an
    editable install, whose finder it asks only after every sys.path entry. A real package there still wins."""

    def __init__(self, spec) -> None:
        self.spec = spec

    def find_spec(self, name, path=None, target=None):
        if name != self.spec.name:
            return None
        import importlib.machinery

        found = importlib.machinery.PathFinder.find_spec(name, path)
        return None if found is not None and found.origin is not None else self.spec


def _pin(name: str) -> None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)  # sitecustomize runs before sys.path[0] is the script's folder
    except (ImportError, ValueError):
        return
    if spec is not None and spec.origin is not None and spec.loader is not None:
        sys.meta_path.insert(0, _Pinned(spec))


def _run_shadowed() -> None:
    """Run the `sitecustomize` this one hides (a distribution's or a user's), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


atexit.register(wait_for_gloo_workers)
_serve_stacks()
_serve_accelerate_on_cpu()
_pin("crew")
_run_shadowed()
