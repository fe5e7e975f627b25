"""What checking one state costs: the state digest of an epoch, as a fraction of the epoch, on the default task.

A peer digests what a state download would hand over (averaging/swarm/digests.py): for `sync`, the parameters
and the optimizer's state. This takes the SHA-256 of exactly those bytes for the task's model after a few
AdamW steps (so that the optimizer state exists), and times a local step (forward, backward, optimizer step on
one batch) of the same model, in one process, interleaved (digest, steps, digest, ...). An epoch of a swarm of P
equal peers takes target_batch_size / (batch_size * P) steps of each peer, so the digest's share of an epoch is
digest_seconds / (steps * step_seconds), reported for P = 1, 4 and 16 at the default --target-batch-size.

Usage (from the repository root)::

    python -m benchmarks.one_state --quick    # bytelm, 5 rounds
    python -m benchmarks.one_state            # bytelm, 20 rounds
    python -m benchmarks.one_state --smoke    # bytelm-tiny, 2 rounds; for tests

JSON (benchmarks/results/one_state.json), ``results``: ``task``, ``parameters``, ``digested_bytes``,
``batch_size``, ``target_batch_size``, ``rounds``, ``digest_seconds`` and ``step_seconds``
(``{median, min, max, n}``), ``epoch_fraction`` (peers -> the digest's median share of an epoch), ``goal``
(``epoch_fraction_max`` 0.01 at the largest swarm, and whether it is met).
"""
from __future__ import annotations

import sys
import time
from statistics import median

if __package__ in (None, ""):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

NAME = "one_state"
SWARM_SIZES = (1, 4, 16)
GOAL = 0.01


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    import torch

    from averaging.config import AveragingConfig
    from averaging.pipeline.state_digest import state_digest
    from peer.tasks.registry import load_task

    mode = args.mode
    task_name = common.by_mode(mode, smoke="bytelm-tiny", quick="bytelm", full="bytelm")
    rounds = common.by_mode(mode, smoke=2, quick=5, full=20)
    steps_per_round = common.by_mode(mode, smoke=2, quick=5, full=10)
    run = common.Run(NAME, mode, args.output)
    torch.manual_seed(0)
    task = load_task(task_name)
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    batch = next(iter(torch.utils.data.DataLoader(task.build_train_dataset(), batch_size=task.batch_size,
                                                  collate_fn=task.collate_fn)))

    def step() -> None:
        loss = task.loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def served_tensors():
        return [*model.parameters(), *(value for state in optimizer.state.values() for value in state.values()
                                       if torch.is_tensor(value))]

    for _ in range(3):  # the optimizer's state exists from here on
        step()
    digests, steps = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        state_digest(served_tensors())
        digests.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(steps_per_round):
            step()
        steps.append((time.perf_counter() - started) / steps_per_round)

    target = AveragingConfig().target_batch_size
    fractions = {peers: median(digests) / (max(1.0, target / (task.batch_size * peers)) * median(steps))
                 for peers in SWARM_SIZES}
    results = {
        "task": task_name, "parameters": sum(p.numel() for p in model.parameters()),
        "digested_bytes": sum(t.numel() * t.element_size() for t in served_tensors()),
        "batch_size": task.batch_size, "target_batch_size": target, "rounds": rounds,
        "digest_seconds": common.stats(digests, 5), "step_seconds": common.stats(steps, 5),
        "epoch_fraction": {str(peers): round(fraction, 6) for peers, fraction in fractions.items()},
        "goal": {"epoch_fraction_max": GOAL, "meets": fractions[SWARM_SIZES[-1]] <= GOAL},
    }
    line = (f"{NAME} ({task_name}, {results['digested_bytes'] / 2**20:.1f} MiB digested): "
            f"{median(digests) * 1e3:.1f} ms a digest, step {median(steps) * 1e3:.0f} ms; share of an epoch: "
            + ", ".join(f"{fraction:.3%} with {peers} peer{'s' if peers > 1 else ''}"
                        for peers, fraction in fractions.items()))
    run.finish(results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
