"""Resolve a task name: a built-in name, or `module:function` returning a Task."""
from __future__ import annotations

import importlib
import threading
from typing import Callable, Dict, Optional, TypeVar

from peer.task_names import (
    TaskLoadError,
    cannot_import,
    check_task_name,
    make_local_modules_importable,
)
from peer.tasks.base import Task

T = TypeVar("T")


def _bytelm(size: str) -> Callable[[], Task]:
    def factory() -> Task:
        from peer.tasks.bytelm import make_bytelm_task  # imported lazily: it scans the stdlib at build time

        return make_bytelm_task(size)

    return factory


BUILTIN_TASKS: Dict[str, Callable[[], Task]] = {
    "bytelm": _bytelm("small"),
    "bytelm-tiny": _bytelm("tiny"),
}


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


def _load_task(name: str) -> Task:
    check_task_name(name)
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]()
    module_name, _, function_name = name.partition(":")
    make_local_modules_importable()
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:
        raise TaskLoadError(f"--task: importing {module_name!r} called sys.exit({e.code!r}); "
                            f"a task module must not exit when imported") from e
    except Exception as e:  # a user's module can raise anything on import
        raise cannot_import(module_name, e) from e
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
