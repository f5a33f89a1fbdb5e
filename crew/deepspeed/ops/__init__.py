"""`deepspeed.ops`: DeepSpeed's optimizers on torch: `adam` (FusedAdam, DeepSpeedCPUAdam), `adagrad`
(DeepSpeedCPUAdagrad) and `lion` (DeepSpeedCPULion, FusedLion). `lamb` and the kernels are refused."""

from crew.deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
