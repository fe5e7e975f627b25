"""Writes the Grafana dashboards under deploy/grafana/dashboards/ as JSON: dashboards as code.

Edit this file, run `python deploy/grafana/generate_dashboards.py`, and commit both the
script and the JSON; tests/meta/test_deploy.py fails when they differ. Plain Python and the
standard library only, so no new dependency. Queries may name only contract metrics:
those of monitoring/metrics.py (plus `up`) for job="peer", and the swarm_* metrics of
monitoring/swarm_metrics.py for job="monitor". The tests check that, and run every query
against a real Prometheus scraping a live swarm.

job="peer" is every training peer (the compose service `peer`, found by DNS), labelled by
scrape address (`instance`). job="monitor" is `peer monitor`: it reads the DHT records of
all peers, including those Prometheus cannot reach (client mode, behind NAT, elsewhere),
and labels its per-peer series with the short peer id (`peer`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # uid fixed in provisioning/datasources/
GRID_WIDTH = 24
PEERS = 'job="peer"'
MONITOR = 'job="monitor"'
RATE = "$__rate_interval"


def target(expr: str, legend: str = "", instant: bool = False) -> Dict:
    """One PromQL query of a panel; instant queries are shown as tables."""
    result = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        result.update(instant=True, range=False, format="table")
    else:
        result.update(instant=False, range=True)
    return result


def timeseries(title: str, description: str, targets: List[Dict], unit: str = "short", stack: bool = False,
               width: int = 12, height: int = 8, repeat: Optional[str] = None) -> Dict:
    custom: Dict = {"lineWidth": 1, "fillOpacity": 60 if stack else 10, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    panel = {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "_size": (width, height),
    }
    if repeat:
        # Full width: Grafana splits the row among the clones, up to maxPerRow per row.
        panel.update(repeat=repeat, repeatDirection="h", maxPerRow=4)
    return panel


def stat(title: str, description: str, targets: List[Dict], unit: str = "short", width: int = 6) -> Dict:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "graphMode": "area", "colorMode": "value"},
        "_size": (width, 4),
    }


def table(title: str, description: str, targets: List[Dict], transformations: List[Dict], width: int = 12,
          height: int = 8, unit: str = "short") -> Dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "transformations": transformations,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"showHeader": True},
        "_size": (width, height),
    }


def hide_columns(*names: str) -> Dict:
    return {"id": "organize", "options": {"excludeByName": {name: True for name in names}}}


def instance_variable(multi: bool) -> Dict:
    """The `peer` variable: one training peer, by its scrape address (instance label)."""
    query = f"label_values(peer_global_epoch{{{PEERS}}}, instance)"
    return {
        "type": "query",
        "name": "peer",
        "label": "peer",
        "datasource": DATASOURCE,
        "query": query,  # the plain-string form: every Grafana version since 7 reads it
        "definition": query,
        "refresh": 2,  # on time range change: replicas come and go with --scale
        "sort": 1,
        "multi": multi,
        "includeAll": multi,
        "current": {"text": "All", "value": "$__all"} if multi else {},
        "options": [],
    }


def dashboard(uid: str, title: str, description: str, panels: List[Dict], variables: List[Dict]) -> Dict:
    """Assign ids, reference ids and grid positions (left to right, wrapping at 24 columns)."""
    x = y = row_height = 0
    for number, panel in enumerate(panels, start=1):
        width, height = panel.pop("_size")
        if x + width > GRID_WIDTH:
            x, y, row_height = 0, y + row_height, 0
        panel["id"] = number
        panel["gridPos"] = {"x": x, "y": y, "w": width, "h": height}
        for index, query in enumerate(panel["targets"]):
            query["refId"] = chr(ord("A") + index)
        x, row_height = x + width, max(row_height, height)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["swarmtrain"],
        "timezone": "browser",
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "templating": {"list": variables},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["swarmtrain"], "asDropdown": True, "title": "swarmtrain"}],
        "panels": panels,
    }


def quantiles(by: str = "") -> List[Dict]:
    group = f"sum by ({by}le)" if by else "sum by (le)"
    return [
        target(f"histogram_quantile({q}, {group} (rate(peer_averaging_round_seconds_bucket{{{PEERS}}}[{RATE}])))",
               f"p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def swarm_overview() -> Dict:
    panels = [
        stat("Peers", "Peers of the swarm visible to the peers (max over peers; each counts itself).",
             [target(f"max(peer_swarm_peers{{{PEERS}}})")]),
        stat("Global epoch", "Highest global epoch reached by any peer.",
             [target(f"max(peer_global_epoch{{{PEERS}}})")]),
        stat("Swarm samples/s", "Training throughput of the whole swarm, as the peers report it.",
             [target(f"max(peer_swarm_samples_per_second{{{PEERS}}})")]),
        stat("Progress to target batch", "Samples accumulated in this global epoch / --target-batch-size.",
             [target(f"max(peer_target_progress_ratio{{{PEERS}}})")], unit="percentunit"),
        timeseries("Peers over time", "Peers each peer sees, and peers scraped by Prometheus.", [
            target(f"max(peer_swarm_peers{{{PEERS}}})", "visible to peers"),
            target(f'sum(up{{{PEERS}}})', "scraped"),
        ]),
        timeseries("Global epoch", "Global epoch per peer; a peer that lags behind downloads state to catch up.",
                   [target(f"peer_global_epoch{{{PEERS}}}", "{{instance}}")]),
        timeseries("Samples per second", "Swarm throughput reported by the peers, and the sum of local rates.", [
            target(f"max(peer_swarm_samples_per_second{{{PEERS}}})", "swarm (reported)"),
            target(f"sum(rate(peer_samples_total{{{PEERS}}}[{RATE}]))", "sum of local rates"),
        ]),
        timeseries("Progress to target batch", "Fraction of the target batch accumulated in the current epoch.",
                   [target(f"max(peer_target_progress_ratio{{{PEERS}}})", "progress")], unit="percentunit"),
        timeseries("Averaging rounds by outcome",
                   "Rounds per second over all peers: ok, partial, failed, timeout, skipped.",
                   [target(f"sum by (outcome) (rate(peer_averaging_rounds_total{{{PEERS}}}[{RATE}]))",
                           "{{outcome}}")], unit="ops", stack=True),
        timeseries("Averaging round duration", "Quantiles of attempted rounds (matchmaking and all-reduce).",
                   quantiles(), unit="s"),
        timeseries("Averaging payload", "Payload bytes per second after compression, over all peers "
                   "(computed from tensor sizes, not measured on the wire).", [
                       target(f"sum(rate(peer_averaging_payload_sent_bytes_total{{{PEERS}}}[{RATE}]))", "sent"),
                       target(f"sum(rate(peer_averaging_payload_received_bytes_total{{{PEERS}}}[{RATE}]))",
                              "received"),
                   ], unit="Bps"),
        timeseries("Averaging group size", "Peers in each peer's latest averaging group.",
                   [target(f"peer_averaging_group_size{{{PEERS}}}", "{{instance}}")]),
        timeseries("Peers in the DHT (peer monitor)", "Live peers with a record in the DHT, as `peer monitor` "
                   "reads them: includes peers Prometheus cannot scrape (client mode, behind NAT).", [
                       target(f"swarm_peers{{{MONITOR}}}", "in the DHT"),
                   ]),
        timeseries("Global epoch per peer (peer monitor)", "Every peer's last global epoch, from its DHT record.",
                   [target(f"swarm_peer_global_epoch{{{MONITOR}}}", "{{peer}}")]),
        timeseries("Samples per second per peer (peer monitor)", "Every peer's reported throughput, from its "
                   "DHT record.", [target(f"swarm_peer_samples_per_second{{{MONITOR}}}", "{{peer}}")]),
        timeseries("Swarm samples per second (peer monitor)", "Sum of the peers' reported throughput.",
                   [target(f"swarm_samples_per_second{{{MONITOR}}}", "swarm")]),
    ]
    return dashboard("swarmtrain-overview", "swarmtrain / Swarm overview",
                     "The whole swarm: peers, epochs, throughput, averaging rounds.", panels, [])


def bottlenecks() -> Dict:
    panels = [
        timeseries("Time split: $peer", "Seconds per second in each category on this peer, stacked; "
                   "the gap up to 1 is untimed time (other).", [
                       target(f"sum by (category) (rate(peer_category_seconds_total{{{PEERS}, instance=~\"$peer\"}}"
                              f"[{RATE}]))", "{{category}}"),
                   ], unit="percentunit", stack=True, width=GRID_WIDTH, repeat="peer"),
        table("Current bottleneck", "The category that dominates each peer's recent wall time (peer_bottleneck == 1). "
              "Missing peers have not trained long enough for a verdict.",
              [target(f"peer_bottleneck{{{PEERS}}} == 1", instant=True)],
              [hide_columns("Time", "Value", "__name__", "job")]),
        table("Time split now", "Fraction of wall time per category over the classifier's sliding window.",
              [target(f"peer_category_fraction{{{PEERS}}}", instant=True)],
              [{"id": "groupingToMatrix", "options": {"columnField": "category", "rowField": "instance",
                                                      "valueField": "Value"}}], unit="percentunit"),
        table("Slowest peers", "The five peers with the lowest local throughput (samples/s).",
              [target(f"bottomk(5, sum by (instance) (rate(peer_samples_total{{{PEERS}}}[{RATE}])))", instant=True)],
              [hide_columns("Time")]),
        table("Current bottleneck of every peer in the DHT (peer monitor)", "From the peers' DHT records, so it "
              "also covers peers Prometheus cannot scrape; `peer` is the short peer id.",
              [target(f"swarm_peer_bottleneck{{{MONITOR}}} == 1", instant=True)],
              [hide_columns("Time", "Value", "__name__", "job", "instance")]),
        timeseries("Communication share per peer", "Fraction of wall time spent averaging or downloading state.",
                   [target(f'peer_category_fraction{{{PEERS}, category="communication"}}', "{{instance}}")],
                   unit="percentunit"),
        timeseries("Preprocessing share per peer", "Fraction of wall time waiting for data or copying it "
                   "to the device; raise --data-workers where it is high.",
                   [target(f'peer_category_fraction{{{PEERS}, category="preprocessing"}}', "{{instance}}")],
                   unit="percentunit"),
        timeseries("Local samples per second per peer", "Throughput of each peer's own training loop.",
                   [target(f"sum by (instance) (rate(peer_samples_total{{{PEERS}}}[{RATE}]))", "{{instance}}")]),
        timeseries("p90 averaging round per peer", "Slow links show up here first.", [
            target(f"histogram_quantile(0.9, sum by (instance, le) (rate(peer_averaging_round_seconds_bucket"
                   f"{{{PEERS}}}[{RATE}])))", "{{instance}}"),
        ], unit="s"),
    ]
    return dashboard("swarmtrain-bottlenecks", "swarmtrain / Bottlenecks",
                     "Where the time goes on each peer: preprocessing, compute, communication.", panels,
                     [instance_variable(multi=True)])


def peer_detail() -> Dict:
    one = f'{PEERS}, instance="$peer"'
    panels = [
        timeseries("Phase breakdown", "Seconds per second in each training-loop phase (exclusive), stacked.",
                   [target(f"sum by (phase) (rate(peer_phase_seconds_total{{{one}}}[{RATE}]))", "{{phase}}")],
                   unit="percentunit", stack=True),
        timeseries("Loss", "Training loss of the latest local step, and the latest validation loss.", [
            target(f"peer_train_loss{{{one}}}", "train"),
            target(f"peer_validation_loss{{{one}}}", "validation"),
        ]),
        timeseries("Global epoch", "Global epoch of this peer.", [target(f"peer_global_epoch{{{one}}}", "epoch")]),
        timeseries("Samples and steps per second", "This peer's own training loop.", [
            target(f"rate(peer_samples_total{{{one}}}[{RATE}])", "samples/s"),
            target(f"rate(peer_local_steps_total{{{one}}}[{RATE}])", "steps/s"),
        ]),
        timeseries("Averaging rounds by outcome", "This peer's rounds per second by outcome.",
                   [target(f"sum by (outcome) (rate(peer_averaging_rounds_total{{{one}}}[{RATE}]))", "{{outcome}}")],
                   unit="ops", stack=True),
        timeseries("Averaging round duration", "Mean duration of this peer's attempted rounds.", [
            target(f"rate(peer_averaging_round_seconds_sum{{{one}}}[{RATE}]) / "
                   f"rate(peer_averaging_round_seconds_count{{{one}}}[{RATE}])", "mean"),
        ], unit="s"),
        timeseries("CPU", "CPU seconds per second of the training process (its DHT and worker processes "
                   "are not included).", [target(f"rate(process_cpu_seconds_total{{{one}}}[{RATE}])", "cpu")],
                   unit="percentunit"),
        timeseries("Memory", "Resident memory of the training process.",
                   [target(f"process_resident_memory_bytes{{{one}}}", "resident")], unit="bytes"),
        timeseries("GPU memory", "CUDA only: memory allocated by tensors, now and at peak. "
                   "CPU peers show nothing or 0 here.", [
                       target(f"peer_gpu_memory_allocated_bytes{{{one}}}", "allocated"),
                       target(f"peer_gpu_memory_peak_bytes{{{one}}}", "peak"),
                   ], unit="bytes"),
        timeseries("Untrusted peers and disk", "Other peers' contributions this peer's reducers dropped (by reason: "
                   "NaN/Inf, norm or direction far out, bad weight), peers it excluded, and checkpoints it could "
                   "not write (full, read-only or missing disk; it kept training).", [
                       target(f"sum by (reason) (increase(peer_dropped_contributions_total{{{one}}}[{RATE}]))",
                              "dropped: {{reason}}"),
                       target(f"increase(peer_exclusions_total{{{one}}}[{RATE}])", "peers excluded"),
                       target(f"increase(peer_checkpoint_failures_total{{{one}}}[{RATE}])", "checkpoint failures"),
                   ]),
        timeseries("Stragglers", "Rounds in which this peer's contribution came after its group's grace window and "
                   "was left out (a slow link or a busy machine; it still got the round's result), and whether it "
                   "reduces parts of the average for its groups (1) or stands aside, too slow for them (0).", [
                       target(f"increase(peer_late_contributions_total{{{one}}}[{RATE}])", "late contributions"),
                       target(f"peer_averaging_reducing{{{one}}}", "reduces for others"),
                   ]),
        table("Peer info", "Software version, device, averaging strategy and compression.",
              [target(f"peer_info{{{one}}}", instant=True)],
              [hide_columns("Time", "Value", "__name__", "job")]),
    ]
    return dashboard("swarmtrain-peer", "swarmtrain / Peer detail", "One peer: phases, loss, resources.",
                     panels, [instance_variable(multi=False)])


def build_dashboards() -> Dict[str, Dict]:
    """File name -> dashboard JSON model."""
    return {
        "swarm-overview.json": swarm_overview(),
        "bottlenecks.json": bottlenecks(),
        "peer-detail.json": peer_detail(),
    }


def render(model: Dict) -> str:
    return json.dumps(model, indent=2) + "\n"


def main() -> int:
    DASHBOARD_DIR.mkdir(parents=True, exist_ok=True)
    for name, model in build_dashboards().items():
        (DASHBOARD_DIR / name).write_text(render(model))
        print(f"wrote {DASHBOARD_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
