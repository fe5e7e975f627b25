"""PeerConfig and the one function that resolves it.

Precedence, lowest first: built-in defaults < the --config file (TOML or YAML) < PEER_*
environment variables < command-line flags. Every problem is collected in one pass and
raised together as a ConfigError, one line per problem, naming the field, where the value
came from, the rule and how to fix it. Components receive their own sub-config and never
read the environment or files themselves.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Tuple, Type

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from averaging.config import AveragingConfig
from dht.config import DHTConfig
from dht.files import InputFileError, read_input_text
from monitoring.config import MonitoringConfig
from peer.active_hours import parse_active_hours
from peer.task_options import DATA_NEEDED, HF_CAUSAL_LM, TaskConfig, options_not_taken

ENV_PREFIX = "PEER_"


class ConfigError(ValueError):
    """Invalid configuration: one line per problem, each naming the field and a fix."""

    def __init__(self, problems: List[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class TrainingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    run_id: str = Field(
        default="swarmtrain",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_-]+$",  # hivemind builds DHT key prefixes from it and forbids "."
        description="Name of the training run; peers with the same run id train together.",
    )
    task: str = Field(default="bytelm", min_length=1, max_length=256,
                      description="Built-in task name or module:function.")
    task_timeout_seconds: float = Field(
        default=300.0, gt=0,
        description="Give up on a --task that takes longer than this to import and build, or to read its first batch.")
    batch_size: Optional[int] = Field(default=None, ge=1, description="Samples per local step (default: the task's).")
    device: str = Field(
        default="auto", description="auto, cpu, cuda or cuda:N (the N-th GPU; checked at start). auto picks cuda "
                                    "when available.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto",
        description="Forward and loss under autocast in bf16 or fp16 (fp16 with a loss scaler); weights, optimizer "
                    "state and averaging stay fp32. auto: bf16 on a GPU that supports it, else fp32. fp16 needs a GPU.")
    max_epochs: Optional[int] = Field(default=None, ge=1, description="Exit 0 once this global epoch is reached.")
    max_seconds: Optional[float] = Field(default=None, gt=0, description="Exit 0 after training this long.")
    data_workers: int = Field(default=2, ge=0, description="DataLoader worker processes for preprocessing.")
    seed: Optional[int] = Field(
        default=None, ge=0, le=2**32 - 1,
        description="Seed for this peer's data order (model init is seeded by run id). Default: the peer's own, from "
                    "its peer ID, kept in its checkpoints, which also keep how far it has read: a restart reads on.")
    val_batches: int = Field(default=8, ge=1, description="Validation batches evaluated at each global epoch.")

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,3})?", value):
            raise ValueError("must be auto, cpu, cuda or cuda:N (N: the index of a GPU, as nvidia-smi lists them)")
        return value


def _not_a_file(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; choose a directory path")
    return path


def _not_a_directory(path: Optional[Path]) -> Optional[Path]:
    if path is not None and path.is_dir():
        raise ValueError(f"{path} is a directory; give a file path such as {path / 'summary.json'}")
    return path


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    checkpoint_dir: Path = Field(default=Path("checkpoints"), description="Directory for this peer's checkpoints.")
    _dir_is_a_directory = field_validator("checkpoint_dir")(_not_a_file)
    checkpoint_every_epochs: int = Field(default=10, ge=1, description="Write a checkpoint every this many epochs.")
    keep_checkpoints: int = Field(default=3, ge=1, description="How many newest checkpoints to keep.")


class LoggingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    log_format: Literal["text", "json"] = Field(default="text", description="Plain text lines or JSON lines.")
    verbose: bool = Field(default=False, description="Debug logs, hivemind's internals and tracebacks.")
    summary_json: Optional[Path] = Field(default=None, description="Write a JSON summary here at exit.")
    _summary_is_a_file = field_validator("summary_json")(_not_a_directory)
    events: Optional[Path] = Field(default=None, description=(
        "Append what this peer does here, one JSON object per line (ready, epoch, round, checkpoint, exit...), "
        "for scripts and tests."))
    _events_is_a_file = field_validator("events")(_not_a_directory)


class VolunteerConfig(BaseModel):
    """When this machine is lent to the swarm (peer/runtime/pausing.py); `peer pause` and `peer resume` besides."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    active_hours: Optional[str] = Field(
        default=None, max_length=512,
        description="Train only in these local hours, such as '22:00-07:00' or 'Mon-Fri 18:00-23:30'. Windows "
                    "[DAY[-DAY]] HH:MM-HH:MM, comma-separated, such as 'Mon-Fri 18:00-23:30, Sat-Sun 00:00-24:00'; "
                    "a window that ends before it starts runs past midnight. Outside them the peer pauses.")
    yield_when_busy: bool = Field(
        default=False,
        description="Pause while the owner's other programs keep this machine busy. Busy: they use more than "
                    "--yield-cpu-share of its CPU, or --yield-gpu-share of its GPU (read through NVML where "
                    "installed), for --yield-after-seconds; the peer resumes once they have stayed below for "
                    "--resume-after-quiet-seconds.")
    yield_cpu_share: float = Field(
        default=0.5, gt=0, le=1,
        description="With --yield-when-busy: the share of all CPU cores (0-1) that other programs may use before "
                    "this peer pauses.")
    yield_gpu_share: float = Field(
        default=0.1, gt=0, le=1,
        description="With --yield-when-busy: the share of this peer's GPU (its memory or its time, 0-1) that other "
                    "programs may use before this peer pauses.")
    yield_after_seconds: float = Field(
        default=5.0, ge=0,
        description="With --yield-when-busy: how long other programs must stay above their share before the peer "
                    "pauses.")
    resume_after_quiet_seconds: float = Field(
        default=60.0, ge=0,
        description="With --yield-when-busy: how long other programs must stay below their share before the peer "
                    "trains again (longer than a pause between two builds, so that it does not flap).")

    @field_validator("active_hours")
    @classmethod
    def _active_hours_parse(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_active_hours(value)  # ActiveHoursError is a ValueError: reported with the flag and the value
        return value


class PeerConfig(BaseModel):
    """The whole configuration of one peer; each package receives its own section."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    training: TrainingConfig = TrainingConfig()
    task: TaskConfig = TaskConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    dht: DHTConfig = DHTConfig()
    averaging: AveragingConfig = AveragingConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    volunteer: VolunteerConfig = VolunteerConfig()

    @model_validator(mode="after")
    def _no_conflicts(self) -> "PeerConfig":
        batch, target = self.training.batch_size, self.averaging.target_batch_size
        if batch is not None and batch > target:
            raise ValueError(
                f"--batch-size ({batch}) is larger than --target-batch-size ({target}); "
                f"raise --target-batch-size or lower --batch-size"
            )
        stray = options_not_taken(self.training.task, self.task)
        if stray:
            raise ValueError(stray)
        if self.training.task == HF_CAUSAL_LM and self.task.data is None:
            raise ValueError(DATA_NEEDED)
        if self.dht.client_mode and not self.dht.initial_peers:
            raise ValueError(
                "--client-mode needs --initial-peers: a client-mode peer accepts no connections, "
                "so it cannot start a swarm; pass the address of a running peer"
            )
        return self

    def swarm_hash(self) -> str:
        """Hash of the settings every peer of a run must share; stored in checkpoints."""
        shared = {"run_id": self.training.run_id, "task": self.training.task}
        shared["target_batch_size"] = self.averaging.target_batch_size
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


SECTIONS: Dict[str, Type[BaseModel]] = {
    name: field.annotation for name, field in PeerConfig.model_fields.items()  # type: ignore[misc]
}


@dataclass(frozen=True)
class Option:
    """One configurable field, as it appears in files, the environment and on the command line."""

    section: str
    name: str
    help: str
    is_bool: bool
    cli_name: str
    """Name on the command line and in the environment; the field name unless the field sets `cli_name`."""
    default: Any = None
    """The default value, for help (None: none to show)."""
    annotation: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.cli_name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.cli_name.upper()

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def metavar(self) -> str:
        """What the flag takes: its choices, a word for its kind and unit, or both (SECONDS|auto)."""
        choices = [str(choice) for choice in _literal_choices(self.annotation)]
        union = typing.get_origin(self.annotation) in (typing.Union, types.UnionType)
        members = typing.get_args(self.annotation) if union else (self.annotation,)
        others = [arg for arg in members if typing.get_origin(arg) is not Literal and arg is not type(None)]
        if not others:
            return "[" + "|".join(choices) + "]"
        return "|".join([self._kind(others), *choices])

    def _kind(self, types: list) -> str:
        if self.name.endswith("_seconds") or "_seconds_" in self.name:
            return "SECONDS"
        if self.name.endswith("_port"):
            return "PORT"
        for kind, word in ((int, "N"), (float, "X"), (Path, "PATH")):
            if kind in types:
                return word
        return "LIST" if any(typing.get_origin(kind) in (list, List) for kind in types) else "TEXT"

    @property
    def default_text(self) -> Optional[str]:
        if self.default is None or self.default == [] or self.is_bool and self.default is False:
            return None
        return "on" if self.default is True else str(self.default)


def _literal_choices(annotation: Any) -> tuple:
    """The values of a Literal, also inside Optional/Union; () if it is none."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return ()


def index_options(
    sections: Mapping[str, Type[BaseModel]],
) -> Tuple[Dict[str, Option], Dict[str, Option], Dict[str, Option]]:
    """Index every field of the given sections as (by "section.field", by cli_name, by PEER_* name).

    A field name may repeat across sections; its cli_name (and so its flag and variable) may not.
    :raises ValueError: naming both options when two of them share a key
    """
    options = [
        Option(section, name, field.description or "", field.annotation is bool,
               cli_name=(field.json_schema_extra or {}).get("cli_name", name),
               default=None if field.default_factory is not None else field.default, annotation=field.annotation)
        for section, model in sections.items()
        for name, field in model.model_fields.items()
    ]
    return (
        _unique(options, lambda option: option.dotted, "config key"),
        _unique(options, lambda option: option.cli_name, "command-line name"),
        _unique(options, lambda option: option.env, "environment variable"),
    )


def _unique(options: List[Option], key_of: Callable[[Option], str], what: str) -> Dict[str, Option]:
    # checked before each insert: a dict comprehension would keep the last option and drop the other unseen
    index: Dict[str, Option] = {}
    for option in options:
        key = key_of(option)
        if key in index:
            raise ValueError(
                f"{index[key].dotted} and {option.dotted} share the {what} {key!r}; "
                f"give one of them its own json_schema_extra={{'cli_name': ...}}"
            )
        index[key] = option
    return index


# OPTIONS: "training.batch_size" -> Option; OPTIONS_BY_CLI: the flag without dashes ("batch_size", and
# "averaging" for averaging.strategy) -> Option, also click's parameter name; OPTIONS_BY_ENV: "PEER_BATCH_SIZE".
OPTIONS, OPTIONS_BY_CLI, OPTIONS_BY_ENV = index_options(SECTIONS)
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"


def load_config(
    config_file: Optional[Path] = None,
    environ: Mapping[str, str] = {},
    flags: Mapping[str, Any] = {},
) -> PeerConfig:
    """Resolve defaults < file < environment < flags into a validated PeerConfig.

    :param flags: command-line name (OPTIONS_BY_CLI, e.g. "batch_size") -> value, only for flags given explicitly
    :raises ConfigError: listing every problem found
    """
    problems: List[str] = []
    values: Dict[str, Dict[str, Any]] = {section: {} for section in SECTIONS}
    sources: Dict[Tuple[str, str], str] = {}

    def assign(option: Option, value: Any, source: str) -> None:
        values[option.section][option.name] = value
        sources[(option.section, option.name)] = source

    if config_file is not None:
        for option, value in _read_config_file(Path(config_file), problems):
            assign(option, value, f"config file {config_file}")

    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key == CONFIG_FILE_ENV:
            continue
        if key in OPTIONS_BY_ENV:
            assign(OPTIONS_BY_ENV[key], environ[key], f"env {key}")
        else:
            known = [option.env for option in OPTIONS.values()] + [CONFIG_FILE_ENV]
            problems.append(f"{key}: unknown environment variable{_did_you_mean(key, known)}; unset it or fix its name")

    for name, value in flags.items():
        option = OPTIONS_BY_CLI[name]
        assign(option, value, f"flag {option.flag}")

    try:
        config = PeerConfig.model_validate(values)
    except ValidationError as e:
        problems.extend(_describe(error, sources) for error in e.errors())
        config = None
    if problems:
        raise ConfigError(problems)
    return config


def _read_config_file(path: Path, problems: List[str]) -> List[Tuple[Option, Any]]:
    """Parse a TOML/YAML file of [section] tables into (option, value) pairs."""
    if path.suffix not in (".toml", ".yaml", ".yml"):
        problems.append(f"--config: {path} must end in .toml, .yaml or .yml (got {path.suffix or 'no suffix'!r})")
        return []
    try:
        text = read_input_text(path)
    except InputFileError as e:
        problems.append(f"--config: {e}")
        return []
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.load(text, Loader=SettingsYamlLoader) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        problems.append(f"--config: {path} is not valid {path.suffix[1:].upper()}: {' '.join(str(e).split())}")
        return []
    if not isinstance(data, dict):
        problems.append(f"--config: {path} must contain a mapping of sections, got {type(data).__name__}")
        return []

    result: List[Tuple[Option, Any]] = []
    all_keys = list(SECTIONS) + list(OPTIONS)
    for section, table in data.items():
        if section not in SECTIONS:
            problems.append(f"{path}: unknown key {section!r}{_did_you_mean(section, all_keys)}")
            continue
        if not isinstance(table, dict):
            problems.append(f"{path}: [{section}] must be a table of settings, got {type(table).__name__}")
            continue
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in OPTIONS:
                problems.append(f"{path}: unknown key '{key}'{_did_you_mean(key, all_keys)}")
                continue
            option, wrong_type = OPTIONS[key], _wrong_type(OPTIONS[key], value)
            if wrong_type:
                problems.append(
                    f"{option.flag} ({key}) = {_shown(value)} from {path}: {wrong_type}; fix {key} in {path}")
                continue
            result.append((option, value))
    return result


def _wrong_type(option: Option, value: Any) -> Optional[str]:
    """TOML and YAML values are typed: refuse what pydantic would quietly convert (true as 1, 1.0 as 1)."""
    annotation = SECTIONS[option.section].model_fields[option.name].annotation
    kinds = set(typing.get_args(annotation)) | {annotation}
    if isinstance(value, bool) and bool not in kinds and (int in kinds or float in kinds):
        return "a boolean where a number belongs"
    if isinstance(value, float) and int in kinds and float not in kinds:
        return "must be a whole number, without a decimal point"
    return None


class SettingsYamlLoader(yaml.SafeLoader):
    """YAML for settings: no aliases (an alias bomb expands to gigabytes), no duplicate keys."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a config file",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _did_you_mean(word: str, choices: List[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:  # also match the bare field name against dotted keys: "batch_size" -> "training.batch_size"
        close = [c for c in choices if c.endswith("." + word) or c.lower().endswith("_" + word.lower())][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe(error: Dict[str, Any], sources: Dict[Tuple[str, str], str]) -> str:
    """Turn one pydantic error into 'field = value (from source): rule; fix'."""
    loc = tuple(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    option = OPTIONS.get(".".join(loc[:2])) if len(loc) >= 2 else None  # loc is (section, field, ...)
    if option is None:
        return message  # a cross-field rule: its message already names the options
    source = sources.get((option.section, option.name), "default")
    where = {"flag": f"fix {option.flag}", "env": f"fix or unset {option.env}"}.get(
        source.split()[0], f"fix {option.dotted} in {source.removeprefix('config file ')}"
    )
    return f"{option.flag} ({option.dotted}) = {_shown(error.get('input'))} from {source}: {message}; {where}"


def _shown(value: Any, limit: int = 80) -> str:
    """A value as the error line shows it: its repr, cut short (a 100,000-character run id stays one short line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
