"""install(): check the hivemind version, then put every patch of the adapter in place (idempotent).

It runs before any averager process forks (the builder calls it first thing), since hivemind's processes
inherit the patched classes at fork.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict

import hivemind

from averaging.adapter import (
    allreduce,
    epoch_keys,
    grace,
    kept_tasks,
    late_stores,
    numpy2,
    pacing,
    progress_filter,
    recorded_steps,
    refusals,
)
from averaging.adapter.codec_registry import register_codecs
from averaging.adapter.upstream import (
    PINNED_VERSION,
    HivemindIncompatible,
    changed_upstream,
    remember_originals,
    resolve,
)

logger = logging.getLogger(__name__)

PATCHES: Dict[str, Callable] = {
    **numpy2.PATCHES, **pacing.PATCHES, **recorded_steps.PATCHES, **progress_filter.PATCHES,
    **allreduce.PATCHES, **refusals.PATCHES, **epoch_keys.PATCHES, **grace.PATCHES, **late_stores.PATCHES,
    **kept_tasks.PATCHES,
}
"""Every upstream function the adapter replaces, by qualified name."""
remember_originals(PATCHES)


def install() -> None:
    """Check the hivemind version and install every patch (idempotent)."""
    if hivemind.__version__ != PINNED_VERSION:
        changed = changed_upstream()
        if changed:
            raise HivemindIncompatible(
                f"hivemind {hivemind.__version__} is installed, but swarmtrain was written against {PINNED_VERSION} "
                f"and these functions changed: {'; '.join(changed)}; run pip install hivemind=={PINNED_VERSION}"
            )
        logger.warning(f"hivemind {hivemind.__version__} (expected {PINNED_VERSION}); the code we rely on is unchanged")
    for name, patched in PATCHES.items():
        owner, attribute = name.rsplit(".", 1)
        setattr(resolve(owner), attribute, patched)
    register_codecs()
