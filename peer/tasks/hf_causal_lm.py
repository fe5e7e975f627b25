"""The built-in task hf-causal-lm: a `transformers` causal language model trained on local text.

The model comes from a configuration (peer/tasks/hf_models.py), the tokenizer from a local file or one token
per byte (peer/tasks/hf_tokenizer.py), the data from local files read through `datasets`, split by a hash of
each document and packed into sequences of --seq-len tokens (peer/tasks/hf_text.py). Building the task reads
the configuration and the tokenizer and checks that they fit; the data is read when the peer builds the
datasets, so that `peer export` rebuilds the task of a checkpoint without it. `export_model` writes what
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.

This module imports `transformers`; peer/tasks/registry.py imports it only for this task, and turns its
absence into one line that names the extra to install. Nothing here downloads anything.
"""
from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Iterable, Optional

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from peer.task_names import TaskLoadError
from peer.task_options import DATA_NEEDED, DEFAULT_SEQ_LEN, HF_CAUSAL_LM, TaskOptions, data_files, data_kind
from peer.tasks.base import Task
from peer.tasks.hf_models import (
    build_model,
    check_causal_lm,
    config_digest,
    load_model_config,
    model_config_name,
    starting_point_digest,
)
from peer.tasks.hf_text import (
    MAX_VAL_SEQUENCES,
    VAL_FRACTION,
    PackedSequences,
    TokenSplits,
    read_documents,
    tokenize_splits,
)
from peer.tasks.hf_tokenizer import check_vocabulary, describe_tokenizer, encode, load_tokenizer

BATCH_SIZE = 16
"""Default sequences per local step."""
LEARNING_RATE_TIMES_WIDTH = 0.5
"""Peak AdamW learning rate x hidden_size: narrower models take larger steps (llama-1m: 3.9e-3, llama-20m:
1e-3), as width-scaled (muP-style) recipes do."""
MAX_LEARNING_RATE = 5e-3
DEFAULT_LEARNING_RATE = 1e-3
"""For a configuration that names no hidden_size."""
WEIGHT_DECAY = 0.1
WARMUP_EPOCHS = 2
"""Global epochs of linear warmup: Adam's first steps, with its moments still empty, are the least steady."""


class CausalLMText:
    """The parts of one hf-causal-lm task: its configuration, tokenizer and data, read once and shared by the
    task's factories (which must stay picklable: bound methods of this object are)."""

    def __init__(self, options: TaskOptions, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 seq_len: int):
        self.options, self.config, self.tokenizer, self.seq_len = options, config, tokenizer, seq_len
        self._splits: Optional[TokenSplits] = None

    def build_model(self) -> torch.nn.Module:
        return build_model(self.config, self.options.init_from)

    def train_dataset(self) -> PackedSequences:
        return PackedSequences(self.splits().train, self.seq_len)

    def val_dataset(self) -> PackedSequences:
        splits = self.splits()
        if len(splits.val) < self.seq_len:
            raise ValueError(f"--data {self.options.data}: the {splits.val_documents} document(s) held out for "
                             f"validation (one in {round(1 / VAL_FRACTION)}, chosen by a hash of their text) hold "
                             f"{len(splits.val)} tokens, fewer than one sequence of --seq-len {self.seq_len}; give "
                             f"more documents (paragraphs of a text file are documents) or lower --seq-len")
        return PackedSequences(splits.val, self.seq_len, max_sequences=MAX_VAL_SEQUENCES)

    def splits(self) -> TokenSplits:
        """Both splits, tokenized on first use."""
        if self._splits is None:
            if self.options.data is None:
                raise ValueError(DATA_NEEDED)
            try:
                files = data_files(self.options.data)
                kind = data_kind(files)
            except ValueError as e:
                raise ValueError(f"--data {self.options.data}: {e}") from None
            self._splits = tokenize_splits(read_documents(files, kind), partial(encode, self.tokenizer),
                                           len(self.tokenizer))
        return self._splits

    def export(self, model: torch.nn.Module, directory: Path) -> None:
        """Write the model (config.json, model.safetensors) and the tokenizer's files into `directory`."""
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def causal_lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; the model shifts the labels itself."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def learning_rate(config: PretrainedConfig) -> float:
    width = getattr(config, "hidden_size", None)
    return min(MAX_LEARNING_RATE, LEARNING_RATE_TIMES_WIDTH / width) if width else DEFAULT_LEARNING_RATE


def _build_optimizer(params: Iterable, lr: float) -> torch.optim.Optimizer:
    # `params` is passed through untouched: hivemind hands over its own parameter groups and requires the
    # optimizer to keep exactly that grouping
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))


def _warmup_factor(epoch: int) -> float:
    return min(1.0, (epoch + 1) / WARMUP_EPOCHS)


def _build_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_factor)


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what the tokenizer maps text to: peers with equal vocabulary sizes but other tokenizers would
    train one embedding on different meanings."""
    described = f"{tokenizer.backend_tokenizer.to_str()}\n{tokenizer.eos_token_id}"
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def make_hf_causal_lm_task(options: TaskOptions) -> Task:
    """The hf-causal-lm task built from `options` (peer/task_options.py).

    :raises TaskLoadError: the configuration, the tokenizer or --seq-len do not do; one line naming the flag
    """
    transformers.utils.logging.disable_progress_bar()  # a peer's output is log lines: no bars for loads and saves
    model_name = model_config_name(options.model, options.init_from)
    config = load_model_config(options.model, options.init_from)
    check_causal_lm(config, model_name)
    tokenizer = load_tokenizer(options.tokenizer)
    check_vocabulary(tokenizer, describe_tokenizer(options.tokenizer), config.vocab_size, model_name)
    longest = getattr(config, "max_position_embeddings", None)
    seq_len = options.seq_len or min(DEFAULT_SEQ_LEN, longest or DEFAULT_SEQ_LEN)
    if longest is not None and seq_len > longest:
        raise TaskLoadError(f"--seq-len {seq_len} is longer than --model-config {model_name} allows "
                            f"(max_position_embeddings {longest}); lower --seq-len to at most {longest}")
    text = CausalLMText(options, config, tokenizer, seq_len)
    return Task(
        name=HF_CAUSAL_LM,
        build_model=text.build_model,
        build_train_dataset=text.train_dataset,
        build_val_dataset=text.val_dataset,
        loss_fn=causal_lm_loss,
        build_optimizer=partial(_build_optimizer, lr=learning_rate(config)),
        build_scheduler=_build_scheduler,
        batch_size=BATCH_SIZE,
        export_model=text.export,
        shared_digests={"model_config": config_digest(config), "tokenizer": tokenizer_digest(tokenizer),
                        "init_from": starting_point_digest(options.init_from)},
    )

