"""The settings a built-in task is built from (hf-causal-lm's model, data and tokenizer), checked without torch.

TaskOptions is plain data: every checkpoint records it, so that `peer export` rebuilds the task that wrote the
checkpoint (peer/tasks/options.py re-exports it for the task code). TaskConfig is the same fields as the peer's
`[task]` config section, which also checks, at load, that the local paths they name exist on this machine: a
typo is reported with every other config problem, before torch is imported. This module must not import torch,
transformers or datasets (peer/config.py imports it, and `peer --help` must stay quick).
"""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

HF_CAUSAL_LM = "hf-causal-lm"

BUILTIN_MODEL_CONFIGS = ("llama-1m", "llama-20m")
"""Named model configurations of hf-causal-lm (peer/tasks/hf_models.py defines them)."""
DATA_NEEDED = (f"--task {HF_CAUSAL_LM} needs --data: a local file, directory or glob of text, JSON lines or Parquet "
               f"files to train on")
"""The line that refuses hf-causal-lm without data: at config load, and where a task built in code is read."""
DEFAULT_MODEL_CONFIG = "llama-1m"
DEFAULT_SEQ_LEN = 256

DATA_SUFFIXES: Dict[str, str] = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                                 ".parquet": "parquet"}
"""The files --data reads, by suffix, and the `datasets` builder that reads each kind."""

MODEL_CONFIG_WANTED = (f"the path of a local config.json or save_pretrained directory, or a built-in size "
                       f"({', '.join(BUILTIN_MODEL_CONFIGS)})")
PATH_WANTED = {"init_from": "the path of a local save_pretrained directory",
               "tokenizer": "the path of a local tokenizer.json or a directory holding one"}
"""What each path option names, for the line that refuses a missing one."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class TaskOptions(BaseModel):
    """Options of the built-in tasks: hf-causal-lm takes them all, the bytelm tasks and module:function tasks none.

    None means "not given": the task's own default applies, and a task that takes no options sees none given.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Optional[str] = Field(
        default=None, min_length=1, max_length=4096, json_schema_extra={"cli_name": "model_config"},
        description=f"The {HF_CAUSAL_LM} model: {DEFAULT_MODEL_CONFIG} (default), llama-20m or a config.json. "
                    f"The built-in sizes are Llama configurations for the byte-level tokenizer; a local config.json, "
                    f"or a directory written by save_pretrained, names any causal LM transformers builds. Nothing "
                    f"is downloaded: a Hub name is refused.")
    data: Optional[Path] = Field(
        default=None,
        description=f"Local text to train {HF_CAUSAL_LM} on: a file, directory or glob. Text (.txt, .md; its "
                    f"paragraphs are the documents), JSON lines (.jsonl, .json) or Parquet files (a 'text' field "
                    f"per record). One document in twenty, chosen by a hash of its text, is held out for "
                    f"validation on every peer.")
    tokenizer: Optional[Path] = Field(
        default=None,
        description=f"The {HF_CAUSAL_LM} tokenizer: a local tokenizer.json, or a directory holding one (with its "
                    f"tokenizer_config.json). Default: one token per byte (256 tokens), which the built-in sizes "
                    f"read.")
    seq_len: Optional[int] = Field(
        default=None, ge=2, le=1_048_576,
        description=f"Tokens per {HF_CAUSAL_LM} training sequence: the text is packed end to end into sequences of "
                    f"this length. Default {DEFAULT_SEQ_LEN}, and at most the model's max_position_embeddings.")
    init_from: Optional[Path] = Field(
        default=None,
        description=f"Start {HF_CAUSAL_LM} from the weights of this local save_pretrained directory. Instead of "
                    f"the run's seeded initialization; without --model-config, the directory's configuration is "
                    f"the model's.")

    def given(self) -> List[str]:
        """The fields set, in declaration order."""
        return [name for name in type(self).model_fields if getattr(self, name) is not None]


TASKS_TAKING_OPTIONS: Dict[str, Tuple[str, ...]] = {HF_CAUSAL_LM: tuple(TaskOptions.model_fields)}
"""Which built-in task takes which options; every other task takes none."""


def flag_of(field_name: str) -> str:
    """The command-line flag of a TaskOptions field (--model-config for `model`)."""
    extra = TaskOptions.model_fields[field_name].json_schema_extra or {}
    return "--" + str(extra.get("cli_name", field_name)).replace("_", "-")


def options_not_taken(task_name: str, options: TaskOptions) -> Optional[str]:
    """One line if `options` sets something the task does not take; None when it is fine."""
    stray = [name for name in options.given() if name not in TASKS_TAKING_OPTIONS.get(task_name, ())]
    if not stray:
        return None
    flags = ", ".join(flag_of(name) for name in stray)
    takers = ", ".join(f"--task {name}" for name in TASKS_TAKING_OPTIONS)
    what, it = ("options", "them") if len(stray) > 1 else ("an option", "it")
    return f"{flags}: {what} of {takers}, which --task {task_name} does not take; drop {it}, or use {takers}"


def looks_like_hub_name(value: str) -> bool:
    """'gpt2' or 'meta-llama/Llama-3.2-1B': a name `from_pretrained` would download, not a local path."""
    return bool(_HUB_ID.match(value)) and not value.endswith(".json") and not value.startswith(".")


def missing_path_problem(value: str, wanted: str) -> str:
    """Why a local path that does not exist does not do: a Hub name, or a missing file (the caller names the
    flag)."""
    if looks_like_hub_name(value) and not os.path.isabs(value):
        return (f"not a local path, and this peer never downloads from the Hugging Face Hub; pass {wanted} (where "
                f"the Hub is reachable, save_pretrained writes one)")
    return f"no such file or directory; pass {wanted}"


def data_files(pattern: Path) -> List[str]:
    """The files --data names, sorted so that every peer reads them in one order: the file, the readable files
    under a directory (recursively), or the matches of a glob.

    :raises ValueError: nothing readable is named, in one line saying what it reads (the caller names --data)
    """
    text = str(pattern)
    if os.path.isdir(text):
        candidates = glob.glob(os.path.join(glob.escape(text), "**", "*"), recursive=True)
    elif os.path.isfile(text):
        candidates = [text]
    else:
        candidates = glob.glob(text, recursive=True)
    files = sorted(os.path.abspath(path) for path in candidates
                   if os.path.isfile(path) and os.path.splitext(path)[1].lower() in DATA_SUFFIXES)
    if files:
        return files
    readable = ", ".join(DATA_SUFFIXES)
    if candidates or os.path.exists(text):
        raise ValueError(f"no file of a kind it reads ({readable}); name text, JSON lines or Parquet files")
    raise ValueError(f"no such file or directory, and no file matches it as a glob; pass local files ({readable})")


def data_kind(files: List[str]) -> str:
    """The one `datasets` builder that reads all of `files`.

    :raises ValueError: --data mixes kinds (text with JSON lines, say), which one builder cannot read
    """
    kinds = sorted({DATA_SUFFIXES[os.path.splitext(path)[1].lower()] for path in files})
    if len(kinds) > 1:
        raise ValueError(f"mixes {' and '.join(kinds)} files, which are read differently; give one kind "
                         f"(a narrower directory or glob)")
    return kinds[0]


class TaskConfig(TaskOptions):
    """The `[task]` section of the peer's config: TaskOptions whose local paths exist here, made absolute (a
    checkpoint records them, and `peer export` may run from another directory)."""

    @field_validator("model")
    @classmethod
    def _model_is_builtin_or_local(cls, value: Optional[str]) -> Optional[str]:
        if value is None or value in BUILTIN_MODEL_CONFIGS:
            return value
        if not os.path.exists(value):
            raise ValueError(missing_path_problem(value, MODEL_CONFIG_WANTED))
        return os.path.abspath(value)

    @field_validator("init_from", "tokenizer")
    @classmethod
    def _path_exists(cls, value: Optional[Path], info) -> Optional[Path]:
        if value is None or value.exists():
            return None if value is None else value.absolute()
        raise ValueError(missing_path_problem(str(value), PATH_WANTED[info.field_name]))

    @field_validator("data")
    @classmethod
    def _data_names_files(cls, value: Optional[Path]) -> Optional[Path]:
        if value is None:
            return None
        data_kind(data_files(value))
        return value.absolute()
