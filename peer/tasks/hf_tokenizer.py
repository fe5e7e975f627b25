"""hf-causal-lm's tokenizer: a local tokenizer.json or directory, or one token per byte; and its fit to the model.

The byte-level fallback is a real `tokenizers` tokenizer (a byte-level BPE with no merges, whose id of a byte is
its value), so that `peer export` writes tokenizer files that AutoTokenizer loads, and what it encodes is what
training read. Nothing here reads the network: a directory is loaded `local_files_only`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from peer.task_names import TaskLoadError
from peer.task_options import PATH_WANTED, missing_path_problem

BYTE_LEVEL_NAME = "byte-level (no --tokenizer)"

MAX_UNUSED_IDS = 1024
"""How many more ids the model's vocabulary may have than the tokenizer: models pad it to a round size (Qwen2
by 271 ids); more than this is a tokenizer that does not belong to the model."""


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in for every byte value, which the byte-level pre-tokenizer maps bytes to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [byte for byte in range(256) if byte not in printable]
    codes = {byte: chr(byte) for byte in printable}
    codes.update({byte: chr(256 + index) for index, byte in enumerate(shifted)})
    return codes


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """256 ids, the id of a byte is its value; no special tokens."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def load_tokenizer(path: Optional[Path]) -> PreTrainedTokenizerBase:
    """The tokenizer --tokenizer names, or the byte-level one.

    :raises TaskLoadError: a missing path, or one that holds no tokenizer transformers reads; one line
    """
    if path is None:
        return byte_level_tokenizer()
    where = f"--tokenizer {path}"
    if not path.exists():
        raise TaskLoadError(f"{where}: {missing_path_problem(str(path), PATH_WANTED['tokenizer'])}")
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        raise TaskLoadError(f"{where}: the directory holds no tokenizer.json (only fast tokenizers are read); "
                            f"pass a directory written by a fast tokenizer's save_pretrained")
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    except Exception as e:  # tokenizers raises its own Exception types for a malformed file
        reason = " ".join(str(e).split())[:300]
        raise TaskLoadError(f"{where}: not a tokenizer transformers reads ({type(e).__name__}: {reason}); pass "
                            f"a tokenizer.json or a directory written by save_pretrained") from e


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, vocab_size: int,
                     model_name: str) -> None:
    """The model must have an embedding for every id the tokenizer produces, and not many more.

    :raises TaskLoadError: one line naming both sizes
    """
    size = len(tokenizer)
    if size <= vocab_size <= size + MAX_UNUSED_IDS:
        return
    problem = "fewer" if vocab_size < size else f"more than {MAX_UNUSED_IDS} more"
    raise TaskLoadError(f"--tokenizer {tokenizer_name} has {size} tokens but --model-config {model_name} has "
                        f"vocab_size {vocab_size} ({problem} ids than the tokenizer produces); pass the tokenizer "
                        f"the model was made for, or a --model-config with vocab_size {size}")


def encode(tokenizer: PreTrainedTokenizerBase, texts: List[str]) -> List[List[int]]:
    """Token ids of each text, with no special tokens, followed by a separator: documents are packed end to end.
    The separator is the end-of-text token where the tokenizer has one, else a blank line (what splits the
    paragraphs of a text file)."""
    # the Rust tokenizer itself: no warning about texts longer than model_max_length, which packing cuts anyway
    backend = tokenizer.backend_tokenizer
    end = tokenizer.eos_token_id
    separator = [end] if end is not None else backend.encode("\n\n", add_special_tokens=False).ids
    return [item.ids + separator for item in backend.encode_batch(texts, add_special_tokens=False)]


def describe_tokenizer(path: Optional[Path]) -> str:
    return BYTE_LEVEL_NAME if path is None else os.fspath(path)
