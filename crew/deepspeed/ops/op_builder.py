"""`deepspeed.ops.op_builder`: DeepSpeed's op builders, as scripts and tests use them to ask whether an op is
available (`FusedAdamBuilder().is_compatible()`, `deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME]`).
An op crew provides on torch (deepspeed.ops.adam, adagrad, lion) is compatible; `load()` (the compiled
extension itself) is refused, since crew compiles nothing."""

from __future__ import annotations

from crew.deepspeed.errors import UnsupportedAttribute, unsupported

__all__ = ["AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "FusedLambBuilder", "FusedLionBuilder", "OpBuilder", "compatible_ops"]


class OpBuilder:
    NAME = "deepspeed_not_implemented"
    PROVIDED = False  # whether crew answers this op's Python API on torch

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.PROVIDED

    def load(self, verbose: bool = True):
        raise UnsupportedAttribute(unsupported(f"ops.op_builder.{type(self).__name__}.load") +
                                   " crew compiles no kernels; use the optimizer classes in deepspeed.ops.",
                                   name="load", obj=self)

    def jit_load(self, verbose: bool = True):
        return self.load(verbose)


class FusedAdamBuilder(OpBuilder):
    NAME, PROVIDED = "fused_adam", True


class CPUAdamBuilder(OpBuilder):
    NAME, PROVIDED = "cpu_adam", True


class CPUAdagradBuilder(OpBuilder):
    NAME, PROVIDED = "cpu_adagrad", True


class CPULionBuilder(OpBuilder):
    NAME, PROVIDED = "cpu_lion", True


class FusedLionBuilder(OpBuilder):
    NAME, PROVIDED = "fused_lion", True


class FusedLambBuilder(OpBuilder):
    NAME = "fused_lamb"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"


def compatible_ops() -> dict[str, bool]:
    """DeepSpeed's `__compatible_ops__`: op name -> whether it can be used here."""
    builders = [OpBuilder, FusedAdamBuilder, CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder,
                FusedLambBuilder, AsyncIOBuilder]
    return {builder.NAME: builder.PROVIDED for builder in builders}
