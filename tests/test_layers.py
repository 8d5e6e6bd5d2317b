"""The design note's layer table (einshard/README.md) is true: read from the note, held to the code.

Every module's imports are read from its source (the AST, imports inside functions included,
without importing anything): a module imports modules of its own layer and of the layers above
it in the table, never of a layer below; no import circle; every module has a row, every row a
module; and the table's JAX column says whether the module imports JAX or NumPy itself.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "einshard"
NOTE = PACKAGE / "README.md"
TOP = "einshard"  # the layer of the package's own top-level modules
JAX_MODULES = {"jax", "jaxlib", "numpy"}

ROW = re.compile(
    r"^\| `(?P<layer>[\w.]+)` \| `(?P<module>[\w.]+)` \| (?P<decides>.+?) \| (?P<jax>yes|no) \|$"
)


@dataclass(frozen=True)
class Row:
    layer: str
    module: str  # dotted: einshard._trees._paths
    jax: bool


def note_rows(text: str) -> list[Row]:
    """The layer table's rows, in order (a module's layer is its folder, or ``einshard``)."""
    rows = []
    for line in text.splitlines():
        match = ROW.match(line.strip())
        if match:
            folder = "" if match["layer"] == TOP else f".{match['layer']}"
            stem = match["module"].removesuffix(".py")
            name = f"{TOP}{folder}" if stem == "__init__" else f"{TOP}{folder}.{stem}"
            rows.append(Row(match["layer"], name, match["jax"] == "yes"))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_sources() -> dict[str, str]:
    """Every module of the package by dotted name; empty ``__init__.py`` files (mere folders) left out."""
    return {
        module_name(path): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.read_text(encoding="utf-8").strip() or path.name != "__init__.py"
    }


def is_package(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").exists()


def imports_of(name: str, source: str, known: set[str]) -> tuple[set[str], set[str]]:
    """The einshard modules ``name`` imports, and the other top-level modules, from anywhere in it."""
    package = name if is_package(name) else name.rpartition(".")[0]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from . import x` and `from .._trees import _paths` import submodules.
            targets = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known]
            targets = targets or [module]
        else:
            continue
        for target in targets:
            if target == TOP or target.startswith(TOP + "."):
                inside.add(target)
            else:
                outside.add(target.split(".")[0])
    return inside, outside


def layer_of(name: str, layers: dict[str, str]) -> str | None:
    """The layer of a module, or of the folder a package import names."""
    if name in layers:
        return layers[name]
    folder = name.split(".")[1] if name.count(".") else None
    return folder if folder in {layer for layer in layers.values()} else None


def violations(sources: dict[str, str], rows: list[Row]) -> list[str]:
    """Every way the code and the table disagree; empty when the table is true."""
    problems = []
    order = list(dict.fromkeys(row.layer for row in rows))
    layers = {row.module: row.layer for row in rows}
    known = set(sources) | {row.module for row in rows}
    for row in rows:
        if row.module not in sources:
            problems.append(f"{row.module}: in the table, but there is no such module")
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        if name not in layers:
            problems.append(f"{name}: a module the table does not list")
            continue
        inside, outside = imports_of(name, source, known)
        graph[name] = {target for target in inside if target in sources}
        rank = order.index(layers[name])
        for target in sorted(inside):
            target_layer = layer_of(target, layers)
            if target_layer is None:
                problems.append(f"{name} imports {target}, which the table does not list")
            elif order.index(target_layer) > rank:
                problems.append(
                    f"{name} (layer {layers[name]}) imports {target} (layer {target_layer}, below it)"
                )
        row = next(r for r in rows if r.module == name)
        uses_jax = bool(outside & JAX_MODULES)
        if uses_jax != row.jax:
            said = "yes" if row.jax else "no"
            problems.append(
                f"{name}: the table says JAX {said!r}, but it imports {sorted(outside & JAX_MODULES)}"
            )
    problems += [f"an import circle: {' -> '.join(circle)}" for circle in circles(graph)]
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected set of modules that import each other."""
    found, state = [], {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_note_s_layer_table_is_true():
    rows = note_rows(NOTE.read_text(encoding="utf-8"))
    assert len(rows) >= 30, "the layer table was not found in einshard/README.md"
    assert [row.layer for row in rows] == sorted(
        (row.layer for row in rows), key=list(dict.fromkeys(r.layer for r in rows)).index
    ), "each layer's rows stand together"
    problems = violations(package_sources(), rows)
    assert not problems, "einshard/README.md's layer table and the code disagree:\n" + "\n".join(problems)


def test_a_planted_upward_import_fails():
    """The check sees an import that goes up a layer, inside a function too, and the circle it makes."""
    rows = note_rows(NOTE.read_text(encoding="utf-8"))
    sources = package_sources()
    sources["einshard._trees._paths"] += "\n\ndef _planted():\n    from ..integrations import flax\n"
    sources["einshard._language._numbers"] += "\nimport jax\n"
    problems = violations(sources, rows)
    assert any(
        p.startswith("einshard._trees._paths (layer _trees) imports einshard.integrations.flax")
        for p in problems
    ), problems
    assert any(p.startswith("an import circle:") and "einshard.integrations.flax" in p for p in problems)
    assert any(p.startswith("einshard._language._numbers: the table says JAX 'no'") for p in problems)


def test_a_module_missing_from_the_table_fails():
    rows = [
        row for row in note_rows(NOTE.read_text(encoding="utf-8")) if row.module != "einshard._trees._rules"
    ]
    sources = package_sources()
    sources["einshard._cost._new"] = "from .._trees import _rules\n"
    problems = violations(sources, rows)
    assert "einshard._trees._rules: a module the table does not list" in problems
    assert "einshard._cost._new: a module the table does not list" in problems
