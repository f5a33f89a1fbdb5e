"""`deepspeed.ops`: DeepSpeed's optimizers on torch: `adam` (FusedAdam, DeepSpeedCPUAdam), `adagrad`
(DeepSpeedCPUAdagrad) and `lion` (DeepSpeedCPULion, FusedLion). `lamb` and the kernels are refused;
`op_builder` says which ops are available."""

from crew.deepspeed.ops import adagrad, adam, lion, op_builder

__all__ = ["adagrad", "adam", "lion", "op_builder"]
__compatible_ops__ = op_builder.compatible_ops()  # DeepSpeed's skip markers index it by a builder's NAME
