"""The `peer` command's entry point: run the CLI, then exit without the interpreter's teardown.

Once a command is done, Python frees torch's and hivemind's modules object by object: about a second of CPU
after the last line is written (1.0 s of a lone 8 s `peer start`), that nothing needs. So the first exit
handler registered, which runs last, ends the process at once: by then Python has joined every non-daemon
thread, multiprocessing has stopped its children and logging has flushed. Only the handler must be
registered before peer.cli.main is imported: the modules it imports register their own.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Optional

_exit_code: Optional[int] = None


def run() -> None:
    global _exit_code
    atexit.register(_exit_without_teardown)
    from peer.cli.main import main  # noqa: E402 (after the handler: see the module's docstring)

    try:
        main()
    except SystemExit as e:
        _exit_code = e.code if isinstance(e.code, int) else None  # main() always exits with a number
        raise


def _exit_without_teardown() -> None:
    if _exit_code is None:  # a crash, or a code Python prints first: leave it to the interpreter
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, or a closed stream: nothing left to write
            pass
    os._exit(_exit_code)
