"""`deepspeed.launcher.runner`: DeepSpeed 0.19.8's constants, which `accelerate launch` reads
(DEEPSPEED_ENVIRONMENT_NAME: the file of KEY=VALUE lines that travel to every node, `.deepspeed_env`
unless DS_ENV_FILE names another; crew's launcher reads the same files, crew/launcher/plan/env.py).
The runner's functions (main, parse_args, ...) are DeepSpeed's launcher, which `crew run` replaces:
refused by name."""

from __future__ import annotations

import os

from crew.deepspeed.errors import UnsupportedAttribute, unsupported

DLTS_HOSTFILE = "/job/hostfile"
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
PDSH_MAX_FAN_OUT = 1024

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "DLTS_HOSTFILE", "EXPORT_ENVS",
           "PDSH_MAX_FAN_OUT"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedAttribute(unsupported(f"launcher.runner.{name}"), name=name, obj=None)
