"""What pausing costs a volunteer (issue 33): resuming a paused peer against starting a fresh one, and, on a GPU,
the device memory a pause gives back.

Swarm part (real `peer start` processes on 127.0.0.1, bytelm-tiny, target batch 48): a first peer trains; then,
per round, interleaved:

- ``fresh``: a new peer starts and joins (process start, DHT, manifest, the start gate, the state download):
  ``seconds`` from launching it to its ``joined`` event; it is stopped again afterwards;
- ``resume``: a second peer, paused with `peer pause` for ``--pause-seconds`` while the swarm moves on, is
  resumed with `peer resume`: ``seconds`` from the command to its ``resumed`` event (which follows its catch-up
  download; the command's own start, about a second of Python imports, included), ``resuming_seconds`` (what the
  peer itself took: back on the device, the catch-up download), ``pause_seconds`` (from `peer pause` to its
  ``paused`` event: the end of its step and of any round it was in), ``downloaded`` and the epochs.

GPU part (only where CUDA is available; it needs no swarm and no hivemind): a model of ``--gpu-params`` parameters
with Adam state on the GPU is parked on the host and brought back (peer/runtime/parking.py): ``allocated_before``,
``allocated_parked`` and ``allocated_after`` (torch.cuda.memory_allocated), ``park_seconds``, ``unpark_seconds`` and
``round_trip_exact``; then what --yield-when-busy reads through NVML for a process that allocates GPU memory
(``others_share_idle``, ``others_share_busy``, and the share it allocated).

Usage (from the repository root)::

    python -m benchmarks.pause             # 3 rounds
    python -m benchmarks.pause --quick     # 2 rounds
    python -m benchmarks.pause --smoke     # 1 round, short pause; checks that the script works
    python -m benchmarks.pause --gpu-only  # the GPU part alone

JSON ``results``: ``rounds`` (one row per setup and round), ``fresh_seconds`` and ``resume_seconds`` (median, min,
max), ``ratio`` (fresh / resume, median of the ratios paired by round), ``gpu`` (the GPU part, or null) and
``skipped``.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common  # noqa: E402 (after the path fix above)

NAME = "pause"
TASK_ARGS = ("--task", "bytelm-tiny", "--target-batch-size", "48")


async def peer_command(work: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT)}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "peer", *args], cwd=work, env=env,
                                   capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


async def swarm_rounds(work: Path, rounds: int, pause_seconds: float, log) -> List[dict]:
    from peer.telemetry.events import Joined, Paused, Resumed
    from peer.testing import Swarm

    rows: List[dict] = []
    async with Swarm(work, *TASK_ARGS, fast=True) as swarm:
        first = await swarm.add(name="first")
        await first.reach(2, timeout=120)
        volunteer = await swarm.add(name="volunteer")
        await volunteer.reach(first.epoch, timeout=120)
        for round_index in range(rounds):
            for setup in common.interleaved(["fresh", "resume"], round_index):
                if setup == "fresh":
                    launched = time.time()
                    newcomer = await swarm.add(name=f"fresh-{round_index}")
                    joined = await newcomer.wait_for(Joined, timeout=120, what="the join")
                    rows.append({"setup": "fresh", "round": round_index, "seconds": round(joined.time - launched, 3),
                                 "epoch": joined.epoch})
                    newcomer.terminate()
                    await newcomer.exit_code(timeout=120)
                    continue
                pause_asked = time.time()
                done = await peer_command(work, "pause", "--checkpoint-dir", str(work / volunteer.name))
                paused = await volunteer.wait_for(Paused, lambda event, since=pause_asked: event.time >= since,
                                                  timeout=10, what="the pause")
                await asyncio.sleep(pause_seconds)
                resume_asked, swarm_epoch = time.time(), first.epoch
                resumed_by = await peer_command(work, "resume", "--checkpoint-dir", str(work / volunteer.name))
                resumed = await volunteer.wait_for(Resumed, lambda event, since=resume_asked: event.time >= since,
                                                   timeout=60, what="the resume")
                rows.append({"setup": "resume", "round": round_index,
                             "seconds": round(resumed.time - resume_asked, 3), "resuming_seconds": resumed.seconds,
                             "pause_seconds": round(paused.time - pause_asked, 3), "downloaded": resumed.downloaded,
                             "paused_at_epoch": paused.epoch, "swarm_epoch": swarm_epoch,
                             "resumed_at_epoch": resumed.epoch, "command_exits": [done.returncode,
                                                                                 resumed_by.returncode]})
            log(f"round {round_index}: {rows[-2:]}")
    return rows


def gpu_part(params: int) -> Optional[Dict]:
    """Park a model and its Adam state on the host and bring it back; read others' GPU use through NVML."""
    import torch

    from peer.runtime.parking import park

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", 0)
    width = int((params / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)]).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone().cpu() for p in model.parameters()]
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    parked = park(model, optimizer)
    torch.cuda.synchronize()
    park_seconds, allocated_parked = time.perf_counter() - started, torch.cuda.memory_allocated(device)
    reserved_parked = torch.cuda.memory_reserved(device)
    started = time.perf_counter()
    parked.unpark()
    torch.cuda.synchronize()
    unpark_seconds, allocated_after = time.perf_counter() - started, torch.cuda.memory_allocated(device)
    exact = all(torch.equal(a, b.detach().cpu()) for a, b in zip(before, model.parameters()))
    optimizer.step()  # the optimizer still works on the parameters it holds, back on the device
    result = {
        "device": torch.cuda.get_device_name(device), "parameters": sum(p.numel() for p in model.parameters()),
        "parked_bytes": parked.bytes, "allocated_before": allocated_before, "allocated_parked": allocated_parked,
        "reserved_parked": reserved_parked, "allocated_after": allocated_after,
        "park_seconds": round(park_seconds, 4), "unpark_seconds": round(unpark_seconds, 4), "round_trip_exact": exact,
        "optimizer_on": str(next(iter(optimizer.state.values()))["exp_avg"].device),
    }
    del model, optimizer, parked
    torch.cuda.empty_cache()
    result.update(nvml_reading())
    return result


def nvml_reading() -> Dict:
    """What MachineUse reads of the GPU while another process holds a quarter of its memory."""
    import torch

    from peer.runtime.busy import NvmlGpu

    gpu = NvmlGpu.open(0)
    if gpu is None:
        return {"nvml": None}
    total = torch.cuda.get_device_properties(0).total_memory
    idle = gpu.others_share({os.getpid()})  # the holder below is this process's child: not in `ours` here
    holder = subprocess.Popen([sys.executable, "-c", f"import torch, time\nx = torch.empty({total // 4}, "
                               f"dtype=torch.uint8, device='cuda')\ntorch.cuda.synchronize()\nprint('ok', flush=True)"
                               f"\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        time.sleep(1.0)
        busy = gpu.others_share({os.getpid()})
    finally:
        holder.kill()
        holder.wait(30)
    return {"nvml": True, "others_share_idle": idle, "others_share_busy": busy, "allocated_share": 0.25}


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--rounds", type=int, default=None, help="fresh starts and resumes, each (default 3; quick 2)")
    p.add_argument("--pause-seconds", type=float, default=None, help="how long each pause lasts (default 20; smoke 5)")
    p.add_argument("--gpu-params", type=int, default=100_000_000, help="parameters of the GPU part's model")
    p.add_argument("--gpu-only", action="store_true", help="the GPU part alone (no swarm)")
    args = p.parse_args(argv)
    run = common.Run(NAME, args.mode, args.output)
    results: Dict = {"task": TASK_ARGS[1], "rounds": [], "skipped": None}
    gpu = gpu_part(args.gpu_params)
    results["gpu"] = gpu
    if gpu is None:
        run.note("no CUDA device: the GPU part was skipped")
    if not args.gpu_only:
        rounds = args.rounds or common.by_mode(args.mode, smoke=1, quick=2, full=3)
        pause_seconds = args.pause_seconds or common.by_mode(args.mode, smoke=5.0, quick=20.0, full=20.0)
        with tempfile.TemporaryDirectory(prefix="swarmtrain-pause-") as work:
            rows = asyncio.run(swarm_rounds(Path(work), rounds, pause_seconds, run.log))
        fresh = [row["seconds"] for row in rows if row["setup"] == "fresh"]
        resume = [row["seconds"] for row in rows if row["setup"] == "resume"]
        results.update(rounds=rows, pause_seconds=pause_seconds, fresh_seconds=common.stats(fresh, 3),
                       resume_seconds=common.stats(resume, 3),
                       ratio=common.stats(common.paired_ratios(fresh, resume), 2))
    parts = []
    if not args.gpu_only:
        parts.append(f"a fresh start takes {common.fmt_ratio(results['ratio']['median'])}x as long as a resume (fresh "
                     f"{results['fresh_seconds']['median']}s, resume {results['resume_seconds']['median']}s)")
    if gpu is not None:
        parts.append(f"{gpu['device']}: a pause parks {gpu['parked_bytes'] / 2**20:.0f} MiB, allocated "
                     f"{gpu['allocated_before'] / 2**20:.0f} -> {gpu['allocated_parked'] / 2**20:.0f} MiB in "
                     f"{gpu['park_seconds']}s, back in {gpu['unpark_seconds']}s")
    run.finish(results, f"{NAME}: " + ("; ".join(parts) or "nothing measured"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
