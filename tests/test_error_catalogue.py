"""docs/errors.md catalogues every message einshard raises or warns, and nothing else.

The messages are read from einshard's source, without importing it (no JAX, no devices):

* every ``EinshardError(...)`` headline, including those built by helper functions
  (``_error(text, headline, ...)``) and through local variables;
* every ``warnings.warn(..., EinshardWarning)`` message (and ``EinshardDeprecationWarning``);
* every context line (``error.add_context(...)``, ``EinshardError(..., context=[...])``);
* the command line's argument errors (``argparse.ArgumentTypeError``) and the
  ``ImportError`` for a missing ``rich``.

Each message becomes a template: its literal text, with a hole (any text) for each
f-string field that is not itself a known string. A template must match a whole line of
the catalogue where such a message is shown (``einshard.EinshardError: <headline>``, a
context line indented by two spaces, ...), so a message added or reworded without its
catalogue entry fails here. Conversely, every message the catalogue shows must match a
template, so an entry for a message that no longer exists fails too.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "einshard"
CATALOGUE = ROOT / "docs" / "errors.md"

Template = tuple[str | None, ...]  # literal text, and None for a hole

# Where each kind of message shows on the catalogue page: the start of its line.
PREFIXES = {
    "error": r"(?:einshard\.EinshardError: |einshard\.DoesNotFitError: |einshard: error: )",
    "warning": r"einshard\.Einshard(?:Deprecation)?Warning: ",
    "context": r"  ",
    "argument": r"python -m einshard: error: argument [^\s:]+: ",
    "import": r"(?:ImportError: |einshard: error: )",
}
# The exceptions einshard may raise besides EinshardError: the command line's argument errors
# (argparse prints them), the ImportError for a missing optional dependency, assertions of its
# own invariants, and the end of a child process's second run of the user's script (caught there:
# neither is a user error).
OTHER_RAISES = {
    "ArgumentTypeError": "argument",
    "ImportError": "import",
    "AssertionError": None,
    "ScriptStopped": None,
    "NotLayers": None,  # a plan's cut of the step into fewer layers failed: it compiles the step whole
}


@dataclasses.dataclass(frozen=True)
class Message:
    """One message template and where einshard builds it."""

    kind: str
    template: Template
    where: str

    def pattern(self) -> re.Pattern[str]:
        body = "".join(".*" if part is None else re.escape(part) for part in self.template)
        return re.compile(f"^{PREFIXES[self.kind]}{body}$", re.MULTILINE)

    def __str__(self) -> str:
        text = "".join("{…}" if part is None else part for part in self.template)
        return f"{self.where}: {self.kind} {text!r}"


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _normalized(parts: list[str | None]) -> Template:
    """Joins neighbouring literals and neighbouring holes; drops empty literals."""
    out: list[str | None] = []
    for part in parts:
        if part == "":
            continue
        if out and part is None and out[-1] is None:
            continue
        if out and part is not None and out[-1] is not None:
            out[-1] = f"{out[-1]}{part}"
            continue
        out.append(part)
    return tuple(out)


class Module:
    """One source file of einshard: its syntax tree and what resolving a message needs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.relative_to(ROOT).as_posix()
        self.tree = ast.parse(path.read_text(encoding="utf-8"), filename=self.name)
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.functions = {
            node.name: node
            for node in self.tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }

    def scopes(self, node: ast.AST) -> list[ast.AST]:
        """The functions enclosing ``node``, innermost first, then the module."""
        found: list[ast.AST] = []
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                found.append(node)
        return [*found, self.tree]

    def assignments(self, name: str, scopes: list[ast.AST]) -> list[ast.expr]:
        """The values assigned to ``name`` in the innermost scope that assigns it."""
        for scope in scopes:
            values = [
                node.value
                for node in _own_nodes(scope)
                if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            ]
            values += [
                node.value
                for node in _own_nodes(scope)
                if isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
                and node.value is not None
            ]
            if values:
                return values
        return []

    def templates(self, node: ast.expr, scopes: list[ast.AST], depth: int = 0) -> list[Template]:
        """Every text ``node`` may evaluate to, as templates."""
        hole: list[Template] = [(None,)]
        if depth > 8:
            return hole
        if isinstance(node, ast.Constant):
            return [(node.value,)] if isinstance(node.value, str) else hole
        if isinstance(node, ast.JoinedStr):
            choices: list[list[Template]] = []
            for value in node.values:
                if isinstance(value, ast.FormattedValue):
                    choices.append([self._field(value, scopes, depth)])
                else:
                    choices.append(self.templates(value, scopes, depth + 1))
            return [_normalized([p for t in combo for p in t]) for combo in itertools.product(*choices)]
        if isinstance(node, ast.IfExp):
            branches = (node.body, node.orelse)
            return [t for branch in branches for t in self.templates(branch, scopes, depth + 1)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            lefts = self.templates(node.left, scopes, depth + 1)
            rights = self.templates(node.right, scopes, depth + 1)
            return [_normalized([*a, *b]) for a in lefts for b in rights]
        if isinstance(node, ast.Name):
            values = self.assignments(node.id, scopes)
            return [t for value in values for t in self.templates(value, scopes, depth + 1)] or hole
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.functions:
            function = self.functions[node.func.id]
            returns = [n.value for n in _own_nodes(function) if isinstance(n, ast.Return) and n.value]
            found = [t for value in returns for t in self.templates(value, [function, self.tree], depth + 1)]
            return found or hole
        return hole

    def _field(self, value: ast.FormattedValue, scopes: list[ast.AST], depth: int) -> Template:
        """An f-string field: the text it stands for when that is one known string, else a hole."""
        if value.conversion != -1 or value.format_spec is not None:
            return (None,)
        if isinstance(value.value, ast.Name | ast.Call):
            found = self.templates(value.value, scopes, depth + 1)
            if len(found) == 1:
                return found[0]
        return (None,)

    def where(self, node: ast.AST) -> str:
        return f"{self.name}:{getattr(node, 'lineno', '?')}"


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a scope, not descending into the functions and classes it defines."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _argument(call: ast.Call, index: int | None, keyword: str) -> ast.expr | None:
    """A call's argument, given at position ``index`` or as ``keyword=``."""
    if index is not None and len(call.args) > index and not isinstance(call.args[index], ast.Starred):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _parameters(function: ast.AST) -> list[str]:
    assert isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
    arguments = function.args
    return [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]


MODULES = [Module(path) for path in sorted(PACKAGE.rglob("*.py"))]


def _error_classes() -> set[str]:
    """``EinshardError`` and its subclasses (``DoesNotFitError``): a call of any makes an error message."""
    classes = {"EinshardError"}
    for module in MODULES:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and any(_name(base) in classes for base in node.bases):
                classes.add(node.name)
    return classes


ERROR_CLASSES = _error_classes()


def _factories() -> tuple[dict[str, tuple[int, str]], set[str]]:
    """Functions that make an EinshardError: those that take its headline as a parameter
    (name -> the parameter's position and name), and all of them by name."""
    builders: dict[str, tuple[int, str]] = {}
    factories: set[str] = set()
    for module in MODULES:
        for name, function in module.functions.items():
            for node in _own_nodes(function):
                if not (isinstance(node, ast.Return) and isinstance(node.value, ast.Call)):
                    continue
                if _name(node.value.func) not in ERROR_CLASSES:
                    continue
                factories.add(name)
                headline = _argument(node.value, 0, "headline")
                parameters = _parameters(function)
                if isinstance(headline, ast.Name) and headline.id in parameters:
                    builders[name] = (parameters.index(headline.id), headline.id)
    return builders, factories


BUILDERS, FACTORIES = _factories()


def _messages() -> list[Message]:
    found: list[Message] = []

    def add(kind: str, module: Module, call: ast.Call, node: ast.expr | None) -> None:
        assert node is not None, f"{module.where(call)}: a {kind} message without its text"
        for template in module.templates(node, module.scopes(call)):
            found.append(Message(kind, template, module.where(call)))

    for module in MODULES:
        for call in ast.walk(module.tree):
            if not isinstance(call, ast.Call):
                continue
            name = _name(call.func)
            if name in ERROR_CLASSES:
                headline = _argument(call, 0, "headline")
                scope = module.scopes(call)[0]
                builder = BUILDERS.get(getattr(scope, "name", ""))
                if not (isinstance(headline, ast.Name) and builder and headline.id == builder[1]):
                    add("error", module, call, headline)  # (a builder's own call has no text of its own)
                context = _argument(call, None, "context")
                if isinstance(context, ast.List | ast.Tuple):
                    for line in context.elts:
                        add("context", module, call, line)
            elif name in BUILDERS:
                index, parameter = BUILDERS[name]
                add("error", module, call, _argument(call, index, parameter))
            elif name == "add_context":
                add("context", module, call, _argument(call, 0, "line"))
            elif name == "warn":
                add("warning", module, call, _argument(call, 0, "message"))
            elif name is not None and OTHER_RAISES.get(name) is not None:
                add(str(OTHER_RAISES[name]), module, call, _argument(call, 0, "message"))
    return found


MESSAGES = _messages()
TEXT = CATALOGUE.read_text(encoding="utf-8")


def _literal(template: Template) -> str:
    return "".join(part for part in template if part is not None)


def test_the_scan_finds_the_messages():
    """Guards the scan itself: it finds every kind of message, each with text of its own."""
    kinds = {kind: [m for m in MESSAGES if m.kind == kind] for kind in PREFIXES}
    assert len(kinds["error"]) >= 60, len(kinds["error"])
    assert len(kinds["warning"]) >= 2
    assert len(kinds["context"]) >= 12  # fewer since each public function adds its context once
    assert len(kinds["argument"]) >= 3
    assert len(kinds["import"]) >= 1
    texts = {_literal(m.template) for m in MESSAGES}
    # A literal headline, one passed to a builder, and ones chosen by a local variable.
    for expected in (
        "the expression has no '->'",
        "'...' must stand alone",
        "the expression names  axes besides '...', but the array has ",
        "axes  are on the left-hand side but not on the right",
        " devices leave a factor of  for  starred elements, which is not a whole ",
        "unused rules (they decided no leaf): ",
    ):
        assert expected in texts, expected
    vague = [str(m) for m in MESSAGES if not re.search(r"\w", _literal(m.template))]
    assert not vague, "messages the scan could not read (teach it how they are built):\n" + "\n".join(vague)


def test_every_message_is_in_the_catalogue():
    missing = sorted({str(m) for m in MESSAGES if not m.pattern().search(TEXT)})
    assert not missing, (
        "docs/errors.md does not show these messages; add an entry with an example that raises "
        "each (or a ```text block when it needs several processes):\n" + "\n".join(missing)
    )


def test_every_message_the_catalogue_shows_is_raised_somewhere():
    # Context lines are checked one way only: any indented line of an example would look like one.
    kinds = [kind for kind in PREFIXES if kind != "context"]
    shown = re.compile("^(?:" + "|".join(PREFIXES[kind] for kind in kinds) + ").*$", re.MULTILINE)
    templates = [m.pattern() for m in MESSAGES if m.kind in kinds]
    stale = [
        match.group()
        for match in shown.finditer(TEXT)
        if not any(t.fullmatch(match.group()) for t in templates)
    ]
    assert not stale, "docs/errors.md shows messages einshard does not raise:\n" + "\n".join(stale)


def test_einshard_raises_only_catalogued_exceptions():
    """A ``raise`` of anything but an EinshardError would escape the catalogue."""
    allowed = {*ERROR_CLASSES, "add_context", *FACTORIES, *OTHER_RAISES}
    uncatalogued = []
    for module in MODULES:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Raise) or node.exc is None or isinstance(node.exc, ast.Name):
                continue  # a bare raise, or one re-raising a caught error
            name = _name(node.exc.func) if isinstance(node.exc, ast.Call) else None
            if name not in allowed:
                uncatalogued.append(f"{module.where(node)}: raise {ast.unparse(node.exc)[:80]}")
    assert not uncatalogued, (
        "user errors are EinshardError (catalogued in docs/errors.md); these raise something else:\n"
        + "\n".join(uncatalogued)
    )


def test_einshard_warns_only_with_einshard_warning():
    others = []
    for module in MODULES:
        for call in ast.walk(module.tree):
            if isinstance(call, ast.Call) and _name(call.func) == "warn":
                category = _argument(call, 1, "category")
                if category is None or _name(category) not in (
                    "EinshardWarning",
                    "EinshardDeprecationWarning",
                ):
                    others.append(module.where(call))
    assert not others, "warnings that are not EinshardWarning: " + ", ".join(others)


def test_every_entry_has_a_stable_anchor():
    headings = re.findall(r"^#{2,4} .*$", TEXT, re.MULTILINE)
    assert len(headings) >= 60
    without = [h for h in headings if not re.search(r"\{ #[a-z0-9-]+ \}$", h)]
    assert not without, "catalogue entries without an explicit { #anchor }:\n" + "\n".join(without)
    anchors = re.findall(r"\{ #([a-z0-9-]+) \}$", TEXT, re.MULTILINE)
    repeated = sorted({a for a in anchors if anchors.count(a) > 1})
    assert not repeated, f"anchors used twice: {repeated}"
