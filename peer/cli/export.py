"""`peer export`: the newest good checkpoint of a checkpoint directory, as a model other tools load.

A task with its own exporter writes its form (hf-causal-lm: a directory `from_pretrained` reads); any other
task gets model.safetensors and model.json, which describes it (peer/runtime/export.py). The checkpoint
directory is only read, with no lock, DHT or network, so a peer may go on training there meanwhile.

Exit codes: 0 once --out is written, 1 when writing it failed (nothing is left half-written), 2 for bad input:
a checkpoint directory that is missing, empty or holds no readable checkpoint, an --out that exists and is not
empty (without --force), or a task that cannot be built here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from peer.cli.options import SectionedCommand, config_options_for, resolve_config
from peer.exit_codes import BadInput, ExitCode

EXPORT_FIELDS = ["checkpoint_dir", "task_timeout_seconds"]
EXPORT_WORDING = {"checkpoint_dir": "The checkpoint directory whose newest good checkpoint to export (only read: a "
                                    "peer may be training there)."}


@click.command(cls=SectionedCommand)
@config_options_for(EXPORT_FIELDS, wording=EXPORT_WORDING)
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="The directory to write: it must not exist, or be empty (see --force).")
@click.option("--force", is_flag=True, help="Replace --out if it exists and is not empty.")
@click.pass_context
def export(ctx: click.Context, out: Path, force: bool, **params: Any) -> None:
    """Write the newest good checkpoint as a model other tools load: the task's own form (hf-causal-lm: a
    directory from_pretrained reads), else model.safetensors with model.json describing it."""
    config = resolve_config(ctx, params)
    ctx.exit(run_export(config.checkpoint.checkpoint_dir, out, force, config.training.task_timeout_seconds))


def run_export(checkpoint_dir: Path, out: Path, force: bool, task_timeout_seconds: float) -> int:
    # `..` collapsed (links kept: a link as --out is refused), so that `--out ckpt/..` is seen to hold the checkpoints
    checkpoint_dir, out = (Path(os.path.normpath(Path(path).absolute())) for path in (checkpoint_dir, out))
    try:
        check_out(out, checkpoint_dir, force)
    except ValueError as e:
        return _refuse(str(e))
    from peer.checkpoint.store import read_newest  # torch: only once the paths pass
    from peer.runtime.export import ExportFailed, export_into, rebuild_model

    try:
        checkpoint = newest_checkpoint(checkpoint_dir, read_newest)
        task, model = rebuild_model(checkpoint, task_timeout_seconds)
    except (ValueError, BadInput) as e:
        return _refuse(str(e))
    try:
        written = export_into(out, force, task, model, checkpoint)
    except ExportFailed as e:
        click.echo(f"error: {e}", err=True)
        return ExitCode.FAILED
    click.echo(f"exported {checkpoint.path.name} (task {task.name}, run {checkpoint.state.get('run_id')}, global "
               f"epoch {checkpoint.global_epoch}) to {out}: {', '.join(written)}")
    return ExitCode.OK


def check_out(out: Path, checkpoint_dir: Path, force: bool) -> None:
    """:raises ValueError: one line, when --out may not be written"""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"--out {out} exists and is not a directory; name a new or empty directory")
    if checkpoint_dir == out or out in checkpoint_dir.parents:
        raise ValueError(f"--out {out} holds --checkpoint-dir {checkpoint_dir}, which the export reads; name "
                         f"another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty; name a new or empty directory, or add --force to "
                         f"replace it")


def newest_checkpoint(checkpoint_dir: Path, read_newest):
    """The newest checkpoint of `checkpoint_dir` that verifies; damaged newer ones are reported on stderr.

    :raises ValueError: one line, when there is none to export
    """
    flag = f"--checkpoint-dir {checkpoint_dir}"
    if not checkpoint_dir.is_dir():
        raise ValueError(f"{flag} does not exist; name the directory a peer wrote its checkpoints to (its "
                         f"--checkpoint-dir)")
    try:
        checkpoint, damaged = read_newest(checkpoint_dir)
    except OSError as e:
        raise ValueError(f"{flag} cannot be read ({e.strerror or e}); run this as a user who may read it") from None
    if checkpoint is None and not damaged:
        raise ValueError(f"{flag} holds no checkpoint (checkpoint-<sequence>-epoch<epoch>); name the directory a "
                         f"peer wrote its checkpoints to, once it has written one")
    problems = "; ".join(f"{d.path.name}: {d.reason}" for d in damaged)
    if checkpoint is None:
        raise ValueError(f"{flag} holds no readable checkpoint, every one is damaged ({problems}); restore one "
                         f"from a backup, or export another peer's")
    if damaged:
        click.echo(f"warning: skipped damaged newer checkpoints ({problems}); exporting {checkpoint.path.name}",
                   err=True)
    return checkpoint


def _refuse(message: str) -> int:
    click.echo(f"error: {message}", err=True)
    return ExitCode.BAD_INPUT
