"""Tiled compute on the sequence dimension (DeepSpeed 0.19.8's ALST pieces), as plain autograd Functions.

Each runs its function one sequence tile at a time without keeping activations, and runs it again, tile by tile,
in backward: memory for one tile's activations instead of the whole sequence's, for a second forward's time.
- sequence_tiled_compute / SequenceTiledCompute: any fn over dicts of [bs, seq, ...] tensors.
- TiledMLP: fn(module, x) applied per token (an MLP).
- TiledFusedLogitsLoss: fn(module, x, y[, mask]) -> a loss per tile; the logits of one tile at a time. It runs
  backward inside forward (it is the last op), so its parameters' gradients are accumulated during forward.
- AutogradComputeMLP: fn(module, x) recomputed in backward, untiled.

`compute_params` are the weights fn uses; as in DeepSpeed, each gets `ds_grad_is_ready` False until the last
tile's backward (DeepSpeed ZeRO reads it; crew's engine does not need it, as gradients are reduced after backward).
"""

from __future__ import annotations

import math

import torch

REDUCTIONS = (None, "mean", "sum")


def _mark_ready(params, ready: bool) -> None:
    for param in params or ():
        param.ds_grad_is_ready = ready


def _leaf(x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_(requires_grad)


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """fn(**tile of kwargs_to_shard, **kwargs_to_pass) over `shards` tiles of the `seqlen` dim (dim 1), outputs
    joined on `output_unshard_dimension` (0: fn returns a scalar per tile), then reduced: None, "mean" or "sum".
    Only kwargs_to_shard[grad_requiring_tensor_key] gets a gradient."""
    if output_reduction not in REDUCTIONS:
        raise ValueError(f"sequence_tiled_compute(output_reduction={output_reduction!r}): valid values are None, "
                         "'mean' and 'sum'.")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"sequence_tiled_compute(grad_requiring_tensor_key={grad_requiring_tensor_key!r}): not a "
                         f"key of kwargs_to_shard ({list(kwargs_to_shard)}).")
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """See sequence_tiled_compute, which fills the arguments in (an autograd Function takes no dicts)."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
                output_unshard_dimension, output_reduction, *args) -> torch.Tensor:
        sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        step = math.ceil(seqlen / shards)
        with torch.no_grad():
            outputs = [fn(**{k: v[:, i * step:(i + 1) * step] for k, v in sharded.items()}, **passed)
                       for i in range(shards)]
            whole = (torch.stack(outputs) if output_unshard_dimension == 0
                     else torch.cat(outputs, dim=output_unshard_dimension))
        ctx.fn, ctx.step, ctx.shards, ctx.sharded, ctx.passed = fn, step, shards, sharded, passed
        ctx.key, ctx.dim, ctx.reduction = grad_requiring_tensor_key, output_unshard_dimension, output_reduction
        ctx.params = [p for p in compute_params or () if p.requires_grad]
        ctx.whole_shape, ctx.n_args = whole.shape, len(args)
        ctx.key_index = (list(keys_to_shard) + list(keys_to_pass)).index(grad_requiring_tensor_key)
        if output_reduction is None:
            return whole
        if output_reduction == "mean":
            return whole.mean()
        if output_reduction == "sum":
            return whole.sum()
        raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0]
        if ctx.reduction is not None:  # the reduction's own gradient, spread over the joined outputs
            grad = grad.expand(ctx.whole_shape) / (math.prod(ctx.whole_shape) if ctx.reduction == "mean" else 1)
        target = ctx.sharded[ctx.key]
        target_grad = torch.zeros_like(target)
        for i in range(ctx.shards):
            _mark_ready(ctx.params, i + 1 == ctx.shards)
            start = min(i * ctx.step, target.shape[1])
            tile = {k: v[:, start:start + ctx.step] for k, v in ctx.sharded.items()}
            tile[ctx.key] = _leaf(tile[ctx.key], target.requires_grad)
            with torch.enable_grad():
                output = ctx.fn(**tile, **ctx.passed)
            width = tile[ctx.key].shape[1]
            tile_grad = grad[i] if ctx.dim == 0 else grad.narrow(ctx.dim, start, width)
            torch.autograd.backward(output, tile_grad)
            if tile[ctx.key].grad is not None:
                target_grad[:, start:start + width] = tile[ctx.key].grad
        arg_grads = [None] * ctx.n_args
        arg_grads[ctx.key_index] = target_grad
        return (None,) * 9 + tuple(arg_grads)


class TiledMLP(torch.autograd.Function):
    """TiledMLP.apply(fn, module, x, shards, compute_params): fn(module, x) in `shards` tiles of dim -2 of x
    ([bs, seq, hidden] or [seq, hidden]); fn must treat each token on its own."""

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.params = [p for p in compute_params or () if p.requires_grad]
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        # tokens flattened (reshape: x or the gradient may be non-contiguous), so a tile is rows, for any batch
        rows, incoming = x.reshape(-1, x.shape[-1]), grads[0].reshape(-1, grads[0].shape[-1])
        x_grad = torch.zeros_like(rows)
        start = 0
        tiles = torch.chunk(rows, ctx.shards, dim=0)
        for i, tile in enumerate(tiles):
            _mark_ready(ctx.params, i + 1 == len(tiles))
            leaf, width = _leaf(tile, x.requires_grad), tile.shape[0]
            with torch.enable_grad():
                output = ctx.fn(ctx.module, leaf)
            torch.autograd.backward(output, incoming.narrow(0, start, width).reshape(output.shape))
            if leaf.grad is not None:
                x_grad[start:start + width] = leaf.grad
            start += width
        return None, None, x_grad.view(x.shape), None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction):
    fn(module, x_tile, y_tile[, mask_tile]) -> a scalar loss per tile, tiles over the flattened [bs, seq] tokens;
    the tiles' losses averaged ("mean") or summed ("sum"). With uneven tiles or a mask, prefer "sum" and divide
    yourself. The full logits never exist; x's gradient is computed in forward and scaled in backward."""

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction) -> torch.Tensor:
        _check_loss_inputs(x, y, mask, output_reduction)
        params = [p for p in compute_params or () if p.requires_grad]
        batch, seqlen = x.shape[:2]
        wants_grad = x.requires_grad
        flat_x, flat_y = x.detach().reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])
        tiles = list(zip(torch.chunk(flat_x, shards), torch.chunk(flat_y, shards)))
        masks = torch.chunk(mask.reshape(-1), shards) if mask is not None else [None] * len(tiles)
        # backward here, with the reduction's gradient given up front: 1 per tile for "sum", 1/shards for "mean"
        seed = torch.tensor(1.0 / shards if output_reduction == "mean" else 1.0, dtype=x.dtype, device=x.device)
        x_grad = torch.zeros_like(flat_x) if wants_grad else None
        losses, start = [], 0
        for i, ((x_tile, y_tile), m_tile) in enumerate(zip(tiles, masks)):
            _mark_ready(params, i + 1 == len(tiles))
            leaf = _leaf(x_tile, wants_grad)
            args = (self, leaf, y_tile) + ((m_tile,) if mask is not None else ())
            with torch.enable_grad():
                loss = fn(*args)
            if wants_grad:
                torch.autograd.backward(loss, seed)
                x_grad[start:start + x_tile.shape[0]] = leaf.grad
            losses.append(loss.detach())
            start += x_tile.shape[0]
        if x_grad is not None:
            ctx.save_for_backward(x_grad.view(batch, seqlen, *x_grad.shape[1:]))
        stacked = torch.stack(losses)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx, *grads):
        (x_grad,) = ctx.saved_tensors
        if grads[0] != 1.0:
            x_grad = x_grad * grads[0]
        return None, None, x_grad, None, None, None, None, None


def _check_loss_inputs(x, y, mask, output_reduction) -> None:
    where = "TiledFusedLogitsLoss"
    if output_reduction not in ("mean", "sum"):
        raise ValueError(f'{where}: unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(f"{where}: x {tuple(x.shape)} and y {tuple(y.shape)} must be at least 2D "
                         "[batch_size, seq_len, ...]")
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"{where}: x and y batch/seq dims must match: {tuple(x.shape[:2])} vs {tuple(y.shape[:2])}")
    if mask is not None and (mask.dim() != 2 or mask.shape != x.shape[:2]):
        raise ValueError(f"{where}: mask must be 2D [batch_size, seq_len] = {tuple(x.shape[:2])}, got "
                         f"{tuple(mask.shape)}")


class AutogradComputeMLP(torch.autograd.Function):
    """AutogradComputeMLP.apply(fn, module, x): fn(module, x) without saved activations, recomputed in backward."""

    @staticmethod
    def forward(ctx, fn, self, x) -> torch.Tensor:
        ctx.fn, ctx.module = fn, self
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(self, x)

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        leaf = _leaf(x, x.requires_grad)
        with torch.enable_grad():
            output = ctx.fn(ctx.module, leaf)
        torch.autograd.backward(output, grads[0])
        return None, None, leaf.grad
