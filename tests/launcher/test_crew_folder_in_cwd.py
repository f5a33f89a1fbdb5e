"""A folder named `crew/` where the job starts (a user's project or outputs) must not stand in for crew: with
crew installed editable, `python -m crew...` and a script's `import crew` would otherwise import that folder as
an empty namespace package (`Path(crew.__file__)`: TypeError in the agent, before any rank started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RUN_TIMEOUT_S, write_script

import crew as installed

SCRIPT = """
    import os
    import crew
    print("rank", os.environ["RANK"], "crew from", crew.__file__)
"""


@pytest.mark.parametrize("contents", ["empty", "files", "own package"])
def test_a_crew_folder_in_the_working_directory_is_not_imported(tmp_path, contents):
    (tmp_path / "crew").mkdir()
    if contents == "own package":  # a real package of the user's: Python's choice, as without crew
        (tmp_path / "crew" / "__init__.py").write_text("")
    if contents == "files":
        (tmp_path / "crew" / "run1").mkdir()
        (tmp_path / "crew" / "run1" / "loss.csv").write_text("step,loss\n1,2.0\n")
        (tmp_path / "crew" / "notes.txt").write_text("outputs\n")
    write_script(tmp_path, "train.py", SCRIPT)
    # the `crew` command, as users type it (`python -m crew` would import the folder before crew runs)
    command = [str(Path(sys.executable).parent / "crew"), "run", "--num_gpus", "2", "--as_deepspeed", "train.py"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    expected = tmp_path / "crew" / "__init__.py" if contents == "own package" else installed.__file__
    for rank in (0, 1):
        assert f"rank {rank} crew from {expected}" in run.stdout
