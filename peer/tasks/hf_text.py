"""hf-causal-lm's data: local documents read through `datasets`, split by a hash of each one, packed into sequences.

Every peer must agree on what is held out, whatever files it holds and in whatever order it lists them: a
document is held out for validation when a hash of its text says so (VAL_FRACTION of them), so the same text is
held out on every peer, and never trained on anywhere. Documents are a text file's paragraphs (split at blank
lines) or the `text` field of each JSON lines or Parquet record.

The text is tokenized once, when the task's datasets are built, into one array of ids per split; the datasets
hold only that array, so that DataLoader workers, forked or spawned, receive them quickly. Nothing is written
to disk and nothing is fetched: `datasets` streams the local files.
"""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

VAL_FRACTION = 0.05
"""Share of the documents held out for validation."""

MAX_VAL_SEQUENCES = 256
"""Validation runs at every global epoch; a few hundred sequences, spread over the held-out text, are enough."""

ENCODE_BATCH_DOCUMENTS = 1000
"""Documents tokenized per call: the Rust tokenizer works through a batch in parallel."""


class DataError(ValueError):
    """--data cannot be read as documents; the message is one line naming --data."""


def is_validation_document(text: str) -> bool:
    """Whether a document is held out. A hash of its text, not `hash()`, which is salted per process."""
    digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:4], "big") % 10_000 < VAL_FRACTION * 10_000


def read_documents(files: List[str], kind: str) -> Iterator[str]:
    """The documents of `files` in order, read with the `datasets` builder `kind` (text, json or parquet).

    :raises DataError: a file it cannot read, or records without a text field
    """
    import datasets  # imported on use: a second of start-up that only the data needs

    # a file it cannot read is reported below, in one line; datasets would log it first, over several
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    options = {"sample_by": "paragraph"} if kind == "text" else {}
    # streaming: the files are read as they are iterated, and no Arrow copy of them is written; the lock file that
    # datasets still takes goes into a directory removed afterwards (the user's cache would gain one per --data)
    with tempfile.TemporaryDirectory(prefix="swarmtrain-datasets-") as cache_dir:
        yield from _stream(datasets, files, kind, options, cache_dir)


def _stream(datasets, files: List[str], kind: str, options: dict, cache_dir: str) -> Iterator[str]:
    """:param datasets: the module, imported by the caller"""
    try:
        rows = datasets.load_dataset(kind, data_files=files, split="train", streaming=True, cache_dir=cache_dir,
                                     **options)
        for row in rows:
            text = row.get("text")
            if not isinstance(text, str):
                fields = ", ".join(sorted(row)) or "none"
                raise DataError(f"--data: a {kind} record has no 'text' field holding a string (its fields: "
                                 f"{fields}); give records with a 'text' field")
            if text.strip():
                yield text
    except DataError:
        raise
    except Exception as e:  # datasets and pyarrow report a bad file in many exception types, over many lines
        reason = " ".join(str(e).split())[:300]
        raise DataError(f"--data: reading its {len(files)} {kind} file(s) ({files[0]} first) failed "
                        f"({type(e).__name__}: {reason}); check that they are {kind} files") from e


@dataclass(frozen=True)
class TokenSplits:
    """The tokenized documents of both splits, end to end."""

    train: np.ndarray
    """Token ids of the training documents, in reading order; read-only."""
    val: np.ndarray
    """Token ids of the held-out documents, in reading order; read-only."""
    train_documents: int
    val_documents: int


def tokenize_splits(documents: Iterable[str], encode: Callable[[List[str]], List[List[int]]],
                    vocab_size: int) -> TokenSplits:
    """Split `documents` by is_validation_document and tokenize each split into one array.

    :param encode: token ids of each of a list of texts, separator included (hf_tokenizer.encode)
    """
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces = {"train": [], "val": []}
    pending = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}

    def flush(split: str) -> None:
        for ids in encode(pending[split]):
            pieces[split].append(np.asarray(ids, dtype=dtype))
        pending[split].clear()

    for text in documents:
        split = "val" if is_validation_document(text) else "train"
        pending[split].append(text)
        counts[split] += 1
        if len(pending[split]) >= ENCODE_BATCH_DOCUMENTS:
            flush(split)
    arrays = {}
    for split in pending:
        flush(split)
        array = np.concatenate(pieces[split]) if pieces[split] else np.zeros(0, dtype=dtype)
        array.flags.writeable = False
        arrays[split] = array
    return TokenSplits(train=arrays["train"], val=arrays["val"], train_documents=counts["train"],
                       val_documents=counts["val"])


class PackedSequences(Dataset):
    """Consecutive, non-overlapping sequences of `seq_len` ids cut from one array; the tail that fills no sequence
    is dropped. Item i is a pure function of i, so every peer and every worker agrees on it.

    :param max_sequences: keep at most this many, evenly spread over the array (validation)
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, max_sequences: Optional[int] = None):
        if tokens.ndim != 1 or seq_len < 1:
            raise ValueError(f"PackedSequences: needs a 1-D array and seq_len >= 1 (got ndim {tokens.ndim}, "
                             f"seq_len {seq_len})")
        self.tokens = tokens
        self.seq_len = seq_len
        available = len(tokens) // seq_len
        self.length = available if max_sequences is None else min(available, max_sequences)
        self.spacing = available / self.length if self.length else 1.0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.length:
            raise IndexError(f"sequence {index} out of range for {self.length} sequences")
        start = int(index * self.spacing) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len].astype(np.int64))
