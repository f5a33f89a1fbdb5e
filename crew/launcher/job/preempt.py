"""`crew run`'s side of a preemption: what it says, its exit code, and a Slurm batch job's requeue.

SIGTERM or SIGUSR1 to `crew run` (a first one; Ctrl-C stays a stop) is passed to every agent as a `preempt`
line (job/run.py); each agent sends SIGTERM to its ranks' own processes and waits --preempt_grace before
SIGKILL (node/agent.py). Ranks whose config has crew's `"preemption": {"enabled": true}` finish the optimizer
step, save and exit 75 (crew/runtime/preemption.py); the others stop at once, as on any stop. Under pdsh the
agents have no stdin: there a SIGTERM stops the job as before.

Inside an sbatch job (`exec crew run ...` makes crew the batch shell, so `#SBATCH --signal=B:USR1@120`
reaches it) crew requeues the job itself once the ranks saved (`scontrol requeue $SLURM_JOB_ID`): nothing
after `exec` could, and a requeue from a line after a plain `crew run` would come too late, since the batch
shell dies of the USR1 it cannot pass on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable, Mapping

from crew.errors import PREEMPTED_EXIT_CODE, STOPPED_EXIT_CODE

NOTICE_SIGNALS = ("SIGTERM", "SIGUSR1")
SCONTROL_TIMEOUT_S = 30.0


def notice_line(name: str, grace: float) -> str:
    return (f"{name} received: stopping every rank on every node; ranks whose config has crew's \"preemption\": "
            "{\"enabled\": true} first finish their optimizer step and save a checkpoint (a preemption notice). "
            f"Ranks still running in {grace:g}s (--preempt_grace) are killed; {name} again kills now.")


def exit_code(codes: Mapping[int, int | None]) -> int:
    """75 once any rank exited 75: every rank got past the save's last collective, after its commit. Else a
    stopped job's 143: nothing was saved."""
    return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes.values() else STOPPED_EXIT_CODE


def closing_line(codes: Mapping[int, int | None], checkpoint: str | None, grace: float) -> str:
    """`crew run`'s last word on a preemption, from the ranks' raw exit codes (negative: killed by a signal)."""
    if exit_code(codes) == PREEMPTED_EXIT_CODE:
        saved = f"a checkpoint was saved in {checkpoint}" if checkpoint else "the ranks saved and exited with 75"
        return f"preempted: {saved}; the same command resumes (exit code 75)."
    values = set(codes.values())
    if not values:
        why = "the job was stopped before its ranks started"
    elif -signal.SIGKILL in values:
        why = (f"the ranks did not finish their step and save within {grace:g}s and were killed; give them "
               "longer with --preempt_grace SECONDS")
    elif -signal.SIGTERM in values:
        why = ("the ranks stopped at once on SIGTERM: their config does not enable crew's preemption "
               "(\"preemption\": {\"enabled\": true})")
    else:
        why = "the ranks could not save one (their output above says why)"
    return f"preempted: no checkpoint was saved: {why}. Everything since the script's last save is lost."


def requeue_slurm_job(say: Callable[[str], None], environ: Mapping[str, str] = os.environ) -> None:
    """In an sbatch job that may be requeued (--requeue): `scontrol requeue` it. Slurm ends this job at
    once, so this is crew's last act; a refusal is said, not hidden."""
    job = environ.get("SLURM_JOB_ID")
    if not job or environ.get("ENVIRONMENT") != "BATCH":
        return
    shown = _scontrol(["show", "job", "--oneliner", job])
    if isinstance(shown, str):
        say(f"cannot requeue Slurm job {job}: {shown}. Resubmit the batch script to continue.")
        return
    if re.search(r"\bRequeue=0\b", shown.stdout):
        say(f"Slurm job {job} may not be requeued (Requeue=0): resubmit the batch script to continue, or add "
            "`#SBATCH --requeue` so that crew requeues it after a preemption.")
        return
    say(f"requeueing Slurm job {job} (scontrol requeue {job}): it starts again, and the same command resumes.")
    done = _scontrol(["requeue", job])
    if isinstance(done, str):
        say(f"scontrol requeue {job} failed: {done}. Resubmit the batch script to continue.")


def _scontrol(args: list[str]) -> subprocess.CompletedProcess | str:
    """scontrol's answer, or why there is none (its own words when it refused)."""
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
    return done
