"""Print the Markdown tables of BENCHMARKS.md from the JSON files in benchmarks/results/.

`python -m benchmarks.report` reads whatever results exist and prints one section per
benchmark, with the hardware and date each was measured on and the command that reproduces
it. It measures nothing; paste its output into BENCHMARKS.md after a run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common

ORDER = ("local_overhead", "allreduce_link", "compression", "uplink", "diloco_recipes", "offload", "scaling",
         "one_state", "straggler", "peer_memory", "swarm_size")


def _f(value, digits: int = 3, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _e(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def header(doc: dict) -> str:
    hw = doc["hardware"]
    return (f"Measured {doc['started_at']} ({doc['mode']} mode, {doc['wall_seconds']:.0f} s) on {hw['cpu_model']}, "
            f"{hw['cpu_cores_usable']} cores, {hw['ram_gib']} GiB RAM, torch {hw['torch']}, hivemind {hw['hivemind']}, "
            f"CUDA: {hw['cuda_device'] or 'none'}; 1-minute load average {hw['load_average_1m_at_start']} at start, "
            f"{hw.get('load_average_1m_at_end')} at end. Reproduce: `{doc['command']}`")


def local_overhead(doc: dict) -> str:
    r = doc["results"]
    lines = ["| device | plain | daemon | daemon, monitoring off | hivemind | daemon/plain | hivemind/plain | "
             "monitoring on/off | goals met |", "|---|---|---|---|---|---|---|---|---|"]
    for device, row in r["devices"].items():
        if row.get("skipped"):
            lines.append(f"| {device} | skipped: {row['reason']} ||||||||")
            continue
        sps, ratio = row["samples_per_second"], row["ratios"]
        goals = row["goals"]
        lines.append(
            f"| {device} | {_f(sps['plain']['median'], 1)} | {_f(sps['daemon']['median'], 1)} | "
            f"{_f(sps['daemon_monitoring_off']['median'], 1)} | {_f(sps['hivemind']['median'], 1)} | "
            f"{_f(ratio['daemon_over_plain']['median'])} ({_f(ratio['daemon_over_plain']['min'], 2)}–"
            f"{_f(ratio['daemon_over_plain']['max'], 2)}) | {_f(ratio['hivemind_over_plain']['median'])} | "
            f"{_f(ratio['monitoring_on_over_off']['median'])} ({_f(ratio['monitoring_on_over_off']['min'], 2)}–"
            f"{_f(ratio['monitoring_on_over_off']['max'], 2)}) | "
            f"daemon ≥ 0.97: {'yes' if goals['daemon_meets'] else 'no'}; "
            f"monitoring ≤ 2%: {'yes' if goals['monitoring_meets'] else 'no'} |")
    measured = [row for row in r["devices"].values() if not row.get("skipped")]
    tasks = sorted({row.get("task", r["task"]) for row in measured}) or [r["task"]]
    options = "".join(f", {name} {value}" for name, value in (r.get("task_options") or {}).items())
    return (f"samples/s are medians over {r['rounds']} interleaved rounds ({', '.join(tasks)}{options}, "
            f"batch {r['batch_size']}, "
            f"{r['data_workers']} data workers, {r['torch_threads']} torch threads); ratios are medians of per-round "
            f"ratios (min–max in brackets).\n\n" + "\n".join(lines))


def allreduce_link(doc: dict) -> str:
    r = doc["results"]
    lines = ["| peers | MiB | link | raw TCP Mbit/s | bound s | config | matchmaking s | all-reduce s | "
             "all-reduce / bound | round s | ok / failed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(
            f"| {row['peers']} | {row['size_mib']:g} | {row['link']} | {_f(row['tcp_mbit'], 0)} | "
            f"{_f(row['bound_seconds'], 2)} | {row['config']} | {_f(row['matchmaking_seconds']['median'], 2)} | "
            f"{_f(row['allreduce_seconds']['median'], 2)} | {_f(row['allreduce_over_bound'], 2)} | "
            f"{_f(row['round_seconds']['median'], 2)} | {row['rounds_ok']} / {row['rounds_failed']} |")
    ratio_lines = ["| peers | MiB | link | ours/bare all-reduce | ours/bare round |", "|---|---|---|---|---|"]
    for row in r["ratios"]:
        ratio_lines.append(f"| {row['peers']} | {row['size_mib']:g} | {row['link']} | "
                           f"{_f(row['ours_over_bare_allreduce']['median'])} | "
                           f"{_f(row['ours_over_bare_round']['median'])} |")
    ours = r["ours"]["averager"] or {}
    return (f"Network: {r['network']} ({r['network_note']}). "
            f"Matchmaking window {r['settings']['matchmaking_seconds']} s "
            f"for both; ours = `{ours.get('class')}` with compression {ours.get('compression')}, "
            f"request_timeout "
            f"{ours.get('request_timeout')} s, all-reduce timeout {ours.get('allreduce_timeout')} s, "
            f"next_chunk_timeout "
            f"{ours.get('next_chunk_timeout')} s. Medians over {r['settings']['rounds']} rounds after "
            f"{r['settings']['warmup_rounds']} warm-up.\n\n" + "\n".join(lines) + "\n\n" + "\n".join(ratio_lines))


def compression(doc: dict) -> str:
    r = doc["results"]
    rounds = r.get("feedback_rounds")
    lines = ["| codec | payload vs fp32 | bytes per value | rel. L2 error | max abs error | loopback all-reduce s | "
             f"vs none | error after {rounds} rounds | with error feedback |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in r["codecs"].items():
        ar = row.get("allreduce_seconds", {}).get("median")
        per_value = row.get("bytes_per_value", 4 * row["payload_ratio"])  # results from before it was recorded
        lines.append(f"| {name} | {row['payload_ratio']:.3f} | {_f(per_value, 4)} | "
                     f"{row['rel_l2_error']:.2e} | "
                     f"{row['max_abs_error']:.2e} | "
                     f"{_f(ar, 3)} | {_f(row.get('allreduce_over_none', {}).get('median'))} | "
                     f"{_e(row.get('accumulated_error'))} | {_e(row.get('accumulated_error_with_feedback'))} |")
    for name, reason in r["skipped"].items():
        lines.append(f"| {name} | skipped: {reason} ||||||||")
    return (f"Real gradients of `{r['task']}` ({r['parameters']:,} parameters, {r['fp32_bytes']:,} fp32 bytes), "
            f"worst of {r['gradient_samples']} backward passes; 2-peer rounds on 127.0.0.1, medians of "
            f"{r['rounds']} interleaved rounds. The last two columns: the relative L2 error of the update "
            f"accumulated over {rounds} consecutive gradients of a training run, one codec round each.\n\n"
            + "\n".join(lines))


def uplink(doc: dict) -> str:
    r = doc["results"]
    if r.get("skipped"):
        return f"Skipped: {r['skipped']}."
    lines = [f"Two peers of `{r['task']}`, one core each, {r['samples']:,} samples per run; sync target batch "
             f"{r['target_batch_size']}, DiLoCo {r['diloco_target_batch_size']}. Target validation loss "
             f"{r['target_val_loss']:.3f}." + (f" Plot: `benchmarks/results/{r['plot']}`." if r.get("plot") else "")]
    for rate, rows in r["compared"].items():
        runs = {run["setup"]: run for run in r["runs"] if run["rate"] == rate}
        lines += ["", f"**{rate} per link**", "",
                  "| setup | wire B/sample | fewer bytes than sync-fp32 | exported / wire | communication share | "
                  f"val loss at {next(iter(rows.values()))['equal_samples']:,} samples | vs sync-fp32 | "
                  "s to target | speedup |", "|---|---|---|---|---|---|---|---|---|"]
        for setup, row in rows.items():
            run = runs[setup]
            exported = ", ".join(_f(value, 2) for value in run["exported_over_wire"])
            lines.append(
                f"| {setup} | {_f(run['wire_bytes_per_sample'], 0)} | "
                f"{_f(row['wire_bytes_per_sample_vs_sync_fp32'], 1)}x | "
                f"{exported} | {_f(run['communication_share'], 2)} | {_f(row['val_loss_at_equal_samples'], 3)} | "
                f"{_f(row['val_loss_vs_sync_fp32'], 3)} | {_f(row['time_to_target_seconds'], 1)} | "
                f"{_f(row['speedup_vs_sync_fp32'], 2)}x |")
    return "\n".join(lines)


def diloco_recipes(doc: dict) -> str:
    r = doc["results"]
    lines = ["| recipe (H:lr:mu:codec:warmup) | rounds | val loss | vs sync | fewer payload bytes than sync fp32 |",
             "|---|---|---|---|---|"]
    for row in r["recipes"]:
        lines.append(f"| {row['recipe']} | {row['rounds']} | {_f(row['final_val_loss'], 4)} | "
                     f"{_f(row['val_loss_vs_sync'], 4)} | {_f(row['fewer_bytes_than_sync_fp32'], 1)}x |")
    return (f"`{r['task']}` ({r['parameters']:,} parameters), {r['peers']} replicas, batch {r['batch_size']} a step, "
            f"{r['samples']:,} samples per run on {r['device']}; sync reference at target batch "
            f"{r['target_batch_size']}: validation loss {_f(r['reference']['final_val_loss'], 4)}.\n\n"
            + "\n".join(lines))


def offload(doc: dict) -> str:
    r = doc["results"]
    if r.get("skipped"):
        return f"Skipped: {r['reason']}."
    lines = ["| config | flags | peak device MiB | step s |", "|---|---|---|---|"]
    for name, row in r["configs"].items():
        peak = row["peak_device_memory_bytes"]["median"]
        lines.append(f"| {name} | {' '.join(row['flags']) or '-'} | {_f(peak / 2**20 if peak else None, 0)} | "
                     f"{_f(row['step_seconds']['median'], 3)} |")
    return "\n".join(lines) + "\n\nRatios: " + ", ".join(f"{k} {_f(v)}" for k, v in r["ratios"].items())


def scaling(doc: dict) -> str:
    r = doc["results"]
    lines = ["| peers | CPU sets | oversubscribed | reached | time to target s | startup s | epoch | speedup vs 1 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["scaling"]:
        lines.append(f"| {row['peers']} | {row['cpu_sets']} | {row['oversubscribed']} | {row['reached']} | "
                     f"{row.get('time_to_target_seconds', 'n/a')} | {row.get('startup_seconds', 'n/a')} | "
                     f"{row.get('epoch')} | {_f(r['speedup_vs_1'].get(str(row['peers'])))} |")
    text = (f"`{r['task']}` to val_loss ≤ {r['target_val_loss']}, target batch {r['target_batch_size']}, "
            f"{len(r['cores'])} cores, {r['cores_per_peer']} per peer, pinning: {r['pinning']}.\n\n" + "\n".join(lines))
    text += _scaling_curves(r)
    hiding = r["hiding"]
    if hiding.get("skipped"):
        return text + f"\n\nCommunication hiding: skipped ({hiding['reason']})."
    rates = hiding["local_samples_per_second"]
    hide = ["| run | peers | flags | local samples/s per peer | averaging rounds |", "|---|---|---|---|---|"]
    for row in hiding["runs"]:
        hide.append(f"| {row['name']} | {row['peers']} | {' '.join(row['flags'])} | "
                    f"{row['local_samples_per_second']} | "
                    f"{row['averaging_rounds']} |")
    return (text + f"\n\nCommunication hiding (target batch {r['hiding_target_batch_size']}, "
                   f"{r['hiding_seconds']:.0f} s "
            f"runs): alone {_f(rates['alone'], 1)}, delay_updates {_f(rates['delay_updates'], 1)}, blocking "
            f"{_f(rates['blocking'], 1)} samples/s; hiding ratio {_f(hiding['hiding_ratio'])}, blocking ratio "
            f"{_f(hiding['blocking_ratio'])}.\n\n" + "\n".join(hide))


def _scaling_curves(r: dict) -> str:
    """Per run, from its validation curve: when it first reached the target and 0.3 above it, and its loss at a few
    epochs (learning per step, whatever the speed)."""
    rows = [row for row in r["scaling"] if row.get("curve")]
    if not rows:
        return ""
    levels = (round(r["target_val_loss"] + 0.3, 2), r["target_val_loss"])
    epochs = (10, 15, 20, 25)

    def reached(curve, level):
        hit = next(((seconds, epoch) for seconds, epoch, loss in curve if loss <= level), None)
        return f"{hit[0]} s (epoch {hit[1]})" if hit else "not reached"

    def at(curve, epoch):
        return next((f"{loss:.3f}" for _, number, loss in curve if number == epoch), "-")

    lines = ["| peers | repeat | " + " | ".join(f"to val_loss {level}" for level in levels) + " | "
             + " | ".join(f"val_loss at epoch {epoch}" for epoch in epochs) + " |",
             "|---" * (2 + len(levels) + len(epochs)) + "|"]
    for row in rows:
        lines.append(f"| {row['peers']} | {row['repeat']} | "
                     + " | ".join(reached(row["curve"], level) for level in levels) + " | "
                     + " | ".join(at(row["curve"], epoch) for epoch in epochs) + " |")
    return "\n\nFrom each run's validation curve (seconds from the last peer's `ready`):\n\n" + "\n".join(lines)


def one_state(doc: dict) -> str:
    r = doc["results"]
    shares = ", ".join(f"{float(share):.3%} with {peers} peers" for peers, share in r["epoch_fraction"].items())
    return (f"`{r['task']}` ({r['parameters']:,} parameters; {r['digested_bytes'] / 2**20:.1f} MiB digested: "
            f"parameters and AdamW state), batch {r['batch_size']}, target batch {r['target_batch_size']}: "
            f"a digest takes "
            f"{_f(r['digest_seconds']['median'] * 1e3, 1)} ms, a step {_f(r['step_seconds']['median'] * 1e3, 0)} ms. "
            f"Share of an epoch: {shares} (goal under {r['goal']['epoch_fraction_max']:.0%}: "
            f"{'met' if r['goal']['meets'] else 'not met'}).")


def straggler(doc: dict) -> str:
    r = doc["results"]
    lines = ["| setup | round | fast peers' epochs/min | slow peer's | late rounds | stood aside | max parameter "
             "difference |", "|---|---|---|---|---|---|---|"]
    for row in r["runs"]:
        lines.append(f"| {row['setup']} | {row['round']} | {row.get('fast_epochs_per_minute')} | "
                     f"{row.get('slow_epochs_per_minute', '-')} | {row.get('late_rounds', '-')} | "
                     f"{row.get('stood_aside', '-')} | {row.get('max_parameter_difference')} |")
    ratios = "; ".join(f"{name} {_f(value['median'])} ({_f(value['min'], 2)}–{_f(value['max'], 2)})"
                       for name, value in r["ratios"].items())
    met = {True: "met", False: "not met", None: "not measured"}[r["goal"]["met"]]
    return (f"`{r['task']}`, one of three peers on a {r['slow_rate']} link, {r['measure_seconds']:.0f} s windows. "
            f"Ratios of the fast peers' epoch rates: {ratios} (goal slow-3/fast-2 ≥ {r['goal']['min_ratio']}: "
            f"{met}).\n\n" + "\n".join(lines))


def peer_memory(doc: dict) -> str:
    r = doc["results"]
    lines = ["| peer | role | processes | PSS MiB | USS MiB | RSS MiB | CPU s/s training | CPU s/s paused |",
             "|---|---|---|---|---|---|---|---|"]
    for peer in r["peers"]:
        for role, totals in sorted(peer["by_role"].items(), key=lambda item: -item[1]["pss_mib"]):
            lines.append(f"| {peer['name']} | {role} | {totals['processes']:g} | {totals['pss_mib']:.0f} | "
                         f"{totals['uss_mib']:.0f} | {totals['rss_mib']:.0f} | {_f(totals['cpu_training'], 2)} | "
                         f"{_f(totals['cpu_paused'], 2)} |")
        lines.append(f"| {peer['name']} | **all** | {len(peer['processes'])} | **{peer['pss_mib']:.0f}** | - | "
                     f"{peer['rss_mib']:.0f} | {_f(peer['cpu_training'], 2)} | {_f(peer['cpu_paused'], 2)} |")
    flags = " ".join(r["peer_args"]) or "none"
    return (f"`{r['task']}`, two peers, extra flags: {flags}; readings after {r['warm_epochs']} epochs, CPU over "
            f"{r['window_seconds']:g} s windows. **{r['pss_mib_per_peer']:.0f} MiB PSS per peer.**\n\n"
            + "\n".join(lines))


def _median_and_max(values: Optional[dict]) -> str:
    return "n/a" if values is None else f"{values['median']}, {values['max']}"  # None: written before it was measured


def swarm_size(doc: dict) -> str:
    r = doc["results"]
    lines = ["| peers | target batch | exit | ready s (median, max) | join s (median, max) | epochs/min | rounds | "
             "state downloads | final states | max parameter difference | PSS MiB/peer | clock warnings | "
             "asyncio errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["runs"]:
        rounds = ", ".join(f"{outcome} {count}" for outcome, count in sorted(row["rounds"].items()))
        lines.append(f"| {row['peers']} | {row['target_batch_size']} | {row['exit_code']} | "
                     f"{_median_and_max(row.get('ready_seconds'))} | "
                     f"{_median_and_max(row['join_seconds'])} | {row['epochs_per_minute']} | "
                     f"{rounds} | {row['state_downloads']} | {row['states']} | {_e(row['max_parameter_difference'])} | "
                     f"{row['pss_mib_per_peer']} | {row['clock_warnings']} | {row['asyncio_errors']} |")
    reasons = [f"- {row['peers']} peers: " + "; ".join(f"{count}x {reason}" for reason, count in
                                                  sorted(row["download_reasons"].items(), key=lambda item: -item[1]))
               for row in r["runs"] if row.get("download_reasons")]
    why = "\n\nWhy peers downloaded (their log lines):\n\n" + "\n".join(reasons) if reasons else ""
    groups = [f"- {row['peers']} peers: rounds by group size "
              + ", ".join(f"{size}: {count}" for size, count in row["group_sizes"].items())
              + f"; {row['distinct_groups']} distinct groups" for row in r["runs"] if row.get("group_sizes")]
    grouped = "\n\nGroups that averaged together:\n\n" + "\n".join(groups) if groups else ""
    flags = " ".join(["--data-workers 0", *r.get("peer_args", [])])
    return f"`{r['task']}`, `peer swarm {flags}`, {r['max_epochs']} epochs.\n\n" + "\n".join(lines) + why + grouped


def main() -> int:
    for name in ORDER:
        main_run = common.RESULTS_DIR / f"{name}.json"
        if not main_run.exists():
            print(f"## {name}\n\nNo results yet: run `python -m benchmarks.{name} --quick`.\n")
        # then the runs written beside it with --output <name>-<variant>.json (another task, another machine)
        for path in [main_run] * main_run.exists() + sorted(common.RESULTS_DIR.glob(f"{name}-*.json")):
            title = f"{name} ({path.stem.removeprefix(name + '-')})" if path != main_run else name
            doc = json.loads(path.read_text())
            print(f"## {title}\n\n{header(doc)}\n\n{globals()[name](doc)}\n\nSummary line: `{doc['summary']}`\n")
            if doc["notes"]:
                print("Notes: " + " ".join(f"{n.rstrip('.')}." for n in doc["notes"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
