"""How the born-sharded builders are called: the factory, the rule table, then the factory's arguments.

``create_sharded`` (Flax and Equinox) and Flax's ``init_sharded`` and
``create_train_state`` take their rule table positionally, right after what
they build from, and pass every other argument to it. This module refuses the
calls that put the table anywhere else (``rules=`` after the factory's
arguments, or the factory's first argument where the table goes) with an
error that shows the call to write.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._arrays._leaves import is_array
from .._language._errors import EinshardError
from .._trees._rules import Rules, RulesLike

__all__ = ["rule_table"]

_SHOWN = (bool, int, float, complex, str, bytes, type(None))  # arguments shown by value in a hint


def rule_table(
    verb: str,
    target: Any,
    rules: RulesLike | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    before: tuple[str, ...] = (),
    none: str | None = None,
) -> Rules | None:
    """The rule table of a ``verb(target, *before, rules, *args, **kwargs)`` call, checked.

    Args:
        verb: The function's name, for the messages (``create_sharded``).
        target: What it builds from: the factory, or the module to initialize.
        rules: The argument in the table's place.
        args: The positional arguments after it (for the factory).
        kwargs: The keyword arguments (for the factory). ``rules`` among them
            is the table given by keyword, unless ``target`` itself names a
            parameter ``rules``.
        before: How the hint writes the arguments between ``target`` and the
            table (``('tx',)`` for ``create_train_state``).
        none: What ``None`` in the table's place means, if it is allowed
            (Equinox: the table the ``@sharded`` layers compose into).

    Returns:
        The table as a :class:`~einshard.Rules`, or ``None`` where ``none`` allows it.

    Raises:
        EinshardError: The table given by keyword, or an argument in its place
            that is no table; the hint shows the call with the table second.
    """
    if "rules" in kwargs and not _names_rules(target):
        given = args if rules is None else (rules, *args)
        rest = {name: value for name, value in kwargs.items() if name != "rules"}
        raise EinshardError(
            f"{verb} takes the rule table right after {_what(verb, before)}, "
            "not as rules= after its arguments",
            hint=f"Call {_call(verb, target, before, given, rest)}.",
        )
    if rules is None and none is not None:
        return None
    if isinstance(rules, Rules):
        return rules
    if not _no_table(rules):
        try:
            return Rules(rules)  # pyright: ignore[reportArgumentType]
        except EinshardError as error:
            if isinstance(rules, (list, tuple, Mapping)):  # a table with a mistake: its message says which
                raise error.add_context(f"in the rule table of {verb}") from None
    hint = f"Put the table first, then the arguments for {_name(target)}: "
    hint += _call(verb, target, before, (rules, *args), kwargs)
    if none is not None:
        hint += f"; or, for {none}, {_call(verb, target, before, (rules, *args), kwargs, table='None')}"
    raise EinshardError(
        f"the argument after {_what(verb, before)} is the rule table, not {_describe(rules)}",
        hint=hint + ".",
    )


def _no_table(value: Any) -> bool:
    """Values that cannot be a rule table: numbers, strings, arrays (PRNG keys), non-iterables."""
    return value is None or isinstance(value, _SHOWN) or is_array(value) or not isinstance(value, Iterable)


def _what(verb: str, before: tuple[str, ...]) -> str:
    """What comes before the table: ``the factory``, ``the module``, ``the module and tx``."""
    return " and ".join(["the factory" if verb == "create_sharded" else "the module", *before])


def _names_rules(target: Any) -> bool:
    """Whether ``target`` has a parameter of its own called ``rules`` (then ``rules=`` is for it).

    A class is read by its ``__init__`` too: NNX's metaclass shows a class's signature as
    ``(*args, **kwargs)``.
    """
    readable = [target, target.__init__] if isinstance(target, type) else [target]
    for function in readable:
        try:
            parameter = inspect.signature(function).parameters.get("rules")
        except (TypeError, ValueError):  # no signature to read (a builtin, a C extension)
            continue
        if parameter is not None and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return True
    return False


def _name(target: Any) -> str:
    if isinstance(target, (type, Callable)) and hasattr(target, "__qualname__"):
        return target.__qualname__
    return type(target).__name__ + "(...)"  # a module instance (linen), shown by its class


def _describe(value: Any) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:  # an array, a PRNG key among them
        return f"a {dtype} array of shape {shape}"
    kind = type(value).__name__
    shown = f" {value!r}" if isinstance(value, _SHOWN) and len(repr(value)) <= 40 else ""
    return f"{'an' if kind[:1] in 'aeiouAEIOU' else 'a'} {kind}{shown}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if isinstance(value, _SHOWN) and len(text) <= 40 else "…"


def _call(
    verb: str,
    target: Any,
    before: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    table: str = "rules",
) -> str:
    """The call with the table in its place, arguments shown by value where short (else ``…``)."""
    keywords = [f"{name}={_shown(value)}" for name, value in kwargs.items()]
    return f"{verb}({', '.join([_name(target), *before, table, *map(_shown, args), *keywords])})"
