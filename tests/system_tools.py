"""Debian tools that tests use for real (promtool, docker-compose, chromium), installed when missing.

CI installs them first (.ci/run); a developer's machine gets them here when the tests run as root, and
otherwise the tests that need them skip with the package to install.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

APT_TIMEOUT_SECONDS = 150  # under the suite's 240 s per-test timeout, which covers fixture setup


def system_tool(binary: str, package: str) -> str:
    """Path of `binary`, installing Debian's `package` first when missing and we are root; else skip."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{binary} is missing and cannot be installed here (needs root and apt-get): "
                    f"install the Debian package {package!r}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=60", "install", "-y", "--no-install-recommends", package]
    for command in (install, ["apt-get", "-o", "DPkg::Lock::Timeout=60", "update"], install):
        try:
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(command)} took over {APT_TIMEOUT_SECONDS}s; install {package!r} by hand")
        if command is install and result.returncode == 0 and shutil.which(binary):
            return shutil.which(binary)
    pytest.skip(f"apt-get could not install {package!r} for {binary}: {result.stderr.strip()[-500:]}")
