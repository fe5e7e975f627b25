"""Resolve a task name: a built-in name, or `module:function` returning a Task."""
from __future__ import annotations

import difflib
import importlib
import os
import sys
import threading
from typing import Callable, Dict, Optional, TypeVar

from peer.tasks.base import Task

T = TypeVar("T")


class TaskLoadError(ValueError):
    """The task named by --task cannot be built; the message says why and how to fix it."""


def _bytelm(size: str) -> Callable[[], Task]:
    def factory() -> Task:
        from peer.tasks.bytelm import make_bytelm_task  # imported lazily: it scans the stdlib at build time

        return make_bytelm_task(size)

    return factory


BUILTIN_TASKS: Dict[str, Callable[[], Task]] = {
    "bytelm": _bytelm("small"),
    "bytelm-tiny": _bytelm("tiny"),
}
DEFAULT_TASK = "bytelm"


def load_task(name: str, timeout_seconds: Optional[float] = None) -> Task:
    """Build the task named `name`; raise TaskLoadError with a one-line reason on failure.

    :param timeout_seconds: a module that hangs on import, or a factory that never returns, is reported after
        this long
    """
    if timeout_seconds is None:
        return _load_task(name)
    return run_within(timeout_seconds, lambda: _load_task(name), TaskLoadError(
        f"--task {name}: importing and building it took longer than --task-timeout-seconds {timeout_seconds:g}; "
        f"a module that waits at import (on the network, a lock, input) hangs here: fix it, or raise "
        f"--task-timeout-seconds for a task that is slow to build"))


def run_within(seconds: float, work: Callable[[], T], timed_out: Exception) -> T:
    """work()'s result or exception, or `timed_out` raised once `seconds` have passed. The work goes on in a
    daemon thread, which the exiting process abandons: user code cannot be interrupted any other way."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as e:  # handed to the caller's thread, whatever it is
            outcome.append(e)

    worker = threading.Thread(target=run, name="task-code", daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        raise timed_out
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _as_module(name: str) -> Optional[str]:
    """For a --task given as a file path (examples/custom_task.py[:make_task]): what to give instead."""
    path, _, function_name = name.partition(":")
    if not (path.endswith(".py") or "/" in path or os.sep in path):
        return None
    function_name = function_name or "make_task"
    relative = os.path.relpath(os.path.abspath(path), os.getcwd())
    if relative.startswith(".."):  # outside this directory: import it from its own
        stem = os.path.splitext(os.path.basename(path))[0]
        return f"{stem}:{function_name} from {os.path.dirname(os.path.abspath(path))}"
    module = os.path.splitext(relative)[0] if relative.endswith(".py") else relative
    return f"{module.replace(os.sep, '.')}:{function_name}"


def _load_task(name: str) -> Task:
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]()
    module_form = _as_module(name)
    if module_form is not None:
        raise TaskLoadError(f"--task {name}: a task is named as module:function, not as a file path; "
                            f"give --task {module_form}")
    if ":" not in name:
        close = difflib.get_close_matches(name, BUILTIN_TASKS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TaskLoadError(
            f"--task: unknown task {name!r}; {hint}use a built-in ({', '.join(BUILTIN_TASKS)}) "
            f"or 'module:function' returning a peer.tasks.Task"
        )
    module_name, _, function_name = name.partition(":")
    # as `python -m` does, so that `peer start --task mymodule:make` finds ./mymodule.py; appended, so that a
    # local file never shadows an installed package
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:
        raise TaskLoadError(f"--task: importing {module_name!r} called sys.exit({e.code!r}); "
                            f"a task module must not exit when imported") from e
    except Exception as e:  # a user's module can raise anything on import
        raise TaskLoadError(
            f"--task: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            f"check that it is importable (on PYTHONPATH) and imports cleanly"
        ) from e
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise TaskLoadError(f"--task: module {module_name!r} has no callable {function_name!r}")
    try:
        task = factory()
    except SystemExit as e:
        raise TaskLoadError(
            f"--task: {name}() called sys.exit({e.code!r}) instead of returning a peer.tasks.Task") from e
    except Exception as e:
        raise TaskLoadError(f"--task: {name}() raised {type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise TaskLoadError(f"--task: {name}() returned {type(task).__name__}, expected peer.tasks.Task")
    return task
