"""Which census names real DeepSpeed has: run with DeepSpeed's own python, never crew's (it imports no crew).

    DS_ACCELERATOR=cpu /opt/dsvenv/bin/python -m torch.distributed.run --nproc_per_node 1 \
        tools/deepspeed_reference.py docs/deepspeed_names.json OUT.json

tools/deepspeed_census.py --deepspeed-python runs it so. Module and name entries are imported as the
libraries import them; attribute entries are looked up on real DeepSpeed engines at ZeRO 0-3 (tiny model,
fp32, one CPU rank), at the stages the census says DeepSpeed has them. Writes {name: true/false}.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deepspeed_crew_check import ATTRIBUTES, _owner  # noqa: E402  (that module imports crew only in functions)


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:index + 1]))
            except ImportError:
                return False
    return True


def engine(stage: int):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    built, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    built.backward(built(torch.ones(2, 4)).sum())
    built.step()
    return built


def has_attribute(engines: dict, name: str) -> bool:
    spec = ATTRIBUTES[name[1:]]
    try:
        return all(hasattr(_owner(engines[stage], spec["owner"]), name[1:]) for stage in spec["stages"])
    except (AttributeError, StopIteration):
        return False


def main(census_path: str, out_path: str) -> None:
    names = json.loads(pathlib.Path(census_path).read_text())["names"]
    found = {e["name"]: resolves(e["name"]) for e in names if e["kind"] != "attribute"}
    engines = {stage: engine(stage) for stage in range(4)}
    found.update({e["name"]: has_attribute(engines, e["name"]) for e in names if e["kind"] == "attribute"})
    pathlib.Path(out_path).write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
