"""The settings a built-in task is built from (hf-causal-lm's model, data and tokenizer).

They come from the peer's config, and every checkpoint records them (`"task_options"`), so that `peer export`
rebuilds the task that wrote it: `load_task(name, options=TaskOptions(**state["task_options"]))`. The model lives
in peer/task_options.py, which imports no torch, so that the config can use it before torch is imported.
"""
from peer.task_options import TaskOptions

__all__ = ["TaskOptions"]
