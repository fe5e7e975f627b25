"""An import-linter contract: only the hivemind adapter imports hivemind's internal modules.

import-linter sees an external package such as hivemind only as a whole (grimp squashes it to its top level),
so its built-in `forbidden` contract cannot name hivemind's submodules. This contract reads the import lines
instead. pyproject.toml registers it (`contract_types`); `lint-imports` finds it from the repository root.
"""
from __future__ import annotations

import re
from typing import List

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck

IMPORTED_MODULE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))")


def imported_module(line: str) -> str:
    """`from a.b import c` -> a.b; `import a.b` -> a.b."""
    match = IMPORTED_MODULE.match(line)
    return (match.group(1) or match.group(2)) if match else ""


class HivemindInternalsContract(Contract):
    """Modules outside `allowed_importers` may not import any of `internal_modules` (or their submodules)."""

    type_name = "hivemind_internals"
    allowed_importers = fields.ListField(subfield=fields.ModuleField())
    internal_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        allowed = [module.name for module in self.allowed_importers]
        violations: List[str] = []
        for importer in sorted(graph.find_modules_that_directly_import("hivemind")):
            if any(importer == name or importer.startswith(name + ".") for name in allowed):
                continue
            for detail in graph.get_import_details(importer=importer, imported="hivemind"):
                module = imported_module(detail["line_contents"])
                if any(module == name or module.startswith(name + ".") for name in self.internal_modules):
                    violations.append(f"{importer}:{detail['line_number']}: {detail['line_contents'].strip()}")
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error("Only the hivemind adapter (averaging/adapter/) may import these; move the code there:")
        for violation in check.metadata["violations"]:
            output.indent_cursor()
            output.print_error(violation)
