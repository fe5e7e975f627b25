"""Shared helpers for the benchmarks: command-line modes, hardware description, timing, JSON results.

Every benchmark writes one JSON file (default benchmarks/results/<name>.json) with the same
envelope and prints one summary line. The envelope's fields:

- ``benchmark``: the script's name; ``mode``: smoke, quick or full; ``command``: how it was run;
- ``hardware``: CPU model, cores (online and usable by this process), RAM, load average at
  start and end, torch/hivemind/python versions, CUDA device (or null), date (UTC);
- ``started_at`` / ``finished_at`` (UTC, ISO 8601) and ``wall_seconds``;
- ``results``: the benchmark's own fields (documented in each script's docstring);
- ``notes``: plain sentences about what was skipped, shared or fell short.

Ratios are always measured side by side within one run (configurations interleaved); the
absolute numbers are noise on a shared machine. This module must not import anything of ours
at import time, so that `--help` stays fast.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
def parser(name: str, doc: Optional[str]) -> argparse.ArgumentParser:
    """An argument parser with the modes every benchmark has (--smoke, --quick, default full) and --output."""
    summary = (doc or "").strip().splitlines()[0] if doc else name
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=summary)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_const", dest="mode", const="quick",
                       help="smaller sizes and fewer rounds: each script finishes in under 5 minutes on 2 CPU cores")
    group.add_argument("--smoke", action="store_const", dest="mode", const="smoke",
                       help="the smallest configuration, for tests: checks that the script runs, "
                            "measures nothing useful")
    p.set_defaults(mode="full")
    p.add_argument("--output", type=Path, default=RESULTS_DIR / f"{name}.json",
                   help=f"where to write the JSON result (default: benchmarks/results/{name}.json)")
    return p


def by_mode(mode: str, *, smoke, quick, full):
    return {"smoke": smoke, "quick": quick, "full": full}[mode]


# ---------------------------------------------------------------------------------------- hardware


def _lscpu_model() -> Optional[str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def hardware_info() -> Dict[str, Any]:
    """What the numbers were measured on."""
    import psutil
    import torch

    try:
        import hivemind

        hivemind_version = hivemind.__version__
    except Exception:  # a broken hivemind install should still let the envelope be written
        hivemind_version = None
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    driver = None
    if cuda is not None:
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return {
        "cpu_model": _lscpu_model(),
        "cpu_cores_online": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "cuda_device": cuda,
        "cuda_version": torch.version.cuda,
        "nvidia_driver": driver,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "hivemind": hivemind_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": utc_now(),
    }


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


class Run:
    """One benchmark run: collects notes and results, writes the envelope, prints the summary line."""

    def __init__(self, name: str, mode: str, output: Path):
        self.name, self.mode, self.output = name, mode, Path(output)
        self.notes: List[str] = []
        self.started_at, self._t0 = utc_now(), time.monotonic()
        self.hardware = hardware_info()

    def note(self, text: str) -> None:
        """A sentence for the JSON's notes, also printed at once (stderr) so a person watching sees it."""
        self.notes.append(text)
        print(f"[{self.name}] note: {text}", file=sys.stderr, flush=True)

    def log(self, text: str) -> None:
        print(f"[{self.name}] {text}", file=sys.stderr, flush=True)

    def finish(self, results: Dict[str, Any], summary_line: str) -> Dict[str, Any]:
        self.hardware["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
        document = {
            "benchmark": self.name,
            "mode": self.mode,
            "command": f"python -m benchmarks.{self.name} {shlex.join(sys.argv[1:])}".rstrip(),
            "hardware": self.hardware,
            "started_at": self.started_at,
            "finished_at": utc_now(),
            "wall_seconds": round(time.monotonic() - self._t0, 1),
            "results": results,
            "notes": self.notes,
            "summary": summary_line,
        }
        write_json(self.output, document)
        print(summary_line, flush=True)
        return document


def write_json(path: Path, document: Dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


# ---------------------------------------------------------------------------------------- statistics


def stats(values: Iterable[float], digits: Optional[int] = None) -> Dict[str, Any]:
    """Median, min, max and count of a list (None when empty); medians resist one noisy window."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    result = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    if digits is not None:
        result = {k: round(v, digits) for k, v in result.items()}
    return {**result, "n": len(values)}


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> List[float]:
    """Ratio of each round's two measurements (taken next to each other), so drift between rounds cancels."""
    return [a / b for a, b in zip(numerators, denominators) if a is not None and b]


def interleaved(configs: Sequence[Any], round_index: int) -> List[Any]:
    """The order of configurations in a round: forward on even rounds, reversed on odd ones (ABC CBA ...),
    so that no configuration always runs first or always follows the same neighbour."""
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def rounded(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else round(float(value), digits)


def fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def child_env(**extra: str) -> Dict[str, str]:
    """The environment for a peer or worker subprocess: unbuffered, and able to import our packages."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def kill_session(process: subprocess.Popen, wait_seconds: float = 10.0) -> None:
    """SIGKILL a process started with start_new_session and everything in its session (DHT, p2pd,
    averagers, data workers: each in a process group of its own, see peer/process/lifeline.py), then reap it
    with a bounded wait."""
    from peer.testing import signal_session

    signal_session(process.pid, signal.SIGKILL)
    try:
        process.wait(wait_seconds)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------------------------------- processes


def process_memory_kib(pid: int) -> Dict[str, int]:
    """A process's memory from /proc/<pid>/smaps_rollup, in KiB: ``Rss``, ``Pss`` (a page shared by k processes
    counts 1/k: summed over a peer's processes, what the peer costs) and ``Uss`` (its private pages); zeros once
    it is gone."""
    found = {"Rss": 0, "Pss": 0, "Private_Clean": 0, "Private_Dirty": 0}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in found:
                found[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return {"Rss": found["Rss"], "Pss": found["Pss"], "Uss": found["Private_Clean"] + found["Private_Dirty"]}


def process_cpu_seconds(pid: int) -> Optional[float]:
    """User and system CPU seconds a process has used so far (None once it is gone)."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return None


CORPUS_BYTES = 4 * 1024 * 1024
"""The text --task hf-causal-lm reads in a benchmark that names none: as much of the stdlib's sources as bytelm."""


def stdlib_text_corpus(directory: Path, max_bytes: int = CORPUS_BYTES) -> Path:
    """Up to `max_bytes` of the standard library's sources, as .txt files in `directory`: local text for
    --task hf-causal-lm that needs no download (the files bytelm reads, in its order)."""
    from peer.tasks.bytelm import source_paths, stdlib_root

    root, written = stdlib_root(), 0
    directory.mkdir(parents=True, exist_ok=True)
    for index, relative in enumerate(source_paths(root)):
        if written >= max_bytes:
            break
        text = Path(root, relative).read_bytes()[: max_bytes - written].decode("utf-8", errors="replace")
        (directory / f"{index:05d}.txt").write_text(text)
        written += len(text.encode())
    return directory
