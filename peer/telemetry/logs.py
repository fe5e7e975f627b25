"""Logging for the daemon: plain lines by default, JSON lines with --log-format json.

hivemind's own log handler is switched off so that its records flow through ours, at
WARNING unless --verbose: its INFO chatter is for hivemind developers, not volunteers.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
import warnings

HIVEMIND_LOGGERS = ("hivemind", "asyncio")  # hivemind leaves unretrieved task errors to asyncio's logger
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _DropTracebacks(logging.Filter):
    """Without --verbose, keep the message of a logged exception but not its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def setup_logging(log_format: str = "text", verbose: bool = False) -> None:
    import hivemind.utils.logging as hivemind_logging

    hivemind_logging.use_hivemind_log_handler("nowhere")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT, "%H:%M:%S"))
    if not verbose:
        handler.addFilter(_DropTracebacks())
    # hivemind steps the LR scheduler itself after downloading state; torch's warning about the order is moot
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
    if not verbose:
        _quiet_background_failures()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in HIVEMIND_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
        logging.getLogger(name).propagate = True


def _quiet_background_failures() -> None:
    """hivemind's threads and finalizers can raise while a failed peer unwinds; say so in one line."""
    log = logging.getLogger("peer")

    def thread_failed(args: threading.ExceptHookArgs) -> None:
        log.error(f"background thread {args.thread.name if args.thread else '?'} failed: {args.exc_value!r}")

    threading.excepthook = thread_failed
    sys.unraisablehook = lambda unraisable: log.debug(f"ignored in finalizer: {unraisable.exc_value!r}")


def silence_hivemind() -> None:
    """During shutdown, hivemind logs errors about peers and pipes going away; they are expected."""
    for name in HIVEMIND_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
