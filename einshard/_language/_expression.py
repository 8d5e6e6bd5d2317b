"""Parsing einshard expressions: pure Python, no JAX.

An expression is ``LEFT -> RIGHT``. LEFT names the array's axes (or ``...``);
RIGHT lists elements ``[name][count][*]`` or ``...``. Every element records the
character span it came from, so later layers can put a caret under it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Sequence

from ._errors import EinshardError
from ._numbers import MAX_DEVICES

__all__ = [
    "LETTERS",
    "REPLICATE",
    "Expression",
    "LeftElement",
    "RightElement",
    "axis_names",
    "check_expression_type",
    "parse",
    "split_expression",
]

REPLICATE = "... -> * ..."
"""The expression that replicates an array of any rank on every device."""

LETTERS = "abcdefghijklmnopqrstuvwxyz"
"""The alphabet of the axis names einshard writes itself (``a b -> a b8``)."""


def axis_names(rank: int) -> list[str]:
    """Names for ``rank`` axes, the ones einshard writes: ``a``, ``b``, ..., ``z``, ``aa``, ``bb``, ...

    >>> axis_names(3), axis_names(28)[-2:]
    (['a', 'b', 'c'], ['aa', 'bb'])
    """
    return [LETTERS[i % 26] * (1 + i // 26) for i in range(rank)]


def split_expression(counts: Sequence[int], n_devices: int) -> str:
    """The expression that splits each axis into ``counts`` parts; the devices left over hold copies.

    >>> split_expression([1, 8], 8), split_expression([2, 1], 8)
    ('a b -> a b8', 'a b -> a2 b 4')
    """
    names = axis_names(len(counts))
    right = [f"{name}{count}" if count > 1 else name for name, count in zip(names, counts, strict=True)]
    copies = n_devices // max(1, math.prod(counts))
    if copies > 1:
        right.append(str(copies))
    return f"{' '.join(names)} -> {' '.join(right)}"


_ARROW = "->"
_ELLIPSIS = "..."
_ARROW_LOOKALIKES = ("→", "⟶", "=>", "—>", "–>", "- >", "<-")
_DIGITS = "0123456789"  # counts are ASCII digits; other Unicode digits are errors


@dataclasses.dataclass(frozen=True)
class LeftElement:
    """An axis of the array as named on the left-hand side, or ``...``.

    Attributes:
        name: The axis name, or ``None`` for ``...``.
        span: ``(start, end)`` offsets in the expression.
    """

    name: str | None
    span: tuple[int, int]

    @property
    def is_ellipsis(self) -> bool:
        return self.name is None

    def __str__(self) -> str:
        return _ELLIPSIS if self.name is None else self.name


@dataclasses.dataclass(frozen=True)
class RightElement:
    """One element of the right-hand side: a mesh axis, or ``...``.

    Attributes:
        name: The array axis this element shards, or ``None`` for a standalone
            count (replication) or ``...``.
        count: The written count, or ``None`` when none was written (it then
            counts as 1).
        star: Whether the element is proportional (``*``).
        span: ``(start, end)`` offsets in the expression.
        is_ellipsis: Whether this is ``...``.
    """

    name: str | None
    count: int | None
    star: bool
    span: tuple[int, int]
    is_ellipsis: bool = False

    @property
    def number(self) -> int:
        """The written count, 1 when none was written."""
        return 1 if self.count is None else self.count

    def __str__(self) -> str:
        if self.is_ellipsis:
            return _ELLIPSIS
        count = "" if self.count is None else str(self.count)
        return f"{self.name or ''}{count}{'*' if self.star else ''}"


@dataclasses.dataclass(frozen=True)
class Expression:
    """A parsed einshard expression.

    ``str(expression)`` gives the canonical spelling (single spaces), which
    parses back to an equal expression.

    Attributes:
        text: The expression as written.
        left: The left-hand side, in order.
        right: The right-hand side, in order.
    """

    text: str
    left: tuple[LeftElement, ...]
    right: tuple[RightElement, ...]

    @property
    def has_ellipsis(self) -> bool:
        return any(e.is_ellipsis for e in self.left)

    @property
    def left_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.left if e.name is not None)

    @property
    def left_span(self) -> tuple[int, int]:
        return _cover(self.text, [e.span for e in self.left], before_arrow=True)

    @property
    def right_span(self) -> tuple[int, int]:
        return _cover(self.text, [e.span for e in self.right], before_arrow=False)

    def __str__(self) -> str:
        left = " ".join(map(str, self.left))
        right = " ".join(map(str, self.right))
        return f"{left} -> {right}".strip()

    def with_right(self, right: list[str]) -> str:
        """The canonical spelling with the right-hand side replaced (for hints)."""
        left = " ".join(map(str, self.left))
        return f"{left} -> {' '.join(right)}".strip()


def _cover(text: str, spans: list[tuple[int, int]], *, before_arrow: bool) -> tuple[int, int]:
    if spans:
        return spans[0][0], spans[-1][1]
    arrow = text.find(_ARROW)
    at = arrow if before_arrow else arrow + len(_ARROW)
    return at, at


def _merged(first: RightElement, second: RightElement) -> str:
    """One element splitting an axis as two elements of it would together."""
    count = (first.count or 1) * (second.count or 1)
    return f"{first.name}{count if count > 1 else ''}{'*' if first.star or second.star else ''}"


# A count is at most a device count: 2**24, 8 digits (and far from int()'s 4300-digit limit).
_MAX_COUNT_DIGITS = len(str(MAX_DEVICES))


def _shown_digits(digits: str) -> str:
    return digits if len(digits) <= 30 else f"{digits[:12]}…{digits[-6:]} ({len(digits)} digits)"


def _error(text: str, headline: str, span: tuple[int, int], hint: str | None = None) -> EinshardError:
    return EinshardError(headline, expression=text, span=span, hint=hint)


_SYNTAX_HINT = (
    "An expression is 'LEFT -> RIGHT': LEFT names the array's axes (letters or '_'), "
    "RIGHT lists them with optional shard counts and stars, e.g. 'x y -> x y*'."
)


def parse(text: str) -> Expression:
    """Parses an einshard expression.

    Checks everything that does not depend on the array or the devices: the
    syntax, ``...`` on both sides or neither, duplicate names, and that both
    sides name the same axes.

    Args:
        text: The expression, e.g. ``'x y -> x y*'``.

    Returns:
        The parsed :class:`Expression`.

    Raises:
        EinshardError: If the expression is malformed, with a caret under the fault.

    >>> str(parse('a   b->2 a2*  b*'))
    'a b -> 2 a2* b*'
    >>> parse('x y -> x y*').right[1]
    RightElement(name='y', count=None, star=True, span=(9, 11), is_ellipsis=False)
    """
    check_expression_type(text)
    return _parse(text)


def check_expression_type(text: object) -> None:
    """Refuses an expression that is not a string, before any cache sees it."""
    if not isinstance(text, str):
        raise EinshardError(
            f"an einshard expression must be a string, not {type(text).__name__}",
            hint="Write it like 'x y -> x y*'.",
        )


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> Expression:
    arrow = _find_arrow(text)
    left = tuple(_parse_left(text, start, end) for start, end in _words(text, 0, arrow))
    right = tuple(
        _parse_right(text, start, end) for start, end in _words(text, arrow + len(_ARROW), len(text))
    )
    expression = Expression(text, left, right)
    _check_ellipses(expression)
    _check_names(expression)
    return expression


def _find_arrow(text: str) -> int:
    arrow = text.find(_ARROW)
    if arrow < 0:
        for lookalike in _ARROW_LOOKALIKES:
            at = text.find(lookalike)
            if at >= 0:
                fixed = text[:at] + _ARROW + text[at + len(lookalike) :]
                raise _error(
                    text,
                    f"expected '->', found {lookalike!r}",
                    (at, at + len(lookalike)),
                    f"Write the arrow as two characters, '-' and '>': {fixed!r}",
                )
        raise _error(text, "the expression has no '->'", (len(text), len(text)), _SYNTAX_HINT)
    second = text.find(_ARROW, arrow + len(_ARROW))
    if second >= 0:
        raise _error(
            text,
            "the expression has more than one '->'",
            (second, second + len(_ARROW)),
            _SYNTAX_HINT,
        )
    return arrow


def _words(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Spans of the whitespace-separated words of ``text[start:end]``."""
    spans = []
    i = start
    while i < end:
        if text[i].isspace():
            i += 1
            continue
        j = i
        while j < end and not text[j].isspace():
            j += 1
        spans.append((i, j))
        i = j
    return spans


def _is_name_char(char: str) -> bool:
    return char.isalpha() or char == "_"


def _check_ellipsis_word(text: str, start: int, end: int) -> None:
    word = text[start:end]
    if "." in word and word != _ELLIPSIS:
        dots = word.index(".")
        run = len(word[dots:]) - len(word[dots:].lstrip("."))
        if run != 3:
            raise _error(
                text,
                f"'{word[dots : dots + run]}' is not '...'",
                (start + dots, start + dots + run),
                "Write exactly three dots, '...', for the axes you leave unnamed and unsharded.",
            )
        raise _error(
            text,
            "'...' must stand alone",
            (start, end),
            "Separate '...' from its neighbours with spaces, e.g. 'x ... -> x* ...'.",
        )


def _parse_left(text: str, start: int, end: int) -> LeftElement:
    word = text[start:end]
    if word == _ELLIPSIS:
        return LeftElement(None, (start, end))
    _check_ellipsis_word(text, start, end)
    for i, char in enumerate(word):
        if _is_name_char(char):
            continue
        at = start + i
        if char in _DIGITS:
            run = len(word[i:]) - len(word[i:].lstrip(_DIGITS))
            raise _error(
                text,
                "axis names cannot contain digits",
                (at, at + run),
                "Digits are shard counts, and counts go on the right-hand side "
                f"('{word[:i]}{word[i : i + run]}*' there means axis '{word[:i]}', count "
                f"{word[i : i + run]}, star). Rename the axis with letters only.",
            )
        if char == "*":
            raise _error(
                text,
                "'*' on the left-hand side",
                (at, at + 1),
                "The left-hand side only names the array's axes; stars and counts go on the "
                "right, e.g. 'x y -> x y*'.",
            )
        raise _error(
            text,
            f"unexpected character {char!r} in an axis name",
            (at, at + 1),
            "Axis names are letters or '_'; separate axes with spaces.",
        )
    return LeftElement(word, (start, end))


def _parse_right(text: str, start: int, end: int) -> RightElement:
    word = text[start:end]
    if word == _ELLIPSIS:
        return RightElement(None, None, False, (start, end), is_ellipsis=True)
    _check_ellipsis_word(text, start, end)
    # [name][count][*]: scan each part in turn.
    i = 0
    while i < len(word) and _is_name_char(word[i]):
        i += 1
    name = word[:i] or None
    digits_start = i
    while i < len(word) and word[i] in _DIGITS:
        i += 1
    digits = word[digits_start:i]
    star = i < len(word) and word[i] == "*"
    if star:
        i += 1
    if i == len(word):
        if digits.startswith("0"):
            fixed = digits.lstrip("0")
            if fixed:
                fix = f"write '{word[:digits_start]}{fixed}{'*' if star else ''}'"
            elif star:
                fix = f"write '{word[:digits_start]}*' (a count of 1, grown with the device count)"
            elif name is not None:
                fix = f"to leave axis '{name}' whole, write '{name}' with no count"
            else:
                fix = "leave out a replication count of 0"
            raise _error(
                text,
                f"count {digits!r} is not a positive integer without leading zeros",
                (start + digits_start, start + digits_start + len(digits)),
                f"Counts are whole numbers from 1: {fix}.",
            )
        if len(digits) > _MAX_COUNT_DIGITS or (digits and int(digits) > MAX_DEVICES):
            raise _error(
                text,
                f"count {_shown_digits(digits)} is larger than any device count (2**24)",
                (start + digits_start, start + digits_start + len(digits)),
                "Counts are numbers of shards or replicas; use '*' to let einshard derive a count "
                "from the device count.",
            )
        return RightElement(name, int(digits) if digits else None, star, (start, end))
    # Explain the first character the grammar could not take.
    at = start + i
    char = word[i]
    rest = word[i:]
    if char == "*":
        raise _error(text, "an element has two stars", (at, at + 1), "Write one '*' per element, e.g. 'x2*'.")
    if char in _DIGITS and star:
        run = len(rest) - len(rest.lstrip(_DIGITS))
        raise _error(
            text,
            "the count must come before '*'",
            (at - 1, at + run),
            f"Write the name, then the count, then the star: '{word[: i - 1]}{rest[:run]}*'.",
        )
    if _is_name_char(char):
        raise _error(
            text,
            "elements must be separated by whitespace",
            (at, at + 1),
            f"An element is [name][count][*], with the name first; put a space before {rest!r}: "
            f"'{word[:i]} {rest}'.",
        )
    if char.isdecimal():  # a digit of another script: 0.2.0 read it as a count, silently
        raise _error(
            text,
            f"count digit {char!r} is not an ASCII digit",
            (at, at + 1),
            f"Counts are written with the digits 0-9: for {char!r}, write '{int(char)}'.",
        )
    raise _error(
        text,
        f"unexpected character {char!r} on the right-hand side",
        (at, at + 1),
        "Each element is [name][count][*] or '...', e.g. 'x', 'x4', 'x*', 'x2*', '2', '*'.",
    )


def _check_ellipses(expression: Expression) -> None:
    text = expression.text
    for side, elements in (("left", expression.left), ("right", expression.right)):
        ellipses = [e for e in elements if e.is_ellipsis]
        if len(ellipses) > 1:
            raise _error(
                text,
                f"'...' appears more than once on the {side}-hand side",
                ellipses[1].span,
                "Use '...' at most once per side; name the other axes.",
            )
    left = [e for e in expression.left if e.is_ellipsis]
    right = [e for e in expression.right if e.is_ellipsis]
    if left and not right:
        raise _error(
            text,
            "'...' is on the left-hand side but not on the right",
            left[0].span,
            "Put '...' on both sides or on neither: "
            f"{expression.with_right([*map(str, expression.right), '...'])!r}",
        )
    if right and not left:
        raise _error(
            text,
            "'...' is on the right-hand side but not on the left",
            right[0].span,
            "Put '...' on both sides or on neither; on the left it stands for the axes you do not name.",
        )


def _check_names(expression: Expression) -> None:
    text = expression.text
    seen: dict[str, LeftElement] = {}
    for element in expression.left:
        if element.name is None:
            continue
        if element.name in seen:
            raise _error(
                text,
                f"axis {element.name!r} is named twice on the left-hand side",
                element.span,
                "Give every axis of the array its own name.",
            )
        seen[element.name] = element
    placed: dict[str, RightElement] = {}
    for element in expression.right:
        if element.name is None:
            continue
        if element.name in placed:
            raise _error(
                text,
                f"axis {element.name!r} appears twice on the right-hand side",
                element.span,
                "An axis is split over one element; to split it further, multiply the counts "
                f"(e.g. {_merged(placed[element.name], element)!r} rather than "
                f"'{placed[element.name]} {element}').",
            )
        placed[element.name] = element
        if element.name not in seen:
            names = ", ".join(expression.left_names) or "(none)"
            hint = f"The left-hand side names the array's axes: {names}."
            close = difflib.get_close_matches(element.name, list(seen), n=1)
            if close:
                fixed = [
                    str(dataclasses.replace(e, name=close[0])) if e is element else str(e)
                    for e in expression.right
                ]
                hint += f" Did you mean {close[0]!r}? {expression.with_right(fixed)!r}"
            raise _error(
                text,
                f"axis {element.name!r} is on the right-hand side but not on the left",
                element.span,
                hint,
            )
    missing = [name for name in seen if name not in placed]
    if missing:
        right = [*map(str, expression.right), *missing]
        headline = (
            f"axis {missing[0]!r} is on the left-hand side but not on the right"
            if len(missing) == 1
            else f"axes {', '.join(map(repr, missing))} are on the left-hand side but not on the right"
        )
        raise _error(
            text,
            headline,
            seen[missing[0]].span,
            "Every axis must appear on the right; write it alone to leave it unsharded: "
            f"{expression.with_right(right)!r}",
        )
