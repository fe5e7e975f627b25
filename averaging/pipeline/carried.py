"""Objects an averager takes into its own process: named while it is built, attached to it before it forks.

hivemind starts an averager's process from its constructor, so whatever the averager should carry
(a Defence, an ErrorFeedback) cannot be passed to it: the builder names it in a `building()` block,
and hivemind_compat's pre-fork hook attaches it to the averager, whose process inherits it.
"""
from __future__ import annotations

import contextlib
from typing import Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class Carried(Generic[T]):
    def __init__(self, name: str):
        self._attribute = f"_swarmtrain_{name}"
        self._being_built: Optional[T] = None

    @contextlib.contextmanager
    def building(self, value: Optional[T]) -> Iterator[None]:
        """Averagers started inside this block carry `value` (into their process, at fork)."""
        previous, self._being_built = self._being_built, value
        try:
            yield
        finally:
            self._being_built = previous

    def attach(self, averager) -> Optional[T]:
        """As an averager starts, in the training process: the value being built becomes the averager's."""
        setattr(averager, self._attribute, self._being_built)
        return self._being_built

    def of(self, averager) -> Optional[T]:
        return getattr(averager, self._attribute, None)
