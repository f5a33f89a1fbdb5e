"""`--config_file accelerate_config.yaml`: Accelerate's launch config, read as crew's launch options.

`accelerate launch --config_file` turns the YAML `accelerate config` writes into a world (machines,
processes, main process, DeepSpeed's hostfile and multinode launcher) and a set of `ACCELERATE_*`
variables that `accelerate.Accelerator` reads in every rank (accelerate/utils/launch.py,
`prepare_multi_gpu_env`, `prepare_deepspeed_cmd_env`). crew does the same with its own launcher: the
world becomes launch options (`--num_nodes`, `--num_gpus`, `--hostfile`, `--launcher`, ...) and the
variables travel to every rank as `--env` would, before the user's own `--env`. A launch option the user
gave (on the command line or as CREW_<NAME>) wins over the YAML. Free of torch and of accelerate: the
launcher plans without either.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.util
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from crew.errors import CrewError
from crew.launcher.plan.hostfile import Host
from crew.launcher.plan.launch import LOCAL_HOST

ACCELERATE_PORT = 29500  # accelerate launch's main_process_port when none is given
PRECISIONS = ("no", "fp16", "bf16", "fp8")
# deepspeed_multinode_launcher -> crew's runner. "standard" and "nossh" start each machine by hand
# (torchrun on each, DeepSpeed's --no_ssh): crew's standalone. The MPI ones are crew's MPI runners.
LAUNCHERS = {"pdsh": "pdsh", "ssh": "ssh", "standard": "standalone", "nossh": "standalone",
             "slurm": "slurm", "openmpi": "openmpi", "mvapich": "mvapich", "mpich": "mpich"}
HOSTFILE_LAUNCHERS = ("pdsh", "ssh", "openmpi", "mvapich", "mpich")  # they start the machines of a hostfile
MULTI_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
               "MULTI_HPU", "MULTI_NEURON")
REFUSED_TYPES = ("FSDP", "MEGATRON_LM", "XLA")
# deepspeed_config keys -> the variable prepare_deepspeed_cmd_env sets from them (DeepSpeedPlugin reads them)
DEEPSPEED_ENV = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}
DEEPSPEED_LAUNCH = ("deepspeed_hostfile", "deepspeed_multinode_launcher", "deepspeed_inclusion_filter",
                    "deepspeed_exclusion_filter")
HONOURED = ("compute_environment", "distributed_type", "num_machines", "num_processes", "machine_rank",
            "main_process_ip", "main_process_port", "use_cpu", "mixed_precision", "fp16", "debug",
            "enable_cpu_affinity", "gradient_accumulation_steps", "deepspeed_config", "gpu_ids",
            "parallelism_config")
# Accelerate's other keys (ClusterConfig): said in one line when set to anything that would change what
# `accelerate launch` does; same_network and main_training_function never do under crew.
NO_USE = ("rdzv_backend", "dynamo_config", "dynamo_backend", "fp8_config", "fsdp_config",
          "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
          "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env")
SILENT = ("same_network", "main_training_function")
# parallelism_config's keys (each `parallelism_config_<name>`, as `accelerate config` writes them) and the
# defaults of accelerate launch's --parallelism_config_<name> flags, which fill the keys left out
PARALLELISM_PREFIX = "parallelism_config_"
PARALLELISM_DEFAULTS = {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 1,
                        "cp_backend": "torch", "cp_comm_strategy": "allgather", "sp_size": 1,
                        "sp_backend": "deepspeed", "sp_seq_length": None, "sp_seq_length_is_variable": True,
                        "sp_attn_implementation": "sdpa"}
PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
# accelerate launch passes parallelism_config through its DeepSpeed and multi-GPU launchers only: NO and
# MULTI_CPU start through its simple launcher, which leaves it out
PARALLELISM_TYPES = ("DEEPSPEED",) + tuple(kind for kind in MULTI_TYPES if kind != "MULTI_CPU")
SP_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")  # or a hub kernel such as org/flash-attn2
_NO_OP = (None, False, "", "no", "NO", "static", "all", "main")
_OPTION_FLAGS = {"hostfile": "--hostfile", "num_nodes": "--num_nodes", "num_gpus": "--num_gpus",
                 "include": "--include", "exclude": "--exclude", "launcher": "--launcher",
                 "node_rank": "--node_rank", "master_addr": "--master_addr", "master_port": "--master_port",
                 "no_local_rank": "--no_local_rank"}


@dataclass
class AccelerateConfig:
    """What the YAML says, in crew's terms, before the command line's own options are applied."""

    path: str
    options: dict[str, object] = field(default_factory=dict)  # launch option dest -> value
    env: dict[str, str] = field(default_factory=dict)  # for every rank
    num_machines: int = 1
    per_machine: int | None = None  # num_processes // num_machines
    machine_rank: int = 0
    deepspeed: bool = False  # the ranks train with DeepSpeed (DEEPSPEED, and not use_cpu unless as_deepspeed)
    as_deepspeed: bool = False  # crew run --as_deepspeed: crew's engine is the ranks' DeepSpeed
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_config(path: str) -> dict:
    """The YAML's top-level mapping; an unreadable file, bad YAML or a non-mapping is a CrewError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CrewError(f"--config_file {path}: no such file. Give the path of the YAML `accelerate config` "
                        "wrote (by default ~/.cache/huggingface/accelerate/default_config.yaml).") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CrewError(f"--config_file {path} cannot be read: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CrewError(f"{path} is not valid YAML: {problem} ({_yaml_where(exc)}). Fix that line, or write "
                        "the file anew with `accelerate config`.") from None
    if not isinstance(data, dict):
        raise CrewError(f"{path}: expected Accelerate's launch config, a mapping of keys such as "
                        f"'num_processes: 2', got {'an empty file' if data is None else type(data).__name__}.")
    return data


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f"line {mark.line + 1}" if mark else "somewhere in the file"


def parse_config(path: str, data: dict, as_deepspeed: bool = False) -> AccelerateConfig:
    """The YAML mapping -> crew's options, env and the keys it cannot honour. `as_deepspeed`: the ranks'
    `import deepspeed` is crew's engine, which trains on the CPU too, so `use_cpu` does not drop DeepSpeed."""
    key = _Keys(path, data)
    key.check_known()
    config = AccelerateConfig(path, as_deepspeed=as_deepspeed)
    kind = key.distributed_type()
    key.data = {**data, "distributed_type": kind}
    ds = key.deepspeed_block()
    use_cpu = key.flag("use_cpu")
    crew_deepspeed = as_deepspeed and kind == "DEEPSPEED"
    _world(key, ds, config)
    _precision_env(key, config.env)
    if use_cpu and crew_deepspeed:
        config.notes.append("use_cpu: true: under --as_deepspeed Accelerate trains with DeepSpeed on crew's engine "
                            "(on the CPU where a machine has no GPU); ACCELERATE_USE_CPU is not set, as with it "
                            "Accelerate would drop the DeepSpeed config")
    elif use_cpu:
        config.env["ACCELERATE_USE_CPU"] = "true"
    if key.flag("debug"):
        config.env["ACCELERATE_DEBUG_MODE"] = "true"
    if key.flag("enable_cpu_affinity"):
        config.env["ACCELERATE_CPU_AFFINITY"] = "1"
    steps = ds.get("gradient_accumulation_steps", data.get("gradient_accumulation_steps"))
    if steps is not None:
        config.env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(key.number(
            "gradient_accumulation_steps", steps, minimum=1))
    _deepspeed_env(key, ds, kind == "DEEPSPEED" and (crew_deepspeed or not use_cpu), config)
    _parallelism_env(key, config)
    config.ignored += [k for k in NO_USE if k in data and not _no_op(data[k])]
    known = (*DEEPSPEED_ENV, *DEEPSPEED_LAUNCH, "gradient_accumulation_steps")
    config.ignored += [f"deepspeed_config.{k}" for k in ds if k not in known]
    return config


class _Keys:
    """Typed reads of the YAML's keys; every error names the file, the key, the value and the fix."""

    def __init__(self, path: str, data: dict):
        self.path, self.data = path, data

    def fail(self, key: str, problem: str, fix: str) -> CrewError:
        return CrewError(f"{self.path}: {key}: {problem}. {fix}")

    def check_known(self) -> None:
        known = HONOURED + NO_USE + SILENT
        for key in self.data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"Did you mean '{close[0]}'?" if close else "Remove it (Accelerate refuses it too)."
                raise self.fail(str(key), "not a key of Accelerate's launch config", hint)
        if self.data.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
            raise self.fail("compute_environment", f"{self.data['compute_environment']!r}: crew starts the job "
                            "on your own machines", "Set it to LOCAL_MACHINE (or remove it).")

    def distributed_type(self) -> str:
        kind = self.data.get("distributed_type")
        kind = "NO" if kind is False else kind  # an unquoted NO is YAML's false
        if kind is None:
            raise self.fail("distributed_type", "missing (Accelerate requires it too)",
                            "Add e.g. 'distributed_type: MULTI_GPU' (MULTI_CPU on machines without GPUs).")
        if kind in REFUSED_TYPES:
            raise self.fail("distributed_type", f"{kind}: crew does not set up Accelerate's {kind} plugin",
                            "Use MULTI_GPU (data parallel) or DEEPSPEED, or run it with `accelerate launch`.")
        if kind not in ("NO", "DEEPSPEED") + MULTI_TYPES:
            close = difflib.get_close_matches(str(kind), ("NO", "DEEPSPEED") + MULTI_TYPES, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise self.fail("distributed_type", f"unknown value {kind!r}",
                            f"Use one of NO, MULTI_CPU, MULTI_GPU, DEEPSPEED.{hint}")
        return kind

    def deepspeed_block(self) -> dict:
        block = self.data.get("deepspeed_config") or {}
        if not isinstance(block, dict):
            raise self.fail("deepspeed_config", f"expected a mapping of keys, got {block!r}",
                            "Indent its keys under it (deepspeed_config_file: ..., deepspeed_hostfile: ...).")
        return block

    def flag(self, key: str, value: object = None, where: str | None = None) -> bool:
        value = self.data.get(key) if where is None else value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        if value is not None and not isinstance(value, bool):
            raise self.fail(where or key, f"expected true or false, got {value!r}", "Write true or false.")
        return bool(value)

    def number(self, key: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
                maximum is not None and value > maximum):
            top = f" and at most {maximum}" if maximum is not None else ""
            raise self.fail(key, f"expected a whole number of at least {minimum}{top}, got {value!r}",
                            "Fix the value.")
        return value

    def text(self, key: str, value: object) -> str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise self.fail(key, f"expected text, got {value!r}", "Quote the value.")
        return str(value)


def _world(key: _Keys, ds: dict, config: AccelerateConfig) -> None:
    """Machines, processes, the main process and DeepSpeed's launch keys -> crew's launch options."""
    data = key.data
    machines = config.num_machines = key.number("num_machines", data.get("num_machines", 1), minimum=1)
    total = data.get("num_processes", 1 if data.get("distributed_type") == "NO" else None)
    if total not in (None, -1):  # -1: `accelerate config` left it to the command line
        total = key.number("num_processes", total, minimum=1)
        if total % machines:
            raise key.fail("num_processes", f"{total} processes do not divide over num_machines {machines} "
                           "(Accelerate runs num_processes // num_machines on each)",
                           f"Use a multiple of {machines}, e.g. {machines * max(1, total // machines)}.")
        config.per_machine = total // machines
    config.machine_rank = key.number("machine_rank", data.get("machine_rank", 0), maximum=machines - 1)
    ip = key.text("main_process_ip", data["main_process_ip"]) if data.get("main_process_ip") else None
    config.options.update(master_addr=ip, master_port=_main_port(key, data.get("main_process_port")),
                          no_local_rank=True, hostfile=None, include="", exclude="", launcher=None)
    launch = {k: key.text(f"deepspeed_config.{k}", ds[k]) for k in DEEPSPEED_LAUNCH if ds.get(k)}
    gpu_ids = _gpu_ids(key, data.get("gpu_ids"))
    if machines == 1:  # as `accelerate launch`: one machine runs here, whatever the hostfile says
        config.ignored += [f"deepspeed_config.{k} (num_machines is 1)" for k in launch]
        if gpu_ids:  # Accelerate's CUDA_VISIBLE_DEVICES: these devices of this machine
            if config.per_machine not in (None, len(gpu_ids.split(","))):
                raise key.fail("gpu_ids", f"{gpu_ids} names {len(gpu_ids.split(','))} device(s) for "
                               f"num_processes {config.per_machine}", "Name one device per process.")
            config.options["include"] = f"{LOCAL_HOST}:{gpu_ids}"
        return
    if gpu_ids:
        config.ignored.append("gpu_ids (num_machines > 1)")
    if "deepspeed_inclusion_filter" in launch and "deepspeed_exclusion_filter" in launch:
        raise key.fail("deepspeed_config", "deepspeed_inclusion_filter and deepspeed_exclusion_filter are "
                       "both set (DeepSpeed takes one)", "Keep one of them.")
    config.options.update(hostfile=launch.get("deepspeed_hostfile"),
                          include=launch.get("deepspeed_inclusion_filter", ""),
                          exclude=launch.get("deepspeed_exclusion_filter", ""),
                          launcher=_launcher(key, launch.get("deepspeed_multinode_launcher")))


def _gpu_ids(key: _Keys, value: object) -> str | None:
    """Accelerate's gpu_ids: "all" (or nothing) for every device, else device ids separated by commas."""
    if value is None or value in ("", "all"):
        return None
    ids = key.text("gpu_ids", value).replace(" ", "")
    if not all(part.isdigit() for part in ids.split(",")):
        raise key.fail("gpu_ids", f"{value!r} is not device ids separated by commas", "Write e.g. 0,1, or all.")
    return ids


def _main_port(key: _Keys, port: object) -> int | None:
    if port in (None, 0):  # 0: any free port, which crew picks anyway
        return None
    return key.number("main_process_port", port, minimum=1, maximum=65535)


def _launcher(key: _Keys, name: object) -> str | None:
    if name is None:
        return None  # crew's default: ssh with a hostfile, local without
    if name not in LAUNCHERS:
        raise key.fail("deepspeed_multinode_launcher", f"unknown launcher {name!r}",
                       f"Use one of {', '.join(LAUNCHERS)}.")
    return LAUNCHERS[name]


def _precision_env(key: _Keys, env: dict[str, str]) -> None:
    data = key.data
    if "mixed_precision" in data:
        value = data["mixed_precision"]
        value = "no" if value in (None, False) else str(value).lower()
        if value not in PRECISIONS:
            raise key.fail("mixed_precision", f"unknown value {data['mixed_precision']!r}",
                           f"Use one of {', '.join(PRECISIONS)}.")
        env["ACCELERATE_MIXED_PRECISION"] = value
    elif key.flag("fp16"):  # the old spelling, as Accelerate's process_config reads it
        env["ACCELERATE_MIXED_PRECISION"] = "fp16"


def _deepspeed_env(key: _Keys, ds: dict, use: bool, config: AccelerateConfig) -> None:
    """distributed_type DEEPSPEED: the variables prepare_deepspeed_cmd_env sets. With use_cpu Accelerate
    trains with DDP and never uses DeepSpeed (AcceleratorState checks `not cpu`), so there (unless
    --as_deepspeed) the DeepSpeed settings are left out, and with them Accelerate's demand for deepspeed."""
    settings = [k for k in DEEPSPEED_ENV if ds.get(k) is not None]
    if not use:
        if settings and key.data.get("distributed_type") == "DEEPSPEED":
            config.notes.append(f"use_cpu: true: Accelerate trains with DDP on the CPU, where DeepSpeed is not "
                                f"used; not set: {', '.join(settings)} (with --as_deepspeed crew's engine trains "
                                "with them on the CPU)")
        elif settings:
            config.ignored += [f"deepspeed_config.{k}" for k in settings]
        return
    config.deepspeed = True
    env = config.env
    env["ACCELERATE_USE_DEEPSPEED"] = "true"
    for name in settings:
        value = ds[name]
        env[DEEPSPEED_ENV[name]] = str(key.flag(name, value, f"deepspeed_config.{name}")).lower() \
            if name in ("zero3_init_flag", "zero3_save_16bit_model") else str(value)
    # Accelerate's DeepSpeedPlugin refuses some of these next to a deepspeed_config_file: it learns which
    # the YAML set from this list (launch_command's deepspeed_fields_from_accelerate_config).
    fields = list(ds) + (["mixed_precision"] if key.data.get("mixed_precision") is not None else [])
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields)


def _parallelism_env(key: _Keys, config: AccelerateConfig) -> None:
    """parallelism_config: the variables prepare_extend_env_parallelism_config sets, from which Accelerator()
    builds every rank's ParallelismConfig (DeepSpeed's Ulysses sequence parallelism with sp_size > 1). As
    `accelerate launch`: any non-empty mapping turns it on, keys left out take the launcher's defaults, the
    cp_* and sp_* details travel only with cp_size or sp_size > 1, and only for DeepSpeed and multi-GPU."""
    block = key.data.get("parallelism_config")
    if block is None or block == {}:
        return
    if not isinstance(block, dict):
        raise key.fail("parallelism_config", f"expected a mapping of keys, got {block!r}",
                       "Indent its keys under it (parallelism_config_sp_size: 2, ...).")
    kind = key.data["distributed_type"]
    if kind not in PARALLELISM_TYPES:
        config.ignored.append(f"parallelism_config (distributed_type {kind})")
        return
    values = _parallelism(key, block)
    env = config.env
    env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    names = [*PARALLELISM_SIZES[:4], "cp_backend", "sp_size", "sp_backend"]
    if values["cp_size"] > 1:
        names.append("cp_comm_strategy")
    if values["sp_size"] > 1:
        names += ["sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"]
    env.update({f"PARALLELISM_CONFIG_{name.upper()}": str(values[name]) for name in names})


def _parallelism(key: _Keys, block: dict) -> dict:
    """parallelism_config's values, its defaults filled in, refused where Accelerate refuses them (its launcher
    or the ranks' ParallelismConfig and DeepSpeedSequenceParallelConfig)."""
    where = {name: f"parallelism_config.{PARALLELISM_PREFIX}{name}" for name in PARALLELISM_DEFAULTS}
    keys = [PARALLELISM_PREFIX + name for name in PARALLELISM_DEFAULTS]
    for name in map(str, block):
        if name not in keys:  # Accelerate would drop it unread: sp_size: 2 would leave SP off
            close = difflib.get_close_matches(PARALLELISM_PREFIX + name.removeprefix(PARALLELISM_PREFIX), keys, n=1)
            raise key.fail(f"parallelism_config.{name}", "not a key of Accelerate's parallelism_config",
                           f"Did you mean '{close[0]}'?" if close else f"Use one of {', '.join(keys)}.")
    values = {name: block.get(PARALLELISM_PREFIX + name, default) for name, default in PARALLELISM_DEFAULTS.items()}
    for name in PARALLELISM_SIZES:
        values[name] = key.number(where[name], values[name], minimum=1)
    _choice(key, where["cp_backend"], values["cp_backend"], ("torch",))
    _choice(key, where["sp_backend"], values["sp_backend"], ("deepspeed",))
    if values["cp_size"] > 1:
        _choice(key, where["cp_comm_strategy"], values["cp_comm_strategy"], ("allgather", "alltoall"))
    if values["sp_size"] > 1:
        _sequence_parallel(key, where, values)
    if values["cp_size"] > 1 and values["sp_size"] > 1:
        raise key.fail("parallelism_config", f"cp_size {values['cp_size']} and sp_size {values['sp_size']}: "
                       "context and sequence parallelism exclude each other", "Set one of them to 1.")
    if (values["tp_size"] > 1 or values["cp_size"] > 1) and values["dp_replicate_size"] > 1 \
            and values["dp_shard_size"] == 1:
        raise key.fail("parallelism_config", "tp_size or cp_size > 1 with dp_replicate_size > 1 and dp_shard_size "
                       "1 (Accelerate composes TP/CP with FSDP sharding only)",
                       "Set dp_shard_size > 1, or dp_replicate_size to 1.")
    return values


def _sequence_parallel(key: _Keys, where: dict[str, str], values: dict) -> None:
    """sp_size > 1: the sp_* keys the ranks' DeepSpeedSequenceParallelConfig reads."""
    length, attention = values["sp_seq_length"], values["sp_attn_implementation"]
    if length is not None:
        values["sp_seq_length"] = key.number(where["sp_seq_length"], length, minimum=1)
    variable = values["sp_seq_length_is_variable"]
    values["sp_seq_length_is_variable"] = key.flag(where["sp_seq_length_is_variable"], variable,
                                                   where["sp_seq_length_is_variable"])
    if not values["sp_seq_length_is_variable"] and length is None:
        raise key.fail(where["sp_seq_length_is_variable"], "false needs the fixed length of every batch",
                       f"Set {PARALLELISM_PREFIX}sp_seq_length, or make it true for batches of varying length.")
    attention = key.text(where["sp_attn_implementation"], attention)
    if attention not in SP_ATTENTION and ("/" not in attention or "flash-attn" not in attention):
        raise key.fail(where["sp_attn_implementation"], f"{attention!r} cannot run under sequence parallelism",
                       f"Use one of {', '.join(SP_ATTENTION)}, or a hub flash attention kernel such as "
                       "kernels-community/flash-attn2.")


def _choice(key: _Keys, where: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise key.fail(where, f"unknown value {value!r}", f"Use {' or '.join(choices)}.")


def _no_op(value: object) -> bool:
    if isinstance(value, dict):
        return all(_no_op(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return value in _NO_OP


def _unset(value: object) -> bool:
    """A launch option still at its built-in default: the YAML may fill it."""
    return value is None or value == "" or value is False


def launch_options(config: AccelerateConfig, args: argparse.Namespace) -> dict[str, object]:
    """The options the YAML gives, now that the command line's hostfile and filters are known:
    --num_nodes with a hostfile, --num_gpus per machine (neither next to a filter, as DeepSpeed), and
    several machines without a hostfile or with the "standard" launcher: standalone, node_rank =
    machine_rank, each machine started by hand as `accelerate launch` on each."""
    options = dict(config.options)
    hostfile = args.hostfile or options["hostfile"]
    if not args.hostfile and hostfile and not Path(hostfile).is_file():
        raise CrewError(f"{config.path}: deepspeed_config.deepspeed_hostfile: {hostfile} not found (from "
                        f"{Path.cwd()}). Fix the path in the YAML, or pass --hostfile.")
    if not (args.include or args.exclude or options["include"] or options["exclude"]):
        options["num_gpus"] = config.per_machine
        if hostfile:
            options["num_nodes"] = config.num_machines
    launcher = args.launcher or options["launcher"]
    if config.num_machines > 1 and launcher == "slurm":  # the allocation's nodes, as a hostfile's hosts
        options["num_nodes"] = config.num_machines
    elif config.num_machines > 1 and (not hostfile or launcher == "standalone"):
        if options["launcher"] in HOSTFILE_LAUNCHERS and not hostfile:
            raise CrewError(f"{config.path}: deepspeed_multinode_launcher: {options['launcher']} starts the "
                            "machines of deepspeed_hostfile, and there is none. Add deepspeed_hostfile (or "
                            "--hostfile), or use the standard launcher and run crew on each machine.")
        options.update(launcher="standalone", node_rank=config.machine_rank)
        options["master_port"] = options["master_port"] or ACCELERATE_PORT  # every machine must agree
    return options


def standalone_machines(config: AccelerateConfig, args: argparse.Namespace) -> list[Host]:
    """num_machines with no hostfile: the plan's nodes, as each machine runs its own part. Only this
    machine's slots are started here; the others' names are labels (node 0 is main_process_ip)."""
    per_machine = args.num_gpus or config.per_machine
    if per_machine is None:
        raise CrewError(f"{config.path}: num_processes: needed for num_machines {config.num_machines} "
                        "(the total over all machines). Set it, or pass --num_gpus (per machine).")
    if not args.master_addr:
        raise CrewError(f"{config.path}: main_process_ip: needed for num_machines {config.num_machines}: "
                        "the address of machine 0, where rank 0 listens. Set it, or pass --master_addr.")
    names = [args.master_addr if k == 0 else
             socket.gethostname() if k == config.machine_rank else f"machine{k}"
             for k in range(config.num_machines)]
    return [Host(str(name), tuple(range(per_machine))) for name in names]


def deepspeed_note(config: AccelerateConfig, args: argparse.Namespace) -> str | None:
    """distributed_type DEEPSPEED: what an Accelerate script will lack, said before anything starts.
    Accelerate's DeepSpeed integration finds DeepSpeed by its package metadata and builds transformers'
    HfDeepSpeedConfig (DeepSpeedPlugin.select, at `Accelerator()`), so the ranks need transformers and a
    DeepSpeed: the real one, or crew's engine under --as_deepspeed (the ranks then find crew's record).
    Only a note, and only when the script's text names accelerate: a script on crew's own engine
    launched with the same YAML needs neither; an Accelerate script stops at `Accelerator()` with
    Accelerate's own ImportError."""
    if not config.deepspeed:
        return None
    path = config.env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and not Path(path).is_file():
        raise CrewError(f"{config.path}: deepspeed_config.deepspeed_config_file: {path} not found (from "
                        f"{Path.cwd()}, where the ranks start). Fix the path, or remove the key.")
    if not _mentions_accelerate(getattr(args, "script", None)):
        return None  # a script on crew's (or DeepSpeed's) engine, launched with the same YAML
    if config.as_deepspeed:
        if _installed("transformers"):
            return None
        return ("distributed_type: DEEPSPEED: an Accelerate script needs transformers on every node (Accelerate's "
                "DeepSpeed plugin builds transformers' HfDeepSpeedConfig, also on crew's engine); not installed "
                "here: transformers (pip install transformers, or use MULTI_GPU)")
    missing = [name for name in ("deepspeed", "transformers") if not _installed(name)]
    if not missing:
        return None
    fix = ("pass --as_deepspeed to train on crew's engine as DeepSpeed, or use MULTI_GPU" if "deepspeed" in missing
           else "or use MULTI_GPU")
    return (f"distributed_type: DEEPSPEED: an Accelerate script needs deepspeed and transformers on every "
            f"node; not installed here: {', '.join(missing)} ({fix})")


def _mentions_accelerate(script: str | None) -> bool:
    """Whether the script may be an Accelerate one: its text names accelerate, or it cannot be read here."""
    try:
        return "accelerate" in Path(script).read_text(errors="replace")
    except (OSError, TypeError):
        return True


def _installed(name: str) -> bool:
    """As accelerate's _is_package_available: importable and with package metadata (a version)."""
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def apply_config_file(args: argparse.Namespace, say: Callable[[str], None], for_run: bool = False) -> None:
    """Fill the launch options the user left at their defaults from args.config_file, put its
    ACCELERATE_* variables before the user's --env, and say what it read it as, the keys crew has no use
    for (one line) and any note. `for_run`: also say what an Accelerate script will lack (DeepSpeed)."""
    path = args.config_file
    config = parse_config(path, read_config(path), as_deepspeed=bool(getattr(args, "as_deepspeed", False)))
    applied = {}
    for dest, value in launch_options(config, args).items():
        if value not in (None, "") and _unset(getattr(args, dest, None)):
            setattr(args, dest, value)
            applied[dest] = value
    if applied.get("master_port") == 22:  # seen in the wild: the ssh port where the master port goes
        raise CrewError(f"{path}: main_process_port: 22 is ssh's port: rank 0 listens on main_process_port for "
                        "the other ranks, and sshd already holds 22. Set a free port such as 29500, or 0 (or "
                        "remove it) for any free port, or pass --master_port.")
    if config.num_machines > 1 and not args.hostfile and args.launcher == "standalone":
        args.machines = standalone_machines(config, args)
    args.env = [f"{name}={value}" for name, value in config.env.items()] + list(args.env or [])
    if for_run and (note := deepspeed_note(config, args)):
        config.notes.append(note)
    flags = " ".join(_OPTION_FLAGS[d] if v is True else f"{_OPTION_FLAGS[d]} {v}" for d, v in applied.items())
    say(f"--config_file {path}: as {flags or 'no launch options'}")
    if config.env:
        env = " ".join(f"{k}={v}" for k, v in config.env.items())
        say(f"--config_file {path}: env {env if len(env) < 150 else env[:140] + '… (crew plan shows all)'}")
    if config.ignored:
        say(f"--config_file {path}: ignoring keys crew has no use for: {', '.join(config.ignored)}")
    for note in config.notes:
        say(f"--config_file {path}: {note}")
