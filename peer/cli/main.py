"""The `peer` command line: parse, resolve the config once (peer/cli/options.py), hand over.

Errors from click itself (an unknown flag, a missing value) become one line and exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional

import click
from click.core import ParameterSource

from peer.cli.bootstrap import bootstrap
from peer.cli.export import export
from peer.cli.monitor import monitor
from peer.cli.options import SectionedCommand, config_options_for, resolve_config
from peer.cli.pause import pause, resume
from peer.cli.preflight import check_before_start
from peer.cli.status import status
from peer.config import OPTIONS_BY_CLI
from peer.exit_codes import ExitCode
from peer.process.p2p_daemon_heap import bound_p2p_daemon_heap
from peer.process.tensor_sharing import share_tensors_by_descriptor


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="swarmtrain", prog_name="peer", message="%(prog)s %(version)s")
def cli() -> None:
    """swarmtrain: train one PyTorch model together with a swarm of peers."""


@cli.command(cls=SectionedCommand)
@config_options_for()
@click.option("--inject-faults", hidden=True, default=None,
              help="Tests only: a FaultPlan as JSON (peer/testing/faults.py).")
@click.pass_context
def start(ctx: click.Context, inject_faults: Optional[str], **params: Any) -> None:
    """Start a peer: join (or start) a swarm and train until stopped."""
    share_tensors_by_descriptor()  # before hivemind is imported (checking a multiaddr imports it)
    bound_p2p_daemon_heap()
    config = resolve_config(ctx, params)
    faults = _fault_plan(inject_faults) if inject_faults is not None else None
    try:
        check_before_start(config)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    from peer.cli.start import run_peer  # heavy imports (torch, hivemind) only once the config and the machine pass

    ctx.exit(run_peer(config, faults))


def _fault_plan(value: str):
    import pydantic

    from peer.testing.faults import FaultPlan

    try:
        return FaultPlan.model_validate_json(value)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the value"
        raise click.UsageError(f"--inject-faults {value!r}: {where}: {error['msg']}; give a JSON object with "
                               f"{', '.join(FaultPlan.model_fields)}") from None


@cli.command(cls=SectionedCommand, context_settings={"ignore_unknown_options": False})
@click.option("--peers", "num_peers", type=click.IntRange(min=1, max=64), default=2, show_default=True,
              help="How many peers to start on this machine.")
@click.option("--summary-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Write each peer's summary to DIR/peer-<i>.json.")
@click.option("--gpus", default=None, metavar="all|0,1,..",
              help="One peer per GPU, each with --device cuda:N: 'all' or the GPU indices (sets --peers).")
@config_options_for()
@click.pass_context
def swarm(ctx: click.Context, num_peers: int, summary_dir: Optional[Path], gpus: Optional[str], **params: Any) -> None:
    """Start N peers on this machine: the first bootstraps, the rest join it; they wait for each other
    (--min-peers N) unless --min-peers says otherwise."""
    from peer.cli.swarm import prepare_cpu_peers, run_local_swarm

    if gpus is None:
        prepare_cpu_peers(num_peers)  # before torch and hivemind are imported (checking a multiaddr imports them)
    config = resolve_config(ctx, params)

    chosen = _chosen_gpus(ctx, gpus, num_peers) if gpus is not None else []
    count, args = len(chosen) or num_peers, _start_args(ctx)
    if "min_peers" not in config.averaging.model_fields_set:  # not given by flag, variable or file
        args += ["--min-peers", str(count)]  # else the first peer trains alone while the others start
    ctx.exit(run_local_swarm(config, count, summary_dir, args, exit_code_of, chosen))


def _chosen_gpus(ctx: click.Context, spec: str, num_peers: int) -> List[int]:
    import torch  # only here: the rest of the command line stays fast

    from peer.cli.swarm import choose_gpus

    try:
        gpus = choose_gpus(spec, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if ctx.get_parameter_source("num_peers") == ParameterSource.COMMANDLINE and num_peers != len(gpus):
        raise click.UsageError(f"--peers {num_peers} conflicts with --gpus {spec} ({len(gpus)} GPU(s), one peer "
                               f"each); leave out --peers")
    if ctx.get_parameter_source("device") == ParameterSource.COMMANDLINE:
        raise click.UsageError(f"--gpus {spec} sets each peer's --device; leave out --device")
    return gpus


def _start_args(ctx: click.Context) -> List[str]:
    """The `peer start` flags given to `peer swarm`, to pass on to each peer as typed."""
    args: List[str] = []
    for name, value in ctx.params.items():
        if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        if name == "config_file":
            args += ["--config", str(value)]
        elif name in OPTIONS_BY_CLI:
            option = OPTIONS_BY_CLI[name]
            if option.is_bool:
                args.append(option.flag if value else f"--no-{option.flag[2:]}")
            else:
                args += [option.flag, str(value)]
    return args


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: click errors become one line and exit code 2."""
    try:
        code = cli.main(args=argv, prog_name="peer", standalone_mode=False)
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.ClickException as e:
        click.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        code = ExitCode.BAD_INPUT
    except click.exceptions.Abort:
        code = 130  # the shell's convention for an interrupted command
    sys.exit(code or 0)


def exit_code_of(argv: List[str]) -> int:
    """Run `peer <argv>` in this process, as main() does; the code it would exit with (a preforked peer's)."""
    try:
        main(argv)
    except SystemExit as e:  # main() always exits with a number
        return e.code if isinstance(e.code, int) else 1
    return 0


# commands that live in their own modules
for command in (bootstrap, status, monitor, pause, resume, export):
    cli.add_command(command)
