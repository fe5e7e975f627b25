"""Gradient codecs on real gradients of the default task: bytes on the wire, error, and round time.

For each codec `--grad-compression` accepts (none, fp16, scaled-fp16, uint8, quantile8,
adaptive, and blockwise8 when bitsandbytes is importable), on gradients from real backward
passes of the default task (`bytelm`; `bytelm-tiny` in smoke mode), after a few training steps:

- ``payload_ratio``: the serialized size of one peer's gradients under the codec, divided by
  their float32 size (`averaging.codecs.compression.payload_bytes`, the number the metrics use),
  and ``bytes_per_value``, that size per fp32 value;
- ``rel_l2_error`` and ``max_abs_error``: one compress/decompress round trip of the whole
  gradient, ||g' - g|| / ||g|| and max |g' - g| (worst over the sampled steps);
- round time of a 2-peer averaging round on 127.0.0.1: one `DecentralizedAverager` pair per
  codec (our codec object from `averaging.codecs.compression.make_codec`, our request timeout),
  all alive at once, rounds interleaved across codecs (forward, then reversed); each round is
  split into matchmaking and all-reduce where the group is assembled, as in allreduce_link.

- error feedback: over ``--feedback-rounds`` consecutive real gradients (the task keeps training
  between them), the error of the accumulated update, ||sum of what was received - sum of the
  gradients|| / ||sum of the gradients||, for each lossy codec as it is and, for those error
  feedback runs with (int8, int4, topk), with it (`averaging.pipeline.error_feedback.encode_with_feedback`).

Besides the codecs by name, the top-k variants of TOPK_VARIANTS (`topk` itself has the defaults:
`--topk-fraction` 0.01, `--topk-value-bits` 4, `--topk-chunk` 256): their sizes and errors, not timed in
rounds unless named in ``--round-codecs``.

On loopback the wire is nearly free, so the all-reduce time mostly shows what encoding and
decoding cost; over a slow link the payload ratio is what matters (see allreduce_link).

Usage (from the repository root)::

    python -m benchmarks.compression --quick
    python -m benchmarks.compression            # more gradient samples and rounds
    python -m benchmarks.compression --smoke    # bytelm-tiny; for tests

JSON ``results``: ``task``, ``parameters``, ``fp32_bytes``, ``gradient_samples``, ``rounds``,
``matchmaking_seconds``, ``skipped`` (codec -> reason), and ``codecs.<name>``: ``payload_bytes``,
``payload_ratio``, ``bytes_per_value``, ``rel_l2_error``, ``max_abs_error``, ``rounds_ok``, ``rounds_failed``,
``round_seconds``, ``matchmaking_seconds``, ``allreduce_seconds`` (``{median, min, max, n}``),
``allreduce_over_none`` (per-round ratio to the ``none`` codec's all-reduce, ``{median, ...}``); the round
fields are absent for codecs left out of ``--round-codecs`` (listed in ``round_codecs``).
``feedback_rounds``, and for lossy codecs ``accumulated_error`` (without error feedback) and, for int8, int4
and topk (and its variants), ``accumulated_error_with_feedback``.
"""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Dict, List

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from averaging.config import CODECS, FEEDBACK_CODECS  # noqa: E402 (after the path fix above)
from benchmarks import common

NAME = "compression"
TOPK_VARIANTS = {"topk-2bit": {"topk_value_bits": 2}, "topk-8bit": {"topk_value_bits": 8},
                 "topk-16bit": {"topk_value_bits": 16}, "topk-4pct": {"topk_fraction": 0.04}}
"""Top-k with other value bits at the default chunk, and at 4% (about the bytes of the int32-index top-k at 1%):
name -> make_codec's arguments."""


def real_gradients(task_name: str, train_steps: int, samples: int, seed: int = 0):
    """Gradients (lists of CPU float32 tensors, one per parameter) of `samples` backward passes,
    taken after `train_steps` optimizer steps of the task's own optimizer."""
    import torch

    from peer.tasks import load_task
    from peer.tasks.data import make_loader
    from peer.tasks.order import DataOrder

    task = load_task(task_name)
    torch.manual_seed(seed)
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    train_set = task.build_train_dataset()
    batches = iter(make_loader(train_set, batch_size=task.batch_size, workers=0,
                                  order=DataOrder(len(train_set), seed), collate_fn=task.collate_fn))
    grads = []
    for step in range(train_steps + samples):
        loss = task.loss_fn(model, next(batches))
        loss.backward()
        if step >= train_steps:
            grads.append([p.grad.detach().clone().float() for p in model.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad()
    return grads, sum(p.numel() for p in model.parameters())


def round_trip_errors(grads: List, codec) -> Dict[str, float]:
    import torch
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from averaging import adapter

    adapter.install()  # the numpy 2 fix the 8-bit codecs need to decode, as in every peer
    rel, worst = [], 0.0
    for sample in grads:
        original = torch.cat([g.flatten() for g in sample])
        restored = torch.cat([
            deserialize_torch_tensor(codec.compress(g, CompressionInfo.from_tensor(g, key=i), allow_inplace=False))
            .float().flatten() for i, g in enumerate(sample)])
        diff = restored - original
        rel.append(float(diff.norm() / original.norm().clamp_min(1e-30)))
        worst = max(worst, float(diff.abs().max()))
    return {"rel_l2_error": max(rel), "max_abs_error": worst}


def accumulated_error(sequence: List, codec, feedback: bool) -> float:
    """||sum of what the receivers decoded - sum of the gradients|| / ||sum of the gradients||, one codec round
    per gradient of `sequence`, each parameter's tensor encoded on its own."""
    import torch
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from averaging.pipeline.error_feedback import encode_with_feedback

    residuals = [torch.zeros_like(g) for g in sequence[0]]
    meant = [torch.zeros_like(g) for g in sequence[0]]
    received = [torch.zeros_like(g) for g in sequence[0]]
    for sample in sequence:
        for index, gradient in enumerate(sample):
            if feedback:
                decoded, residuals[index] = encode_with_feedback(gradient, residuals[index], codec)
            else:
                decoded = deserialize_torch_tensor(codec.compress(gradient, CompressionInfo.from_tensor(gradient)))
            meant[index] += gradient
            received[index] += decoded.float()
    error = torch.cat([(r - m).flatten() for r, m in zip(received, meant)])
    return float(error.norm() / torch.cat([m.flatten() for m in meant]).norm().clamp_min(1e-30))


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--task", default=None, help="task whose gradients are used (default bytelm; smoke bytelm-tiny)")
    p.add_argument("--rounds", type=int, default=None, help="measured averaging rounds per codec")
    p.add_argument("--matchmaking-seconds", type=float, default=1.0, help="matchmaking window of every round")
    p.add_argument("--feedback-rounds", type=int, default=None,
                   help="consecutive gradients the error feedback comparison runs over (default 20; smoke 3)")
    p.add_argument("--round-codecs", default=None,
                   help="comma-separated codecs to time in averaging rounds (default all; smoke: none,uint8)")
    args = p.parse_args(argv)
    mode = args.mode
    task_name = args.task or common.by_mode(mode, smoke="bytelm-tiny", quick="bytelm", full="bytelm")
    rounds = args.rounds or common.by_mode(mode, smoke=1, quick=3, full=8)
    warmup = common.by_mode(mode, smoke=0, quick=1, full=1)
    train_steps, samples = common.by_mode(mode, smoke=(1, 1), quick=(4, 3), full=(20, 8))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run = common.Run(NAME, mode, args.output)

    import hivemind
    import torch

    from averaging.codecs.compression import make_codec, payload_bytes
    from averaging.config import BITSANDBYTES_INSTALL, bitsandbytes_available
    from benchmarks.allreduce_worker import wait_for_group

    torch.set_num_threads(1)  # two averagers and two DHTs share the machine with this process
    feedback_rounds = args.feedback_rounds or common.by_mode(mode, smoke=3, quick=20, full=20)
    grads, parameters = real_gradients(task_name, train_steps, max(samples, feedback_rounds))
    grads, sequence = grads[:samples], grads
    fp32_bytes = sum(g.numel() * 4 for g in grads[0])
    skipped = {}
    codecs = {}
    for name in CODECS:
        if name == "blockwise8" and not bitsandbytes_available():
            skipped[name] = f"bitsandbytes is not importable ({BITSANDBYTES_INSTALL})"
            run.note("blockwise8 skipped: bitsandbytes is not importable")
            continue
        codecs[name] = make_codec(name)
    for name, settings in TOPK_VARIANTS.items():
        codecs[name] = make_codec("topk", **settings)
    results: Dict[str, dict] = {}
    for name, codec in codecs.items():
        size = payload_bytes(grads[0], codec)
        results[name] = {"payload_bytes": size, "payload_ratio": round(size / fp32_bytes, 4),
                         "bytes_per_value": float(f"{4 * size / fp32_bytes:.4g}"),
                         **{k: float(f"{v:.4g}") for k, v in round_trip_errors(grads, codec).items()}}
        if name != "none":
            results[name]["accumulated_error"] = float(f"{accumulated_error(sequence, codec, False):.4g}")
        if name in FEEDBACK_CODECS or name in TOPK_VARIANTS:
            results[name]["accumulated_error_with_feedback"] = float(
                f"{accumulated_error(sequence, codec, True):.4g}")

    wanted = (args.round_codecs or common.by_mode(mode, smoke="none,uint8", quick="", full="")).split(",")
    timed = {name: codec for name, codec in codecs.items() if name in wanted or (wanted == [""] and name in CODECS)}
    localhost = ["/ip4/127.0.0.1/tcp/0"]
    dhts, averagers = [], {}
    timings: Dict[str, List[dict]] = {name: [] for name in timed}
    try:
        dhts.append(hivemind.DHT(start=True, host_maddrs=localhost))
        dhts.append(hivemind.DHT(start=True, host_maddrs=localhost, initial_peers=dhts[0].get_visible_maddrs()))
        for name, codec in timed.items():
            averagers[name] = [
                hivemind.averaging.DecentralizedAverager(
                    [g.clone() for g in grads[-1]], dht, prefix=f"bench_codec_{name.replace('-', '_')}",
                    compression=codec, min_matchmaking_time=args.matchmaking_seconds,
                    request_timeout=min(3.0, args.matchmaking_seconds / 2), start=True)
                for dht in dhts]
        timeout = args.matchmaking_seconds + 60
        for r in range(warmup + rounds):
            for name in common.interleaved(list(timed), r):
                scheduled = time.time() + args.matchmaking_seconds
                started = time.time()
                controls = [a.step(scheduled_time=scheduled, timeout=timeout, wait=False, require_trigger=True)
                            for a in averagers[name]]
                deadline = time.monotonic() + timeout
                for control in controls:
                    wait_for_group(control, deadline)
                grouped = time.time()
                try:
                    for control in controls:
                        control.allow_allreduce()
                    groups = [c.result(max(0.1, deadline - time.monotonic())) for c in controls]
                    ok = all(g is not None and len(g) == 2 for g in groups)
                    error = None
                except BaseException as e:  # a failed round is a result
                    ok, error = False, f"{type(e).__name__}: {e}"[:200]
                done = time.time()
                if r >= warmup:
                    timings[name].append({"ok": ok, "error": error, "round": r, "round_seconds": done - started,
                                          "matchmaking_seconds": grouped - started,
                                          "allreduce_seconds": done - grouped})
                run.log(f"round {r} {name:>11}: matchmaking {grouped - started:.2f}s all-reduce {done - grouped:.3f}s "
                        f"{'ok' if ok else 'FAILED ' + str(error)}")
    finally:
        from dht.node import quiet_dht_logs, shutdown_dht
        from peer.telemetry.logs import silence_hivemind

        silence_hivemind()  # teardown races between averagers and DHTs print tracebacks that mean nothing here
        for dht in dhts:
            quiet_dht_logs(dht)
        for pair in averagers.values():
            for averager in pair:
                try:
                    averager.shutdown()
                except Exception:
                    pass
        for dht in dhts:
            shutdown_dht(dht)

    reference = {t["round"]: t["allreduce_seconds"] for t in timings.get("none", []) if t["ok"]}
    for name, rows in timings.items():
        good = [t for t in rows if t["ok"]]
        results[name].update(
            rounds_ok=len(good), rounds_failed=len(rows) - len(good),
            errors=[t["error"] for t in rows if t["error"]][:3],
            **{field: common.stats((t[field] for t in good), 4)
               for field in ("round_seconds", "matchmaking_seconds", "allreduce_seconds")},
            allreduce_over_none=common.stats(common.paired_ratios(
                [t["allreduce_seconds"] for t in good if t["round"] in reference],
                [reference[t["round"]] for t in good if t["round"] in reference]), 3),
        )
    document = {
        "task": task_name, "parameters": parameters, "fp32_bytes": fp32_bytes, "gradient_samples": samples,
        "train_steps_before_sampling": train_steps, "rounds": rounds, "warmup_rounds": warmup,
        "matchmaking_seconds": args.matchmaking_seconds, "round_codecs": list(timed), "skipped": skipped,
        "feedback_rounds": feedback_rounds, "codecs": results,
    }
    failed = sum(r.get("rounds_failed", 0) for r in results.values())
    if failed:
        run.note(f"{failed} averaging round(s) failed; see codecs.<name>.errors")
    parts = [f"{name} {row['payload_ratio']:.{2 if row['payload_ratio'] >= 0.1 else 4}f}x/err "
             f"{row['rel_l2_error']:.1e}/ar "
             f"{common.fmt_ratio(row.get('allreduce_over_none', {}).get('median'))}" for name, row in results.items()]
    feedback = [f"{name} {row['accumulated_error']:.1e} -> {row['accumulated_error_with_feedback']:.1e}"
                for name, row in results.items() if "accumulated_error_with_feedback" in row]
    line = (f"{NAME} ({task_name} gradients, {parameters / 1e6:.2f}M params; payload vs fp32 / rel L2 error / "
            f"loopback all-reduce time vs none): " + ", ".join(parts)
            + (f"; skipped {', '.join(skipped)}" if skipped else "")
            + f"; error of the update accumulated over {feedback_rounds} rounds, without -> with error feedback: "
            + ", ".join(feedback))
    run.finish(document, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
