"""`peer pause` and `peer resume`: control a peer running on this machine, found by its checkpoint directory.

The command writes a request for the peer that holds the directory's lock and waits until the peer
confirms it (peer/runtime/pausing.py). A pause takes effect after the peer's current step, and after a
round it is in: the command waits for that, up to --timeout-seconds.

Exit codes: 0 once the peer confirmed, 1 when it did not in time or exited, 2 for bad input (no peer
runs there, or it runs as another user).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from peer.cli.options import SectionedCommand, config_options_for, resolve_config
from peer.exit_codes import ExitCode

CONTROL_FIELDS = ["checkpoint_dir"]
TIMEOUT = click.option("--timeout-seconds", type=click.FloatRange(min=0, min_open=True), default=300.0,
                       show_default=True, help="Give up (exit 1) if the peer has not confirmed within this long.")


@click.command(cls=SectionedCommand)
@config_options_for(CONTROL_FIELDS)
@TIMEOUT
@click.pass_context
def pause(ctx: click.Context, timeout_seconds: float, **params: Any) -> None:
    """Pause the peer running with --checkpoint-dir: it finishes its step, stops counting samples and joining
    rounds, and gives back its GPU memory; it keeps its process and its place in the swarm."""
    config = resolve_config(ctx, params)
    ctx.exit(control(config.checkpoint.checkpoint_dir, True, timeout_seconds))


@click.command(cls=SectionedCommand)
@config_options_for(CONTROL_FIELDS)
@TIMEOUT
@click.pass_context
def resume(ctx: click.Context, timeout_seconds: float, **params: Any) -> None:
    """Resume a peer paused with peer pause: it catches up with the swarm (downloading its state if the swarm
    moved on) and trains again, unless --active-hours or --yield-when-busy keep it paused."""
    config = resolve_config(ctx, params)
    ctx.exit(control(config.checkpoint.checkpoint_dir, False, timeout_seconds))


def control(directory: Path, paused: bool, timeout_seconds: float) -> int:
    from peer.checkpoint.lock import LOCK_FILE_NAME, running_peer
    from peer.runtime.pausing import PAUSED, REQUESTED, STATE_FILE, TRAINING, describe, read_json, request

    directory = Path(directory).absolute()
    pid = running_peer(directory)
    if not pid:
        click.echo(f"error: --checkpoint-dir {directory}: no running peer holds this directory"
                   f"{'' if pid is None else ' that wrote its pid'}; name the --checkpoint-dir of a peer started "
                   f"on this machine with peer start", err=True)
        return ExitCode.BAD_INPUT
    if (directory / LOCK_FILE_NAME).stat().st_uid != os.geteuid():
        click.echo(f"error: --checkpoint-dir {directory}: the peer there (pid {pid}) runs as another user, and only "
                   f"its own user may pause or resume it; run this command as that user", err=True)
        return ExitCode.BAD_INPUT
    state = read_json(directory / STATE_FILE) or {}
    if not paused and state.get("pid") == pid and state.get("state") == TRAINING:
        click.echo(f"the peer (pid {pid}) is not paused: it trains")
        return ExitCode.OK
    try:
        stamp = request(directory, pid, paused)
    except OSError as e:
        click.echo(f"error: --checkpoint-dir {directory}: cannot write the request ({e.strerror or e}); run this "
                   f"command as the peer's user", err=True)
        return ExitCode.BAD_INPUT
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        state = read_json(directory / STATE_FILE) or {}
        if state.get("pid") == pid and state.get("request_seen") == stamp:
            reasons = state.get("reasons") or {}
            if paused and state.get("state") == PAUSED:
                click.echo(f"paused: the peer (pid {pid}) counts no samples and joins no round ({describe(reasons)})")
                return ExitCode.OK
            if not paused and state.get("state") == TRAINING:
                click.echo(f"resumed: the peer (pid {pid}) trains again")
                return ExitCode.OK
            if not paused and REQUESTED not in reasons:
                click.echo(f"resume taken: the peer (pid {pid}) stays paused while {describe(reasons)}")
                return ExitCode.OK
        if running_peer(directory) != pid:
            click.echo(f"error: the peer (pid {pid}) exited before it confirmed", err=True)
            return ExitCode.FAILED
        time.sleep(0.2)
    what = "finishes its step and any round it is in" if paused else "catches up with the swarm"
    click.echo(f"error: the peer (pid {pid}) did not confirm within {timeout_seconds:g}s; it {what} first (see its "
               f"log), or raise --timeout-seconds", err=True)
    return ExitCode.FAILED
