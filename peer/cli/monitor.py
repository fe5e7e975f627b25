"""`peer monitor`: export the whole swarm's state as one Prometheus target.

Joins the DHT as a client, reads every peer's record and the run's progress every few
seconds (the same snapshot as `peer status --json`), and serves it on /metrics with the
swarm_* metrics of monitoring.swarm_metrics, and as a live page at / for people who run no
Grafana (monitoring.swarm_page). /healthz is 503 when the swarm could not be read for longer
than the health window, and while it has no live peer. Runs until SIGINT/SIGTERM, then exits 0.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import click

from peer.cli.options import READER_WORDING, SectionedCommand, config_options_for, resolve_config
from peer.exit_codes import ExitCode

logger = logging.getLogger("peer.cli.monitor")

MONITOR_FIELDS = ["initial_peers", "initial_peers_file", "run_id", "swarm_key", "target_batch_size", "metrics_port",
                  "metrics_host", "health_window_seconds", "log_format", "verbose"]


@click.command(cls=SectionedCommand)
@config_options_for(MONITOR_FIELDS, wording=READER_WORDING)
@click.option("--refresh-seconds", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              help="How often to read the swarm's records.")
@click.option("--timeout-seconds", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Give up (exit 1) if the swarm cannot be joined within this long.")
@click.pass_context
def monitor(ctx: click.Context, refresh_seconds: float, timeout_seconds: float, **params: Any) -> None:
    """Export swarm-level metrics for every peer (joins as a client; changes nothing)."""

    config = resolve_config(ctx, params)
    if not config.dht.initial_peers:
        click.echo("error: peer monitor needs --initial-peers or --initial-peers-file: "
                   "the address of any peer or bootstrap node of the swarm", err=True)
        ctx.exit(ExitCode.BAD_INPUT)
    if config.monitoring.metrics_port == "off":
        click.echo("error: --metrics-port off: the monitor exists to serve metrics; give it a port", err=True)
        ctx.exit(ExitCode.BAD_INPUT)
    ctx.exit(run_monitor(config, refresh_seconds, timeout_seconds))


def run_monitor(config, refresh_seconds: float, timeout_seconds: float) -> int:
    from prometheus_client import CollectorRegistry

    from dht.node import quiet_dht_logs, shutdown_dht
    from monitoring import HealthCheck, MetricsBindError, MetricsExporter
    from monitoring.swarm_metrics import SwarmCollector
    from monitoring.swarm_page import SwarmPage
    from peer.cli.status import SwarmUnreachable, claim_filter, join_as_client, read_swarm
    from peer.process import lifeline
    from peer.process.signals import StopRequest
    from peer.telemetry.logs import setup_logging, silence_hivemind

    lifeline.install()
    setup_logging(config.logging.log_format, config.logging.verbose)
    stop = StopRequest(first_signal_does="leaving the swarm")
    stop.install_handlers()
    registry = CollectorRegistry()
    collector = SwarmCollector(clock=time.monotonic)
    registry.register(collector)
    health = HealthCheck(config.monitoring.health_window_seconds)
    health.degrade("no live peer in the swarm")  # until a read of the swarm shows one
    page = SwarmPage(health, refresh_seconds)
    exporter = MetricsExporter(registry, config.monitoring.metrics_port, config.monitoring.metrics_host, health=health,
                               routes=page.routes())
    dht = None
    try:
        try:
            port = exporter.start()
        except MetricsBindError as e:
            click.echo(f"error: {e}", err=True)
            return ExitCode.BAD_INPUT
        url = f"http://{config.monitoring.metrics_host}:{port}"
        logger.info(f"swarm page on {url}/ and swarm metrics on {url}/metrics")
        dht, claims = join_as_client(config, timeout_seconds), claim_filter(config)
        stop.install_handlers()  # hivemind may have replaced SIGINT while starting
        while not stop:
            try:
                snapshot = read_swarm(dht, config, timeout_seconds, claims)
                collector.update(snapshot)
                page.update(snapshot)
                health.beat()
                if snapshot["peers"]:
                    health.recover()
                else:
                    health.degrade("no live peer in the swarm")
            except SwarmUnreachable as e:  # keep serving the last snapshot; /healthz tells the age
                logger.warning(str(e))
            stop.wait(refresh_seconds)
        return ExitCode.OK
    except SwarmUnreachable as e:
        click.echo(f"error: {e}", err=True)
        return ExitCode.FAILED
    finally:
        silence_hivemind()
        if not config.logging.verbose:
            quiet_dht_logs(dht)
        shutdown_dht(dht)
        exporter.stop()
