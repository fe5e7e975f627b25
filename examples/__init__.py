"""Examples: a custom task (custom_task.py) with its swarm test, and config presets (configs/)."""
