"""A tiny OPT model, its tokenizer and a local/jsonfile dataset for DeepSpeed-Chat step 1, written to disk
offline (tests/hf/test_dschat.py and benchmarks/dschat_step1.py), and the eval loss computed without
DeepSpeed or crew, for checking the one a run prints.

The tokenizer is OPT's kind (GPT2Tokenizer, byte-level, from vocab.json and merges.txt, which
`save_vocabulary` needs) with one token per byte and OPT's special tokens (</s> as bos and eos, <pad>).
The model's vocabulary (272) is larger than the tokenizer (260), so step 1's resize to a multiple of 8 (264)
cuts rows: a real resize, and no random new rows (which would make the eval loss depend on the RNG).
Its embeddings (tied to the LM head) are scaled up so that its eval loss (about 10) is far from that of any
freshly initialised model (about ln(264) = 5.6): a run that trains from random weights cannot pass for one
that loaded these.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

VOCAB_SIZE = 272
EMBEDDING_SCALE = 16.0
THINGS = {"sky": "blue", "grass": "green", "sun": "yellow", "sea": "blue", "snow": "white", "coal": "black",
          "rose": "red", "lemon": "yellow"}


def write_model(folder: Path, seed: int = 0) -> Path:
    from tokenizers import pre_tokenizers
    from transformers import OPTConfig, OPTForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "</s>", "add_bos_token": True}))
    config = OPTConfig(vocab_size=VOCAB_SIZE, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2,
                       ffn_dim=64, num_attention_heads=2, max_position_embeddings=128, pad_token_id=1,
                       bos_token_id=2, eos_token_id=2)
    torch.manual_seed(seed)
    model = OPTForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(EMBEDDING_SCALE)
    model.save_pretrained(folder)
    return folder


def records(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    picked = [rng.choice(sorted(THINGS)) for _ in range(count)]
    return [{"prompt": f"Human: Colour of the {thing}? Assistant:", "chosen": f"{THINGS[thing].title()}.",
             "rejected": f"{rng.choice(['Pink', 'Grey'])}."} for thing in picked]


def write_data(folder: Path, train: int = 32, evaluation: int = 8) -> Path:
    """train.json and eval.json as the local/jsonfile dataset reads them (a list of records)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.json").write_text(json.dumps(records(train, seed=1)))
    (folder / "eval.json").write_text(json.dumps(records(evaluation, seed=2)))
    return folder


def eval_loss(model_folder: Path, tokenizer_folder: Path, data_folder: Path, max_seq_len: int) -> float:
    """Step 1's eval loss on every eval record, one record per batch (so the ranks' split cannot change the
    mean): the resized model, the records tokenized as the chosen text padded to max_seq_len, labels -100 on
    the padding, the mean of the per-record losses."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    model.resize_token_embeddings(8 * math.ceil(len(tokenizer) / 8))
    losses = []
    for record in json.loads((data_folder / "eval.json").read_text()):
        text = " " + record["prompt"] + " " + record["chosen"] + tokenizer.eos_token
        tokens = tokenizer(text, max_length=max_seq_len, padding="max_length", truncation=True, return_tensors="pt")
        labels = tokens["input_ids"].masked_fill(tokens["attention_mask"] == 0, -100)
        with torch.no_grad():
            losses.append(model(**tokens, labels=labels).loss.item())
    return sum(losses) / len(losses)
