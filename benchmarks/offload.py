"""ZeRO-Offload and delayed updates on a >=100M-parameter model: peak device memory and step time (CUDA).

Three configurations of the optimizer `peer start` builds (`build_swarm_optimizer`), one peer
alone with a real DHT, on a byte-level transformer of the default task's architecture
(`peer.tasks.bytelm.ByteTransformer`, d_model 1024, 8 layers, about 101M parameters) with AdamW:

- ``baseline``: optimizer state on the device;
- ``offload``: ``--offload-optimizer`` (parameters' master copy and AdamW state in host memory);
- ``offload_delay``: ``--offload-optimizer --delay-updates`` (the step runs in the background).

The target batch equals one step's batch, so every step is a global epoch: the (lone) peer
skips averaging and runs its optimizer step every step, which is what offloading moves. Each
configuration runs in its own process (so that its peak memory is its own), in the order
ABC, CBA, ... for ``--rounds`` rounds. Reported per configuration: ``torch.cuda.max_memory_allocated``
(and reserved) during training, host peak RSS, and the median step time after warm-up.
Tokens are random bytes (memory and speed do not depend on the text).

On a machine without CUDA it prints that a GPU is needed and exits 0, writing a JSON with
``skipped: true`` and the reason. ``--device cpu`` runs the same code on the CPU (a check of
the code path, not a measurement; use it with a small ``--d-model``).

Usage (from the repository root)::

    python -m benchmarks.offload --quick     # 2 rounds of 20 steps
    python -m benchmarks.offload             # 3 rounds of 50 steps
    python -m benchmarks.offload --smoke     # on CPU: writes the skipped JSON

JSON ``results``: ``skipped`` (bool), ``reason`` (when skipped), ``device``, ``model`` (d_model,
layers, heads, context, parameters), ``batch_size``, ``steps``, ``warmup_steps``, ``rounds``, and
``configs.<baseline|offload|offload_delay>``: ``flags``, ``peak_device_memory_bytes``
(``{median, min, max, n}`` over rounds), ``peak_device_reserved_bytes``, ``peak_host_rss_bytes``,
``step_seconds``; and ``ratios``: ``offload_memory_over_baseline``, ``offload_delay_memory_over_baseline``,
``offload_step_over_baseline``, ``offload_delay_step_over_baseline`` (medians of per-round ratios).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common

NAME = "offload"
CONFIGS = {
    "baseline": [],
    "offload": ["--offload-optimizer"],
    "offload_delay": ["--offload-optimizer", "--delay-updates"],
}


def child(args) -> int:
    """Train one configuration for --steps steps; write peak memory and step times to --child-output."""
    import torch

    from averaging.api import Replica
    from averaging.config import AveragingConfig
    from averaging.strategies.factory import build_swarm_optimizer
    from dht.config import DHTConfig
    from dht.keys import SwarmKeys
    from dht.node import shutdown_dht, start_dht
    from peer.tasks.bytelm import VOCAB_SIZE, ByteTransformer

    device = torch.device(args.device)
    flags = CONFIGS[args.child]
    config = AveragingConfig(target_batch_size=args.batch_size, matchmaking_seconds=1.0,
                             offload_optimizer="--offload-optimizer" in flags, delay_updates="--delay-updates" in flags)
    torch.manual_seed(0)
    model = ByteTransformer(args.d_model, args.layers, args.heads, args.context).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    dht = start_dht(DHTConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    optimizer = None
    try:
        optimizer = build_swarm_optimizer(config, Replica(
            dht=dht, keys=SwarmKeys.for_run(f"bench-offload-{os.getpid()}"), params=model.parameters(),
            optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-4), batch_size=args.batch_size,
            client_mode=False,
        ))
        generator = torch.Generator().manual_seed(0)
        synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            tokens = torch.randint(0, VOCAB_SIZE, (args.batch_size, args.context + 1), generator=generator).to(device)
            started = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
            loss.backward()
            float(loss.detach())
            optimizer.step(batch_size=args.batch_size)
            optimizer.zero_grad()
            synchronize()
            times.append(time.perf_counter() - started)
        optimizer.wait_for_background_updates()
        result = {
            "parameters": parameters,
            "local_epoch": int(optimizer.local_epoch),
            "step_seconds": times[args.warmup_steps:],
            "peak_device_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "peak_device_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        shutdown_dht(dht)
    Path(args.child_output).write_text(json.dumps(result))
    return 0


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only checks the code path")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=None, help="steps per configuration per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--child-output", help=argparse.SUPPRESS)
    p.add_argument("--warmup-steps", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = args.mode
    args.steps = args.steps or common.by_mode(mode, smoke=4, quick=20, full=50)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else common.by_mode(
        mode, smoke=1, quick=5, full=10)
    rounds = args.rounds or common.by_mode(mode, smoke=1, quick=2, full=3)
    if args.child:
        return child(args)

    import torch

    run = common.Run(NAME, mode, args.output)
    if args.device == "cuda" and not torch.cuda.is_available():
        reason = "needs a CUDA GPU (peak device memory of ZeRO-Offload is a GPU measurement); none on this machine"
        run.note(reason)
        run.finish({"skipped": True, "reason": reason, "device": None}, f"{NAME}: skipped ({reason})")
        return 0
    if args.device != "cuda":
        run.note(f"--device {args.device}: a check of the code path, not a measurement of device memory")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    measured = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="swarmtrain-offload-") as tmp:
        for r in range(rounds):
            for name in common.interleaved(list(CONFIGS), r):
                out = Path(tmp) / f"{name}-{r}.json"
                cmd = [sys.executable, "-m", "benchmarks.offload", "--child", name, "--child-output", str(out),
                       "--device", args.device, "--d-model", str(args.d_model), "--layers", str(args.layers),
                       "--heads", str(args.heads), "--context", str(args.context), "--batch-size",
                       str(args.batch_size), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
                child_process = subprocess.run(cmd, cwd=common.REPO_ROOT, capture_output=True, text=True, timeout=600,
                                               env={**os.environ, "PYTHONPATH": str(common.REPO_ROOT)})
                if child_process.returncode != 0 or not out.exists():
                    run.note(f"{name} round {r} failed (exit {child_process.returncode}): "
                             f"{child_process.stderr.strip().splitlines()[-1:] }")
                    continue
                result = json.loads(out.read_text())
                measured[name].append({**result, "round": r})
                run.log(f"round {r} {name}: median step {common.stats(result['step_seconds'])['median']:.3f}s, "
                        f"peak device memory {result['peak_device_memory_bytes']}")
    parameters = next((m[0]["parameters"] for m in measured.values() if m), None)
    configs = {}
    for name, rows in measured.items():
        configs[name] = {
            "flags": CONFIGS[name],
            "rounds_ok": len(rows),
            "step_seconds": common.stats(common.stats(r["step_seconds"])["median"] for r in rows),
            **{field: common.stats(r[field] for r in rows)
               for field in ("peak_device_memory_bytes", "peak_device_reserved_bytes", "peak_host_rss_bytes")},
        }

    def ratio(name: str, field: str):
        by_round = {r["round"]: r for r in measured["baseline"]}
        pairs = [(r, by_round[r["round"]]) for r in measured[name] if r["round"] in by_round]
        if field == "step":
            values = [common.stats(a["step_seconds"])["median"] / common.stats(b["step_seconds"])["median"]
                      for a, b in pairs]
        else:
            values = [a["peak_device_memory_bytes"] / b["peak_device_memory_bytes"] for a, b in pairs
                      if a["peak_device_memory_bytes"] and b["peak_device_memory_bytes"]]
        return common.rounded(common.stats(values)["median"], 3)

    ratios = {
        "offload_memory_over_baseline": ratio("offload", "memory"),
        "offload_delay_memory_over_baseline": ratio("offload_delay", "memory"),
        "offload_step_over_baseline": ratio("offload", "step"),
        "offload_delay_step_over_baseline": ratio("offload_delay", "step"),
    }
    results = {
        "skipped": False, "device": args.device,
        "model": {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "context": args.context,
                  "parameters": parameters},
        "batch_size": args.batch_size, "steps": args.steps, "warmup_steps": args.warmup_steps, "rounds": rounds,
        "configs": configs, "ratios": ratios,
    }
    line = (f"{NAME} ({args.device}, {(parameters or 0) / 1e6:.0f}M params): peak device memory vs baseline: "
            f"offload {common.fmt_ratio(ratios['offload_memory_over_baseline'])}, offload+delay "
            f"{common.fmt_ratio(ratios['offload_delay_memory_over_baseline'])}; step time vs baseline: offload "
            f"{common.fmt_ratio(ratios['offload_step_over_baseline'])}, offload+delay "
            f"{common.fmt_ratio(ratios['offload_delay_step_over_baseline'])}")
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
