# Written for crew's tests in the shape of DeepSpeedExamples training/HelloDeepSpeed/train_bert_ds.py (the
# DeepSpeed version of the tutorial's train_bert.py): its `import deepspeed` and
# `from deepspeed.accelerator import get_accelerator`, its own rank-filtered log_dist, the masking and
# collate functions, the map-style dataset in an InfiniteIterator, create_model, the experiment directory
# with hparams.json and tb_dir, the ds_config dict given to deepspeed.initialize(model=, model_parameters=,
# config=), load_checkpoint(load_dir=) returning client_state['checkpoint_step'], the training loop with
# model(**batch) / backward / step, and save_checkpoint(save_dir=, client_state=) every checkpoint_every
# steps and at the end. Not copied from it. Changed only what cannot run offline, in a test's time, or
# with this venv's packages:
# - data: synthetic text records in place of the wikitext-2 download, and a word-level tokenizer with
#   RoBERTa's special ids (bos 0, pad 1, eos 2) in place of the HF roberta-base tokenizer. A record is
#   20-30 words of one "topic" (topics of unequal frequency), so a masked word is learnable in a few
#   steps: first from word frequencies, then from the words around it.
# - model: transformers' RobertaModel/RobertaLMHead are replaced by a small torch model of the same role
#   (word + position embeddings, nn.TransformerEncoderLayer blocks, RoBERTa's LM head: dense, gelu,
#   layer norm, a decoder tied to the word embeddings) with the same forward(src_tokens, attention_mask,
#   tgt_tokens) -> masked-LM loss; a 69-word vocabulary.
# - train()'s defaults: tiny sizes (max_seq_length 32, 2 layers, 2 heads, ff_dim 64, h_dim 32 instead of
#   512, 6, 8, 512, 256) and few steps (num_iterations 40, checkpoint_every 10 instead of 10000, 1000).
# - packages not installed here: `fire.Fire(train)` is a small argparse stand-in making the same
#   --flags from train()'s signature (and printing what train returns, as fire does); loguru is
#   `logging`; `sh.git` is subprocess; tensorboard's SummaryWriter is a stand-in that appends each
#   add_scalar call to tb_dir/scalars.jsonl.
# - the experiment name's clock part is the UTC date instead of US/Pacific time to the second (pytz is not
#   installed; and every rank names the folder from its own clock, so two ranks reading it a second apart
#   would save into different folders: a race in the original).
# - ds_config: an added `zero_stage` argument (default 1, the original's stage) and lr 1e-2 (the
#   original's 1e-4 learns too slowly for a test's few steps). bf16 and offload_optimizer cpu are kept
#   (crew logs offload as a no-op on a CPU-only run).
# - the original's unused torch-only load_model_checkpoint helper is left out.
import argparse
import datetime
import inspect
import json
import logging
import os
import pathlib
import random
import string
import subprocess
import sys
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import deepspeed
import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from deepspeed.accelerator import get_accelerator


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# -- logging ------------------------------------------------------------------------------------------

logging.basicConfig(stream=sys.stderr, format="%(asctime)s | %(levelname)s | %(message)s")
logger = logging.getLogger("train_bert_ds")
logger.setLevel(logging.DEBUG)


def log_dist(message: str, ranks: list[int] = [], level: int = logging.INFO) -> None:  # noqa: B006
    """Log `message` on the listed ranks only."""
    my_rank = int(os.environ.get("RANK", "0"))
    if my_rank in ranks:
        logger.log(level, f"[Rank {my_rank}] {message}")


# -- data set -----------------------------------------------------------------------------------------

TOPICS, WORDS_PER_TOPIC = 16, 4


class WordTokenizer:
    """Stand-in for roberta-base's tokenizer: one id per word, RoBERTa's special ids."""
    bos_token_id, pad_token_id, eos_token_id, unk_token_id, mask_token_id = 0, 1, 2, 3, 4

    def __init__(self) -> None:
        words = [f"t{topic}w{index}" for topic in range(TOPICS) for index in range(WORDS_PER_TOPIC)]
        self.vocab = {word: 5 + position for position, word in enumerate(words)}
        self.vocab_size = 5 + len(words)
        self.all_special_ids = [0, 1, 2, 3, 4]

    def encode(self, text: str, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        ids = [self.vocab.get(word, self.unk_token_id) for word in text.split()]
        if truncation and max_length is not None:
            ids = ids[:max_length]
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids


def synthetic_wikitext(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Records like wikitext's `{"text": ...}`, empty lines and trailing newlines included."""
    rng = random.Random(seed)
    records = []
    for index in range(count):
        if index % 10 == 0:
            records.append({"text": ""})
            continue
        topic = rng.choices(range(TOPICS), weights=[2.0 ** -topic for topic in range(TOPICS)])[0]
        words = [f"t{topic}w{rng.randrange(WORDS_PER_TOPIC)}" for _ in range(rng.randint(20, 30))]
        records.append({"text": " ".join(words) + "\n"})
    return records


def collate_function(batch: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad the masked token ids and the labels to the batch's longest sequence."""
    longest = max(len(token_ids) for token_ids, _ in batch)
    src_tokens = torch.LongTensor([ids + [pad_token_id] * (longest - len(ids)) for ids, _ in batch])
    tgt_tokens = torch.LongTensor([labels + [pad_token_id] * (longest - len(labels)) for _, labels in batch])
    attention_mask = src_tokens.ne(pad_token_id).type_as(src_tokens)
    return {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens, "attention_mask": attention_mask}


def masking_function(text: str, tokenizer: WordTokenizer, mask_prob: float, random_replace_prob: float,
                     unmask_replace_prob: float, max_length: int) -> tuple[list[int], list[int]]:
    """BERT's masking: mask a fraction of the words (never bos/eos); of those, some become a random word
    and some stay as they were. Labels hold the masked words and pad everywhere else."""
    token_ids = np.array([tokenizer.bos_token_id]
                         + tokenizer.encode(text, add_special_tokens=False, truncation=True,
                                            max_length=max_length - 2)
                         + [tokenizer.eos_token_id])
    inner = np.arange(1, len(token_ids) - 1)
    count = max(int(mask_prob * len(inner) + np.random.rand()), 1)
    masked = np.zeros(len(token_ids), dtype=bool)
    masked[np.random.choice(inner, count, replace=False)] = True
    labels = np.full(len(token_ids), tokenizer.pad_token_id)
    labels[masked] = token_ids[masked]
    token_ids[masked] = tokenizer.mask_token_id
    either = random_replace_prob + unmask_replace_prob
    if either > 0:
        chosen = masked & (np.random.rand(len(token_ids)) < either)
        keep = chosen & (np.random.rand(len(token_ids)) < unmask_replace_prob / either)
        replace = chosen & ~keep
        token_ids[keep] = labels[keep]
        if replace.any():
            weights = np.ones(tokenizer.vocab_size)
            weights[tokenizer.all_special_ids] = 0
            token_ids[replace] = np.random.choice(tokenizer.vocab_size, replace.sum(), p=weights / weights.sum())
    return token_ids.tolist(), labels.tolist()


class WikiTextMLMDataset(Dataset):
    """Map-style data set: each record's text through the masking function."""

    def __init__(self, dataset: list[dict[str, str]],
                 masking_function: Callable[[str], tuple[list[int], list[int]]]) -> None:
        self.dataset = dataset
        self.masking_function = masking_function

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> tuple[list[int], list[int]]:
        return self.masking_function(self.dataset[idx]["text"])


T = TypeVar("T")


class InfiniteIterator:
    """Iterate over `iterable` forever, starting it again when it ends."""

    def __init__(self, iterable: Iterable[T]) -> None:
        self._iterable = iterable
        self._iterator = iter(iterable)

    def __iter__(self):
        return self

    def __next__(self) -> T:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


def create_data_iterator(mask_prob: float, random_replace_prob: float, unmask_replace_prob: float,
                         batch_size: int, max_seq_length: int = 512,
                         tokenizer: str = "roberta-base") -> InfiniteIterator:
    """The shuffled DataLoader of masked examples, wrapped to go on forever."""
    records = [{"text": record["text"].rstrip("\n")} for record in synthetic_wikitext(512) if record["text"] != ""]
    word_tokenizer = WordTokenizer()  # the stand-in, whatever `tokenizer` names
    masking = partial(masking_function, tokenizer=word_tokenizer, mask_prob=mask_prob,
                      random_replace_prob=random_replace_prob, unmask_replace_prob=unmask_replace_prob,
                      max_length=max_seq_length)
    dataset = WikiTextMLMDataset(records, masking)
    collate = partial(collate_function, pad_token_id=word_tokenizer.pad_token_id)
    return InfiniteIterator(DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate))


# -- model --------------------------------------------------------------------------------------------


class RobertaConfig(argparse.Namespace):
    """Stand-in for transformers' RobertaConfig: the keys this model reads."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RobertaConfig":
        return cls(**values)


class RobertaEmbeddings(nn.Module):
    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                            padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.dropout(self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions)))


class RobertaModel(nn.Module):
    """Stand-in for transformers' RobertaModel: embeddings and a stack of torch encoder layers."""

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = RobertaEmbeddings(config)
        layer = nn.TransformerEncoderLayer(config.hidden_size, config.num_attention_heads,
                                           config.intermediate_size, config.hidden_dropout_prob,
                                           activation=config.hidden_act, layer_norm_eps=config.layer_norm_eps,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.num_hidden_layers, enable_nested_tensor=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, return_dict: bool = False):
        hidden = self.encoder(self.embeddings(input_ids), src_key_padding_mask=attention_mask.eq(0))
        return (hidden,)


def init_weights(config: RobertaConfig, module: nn.Module) -> None:
    """RoBERTa's initialisation: normal(0, initializer_range) weights, zero biases, unit layer norms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.data.normal_(mean=0.0, std=config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            module.weight.data[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(1.0)
        module.bias.data.zero_()


class RobertaLMHeadWithMaskedPredict(nn.Module):
    """RoBERTa's LM head (dense, gelu, layer norm, decoder) run on the masked positions only."""

    def __init__(self, config: RobertaConfig, embedding_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features: torch.Tensor, masked_token_indices: torch.Tensor | None = None) -> torch.Tensor:
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return self.decoder(self.layer_norm(nn.functional.gelu(self.dense(features))))


class RobertaMLMModel(nn.Module):
    def __init__(self, config: RobertaConfig, encoder: RobertaModel) -> None:
        super().__init__()
        self.config = config
        self.encoder = encoder
        self.encoder.apply(partial(init_weights, config))
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(partial(init_weights, config))

    def forward(self, src_tokens: torch.Tensor, attention_mask: torch.Tensor,
                tgt_tokens: torch.Tensor) -> torch.Tensor:
        """The masked-LM loss over the positions whose label is not pad."""
        sequence_output, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask,
                                           return_dict=False)
        masked_token_indexes = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        return nn.CrossEntropyLoss(ignore_index=-1)(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers: int, num_heads: int, ff_dim: int, h_dim: int, dropout: float) -> RobertaMLMModel:
    """A BERT-style masked-LM model with these sizes."""
    roberta_config = RobertaConfig.from_dict({
        "attention_probs_dropout_prob": dropout,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "hidden_act": "gelu",
        "hidden_dropout_prob": dropout,
        "hidden_size": h_dim,
        "initializer_range": 0.02,
        "intermediate_size": ff_dim,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 514,
        "model_type": "roberta",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "pad_token_id": 1,
        "type_vocab_size": 1,
        "vocab_size": WordTokenizer().vocab_size,
    })
    return RobertaMLMModel(roberta_config, RobertaModel(roberta_config))


# -- experiment management ----------------------------------------------------------------------------


class SummaryWriter:
    """Stand-in for torch.utils.tensorboard's writer (tensorboard is not installed): JSON lines."""

    def __init__(self, log_dir: pathlib.Path) -> None:
        self.path = pathlib.Path(log_dir) / "scalars.jsonl"

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"tag": tag, "value": float(scalar_value), "step": global_step}) + "\n")


def get_unique_identifier(length: int = 8) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(alphabet[index] for index in np.random.choice(len(alphabet), length))


def create_experiment_dir(checkpoint_dir: pathlib.Path, all_arguments: dict[str, Any]) -> pathlib.Path:
    """checkpoint_dir/bert_pretrain.<date>.<uuid>/ with hparams.json, githash.log, gitdiff.log and tb_dir/
    (rank 0 creates it; every rank returns its path)."""
    today = datetime.datetime.now(datetime.timezone.utc)
    exp_dir = checkpoint_dir / f"bert_pretrain.{today.year}.{today.month}.{today.day}.{get_unique_identifier()}"
    if not is_rank_0():
        return exp_dir
    exp_dir.mkdir(exist_ok=False)
    with (exp_dir / "hparams.json").open("w") as handle:
        json.dump(obj=all_arguments, fp=handle, indent=2)
    for name, command in (("githash.log", ["git", "log", "-1", "--format=%H"]), ("gitdiff.log", ["git", "diff"])):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode == 0:
            (exp_dir / name).write_text(result.stdout)
        else:
            log_dist("Seems like the code is not running from within a git repo, so "
                     f"{name} will not be stored. However, it is strongly advised to use version control.",
                     ranks=[0], level=logging.INFO)
    (exp_dir / "tb_dir").mkdir(exist_ok=False)
    return exp_dir


# -- driver -------------------------------------------------------------------------------------------


def train(
        checkpoint_dir: str = None,
        load_checkpoint_dir: str = None,
        # Dataset Parameters
        mask_prob: float = 0.15,
        random_replace_prob: float = 0.1,
        unmask_replace_prob: float = 0.1,
        max_seq_length: int = 32,
        tokenizer: str = "roberta-base",
        # Model Parameters
        num_layers: int = 2,
        num_heads: int = 2,
        ff_dim: int = 64,
        h_dim: int = 32,
        dropout: float = 0.1,
        # Training Parameters
        batch_size: int = 8,
        num_iterations: int = 40,
        checkpoint_every: int = 10,
        log_every: int = 10,
        local_rank: int = -1,
        zero_stage: int = 1,
) -> pathlib.Path:
    """Train a BERT-style (encoder only) model on the masked-LM task; return the experiment directory."""
    device = (torch.device(get_accelerator().device_name(), local_rank)
              if local_rank > -1 and get_accelerator().is_available() else torch.device("cpu"))
    # experiment directory: a new one, or the one to resume
    if checkpoint_dir is None and load_checkpoint_dir is None:
        log_dist("Need to specify one of checkpoint_dir or load_checkpoint_dir", ranks=[0], level=logging.ERROR)
        return
    if checkpoint_dir is not None and load_checkpoint_dir is not None:
        log_dist("Cannot specify both checkpoint_dir and load_checkpoint_dir", ranks=[0], level=logging.ERROR)
        return
    if checkpoint_dir:
        log_dist("Creating Experiment Directory", ranks=[0], level=logging.INFO)
        checkpoint_dir = pathlib.Path(checkpoint_dir)
        checkpoint_dir.mkdir(exist_ok=True)
        all_arguments = {
            "mask_prob": mask_prob, "random_replace_prob": random_replace_prob,
            "unmask_replace_prob": unmask_replace_prob, "max_seq_length": max_seq_length, "tokenizer": tokenizer,
            "num_layers": num_layers, "num_heads": num_heads, "ff_dim": ff_dim, "h_dim": h_dim, "dropout": dropout,
            "batch_size": batch_size, "num_iterations": num_iterations, "checkpoint_every": checkpoint_every,
        }
        exp_dir = create_experiment_dir(checkpoint_dir, all_arguments)
        log_dist(f"Experiment Directory created at {exp_dir}", ranks=[0], level=logging.INFO)
    else:
        log_dist("Loading from Experiment Directory", ranks=[0], level=logging.INFO)
        load_checkpoint_dir = pathlib.Path(load_checkpoint_dir)
        assert load_checkpoint_dir.exists()
        with (load_checkpoint_dir / "hparams.json").open("r") as handle:
            hparams = json.load(handle)
        mask_prob = hparams.get("mask_prob", mask_prob)
        tokenizer = hparams.get("tokenizer", tokenizer)
        random_replace_prob = hparams.get("random_replace_prob", random_replace_prob)
        unmask_replace_prob = hparams.get("unmask_replace_prob", unmask_replace_prob)
        max_seq_length = hparams.get("max_seq_length", max_seq_length)
        ff_dim = hparams.get("ff_dim", ff_dim)
        h_dim = hparams.get("h_dim", h_dim)
        dropout = hparams.get("dropout", dropout)
        num_layers = hparams.get("num_layers", num_layers)
        num_heads = hparams.get("num_heads", num_heads)
        batch_size = hparams.get("batch_size", batch_size)
        num_iterations = max(num_iterations, hparams.get("num_iterations", num_iterations))
        checkpoint_every = hparams.get("checkpoint_every", checkpoint_every)
        exp_dir = load_checkpoint_dir
    if is_rank_0():
        tb_dir = exp_dir / "tb_dir"
        assert tb_dir.exists()
        summary_writer = SummaryWriter(log_dir=tb_dir)
    # data
    log_dist("Creating Datasets", ranks=[0], level=logging.INFO)
    data_iterator = create_data_iterator(mask_prob=mask_prob, random_replace_prob=random_replace_prob,
                                         unmask_replace_prob=unmask_replace_prob, tokenizer=tokenizer,
                                         max_seq_length=max_seq_length, batch_size=batch_size)
    log_dist("Dataset Creation Done", ranks=[0], level=logging.INFO)
    # model
    log_dist("Creating Model", ranks=[0], level=logging.INFO)
    model = create_model(num_layers=num_layers, num_heads=num_heads, ff_dim=ff_dim, h_dim=h_dim, dropout=dropout)
    log_dist("Model Creation Done", ranks=[0], level=logging.INFO)
    # the DeepSpeed engine
    log_dist("Creating DeepSpeed engine", ranks=[0], level=logging.INFO)
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": zero_stage, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    log_dist("DeepSpeed engine created", ranks=[0], level=logging.INFO)
    # resume
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    # the training loop
    log_dist(f"Total number of model parameters: {sum([p.numel() for p in model.parameters()]):,d}",
             ranks=[0], level=logging.INFO)
    model.train()
    losses = []
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % log_every == 0:
            log_dist(f"Loss: {np.mean(losses):.4f}", ranks=[0], level=logging.INFO)
            if is_rank_0():
                summary_writer.add_scalar("Train/loss", np.mean(losses), step)
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
            log_dist(f"Saved model to {exp_dir}", ranks=[0], level=logging.INFO)
    # the last checkpoint, if not saved yet
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
        log_dist(f"Saved model to {exp_dir}", ranks=[0], level=logging.INFO)
    return exp_dir


def Fire(function: Callable) -> None:  # noqa: N802
    """Stand-in for fire.Fire (not installed): --name value flags from `function`'s signature."""
    parser = argparse.ArgumentParser()
    for name, parameter in inspect.signature(function).parameters.items():
        kind = type(parameter.default) if parameter.default is not None else str
        parser.add_argument(f"--{name}", type=kind, default=parameter.default)
    result = function(**vars(parser.parse_args()))
    if result is not None:
        print(result)


if __name__ == "__main__":
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    Fire(train)
