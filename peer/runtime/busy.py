"""--yield-when-busy: how much of this machine the owner's other programs use, and when that means "step aside".

`MachineUse` measures what processes outside this peer (its own process and every process under it:
the DHT, p2pd, averagers, data workers) take: their share of all CPU cores since the last reading, and,
where NVML can be read (an NVIDIA driver and the nvidia-ml-py package), their share of the peer's GPU, by
memory or by utilisation, whichever is higher. `BusyRule` turns readings into a decision with hysteresis:
busy once the others stay above --yield-cpu-share (or --yield-gpu-share) for --yield-after-seconds, quiet
again only once they stay below for --resume-after-quiet-seconds, so that a build that stops for a second
does not restart training.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Set

import psutil

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Use:
    """What the other programs use now, as shares of the whole (0..1); gpu is None where it cannot be read."""

    cpu: float
    gpu: Optional[float] = None

    def describe(self) -> str:
        gpu = "" if self.gpu is None else f", GPU {self.gpu:.0%}"
        return f"other programs use CPU {self.cpu:.0%}{gpu}"


class MachineUse:
    """Readings of what programs outside this process tree use of this machine."""

    def __init__(self, root_pid: Optional[int] = None, gpu_index: Optional[int] = None):
        self.root = psutil.Process(root_pid or os.getpid())
        self._last: Optional[tuple] = None  # (when, the machine's busy seconds)
        self._own: Dict[int, float] = {}  # pid -> its CPU seconds at the last reading
        self._gpu = NvmlGpu.open(gpu_index) if gpu_index is not None else None

    def read(self) -> Optional[Use]:
        """The others' use since the previous reading; None at the first (nothing to compare with yet)."""
        tree = self._tree()
        now, busy, own = time.monotonic(), _machine_busy_seconds(), _cpu_seconds(tree)
        last, self._last = self._last, (now, busy)
        # per process, so that a child that exits (taking its CPU time with it) does not make the rest look busy;
        # a child born since counts whole
        own_used = sum(seconds - self._own.get(pid, 0.0) for pid, seconds in own.items())
        self._own = own
        if last is None:
            return None
        elapsed = (now - last[0]) * (psutil.cpu_count() or 1)
        others = max(0.0, (busy - last[1]) - own_used)
        gpu = self._gpu.others_share({process.pid for process in tree}) if self._gpu is not None else None
        return Use(min(1.0, others / elapsed) if elapsed > 0 else 0.0, gpu)

    def _tree(self) -> list:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return [self.root]


def _machine_busy_seconds() -> float:
    """CPU time every process of this machine used (guest time is already in user time; steal is another VM's)."""
    times = psutil.cpu_times()
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))


def _cpu_seconds(processes: list) -> Dict[int, float]:
    """Each process's CPU seconds so far, by pid."""
    used = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:  # exited since it was listed
            continue
        used[process.pid] = times.user + times.system
    return used


class NvmlGpu:
    """One GPU through NVML: the share of its memory, or of its time, that processes outside `ours` use."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle
        self._last_sample = 0

    @classmethod
    def open(cls, index: int) -> Optional["NvmlGpu"]:
        try:
            import pynvml  # the nvidia-ml-py package, where an NVIDIA driver is installed

            pynvml.nvmlInit()
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        except Exception as e:  # no package, no driver, no such GPU: the CPU alone decides
            logger.info(f"--yield-when-busy: cannot read GPU {index} through NVML ({e!r}); watching the CPU only")
            return None

    def others_share(self, ours: Set[int]) -> Optional[float]:
        try:
            total = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total
            processes = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
            memory = sum(p.usedGpuMemory or 0 for p in processes if p.pid not in ours) / max(1, total)
            return max(memory, self._others_utilisation(ours))
        except Exception as e:
            logger.debug(f"NVML reading failed: {e!r}")
            return None

    def _others_utilisation(self, ours: Set[int]) -> float:
        """The highest SM utilisation of another process since the last reading (0 where NVML keeps no samples)."""
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(self.handle, self._last_sample)
        except Exception:  # NVML_ERROR_NOT_FOUND: no process ran on it since then
            return 0.0
        if samples:
            self._last_sample = max(sample.timeStamp for sample in samples)
        return max((sample.smUtil / 100.0 for sample in samples if sample.pid not in ours), default=0.0)


class BusyRule:
    """Busy after others stayed above `cpu_share` of the CPU (or `gpu_share` of the GPU) for `after_seconds`; quiet
    after they stayed at or below both for `quiet_seconds`. In between, the last decision holds."""

    def __init__(self, cpu_share: float, gpu_share: float, after_seconds: float, quiet_seconds: float,
                 clock: Callable[[], float] = time.monotonic):
        self.cpu_share, self.gpu_share = cpu_share, gpu_share
        self.after_seconds, self.quiet_seconds, self.clock = after_seconds, quiet_seconds, clock
        self.busy = False
        self._above_since: Optional[float] = None
        self._below_since: Optional[float] = None

    def observe(self, use: Use) -> bool:
        """Take one reading; whether the machine counts as busy now."""
        now = self.clock()
        above = use.cpu > self.cpu_share or (use.gpu is not None and use.gpu > self.gpu_share)
        if above:
            self._below_since = None
            self._above_since = now if self._above_since is None else self._above_since
            if now - self._above_since >= self.after_seconds:
                self.busy = True
        else:
            self._above_since = None
            self._below_since = now if self._below_since is None else self._below_since
            if now - self._below_since >= self.quiet_seconds:
                self.busy = False
        return self.busy
