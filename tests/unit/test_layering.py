"""Modules import only from below: the OpenAI wire (wire/) is spoken by both the dispatch
(router/) and the arms' front (engine/), so neither imports the other, and the wire imports
neither; the config (config/) is read by all of them and imports none."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "specserve"
# package -> packages it must not import
FORBIDDEN = {
    "config": ("specserve.router", "specserve.engine", "specserve.wire", "specserve.loop"),
    "engine": ("specserve.router",),
    "router": ("specserve.engine",),
    "wire": ("specserve.router", "specserve.engine"),
}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_from_below(package):
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in sorted((PACKAGE / package).glob("*.py"))
        for module in sorted(imported_modules(path))
        if module.startswith(FORBIDDEN[package])
    ]
    assert not wrong, wrong
