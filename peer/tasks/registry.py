"""Resolve a task name: a built-in name, or `module:function` returning a Task."""
from __future__ import annotations

import importlib
import os
import threading
from typing import Callable, Dict, Optional, TypeVar

from peer.task_names import (
    TaskLoadError,
    cannot_import,
    check_task_name,
    make_local_modules_importable,
)
from peer.task_options import HF_CAUSAL_LM, options_not_taken
from peer.tasks.base import Task
from peer.tasks.options import TaskOptions

T = TypeVar("T")

HF_EXTRA = "pip install -e '.[hf]'"
"""What installs hf-causal-lm's optional packages (pyproject.toml: the `hf` extra)."""
HF_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def _bytelm(size: str) -> Callable[[TaskOptions], Task]:
    def factory(options: TaskOptions) -> Task:
        from peer.tasks.bytelm import make_bytelm_task  # imported lazily: it scans the stdlib at build time

        return make_bytelm_task(size)

    return factory


def _hf_causal_lm(options: TaskOptions) -> Task:
    # This task never downloads (every load names local files, `local_files_only`); huggingface_hub and datasets
    # read these once, when first imported, so that whatever path the libraries take, they do not look online.
    for variable in HF_OFFLINE_VARIABLES:
        os.environ[variable] = "1"
    try:  # transformers, datasets, tokenizers and safetensors are an optional extra
        from peer.tasks.hf_causal_lm import make_hf_causal_lm_task
    except ImportError as e:
        missing = e.name or str(e)
        raise TaskLoadError(f"--task {HF_CAUSAL_LM} needs the optional packages transformers, datasets, tokenizers "
                            f"and safetensors ({missing} cannot be imported); install them: {HF_EXTRA}") from e
    return make_hf_causal_lm_task(options)


BUILTIN_TASKS: Dict[str, Callable[[TaskOptions], Task]] = {
    "bytelm": _bytelm("small"),
    "bytelm-tiny": _bytelm("tiny"),
    HF_CAUSAL_LM: _hf_causal_lm,
}


def load_task(name: str, timeout_seconds: Optional[float] = None, options: Optional[TaskOptions] = None) -> Task:
    """Build the task named `name`; raise TaskLoadError with a one-line reason on failure.

    :param options: the settings of a built-in task that takes any (peer/tasks/options.py)
    :param timeout_seconds: a module that hangs on import, or a factory that never returns, is reported after
        this long
    """
    if timeout_seconds is None:
        return _load_task(name, options or TaskOptions())
    return run_within(timeout_seconds, lambda: _load_task(name, options or TaskOptions()), TaskLoadError(
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


def _load_task(name: str, options: TaskOptions) -> Task:
    check_task_name(name)
    stray = options_not_taken(name, options)
    if stray:
        raise TaskLoadError(stray)
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name](options)
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
