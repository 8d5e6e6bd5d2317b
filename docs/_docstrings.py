"""A Griffe extension that renders einshard's docstrings as Markdown for the API reference.

The docstrings are Google style, written to read well in ``help()`` and to run
as doctests: Sphinx roles (``:func:`shard_pytree```) and bare ``>>>`` examples.
Markdown would turn the roles into noise and the examples into nested block
quotes, so before mkdocstrings renders a docstring this extension

* turns ``:func:`~einshard.Layout``` (any role) into a link to the API entry
  when the target is a public einshard name, and into inline code otherwise;
* fences every run of ``>>>`` lines, with its expected output, as Python code;
* reads a paragraph's closing ``::`` (reST's "literal block follows") as ``:``.

mkdocs.yml loads it with ``extensions: [docs/_docstrings.py]``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")
_PROMPT = re.compile(r"^(\s*)>>> ")


def _role(match: re.Match[str], public: set[str]) -> str:
    short, target = match.group(1), match.group(2)
    shown = target.rsplit(".", 1)[-1] if short else target
    if target in public:
        return f"[`{shown}`][{target}]"
    return f"`{shown}`"


def _fence_doctests(text: str) -> str:
    """Wraps each ``>>>`` example and its output (up to a blank line) in a Python fence."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        prompt = _PROMPT.match(lines[i])
        if prompt is None:
            out.append(lines[i].replace("::", ":") if lines[i].rstrip().endswith("::") else lines[i])
            i += 1
            continue
        indent = prompt.group(1)
        if out and out[-1].strip():
            out.append("")  # a fence must not continue a paragraph
        out.append(f"{indent}```python")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class RenderDocstrings(griffe.Extension):
    """Rewrites the docstrings of the einshard package once Griffe has loaded it."""

    def __init__(self) -> None:
        super().__init__()
        # The names the API reference renders, so that links to them resolve (mkdocs strict mode
        # fails on a link to anything else).
        self.public: set[str] = set()

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "einshard":
            return
        public = {f"einshard.{name}" for name in pkg.members if not name.startswith("_")}
        integrations = pkg.members["integrations"]
        for module in integrations.members.values():
            if module.name.startswith("_"):
                continue
            public.add(module.path)
            public.update(f"{module.path}.{name}" for name in module.exports or ())
        self.public = public
        self._rewrite(pkg, seen=set())

    def _rewrite(self, obj: griffe.Object | griffe.Alias, seen: set[str]) -> None:
        if obj.is_alias or obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            text = _ROLE.sub(lambda m: _role(m, self.public), obj.docstring.value)
            obj.docstring.value = _fence_doctests(text)
        for member in obj.members.values():
            self._rewrite(member, seen)
