"""`crew.initialize` and `crew.add_config_arguments`: DeepSpeed's entry points, same signatures."""

from __future__ import annotations

import argparse

from crew import comm
from crew.config import ignored_keys, load_config
from crew.data import DataLoader
from crew.engine import Engine
from crew.errors import CrewError, install_excepthook
from crew.log import log_rank0

install_excepthook()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize."""
    if model is None:
        raise CrewError("initialize() needs model=<your torch.nn.Module>.")
    if mpu is not None or mesh_param is not None:
        raise CrewError("initialize(mpu=..., mesh_param=...): model/pipeline parallelism is not "
                        "supported by crew yet; crew runs data parallel (with ZeRO).")
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    resolved = load_config(config, world_size=comm.get_world_size(), args=args,
                           config_params=config_params)
    engine = Engine(model, resolved, optimizer, model_parameters, lr_scheduler)
    loader = None
    if training_data is not None:
        on_gpu = engine.device.type == "cuda"  # DeepSpeed's loader: pinned, 2 workers per GPU
        loader = DataLoader(training_data, resolved.train_micro_batch_size_per_gpu,
                            engine.world_size, engine.global_rank, collate_fn=collate_fn,
                            drop_last=resolved.dataloader_drop_last,
                            num_workers=2 if on_gpu else 0, pin_memory=on_gpu)
    engine.training_dataloader = loader
    engine.log_batch_math(len(loader) if loader is not None else None)
    no_effect = ignored_keys(resolved) + engine.zero.no_effect_keys()
    if no_effect:
        log_rank0("config keys accepted, but with no effect in crew: %s", ", ".join(no_effect))
    return engine, engine.optimizer, loader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--deepspeed and --deepspeed_config (plus DeepSpeed's deprecated --deepscale spellings)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by crew)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (crew) for this script")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
