"""What running DeepSpeed's own unit tests against crew (tools/deepspeed_unit_tests.py) showed missing, in
crew's words: the op builders scripts ask for availability, the build record (deepspeed.git_version_info,
deepspeed.__version_major__...), DeepSpeed's config and schedule constants, the CPU accelerator's device
count from LOCAL_SIZE, OneCycle's per-param-group lists, MoE param groups of a model without experts,
deepspeed.comm.inference_all_reduce and deepspeed.utils.torch's version check.

One process with crew's shim first on sys.path checks them all, as a script run under --as_deepspeed sees them.
"""

from __future__ import annotations

import json

import pytest
import torch
from shimrun import run_as_deepspeed

SCRIPT = """
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
    from deepspeed.git_version_info import installed_ops, torch_info
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split_moe
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder
    from deepspeed.runtime.config import ADAM_OPTIMIZER, DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import (CYCLE_FIRST_STEP_SIZE, CYCLE_MAX_LR, CYCLE_MAX_MOM, CYCLE_MIN_LR,
                                                CYCLE_MIN_MOM, WARMUP_MAX_LR, OneCycle)
    from deepspeed.utils.torch import register_grad_hook, required_torch_version

    out = {"compatible": [deepspeed.ops.__compatible_ops__[b.NAME] for b in (FusedAdamBuilder, CPUAdamBuilder,
                                                                               FusedLambBuilder)],
           "builders": [b().is_compatible() for b in (FusedAdamBuilder, FusedLambBuilder)],
           "version": [deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__],
           "git": [deepspeed.__git_hash__, deepspeed.__git_branch__], "torch_info": torch_info,
           "installed": any(installed_ops.values()), "supported": is_current_accelerator_supported(),
           "names": [ADAM_OPTIMIZER, ADAM_OPTIMIZER in DEEPSPEED_OPTIMIZERS, CYCLE_MIN_LR, WARMUP_MAX_LR]}
    group = {"params": [torch.nn.Parameter(torch.zeros(1))], "name": "parameters"}
    out["moe_groups"] = [split_moe(group) == [group], split_moe((group,)) == [group]]
    major = int(torch.__version__.split(".")[0])
    bounds = [{"min_version": major}, {"min_version": major + 1}, {"max_version": major - 1},
              {"max_version": major + 1}]
    out["torch_version"] = [required_torch_version(**bound) for bound in bounds]
    seen = []
    register_grad_hook(group["params"][0], lambda p: seen.append(p.grad.item()))
    (group["params"][0] * 3).sum().backward()
    ones = torch.ones(2)
    deepspeed.comm.inference_all_reduce(ones)  # no process group: a world of one
    out["hooks"] = [seen, ones.tolist()]
    try:
        FusedAdamBuilder().load()
    except deepspeed.CrewError as error:
        out["load"] = str(error)
    os.environ.update(LOCAL_SIZE="3", LOCAL_WORLD_SIZE="2")  # DeepSpeed's launcher variable wins
    out["count"] = [get_accelerator().device_count()]
    del os.environ["LOCAL_SIZE"]
    out["count"].append(get_accelerator().device_count())

    def optimizer(groups):
        return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=1.0)

    def trace(scheduler, steps=12):
        rows = []
        for step in range(steps):
            scheduler.step(step)
            rows.append([[g["lr"], g["betas"][0]] for g in scheduler.optimizer.param_groups])
        return rows

    lists = {CYCLE_MIN_LR: [0.001, 0.002], CYCLE_MAX_LR: [0.01, 0.03], CYCLE_MIN_MOM: [0.8, 0.85],
             CYCLE_MAX_MOM: [0.9, 0.95], CYCLE_FIRST_STEP_SIZE: 4}
    out["lists"] = trace(OneCycle(optimizer(2), **lists))
    out["alone"] = [trace(OneCycle(optimizer(1), **{k: v[i] if isinstance(v, list) else v for k, v in lists.items()}))
                    for i in range(2)]
    print(json.dumps(out))
"""


def test_names_deepspeed_unit_tests_reach(tmp_path):
    out = json.loads(run_as_deepspeed(SCRIPT, tmp_path)[-1])
    # crew's FusedAdam and DeepSpeedCPUAdam are torch's; FusedLamb it has not
    assert out["compatible"] == [True, True, False] and out["builders"] == [True, False]
    assert "compiles no kernels" in out["load"] and "deepspeed.ops" in out["load"]
    assert out["version"] == [0, 19, 8] and out["git"] == ["[none]", "[none]"]
    assert out["torch_info"]["version"] == ".".join(torch.__version__.split(".")[:2])
    assert set(out["torch_info"]) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    assert not out["installed"] and out["supported"]
    assert out["names"] == ["adam", True, "cycle_min_lr", "warmup_max_lr"]
    assert out["count"] == [3, 2]
    assert out["moe_groups"] == [True, True]  # a model without experts: DeepSpeed's MoE recipe passes it through
    assert out["torch_version"] == [True, False, False, True]
    assert out["hooks"] == [[3.0], [1.0, 1.0]]
    # per-group lists: each group follows the schedule it would follow alone with its own numbers
    for group in range(2):
        assert [step[group] for step in out["lists"]] == [step[0] for step in out["alone"][group]]
    peak = out["lists"][3]  # cycle_first_step_size=4: the top of the cycle
    assert peak == [[pytest.approx(0.01), 0.8], [pytest.approx(0.03), 0.85]]
