"""`peer status`: who is in the swarm and how it is doing, from any machine that can reach it.

Joins the DHT as a client (it accepts no connections and stores nothing), reads every live
PeerInfo record, hivemind's progress record and the manifest of the run, and prints a table (or one
JSON object per refresh with --json). Swarm totals follow hivemind's ProgressTracker:
the global epoch is the highest epoch of a non-client peer, and only peers at that epoch
count toward the target. It must never write to the DHT: a ProgressTracker would publish
a progress record and be counted as a training peer, so the record is parsed here.

Exit codes: 0 after printing (or Ctrl+C under --watch), 1 when the swarm cannot be
reached within --timeout-seconds, 2 for bad input.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

import click

from peer.cli.options import READER_WORDING, SectionedCommand, config_options_for, resolve_config
from peer.config import PeerConfig
from peer.exit_codes import ExitCode

STATUS_FIELDS = ["initial_peers", "initial_peers_file", "run_id", "run_owner", "swarm_key", "target_batch_size",
                 "verbose"]
SHORT_ID_CHARS = 8


class SwarmUnreachable(Exception):
    """The swarm could not be joined or read in time; the message is one line."""


@click.command(cls=SectionedCommand)
@config_options_for(STATUS_FIELDS, wording=READER_WORDING)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {\"swarm\": {...}, \"peers\": [...]}.")
@click.option("--watch", type=click.FloatRange(min=0.5), default=None, metavar="SECONDS",
              help="Refresh every SECONDS until Ctrl+C.")
@click.option("--timeout-seconds", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True,
              help="Give up (exit 1) if the swarm cannot be joined and read within this long.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, watch: Optional[float], timeout_seconds: float, **params: Any) -> None:
    """Show the swarm's peers and progress (joins as a client; changes nothing)."""

    config = resolve_config(ctx, params)
    if not config.dht.initial_peers:
        click.echo("error: peer status needs --initial-peers or --initial-peers-file: "
                   "the address of any peer or bootstrap node of the swarm", err=True)
        ctx.exit(ExitCode.BAD_INPUT)
    ctx.exit(run_status(config, as_json, watch, timeout_seconds))


def run_status(config: PeerConfig, as_json: bool, watch: Optional[float], timeout_seconds: float) -> int:
    from dht.node import quiet_dht_logs, shutdown_dht
    from peer.process import lifeline
    from peer.telemetry.logs import setup_logging, silence_hivemind

    lifeline.install()
    setup_logging("text", config.logging.verbose)
    dht = None
    try:
        deadline = time.monotonic() + timeout_seconds
        dht, claims = join_as_client(config, timeout_seconds), claim_filter(config)
        while True:
            report = read_swarm(dht, config, max(1.0, deadline - time.monotonic()), claims)
            if as_json:
                click.echo(json.dumps(report))
            else:
                print_table(report, clear=watch is not None)
            if watch is None:
                return ExitCode.OK
            time.sleep(watch)
            deadline = time.monotonic() + timeout_seconds
    except SwarmUnreachable as e:
        click.echo(f"error: {e}", err=True)
        return ExitCode.FAILED
    except KeyboardInterrupt:  # the way out of --watch
        return ExitCode.OK
    finally:
        silence_hivemind()
        if not config.logging.verbose:
            quiet_dht_logs(dht)
        shutdown_dht(dht)


def join_as_client(config: PeerConfig, timeout_seconds: float):
    from hivemind.dht.schema import SchemaValidator
    from hivemind.optim.progress_tracker import TrainingProgressSchema

    from dht.keys import SwarmKeys
    from dht.node import DHTStartError, one_line, start_dht
    from dht.records import record_validators

    dht_config = config.dht.model_copy(
        update=dict(client_mode=True, startup_attempts=1, startup_timeout_seconds=timeout_seconds, identity=None)
    )
    # hivemind's validators strip signatures on read; without them signed values would not parse
    keys = SwarmKeys.for_run(config.training.run_id, config.dht.swarm_key)
    validators = [
        *record_validators(keys),
        SchemaValidator(TrainingProgressSchema, prefix=keys.namespace),
    ]
    try:
        return start_dht(dht_config, record_validators=validators)
    except DHTStartError as e:
        cause = one_line(e.__cause__) if e.__cause__ is not None else str(e)
        raise SwarmUnreachable(
            f"could not reach the swarm via {', '.join(config.dht.initial_peers)} within {timeout_seconds:g}s "
            f"({cause}); check the address, or raise --timeout-seconds"
        ) from e


def read_swarm(dht, config: PeerConfig, timeout_seconds: float, claims=None) -> Dict[str, Any]:
    """One snapshot: {"swarm": totals, "peers": one dict per live peer, "manifest": the run's settings or None}."""
    from hivemind.utils import get_dht_time

    from dht.credit import contributors
    from dht.keys import SwarmKeys
    from dht.manifest import held_by_peers, read_manifests, runs_manifest
    from dht.records import read_peer_infos
    from dht.run_owner import fingerprint

    run_id, keys = config.training.run_id, SwarmKeys.for_run(config.training.run_id, config.dht.swarm_key)
    try:
        infos = read_peer_infos(dht, run_id, timeout_seconds)
        progress = read_progress(dht, keys.progress, timeout_seconds, claims)
        copies = read_manifests(dht, keys.manifest, timeout_seconds, owner=config.dht.run_owner)
    except Exception as e:  # a timeout or a DHT that went away: the swarm is not readable
        raise SwarmUnreachable(f"could not read the swarm's records within {timeout_seconds:.0f}s "
                               f"({type(e).__name__}); check the address, or raise --timeout-seconds") from e
    manifest = runs_manifest(copies, infos, config.dht.run_owner)
    now, dht_now = time.time(), get_dht_time()
    latest: Dict[str, Any] = {}  # by peer id: a restarted peer keeps its id (--identity) but signs with a new key
    for info in infos.values():
        if info.peer_id not in latest or info.time > latest[info.peer_id].time:
            latest[info.peer_id] = info
    peers = [describe_peer(info, now) for info in sorted(latest.values(), key=lambda info: info.peer_id)]
    # the run's own target, from its manifest: the reader's --target-batch-size is only a fallback
    target = manifest.settings.get("target_batch_size") if manifest is not None else None
    target = target if isinstance(target, int) and target > 0 else config.averaging.target_batch_size
    factor = round_factor(peers)
    swarm = swarm_totals(progress, target * factor, dht_now)
    swarm["round_factor"] = factor
    swarm["run_id"] = run_id
    swarm["peers"] = len(peers)
    swarm["samples_per_second"] = round(float(sum(peer["samples_per_second"] for peer in peers)), 3)
    if not progress and peers:
        swarm["global_epoch"] = max((p["epoch"] for p in peers if not p["client_mode"]), default=0)
    if manifest is not None:
        manifest = {"protocol": manifest.protocol, "settings": manifest.settings, "owner": fingerprint(manifest.owner),
                    "held_by_peers": sum(1 for copy in held_by_peers(copies, infos).values() if copy == manifest)}
    return {"swarm": swarm, "peers": peers, "manifest": manifest, "contributors": contributors(latest.values())}


def round_factor(peers: List[Dict[str, Any]]) -> int:
    """The swarm's round factor (DiLoCo): what the peers at the newest epoch their records show apply (1 for other
    strategies). Records are a few seconds old: the progress records' epoch may be ahead of theirs."""
    with_factor = [peer for peer in peers if peer.get("round_factor") is not None]
    newest = max((peer["epoch"] for peer in with_factor), default=None)
    return max((peer["round_factor"] for peer in with_factor if peer["epoch"] == newest), default=1)


def claim_filter(config: PeerConfig):
    """Which progress records status and the monitor believe: the same rules as every peer (averaging/swarm/claims.py).
    Keep one for the life of the command, so that a --watch or the monitor judges epochs against what it saw."""
    from averaging.strategies.factory import progress_record_ttl_seconds
    from averaging.swarm.claims import ClaimFilter
    from averaging.swarm.progress import MIN_CLOCK_SKEW_SECONDS

    averaging = config.averaging
    skew = max(MIN_CLOCK_SKEW_SECONDS, averaging.seconds("matchmaking_seconds") or averaging.matchmaking_seconds_min)
    return ClaimFilter(b"", averaging.target_batch_size, max_ttl_seconds=progress_record_ttl_seconds(averaging) + skew,
                       max_clock_skew_seconds=skew, longest_round=averaging.max_round_factor)


def read_progress(dht, progress_key: str, timeout_seconds: float, claims=None) -> List[Any]:
    """Live, believable entries of hivemind's progress record (one per training peer); with a swarm key, the key
    is keyed too."""
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils import get_dht_time

    found = dht.get(progress_key, latest=True, return_future=True).result(timeout=timeout_seconds)
    if found is None or not isinstance(found.value, dict):
        return []
    now, entries = get_dht_time(), []
    believed = claims.filter(found.value, now) if claims is not None else found.value
    for entry in believed.values():
        if entry.value is None or entry.expiration_time < now:
            continue
        try:
            entries.append(LocalTrainingProgress.parse_obj(entry.value))
        except Exception:  # not a progress entry: skip it, as hivemind's tracker would reject it
            continue
    return entries


def swarm_totals(progress: List[Any], target_batch_size: int, now: float) -> Dict[str, Any]:
    """Global epoch, samples toward the target and the ETA of the next epoch, as hivemind derives them."""
    trainers = [entry for entry in progress if not entry.client_mode]
    global_epoch = max((entry.epoch for entry in trainers or progress), default=0)
    current = [entry for entry in progress if entry.epoch == global_epoch]
    accumulated = sum(entry.samples_accumulated for entry in current)
    estimated = sum(entry.samples_accumulated + max(0.0, now - entry.time) * entry.samples_per_second
                    for entry in current)
    total_speed = sum(entry.samples_per_second for entry in progress)
    remaining = max(0.0, target_batch_size - estimated)
    eta = remaining / total_speed if total_speed > 0 else None
    return {
        "global_epoch": global_epoch,
        "samples_accumulated": accumulated,
        "target_batch_size": target_batch_size,
        "progress": round(min(1.0, accumulated / target_batch_size), 4),
        "eta_next_epoch_seconds": None if eta is None else round(eta, 2),
        "training_peers": len(progress),
    }


def describe_peer(info, now: float) -> Dict[str, Any]:
    return {
        "peer_id": info.peer_id,
        "short_id": info.peer_id[-SHORT_ID_CHARS:],
        "device": info.device,
        "version": info.version,
        "client_mode": info.client_mode,
        "samples_per_second": round(info.samples_per_second, 3),
        "epoch": info.global_epoch,
        "bottleneck": info.bottleneck,
        "fractions": info.fractions,
        "val_loss": info.val_loss,
        "state": info.state,
        "paused": list(info.paused),
        "upload_budget_mbit": info.upload_budget_mbit,
        "round_factor_requested": info.round_factor_requested,
        "round_factor": info.round_factor,
        "uptime_seconds": round(info.uptime_seconds, 1),
        "last_seen_seconds": round(max(0.0, now - info.time), 1),
    }


def print_table(report: Dict[str, Any], clear: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    swarm, console = report["swarm"], Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and wrap device names
        console = Console(width=120)
    table = Table(title=f"swarm {swarm['run_id']}", title_justify="left")
    for column, justify in [("peer", "left"), ("device", "left"), ("samples/s", "right"), ("epoch", "right"),
                            ("round", "left"), ("bottleneck", "left"), ("state", "left"), ("last seen", "right")]:
        table.add_column(column, justify=justify, no_wrap=column != "device")
    for peer in report["peers"]:
        table.add_row(
            peer["short_id"] + (" (client)" if peer["client_mode"] else ""), peer["device"],
            f"{peer['samples_per_second']:.1f}", str(peer["epoch"]), describe_round(peer), peer["bottleneck"] or "-",
            ("paused: " + ", ".join(peer["paused"])) if peer["paused"] else
            {"agrees": "the swarm's", "apart": "apart"}.get(peer["state"], "-"),
            f"{peer['last_seen_seconds']:.0f}s ago",
        )
    eta = swarm["eta_next_epoch_seconds"]
    if clear:
        console.clear()
    console.print(table)
    factor = swarm.get("round_factor", 1)
    console.print(f"swarm: {swarm['peers']} peers, {swarm['samples_per_second']:.1f} samples/s, "
                  f"global epoch {swarm['global_epoch']}"
                  + (f", rounds of {factor} x the target batch (the round factor)" if factor > 1 else ""))
    console.print(f"next epoch: {swarm['samples_accumulated']}/{swarm['target_batch_size']} samples "
                  f"({swarm['progress']:.0%}), ETA {'unknown' if eta is None else f'~{eta:.0f}s'}")
    print_contributors(console, report.get("contributors") or [])
    manifest = report.get("manifest")
    if manifest is None:
        console.print("manifest: none readable (with --swarm-key, pass the swarm's key file)")
    else:
        settings = ", ".join(f"{name} {value}" for name, value in sorted(manifest["settings"].items()))
        console.print(f"manifest (protocol {manifest['protocol']}, signed by run owner {manifest['owner']}, held by "
                      f"{manifest['held_by_peers']} live peers): {settings}", soft_wrap=True)


def describe_round(peer: Dict[str, Any]) -> str:
    """A peer's round factor, what it asks for and its upload budget, e.g. "x2, asks x4, 10 Mbit/s" ("-": none)."""
    factor = peer.get("round_factor")
    if factor is None:
        return "-"
    words = [f"x{factor}"]
    if peer.get("upload_budget_mbit") is not None:  # without a budget it asks for 1
        if peer.get("round_factor_requested") not in (None, factor):
            words.append(f"asks x{peer['round_factor_requested']}")
        words.append(f"{peer['upload_budget_mbit']:g} Mbit/s")
    return ", ".join(words)


def print_contributors(console, rows: List[Dict[str, Any]]) -> None:
    """Each peer's own claim beside the median of what the others observed of it (dht/credit.py)."""
    from rich.table import Table

    if not rows:
        return
    table = Table(title="contributors (samples: claimed by the peer, observed by the others)", title_justify="left")
    for column in ("peer", "claimed", "observed", "observers", "compute", "sent"):
        table.add_column(column, justify="left" if column == "peer" else "right", no_wrap=True)
    for row in rows:
        observed = row["observed_samples"]
        table.add_row(row["peer_id"][-SHORT_ID_CHARS:], str(row["claimed_samples"]),
                      "-" if observed is None else str(observed), str(row["observers"]),
                      f"{row['device_seconds']:.0f}s", f"{row['sent_bytes'] / 2**20:.1f} MiB")
    console.print(table)
