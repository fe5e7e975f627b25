"""The configuration reference of the docs, generated from the config models at build time.

mkdocs runs this file as a hook (mkdocs.yml, `hooks:`). Where docs/configuration.md holds a marker,
the hook puts a table in its place:
- CONFIG_MARKER: every field of PeerConfig (peer/config.py's OPTIONS) with its flag, PEER_* variable,
  config-file key, default and description, grouped as `peer start --help` groups them;
- COMMANDS_MARKER: each `peer` command, its own flags and the config flags it takes.

The config models are the source of truth: this file must not hold a flag name, a default or a
description of its own. Nothing it writes is committed; tests/meta/test_docs.py calls the two
functions below directly.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, List

import click

from peer.cli.options import SHOWN_ORDER, help_section
from peer.config import CONFIG_FILE_ENV, OPTIONS, OPTIONS_BY_CLI, SECTIONS, Option

CONFIG_MARKER = "<!-- config-reference -->"
COMMANDS_MARKER = "<!-- command-reference -->"
PAGE = "configuration.md"
GENERIC_FLAGS = ("--config", "--help-all")  # every command that takes config flags has these two


def config_reference_markdown() -> str:
    """One table per help section, one row per config field."""
    lines = [
        f"{len(OPTIONS)} settings, grouped as `peer start --help` groups them. Besides these, `--config FILE` "
        f"(or `{CONFIG_FILE_ENV}=FILE`) names a config file and `--help-all` lists every flag. "
        "In a config file, a key goes under the table its first part names: `training.run_id` is "
        "`run_id` under `[training]`.",
        "",
    ]
    for title in SHOWN_ORDER:
        options = [option for option in OPTIONS.values() if help_section(option) == title]
        if not options:
            continue
        lines += [f"### {title}", "", "| flag | environment | config key | default | meaning |",
                  "|---|---|---|---|---|"]
        lines += [
            f"| `{_flag_with_value(option)}` | `{option.env}` | `{option.dotted}` | {_default(option)} "
            f"| {_prose(option.help)} |"
            for option in options
        ]
        lines.append("")
    return "\n".join(lines)


def command_reference_markdown() -> str:
    """Each `peer` command: what it does, its own flags, and which config flags it takes."""
    from peer.cli.main import cli  # imported on use: the command modules are heavier than the config

    lines: List[str] = []
    for name, command in cli.commands.items():
        params = [param for param in command.params if isinstance(param, click.Option) and not param.hidden]
        shared = [OPTIONS_BY_CLI[param.name].flag for param in params if param.name in OPTIONS_BY_CLI]
        own = [param for param in params if param.name not in OPTIONS_BY_CLI and param.opts[0] not in GENERIC_FLAGS]
        lines += [f"### `peer {name}`", "", _prose(" ".join((command.help or "").split())), ""]
        if own:
            lines += ["| flag | default | meaning |", "|---|---|---|"]
            lines += [f"| `{_click_flag(param)}` | {_click_default(param)} | {_prose(param.help or '')} |"
                      for param in own]
            lines.append("")
        if len(shared) == len(OPTIONS):
            lines.append("It takes every setting of the reference above.")
        elif shared:
            lines.append("Settings it takes from the reference above: " + ", ".join(f"`{flag}`" for flag in shared)
                         + ".")
        lines.append("")
    return "\n".join(lines)


def _flag_with_value(option: Option) -> str:
    """`--batch-size N`, `--precision {auto,fp32,bf16,fp16}`, `--verbose / --no-verbose`."""
    if option.is_bool:
        return f"{option.flag} / --no-{option.flag[2:]}"
    alternatives = option.metavar.strip("[]").split("|")
    value = alternatives[0] if len(alternatives) == 1 else "{" + ",".join(alternatives) + "}"
    return f"{option.flag} {value}"


def _default(option: Option) -> str:
    value = SECTIONS[option.section].model_fields[option.name].get_default(call_default_factory=True)
    return _shown_default(value)


def _shown_default(value: Any) -> str:
    if value is None or value == [] or value == ():
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (list, tuple)):
        return "`" + ",".join(str(item) for item in value) + "`"
    return f"`{value}`"


def _click_flag(param: click.Option) -> str:
    if param.is_flag:
        return " / ".join(param.opts + param.secondary_opts)
    return f"{param.opts[0]} {param.metavar or _click_kind(param)}"


def _click_kind(param: click.Option) -> str:
    """A word for what a flag takes, as the config flags name theirs (peer/config.py's Option.metavar)."""
    if (param.name or "").endswith("_seconds"):
        return "SECONDS"
    if isinstance(param.type, click.Path):
        return "PATH" if param.type.file_okay else "DIR"
    if isinstance(param.type, (click.types.IntParamType, click.IntRange)):
        return "N"
    return "X" if isinstance(param.type, click.types.FloatParamType) else "TEXT"


def _click_default(param: click.Option) -> str:
    if param.is_flag or param.default is None or not isinstance(param.default, (str, int, float)):
        return "unset" if not param.is_flag else "`false`"
    return _shown_default(param.default)


def _prose(text: str) -> str:
    """Help text as a table cell: no raw HTML, no cell breaks, no emphasis; flags as code."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace("|", "\\|").replace("*", "\\*")
    return re.sub(r"(?<![\w`-])(--[a-z][a-z0-9-]*)", r"`\1`", text)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: fill in the markers of the configuration page."""
    if Path(page.file.src_uri).as_posix() != PAGE:
        return markdown
    from mkdocs.exceptions import PluginError

    for marker in (CONFIG_MARKER, COMMANDS_MARKER):
        if marker not in markdown:
            raise PluginError(f"docs/{PAGE} lost its {marker} marker; the generated reference goes there")
    markdown = markdown.replace(CONFIG_MARKER, config_reference_markdown())
    return markdown.replace(COMMANDS_MARKER, command_reference_markdown())
