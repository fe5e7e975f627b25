"""What the daemon costs one peer that trains alone: its training loop against a plain PyTorch loop.

Same task (default `bytelm`), model initialization, DataLoader settings, batch size and
optimizer, trained four ways in one process, in interleaved windows (ABCD, DCBA, ...):

- ``plain``: a plain PyTorch loop: next batch, to device, forward, backward, ``float(loss)``,
  ``optimizer.step()``, ``zero_grad()``.
- ``daemon``: the real `peer.runtime.trainer.Trainer` (its ``run()`` loop, one call per window) with a
  real DHT on 127.0.0.1, the SyncOptimizer that `peer start` builds, and monitoring wired as
  `peer start` wires it (peer/runtime/builder.py): PhaseTimer feeding PeerMetrics and the BottleneckClassifier,
  MetricsObserver, HealthCheck, the /metrics exporter on 127.0.0.1 and the peer-record publisher.
  The target batch is so large that no averaging round ever happens.
- ``daemon_monitoring_off``: the same Trainer object with per-step monitoring removed: a timer
  whose phases are no-ops and an observer that does nothing (the exporter and publisher threads
  keep running, idle). The daemon has no switch for this; it is the floor monitoring is held to.
- ``hivemind``: a bare ``hivemind.Optimizer`` loop (same DHT, its own run id, same huge target).

Each window runs a fixed number of steps; the first few of each window are warm-up and not
counted. The rate of a window is samples / seconds between the end of its first counted step
and the end of its last. Ratios are taken between windows of the same round, then the median
over rounds is reported. Every way runs in the same precision (the forward and loss under autocast,
as peer/runtime/precision.py does): fp32 on the CPU; fp32 and bf16 on CUDA. CUDA rows run when a CUDA
device is present and are skipped (with a note) otherwise; there the task is `--cuda-task`
(default: bytelm widened to about 57M parameters, so that a step takes well over 20 ms and the
daemon's per-step cost is measured against real GPU work, not launch overhead).

Goals (issue 4 and the daemon's design): daemon >= 97% of plain; monitoring on within 2% of off.

Usage (from the repository root)::

    python -m benchmarks.local_overhead --quick     # under 5 minutes on 2 CPU cores
    python -m benchmarks.local_overhead             # full: more rounds, longer windows
    python -m benchmarks.local_overhead --smoke     # bytelm-tiny, seconds; for tests
    # a transformers model (the stdlib's sources as its text), results beside the default ones:
    python -m benchmarks.local_overhead --quick --task hf-causal-lm --task-option model_config=llama-20m \
        --output benchmarks/results/local_overhead-hf.json

JSON (benchmarks/results/local_overhead.json), ``results``:

- ``task``, ``task_options`` (hf-causal-lm's, as given), ``batch_size``, ``data_workers``, ``rounds``,
  ``warmup_steps``, ``ways`` (what each way is);
- ``devices.<cpu|cuda-fp32|cuda-bf16>``: either ``{"skipped": true, "reason": ...}`` or
  - ``task``, ``precision`` and ``batch_size`` (the GPU, its driver, CUDA and torch versions are in ``hardware``);
  - ``steps_per_window``;
  - ``samples_per_second.<way>``: ``{median, min, max, n}`` over rounds;
  - ``ratios.daemon_over_plain``, ``ratios.hivemind_over_plain``, ``ratios.daemon_over_hivemind``,
    ``ratios.monitoring_on_over_off``: ``{median, min, max, n}`` of per-round ratios;
  - ``monitoring_overhead``: 1 - median(monitoring_on_over_off);
  - ``goals``: ``{daemon_over_plain_min: 0.97, daemon_meets: bool, monitoring_overhead_max: 0.02,
    monitoring_meets: bool}``;
  - ``per_round``: the samples/s of every way in every round, in the order they ran.
"""
from __future__ import annotations

import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common

NAME = "local_overhead"
WAYS = ("plain", "daemon", "daemon_monitoring_off", "hivemind")
DAEMON_GOAL, MONITORING_GOAL = 0.97, 0.02
HUGE_TARGET = 10**9
CUDA_TASK = "benchmarks.local_overhead:make_cuda_task"


def make_cuda_task():
    """bytelm widened for a GPU: d_model 768, 8 layers, context 256 (about 57M parameters), batch 32."""
    import dataclasses

    from peer.tasks.bytelm import SIZES, bytelm_task

    return bytelm_task("bytelm-cuda-bench", dataclasses.replace(
        SIZES["small"], d_model=768, n_layers=8, n_heads=12, context=256, batch_size=32))


class NullTimer:
    """A PhaseTimer that times nothing: per-step monitoring off."""

    _null = nullcontext()

    def phase(self, name: str):
        return self._null

    def totals(self) -> Dict[str, float]:
        return {}


class WindowStop:
    """Stops Trainer.run() after `steps` steps; records when each step ended."""

    def __init__(self, steps: int):
        from peer.process.signals import StopRequest

        self.request, self.steps, self.ends = StopRequest(), steps, []

    def step_done(self) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) >= self.steps:
            self.request.set("window")


def window_rate(ends: List[float], warmup: int, batch_size: int) -> float:
    counted = ends[warmup:]
    if len(counted) < 2:
        raise RuntimeError(f"a window needs more than {warmup + 1} steps")
    return (len(counted) - 1) * batch_size / (counted[-1] - counted[0])


class Ways:
    """The four training loops of one device, built once and run window by window."""

    def __init__(self, task_name: str, task_flags: Dict[str, str], batch_size: Optional[int], workers: int,
                 device_name: str, precision: str, tmp: Path):
        import hivemind
        import torch

        from peer.config import load_config
        from peer.process.signals import StopRequest
        from peer.runtime.builder import PeerBuilder
        from peer.runtime.precision import MixedPrecision
        from peer.runtime.trainer import seed_from_run_id
        from peer.tasks import load_task
        from peer.tasks.data import make_loader
        from peer.tasks.order import DataOrder
        from peer.telemetry.console import ProgressDisplay
        from peer.telemetry.reports import TrainingObserver

        self.torch, self.device = torch, torch.device(device_name)
        self.task = load_task(task_name, options=load_config(flags=dict(task=task_name, **task_flags)).task)
        self.batch_size = batch_size or self.task.batch_size
        run_id = f"bench-overhead-{device_name}-{precision}"
        self.config = load_config(flags=dict(
            task=task_name, **task_flags, run_id=run_id, batch_size=self.batch_size, target_batch_size=HUGE_TARGET,
            device=device_name, precision=precision, data_workers=workers, checkpoint_dir=tmp / "ckpt",
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], metrics_host="127.0.0.1", metrics_port=0,
        ))
        self._stack = ExitStack()

        # plain: what a PyTorch user writes, with the daemon's data loader settings and seed
        torch.manual_seed(seed_from_run_id(run_id))
        self.plain_model = self.task.build_model().to(self.device)
        self.plain_opt = self.task.build_optimizer(self.plain_model.parameters())
        self.autocast = MixedPrecision(precision, self.device, ()).autocast
        pinned = self.device.type == "cuda"
        train_set = self.task.build_train_dataset()
        self.plain_batches = iter(make_loader(
            train_set, batch_size=self.batch_size, workers=workers, order=DataOrder(len(train_set), 0),
            collate_fn=self.task.collate_fn, pin_memory=pinned))

        # daemon: assembled by the same builder as `peer start`, torn down by closing the stack
        builder = PeerBuilder(self.config, StopRequest(), self._stack)
        monitoring = builder.monitoring(self.device)
        self.dht = builder.dht()
        self.trainer = trainer = builder.training(
            self.task, self.device, precision, self.dht, monitoring, ProgressDisplay(HUGE_TARGET, interactive=False))
        builder.publisher(self.dht, trainer, monitoring)
        self.timer, self.health = monitoring.timer, monitoring.health
        self.observer_on, self.observer_off = monitoring.observer, TrainingObserver()
        val_loss = trainer.validate()
        trainer.validate = lambda: val_loss  # validation is not what is measured; run() calls it once per window

        # hivemind: a bare hivemind.Optimizer on the same DHT, under its own run id
        torch.manual_seed(seed_from_run_id(run_id))
        self.hm_model = self.task.build_model().to(self.device)
        self.hm_opt = hivemind.Optimizer(
            dht=self.dht, run_id=f"{run_id}-hivemind", params=self.hm_model.parameters(),
            optimizer=self.task.build_optimizer, target_batch_size=HUGE_TARGET, batch_size_per_step=self.batch_size,
            verbose=False,
        )
        self._stack.callback(self.hm_opt.shutdown)
        self.hm_batches = iter(make_loader(
            train_set, batch_size=self.batch_size, workers=workers, order=DataOrder(len(train_set), 0),
            collate_fn=self.task.collate_fn, pin_memory=pinned))

    def close(self) -> None:
        """Stop everything in reverse order; one failure must not leave the DHT running."""
        self._stack.close()

    # --- one window of each way ------------------------------------------------------------

    def _loop(self, model, optimizer, batches, steps: int) -> List[float]:
        from peer.tasks.data import move_to

        ends = []
        for _ in range(steps):
            batch = move_to(next(batches), self.device)
            with self.autocast():
                loss = self.task.loss_fn(model, batch)
            loss.backward()
            float(loss.detach())  # the daemon reads the loss every step too (a device sync on GPUs)
            if isinstance(optimizer, self.torch.optim.Optimizer):
                optimizer.step()
            else:
                optimizer.step(batch_size=self.batch_size)
            optimizer.zero_grad()
            ends.append(time.perf_counter())
        return ends

    def _trainer_window(self, steps: int, monitoring: bool) -> List[float]:
        from peer.telemetry.reports import TrainingObserver

        window = WindowStop(steps)
        inner = self.observer_on if monitoring else self.observer_off

        class Counting(TrainingObserver):
            def on_step(self, samples: int, loss: float) -> None:
                inner.on_step(samples, loss)
                window.step_done()

            def on_joined(self, epoch, peers, val_loss) -> None:
                inner.on_joined(epoch, peers, val_loss)

            def on_epoch(self, report) -> None:
                inner.on_epoch(report)

            def on_round(self, report, group_payload_bytes) -> None:
                inner.on_round(report, group_payload_bytes)

            def on_swarm(self, peers, samples_per_second, progress_ratio) -> None:
                inner.on_swarm(peers, samples_per_second, progress_ratio)

        trainer = self.trainer
        trainer.stop, trainer.observer = window.request, Counting()
        trainer.timer = self.timer if monitoring else NullTimer()
        trainer.on_progress = self.health.beat if monitoring else (lambda: None)
        reason = trainer.run()
        if reason != "signal:window":
            raise RuntimeError(f"the daemon's loop stopped early: {reason}")
        return window.ends

    def window(self, way: str, steps: int) -> List[float]:
        if way == "plain":
            return self._loop(self.plain_model, self.plain_opt, self.plain_batches, steps)
        if way == "hivemind":
            return self._loop(self.hm_model, self.hm_opt, self.hm_batches, steps)
        return self._trainer_window(steps, monitoring=(way == "daemon"))


def measure_device(run: common.Run, device: str, precision: str, task: str, args, settings: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="swarmtrain-bench-") as tmp:
        ways = Ways(task, task_flags(task, settings, Path(tmp)), args.batch_size, settings["data_workers"], device,
                    precision, Path(tmp))
        try:
            batch_size, warmup = ways.batch_size, settings["warmup_steps"]
            # calibrate: steps per window from the plain loop's speed
            ends = ways.window("plain", warmup + 6)
            step_seconds = (ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup)
            steps = max(settings["min_steps"], int(settings["window_seconds"] / max(step_seconds, 1e-6)))
            steps += warmup
            run.log(f"{device} {precision}: {step_seconds * 1e3:.1f} ms per plain step; {steps} steps per window")
            rates: Dict[str, List[float]] = {way: [] for way in WAYS}
            per_round = []
            for r in range(settings["rounds"]):
                row = {}
                for way in common.interleaved(WAYS, r):
                    row[way] = window_rate(ways.window(way, steps), warmup, batch_size)
                    rates[way].append(row[way])
                per_round.append({way: round(v, 2) for way, v in row.items()})
                rates_line = ", ".join(f"{w} {v:.1f}" for w, v in row.items())
                run.log(f"{device} {precision} round {r}: {rates_line} samples/s")
        finally:
            ways.close()
    ratios = {
        "daemon_over_plain": common.stats(common.paired_ratios(rates["daemon"], rates["plain"]), 4),
        "hivemind_over_plain": common.stats(common.paired_ratios(rates["hivemind"], rates["plain"]), 4),
        "daemon_over_hivemind": common.stats(common.paired_ratios(rates["daemon"], rates["hivemind"]), 4),
        "monitoring_on_over_off": common.stats(
            common.paired_ratios(rates["daemon"], rates["daemon_monitoring_off"]), 4),
    }
    on_off = ratios["monitoring_on_over_off"]["median"]
    overhead = None if on_off is None else 1.0 - on_off
    daemon_ratio = ratios["daemon_over_plain"]["median"]
    return {
        "task": task,
        "precision": precision,
        "batch_size": batch_size,
        "steps_per_window": steps,
        "samples_per_second": {way: common.stats(values, 2) for way, values in rates.items()},
        "ratios": ratios,
        "monitoring_overhead": common.rounded(overhead),
        "goals": {
            "daemon_over_plain_min": DAEMON_GOAL,
            "daemon_meets": daemon_ratio is not None and daemon_ratio >= DAEMON_GOAL,
            "monitoring_overhead_max": MONITORING_GOAL,
            "monitoring_meets": overhead is not None and overhead <= MONITORING_GOAL,
        },
        "per_round": per_round,
    }


def task_flags(task: str, settings: dict, tmp: Path) -> Dict[str, str]:
    """--task-option flags, for the task that takes them: hf-causal-lm, which reads the stdlib's sources as text
    unless data=... names other files. (main refuses them for a run without that task.)"""
    if task != "hf-causal-lm":
        return {}
    flags = dict(settings["task_options"])
    flags.setdefault("data", str(common.stdlib_text_corpus(tmp / "corpus")))
    return flags


def parse_task_options(values: List[str]) -> Dict[str, str]:
    options = {}
    for value in values:
        name, equals, setting = value.partition("=")
        if not equals or not name:
            raise SystemExit(f"--task-option {value!r}: give NAME=VALUE, e.g. model_config=llama-20m")
        options[name.replace("-", "_")] = setting
    return options


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--task", default=None, help="task to train on the CPU (default: bytelm; smoke: bytelm-tiny)")
    p.add_argument("--cuda-task", default=CUDA_TASK, help=f"task to train on CUDA (default: {CUDA_TASK})")
    p.add_argument("--task-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option of --task hf-causal-lm, as peer start takes it (model_config=llama-20m, "
                        "seq_len=128, data=PATH; default data: the stdlib's sources as text); repeat for more")
    p.add_argument("--skip-cpu", action="store_true", help="measure the CUDA rows alone (a GPU machine's time)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per step (default: the task's)")
    p.add_argument("--data-workers", type=int, default=None, help="DataLoader workers (default: the daemon's, 2)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (each runs every way once)")
    p.add_argument("--window-seconds", type=float, default=None, help="about how long one window of one way runs")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads for every way (default: torch's own choice, as a peer gets; smoke: 1)")
    args = p.parse_args(argv)
    mode = args.mode
    settings = {
        "task": args.task or common.by_mode(mode, smoke="bytelm-tiny", quick="bytelm", full="bytelm"),
        "data_workers": args.data_workers if args.data_workers is not None else common.by_mode(
            mode, smoke=1, quick=2, full=2),
        "rounds": args.rounds or common.by_mode(mode, smoke=1, quick=4, full=8),
        "window_seconds": args.window_seconds or common.by_mode(mode, smoke=1.0, quick=5.0, full=15.0),
        "min_steps": common.by_mode(mode, smoke=6, quick=10, full=30),
        "warmup_steps": common.by_mode(mode, smoke=2, quick=3, full=5),
        "task_options": parse_task_options(args.task_option),
    }
    if settings["task_options"] and "hf-causal-lm" not in (settings["task"], args.cuda_task):
        p.error(f"--task-option: only --task or --cuda-task hf-causal-lm takes options, not {settings['task']} or "
                f"{args.cuda_task}")
    import torch

    threads = args.torch_threads or common.by_mode(mode, smoke=1, quick=None, full=None)
    if threads:
        torch.set_num_threads(threads)
    settings["torch_threads"] = torch.get_num_threads()
    run = common.Run(NAME, mode, args.output)

    devices: Dict[str, dict] = {"cpu": {"skipped": True, "reason": "--skip-cpu"} if args.skip_cpu else
                                measure_device(run, "cpu", "fp32", settings["task"], args, settings)}
    for precision in ("fp32", "bf16"):
        if torch.cuda.is_available():
            devices[f"cuda-{precision}"] = measure_device(run, "cuda", precision, args.cuda_task, args, settings)
        else:
            devices[f"cuda-{precision}"] = {"skipped": True, "reason": "no CUDA device on this machine"}
    if not torch.cuda.is_available():
        run.note("CUDA rows skipped: no CUDA device on this machine")

    measured = [row for row in devices.values() if not row.get("skipped")]
    batch_size = args.batch_size or (measured[0]["batch_size"] if measured else None)
    results = {
        **{k: v for k, v in settings.items() if k != "min_steps"},
        "batch_size": batch_size,
        "ways": {
            "plain": "plain PyTorch loop: batch to device, forward, backward, float(loss), optimizer step, zero_grad",
            "daemon": "peer.runtime.trainer.Trainer.run() with a real DHT and SyncOptimizer, assembled by "
                      "peer/runtime/builder.py as peer start does (PhaseTimer -> PeerMetrics + BottleneckClassifier, "
                      "MetricsObserver, HealthCheck, exporter, peer-record publisher); target batch too large for "
                      "any averaging round",
            "daemon_monitoring_off": "the same Trainer with no-op phase timer and observer (exporter and publisher "
                                     "still running, idle)",
            "hivemind": "bare hivemind.Optimizer loop on the same DHT, same huge target batch",
        },
        "devices": devices,
    }
    for device, row in devices.items():
        if row.get("skipped"):
            continue
        if not row["goals"]["daemon_meets"]:
            run.note(f"{device}: the daemon's loop runs at {row['ratios']['daemon_over_plain']['median']:.3f} of "
                     f"the plain loop, short of the {DAEMON_GOAL:.0%} goal")
        if not row["goals"]["monitoring_meets"]:
            run.note(f"{device}: monitoring costs {row['monitoring_overhead']:.1%} of the step rate, over the "
                     f"{MONITORING_GOAL:.0%} goal")
    line = f"{NAME}: " + "; ".join(
        f"{device} skipped" if row.get("skipped") else
        f"{device} ({row['task']}, batch {row['batch_size']}): "
        f"daemon/plain {common.fmt_ratio(row['ratios']['daemon_over_plain']['median'])}, "
        f"hivemind/plain {common.fmt_ratio(row['ratios']['hivemind_over_plain']['median'])}, "
        f"monitoring on/off {common.fmt_ratio(row['ratios']['monitoring_on_over_off']['median'])}"
        for device, row in devices.items()) + (
        f" (goals: daemon >= {DAEMON_GOAL}, monitoring overhead <= {MONITORING_GOAL:.0%})")
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
