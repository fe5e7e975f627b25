"""Click flags generated from the config models, and the one place a command's config is resolved.

Every config field has exactly one flag and one PEER_* variable. Flag values are passed on
as typed and validated together with the file and the environment, so that every problem is
reported in one pass: one line each, exit code 2, no traceback.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

import click
from click.core import ParameterSource

from peer.config import CONFIG_FILE_ENV, OPTIONS_BY_CLI, ConfigError, PeerConfig, load_config
from peer.exit_codes import ExitCode


def config_options_for(names: Optional[Iterable[str]] = None) -> Callable[[Callable], Callable]:
    """Decorate a command with --config and the flags of the given options (default: all).

    Fields without a flag on that command keep their defaults, config-file values and PEER_*
    variables; the resolved config is always a whole, validated PeerConfig.

    :param names: command-line names without dashes (keys of OPTIONS_BY_CLI, e.g. "batch_size")
    """
    selected = [OPTIONS_BY_CLI[name] for name in (names if names is not None else OPTIONS_BY_CLI)]

    def decorate(command: Callable) -> Callable:
        # the parameter is named by cli_name, which is unique, unlike field names across sections
        for option in reversed(selected):
            help_text = f"{option.help} [env: {option.env}; config: {option.dotted}]"
            if option.is_bool:
                decls = [f"{option.flag}/--no-{option.flag[2:]}"]
                command = click.option(*decls, option.cli_name, default=None, help=help_text)(command)
            else:
                command = click.option(option.flag, option.cli_name, default=None, metavar="VALUE",
                                       help=help_text)(command)
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
