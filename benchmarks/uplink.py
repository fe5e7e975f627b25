"""Training over a slow uplink: wire bytes per sample and time to a validation loss, per averaging setup.

Two real `peer start` processes, each in its own network namespace on one bridge (benchmarks/netns.py),
each link's egress shaped with `tc tbf` to the rate under test, each peer pinned to its own core with
one torch thread, train the task (`bytelm`), each reading its own data order (`--seed` 0 and 1), for the
same number of samples (``--samples``), once per configuration and link rate, configurations interleaved
(forward at the first rate, reversed at the next):

- ``sync-fp32``, ``sync-fp16``, ``sync-int8-ef``: gradients averaged every epoch (``--target-batch-size``);
  int8 with error feedback (on by default for int8);
- ``diloco-fp32``, ``diloco-int4-ef``, ``diloco-topk-ef``: DiLoCo with a target batch ``--diloco-factor``
  times larger (each peer takes that many times more local steps per round, ``--diloco-inner-steps`` of them
  at most), pseudo-gradients averaged in fp32, int4 or top-k, the last two with error feedback;
- ``diloco-int4-ef-overlap``: the same as diloco-int4-ef with ``--diloco-overlap``;
- ``none``: no averaging (``--averaging none``: each peer trains its own replica alone, at the sync setups'
  target batch): the baseline, with the wire bytes of the DHT alone and the loss that averaging must beat.

Each setup's name begins with the strategy it runs (averaging/registry.py), which gives its ``--averaging``.

The sync setups average parameters only every ``--average-state-every`` 1000 epochs (never, here):
that is hivemind's drift repair, not part of what the papers compare against.

Measured per run:
- ``wire_bytes``: bytes each peer's interface sent (tx) and received (rx) during the run (all traffic,
  libp2p framing, DHT and state downloads included), from the interface's own counters;
- ``exported_sent_bytes``: what the peer's own ``peer_averaging_payload_sent_bytes`` counter says it sent (its summary's
  ``averaging_sent_bytes``), and ``exported_over_wire``, the ratio to the tx bytes;
- ``wire_bytes_per_sample``: both peers' tx bytes / both peers' samples;
- ``curve``: peer 0's validation loss after every epoch, with the seconds since both peers were ready and
  the swarm's samples so far (epoch x target batch);
- ``seconds``: from both peers ready to both exited; ``communication_share``: the share of the peers' time
  spent averaging (their summaries' `averaging` phase over all phases).

Compared, side by side: ``val_loss_at_equal_samples`` (each curve read at the smallest final sample count of
the runs at that rate, linearly between epochs), ``time_to_target_seconds`` (the first epoch at or below the
target loss: ``--target-val-loss``, or by default the highest final loss of all runs, one that every run
reached), and each setup's wire bytes per sample against sync-fp32's at the same rate. The plot
(``uplink.png`` next to the JSON, matplotlib: ``pip install 'swarmtrain[benchmarks]'``) shows validation loss
against wall time per configuration, one panel per rate.

Needs root (network namespaces, tc). Usage (from the repository root)::

    python -m benchmarks.uplink --quick     # 20 and 100 Mbit/s, 4096 samples per run (about 20 minutes)
    python -m benchmarks.uplink             # 20 Mbit/s, FULL_SETUPS, batch 16, 16 rounds of 128 inner steps
                                            # (65,536 samples per run; about an hour)
    python -m benchmarks.uplink --smoke     # 2 setups at 100 Mbit/s, 256 samples, bytelm-tiny; for tests

JSON ``results``: ``task``, ``samples``, ``target_batch_size``, ``diloco_target_batch_size``, ``rates``,
``target_val_loss``, ``plot``, ``runs`` (one per rate and setup: ``rate``, ``setup``, ``flags``, ``seconds``,
``samples``, ``epochs``, ``wire_bytes``, ``exported_sent_bytes``, ``exported_over_wire``,
``wire_bytes_per_sample``, ``communication_share``, ``val_loss_final``, ``curve``, ``averaging_rounds`` and
``state_downloads`` (per peer, from its summary), ``exit_codes``, ``error``),
``compared`` (per rate and setup: ``wire_bytes_per_sample_vs_sync_fp32``, ``val_loss_at_equal_samples``,
``val_loss_vs_sync_fp32``, ``time_to_target_seconds``, ``speedup_vs_sync_fp32``), and ``skipped``.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from averaging.registry import STRATEGIES, Strategy  # noqa: E402 (after the path fix above)
from benchmarks import common, netns  # noqa: E402 (after the path fix above)

NAME = "uplink"
SETUPS: Dict[str, List[str]] = {  # each setup's flags besides --averaging, which its name gives (strategy_of)
    "sync-fp32": [],
    "sync-fp16": ["--grad-compression", "fp16"],
    "sync-int8-ef": ["--grad-compression", "int8"],
    "diloco-fp32": [],
    "diloco-int4-ef": ["--grad-compression", "int4"],
    "diloco-topk-ef": ["--grad-compression", "topk"],
    "diloco-int4-ef-overlap": ["--grad-compression", "int4", "--diloco-overlap"],
    "none": [],
}
FULL_SETUPS = ("sync-fp32", "diloco-fp32", "diloco-int4-ef")
"""What full mode runs by default: the reference and the best DiLoCo setups (top-k loses too much at 16 rounds:
benchmarks/diloco_recipes.py)."""
STOP_GRACE_SECONDS = 60.0


def strategy_of(setup: str) -> Strategy:
    """The strategy a setup runs: the one its name begins with."""
    return next(strategy for name, strategy in STRATEGIES.items() if setup == name or setup.startswith(f"{name}-"))


def interpolate(curve: List[dict], samples: float) -> Optional[float]:
    """The validation loss of `curve` at `samples`, linearly between the epochs around it."""
    points = [(0.0, None)] + [(point["samples"], point["val_loss"]) for point in curve]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= samples <= x1:
            if y0 is None or x1 == x0:
                return y1
            return y0 + (y1 - y0) * (samples - x0) / (x1 - x0)
    return None


def time_to(curve: List[dict], target: float) -> Optional[float]:
    return next((point["seconds"] for point in curve if point["val_loss"] <= target), None)


async def one_run(run: common.Run, bridge: netns.Bridge, rate: str, setup: str, settings: dict, work: Path) -> dict:
    from peer.telemetry.events import EpochEnded, Ready
    from peer.testing import PeerFailed, Swarm

    strategy = strategy_of(setup)
    inner_steps = strategy.uses("diloco_inner_steps")  # rounds of many local steps each: a larger target batch
    target = settings["diloco_target_batch_size"] if inner_steps else settings["target_batch_size"]
    epochs = max(1, settings["samples"] // target)
    flags = ["--averaging", strategy.name, *SETUPS[setup], "--target-batch-size", str(target),
             "--max-epochs", str(epochs)]
    if inner_steps:
        flags += ["--diloco-inner-steps", str(settings["diloco_inner_steps"])]
    else:
        flags += ["--average-state-every", "1000"]
    row = {"rate": rate, "setup": setup, "flags": flags, "epochs": epochs, "error": None}
    bridge.set_rate(rate)
    before = [bridge.traffic(i) for i in range(2)]
    label = f"{rate}-{setup}"
    base = ["--task", settings["task"], "--batch-size", str(settings["batch_size"]),
            "--matchmaking-seconds", "1", "--averaging-timeout-seconds", "120", "--data-workers", "1",
            "--checkpoint-every-epochs", "1000", "--min-peers", "2", "--run-id", f"uplink-{os.getpid()}-{label}"]
    async with Swarm(work / label, *base, env={"OMP_NUM_THREADS": "1"}) as swarm:
        try:
            peers = []
            for index in range(2):
                peers.append(await swarm.add(  # each its own data order, as `peer swarm` hands them out
                    *flags, "--seed", str(index), "--host-maddrs", f"/ip4/{bridge.ip(index)}/tcp/0",
                    name=f"peer-{index}",
                    namespace=bridge.namespaces[index], prefix=["taskset", "-c", str(settings["cores"][index])],
                    ready=index == 0, timeout=120))
            await peers[1].ready(120)
            started = max(next(e.time for e in peer.events if isinstance(e, Ready)) for peer in peers)
            row["exit_codes"] = list(await asyncio.wait_for(
                asyncio.gather(*(peer.exit_code(settings["max_seconds"]) for peer in peers)),
                settings["max_seconds"] + 10))
            finished = time.time()
        except (PeerFailed, TimeoutError, asyncio.TimeoutError) as e:
            row["error"] = str(e).splitlines()[0][:300]
            finished = time.time()
            row["exit_codes"] = list(await asyncio.gather(*(p.stop(STOP_GRACE_SECONDS) for p in swarm.training_peers)))
        after = [bridge.traffic(i) for i in range(2)]
        curve = [{"epoch": e.epoch, "seconds": round(e.time - started, 2), "samples": e.epoch * target,
                  "val_loss": e.val_loss} for e in swarm.peer(0).events
                 if isinstance(e, EpochEnded) and e.val_loss is not None]
    summaries = [json.loads(path.read_text()) for path in sorted((work / label).glob("peer-*.json"))]
    wire = [{key: a[key] - b[key] for key in ("tx", "rx")} for a, b in zip(after, before)]
    samples = sum(summary["samples"] for summary in summaries)
    exported = [summary.get("averaging_sent_bytes", 0) for summary in summaries]
    phases = [summary["phase_seconds"] for summary in summaries]
    busy = sum(sum(p.values()) for p in phases)
    row.update(
        seconds=round(finished - started, 1), samples=samples, wire_bytes=wire, exported_sent_bytes=exported,
        exported_over_wire=[round(e / w["tx"], 3) if w["tx"] else None for e, w in zip(exported, wire)],
        wire_bytes_per_sample=round(sum(w["tx"] for w in wire) / samples, 1) if samples else None,
        communication_share=round(sum(p.get("averaging", 0.0) for p in phases) / busy, 3) if busy else None,
        val_loss_final=curve[-1]["val_loss"] if curve else None, curve=curve,
        averaging_rounds=[summary["averaging_rounds"] for summary in summaries],
        state_downloads=[summary["state_downloads"] for summary in summaries],
    )
    run.log(f"{rate} {setup}: {row['seconds']}s, {samples} samples, {row['wire_bytes_per_sample']} wire B/sample, "
            f"exported/wire {row['exported_over_wire']}, communication {row['communication_share']}, "
            f"val loss {row['val_loss_final']}" + (f", error {row['error']}" if row["error"] else ""))
    return row


def compare(runs: List[dict], target: float) -> Dict[str, Dict[str, dict]]:
    compared: Dict[str, Dict[str, dict]] = {}
    for rate in dict.fromkeys(run["rate"] for run in runs):
        at_rate = {run["setup"]: run for run in runs if run["rate"] == rate and run["curve"]}
        if not at_rate:
            continue
        equal = min(run["curve"][-1]["samples"] for run in at_rate.values())
        baseline = at_rate.get("sync-fp32")
        base_loss = interpolate(baseline["curve"], equal) if baseline else None
        base_time = time_to(baseline["curve"], target) if baseline else None
        rows = {}
        for setup, run in at_rate.items():
            loss, reached = interpolate(run["curve"], equal), time_to(run["curve"], target)
            rows[setup] = {
                "wire_bytes_per_sample_vs_sync_fp32": common.rounded(
                    baseline["wire_bytes_per_sample"] / run["wire_bytes_per_sample"], 1)
                if baseline and run["wire_bytes_per_sample"] else None,
                "equal_samples": equal, "val_loss_at_equal_samples": common.rounded(loss, 4),
                "val_loss_vs_sync_fp32": common.rounded(loss / base_loss, 4) if loss and base_loss else None,
                "time_to_target_seconds": reached,
                "speedup_vs_sync_fp32": common.rounded(base_time / reached, 2) if base_time and reached else None,
            }
        compared[rate] = rows
    return compared


def plot(runs: List[dict], target: float, path: Path) -> Optional[str]:
    """Validation loss against wall time, one panel per rate; None, or why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'swarmtrain[benchmarks]')"
    rates = list(dict.fromkeys(run["rate"] for run in runs))
    figure, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False, sharey=True)
    colors = {setup: f"C{index}" for index, setup in enumerate(SETUPS)}  # the same in every panel
    for axis, rate in zip(axes[0], rates):
        for run in sorted((run for run in runs if run["rate"] == rate and run["curve"]),
                          key=lambda run: list(SETUPS).index(run["setup"])):
            axis.plot([p["seconds"] for p in run["curve"]], [p["val_loss"] for p in run["curve"]],
                      marker="o", markersize=3, label=run["setup"], color=colors[run["setup"]])
        axis.axhline(target, color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"2 peers, {rate} per link")
        axis.set_xlabel("wall time since both peers were ready (s)")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--rates", default=None, help="comma-separated tc rates (default 20mbit,100mbit; smoke 100mbit)")
    p.add_argument("--setups", default=None, help=f"comma-separated, of {', '.join(SETUPS)} (default all)")
    p.add_argument("--samples", type=int, default=None, help="samples the swarm trains per run")
    p.add_argument("--target-batch-size", type=int, default=128, help="the sync setups' target batch")
    p.add_argument("--diloco-factor", type=int, default=None,
                   help="the DiLoCo setups' target batch, in multiples of the sync setups' (default 8; smoke 4)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per local step (default 32; full 16)")
    p.add_argument("--max-seconds", type=float, default=None, help="a run's time limit (default 600; full 3600)")
    p.add_argument("--target-val-loss", type=float, default=None,
                   help="the loss time-to-target is measured at (default: the highest final loss of all runs)")
    args = p.parse_args(argv)
    mode = args.mode
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run = common.Run(NAME, mode, args.output)
    rates = (args.rates or common.by_mode(mode, smoke="100mbit", quick="20mbit,100mbit", full="20mbit"))
    setups = (args.setups or common.by_mode(mode, smoke="sync-fp32,diloco-int4-ef", quick="",
                                            full=",".join(FULL_SETUPS))).split(",")
    setups = [setup for setup in SETUPS if setup in setups or setups == [""]]
    batch_size = args.batch_size or common.by_mode(mode, smoke=32, quick=32, full=16)
    target_batch_size = common.by_mode(mode, smoke=64, quick=args.target_batch_size, full=args.target_batch_size)
    factor = args.diloco_factor or common.by_mode(mode, smoke=4, quick=8, full=32)
    # full: 128 inner steps a round (batch 16, 2 peers), and 16 rounds of it
    samples = args.samples or common.by_mode(mode, smoke=256, quick=4096, full=16 * target_batch_size * factor)
    settings = {
        "task": common.by_mode(mode, smoke="bytelm-tiny", quick="bytelm", full="bytelm"),
        "samples": samples, "batch_size": batch_size, "target_batch_size": target_batch_size,
        "max_seconds": args.max_seconds or common.by_mode(mode, smoke=240, quick=600, full=3600),
        "cores": sorted(os.sched_getaffinity(0))[:2] * 2,
    }
    settings["diloco_target_batch_size"] = settings["target_batch_size"] * factor
    settings["diloco_inner_steps"] = settings["diloco_target_batch_size"] // batch_size  # a peer never idles
    results = {"task": settings["task"], "samples": samples, "target_batch_size": settings["target_batch_size"],
               "diloco_target_batch_size": settings["diloco_target_batch_size"], "rates": rates.split(","),
               "setups": setups, "runs": [], "skipped": None}
    if netns.finished_without_namespaces(run, NAME, results):
        return 0

    runs: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-uplink-") as work, netns.Bridge(2) as bridge:
        for index, rate in enumerate(rates.split(",")):
            for setup in common.interleaved(setups, index):
                runs.append(asyncio.run(one_run(run, bridge, rate, setup, settings, Path(work))))
    finished = [r["val_loss_final"] for r in runs if r["val_loss_final"] is not None]
    target = args.target_val_loss or (max(finished) if finished else float("nan"))
    compared = compare(runs, target)
    png = args.output.with_suffix(".png")
    why_no_plot = plot(runs, target, png)
    if why_no_plot:
        run.note(f"no plot: {why_no_plot}")
    failed = [f"{r['rate']} {r['setup']}" for r in runs if r["error"] or any(code != 0 for code in r["exit_codes"])]
    if failed:
        run.note(f"runs that did not end cleanly: {', '.join(failed)}")
    results.update(runs=runs, target_val_loss=target, compared=compared,
                   plot=None if why_no_plot else png.name)
    parts = []
    for rate, rows in compared.items():
        parts.append(f"{rate}: " + ", ".join(
            f"{setup} {common.fmt_ratio(row['wire_bytes_per_sample_vs_sync_fp32'])}x fewer bytes/loss "
            f"{common.fmt_ratio(row['val_loss_vs_sync_fp32'])}/speedup {common.fmt_ratio(row['speedup_vs_sync_fp32'])}"
            for setup, row in rows.items()))
    run.finish(results, f"{NAME} (2 peers, vs sync-fp32: wire bytes per sample, val loss at equal samples, time to "
                        f"val loss {target:.3f}): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
