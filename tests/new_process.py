"""Checks that need a fresh interpreter: what a module sets as it is imported, a fork, a process-wide setting. Each
runs a Python script in a new process and reads the JSON value it prints last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterable, Optional

TIMEOUT_SECONDS = 180  # generous: CI runs these beside busy swarms


def python_result(script: str, *args: str, env: Optional[dict] = None) -> Any:
    """Run `script` (with `args` as sys.argv[1:]) in a new Python process; the JSON value it printed last."""
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_SECONDS, cwd=os.getcwd())
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def environment_without(names: Iterable[str]) -> dict:
    """This process's environment, less `names`: what the script would otherwise inherit from the test's."""
    names = set(names)
    return {name: value for name, value in os.environ.items() if name not in names}
