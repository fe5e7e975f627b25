"""The form of a --task name, checked without importing torch (peer/cli/preflight.py) and again when the task loads.

A built-in name, or `module:function` whose top-level module can be found from here. Importing the
module and building the task (peer/tasks/registry.py) can fail in more ways; a typo is caught here.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Optional

from peer.task_options import HF_CAUSAL_LM

BUILTIN_TASK_NAMES = ("bytelm", "bytelm-tiny", HF_CAUSAL_LM)  # peer/tasks/registry.py builds them


class TaskLoadError(ValueError):
    """The task named by --task cannot be built; the message says why and how to fix it."""


def check_task_name(name: str) -> None:
    """:raises TaskLoadError: the name is neither a built-in nor module:function with a module to be found"""
    if name in BUILTIN_TASK_NAMES:
        return
    module_form = _as_module(name)
    if module_form is not None:
        raise TaskLoadError(f"--task {name}: a task is named as module:function, not as a file path; "
                            f"give --task {module_form}")
    if ":" not in name:
        close = difflib.get_close_matches(name, BUILTIN_TASK_NAMES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TaskLoadError(
            f"--task: unknown task {name!r}; {hint}use a built-in ({', '.join(BUILTIN_TASK_NAMES)}) "
            f"or 'module:function' returning a peer.tasks.Task"
        )
    module_name = name.partition(":")[0]
    top_level = module_name.partition(".")[0]
    make_local_modules_importable()
    if not top_level or importlib.util.find_spec(top_level) is None:  # finding a top-level module runs nothing
        raise cannot_import(module_name, ModuleNotFoundError(f"No module named {top_level!r}"))


def cannot_import(module_name: str, error: BaseException) -> TaskLoadError:
    return TaskLoadError(f"--task: cannot import module {module_name!r} ({type(error).__name__}: {error}); "
                         f"check that it is importable (on PYTHONPATH) and imports cleanly")


def make_local_modules_importable() -> None:
    """As `python -m` does, so that `peer start --task mymodule:make` finds ./mymodule.py; appended, so that a
    local file never shadows an installed package."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


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
