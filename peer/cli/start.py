"""`peer start`: assemble a peer (peer/runtime/builder.py), train, and take it apart within a deadline.

Exit codes (peer/exit_codes.py): 0 after a clean stop (max epochs, max seconds, a signal), 1
when the peer could not run (swarm unreachable, --min-peers not met, a crash) or could not write
its final checkpoint, 2 for bad input (a --checkpoint-dir another peer holds included).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

from averaging.registry import DEFAULT_STRATEGY
from dht.node import DHTStartCancelled, DHTStartError, visible_maddrs
from dht.run_owner import fingerprint
from peer.checkpoint.store import CheckpointError
from peer.config import PeerConfig
from peer.exit_codes import BadInput, ExitCode
from peer.process import lifeline
from peer.process.signals import StopRequest, start_shared_memory_manager
from peer.runtime.builder import PeerBuilder
from peer.runtime.device import describe_device, resolve_device, resolve_precision
from peer.runtime.manifest import ManifestUnreadable
from peer.runtime.trainer import Trainer, TrainingDiverged
from peer.task_options import BUILTIN_MODEL_CONFIGS, HF_CAUSAL_LM
from peer.tasks import load_task
from peer.telemetry.events import EventLog, Exited, Ready
from peer.telemetry.logs import setup_logging
from peer.testing.faults import FaultPlan
from peer.version import __version__

logger = logging.getLogger("peer")

EXIT_DEADLINE_SECONDS = 10.0
SHUTDOWN_DEADLINE_SECONDS = 25.0


@dataclass
class PeerRun:
    """How the run is going, for the shutdown and the summary."""

    code: ExitCode = ExitCode.FAILED
    reason: str = "crashed"
    trainer: Optional[Trainer] = None


def run_peer(config: PeerConfig, faults: Optional[FaultPlan] = None) -> int:
    lifeline.install()
    setup_logging(config.logging.log_format, config.logging.verbose)
    start_shared_memory_manager()
    stop = StopRequest()
    stop.install_handlers()
    if config.logging.verbose or config.logging.log_format == "json":  # a person reads start_summary() instead
        logger.info(f"swarmtrain {__version__}; config: {config.model_dump_json()}")
    run, stack = PeerRun(), ExitStack()
    builder = PeerBuilder(config, stop, stack, faults)
    try:
        run.code, run.reason = _run(config, stop, builder, run)
    except BadInput as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr, flush=True)
        run.code, run.reason = ExitCode.BAD_INPUT, "bad_input"
    except DHTStartCancelled:
        run.code, run.reason = ExitCode.OK, f"signal:{stop.signal_name}"
    except DHTStartError as e:
        logger.error(str(e))
        run.reason = "dht_start_failed"
    except ManifestUnreadable as e:
        logger.error(str(e))
        run.reason = "manifest_unreadable"
    except TrainingDiverged as e:
        logger.error(str(e))
        run.reason = "diverged"
    except Exception as e:
        logger.error(f"peer failed: {type(e).__name__}: {e}", exc_info=True)
    finally:
        with shutdown_deadline(SHUTDOWN_DEADLINE_SECONDS, builder.events):
            finish(config, run, stack)
        builder.events.emit(Exited(reason=run.reason, code=int(run.code)))
    arm_exit_deadline(EXIT_DEADLINE_SECONDS, run.code)
    return run.code


def _run(config: PeerConfig, stop: StopRequest, builder: PeerBuilder, run: PeerRun) -> tuple:
    try:
        # the paths, addresses and --task name were checked before torch was imported (peer/cli/preflight.py)
        task = load_task(config.training.task, config.training.task_timeout_seconds, options=config.task)
        device = resolve_device(config.training.device)
        precision = resolve_precision(config.training.precision, device)
    except (RuntimeError, ValueError) as e:  # TaskLoadError is a ValueError
        raise BadInput(str(e)) from e
    builder.lock_checkpoint_dir()  # a second peer on this directory leaves before it joins anything
    monitoring = builder.monitoring(device)
    builder.faults.hold_before_joining()  # tests only: a peer started ahead of its turn
    with monitoring.timer.phase("joining"):  # communication, and the advice says it passes once joined
        dht = builder.dht()
        run.trainer = trainer = builder.training(task, device, precision, dht, monitoring, builder.display())
        logger.info(start_summary(config, sum(p.numel() for p in trainer.model.parameters()), device, precision,
                                  metrics_url(config.monitoring.metrics_host, monitoring.port)))
        # once this peer is a member (its settings matched the run's manifest); above the bar, on a terminal
        run_owner = fingerprint(builder.manifest.owner)
        print_join_instructions(config, dht, run_owner if builder.owns_run else None, trainer.display.print)
        builder.events.emit(Ready(peer_id=str(dht.peer_id), run_id=config.training.run_id,
                                  multiaddrs=visible_maddrs(dht), run_owner=run_owner,
                                  metrics_url=metrics_url(config.monitoring.metrics_host, monitoring.port)))
        stop.install_handlers()  # hivemind's averagers set SIGINT to "ignore" in this process when they start
        builder.publisher(dht, trainer, monitoring)
        if not wait_for_min_peers(config, trainer):
            return ExitCode.FAILED, "min_peers_timeout"
        trainer.session.catch_up()
    return ExitCode.OK, trainer.run()


def start_summary(config: PeerConfig, parameters: int, device, precision: str, metrics: Optional[str]) -> str:
    """One line that says what this peer is about to do (the whole config: --verbose, or the JSON log)."""
    averaging = config.averaging
    return (f"swarmtrain {__version__}: run {config.training.run_id}, task {config.training.task} "
            f"({parameters / 1e6:.2f}M parameters) on {_device_name(device)} ({precision}), "
            f"{averaging.strategy} averaging, "
            f"target batch {averaging.target_batch_size}, checkpoints in {config.checkpoint.checkpoint_dir}, "
            f"metrics {metrics or 'off'}")


def _device_name(device) -> str:
    name = describe_device(device)
    return name if name == str(device) else f"{name} ({device})"


def wait_for_min_peers(config: PeerConfig, trainer: Trainer) -> bool:
    needed, timeout = config.averaging.min_peers, config.averaging.min_peers_timeout_seconds
    if needed <= 1:
        return True
    logger.info(f"waiting for {needed} peers (--min-peers) for up to {timeout:.0f}s")
    passed, seen = trainer.session.wait_for_quorum(needed, timeout)
    if passed or trainer.stop:
        return True
    logger.error(f"--min-peers {needed}: only {seen} peer(s) visible after {timeout:.0f}s; "
                 f"start more peers or lower --min-peers")
    return False


def metrics_url(host: str, port: Optional[int]) -> Optional[str]:
    """Where a program on this machine scrapes the metrics (an address listening on every interface is
    reached through the loopback one)."""
    if port is None:
        return None
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def print_join_instructions(config: PeerConfig, dht, owned_run: Optional[str], show: Callable[[str], None]) -> None:
    """:param owned_run: the run owner's fingerprint, if this peer started the run"""
    maddrs = visible_maddrs(dht)
    logger.info(f"peer id {dht.peer_id}; listening on {', '.join(maddrs)}")
    hint = join_hint(config, maddrs, owned_run)
    if hint:
        show(hint)


def join_hint(config: PeerConfig, maddrs: List[str], owned_run: Optional[str]) -> Optional[str]:
    """The command that joins this swarm, printed by the peer that started the run (whoever joined it already knows
    an address: `peer swarm` prints it once, not once per peer); None for a joiner or a client."""
    if config.dht.client_mode or owned_run is None or not maddrs:
        return None
    command = (
        f"peer start --run-id {config.training.run_id} --run-owner {owned_run} --task {config.training.task} "
        f"--target-batch-size {config.averaging.target_batch_size}"
    )
    if config.averaging.strategy != DEFAULT_STRATEGY:  # settings every peer of the run must share
        command += f" --averaging {config.averaging.strategy}"
    command += "".join(f" {flag} {value}" for flag, value in task_options_hint(config))
    if config.dht.swarm_key is not None:
        command += " --swarm-key <a copy of this swarm's key file>"
    if "/ip4/127." in maddrs[0] or "/ip6/::1/" in maddrs[0]:  # visible_maddrs puts loopback last: all are
        return (f"To join this swarm from this machine, run:\n  {command} --initial-peers {maddrs[0]}\n"
                f"(it listens on the loopback only; to let other machines join, start it with --host-maddrs "
                f"/ip4/0.0.0.0/tcp/31337)")
    return f"To join this swarm from another machine, run:\n  {command} --initial-peers {maddrs[0]}"


def task_options_hint(config: PeerConfig) -> List[Tuple[str, str]]:
    """The task options of the join command: a built-in size by its name, a file this machine holds as a
    placeholder for a copy of it, and the joiner's own data."""
    options = config.task
    if config.training.task != HF_CAUSAL_LM:
        return []
    hint = []
    if options.model is not None:
        model = options.model
        hint.append(("--model-config", model if model in BUILTIN_MODEL_CONFIGS else f"<a copy of {model}>"))
    if options.init_from is not None:  # every peer starts from those weights (its digest is in the manifest)
        hint.append(("--init-from", f"<a copy of {options.init_from}>"))
    if options.tokenizer is not None:
        hint.append(("--tokenizer", f"<a copy of {options.tokenizer}>"))
    if options.seq_len is not None:
        hint.append(("--seq-len", str(options.seq_len)))
    return [*hint, ("--data", "<your own text files>")]


def finish(config: PeerConfig, run: PeerRun, stack: ExitStack) -> None:
    """Checkpoint after a clean run, stop every part in reverse order, write the summary."""
    trainer = run.trainer
    if trainer is not None and run.code == ExitCode.OK:
        trainer.display.close()  # before the checkpoint's log lines
        try:
            trainer.save_checkpoint()
        except Exception as e:
            # Periodic checkpoints may fail and training goes on (peer/runtime/trainer.py); this one is the run's
            # result, so losing it is the one checkpoint failure that makes the exit code non-zero.
            cause = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            logger.error(f"final checkpoint failed: {cause}; the last checkpoint this peer wrote or resumed from is "
                         f"{trainer.last_checkpoint or 'none'}; free space on, or fix, --checkpoint-dir "
                         f"{config.checkpoint.checkpoint_dir}")
            run.code, run.reason = ExitCode.FAILED, "final_checkpoint_failed"
    stack.close()
    if trainer is not None:
        trainer.summary.exit_reason = run.reason
        trainer.summary.phase_seconds = trainer.timer.totals()
        if config.logging.summary_json is not None:
            trainer.summary.write(config.logging.summary_json)
    logger.info(f"peer stopped ({run.reason})")


@contextmanager
def shutdown_deadline(seconds: float, events: EventLog) -> Iterator[None]:
    """Whatever hangs in the shutdown, the process exits within `seconds` (exit 1), children included."""
    timer = threading.Timer(seconds, _give_up_shutdown, args=(seconds, events))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def arm_exit_deadline(seconds: float, code: int) -> None:
    """Once the peer has stopped, the process ends within `seconds` with `code`.

    Python joins every non-daemon thread before it exits; one that a library left waiting (hivemind's, after a
    crash half-way through building its optimizer) would keep the process alive for ever, holding its ports.
    """
    def give_up() -> None:
        logger.error(f"a background thread kept the process alive {seconds:.0f}s after the peer stopped; exiting now")
        lifeline.kill_descendants()
        os._exit(code)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()


def _give_up_shutdown(seconds: float, events: EventLog) -> None:
    logger.error(f"shutdown took longer than {seconds:.0f}s; exiting now")
    events.emit(Exited(reason="shutdown_timeout", code=int(ExitCode.FAILED)))
    lifeline.kill_descendants()
    os._exit(ExitCode.FAILED)
