"""Start a script under real DeepSpeed on a CPU-only machine with Accelerate's state over the launched ranks.

Without a GPU, Accelerate's PartialState picks no backend and says world size 1, so Trainer (and TRL) would fill
DeepSpeed's batch size for one rank and DeepSpeed would stop at its batch assertion. crew gives Accelerate gloo
under `crew run --as_deepspeed` (crew/launcher/node/site/sitecustomize.py); this does the same for DeepSpeed's
runs, so that both sides train the same 2-rank world. Usage: python _trl_ds_entry.py SCRIPT [ARGS...]
"""

import os
import runpy
import sys

from accelerate import state

_original = state.PartialState._prepare_backend


def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    chosen, kind = _original(self, cpu, sagemaker_dp, backend)
    if chosen is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
        return "gloo", state.DistributedType.MULTI_CPU
    return chosen, kind


state.PartialState._prepare_backend = _prepare_backend
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
