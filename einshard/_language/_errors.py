"""The one exception einshard raises for user mistakes, and how it is drawn."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

__all__ = ["EinshardError", "EinshardWarning", "adding_context", "short_repr"]


class EinshardError(ValueError):
    """A mistake in an einshard expression, rule or call.

    The message has up to four parts, in this order:

    * a headline saying what is wrong;
    * the expression, with a caret under the part at fault;
    * a hint saying how to fix it (ideally a corrected expression);
    * context lines, added on its way out: by the public function that was
      called (the shape and devices of the array, the process, the object),
      and for trees by the leaf and rule being applied.

    It is a :class:`ValueError`, so ``except ValueError`` keeps working for
    code written against einshard 0.2.0.

    Attributes:
        headline: What is wrong, in one sentence.
        expression: The expression at fault, or ``None``.
        span: ``(start, end)`` character offsets of the fault in
            ``expression``, or ``None``.
        hint: How to fix it, or ``None``.
        context: Lines of context, outermost last.
    """

    def __init__(
        self,
        headline: str,
        *,
        expression: str | None = None,
        span: tuple[int, int] | None = None,
        hint: str | None = None,
        context: tuple[str, ...] | list[str] = (),
    ) -> None:
        super().__init__(headline)
        self.headline = headline
        self.expression = expression
        self.span = span
        self.hint = hint
        self.context = list(context)

    def add_context(self, line: str) -> EinshardError:
        """Appends a context line and returns the error, for ``raise e.add_context(...)``."""
        self.context.append(line)
        return self

    def __str__(self) -> str:
        lines = [self.headline]
        if self.expression is not None:
            shown, caret = _underline(self.expression, self.span)
            lines.append("    " + shown)
            if caret:
                lines.append("    " + caret)
        if self.hint:
            lines.append(self.hint)
        lines.extend("  " + line for line in self.context)
        return "\n".join(lines)

    def __reduce__(self):  # keeps the parts when pickled (multiprocessing, pytest-xdist)
        kwargs = dict(expression=self.expression, span=self.span, hint=self.hint, context=tuple(self.context))
        return (_rebuild, (self.headline, kwargs))


def _rebuild(headline: str, kwargs: dict) -> EinshardError:
    return EinshardError(headline, **kwargs)


class EinshardWarning(UserWarning):
    """A problem that is not an error: rules that matched nothing (strict mode), a doubtful regex."""


class EinshardDeprecationWarning(EinshardWarning, DeprecationWarning):
    """A name or a call that still works but is going away; the message says what to call instead.

    Both an :class:`EinshardWarning` and a ``DeprecationWarning``, so either filter catches it.
    """


class adding_context:  # named as it reads: `with adding_context(...):`
    """Adds a public function's context lines to an :class:`EinshardError` leaving a block.

    ``with adding_context(add, *args):`` around the work of a public function
    (after it has checked its own arguments, whose errors need no context):
    an error leaving the block gets ``add(error, *args)`` called on it, which
    appends the lines that say what the call was doing
    (``error.add_context(...)``). The one place each public function adds
    context, as einops adds its own at its public call; the line is built only
    when there is an error.
    """

    __slots__ = ("add", "args")

    def __init__(self, add: Callable[..., object], *args: Any) -> None:
        self.add = add
        self.args = args

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        # Returns None, never true: the error goes on (type checkers read `-> None` so too).
        if isinstance(error, EinshardError):
            self.add(error, *self.args)


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters (and safe for ints of any size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except ValueError:  # e.g. an int beyond the string conversion limit inside a container
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


# The public home is the package, so tracebacks read `einshard.EinshardError`.
EinshardError.__module__ = "einshard"
EinshardWarning.__module__ = "einshard"
EinshardDeprecationWarning.__module__ = "einshard"


def _shown(char: str) -> str:
    """How one character of an expression is printed: escaped if it would not show."""
    if char == "'":
        return "\\'"
    if char == "\\":
        return "\\\\"
    if not char.isprintable() or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return repr(char)[1:-1] if char.isascii() else f"\\u{ord(char):04x}"
    return char


def _width(text: str) -> int:
    """Terminal columns taken by ``text`` (wide East Asian characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def _underline(expression: str, span: tuple[int, int] | None) -> tuple[str, str]:
    """Returns the quoted expression and a caret line under ``span`` (character offsets)."""
    pieces = [_shown(c) for c in expression]
    shown = "'" + "".join(pieces) + "'"
    if span is None:
        return shown, ""
    start, end = span
    start = max(0, min(start, len(expression)))
    end = max(start, min(end, len(expression)))
    before = 1 + _width("".join(pieces[:start]))  # 1 for the opening quote
    under = _width("".join(pieces[start:end]))
    # A fault at the very end (a missing part) gets one caret just past the text.
    return shown, " " * before + "^" * max(under, 1)
