"""Checkpoints with DeepSpeed's semantics (tag folders, a `latest` file, client_state, every rank
calls), written so that no crash can destroy the last good one.

    save_dir/
      latest                  the newest complete tag; written last, after every rank finished
      <tag>/
        model_states.<i>-of-<k>.pt
                              ZeRO stages 0-2: fp32 module, optimizer (whole, with the parameter
                              names), scheduler, precision, counters, config, version. Stage 0: k
                              byte-balanced parts written in parallel by k ranks (the state is
                              replicated, so each rank serialises and fsyncs only its part); stages
                              1-2: one part, by the rank the optimizer state (and at stage 2 the
                              fp32 masters) are consolidated to
        sharded/              ZeRO stage 3: model and optimizer shards by parameter name, one DCP
                              checkpoint written by all ranks in parallel (sharded.py); earlier crew
                              versions wrote stage 2 this way too
        engine_state.pt       stage 3: all the rest (optimizer param groups, scheduler, ...)
        client_state.pt       the user's client_state
        rank<R>.pt            rank R's RNG states and data loader position
        crew_checkpoint.json  manifest: world size, placement, ZeRO stage, format, version, and
                              "files": the size and crc32 of every other file of the tag (its
                              presence = complete)

A tag is built in `.<tag>.partial-<token>` and renamed into place only when every rank has written
and fsynced its files, so a kill at any moment leaves the previous checkpoint and `latest` intact.
Without a shared filesystem each node's ranks write the node's own copy of the shared files
(stages 0-2; a sharded checkpoint needs a filesystem every node shares). Both formats load on any
world size and at any stage: stage 0-2 engines read a sharded checkpoint whole, stage 3 engines
place a whole one into their shards; the optimizer state moves between them by parameter name.
Loading checks each file it reads against the manifest's size and crc32 (hashed at save from the
bytes as they were written; a checkpoint without "files", from an earlier crew, loads unchecked),
then uses torch.load(weights_only=True). A damaged `latest` or manifest is an error naming it; only a
missing `latest` means "nothing to load", as in DeepSpeed. A save that fails removes its staging
folder on every rank.

    layout.py      the file names, CheckpointError, atomic hashed writes, reading a tag's files
    integrity.py   checking a tag's files against the sizes and checksums in its manifest
    collective.py  a problem on any rank raises the same CheckpointError on every rank
    state.py       the state dicts: fp32 module, parameter names, parts split and merged
    saving.py      save: staging folder, every rank's files, commit, `latest`, keep_last
    loading.py     load: read, check the fit, convert between ZeRO stages, load into the engine
    sharded.py     stage 3: the DCP folder of shards by parameter name
    exporting.py   save_16bit_model and `crew export`: the weights as one state dict file
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
