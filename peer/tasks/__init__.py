"""Tasks: the built-in ones and the loader for `module:function` tasks."""
from peer.tasks.base import Task
from peer.tasks.registry import BUILTIN_TASKS, TaskLoadError, load_task

__all__ = ["BUILTIN_TASKS", "Task", "TaskLoadError", "load_task"]
