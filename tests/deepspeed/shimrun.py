"""Shared by the DeepSpeed-name tests: a script run in a fresh Python whose `import deepspeed` is crew."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from crew.launcher.node.agent import DEEPSPEED_SHIM


def run_as_deepspeed(script: str, cwd: Path) -> list[str]:
    """Run `script` (dedented) with crew's shim as argv[1]; its stdout lines (it must exit 0)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), DEEPSPEED_SHIM], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()
