"""`peer bootstrap`: a DHT-only node that newcomers join through.

It stores and validates the run's swarm records (the same validators as every peer), keeps
the run's manifest alive while no peer trains, prints its multiaddrs, optionally writes them
to a file for others to read with --initial-peers-file, and serves until SIGINT/SIGTERM, then
leaves cleanly (exit 0).
It trains nothing and publishes no PeerInfo (it is not a peer of the run).
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, List, Optional

import click

from peer.cli.options import SectionedCommand, config_options_for, resolve_config
from peer.config import OPTIONS, PeerConfig
from peer.exit_codes import ExitCode

logger = logging.getLogger("peer.cli.bootstrap")

DHT_FIELDS = [option.cli_name for option in OPTIONS.values() if option.section == "dht"]
BOOTSTRAP_FIELDS = [*DHT_FIELDS, "run_id", "log_format", "verbose", "events"]
LIVENESS_POLL_SECONDS = 1.0


@click.command(cls=SectionedCommand)
@config_options_for(BOOTSTRAP_FIELDS)
@click.option(
    "--write-maddrs",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write this node's multiaddrs here, one per line (atomically), for --initial-peers-file.",
)
@click.pass_context
def bootstrap(ctx: click.Context, write_maddrs: Optional[Path], **params: Any) -> None:
    """Run a DHT-only bootstrap node for a swarm: it trains nothing; peers join through it."""

    config = resolve_config(ctx, params)
    if config.dht.client_mode:
        click.echo(
            "error: --client-mode: a bootstrap node must accept incoming connections; drop --client-mode "
            "(or unset PEER_CLIENT_MODE)",
            err=True,
        )
        ctx.exit(ExitCode.BAD_INPUT)
    ctx.exit(run_bootstrap(config, write_maddrs))


def run_bootstrap(config: PeerConfig, write_maddrs: Optional[Path] = None) -> int:
    from peer.cli.outputs import check_output_file
    from peer.telemetry.events import EventLog, Exited

    events = EventLog(config.logging.events)
    try:
        check_output_file(config.logging.events, "--events")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    code = _serve(config, write_maddrs, events)
    events.emit(Exited(reason="stopped" if code == ExitCode.OK else "failed", code=int(code)))
    return code


def _serve(config: PeerConfig, write_maddrs: Optional[Path], events) -> int:
    from dht.node import DHTStartCancelled, DHTStartError, visible_maddrs
    from peer.process import lifeline
    from peer.process.signals import StopRequest, start_shared_memory_manager
    from peer.runtime.builder import PeerBuilder
    from peer.telemetry.events import Ready
    from peer.telemetry.logs import setup_logging

    lifeline.install()
    setup_logging(config.logging.log_format, config.logging.verbose)
    start_shared_memory_manager()
    stop = StopRequest(first_signal_does="leaving the swarm")
    stop.install_handlers()
    logger.info(f"bootstrap node for run {config.training.run_id}; dht config: {config.dht.model_dump_json()}")
    with ExitStack() as stack:
        stack.callback(logger.info, "bootstrap node stopped")
        try:
            builder = PeerBuilder(config, stop, stack)
            dht = builder.dht()
            builder.serve_manifest(dht)
            maddrs = visible_maddrs(dht)
            if write_maddrs is not None:
                write_lines_atomically(write_maddrs, maddrs)
            print_addresses(config, str(dht.peer_id), maddrs, write_maddrs)
            events.emit(Ready(role="bootstrap", peer_id=str(dht.peer_id), run_id=config.training.run_id,
                              multiaddrs=maddrs, run_owner=config.dht.run_owner))
            while not stop.wait(LIVENESS_POLL_SECONDS):
                if not dht.is_alive():
                    logger.error("the DHT process died; exiting (check the log above, rerun with --verbose)")
                    return ExitCode.FAILED
            return ExitCode.OK
        except DHTStartCancelled:
            return ExitCode.OK
        except DHTStartError as e:
            logger.error(str(e))
            return ExitCode.FAILED
        except OSError as e:
            logger.error(f"--write-maddrs {write_maddrs}: cannot write ({e.strerror or e}); check the directory")
            return ExitCode.FAILED


def print_addresses(config: PeerConfig, peer_id: str, maddrs: List[str], written_to: Optional[Path]) -> None:
    lines = [f"bootstrap node {peer_id} for run {config.training.run_id}; multiaddrs:"]
    lines += [f"  {maddr}" for maddr in maddrs]
    if written_to is not None:
        lines.append(f"(written to {written_to}; peers can pass --initial-peers-file {written_to})")
    if maddrs:
        owner = f" --run-owner {config.dht.run_owner}" if config.dht.run_owner else ""
        lines += ["To join this swarm, run:",
                  f"  peer start --run-id {config.training.run_id}{owner} --initial-peers {maddrs[0]}"]
    print("\n".join(lines), flush=True)


def write_lines_atomically(path: Path, lines: List[str]) -> None:
    """Readers see either the old file or the whole new one, never half of it."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{line}\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the addresses from the peers' service users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
