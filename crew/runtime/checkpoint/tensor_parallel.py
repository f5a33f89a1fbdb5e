"""AutoTP tensor-parallel checkpoints, in the files DeepSpeed 0.19.8 writes under
`"tensor_parallel": {"autotp_size": N}`.

A tag holds one copy of the data-parallel layout per TP rank t (DeepSpeed's "mp rank"), each with t's slices of the
sharded weights under the model's own names (a column-parallel q_proj [out / N, in], a row-parallel o_proj
[out, in / N], lm_head by vocabulary rows; embeddings and norms whole in every file):

    mp_rank_<t>_model_states.pt   written by TP rank t's first data-parallel rank: DeepSpeed's keys, with
                                  dp_world_size = world / N, mp_world_size = N, checkpoint_parallel_dimensions
                                  {"pp_degree": 1, "tp_degree": N}
    [bf16_]zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt
                                  stages 1-2: data-parallel rank d's partition of TP rank t's flat fp32 weights
                                  and optimizer state, as without TP
    crew_state.pt, rank<R>.pt, crew_checkpoint.json
                                  as without TP; crew_state.pt adds "tensor_parallel": the size and the dim each
                                  sharded parameter is split along, the manifest "tensor_parallel_size"

Loading at the saved TP size reads this rank's mp files. At another size (1 included) every rank reads all of them,
joins each sharded tensor (weights and per-element optimizer state) along its dim and cuts its own slice. A
DeepSpeed-written tag says the dims in its universal_checkpoint_info. A fused weight split as sub-parameters
(tensor_parallel/subparams.py: each rank its share of each) is joined sub-parameter by sub-parameter: crew_state.pt
records its Layout in place of the dim, DeepSpeed's parameter_with_sub_params its shape. Whole weights
(save_16bit_model, _consolidated_16bit_state_dict) are gathered over the TP group; rank 0 keeps them.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from crew.runtime import parallel
from crew.runtime.checkpoint.layout import CheckpointError
from crew.runtime.tensor_parallel.layers import TP_DIM, TP_LAYOUT  # the dim a slice is cut along; a fused one's Layout

MODEL_FILE = "mp_rank_{mp:02d}_model_states.pt"


def size() -> int:
    return parallel.tensor_parallel_size()


def rank() -> int:
    return parallel.tensor_parallel_rank()


def data_parallel_rank() -> int:
    group = parallel.data_parallel_group()
    return dist.get_rank(group) if group is not None else 0


def model_file(mp: int | None = None) -> str:
    return MODEL_FILE.format(mp=rank() if mp is None else mp)


def parallel_keys(engine) -> dict:
    """The model states file's sizes (engine.py _common_checkpoint_state)."""
    tp = size()
    dp = parallel.data_parallel_size() if tp > 1 else engine.world_size
    return {"dp_world_size": dp, "mp_world_size": tp,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": tp}}


def dims(module: torch.nn.Module) -> dict[str, int | dict]:
    """{parameter name: the dim it is split along, or its sub-parameter Layout as a dict}, of the sharded ones."""
    return {name: getattr(param, TP_DIM) if (layout := _layout(param)) is None else layout.as_dict()
            for name, param in module.named_parameters() if getattr(param, TP_DIM, None) is not None}


def _layout(param: torch.Tensor):
    return getattr(param, TP_LAYOUT, None)


def universal_info(module: torch.nn.Module) -> dict:
    """DeepSpeed's universal_checkpoint_info (module_inject/layers.py collect_autotp_universal_checkpoint_info) for
    crew's plain splits: which weights are row-parallel, replicated or vocabulary-parallel, and the affine map of
    each one's slices in its whole tensor, what ds_to_universal.py reads."""
    tp = size()
    output = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    vocabulary = {id(output.weight)} if isinstance(getattr(output, "weight", None), torch.Tensor) else set()
    kinds: dict[str, list] = {"row": [], "replicated": [], "vocabulary": []}
    params, vocab_size, fused, widths = {}, None, [], {}
    for name, param in module.named_parameters():
        pattern = rf"^{re.escape(name)}$"
        dim = getattr(param, TP_DIM, None)
        layout = _layout(param)
        if layout is not None:
            fused.append({"patterns": [pattern], "shape": layout.deepspeed_shape(), "partition_dim": layout.dim})
            widths[pattern] = [[size // tp] * tp for size in layout.sizes]
        if dim is None:
            kinds["replicated"].append(pattern)
        elif dim == 1:
            kinds["row"].append(pattern)
        elif id(param) in vocabulary:
            kinds["vocabulary"].append(pattern)
            vocab_size = param.shape[0] * tp
        params[pattern] = _affine(tuple(param.shape), dim, tp) if layout is None else _fused_affine(layout, tp)
    ordered = dict(sorted(params.items(), key=lambda item: item[0] in kinds["replicated"]))  # as DeepSpeed's
    info = {"universal_checkpoint_version": 0.4, "parameter_with_row_parallelism_patterns": sorted(kinds["row"]),
            "tp_replicated_parameter_patterns": sorted(kinds["replicated"]),
            "vocabulary_parameter_patterns": sorted(kinds["vocabulary"]), "parameter_with_sub_params": fused,
            "autotp_unsupported_parameter_patterns": {}}
    if widths:
        info["sub_param_shard_widths"] = widths
    if vocab_size is not None:
        info["original_vocab_size"] = vocab_size
    return {**info, "affine_map": {"version": 1, "params": ordered}}


def _affine(local: tuple, dim: int | None, tp: int) -> dict:
    """One parameter's affine map: each TP rank's slice as a piece at an offset of the whole, contiguous tensor."""
    whole = list(local) if dim is None else [n * tp if i == dim else n for i, n in enumerate(local)]
    ranks = {}
    for index in range(tp):
        offset = 0 if dim is None else index * local[dim] * _strides(whole)[dim]
        ranks[index] = {"shard_shape": list(local), "pieces": [{
            "shape": list(local), "source": [offset, _strides(whole)], "dest": [0, _strides(list(local))],
            "locations": list(range(tp)) if dim is None else [index]}]}
    return {"logical_shape": whole, "ranks": ranks}


def zero3_ranks() -> tuple[int, int]:
    """Stage 3's (R, t) of zero_pp_rank_<R>_mp_rank_<t>: the global rank and 0, or under AutoTP the data-parallel
    and TP ranks (DeepSpeed's names for stage 3 + TP)."""
    return (data_parallel_rank(), rank()) if size() > 1 else (dist.get_rank(), 0)


def _strides(shape) -> list[int]:
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return out


def _fused_affine(layout, tp: int) -> dict:
    """A sub-parameter weight's affine map: each rank's slice as one piece per sub-parameter, in the logical view
    (the weight's own shape for a 2-D `shape` such as [2, -1], as DeepSpeed's _derive_affine_map)."""
    whole, dim, local = list(layout.logical), layout.dim, layout.local_logical(tp)
    ranks = {}
    for index in range(tp):
        pieces, start, placed = [], 0, 0
        for size in layout.sizes:
            width = size // tp
            pieces.append({"shape": [width if i == dim else n for i, n in enumerate(whole)],
                           "source": [(start + index * width) * _strides(whole)[dim], _strides(whole)],
                           "dest": [placed * _strides(local)[dim], _strides(local)], "locations": [index]})
            start, placed = start + size, placed + width
        ranks[index] = {"shard_shape": list(layout.local_shape(tp)), "pieces": pieces}
    return {"logical_shape": list(layout.whole), "ranks": ranks}


def check_save(engine, shared: bool, what: str) -> None:
    if not shared:
        raise CheckpointError(f"{what}: under tensor parallelism each TP rank's first data-parallel rank writes its "
                              "own files into one tag folder; save_dir must be on a filesystem every node shares. "
                              "Point save_dir at a shared filesystem (NFS, Lustre, ...).")


def column_optimizer_state(engine, writer: bool) -> dict | None:
    """This TP rank's whole optimizer state dict on its writer (data-parallel rank 0). ZeRO 1-2 keep 1/dp of it
    on each rank of the data-parallel group: consolidated there first (a collective over that group)."""
    optimizer = engine.optimizer
    if optimizer is None:
        return {"state": {}, "param_groups": []} if writer else None
    if not hasattr(optimizer, "consolidate_state_dict"):
        return optimizer.state_dict() if writer else None
    group = getattr(optimizer, "process_group", None)
    if dist.get_world_size(group) != parallel.data_parallel_size():
        raise CheckpointError(f"the ZeRO optimizer shards over {dist.get_world_size(group)} ranks, not over the "
                              f"{parallel.data_parallel_size()} of the data-parallel group: a crew bug, report it")
    optimizer.consolidate_state_dict(to=0)  # group rank 0: this TP rank's writer
    if not writer:
        return None
    state = optimizer.state_dict()
    optimizer._all_state_dicts = []  # else the whole state stays on this rank after the save
    return state


# -- reading ---------------------------------------------------------------------------------------

def deepspeed_size(folder: Path) -> int:
    """How many TP ranks a DeepSpeed tag was saved by (its mp_rank_<t>_model_states.pt files)."""
    found = [p.name for p in Path(folder).glob("mp_rank_*_model_states.pt")]
    found += [p.name for p in Path(folder).glob("zero_pp_rank_0_mp_rank_*_model_states.pt")]
    return max(len(found), 1)


def deepspeed_dims(model: dict) -> dict[str, int] | None:
    """The split dims a DeepSpeed AutoTP file states (universal_checkpoint_info, engine.py _save_checkpoint):
    row-parallel weights along 1, replicated ones not, every other (column, vocabulary) along 0."""
    info = model.get("universal_checkpoint_info")
    if not isinstance(info, dict):
        return None
    row = [re.compile(p) for p in info.get("parameter_with_row_parallelism_patterns") or []]
    replicated = [re.compile(p) for p in info.get("tp_replicated_parameter_patterns") or []]
    params = set(model["module"]) - set(model.get("buffer_names") or [])
    split = {name: 1 if any(p.match(name) for p in row) else 0 for name in params
             if not any(p.match(name) for p in replicated)}
    return {**split, **_deepspeed_layouts(info, params)}


def _deepspeed_layouts(info: dict, params: set[str]) -> dict[str, dict]:
    """{name: Layout dict} of the sub-parameter weights in a DeepSpeed universal_checkpoint_info; the whole shape
    from its affine map."""
    from crew.runtime.tensor_parallel.subparams import from_deepspeed
    shapes = {pattern: entry["logical_shape"] for pattern, entry in
              ((info.get("affine_map") or {}).get("params") or {}).items()}
    found = {}
    for entry in info.get("parameter_with_sub_params") or []:
        for pattern in entry.get("patterns") or []:
            for name in (n for n in params if re.match(pattern, n)):
                whole = tuple(shapes.get(pattern) or ())
                if not whole:
                    raise CheckpointError(f"universal_checkpoint_info gives '{name}' sub-parameters "
                                          f"({entry.get('shape')}) but no logical_shape in its affine_map")
                found[name] = from_deepspeed(entry["shape"], entry["partition_dim"], whole, name).as_dict()
    return found


def mismatch(folder: Path, saved: int, why: str) -> CheckpointError:
    last = f"..{saved - 1:02d}" if saved > 1 else ""
    return CheckpointError(
        f"{folder} was saved with tensor parallel size {saved} (mp_rank_00{last} files) and this run has "
        f"tensor_parallel.autotp_size {size()}{why}. Load it with autotp_size {saved}, or take its whole weights "
        f"(`crew export {folder} model.pt`) into the model before deepspeed.initialize.")


def join(parts: list[dict], split: dict[str, int | dict]) -> dict:
    """Each TP rank's {name: tensor} -> whole tensors: a sharded one concatenated along its dim (or joined by its
    Layout), the others from TP rank 0."""
    return {name: _joined([part[name] for part in parts], split[name]) if name in split else value
            for name, value in parts[0].items()}


def _joined(tensors: list[torch.Tensor], how: int | dict) -> torch.Tensor:
    if isinstance(how, dict):
        from crew.runtime.tensor_parallel.subparams import Layout
        return Layout.from_dict(how).join(tensors)
    return torch.cat(tensors, dim=how)


def join_optimizer(parts: list[dict], modules: list[dict], split: dict[str, int]) -> dict:
    """Each TP rank's optimizer state by name -> whole: a per-element tensor (the shape of its parameter's slice in
    `modules`, that rank's module state) joined as the parameter, scalars (step) from TP rank 0."""
    def per_element(name, value):
        return name in split and isinstance(value, torch.Tensor) and value.shape == modules[0][name].shape

    return {name: {key: _joined([part[name][key] for part in parts], split[name])
                   if per_element(name, value) else value for key, value in entry.items()}
            for name, entry in parts[0].items()}


def cut(whole: dict, module: torch.nn.Module, optimizer: bool = False) -> dict:
    """This rank's slices of whole tensors by name (module state, or with `optimizer` its state by name)."""
    from crew.runtime.tensor_parallel import local_slice
    params = dict(module.named_parameters())

    def mine(name, value):
        dim = getattr(params.get(name), TP_DIM, None)
        if dim is None or not isinstance(value, torch.Tensor) or value.dim() <= dim:
            return value
        layout = _layout(params[name])
        if layout is not None:
            return local_slice(value, params[name]) if tuple(value.shape) == layout.whole else value
        if value.shape[dim] != params[name].shape[dim] * size():
            return value  # not the parameter's shape (a scalar's twin): as saved
        return local_slice(value, params[name])

    if optimizer:
        return {name: {key: mine(name, value) for key, value in entry.items()} for name, entry in whole.items()}
    return {name: mine(name, value) for name, value in whole.items()}


# -- whole weights ---------------------------------------------------------------------------------

def whole_state(engine, dtype: torch.dtype, exclude_frozen: bool = False) -> dict | None:
    """The module's state dict with every sharded parameter gathered whole over its TP group, floating-point
    values in `dtype`, on rank 0's CPU (None elsewhere); every rank must call it."""
    from crew.runtime.tensor_parallel import gather_full

    keep = dist.get_rank() == 0
    state = {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if exclude_frozen and isinstance(value, torch.nn.Parameter) and not value.requires_grad:
            continue
        whole = gather_full(value)  # ZeRO 3: over the data-parallel mesh too
        if keep:
            state[name] = (whole.to(dtype) if whole.is_floating_point() else whole).cpu().clone()
    return state if keep else None


def read_tags(engine, folder: Path, saved: int, split: dict[str, int] | None, states_of, open_tag) -> tuple:
    """(the first mp rank's tag, module state, optimizer state) for this rank, where `open_tag(folder, mp,
    tensor_parallel=)` opens one mp rank's files (deepspeed_format's _Tag) and `states_of(tag)` gives its (module
    state by name, optimizer {"state": by name, ...} or None). At the saved TP size: this rank's own files; at
    another: every mp rank's, joined along `split`, this rank's cut."""
    if saved == size():
        tag = open_tag(folder, rank(), tensor_parallel=saved > 1)
        return (tag, *states_of(tag))
    if saved > 1 and split is None:
        raise mismatch(folder, saved, ", and the checkpoint does not say which weights are split along which dim")
    tags = [open_tag(folder, mp, tensor_parallel=True) for mp in range(saved)]
    parts = [states_of(tag) for tag in tags]
    modules = [module for module, _ in parts]
    module = cut(join(modules, split or {}), engine.module)
    optimizer = parts[0][1]
    if optimizer is not None:
        state = join_optimizer([part[1]["state"] for part in parts], modules, split or {})
        optimizer = {**optimizer, "state": cut(state, engine.module, optimizer=True)}
    return tags[0], module, optimizer
