"""Makes stage3_fp32_dp2/: DeepSpeed 0.19.8's own checkpoint of AutoTP 2 with ZeRO stage 3 on 4 ranks (TP 2 x DP 2),
for tests/runtime/checkpoint/test_tensor_parallel_checkpoint.py to load into crew. Not a test.

    cd /work/main/tests/runtime/checkpoint/tensor_parallel_data
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /opt/dsvenv/bin/python make_zero3_fixture.py

The model, config, batches and expected.pt are make_fixtures.py's (its save()), at stage 3: each rank writes its
zero_pp_rank_<data-parallel rank>_mp_rank_<TP rank>_{model,optim}_states.pt.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASE, SPEC = "stage3_fp32_dp2", (3, "fp32", 4)  # (ZeRO stage, precision, ranks), as make_fixtures.CASES


def fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", HERE / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.CASES[CASE] = SPEC
    return module


if __name__ == "__main__":
    if sys.argv[1:] == ["save"]:
        fixtures().save(CASE)
    else:
        torchrun = Path(sys.executable).parent / "torchrun"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(SPEC[2]), __file__, "save"], env=env,
                       check=True)
