"""The exit codes of every `peer` command, in one place.

0 after a clean stop (max epochs, max seconds, a signal, Ctrl+C on status --watch), 1 when the
command could not do its job (swarm unreachable, --min-peers not met, a crash), 2 for bad input,
130 when a second signal cut the shutdown short.
"""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    BAD_INPUT = 2
    SECOND_SIGNAL = 130


class BadInput(Exception):
    """A problem with what the user asked for, found after config validation (exit code 2)."""
