"""The README stays true: its two leading commands, and a row for every flag."""
from __future__ import annotations

import re

from peer.config import OPTIONS
from tests.peers import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
COMMANDS = re.findall(r"```bash\n(.+?)\n```", README)


def test_readme_leads_with_install_and_run_then_tests():
    install_and_run, run_tests = COMMANDS[0], COMMANDS[1]
    assert install_and_run.endswith("peer start")
    assert "'.[test]'" in run_tests and run_tests.endswith("pytest")


def test_ci_runs_the_readme_test_command():
    assert COMMANDS[1] in (REPO_ROOT / ".ci" / "run").read_text()


def test_readme_documents_every_flag():
    missing = [option.flag for option in OPTIONS.values() if f"| `{option.flag}` |" not in README]
    assert not missing
