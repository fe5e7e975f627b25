"""Click flags generated from the config models, their help, and the one place a command's config is resolved.

Every config field has exactly one flag and one PEER_* variable. Flag values are passed on
as typed and validated together with the file and the environment, so that every problem is
reported in one pass: one line each, exit code 2, no traceback.

Help comes in sections (SectionedCommand): each flag with what it takes (its choices, or a unit),
the first sentence of its description and its default; `--help-all` adds the rest of the
description, the PEER_* variable and the config-file key.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import click
from click.core import ParameterSource

from peer.config import CONFIG_FILE_ENV, OPTIONS_BY_CLI, ConfigError, Option, PeerConfig, load_config
from peer.exit_codes import ExitCode

FULL_HELP = "swarmtrain.full_help"  # set in the click context's meta by --help-all

# (title, which options): an option goes under the first title that takes it; shown in this order
HELP_SECTIONS: Tuple[Tuple[str, Callable[[Option], bool]], ...] = (
    ("Run and task", lambda option: option.section in ("training", "task")),
    ("Network", lambda option: option.section == "dht"),
    ("Compression", lambda option: option.section == "averaging"
     and ("compression" in option.name
          or option.name.startswith(("adaptive_", "powersgd_", "topk_", "error_feedback")))),
    ("Untrusted peers", lambda option: option.section == "averaging"
     and option.name.startswith(("robust_", "exclu"))),
    ("Averaging", lambda option: option.section == "averaging"),
    ("Checkpoints", lambda option: option.section == "checkpoint"),
    ("Volunteer machine", lambda option: option.section == "volunteer"),
    ("Monitoring and logs", lambda option: option.section in ("monitoring", "logging")),
)
TUNING = frozenset({
    "task_timeout_seconds", "val_batches", "seed", "announce_maddrs", "startup_timeout_seconds", "startup_attempts",
    "matchmaking_seconds_min", "matchmaking_seconds_max", "averaging_timeout_seconds_min",
    "averaging_timeout_seconds_max", "load_state_timeout_seconds", "min_peers_timeout_seconds",
    "load_state_compression", "adaptive_compression_threshold", "adaptive_large_codec", "topk_fraction",
    "topk_value_bits", "topk_chunk", "robust_norm_ratio", "robust_min_cosine", "robust_trim_fraction",
    "robust_max_weight_share",
    "exclude_after", "exclude_window", "exclusion_seconds", "harmful_update_rise", "harmful_updates",
    "harmful_update_window", "straggler_grace_min_seconds", "max_round_factor", "target_group_size",
    "keep_checkpoints", "health_window_seconds", "log_format", "yield_cpu_share", "yield_gpu_share",
    "yield_after_seconds", "resume_after_quiet_seconds", "tokenizer", "seq_len", "init_from",
})
"""Flags that most runs never change: listed by --help-all only, so that --help fits a reader."""
SHOWN_ORDER = ("Run and task", "Network", "Averaging", "Compression", "Untrusted peers", "Checkpoints",
               "Volunteer machine", "Monitoring and logs")


READER_WORDING = {
    "initial_peers": "Comma-separated multiaddrs of any peers or bootstrap nodes of the swarm to read (this or "
                     "--initial-peers-file is required).",
    "target_batch_size": "The swarm's target batch, for its progress and ETA when the run's manifest cannot be "
                         "read (the manifest's target is used when it can).",
}
"""How `peer status` and `peer monitor` describe the flags they share with `peer start`."""


def help_section(option: Option) -> str:
    return next(title for title, takes in HELP_SECTIONS if takes(option))


class SectionedCommand(click.Command):
    """A command whose config flags are listed by section, briefly unless --help-all asked for everything."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        full = ctx.meta.get(FULL_HELP, False)
        general: List[Tuple[str, str]] = []
        sections: Dict[str, List[Tuple[str, str]]] = {title: [] for title in SHOWN_ORDER}
        tuning = 0
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            option = OPTIONS_BY_CLI.get(param.name or "")
            if record is None:
                continue
            if option is None:
                general.append(record)
            elif full or option.cli_name not in TUNING:
                sections[help_section(option)].append((record[0], _describe(option, param.help or "", full)))
            else:
                tuning += 1
        with formatter.section("Options"):
            formatter.write_dl(general)
        for title in SHOWN_ORDER:
            if sections[title]:
                with formatter.section(title):
                    formatter.write_dl(sections[title])
        if not full:
            formatter.write_paragraph()
            formatter.write_text(f"--help-all also lists {tuning} flags for tuning timeouts, bounds and defences, and "
                                 f"shows each flag's full description, its PEER_* variable and its config-file key.")


def _describe(option: Option, text: str, full: bool) -> str:
    if not full:
        text = re.split(r"(?<=\.)\s(?=[A-Z])", text, maxsplit=1)[0]  # the first sentence
    if option.default_text is not None:
        text += f" [default: {option.default_text}]"
    if full:
        text += f" [env: {option.env}; config: {option.dotted}]"
    return text


def _print_full_help(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[FULL_HELP] = True
    click.echo(ctx.get_help())
    ctx.exit(0)


def config_options_for(names: Optional[Iterable[str]] = None,
                       wording: Mapping[str, str] = {}) -> Callable[[Callable], Callable]:
    """Decorate a command with --config, --help-all and the flags of the given options (default: all).

    Fields without a flag on that command keep their defaults, config-file values and PEER_*
    variables; the resolved config is always a whole, validated PeerConfig.

    :param names: command-line names without dashes (keys of OPTIONS_BY_CLI, e.g. "batch_size")
    :param wording: name -> this command's own description of a shared flag
    """
    selected = [OPTIONS_BY_CLI[name] for name in (names if names is not None else OPTIONS_BY_CLI)]

    def decorate(command: Callable) -> Callable:
        # the parameter is named by cli_name, which is unique, unlike field names across sections
        for option in reversed(selected):
            help_text = wording.get(option.cli_name, option.help)
            if option.is_bool:
                decls = [f"{option.flag}/--no-{option.flag[2:]}"]
                command = click.option(*decls, option.cli_name, default=None, help=help_text)(command)
            else:
                command = click.option(option.flag, option.cli_name, default=None, metavar=option.metavar,
                                       help=help_text)(command)
        command = click.option("--help-all", is_flag=True, expose_value=False, is_eager=True,
                               callback=_print_full_help,
                               help="Show each flag's full description, PEER_* variable and config key.")(command)
        return click.option(
            "--config",
            "config_file",
            default=None,
            envvar=CONFIG_FILE_ENV,
            type=click.Path(path_type=Path, dir_okay=False),
            help=f"TOML or YAML file with [training], [averaging], [dht], ... sections. [env: {CONFIG_FILE_ENV}]",
        )(command)

    return decorate


def resolve_config(ctx: click.Context, params: Dict[str, Any]) -> PeerConfig:
    """Build the PeerConfig from a command's parameters; exit 2 with one line per problem."""
    flags = {
        name: value
        for name, value in params.items()
        if name in OPTIONS_BY_CLI and ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
    }
    try:
        return load_config(params.get("config_file"), dict(os.environ), flags)
    except ConfigError as e:
        for problem in e.problems:
            click.echo(f"error: {problem}", err=True)
        ctx.exit(ExitCode.BAD_INPUT)
