"""UlyssesSPAttentionHF: DeepSpeed 0.19.8's Ulysses attention for Hugging Face models, on torch.distributed.

Each SP rank holds sl/sp tokens of every head. Around the model's core attention (sdpa, flash, flex) one all-to-all
trades that for all sl tokens of hc/sp heads, and one after it trades back. Tensors inside are [sl, bs, hc, hs]
(sequence first), as DeepSpeed's; the model hands [bs, hc, sl, hs] in and takes [bs, sl, hc*hs] out.

Names as in DeepSpeed: sl seq length, sl_l its local share, bs batch, hc heads, hc_l local heads, hs head size,
ws the SP size, em_l = hc_l * hs.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
import torch.distributed as dist

from crew.errors import ConfigError, CrewError
from crew.runtime.ulysses.exchange import gather_along_seq, swap_first_dim

TRANSFORMERS_MIN = "4.51.3"

_NO_POSITION_IDS = (
    "Ulysses SP attention was called without position_ids: after the sequence is gathered, attention needs every "
    "token's global position, or each rank's local 0..chunk_len-1 positions look like packed sequences and the "
    "causal mask comes out wrong. Pass position_ids to the model's forward (for unpacked sequences "
    "torch.arange(seq_len) per sample; for packed ones positions that restart at each document), e.g. by "
    "wrapping the DataLoader in UlyssesSPDataLoaderAdapter, which requires and shards them.")


class UlyssesShapeError(CrewError, AssertionError):
    """An input the Ulysses attention cannot exchange (an AssertionError too, as DeepSpeed raises one)."""


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed's UlyssesSPAttentionHF: same arguments and attributes. `attn` is the core attention function
    from transformers' ALL_ATTENTION_FUNCTIONS; `process_group` the SP group. With seq_length_is_variable the
    sequence length is read from each call; otherwise local_seq_length / global_seq_length fix it. With
    disable_in_eval, a module in eval mode runs `attn` on its local tokens alone.

    Set `skip_all_but_last_attention_debug_mode = True` to run the core attention in the last layer only
    (memory sizing; the results are garbage), as DeepSpeed's."""

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.skip_all_but_last_attention_debug_mode = False
        self.rotating_layer_counter = 0
        self.core_attn_implementation = None  # register_with_transformers sets it
        self._flex_block_mask_cached = None
        self._flex_block_mask_cache_key = None
        _check_transformers()
        _check_heads(attn_head_count, kv_head_count, self.world_size)
        self.local_q_head_count = attn_head_count // self.world_size
        # fewer kv heads than SP ranks (MQA, some GQA): each rank gets one kv head, repeated to match
        self.kv_replication_factor = self.world_size // kv_head_count
        self.local_kv_head_count = 1 if self.kv_replication_factor > 1 else kv_head_count // self.world_size
        local, whole = (1, 1) if seq_length_is_variable else (local_seq_length, global_seq_length)
        self.required_query_shape = torch.Size([local, batch_size, attn_head_count, attn_head_size])
        self.required_key_value_shape = torch.Size([local, batch_size, kv_head_count, attn_head_size])
        self.required_context_shape = torch.Size([whole, batch_size, self._local_width()])

    def _local_width(self) -> int:
        return self.attn_head_size * self.attn_head_count // self.world_size

    def _follow_seq_length(self, local: int) -> None:
        self.local_seq_length, self.global_seq_length = local, local * self.world_size
        self.required_query_shape = torch.Size([local, *self.required_query_shape[1:]])
        self.required_key_value_shape = torch.Size([local, *self.required_key_value_shape[1:]])
        self.required_context_shape = torch.Size([self.global_seq_length, *self.required_context_shape[1:]])

    def _combine_local_sequences(self, query, key, value):
        """[sl_l bs hc hs] each -> [sl bs hc_l hs] each (kv heads repeated first when fewer than SP ranks)."""
        return (self._seq_to_heads(query, self.local_q_head_count),
                self._seq_to_heads(self._replicate_kv(key), self.local_kv_head_count),
                self._seq_to_heads(self._replicate_kv(value), self.local_kv_head_count))

    def _replicate_kv(self, x):
        return x.repeat_interleave(self.kv_replication_factor, dim=2) if self.kv_replication_factor > 1 else x

    def _seq_to_heads(self, x, local_heads: int):
        x = x.reshape(self.local_seq_length, self.batch_size, self.world_size, local_heads, self.attn_head_size)
        swapped = swap_first_dim(x.permute(2, 0, 1, 3, 4), self.process_group)  # [ws sl_l bs hc_l hs]
        return swapped.reshape(self.global_seq_length, *swapped.shape[2:])

    def _partition_global_sequence(self, context):
        """[sl bs em_l] -> [sl_l bs em]."""
        parts = context.reshape(self.world_size, self.local_seq_length, self.batch_size, self._local_width())
        swapped = swap_first_dim(parts, self.process_group)  # [ws sl_l bs em_l], slot i: rank i's heads
        return swapped.permute(1, 2, 0, 3).reshape(self.local_seq_length, self.batch_size, -1)

    def forward(self, module: torch.nn.Module, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        """query/key/value [bs hc sl_l hs] -> ([bs sl_l em], attention weights or None)."""
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if self.seq_length_is_variable:
            self._follow_seq_length(query.shape[2])
        query, key, value = (x.permute(2, 0, 1, 3) for x in (query, key, value))  # -> [sl_l bs hc hs]
        if kwargs.get("position_ids") is None:
            raise UlyssesShapeError(_NO_POSITION_IDS)
        kwargs["position_ids"] = gather_along_seq(kwargs["position_ids"], self.process_group, self.world_size)
        self._check_inputs(query, key, value)
        query, key, value = (x.permute(1, 2, 0, 3).contiguous()  # -> [bs hc_l sl hs]
                             for x in self._combine_local_sequences(query, key, value))
        if self.kv_replication_factor > 1:  # the core attention repeats kv heads by this count
            module.num_key_value_groups = query.size(-3) // key.size(-3)
        if self.core_attn_implementation == "flex_attention":
            attention_mask = self._whole_sequence_block_mask(attention_mask, query)
        context, weights = self._core(module, query, key, value, attention_mask, *args, **kwargs)
        context = context.permute(1, 0, 2, 3)  # [bs sl hc_l hs] -> [sl bs hc_l hs]
        context = context.reshape(*context.shape[:2], -1)
        if context.shape != self.required_context_shape:
            raise UlyssesShapeError(f"Ulysses SP attention: the core attention returned context of shape "
                                    f"{tuple(context.shape)} (as [seq, batch, heads x head size]); expected "
                                    f"{tuple(self.required_context_shape)}.")
        output = self._partition_global_sequence(context).permute(1, 0, 2)  # -> [bs sl_l em]
        return output.reshape(*output.shape[:2], -1), weights

    def _core(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.skip_all_but_last_attention_debug_mode:
            self.rotating_layer_counter = (self.rotating_layer_counter + 1) % self.num_hidden_layers
            if self.rotating_layer_counter != 0:
                return query.permute(0, 2, 1, 3), None  # right shape, wrong values: memory sizing only
        return self.attn(module, query, key, value, attention_mask, *args, **kwargs)

    def _check_inputs(self, query, key, value) -> None:
        where = f"[rank {dist.get_rank()}] Ulysses SP attention"
        if query.shape != self.required_query_shape:
            raise UlyssesShapeError(f"{where}: query of shape {tuple(query.shape)} as [seq, batch, heads, head "
                                    f"size]; expected {tuple(self.required_query_shape)}. {_shape_fix(self)}")
        if not key.shape == value.shape == self.required_key_value_shape:
            raise UlyssesShapeError(f"{where}: key {tuple(key.shape)} and value {tuple(value.shape)} as [seq, "
                                    f"batch, kv heads, head size]; expected {tuple(self.required_key_value_shape)}."
                                    f" {_shape_fix(self)}")

    def _whole_sequence_block_mask(self, attention_mask, query):
        """flex_attention's BlockMask was built for the local tokens: a causal one for the whole sequence."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask
        if not isinstance(attention_mask, BlockMask):
            return attention_mask
        key = (query.shape[0], query.shape[2])
        if self._flex_block_mask_cache_key != key:
            self._flex_block_mask_cached = create_block_mask(
                mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=key[0], H=None, Q_LEN=key[1],
                KV_LEN=key[1], device=query.device)
            self._flex_block_mask_cache_key = key
        return self._flex_block_mask_cached

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None):
        """Swap transformers' `core_attn_implementation` for Ulysses attention over SP groups of
        `sequence_parallel_size` ranks; returns the mpu for deepspeed.initialize(mpu=...), None for size 1.
        See crew/runtime/ulysses/register.py."""
        from crew.runtime.ulysses.register import register_with_transformers
        return register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                          micro_batch_size, seq_length, seq_length_is_variable, disable_in_eval,
                                          max_length)


def _shape_fix(attention: UlyssesSPAttentionHF) -> str:
    if attention.seq_length_is_variable:
        return (f"Register with micro_batch_size equal to the batch each rank feeds the model "
                f"({attention.batch_size} now).")
    return ("With seq_length_is_variable=False every batch must be seq_length tokens long (seq_length / SP size per "
            "rank); pass seq_length_is_variable=True for batches of varying length.")


def _check_transformers(have: str | None = None) -> None:
    from packaging import version  # transformers' own dependency (crew's is not)

    have = have or importlib.metadata.version("transformers")
    if version.parse(have) < version.parse(TRANSFORMERS_MIN):
        raise ConfigError(f"Ulysses SP needs transformers>={TRANSFORMERS_MIN}; this environment has "
                          f"transformers=={have}: pip install -U 'transformers>={TRANSFORMERS_MIN}'.")


def _check_heads(heads: int, kv_heads: int, sp: int) -> None:
    if heads % sp:
        raise ConfigError(f"Ulysses SP: the model's {heads} attention heads do not divide among sequence parallel "
                          f"size {sp} (attention head count {heads} is not divisible by SP size {sp}); set "
                          "sequence_parallel_size to a divisor of the head count.")
    if kv_heads % sp and sp % kv_heads:
        raise ConfigError(f"Ulysses SP: the model's {kv_heads} key/value heads and sequence parallel size {sp}: "
                          f"KV attention head count {kv_heads} is not divisible by SP size {sp} or vice versa; set "
                          f"sequence_parallel_size to a divisor or a multiple of {kv_heads} (that divides {heads}).")
