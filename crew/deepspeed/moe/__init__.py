"""`deepspeed.moe`: only `deepspeed.moe.utils` exists, for scripts that import it without using MoE;
`deepspeed.moe.layer` and the rest stay refused (crew has no mixture of experts)."""
