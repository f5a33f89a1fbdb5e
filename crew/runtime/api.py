"""`crew.initialize` and `crew.add_config_arguments`: DeepSpeed's entry points, same signatures."""

from __future__ import annotations

import argparse

from crew.errors import ConfigError, CrewError, install_excepthook
from crew.log import log_rank0
from crew.runtime import comm, parallel
from crew.runtime.balance import Balancer
from crew.runtime.config import Config, ignored_keys, load_config
from crew.runtime.data import DataLoader
from crew.runtime.engine import Engine
from crew.runtime.tensor_parallel import config as tp_config
from crew.runtime.tensor_parallel import setup as tp_setup

install_excepthook()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize."""
    if model is None:
        raise CrewError("initialize() needs model=<your torch.nn.Module>.")
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    _join_layout(mpu, mesh_param)
    resolved = load_config(config, world_size=comm.get_world_size(), args=args, config_params=config_params,
                           sequence_parallel=parallel.sequence_parallel_size())
    _say_what_sequence_parallel_size_does(resolved)
    merged = tp_setup.merged_config(resolved.raw)  # what deepspeed.tp_model_init recorded, whatever the config's source
    if merged is not resolved.raw:
        resolved = Config.from_dict(merged, resolved.world_size, resolved.source)
    engine = Engine(model, resolved, optimizer, model_parameters, lr_scheduler)
    given = config if config is not None else config_params
    # DeepSpeed's engine.config: the caller's dict itself, or the file's as loaded
    engine.config = given if isinstance(given, dict) else resolved.raw
    loader = None
    if training_data is not None:
        on_gpu = engine.device.type == "cuda"  # DeepSpeed's loader: pinned, 2 workers per GPU
        micro = engine.balancer.sizes if engine.balancer else resolved.train_micro_batch_size_per_gpu
        # under AutoTP the ranks of a TP group read the same samples: the loader shards over data parallelism
        ranks = engine.dp_world_size if engine.mp_world_size > 1 else engine.world_size
        loader = DataLoader(training_data, micro, ranks, engine.global_rank // engine.mp_world_size,
                            collate_fn=collate_fn, drop_last=resolved.dataloader_drop_last,
                            num_workers=2 if on_gpu else 0, pin_memory=on_gpu,
                            reshuffle=resolved.dataloader_reshuffle_each_epoch)
    engine.training_dataloader = loader
    if engine.balancer is not None:
        _attach_loader(engine.balancer, loader, resolved.source)
    engine.log_batch_math(len(loader) if loader is not None else None)
    no_effect = ignored_keys(resolved) + engine.zero.no_effect_keys() + tp_config.no_effect_keys(
        resolved.raw.get("tensor_parallel"))
    if "communication_data_type" in resolved.raw and not engine.zero.shards_params:
        no_effect.append("communication_data_type")  # stages 0-2 reduce in the model's dtype
    if no_effect:
        log_rank0("config keys accepted, but with no effect in crew: %s", ", ".join(no_effect))
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _join_layout(mpu, mesh_param) -> None:
    """initialize(mpu=...) as Hugging Face passes it for Ulysses SP (the module register_with_transformers
    returned), or mesh_param=(data parallel, sequence parallel) as DeepSpeed's initialize takes it."""
    if mesh_param is not None:
        data, sequence = _mesh_sizes(mesh_param)
        parallel.init_sequence_parallel(sequence, where=f"initialize(mesh_param={tuple(mesh_param)})")
        if data * sequence != comm.get_world_size():
            raise ConfigError(f"initialize(mesh_param={tuple(mesh_param)}): {data} x {sequence} ranks, but the job "
                              f"has {comm.get_world_size()}; pass (world size / sequence parallel size, "
                              "sequence parallel size).")
    if mpu is None:
        return
    size = getattr(mpu, "get_sequence_parallel_world_size", None)
    if size is None:
        raise CrewError(f"initialize(mpu={type(mpu).__name__}): a Megatron-style model-parallel unit is not "
                        "supported by crew; crew takes the one UlyssesSPAttentionHF.register_with_transformers "
                        "returns (Ulysses sequence parallelism). For tensor parallelism use the config's "
                        "tensor_parallel.autotp_size.")
    parallel.init_sequence_parallel(size(), where="initialize(mpu=...)")


def _say_what_sequence_parallel_size_does(resolved) -> None:
    """The config key alone only changes the batch math, in DeepSpeed as here: say so, or it looks like SP is on."""
    declared = resolved.raw.get("sequence_parallel_size")
    if isinstance(declared, int) and declared > 1 and parallel.sequence_parallel_size() == 1:
        log_rank0("%s: sequence_parallel_size %d counts world / %d data-parallel ranks in the batch math, as in "
                  "DeepSpeed; sequence parallelism itself is on only after UlyssesSPAttentionHF."
                  "register_with_transformers(..., sequence_parallel_size=%d) and initialize(mpu=its result)",
                  resolved.source, declared, declared, declared)


def _mesh_sizes(mesh_param) -> tuple[int, int]:
    try:
        data, sequence = (int(size) for size in mesh_param)
    except (TypeError, ValueError):
        raise ConfigError(f"initialize(mesh_param={mesh_param!r}): expected (data parallel size, sequence "
                          "parallel size), two whole numbers.") from None
    return data, sequence


def _attach_loader(balancer: Balancer, loader: DataLoader | None, source: str) -> None:
    if loader is not None:
        balancer.loader = loader
    elif balancer.auto:
        raise ConfigError(
            f"{source}: train_micro_batch_size_per_rank \"auto\" changes each rank's micro batch while "
            "training, which needs crew's loader: pass initialize(training_data=your_dataset) and iterate "
            "the loader it returns, or set the sizes by hand (a list, one per rank).")
    else:
        log_rank0("micro batch per rank %s: without training_data, make rank r's own loader give "
                  "engine.train_micro_batch_size_per_gpu() samples per micro step", balancer.sizes)


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
