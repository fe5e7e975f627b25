"""Recipes for long DiLoCo rounds: validation loss at equal samples against synchronous training, per recipe.

Which inner steps, outer learning rate and momentum keep DiLoCo's loss at 64-128 inner steps a round is a
question of compute, not of the network, so this benchmark answers it in one process: N replicas of the
task train as N peers would, with the daemon's own pieces, and no swarm:

- the task's model, inner optimizer and LR scheduler (stepped to the global epoch after every round, as
  averaging/strategies/membership.py's `step_scheduler_to` does), each replica reading its own data order
  (peer/tasks/order.py, seeds 0..N-1, as `peer swarm` hands them out);
- the round: each replica takes ``inner_steps`` steps of the task's batch from the round's start; its
  pseudo-gradient (start - params) goes through the all-reduce as the daemon's does it: the flattened vector
  is cut into N parts, replica j reduces part j, every other replica sends its part with the codec and error
  feedback (its own part goes in whole), and the reducer replies to all with the average encoded once, with
  its reply residual (averaging/pipeline/error_feedback.py's `message_with_feedback` for both legs);
- the outer step: `outer_nesterov_step_` (averaging/strategies/outer.py) on the round's start, which every
  replica then copies.

The reference, sync: the same N data orders, every global epoch (``--target-batch-size`` samples, spread
over the replicas) one step of the task's optimizer on the mean gradient: what `--averaging sync` computes.

Compared per recipe, at the reference's sample count: validation loss (the task's held-out set, after
every outer round; the reference's curve read at the same samples, linearly between its evaluations), and
payload bytes per sample against sync fp32 (each replica's upload per round: its contributions to the other
reducers plus its replies, from the real message sizes; sync fp32 uploads 2(N-1)/N x 4 bytes a parameter
every epoch). The wire adds framing and the DHT: benchmarks/uplink.py measures that on shaped links.

A recipe is ``H:lr:mu[:codec[:warmup]]``: inner steps per round per replica, outer learning rate and
momentum, the codec of the round (default none; ``topk0.05`` is top-k at 5%), and how the inner LR warmup
is counted: ``epochs`` (as the daemon does: a DiLoCo epoch is a whole round) or ``samples`` (the task's
warmup epochs counted in sync epochs' worth of samples, stepped with the inner steps).

Usage (from the repository root)::

    python -m benchmarks.diloco_recipes --quick            # 2 peers, 32 rounds of 16 inner steps, a few recipes
    python -m benchmarks.diloco_recipes --device cuda      # the full grid at 64 and 128 inner steps, 16 rounds
    python -m benchmarks.diloco_recipes --smoke            # bytelm-tiny, a few steps; for tests

JSON ``results``: ``task``, ``peers``, ``batch_size``, ``target_batch_size``, ``samples``, ``device``,
``parameters``, ``reference`` (the sync run: ``curve``, points of ``samples`` and ``val_loss``;
``final_val_loss``), and
``recipes`` (one per recipe: ``recipe``, ``inner_steps``, ``outer_lr``, ``outer_momentum``, ``codec``,
``warmup``, ``rounds``, ``curve``, ``final_val_loss``, ``val_loss_vs_sync`` (ratio at equal samples),
``payload_bytes_per_round`` (per replica), ``fewer_bytes_than_sync_fp32``, ``seconds``).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common  # noqa: E402 (after the path fix above)

NAME = "diloco_recipes"
GRID = {  # inner steps -> outer (lr, momentum) pairs tried; the codecs are tried on the best fp32 recipe
    64: [(0.7, 0.9), (1.0, 0.9), (0.7, 0.8), (1.0, 0.5), (0.5, 0.9)],
    128: [(0.7, 0.9), (1.0, 0.9), (0.7, 0.8), (1.0, 0.5), (0.5, 0.9)],
}
CODECS = ("int4", "topk")


@dataclass(frozen=True)
class Recipe:
    inner_steps: int
    outer_lr: float
    outer_momentum: float
    codec: str = "none"
    warmup: str = "epochs"

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        fields = text.split(":")
        if not 3 <= len(fields) <= 5:
            raise ValueError(f"a recipe is H:lr:mu[:codec[:warmup]] (got {text!r})")
        recipe = cls(int(fields[0]), float(fields[1]), float(fields[2]), *fields[3:])
        if recipe.warmup not in ("epochs", "samples"):
            raise ValueError(f"warmup must be epochs or samples (got {recipe.warmup!r})")
        return recipe

    def __str__(self) -> str:
        return f"{self.inner_steps}:{self.outer_lr}:{self.outer_momentum}:{self.codec}:{self.warmup}"


class Replicas:
    """The task, its held-out loss, and N replicas' data orders on one device."""

    def __init__(self, task_name: str, peers: int, device: str, batch_size: Optional[int] = None):
        import torch

        from peer.tasks import load_task
        from peer.tasks.data import evaluate, make_loader, move_to
        from peer.tasks.order import DataOrder

        self.torch, self.move_to, self.device = torch, move_to, torch.device(device)
        self.task = load_task(task_name, 120)
        self.batch_size = batch_size or self.task.batch_size
        train = self.task.build_train_dataset()
        self.loaders = [iter(make_loader(train, batch_size=self.batch_size, workers=0,
                                         order=DataOrder(len(train), seed))) for seed in range(peers)]
        val_loader = make_loader(self.task.build_val_dataset(), batch_size=self.batch_size, workers=0)
        self._evaluate = lambda model: evaluate(model, val_loader, self.task.loss_fn, self.device, 8)
        torch.manual_seed(0)
        self.initial = self.task.build_model().state_dict()

    def model(self):
        model = self.task.build_model().to(self.device)
        model.load_state_dict(self.initial)
        return model

    def loss(self, model, peer: int):
        return self.task.loss_fn(model, self.move_to(next(self.loaders[peer]), self.device))

    def val_loss(self, model) -> float:
        return self._evaluate(model)


def run_sync(replicas: Replicas, target: int, samples: int, points: int) -> dict:
    """`--averaging sync` without a network: each epoch, the mean gradient of `target` samples read by the
    replicas in turn, one optimizer step, the scheduler stepped to the epoch."""
    peers = len(replicas.loaders)
    model = replicas.model()
    optimizer = replicas.task.build_optimizer(model.parameters())
    scheduler = replicas.task.build_scheduler(optimizer) if replicas.task.build_scheduler else None
    micro = target // replicas.batch_size  # micro-batches per epoch, over all replicas
    epochs = samples // target
    every = max(1, epochs // points)
    curve = []
    for epoch in range(epochs):
        optimizer.zero_grad()
        for index in range(micro):
            (replicas.loss(model, index % peers) / micro).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if (epoch + 1) % every == 0 or epoch + 1 == epochs:
            curve.append({"samples": (epoch + 1) * target, "val_loss": round(replicas.val_loss(model), 4)})
    return {"curve": curve, "final_val_loss": curve[-1]["val_loss"]}


def allreduce_through_codec(contributions: Sequence, codec, sent: List, replied: List):
    """The daemon's all-reduce of flat vectors, in one process: (the average every replica decodes, upload bytes
    per replica). `sent[i]` and `replied[i]` are replica i's sending and reply residuals (codec None: fp32, no
    residuals)."""
    import torch

    from averaging.pipeline.error_feedback import message_with_feedback

    peers = len(contributions)
    bounds = [round(len(contributions[0]) * j / peers) for j in range(peers + 1)]
    average, upload = torch.empty_like(contributions[0]), [0] * peers
    for j in range(peers):  # replica j reduces part j: the others send theirs, it replies to them
        part = slice(bounds[j], bounds[j + 1])
        if codec is None:
            average[part] = torch.stack([c[part] for c in contributions]).mean(dim=0)
            for i in range(peers):
                upload[i] += 4 * (bounds[j + 1] - bounds[j]) * (peers - 1 if i == j else 1)
            continue
        received = []
        for i, contribution in enumerate(contributions):
            if i == j:  # its own part goes in whole, residual and all
                received.append(contribution[part] + sent[i][part])
                sent[i][part] = 0
                continue
            message, sent[i][part] = message_with_feedback(contribution[part], sent[i][part], codec)
            received.append(codec.extract(message))
            upload[i] += len(message.buffer)
        mean = torch.stack(received).mean(dim=0)
        message, replied[j][part] = message_with_feedback(mean, replied[j][part], codec)
        average[part] = codec.extract(message)
        upload[j] += len(message.buffer) * (peers - 1)  # the same bytes to every other sender
    return average, upload


def recipe_codec(name: str):
    """A recipe's codec: a --grad-compression name, or topk<fraction> (topk0.05: top-k at 5%); None for none."""
    from averaging.codecs.compression import make_codec

    if name == "none":
        return None
    if name.startswith("topk") and name != "topk":
        return make_codec("topk", topk_fraction=float(name[4:]))
    return make_codec(name)


def run_diloco(replicas: Replicas, recipe: Recipe, samples: int, sync_target: int) -> dict:
    torch = replicas.torch
    from averaging.strategies.outer import outer_nesterov_step_

    peers = len(replicas.loaders)
    round_samples = recipe.inner_steps * replicas.batch_size * peers
    rounds = max(1, samples // round_samples)
    models = [replicas.model() for _ in range(peers)]
    optimizers = [replicas.task.build_optimizer(model.parameters()) for model in models]
    schedulers = [replicas.task.build_scheduler(opt) if replicas.task.build_scheduler else None for opt in optimizers]
    start = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(p) for p in start]
    flat_size = sum(p.numel() for p in start)
    codec = recipe_codec(recipe.codec)
    sent = [torch.zeros(flat_size, device="cpu") for _ in range(peers)] if codec is not None else None
    replied = [torch.zeros(flat_size, device="cpu") for _ in range(peers)] if codec is not None else None
    curve, upload_per_round, steps = [], [], 0
    for round_index in range(rounds):
        for peer, (model, optimizer, scheduler) in enumerate(zip(models, optimizers, schedulers)):
            for step in range(recipe.inner_steps):
                optimizer.zero_grad()
                replicas.loss(model, peer).backward()
                optimizer.step()
                if recipe.warmup == "samples" and scheduler is not None:
                    # the task's epochs are sync epochs: step once per sync epoch's worth of samples, swarm-wide
                    swarm_samples = (round_index * recipe.inner_steps + step + 1) * replicas.batch_size * peers
                    while scheduler._step_count <= swarm_samples // sync_target:
                        scheduler.step()
        deltas = [torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, model.parameters())]).float().cpu()
                  for model in models]
        average, upload = allreduce_through_codec(deltas, codec, sent, replied)
        upload_per_round.append(sum(upload) / peers)
        offset, averaged = 0, []
        for param in start:
            averaged.append(average[offset:offset + param.numel()].view_as(param).to(param.device))
            offset += param.numel()
        with torch.no_grad():
            outer_nesterov_step_(start, momentum, averaged, recipe.outer_lr, recipe.outer_momentum)
            for model, scheduler in zip(models, schedulers):
                for param, value in zip(model.parameters(), start):
                    param.copy_(value)
                if recipe.warmup == "epochs" and scheduler is not None:
                    while scheduler._step_count <= round_index + 1:
                        scheduler.step()
        steps += recipe.inner_steps
        curve.append({"samples": (round_index + 1) * round_samples, "val_loss": round(replicas.val_loss(models[0]), 4)})
    return {"rounds": rounds, "curve": curve, "final_val_loss": curve[-1]["val_loss"],
            "payload_bytes_per_round": int(sum(upload_per_round) / len(upload_per_round)), "inner_steps_run": steps}


def one_recipe(job) -> dict:
    import torch

    task, peers, device, batch_size, recipe, samples, sync_target = job
    torch.set_num_threads(2)  # the all-reduce's arithmetic, beside other recipes' processes
    started = time.monotonic()
    replicas = Replicas(task, peers, device, batch_size)  # every run reads the same data from the start
    row = {"recipe": str(recipe), **recipe.__dict__, **run_diloco(replicas, recipe, samples, sync_target)}
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def interpolate(curve: List[dict], samples: float) -> Optional[float]:
    points = [(point["samples"], point["val_loss"]) for point in curve]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= samples <= x1:
            return y0 + (y1 - y0) * (samples - x0) / (x1 - x0)
    return points[-1][1] if points and samples >= points[-1][0] else None


def main(argv=None) -> int:
    p = common.parser(NAME, __doc__)
    p.add_argument("--task", default=None, help="task (default: bytelm; bytelm-tiny in smoke mode)")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--target-batch-size", type=int, default=128, help="the sync reference's target batch")
    p.add_argument("--rounds", type=int, default=None, help="outer rounds of the longest recipe (sets the samples)")
    p.add_argument("--recipe", action="append", default=None, help="H:lr:mu[:codec[:warmup]] (repeatable); "
                   "default: the grid")
    p.add_argument("--batch-size", type=int, default=None, help="samples per inner step (default: the task's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=1, help="recipes run at once, each in its own process")
    args = p.parse_args(argv)
    mode = args.mode or "full"
    task = args.task or common.by_mode(mode, smoke="bytelm-tiny", quick="bytelm", full="bytelm")
    if args.recipe:
        recipes = [Recipe.parse(text) for text in args.recipe]
    else:
        recipes = common.by_mode(mode, smoke=[Recipe(2, 0.7, 0.9), Recipe(2, 0.7, 0.9, "int4")],
                                 quick=[Recipe(16, 0.7, 0.9), Recipe(16, 0.7, 0.9, "int4"),
                                        Recipe(16, 0.7, 0.9, warmup="samples")],
                                 full=[Recipe(h, lr, mu, warmup=w) for h, pairs in GRID.items() for lr, mu in pairs
                                       for w in ("epochs", "samples")])
    rounds = args.rounds or common.by_mode(mode, smoke=2, quick=32, full=16)
    run = common.Run(NAME, mode, args.output)
    replicas = Replicas(task, args.peers, args.device, args.batch_size)
    longest = max(recipe.inner_steps for recipe in recipes)
    samples = rounds * longest * replicas.batch_size * args.peers
    samples = max(args.target_batch_size, samples - samples % args.target_batch_size)  # whole sync epochs
    parameters, batch_size = sum(p.numel() for p in replicas.model().parameters()), replicas.batch_size
    run.log(f"{task}: {parameters:,} parameters, {samples:,} samples per run, {len(recipes)} recipes on {args.device}")
    started = time.monotonic()
    replicas = Replicas(task, args.peers, args.device, args.batch_size)  # every run reads its data from the start
    sync = run_sync(replicas, args.target_batch_size, samples, points=64)
    sync["seconds"] = round(time.monotonic() - started, 1)
    run.log(f"sync: val {sync['final_val_loss']:.4f} at {samples:,} samples ({sync['seconds']} s)")
    sync_bytes_per_sample = 2 * (args.peers - 1) / args.peers * 4 * parameters * args.peers / args.target_batch_size
    rows = []
    jobs = [(task, args.peers, args.device, batch_size, recipe, samples, args.target_batch_size) for recipe in recipes]
    if args.workers > 1:  # each recipe in its own process (spawned: CUDA does not survive a fork)
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            done = pool.map(one_recipe, jobs, chunksize=1)
    else:
        done = map(one_recipe, jobs)
    for recipe, row in zip(recipes, done):
        at = row["curve"][-1]["samples"]
        reference = interpolate(sync["curve"], at)
        row["val_loss_vs_sync"] = common.rounded(row["final_val_loss"] / reference, 4) if reference else None
        round_samples = recipe.inner_steps * batch_size * args.peers
        per_sample = row["payload_bytes_per_round"] * args.peers / round_samples
        row["fewer_bytes_than_sync_fp32"] = common.rounded(sync_bytes_per_sample / per_sample, 1)
        rows.append(row)
        run.log(f"{recipe}: val {row['final_val_loss']:.4f} ({row['val_loss_vs_sync']} of sync), "
                f"{row['fewer_bytes_than_sync_fp32']}x fewer payload bytes ({row['seconds']} s)")
    results = {"task": task, "peers": args.peers, "batch_size": batch_size,
               "target_batch_size": args.target_batch_size, "samples": samples, "device": args.device,
               "parameters": parameters, "reference": sync, "recipes": rows}
    best = min(rows, key=lambda row: row["final_val_loss"])
    run.finish(results, f"{NAME} ({task}, {args.peers} peers, {samples:,} samples; val loss vs sync, fewer payload "
                        f"bytes than sync fp32): " + ", ".join(
                            f"{row['recipe']} {row['val_loss_vs_sync']}/{row['fewer_bytes_than_sync_fp32']}x"
                            for row in rows) + f"; best {best['recipe']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
