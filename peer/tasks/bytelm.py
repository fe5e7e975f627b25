"""The default built-in task: a byte-level causal transformer trained on the stdlib's sources.

Every Python installation carries several megabytes of real text in its standard library,
so this task needs no download and no data directory: a volunteer can join a run with
nothing but the package installed. The corpus is read from `sysconfig`'s stdlib path and
held in memory; nothing is cached on disk and nothing is fetched.

Peers on different Python versions read slightly different sources. That only makes the
data heterogeneous across peers; the model, and thus what is averaged, is the same.

This module must stay cheap: building the corpus reads a few megabytes (well under two
seconds), and the datasets hold one uint8 array each so that DataLoader workers, forked or
spawned, receive them quickly.
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Iterable, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from peer.tasks.base import Task

VOCAB_SIZE = 256
"""One token per byte value: no tokenizer to ship or keep in sync between peers."""

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Third-party code differs between machines, and the test suites are huge and repetitive."""

VAL_FRACTION = 0.05
"""Share of the byte budget given to held-out files."""

MAX_FILE_BYTES = 32 * 1024
"""Longer files are truncated so that a few large modules do not fill the whole budget."""

MAX_VAL_WINDOWS = 256
"""Validation is run often; a few hundred windows give a stable loss at low cost."""


@dataclass(frozen=True, kw_only=True)
class BytelmSize:
    """Shape and training settings of one size of the task."""

    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Number of pre-LN transformer blocks."""
    n_heads: int
    """Attention heads per block; must divide d_model."""
    context: int
    """Tokens (bytes) per training window."""
    corpus_bytes: int
    """Total bytes read from the stdlib, train and validation together."""
    batch_size: int
    """Default samples per local step."""
    learning_rate: float
    """Peak AdamW learning rate, reached after the warmup."""
    weight_decay: float
    """AdamW decoupled weight decay."""
    warmup_epochs: int
    """Global epochs of linear learning-rate warmup."""


SIZES = {
    # Sized for CPU volunteers: about 0.8M parameters, a step of batch 32 takes well under a second.
    "small": BytelmSize(
        d_model=128, n_layers=4, n_heads=4, context=128, corpus_bytes=4 * 1024 * 1024,
        batch_size=32, learning_rate=2e-3, weight_decay=0.05, warmup_epochs=10,
    ),
    # Sized for tests: trains visibly within a few dozen steps on two CPU cores.
    "tiny": BytelmSize(
        d_model=48, n_layers=2, n_heads=4, context=64, corpus_bytes=1024 * 1024,
        batch_size=16, learning_rate=5e-3, weight_decay=0.05, warmup_epochs=2,
    ),
}


# ---------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class ByteCorpus:
    """The stdlib sources split by file into a training and a held-out part."""

    train: np.ndarray
    """Concatenated training files, uint8, read-only."""
    val: np.ndarray
    """Concatenated validation files, uint8, read-only; no file appears in both parts."""
    train_files: Tuple[str, ...]
    """Relative paths of the training files, in corpus order."""
    val_files: Tuple[str, ...]
    """Relative paths of the validation files, in corpus order."""


def stdlib_root() -> str:
    """The directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def source_paths(root: str) -> list:
    """Relative paths of the stdlib's .py files, sorted, so every peer reads them in one order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for filename in filenames:
            if filename.endswith(".py"):
                found.append(os.path.normpath(os.path.join(rel_dir, filename)).replace(os.sep, "/"))
    return sorted(found)


def is_validation_file(rel_path: str) -> bool:
    """Whether a file is held out. A hash of the path, not `hash()`, which is salted per process."""
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 10_000 < VAL_FRACTION * 10_000


def build_corpus(corpus_bytes: int, root: Optional[str] = None) -> ByteCorpus:
    """Read up to `corpus_bytes` of stdlib sources, split by file into train and validation.

    Files are visited in sorted order; each goes to the split its path hashes to, until that
    split's share of the budget is full. The result depends only on the stdlib's contents.
    """
    root = stdlib_root() if root is None else root
    budgets = {"val": max(1, int(corpus_bytes * VAL_FRACTION))}
    budgets["train"] = corpus_bytes - budgets["val"]
    chunks = {"train": [], "val": []}
    files = {"train": [], "val": []}
    used = {"train": 0, "val": 0}
    for rel_path in source_paths(root):
        split = "val" if is_validation_file(rel_path) else "train"
        room = budgets[split] - used[split]
        if room <= 0:
            if all(used[s] >= budgets[s] for s in budgets):
                break
            continue
        try:
            with open(os.path.join(root, rel_path), "rb") as f:
                data = f.read(min(room, MAX_FILE_BYTES))
        except OSError:
            continue  # unreadable files (permissions, broken links) are simply not part of the corpus
        if not data:
            continue
        chunks[split].append(data)
        files[split].append(rel_path)
        used[split] += len(data)
    arrays = {}
    for split in ("train", "val"):
        array = np.frombuffer(b"".join(chunks[split]), dtype=np.uint8).copy()
        array.flags.writeable = False
        arrays[split] = array
    return ByteCorpus(
        train=arrays["train"], val=arrays["val"],
        train_files=tuple(files["train"]), val_files=tuple(files["val"]),
    )


@lru_cache(maxsize=2)
def _cached_corpus(corpus_bytes: int) -> ByteCorpus:
    """The train and validation factories share one read of the stdlib (in memory only)."""
    return build_corpus(corpus_bytes)


# -------------------------------------------------------------------------------------- datasets


class ByteWindows(Dataset):
    """Fixed windows of a byte array: item i is (x, y) at offset i * stride, y = x shifted by one.

    The offsets are a pure function of the index, so every peer and every worker agrees on
    what sample i is. The array is the only state, which keeps pickling cheap.
    """

    def __init__(self, data: np.ndarray, context: int, stride: int, max_windows: Optional[int] = None):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ValueError(f"ByteWindows: data must be a 1-D uint8 array (got {data.dtype}, ndim={data.ndim})")
        if context < 1 or stride < 1:
            raise ValueError(f"ByteWindows: context and stride must be >= 1 (got {context}, {stride})")
        if len(data) < context + 1:
            raise ValueError(
                f"ByteWindows: corpus of {len(data)} bytes is shorter than one window of {context + 1}; "
                f"the stdlib at {stdlib_root()!r} may be incomplete"
            )
        self.data = data
        self.context = context
        self.stride = stride
        count = (len(data) - context - 1) // stride + 1
        self.length = count if max_windows is None else min(count, max_windows)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"window {index} out of range for {self.length} windows")
        start = index * self.stride
        window = torch.from_numpy(self.data[start : start + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]


def _train_dataset(size: BytelmSize) -> ByteWindows:
    return ByteWindows(_cached_corpus(size.corpus_bytes).train, size.context, stride=size.context)


def _val_dataset(size: BytelmSize) -> ByteWindows:
    data = _cached_corpus(size.corpus_bytes).val
    # Spread the fixed windows over the whole held-out text rather than its first files.
    span = max(0, len(data) - size.context - 1)
    stride = max(size.context, span // (MAX_VAL_WINDOWS - 1)) if span else size.context
    return ByteWindows(data, size.context, stride=stride, max_windows=MAX_VAL_WINDOWS)


# ----------------------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-LN: normalising before each sublayer keeps small models stable at high learning rates."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteTransformer(nn.Module):
    """A GPT-style byte model; the output head is tied to the token embedding."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, context: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"ByteTransformer: n_heads ({n_heads}) must divide d_model ({d_model})")
        self.context = context
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # Residual projections start small so that the untrained network is close to identity.
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, length, 256) for int64 tokens of shape (batch, length)."""
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"ByteTransformer: sequence of {length} tokens exceeds the context of {self.context}")
        positions = torch.arange(length, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _build_model(size: BytelmSize) -> ByteTransformer:
    return ByteTransformer(size.d_model, size.n_layers, size.n_heads, size.context)


# ------------------------------------------------------------------------------ loss, optimizer


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean next-byte cross entropy over every position of every window."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))


def _build_optimizer(params: Iterable, size: BytelmSize) -> torch.optim.Optimizer:
    # `params` is passed through untouched: hivemind hands over its own parameter groups and
    # requires the optimizer to keep exactly that grouping, so no decay/no-decay split here.
    return torch.optim.AdamW(params, lr=size.learning_rate, weight_decay=size.weight_decay, betas=(0.9, 0.95))


def _warmup_factor(epoch: int, warmup_epochs: int) -> float:
    return min(1.0, (epoch + 1) / warmup_epochs) if warmup_epochs > 0 else 1.0


def _build_scheduler(optimizer: torch.optim.Optimizer, size: BytelmSize) -> torch.optim.lr_scheduler.LRScheduler:
    # A partial, not a lambda, so that the task stays picklable.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_warmup_factor, warmup_epochs=size.warmup_epochs))


def make_bytelm_task(size: str) -> Task:
    """The byte-level LM task at `size` ("small" or "tiny")."""
    if size not in SIZES:
        raise ValueError(f"bytelm: unknown size {size!r}; choose one of {', '.join(sorted(SIZES))}")
    return bytelm_task("bytelm" if size == "small" else f"bytelm-{size}", SIZES[size])


def bytelm_task(name: str, settings: BytelmSize) -> Task:
    """The byte-level LM task with any shape (the benchmarks size it for a GPU)."""
    return Task(
        name=name,
        build_model=partial(_build_model, settings),
        build_train_dataset=partial(_train_dataset, settings),
        build_val_dataset=partial(_val_dataset, settings),
        loss_fn=lm_loss,
        build_optimizer=partial(_build_optimizer, size=settings),
        build_scheduler=partial(_build_scheduler, size=settings),
        batch_size=settings.batch_size,
    )
