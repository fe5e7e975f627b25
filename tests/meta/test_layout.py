"""The project's layering, checked without the import-linter CLI (pyproject.toml states the same contract).

Allowed import directions between our packages:
  - peer may import averaging, dht and monitoring;
  - averaging may import dht, and nothing else of ours;
  - dht and monitoring import nothing of ours.
(tests, benchmarks and examples may import everything; they are not checked here.)
No module of these packages may take part in an import cycle, counting imports made inside
functions and under `if TYPE_CHECKING:`, since the graph (grimp's) sees those too.
Only the hivemind adapter (averaging/adapter/) imports hivemind's internal modules (an import-linter contract,
tests/meta/hivemind_contract.py) or touches private attributes of hivemind objects (checked here on the syntax tree).
Two tests run `ruff check` and `lint-imports` on the repository, as .ci/run does.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Set, Tuple

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


# --- nothing outside the hivemind adapter touches hivemind's private attributes -------------------------------

ADAPTER = ROOT / "averaging" / "adapter"
# The one exception, by file and attribute. dht/ lies below averaging/ in the layers, so it cannot reach the
# adapter, and it must point hivemind's unix sockets at a directory of its own before the first DHT starts:
# hivemind has no parameter for that, only this class attribute (a setting, no code of hivemind's replaced).
OUTSIDE_THE_ADAPTER = {
    ("dht/sockets.py", "touches hivemind's ._UNIX_SOCKET_PREFIX"),
    # threading._shutdown, the standard library's, whose name hivemind also defines: what a forked peer runs at exit
    ("peer/process/preforked.py", "touches hivemind's ._shutdown"),
}


def our_modules() -> List[Path]:
    return sorted(path for package in ALLOWED for path in (ROOT / package).rglob("*.py")
                  if ADAPTER not in path.parents)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST) -> Set[str]:
    """Names a module defines: functions, classes, and attributes or variables it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


class HivemindPrivates(ast.NodeVisitor):
    """Private hivemind attributes one module touches: read, assigned or overridden."""

    def __init__(self, hivemind_defined: Set[str], ours_defined: Set[str]):
        self.hivemind_defined, self.ours_defined = hivemind_defined, ours_defined
        self.bound: Set[str] = set()  # local names that stand for hivemind modules or objects
        self.found: List[Tuple[int, str]] = []

    def _from_hivemind(self, node: ast.AST) -> bool:
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.value if not isinstance(node, ast.Call) else node.func
        return isinstance(node, ast.Name) and node.id in self.bound

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "hivemind":
                self.bound.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").split(".")[0] == "hivemind":
            for alias in node.names:
                if is_private(alias.name):
                    self.found.append((node.lineno, f"imports {alias.name} from {node.module}"))
                self.bound.add(alias.asname or alias.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if any(self._from_hivemind(base) for base in node.bases):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_private(item.name) \
                        and item.name in self.hivemind_defined:
                    self.found.append((item.lineno, f"{node.name} overrides hivemind's {item.name}"))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if is_private(node.attr) and node.attr in self.hivemind_defined:
            if self._from_hivemind(node.value) or node.attr not in self.ours_defined:
                self.found.append((node.lineno, f"touches hivemind's .{node.attr}"))
        self.generic_visit(node)


def test_only_the_hivemind_adapter_touches_hivemind_privates():
    """Every patch, override and private read of hivemind lives in averaging/adapter/ (where upstream.py
    fingerprints what it relies on); everywhere else uses hivemind's public names only."""
    import hivemind

    hivemind_defined = set().union(*(defined_names(ast.parse(path.read_text()))
                                     for path in Path(hivemind.__file__).parent.rglob("*.py")))
    trees = {path: ast.parse(path.read_text()) for path in our_modules()}
    ours_defined = set()
    for tree in trees.values():  # what our own objects define; hivemind's names we assign are caught below
        ours_defined |= defined_names(tree)
    found = []
    for path, tree in trees.items():
        visitor = HivemindPrivates(hivemind_defined, ours_defined)
        visitor.visit(tree)
        found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in visitor.found
                  if (str(path.relative_to(ROOT)), what) not in OUTSIDE_THE_ADAPTER]
    assert not found, "hivemind privates outside averaging/adapter/:\n" + "\n".join(found)


def test_the_default_checkpoint_dir_is_ignored_by_git():
    """Following the README from the repository root writes the default checkpoint directory there."""
    from peer.config import load_config

    default = load_config().checkpoint.checkpoint_dir
    written = default / "checkpoint-000001-epoch000001" / "model.safetensors"
    result = subprocess.run(["git", "check-ignore", "-q", str(written)], cwd=ROOT, timeout=30)
    assert result.returncode == 0, f"{default}/ is not ignored by git"
