"""Each benchmark's smallest configuration runs and writes the JSON fields its docstring documents.

These check that the scripts work, not what they measure: no timing is asserted. Each runs
as a subprocess (as a person would run it), in its own session so that a timeout kills
everything it started; allreduce_link cleans its network namespaces on SIGTERM.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ENVELOPE = {"benchmark", "mode", "command", "hardware", "started_at", "finished_at", "wall_seconds", "results",
            "notes", "summary"}
HARDWARE = {"cpu_model", "cpu_cores_online", "ram_gib", "torch", "hivemind", "date_utc", "cuda_device"}
STATS = {"median", "min", "max", "n"}


def run_benchmark(name: str, tmp_path: Path, *extra: str, timeout: float = 100.0) -> tuple:
    """Run `python -m benchmarks.<name> --smoke`; return its JSON results and its pid."""
    output = tmp_path / f"{name}.json"
    process = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--output", str(output), *extra],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # lets the script stop its workers and remove its namespaces
        try:
            out, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate(timeout=10)
        pytest.fail(f"benchmarks.{name} --smoke ran over {timeout:.0f}s:\n{out[-3000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever it left behind
        except (ProcessLookupError, PermissionError):
            pass
    assert process.returncode == 0, out[-3000:]
    document = json.loads(output.read_text())
    assert ENVELOPE <= document.keys()
    assert HARDWARE <= document["hardware"].keys()
    assert document["benchmark"] == name and document["mode"] == "smoke"
    assert document["summary"].startswith(name) and document["summary"] in out
    return document["results"], process.pid


@pytest.mark.timeout(120)
def test_local_overhead_smoke(tmp_path: Path):
    results, _ = run_benchmark("local_overhead", tmp_path)
    assert {"task", "batch_size", "data_workers", "rounds", "ways", "devices"} <= results.keys()
    cpu = results["devices"]["cpu"]
    assert set(cpu["samples_per_second"]) == {"plain", "daemon", "daemon_monitoring_off", "hivemind"}
    for ratio in ("daemon_over_plain", "hivemind_over_plain", "daemon_over_hivemind", "monitoring_on_over_off"):
        assert STATS <= cpu["ratios"][ratio].keys() and cpu["ratios"][ratio]["n"] >= 1
    assert {"daemon_meets", "monitoring_meets"} <= cpu["goals"].keys()
    assert "monitoring_overhead" in cpu and cpu["per_round"]
    assert cpu["precision"] == "fp32" and cpu["task"] == results["task"]
    # on a machine without CUDA the two GPU rows say why they are missing
    cuda_rows = {name: row for name, row in results["devices"].items() if name != "cpu"}
    assert set(cuda_rows) == {"cuda-fp32", "cuda-bf16"}
    assert all(row == {"skipped": True, "reason": "no CUDA device on this machine"} for row in cuda_rows.values())


@pytest.mark.timeout(150)
def test_local_overhead_smoke_with_a_transformers_model(tmp_path: Path):
    """--task hf-causal-lm with a tiny Llama configuration, reading the stdlib's sources as its text."""
    transformers = pytest.importorskip("transformers", reason="hf-causal-lm needs the hf extra")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                             bos_token_id=None, eos_token_id=None).save_pretrained(tmp_path / "tiny")
    results, _ = run_benchmark("local_overhead", tmp_path, "--task", "hf-causal-lm", "--task-option",
                               f"model_config={tmp_path / 'tiny'}", "--task-option", "seq_len=32", timeout=130.0)
    assert results["task"] == "hf-causal-lm" and results["task_options"]["seq_len"] == "32"
    cpu = results["devices"]["cpu"]
    assert cpu["task"] == "hf-causal-lm" and cpu["batch_size"] == results["batch_size"]
    assert STATS <= cpu["ratios"]["daemon_over_plain"].keys() and cpu["ratios"]["daemon_over_plain"]["n"] >= 1


@pytest.mark.timeout(150)
def test_allreduce_link_smoke(tmp_path: Path):
    results, pid = run_benchmark("allreduce_link", tmp_path, timeout=130)
    assert results["network"] in ("netns", "loopback-only")
    assert {"peers", "sizes_mib", "links", "rounds", "matchmaking_seconds",
            "grad_compression"} <= results["settings"].keys()
    assert results["ours"]["averager"]["class"] == "GradientAverager"
    assert results["bare"]["averager"]["class"] == "DecentralizedAverager"
    assert results["rows"] and results["ratios"]
    for row in results["rows"]:
        assert {"peers", "size_mib", "link", "config", "rounds_ok", "rounds_failed", "round_seconds",
                "matchmaking_seconds", "allreduce_seconds", "bound_seconds", "allreduce_over_bound",
                "tcp_mbit"} <= row.keys()
        assert STATS <= row["allreduce_seconds"].keys()
    assert {row["config"] for row in results["rows"]} == {"bare", "ours"}
    if results["network"] == "netns":
        assert any(row["bound_seconds"] for row in results["rows"])
    if os.geteuid() == 0:  # its namespaces (named after its pid) are gone
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
        assert not [name for name in listed if re.fullmatch(rf"stb{pid % 100000}(hub|p\d+)", name)], listed


@pytest.mark.timeout(120)
def test_compression_smoke(tmp_path: Path):
    results, _ = run_benchmark("compression", tmp_path)
    assert {"task", "parameters", "fp32_bytes", "codecs", "skipped", "round_codecs"} <= results.keys()
    expected = {"none", "fp16", "scaled-fp16", "uint8", "quantile8", "adaptive"}
    assert expected <= set(results["codecs"]) | set(results["skipped"])
    for row in results["codecs"].values():
        assert {"payload_bytes", "payload_ratio", "rel_l2_error", "max_abs_error"} <= row.keys()
    assert results["codecs"]["none"]["payload_ratio"] == pytest.approx(1.0, abs=0.01)
    assert results["codecs"]["none"]["rel_l2_error"] == 0
    for name in results["round_codecs"]:
        row = results["codecs"][name]
        assert {"rounds_ok", "rounds_failed", "round_seconds", "allreduce_seconds", "allreduce_over_none"} <= row.keys()


@pytest.mark.timeout(120)
def test_diloco_recipes_smoke(tmp_path: Path):
    results, _ = run_benchmark("diloco_recipes", tmp_path)
    assert {"task", "peers", "batch_size", "target_batch_size", "samples", "device", "parameters", "reference",
            "recipes"} <= results.keys()
    assert results["reference"]["curve"] and results["reference"]["curve"][-1]["samples"] == results["samples"]
    for row in results["recipes"]:
        assert {"recipe", "inner_steps", "outer_lr", "outer_momentum", "codec", "warmup", "rounds", "curve",
                "final_val_loss", "val_loss_vs_sync", "payload_bytes_per_round", "fewer_bytes_than_sync_fp32"
                } <= row.keys()
        assert len(row["curve"]) == row["rounds"]
    # a codec's round weighs less than an fp32 one
    by_codec = {row["codec"]: row["payload_bytes_per_round"] for row in results["recipes"]}
    assert by_codec["int4"] < by_codec["none"]


@pytest.mark.timeout(60)
def test_offload_smoke(tmp_path: Path):
    results, _ = run_benchmark("offload", tmp_path)
    if results["skipped"]:
        assert "reason" in results
    else:
        assert {"model", "configs", "ratios"} <= results.keys()
        assert set(results["configs"]) == {"baseline", "offload", "offload_delay"}


@pytest.mark.timeout(60)
def test_one_state_smoke(tmp_path: Path):
    results, _ = run_benchmark("one_state", tmp_path)
    assert {"task", "parameters", "digested_bytes", "batch_size", "target_batch_size", "rounds"} <= results.keys()
    assert STATS <= results["digest_seconds"].keys() and STATS <= results["step_seconds"].keys()
    assert set(results["epoch_fraction"]) == {"1", "4", "16"} and results["digested_bytes"] > 0
    assert results["goal"]["epoch_fraction_max"] == 0.01


@pytest.mark.timeout(120)
def test_scaling_smoke(tmp_path: Path):
    results, _ = run_benchmark("scaling", tmp_path)
    assert {"task", "target_val_loss", "target_batch_size", "cores", "cores_per_peer", "pinning", "scaling",
            "speedup_vs_1", "hiding"} <= results.keys()
    assert {row["peers"] for row in results["scaling"]} == {1, 2}
    for row in results["scaling"]:
        assert {"reached", "cpu_sets", "oversubscribed", "exit_codes", "epoch", "curve"} <= row.keys()
        seconds = [point[0] for point in row["curve"]]
        assert row["curve"] and seconds == sorted(seconds)  # every validated epoch, in order
    assert results["hiding"]["skipped"] in (True, False)


@pytest.mark.timeout(150)
def test_robustness_smoke(tmp_path: Path):
    results, _ = run_benchmark("robustness", tmp_path, "--seconds", "8", timeout=140.0)
    assert {"task", "target_batch_size", "seconds_per_run", "repeats", "runs", "summary", "goal"} <= results.keys()
    [row] = results["runs"]  # the attack alone: smoke mode runs no control
    assert row["attack"] == "scaled-1e4" and row["ratio"] is None
    assert {"epochs", "epochs_per_minute", "epochs_per_minute_after_exclusion", "seconds_to_exclusion",
            "wrongly_excluded", "ratio_after_exclusion", "exit_codes"} <= row.keys()
    assert set(results["summary"]) == {"scaled-1e4"}


@pytest.mark.timeout(200)
def test_uplink_smoke(tmp_path: Path):
    results, pid = run_benchmark("uplink", tmp_path, timeout=180)
    assert {"task", "samples", "target_batch_size", "diloco_target_batch_size", "rates", "runs",
            "skipped"} <= results.keys()
    if results["skipped"]:  # not root, or no iproute2: nothing ran
        assert results["runs"] == []
        return
    assert [(run["rate"], run["setup"]) for run in results["runs"]] == [("100mbit", "sync-fp32"),
                                                                        ("100mbit", "diloco-int4-ef")]
    for run in results["runs"]:
        assert run["error"] is None and run["exit_codes"] == [0, 0], run
        assert all(wire["tx"] > 0 and wire["rx"] > 0 for wire in run["wire_bytes"])
        assert all(0 < ratio for ratio in run["exported_over_wire"])
        assert run["curve"] and run["samples"] > 0
    compared = results["compared"]["100mbit"]
    assert compared["sync-fp32"]["wire_bytes_per_sample_vs_sync_fp32"] == 1.0
    assert compared["diloco-int4-ef"]["wire_bytes_per_sample_vs_sync_fp32"] > 1.0  # int4, once per 4 epochs
    plot = tmp_path / "uplink.png"
    assert plot.exists() == (results["plot"] is not None)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    assert not [name for name in listed if re.fullmatch(rf"stb{pid % 100000}(hub|p\d+)", name)], listed


@pytest.mark.timeout(150)
def test_pause_smoke(tmp_path: Path):
    results, _ = run_benchmark("pause", tmp_path, "--pause-seconds", "3", timeout=130)
    assert {"task", "rounds", "fresh_seconds", "resume_seconds", "ratio", "gpu", "skipped"} <= results.keys()
    assert [row["setup"] for row in results["rounds"]] == ["fresh", "resume"]
    resume = results["rounds"][1]
    assert resume["command_exits"] == [0, 0] and {"pause_seconds", "resuming_seconds", "downloaded"} <= resume.keys()
    assert STATS <= results["ratio"].keys()


@pytest.mark.timeout(150)
def test_peer_memory_smoke(tmp_path: Path):
    """Every process of each peer is read and named, and a peer's PSS is the sum over them."""
    results, _ = run_benchmark("peer_memory", tmp_path, timeout=130.0)
    assert {"task", "peer_args", "warm_epochs", "window_seconds", "peers", "pss_mib_per_peer"} <= results.keys()
    assert len(results["peers"]) == 2
    for peer in results["peers"]:
        counts = {role: totals["processes"] for role, totals in peer["by_role"].items()}
        # the daemon's defaults: two data workers; sync averaging's gradient and state averagers
        assert counts["training"] == counts["dht"] == counts["p2pd"] == 1 and counts["data_worker"] == 2, counts
        assert counts["averager"] == 2, counts
        assert peer["pss_mib"] == pytest.approx(sum(row["pss_mib"] for row in peer["processes"]), abs=0.2)
        assert all(0 < row["pss_mib"] <= row["rss_mib"] for row in peer["processes"])
        assert all(row["cpu_paused"] is not None and row["cpu_training"] is not None for row in peer["processes"])
    assert results["pss_mib_per_peer"] > 0


@pytest.mark.timeout(150)
def test_swarm_views_smoke(tmp_path: Path):
    """Simulated peers' records pass every node's validators: each reader sees all of them and the real peer."""
    results, _ = run_benchmark("swarm_views", tmp_path, timeout=130.0)
    assert {"task", "real_peers", "publishers", "sizes", "schedule", "status_runs", "monitor_refreshes",
            "key_generation_seconds", "windows", "by_size", "real_peer_exit_codes",
            "real_peer_epochs"} <= results.keys()
    assert [row["n"] for row in results["windows"]] == results["schedule"] == [0, 5]
    for row in results["windows"]:
        expected = row["n"] + results["real_peers"]
        assert row["complete"] and row["expected_peers"] == expected, row
        assert set(row["reader_saw"].values()) == {expected}
        assert row["status_peers"] == row["status_training_peers"] == [expected] * results["status_runs"]
        assert row["status_exit_codes"] == [0] * results["status_runs"]
        assert row["monitor_peers"] == row["claims_believed"] == expected
        for name in ("status_seconds", "monitor_refresh_seconds", "monitor_render_seconds", "claim_filter_ms"):
            assert STATS <= row[name].keys() and row[name]["n"] >= 1, name
        memory = row["memory_mib"]
        assert len(memory["real_peers"]) == results["real_peers"] and len(memory["publishers"]) == results["publishers"]
        assert all(0 < peer["training_pss"] <= peer["tree_pss"] for peer in memory["real_peers"])
        assert memory["status_tree_pss_max"] > 0 and row["publisher"]["failed"] == 0 and not row["errors"]
    assert row["record_bytes"]["peers"] > 0  # the last window's: 5 simulated PeerInfo records and the real peer's
    assert set(results["by_size"]) == {"5"} and "epoch_rate_ratio" in results["by_size"]["5"]
    assert results["real_peer_exit_codes"] == [0] * results["real_peers"]  # a graceful stop, with the records around


@pytest.mark.solo  # 8 peers on the CI's 2 cores: run alone, after the suite (.ci/run)
@pytest.mark.timeout(600)
def test_eight_peers_on_one_machine_end_as_one_with_no_clock_warning(tmp_path: Path):
    """`peer swarm --peers 8` through the swarm_size benchmark: every peer exits at --max-epochs with the same
    final parameters, bit for bit, and no peer takes a late record for a clock ahead (the machine is loaded)."""
    results, _ = run_benchmark("swarm_size", tmp_path, "--peers", "8", "--max-epochs", "3", timeout=540.0)
    assert results["task"] == "bytelm-tiny" and results["max_epochs"] == 3
    (row,) = results["runs"]
    assert row["peers"] == 8 and row["exit_code"] == 0, row
    assert row["exit_reasons"] == ["max_epochs"] * 8, row
    assert row["states"] == 1 and row["max_parameter_difference"] == 0.0, row
    assert row["clock_warnings"] == 0 and row["asyncio_errors"] == 0, row
    assert row["rounds"].get("ok", 0) > 0 and row["pss_mib_per_peer"] > 0, row
    assert not any(re.search(r"\d", reason) for reason in row["download_reasons"]), row  # counted by kind
    # every peer's ready and joined events were read (their times are the benchmark's to report, not this test's)
    assert None not in (row["ready_seconds"]["max"], row["join_seconds"]["max"], row["epochs_per_minute"]), row
