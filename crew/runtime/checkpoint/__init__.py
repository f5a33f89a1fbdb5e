"""Checkpoints with DeepSpeed's semantics and DeepSpeed 0.19.8's files (tag folders, a `latest` file,
client_state, every rank calls), written so that no crash can destroy the last good one: DeepSpeed's
load_checkpoint, its zero_to_fp32.py and ds_to_universal read a crew checkpoint, and crew resumes it exactly.

    save_dir/
      latest                  the newest complete tag; written last, after every rank finished
      <tag>/
        mp_rank_00_model_states.pt
                              stages 0-2, DeepSpeed's keys (deepspeed_writing.py): the module in its
                              training dtype, at stage 0 the optimizer (under bf16 with the fp32 copies),
                              at 1-2 param_shapes, the scheduler, counters, ds_config, client_state's keys
        [bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt
                              stages 1-3, one a rank: its flat, aligned partition of the fp32 weights and
                              of the optimizer state, as DeepSpeed's ZeRO optimizers save it
        zero_pp_rank_<R>_mp_rank_00_model_states.pt
                              stage 3, one a rank (deepspeed_zero3.py): placeholders, shapes, the rest
        crew_state.pt         crew's own beside DeepSpeed's: precision (loss scale), micro steps, the
                              optimizer's groups and each parameter's step as crew has them, parameter
                              names, client_state's keys, config, crew version
        rank<R>.pt            rank R's RNG states and data loader position
        crew_checkpoint.json  manifest: world size, placement, ZeRO stage, format, version, and
                              "files": the size and crc32 of every other file of the tag (its
                              presence = complete)

Stages 0-2 are written by rank 0 (the optimizer state consolidated to it, every rank's optimizer file
cut from it); stage 3 by every rank, its own files. A tag is built in `.<tag>.partial-<token>` and
renamed into place only when every rank has written and fsynced its files, so a kill at any moment
leaves the previous checkpoint and `latest` intact. Without a shared filesystem each node's first rank
writes the node's own copy of every file a load there reads (stages 0-2; stage 3 needs a filesystem every
node shares). crew loads the tag with its DeepSpeed reader (deepspeed_format.py: any world size, any
stage) and then crew_state.pt and rank<R>.pt make the resume exact. Layouts of crew 0.1 still load and are
still written where DeepSpeed's cannot be (an optimizer over tensors outside the model, which it cannot name):
"replicated" (model_states.<i>-of-<k>.pt, client_state.pt) and at stage 3 "sharded" (a DCP folder
sharded/ and engine_state.pt, sharded.py). Loading checks each file it reads against the manifest's size
and crc32 (hashed at save from the bytes as they were written; a checkpoint without "files", from an
earlier crew, loads unchecked), then uses torch.load(weights_only=True). A damaged `latest` or manifest is
an error naming it; only a missing `latest` means "nothing to load", as in DeepSpeed. A save that fails
removes its staging folder on every rank.

    layout.py      the file names, CheckpointError, atomic hashed writes, reading a tag's files
    integrity.py   checking a tag's files against the sizes and checksums in its manifest
    collective.py  a problem on any rank raises the same CheckpointError on every rank
    state.py       the state dicts: fp32 module, parameter names, parts split and merged
    saving.py      save: staging folder, every rank's files, commit, `latest`, keep_last
    deepspeed_writing.py  stages 0-2 as DeepSpeed's files, its pickled classes under its own names
    deepspeed_zero3.py    stage 3 as DeepSpeed's per-rank files
    loading.py     load: read, check the fit, convert between ZeRO stages, load into the engine
    sharded.py     crew 0.1's stage 3: the DCP folder of shards by parameter name
    exporting.py   save_16bit_model and `crew export`: the weights as one state dict file
    tensor_parallel.py    AutoTP: each TP rank's mp_rank_<t> files, loading at another TP size, whole weights
    deepspeed_files.py   a DeepSpeed 0.19 tag's files, read with an allow-list of DeepSpeed's classes
    deepspeed_format.py  a DeepSpeed tag as the state load() loads (weights and optimizer state by
                         name): load_checkpoint and `crew export` read DeepSpeed's checkpoints too
"""

from crew.runtime.checkpoint.exporting import export, save_16bit_model
from crew.runtime.checkpoint.layout import CheckpointError, read_latest
from crew.runtime.checkpoint.loading import load
from crew.runtime.checkpoint.saving import default_tag, save
from crew.runtime.checkpoint.state import fp32_module_state, merge_state, optimizer_param_names, split_state

__all__ = [
    "CheckpointError",
    "default_tag",
    "export",
    "fp32_module_state",
    "load",
    "merge_state",
    "optimizer_param_names",
    "read_latest",
    "save",
    "save_16bit_model",
    "split_state",
]
