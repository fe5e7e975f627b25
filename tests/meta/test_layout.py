"""The project's layering, checked without the import-linter CLI (pyproject.toml states the same contract).

Allowed import directions between our packages:
  - peer may import averaging, dht and monitoring;
  - averaging may import dht, and nothing else of ours;
  - dht and monitoring import nothing of ours.
(tests, benchmarks and examples may import everything; they are not checked here.)
No module of these packages may take part in an import cycle, counting imports made inside
functions and under `if TYPE_CHECKING:`, since the graph (grimp's) sees those too.
The last two tests run `ruff check` and `lint-imports` on the repository, as .ci/run does.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "peer": {"averaging", "dht", "monitoring"},
    "averaging": {"dht"},
    "dht": set(),
    "monitoring": set(),
}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ALLOWED, cache_dir=None)


def strongly_connected_components(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's algorithm (iterative), edges importer -> imported; only components of 2+ modules or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.find_modules_directly_imported_by(successor)))))
                    break
                if successor in on_stack:
                    low[module] = min(low[module], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1 or graph.direct_import_exists(importer=module, imported=module):
                        components.append(sorted(component))
    return components


def one_cycle(graph: grimp.ImportGraph, component: list[str]) -> str:
    """'a -> b -> a': the shortest cycle through the component's first module, staying inside the component."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for module in frontier:
            for imported in sorted(graph.find_modules_directly_imported_by(module) & members):
                if imported == start:
                    chain = [start]
                    while module != start:
                        chain.append(module)
                        module = previous[module]
                    return " -> ".join([start, *reversed(chain[1:]), start])
                if imported not in previous:
                    previous[imported] = module
                    next_frontier.append(imported)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {start}")  # cannot happen for a strongly connected component


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    cycles = [f"{one_cycle(graph, c)}   (cycle among: {', '.join(c)})" for c in strongly_connected_components(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_allowed_import_directions(graph: grimp.ImportGraph) -> None:
    offending = []
    for importer in sorted(graph.modules):
        importer_package = importer.split(".")[0]
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            imported_package = imported.split(".")[0]
            if imported_package == importer_package or imported_package in ALLOWED[importer_package]:
                continue
            for detail in graph.get_import_details(importer=importer, imported=imported):
                offending.append(f"{importer}:{detail['line_number']}: {detail['line_contents']}")
    assert not offending, (
        "imports against the layering (peer -> averaging -> dht; dht and monitoring import nothing of ours):\n"
        + "\n".join(offending)
    )


def run_tool(*command: str) -> subprocess.CompletedProcess:
    executable = shutil.which(command[0], path=str(Path(sys.executable).parent)) or shutil.which(command[0])
    assert executable, f"{command[0]} is missing: it comes with the test extra, pip install -e '.[test]'"
    return subprocess.run([executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_passes() -> None:
    result = run_tool("ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_linter_contracts_pass() -> None:
    result = run_tool("lint-imports", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_default_checkpoint_dir_is_ignored_by_git():
    """Following the README from the repository root writes the default checkpoint directory there."""
    from peer.config import load_config

    default = load_config().checkpoint.checkpoint_dir
    result = subprocess.run(["git", "check-ignore", "-q", str(default / "checkpoint-000001-epoch000001.pt")],
                            cwd=ROOT, timeout=30)
    assert result.returncode == 0, f"{default}/ is not ignored by git"
