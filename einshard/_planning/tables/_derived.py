"""The derived tensor-parallel rule table: an expression and an anchored, digit-blind pattern per role."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..._language._expression import LETTERS
from ._roles import LeafRole

# --- the rule table --------------------------------------------------------------------------------

_LETTERS = {
    "layer": "lmn",
    "vocab": "vw",
    "heads": "hg",
    "in": "ijk",
    "out": "opqr",
    "window": "stu",
    "batch": "ef",
    "index": "nk",
    "elem": "xyz",
    "-": "abcd",
}


def axis_names(words: Sequence[str]) -> list[str]:
    """One short distinct name per axis, by its role: ``i`` in, ``o`` out, ``h`` heads ..."""
    used: set[str] = set()
    names = []
    spare = iter(LETTERS)
    for word in words:
        name = next((c for c in _LETTERS.get(word, "xyz") if c not in used), None)
        while name is None or name in used:
            name = next(spare)
        used.add(name)
        names.append(name)
    return names


def tp_expression(row: LeafRole, model: int, data: int, fsdp_axis: int | None) -> str:
    """The expression that splits ``row.axis`` over the model axis (and ``fsdp_axis`` over data).

    Mesh axes follow the right-hand side's order: the data axis, then the model axis, then the
    copies where the split axis does not divide by the whole model axis.
    """
    names = axis_names(row.axes)
    assert row.axis is not None
    left = " ".join(names)
    whole = row.parts == model
    split = f"{names[row.axis]}{'*' if whole and data == 1 else row.parts}"
    copies = [str(model // row.parts)] if row.parts < model else []
    if data == 1:
        right = [split if i == row.axis else name for i, name in enumerate(names)] + copies
        return f"{left} -> {' '.join(right)}"
    rest = [name for i, name in enumerate(names) if i not in (row.axis, fsdp_axis)]
    first = f"{names[fsdp_axis]}*" if fsdp_axis is not None else str(data)
    return f"{left} -> {' '.join([*rest, first, split, *copies])}"


class _Pattern(str):
    r"""A path part given as a regex (``layer_\d+``), not as text to match literally."""


_DIGIT_RUN = re.compile(r"\d+")


def _numbered(part: str) -> bool:
    """A part that numbers its layer inside a name: ``layer_3``, ``h3`` (not ``3``)."""
    return not part.isdigit() and _DIGIT_RUN.search(part) is not None


def rule_patterns(
    paths: Sequence[str], choices: Sequence[tuple[Any, str]], strip: int = 0
) -> list[tuple[str, Any, str]]:
    r"""Compact ``(regex, expression, note)`` rules that give each path its choice.

    Each path becomes ``(^|/)`` + its parts + ``$`` (so it matches with or without the step's
    parameter name in front, and inside optimizer state that mirrors the parameters), with the
    first ``strip`` parts left out; layer numbers become ``\d+`` (``layers/\d+``) where the
    layers agree (for ``layer_\d+``, where all of them agree, notes included); paths differing
    in one part are combined (``(q|k|v)``). Checked: every path resolves to its own expression.
    """
    if not paths:
        return []
    relative = [tuple(path.split("/")[strip:]) for path in paths]
    # Layers numbered inside a name (layer_0, layer_1): one rule when every layer agrees.
    by_name: dict[tuple, list[int]] = {}
    for i, parts in enumerate(relative):
        if any(_numbered(p) for p in parts):
            key = tuple(
                None
                if p.isdigit()
                else _Pattern(_DIGIT_RUN.sub(r"\\d+", re.escape(p)))
                if _numbered(p)
                else p
                for p in parts
            )
            by_name.setdefault(key, []).append(i)
    entries: list[tuple[tuple, Any, str]] = []
    taken: set[int] = set()
    for key, indices in by_name.items():
        if len(indices) < 2:
            continue
        notes = {_unnumbered(choices[i][1], relative[i]) for i in indices}
        expressions = {repr(choices[i][0]) for i in indices}
        if len(notes) == 1 and len(expressions) == 1:
            entries.append(
                (tuple(None if p is None else {p} for p in key), choices[indices[0]][0], notes.pop())
            )
            taken.update(indices)
    groups: dict[tuple, list[int]] = {}
    for i, parts in enumerate(relative):
        if i not in taken:
            groups.setdefault(tuple(None if p.isdigit() else p for p in parts), []).append(i)
    exact: list[tuple[tuple, Any, str]] = []
    for key, indices in groups.items():
        counts: dict[tuple, int] = {}
        for i in indices:
            counts[_choice_key(choices[i])] = counts.get(_choice_key(choices[i]), 0) + 1
        majority = max(counts, key=lambda k: counts[k])
        pick = next(i for i in indices if _choice_key(choices[i]) == majority)
        entries.append((tuple(({p} if p is not None else None) for p in key), *choices[pick]))
        for i in indices:
            if _choice_key(choices[i]) != majority:
                exact.append((tuple({p} for p in relative[i]), *choices[i]))
    entries = _combine(entries)
    # Exceptions first (longest first: a path ending another's is more specific); the general
    # rules match disjoint sets of paths, so their order is free: by path, a layer's together.
    exact = sorted(exact, key=lambda e: -len(e[0]))
    rules = [(_regex(parts), expression, note) for parts, expression, note in exact]
    general = [(_regex(parts), expression, note) for parts, expression, note in entries]
    rules += sorted(general, key=lambda rule: rule[0].replace("(^|/)", "").replace("(", "").lower())
    # Check: each path's first matching rule gives it its expression; else exact paths.
    compiled = [re.compile(rule[0]) for rule in rules]
    for path, (expression, _) in zip(paths, choices, strict=True):
        first = next((rule for rule, c in zip(rules, compiled, strict=True) if c.search(path)), None)
        if first is None or repr(first[1]) != repr(expression):
            return [
                (_regex(tuple({p} for p in parts)), expression, note)
                for parts, (expression, note) in sorted(
                    zip(relative, choices, strict=True), key=lambda e: -len(e[0])
                )
            ]
    return rules


def _unnumbered(note: str, parts: tuple[str, ...]) -> str:
    """A note with the layer names of its own path numbered ``*`` (``layer_*``), to compare layers."""
    for part in parts:
        if _numbered(part):
            note = re.sub(rf"(?<![\w]){re.escape(part)}(?![\w])", _DIGIT_RUN.sub("*", part), note)
    return note


def _choice_key(choice: tuple[Any, str]) -> tuple:
    return (repr(choice[0]), choice[1])


def _combine(entries: list[tuple[tuple, Any, str]]) -> list[tuple[tuple, Any, str]]:
    """Entries with the same choice whose patterns differ in one part become one: ``(a|b)``.

    Only patterns equal in every other part are combined, so the combined pattern matches
    exactly the paths the two matched.
    """
    changed = True
    while changed:
        changed = False
        for position in range(max((len(e[0]) for e in entries), default=0)):
            buckets: dict[tuple, int] = {}
            out: list[tuple[tuple, Any, str]] = []
            for parts, expression, note in entries:
                if position >= len(parts) or parts[position] is None:
                    out.append((parts, expression, note))
                    continue
                rest = tuple(
                    None if p is None else frozenset(p) for i, p in enumerate(parts) if i != position
                )
                key = (len(parts), rest, repr(expression), note)
                index = buckets.get(key)
                if index is None:
                    buckets[key] = len(out)
                    out.append((parts, expression, note))
                else:
                    old = out[index][0]
                    merged = (*old[:position], old[position] | parts[position], *old[position + 1 :])
                    out[index] = (merged, expression, note)
                    changed = True
            entries = out
    return entries


def _regex(parts: tuple) -> str:
    pieces = []
    for part in parts:
        if part is None:
            pieces.append(r"\d+")
            continue
        texts = sorted(p if isinstance(p, _Pattern) else re.escape(p) for p in part)
        pieces.append(texts[0] if len(texts) == 1 else "(" + "|".join(texts) + ")")
    return "(^|/)" + "/".join(pieces) + "$"
