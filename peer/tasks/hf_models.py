"""hf-causal-lm's model: a `transformers` causal LM built from a configuration, and the digest of that configuration.

The configuration is a built-in size, a local config.json, or a local save_pretrained directory; never a Hub
name (peer/task_options.py refuses those before this module is imported, and every `from_pretrained` here is
`local_files_only`). Weights come from the torch RNG, which the peer seeds from the run id before it calls
build_model, so that every peer starts equal; or from a local save_pretrained directory (--init-from).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from peer.task_names import TaskLoadError
from peer.task_options import DEFAULT_MODEL_CONFIG, MODEL_CONFIG_WANTED, PATH_WANTED, missing_path_problem

_BYTE_LEVEL = dict(vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""The built-in sizes read the byte-level tokenizer's 256 ids, and have no special tokens among them."""

NAMED_CONFIGS = {
    # 1.07M parameters: a step of batch 16 x 256 tokens takes well under a second on a CPU core.
    "llama-1m": dict(_BYTE_LEVEL, hidden_size=128, intermediate_size=352, num_hidden_layers=5,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024),
    # 19.5M parameters: small enough for CPU volunteers, large enough that a GPU is busy.
    "llama-20m": dict(_BYTE_LEVEL, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024),
}

_NOT_THE_MODEL = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "use_cache")
"""Keys of a configuration that say how it was saved or run, not what the model is: a config.json written by
save_pretrained and the same configuration built in memory must have one digest."""


def model_config_name(spec: Optional[str], init_from: Optional[Path]) -> str:
    """What --model-config names, as log lines and errors show it (the --init-from directory when only it is
    given)."""
    if spec is not None:
        return spec
    return str(init_from) if init_from is not None else DEFAULT_MODEL_CONFIG


def load_model_config(spec: Optional[str], init_from: Optional[Path] = None) -> PretrainedConfig:
    """The configuration --model-config names; with --init-from alone, that directory's.

    :raises TaskLoadError: a missing path, a Hub name, a file that is no model configuration, or a configuration
        that --init-from's weights do not match; one line naming the flag
    """
    if spec is None and init_from is not None:
        return _read_config("--init-from", str(init_from))
    spec = spec or DEFAULT_MODEL_CONFIG
    config = LlamaConfig(**NAMED_CONFIGS[spec]) if spec in NAMED_CONFIGS else _read_config("--model-config", spec)
    if init_from is not None:
        theirs = _read_config("--init-from", str(init_from))
        if config_digest(theirs) != config_digest(config):
            raise TaskLoadError(f"--init-from {init_from}: its configuration differs from --model-config {spec}'s "
                                f"(digest {config_digest(theirs)} there, {config_digest(config)} here); drop "
                                f"--model-config to train the directory's model, or pass its config.json")
    return config


def _read_config(flag: str, path: str) -> PretrainedConfig:
    if not os.path.exists(path):
        wanted = MODEL_CONFIG_WANTED if flag == "--model-config" else PATH_WANTED["init_from"]
        raise TaskLoadError(f"{flag} {path}: {missing_path_problem(path, wanted)}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise TaskLoadError(f"{flag} {path}: the directory holds no config.json; pass a directory written by "
                            f"save_pretrained, or the config.json itself")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())[:300]
        raise TaskLoadError(f"{flag} {path}: not a model configuration transformers reads ({type(e).__name__}: "
                            f"{reason}); pass a config.json written by save_pretrained") from e


def config_digest(config: PretrainedConfig) -> str:
    """A digest of what the configuration says about the model: equal models, equal digests, on every peer."""
    described = {key: value for key, value in config.to_dict().items() if key not in _NOT_THE_MODEL}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


SEEDED = "seeded"
"""The starting point of a model initialized from the run's seed, as the manifest names it."""
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def starting_point_digest(init_from: Optional[Path]) -> str:
    """What the model starts from, the same on every peer that starts alike: SEEDED, or a digest of the weight
    files of --init-from (peers that start from copies of one directory agree, and a peer that started from
    other weights would be averaged with them)."""
    if init_from is None:
        return SEEDED
    digest = hashlib.sha256()
    for path in sorted(path for path in Path(init_from).iterdir() if path.suffix in WEIGHT_SUFFIXES):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def check_causal_lm(config: PretrainedConfig, name: str) -> None:
    """:raises TaskLoadError: transformers has no causal LM for this configuration (a BERT config, say)"""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TaskLoadError(f"--model-config {name}: transformers has no causal language model for model_type "
                            f"{config.model_type!r}; pass the configuration of a decoder such as Llama, GPT-2 or "
                            f"Qwen")


def build_model(config: PretrainedConfig, init_from: Optional[Path] = None) -> torch.nn.Module:
    """A fresh fp32 model on the CPU: initialized from the torch RNG (seeded by the peer), or --init-from's
    weights."""
    if init_from is not None:
        return AutoModelForCausalLM.from_pretrained(init_from, local_files_only=True, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
