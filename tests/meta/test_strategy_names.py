"""A strategy's name is spelled in the strategy registry and in the strategy's own files only: the config's
choices and rules, the manifest, `peer start`, the composition root, payload accounting and the benchmarks read
averaging/registry.py, so that adding a strategy touches its file and the registry."""
from __future__ import annotations

import ast

from averaging.config import CODECS
from averaging.registry import STRATEGY_NAMES
from tests.peers import REPO_ROOT

REGISTRY, STRATEGIES = REPO_ROOT / "averaging" / "registry.py", REPO_ROOT / "averaging" / "strategies"
SPELLED = set(STRATEGY_NAMES) - set(CODECS)  # "none" names a codec too: a bare string cannot tell which


def test_only_the_registry_and_the_strategies_spell_a_strategys_name():
    found = []
    for package in ("peer", "averaging", "benchmarks"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path == REGISTRY or STRATEGIES in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in SPELLED:
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "strategy names outside averaging/registry.py and averaging/strategies/:\n" + "\n".join(found)
