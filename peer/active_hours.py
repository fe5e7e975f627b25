"""--active-hours: when a volunteer lends this machine, in its local time.

A value is one or more windows separated by commas, each an optional day or day range and a time range:

    22:00-07:00                 every night (a window that ends before it starts runs past midnight)
    Mon-Fri 18:00-23:30         weekday evenings
    Sat-Sun 00:00-24:00, 22:00-07:00

A window that runs past midnight belongs to the day it starts on: `Fri 22:00-07:00` covers Friday night
into Saturday morning. Outside every window the peer pauses (peer/runtime/pausing.py), and resumes when
the next one begins.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import FrozenSet, Tuple

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
EXAMPLE = "22:00-07:00 or Mon-Fri 18:00-23:30, Sat-Sun 00:00-24:00"
_WINDOW = re.compile(r"^(?:(?P<days>[A-Za-z]{3}(?:-[A-Za-z]{3})?)\s+)?(?P<start>\d{1,2}:\d{2})-(?P<end>\d{1,2}:\d{2})$")


class ActiveHoursError(ValueError):
    """A value that is no list of windows; the message says which part and what one looks like."""


@dataclass(frozen=True)
class Window:
    days: FrozenSet[int]
    """The weekdays (0 Monday) it starts on."""
    start: int
    """Minutes after midnight."""
    end: int
    """Minutes after midnight, up to 1440; at or before `start`: the window ends on the next day."""

    def contains(self, when: datetime) -> bool:
        minute, day = when.hour * 60 + when.minute, when.weekday()
        if self.start < self.end:
            return day in self.days and self.start <= minute < self.end
        # past midnight: the evening of a listed day, or the morning after one
        return (day in self.days and minute >= self.start) or ((day - 1) % 7 in self.days and minute < self.end)


@dataclass(frozen=True)
class ActiveHours:
    windows: Tuple[Window, ...]
    text: str

    def active(self, when: datetime) -> bool:
        return any(window.contains(when) for window in self.windows)


def parse_active_hours(text: str) -> ActiveHours:
    """:raises ActiveHoursError: naming the part that is wrong"""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ActiveHoursError(f"an empty window; write windows such as {EXAMPLE}")
    return ActiveHours(tuple(_window(part) for part in parts), text.strip())


def _window(part: str) -> Window:
    found = _WINDOW.match(part)
    if found is None:
        raise ActiveHoursError(f"{part!r} is no window: write [DAY[-DAY]] HH:MM-HH:MM, such as {EXAMPLE}")
    start, end = _minutes(found["start"], part), _minutes(found["end"], part)
    if start == 1440:
        raise ActiveHoursError(f"{part!r}: a window cannot start at 24:00; start it at 00:00")
    if start == end:
        raise ActiveHoursError(f"{part!r} starts and ends at the same time; for the whole day write 00:00-24:00")
    return Window(_days(found["days"], part), start, end)


def _minutes(clock: str, part: str) -> int:
    hours, minutes = (int(value) for value in clock.split(":"))
    if minutes > 59 or hours > 24 or (hours == 24 and minutes):
        raise ActiveHoursError(f"{part!r}: {clock} is no time of day (00:00 to 24:00)")
    return hours * 60 + minutes


def _days(spec: str, part: str) -> FrozenSet[int]:
    if spec is None:
        return frozenset(range(7))
    names = spec.lower().split("-")
    unknown = [name for name in names if name not in DAYS]
    if unknown:
        raise ActiveHoursError(f"{part!r}: {unknown[0]!r} is no day; use Mon, Tue, Wed, Thu, Fri, Sat or Sun")
    first, last = DAYS.index(names[0]), DAYS.index(names[-1])
    return frozenset((first + offset) % 7 for offset in range((last - first) % 7 + 1))
