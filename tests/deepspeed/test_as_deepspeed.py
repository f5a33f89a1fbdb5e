"""`crew run --as_deepspeed`: a script's unchanged `import deepspeed` is crew on every rank; what crew does
not provide is refused by name; without the flag nothing is shadowed."""

from __future__ import annotations

import json

from conftest import crew, write_script
from shimrun import run_as_deepspeed

from crew import __version__ as crew_version
from crew.deepspeed.alias import ALIASES

SCRIPT = """
    import argparse, importlib.metadata, importlib.util, json, os
    import torch
    found = importlib.util.find_spec("deepspeed") is not None  # as Accelerate and transformers look, before importing
    dist_version = importlib.metadata.version("deepspeed")
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                   model_parameters=model.parameters(), config=config)
    inputs = torch.randn(4, 4)
    losses = []
    for _ in range(5):
        loss = (engine(inputs) - inputs.sum(dim=1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    try:
        from deepspeed.pipe import PipelineModule
        refused = None
    except ImportError as error:
        refused = str(error)
    accelerator = get_accelerator()
    result = {"module": deepspeed.__name__, "version": deepspeed.__version__, "rank": dist.get_rank(),
              "world": dist.get_world_size(), "local_rank": args.local_rank, "losses": losses,
              "device": accelerator.device_name(engine.local_rank),
              "backend": accelerator.communication_backend_name(),
              "refused": refused, "found": found, "dist_version": dist_version,
              "spec": importlib.util.find_spec("deepspeed").name}
    with open(f"result{dist.get_rank()}.json", "w") as out:
        json.dump(result, out)
"""


def test_import_deepspeed_is_crew_on_every_rank(job_dir):
    write_script(job_dir, "train.py", SCRIPT)
    run = crew("run", "--num_gpus", "2", "--as_deepspeed", "train.py", "--deepspeed", cwd=job_dir)
    assert run.code == 0, run.err
    assert "--as_deepspeed: `import deepspeed` is crew on every rank" in run.err
    results = [json.loads((job_dir / f"result{rank}.json").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert (result["module"], result["rank"], result["world"], result["local_rank"]) == \
            ("crew.deepspeed", rank, 2, rank)
        # DeepSpeed's API version (HF's gates: deepspeed>=0.9.3, ...) with crew's own as the local label
        assert result["version"] == result["dist_version"] == f"0.19.8+crew.{crew_version}"
        assert result["found"] and result["spec"] == "crew.deepspeed"
        assert (result["device"], result["backend"]) == ("cpu", "gloo")
        assert result["losses"][-1] < result["losses"][0]  # it trains
        assert result["refused"].startswith("deepspeed.pipe (pipeline parallelism")
    assert results[0]["losses"] == results[1]["losses"]  # the same data on both ranks: one update


def test_without_the_flag_deepspeed_is_not_shadowed(job_dir):
    write_script(job_dir, "train.py", """
        import importlib.metadata, importlib.util, os
        assert importlib.util.find_spec("deepspeed") is None and "CREW_DEEPSPEED_ON_CPU" not in os.environ
        try:
            importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            raise AssertionError("a deepspeed distribution record is visible without --as_deepspeed")
        import deepspeed
    """)
    run = crew("run", "--num_gpus", "1", "train.py", cwd=job_dir)
    assert run.code == 1
    assert "No module named 'deepspeed'" in run.err  # this venv has no DeepSpeed: Python's own error
    assert "--as_deepspeed" not in run.err


ALIAS_CHECKS = """
    import sys
    sys.path.insert(0, sys.argv[1])
    import deepspeed, deepspeed.comm, deepspeed.zero, crew
    from deepspeed.accelerator import get_accelerator
    assert deepspeed.comm is crew.comm and deepspeed.zero is crew.zero and deepspeed.initialize is crew.initialize
    assert sys.modules["deepspeed.accelerator"] is sys.modules["crew.deepspeed.accelerator"]
    assert not hasattr(deepspeed, "init_inference")
    for attempt in ("deepspeed.init_inference", "__import__('deepspeed.moe.layer')",
                    "__import__('deepspeed.profiling.flops_profiler')", "__import__('deepspeed.no_such_thing')"):
        try:
            eval(attempt)
        except crew.errors.CrewError as error:
            print(type(error).__name__, error)
    accelerator = get_accelerator()
    print(accelerator.device_name(), accelerator.device_name(1), accelerator.current_device(),
          accelerator.is_available(), accelerator.is_bf16_supported(),
          accelerator.on_accelerator(crew.runtime.comm.torch.zeros(1)))
"""


def test_names_crew_does_not_provide_are_refused_by_feature(tmp_path):
    lines = run_as_deepspeed(ALIAS_CHECKS, tmp_path)
    assert lines[0].startswith("UnsupportedAttribute deepspeed.init_inference (DeepSpeed inference) is not "
                               "supported by crew: crew runs data-parallel training with ZeRO stages 0-3")
    assert lines[1].startswith("UnsupportedModule deepspeed.moe") and "(mixture of experts) is not" in lines[1]
    assert lines[2].startswith("UnsupportedModule deepspeed.profiling (the flops profiler) is not")
    assert lines[3].startswith("UnsupportedModule deepspeed.no_such_thing is not supported by crew")
    assert lines[4] == "cpu cpu 0 True True True"
    # deepspeed.runtime.zero.config: a module under the aliased deepspeed.runtime.zero, for ZeroStageEnum in checkpoints
    assert set(ALIASES) == {"deepspeed", "deepspeed.comm", "deepspeed.zero", "deepspeed.runtime.zero",
                            "deepspeed.runtime.zero.config"}


def test_over_ssh_by_environment_variable_and_for_a_module(cluster, job_dir):
    write_script(job_dir, "probe_ds.py", """
        import os
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        with open(f"seen{os.environ['RANK']}", "w") as out:
            out.write(f"{deepspeed.__name__} {get_accelerator().device_name()}")
    """)
    run = crew("run", "--ssh_args", cluster.ssh_args, "-H", str(cluster.hostfile(slots=1)), "--module",
               "probe_ds", cwd=job_dir, env={"CREW_AS_DEEPSPEED": "1"})
    assert run.code == 0, run.err
    assert [(job_dir / f"seen{rank}").read_text() for rank in range(2)] == ["crew.deepspeed cpu"] * 2
