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


# --- the note's prose: what it names exists and is used; decisions stay with their owners ----------

NAMED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")  # `_module.name`, `_module.Class.method`
ROW_NAMES = re.compile(r"`([A-Za-z_]\w*)`")  # a row's own names: `place_leaf`
# Decisions only their owner module makes (the note's "Which module owns which decision").
OWNED = [
    (
        "einshard._arrays._leaves",
        re.compile(r"isinstance\([^()]*\(?[^()]*\bjax\.Array\b"),
        "an inline isinstance(..., jax.Array): ask _leaves (is_jax_array, is_traced, carried_sharding)",
    ),
    (
        "einshard._language._numbers",
        re.compile(r"isinstance\((?:n_devices|model|count|devices|n)\s*,\s*bool\)"),
        "a device-count check: use _numbers.checked_count",
    ),
    (
        "einshard._arrays._leaves",
        re.compile(r"math\.prod\([^()]*\)\s*\*\s*(?:_?itemsize\(|[\w.]*\.itemsize\b)"),
        "a leaf's bytes computed inline: use _leaves.nbytes",
    ),
    (
        "einshard._language._expression",
        re.compile(r"[\"']abcdefghijklmnopqrstuvwxyz[\"']"),
        "an alphabet of axis names: use _expression.LETTERS / axis_names",
    ),
]


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's top-level names: functions, classes, assignments and the names it imports."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = node
    return names


def _uses(sources: dict[str, str]) -> dict[str, int]:
    """How often each identifier is used (loaded, called, imported by name) across the package."""
    counts: dict[str, int] = {}
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            name = None
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                name = node.id
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                name = node.attr
            elif isinstance(node, ast.alias) and node.name != "*":
                name = node.name
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def prose_violations(note: str, sources: dict[str, str], rows: list[Row]) -> list[str]:
    """Each name the note gives that does not exist or has no use; each decision made out of its owner."""
    problems = []
    by_stem: dict[str, list[str]] = {}
    for row in rows:
        stem = row.module.rsplit(".", 1)[-1]
        by_stem.setdefault(stem, []).append(row.module)
    trees = {name: ast.parse(source) for name, source in sources.items()}
    definitions = {name: _definitions(tree) for name, tree in trees.items()}
    uses = _uses(sources)
    layers = {row.layer for row in rows}

    def check(module: str, chain: list[str], claim: str) -> None:
        if module not in trees:
            problems.append(f"the note names {claim}, but there is no module {module}")
            return
        node = definitions[module].get(chain[0])
        if node is None:
            problems.append(f"the note names {claim}, but {module} defines no {chain[0]}")
            return
        for attribute in chain[1:]:
            members = (
                _definitions(ast.Module(body=node.body, type_ignores=[]))
                if isinstance(node, ast.ClassDef)
                else {}
            )
            if attribute not in members:
                problems.append(f"the note names {claim}, but {chain[0]} has no {attribute}")
                return
            node = members[attribute]
        if not isinstance(node, ast.ImportFrom) and uses.get(chain[-1], 0) == 0:
            problems.append(f"the note names {claim}, which nothing in the package uses")

    for token in dict.fromkeys(NAMED.findall(note)):
        if token.endswith(".py") or token in layers:  # a file, or a folder (a layer: `_cost.xla`)
            continue
        first, *chain = token.split(".")
        candidates = by_stem.get(first, [])
        if len(candidates) == 1:
            check(candidates[0], chain, f"`{token}`")
    table_lines = [line for line in note.splitlines() if ROW.match(line.strip())]  # one per row, in order
    for line in table_lines:
        match = ROW.match(line.strip())
        assert match is not None
        module = rows[table_lines.index(line)].module
        for name in dict.fromkeys(ROW_NAMES.findall(match["decides"])):
            if name in definitions.get(module, {}):
                check(module, [name], f"`{name}` in {module}'s row")
            elif (
                not any(name in d for d in definitions.values())
                and name not in by_stem  # a module
                and not any(f'"{name}"' in source for source in sources.values())  # a word written (a kind)
            ):
                problems.append(f"{module}'s row names `{name}`, which the package does not define")
    for owner, pattern, what in OWNED:
        for name, source in sources.items():
            if name != owner and pattern.search(source):
                problems.append(f"{name}: {what}")
    return problems


def test_the_note_s_prose_is_true():
    note = NOTE.read_text(encoding="utf-8")
    problems = prose_violations(note, package_sources(), note_rows(note))
    assert not problems, "einshard/README.md's prose and the code disagree:\n" + "\n".join(problems)


def test_planted_violations_of_the_note_s_prose_fail():
    """A name that is gone, a name nothing uses, and each decision made outside its owner."""
    note = NOTE.read_text(encoding="utf-8")
    rows = note_rows(note)
    sources = package_sources()
    planted = dict(sources)
    planted["einshard._cost.pipeline._compile"] += (
        "\n\ndef _planted(leaf, n_devices):\n    return isinstance(leaf, (jax.Array, int))\n"
    )
    planted["einshard._planning.search._planner"] += (
        "\n\ndef _planted(n_devices):\n    if isinstance(n_devices, bool):\n        raise ValueError\n"
        "    return math.prod(leaf.shape) * itemsize(leaf.dtype)\n"
    )
    planted["einshard._cost.findings._detect"] += "\n_PLANTED = 'abcdefghijklmnopqrstuvwxyz'\n"
    extra = note + "\nSee `_leaves.is_gone` and `_place.never_called`.\n"
    planted["einshard._arrays._place"] += "\n\ndef never_called():\n    return None\n"
    problems = prose_violations(extra, planted, rows)
    assert any(
        p.startswith("einshard._cost.pipeline._compile: an inline isinstance(..., jax.Array)")
        for p in problems
    )
    assert "einshard._planning.search._planner: a device-count check: use _numbers.checked_count" in problems
    assert (
        "einshard._planning.search._planner: a leaf's bytes computed inline: use _leaves.nbytes" in problems
    )
    assert (
        "einshard._cost.findings._detect: an alphabet of axis names: use _expression.LETTERS / axis_names"
        in problems
    )
    assert "the note names `_leaves.is_gone`, but einshard._arrays._leaves defines no is_gone" in problems
    assert "the note names `_place.never_called`, which nothing in the package uses" in problems
    assert not prose_violations(note, sources, rows)


# --- XLA's text is read in the xla folder alone ------------------------------------------------------

# The cost model's modules that may run regular expressions: the readers of XLA's program text
# (the xla folder), and the reader of XLA's GPU specs (_compilers).
TEXT_READERS = {"einshard._cost.hardware._compilers"}
XLA_FOLDER = "einshard._cost.xla"


def regex_violations(sources: dict[str, str]) -> list[str]:
    """Each ``import re`` or ``re.`` use in a ``_cost`` module other than the readers of XLA's text."""
    problems = []
    for name, source in sources.items():
        if not name.startswith("einshard._cost.") or name in TEXT_READERS or name.startswith(XLA_FOLDER):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import) and any(alias.name == "re" for alias in node.names):
                problems.append(f"{name}:{node.lineno}: imports re (XLA's text is read in xla/ alone)")
            elif isinstance(node, ast.ImportFrom) and node.module == "re" and not node.level:
                problems.append(f"{name}:{node.lineno}: imports from re (XLA's text is read in xla/ alone)")
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "re"
            ):
                problems.append(f"{name}:{node.lineno}: re.{node.attr} (XLA's text is read in xla/ alone)")
    return problems


def test_xla_s_text_is_read_in_the_xla_folder_alone():
    problems = regex_violations(package_sources())
    assert not problems, (
        "a regular expression outside _cost/xla (ask _hlo's Module or Instruction):\n" + "\n".join(problems)
    )


def test_a_planted_regex_in_the_cost_model_fails():
    """A regex over XLA's text in another _cost module is seen, imported either way."""
    sources = package_sources()
    planted = dict(sources)
    planted["einshard._cost.reading._flow"] += '\nimport re\n\n_PLANTED = re.compile(r"body=%?(\\w+)")\n'
    planted["einshard._cost.findings._detect_remat"] += "\nfrom re import search\n"
    problems = regex_violations(planted)
    assert any(p.startswith("einshard._cost.reading._flow:") and "imports re" in p for p in problems), (
        problems
    )
    assert any(p.startswith("einshard._cost.reading._flow:") and "re.compile" in p for p in problems), (
        problems
    )
    assert any(
        p.startswith("einshard._cost.findings._detect_remat:") and "imports from re" in p for p in problems
    )
    assert not regex_violations(sources)


def test_the_detectors_ask_the_data_flow_not_the_attribution():
    """The uses and the detectors of waste import the program's data flow from _flow, never _attribution."""
    sources = package_sources()
    askers = [
        name
        for name in sources
        if name.startswith(
            (
                "einshard._cost.findings._detect",
                "einshard._cost.reading._uses",
                "einshard._cost.findings._findings",
            )
        )
    ]
    assert len(askers) >= 6
    for name in askers:
        inside, _ = imports_of(name, sources[name], set(sources))
        assert "einshard._cost.reading._attribution" not in inside, name
