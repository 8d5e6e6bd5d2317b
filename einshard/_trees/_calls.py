"""How the builders are called: what they build from, the rule table, then the rest.

Every verb that takes a rule table takes it second, right after what it works
on: ``create_sharded(factory, rules, …)`` (Flax and Equinox),
``init_sharded(module, rules, …)`` (linen, and :func:`einshard.init_sharded`
with a function), ``create_train_state(module, rules, tx, …)``,
``shard_module(model, rules)``. This module is the one place that checks it:
it refuses every other place for the table (given by keyword after the
factory's arguments, swapped with the factory or the module, left among the
factory's arguments, before ``tx`` in the order of einshard 0.3's first
``create_train_state``, or missing) with an :class:`~einshard.EinshardError`
whose hint is the call to write.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._arrays._leaves import is_array
from .._language._errors import EinshardError
from ._rules import ByShape, Rule, Rules, RulesLike

__all__ = ["is_optimizer", "is_table", "rule_table", "table_second"]

_SHOWN = (bool, int, float, complex, str, bytes, type(None))  # arguments shown by value in a hint

After = Mapping[str, Callable[[Any], bool]]  # the builder's own arguments after the table, and their test


def is_optimizer(value: Any) -> bool:
    """Whether ``value`` looks like an optax ``GradientTransformation`` (``init`` and ``update``)."""
    return (
        not is_table(value)
        and callable(getattr(value, "init", None))
        and callable(getattr(value, "update", None))
    )


def is_table(value: Any) -> bool:
    """Whether ``value`` looks like a rule table (whether or not it is a correct one).

    A :class:`~einshard.Rules`, a non-empty dict of strings to expressions, or
    a non-empty list or tuple of ``(regex, expression)`` pairs (or triples, or
    :class:`~einshard.Rule` objects).
    """
    if isinstance(value, Rules):
        return True
    if isinstance(value, Mapping):
        return bool(value) and all(
            isinstance(k, (str, re.Pattern)) and isinstance(v, (str, ByShape, type(None)))
            for k, v in value.items()
        )
    if isinstance(value, (list, tuple)) and value:
        return all(
            isinstance(row, Rule)
            or (
                isinstance(row, (list, tuple))
                and len(row) in (2, 3)
                and isinstance(row[0], (str, re.Pattern))
            )
            for row in value
        )
    return False


def rule_table(
    verb: str,
    target: Any,
    rules: RulesLike | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    noun: str = "the module",
    after: After | None = None,
    none: str | None = None,
) -> Rules | None:
    """The rule table of a ``verb(target, rules, *after, *args, **kwargs)`` call, checked.

    Args:
        verb: The function's name, for the messages (``create_sharded``).
        target: What it builds from: the factory, or the module to initialize.
        rules: The argument in the table's place.
        args: The positional arguments after it: the builder's own (``after``)
            first, then the factory's.
        kwargs: The keyword arguments (for the factory). ``rules`` among them
            is the table given by keyword, unless ``target`` itself names a
            parameter ``rules``.
        noun: What ``target`` is, for the messages (``the factory``).
        after: The builder's own positional arguments after the table, by
            name, each with a test of its value (``{'tx': is_optimizer}``
            for ``create_train_state``).
        none: What ``None`` in the table's place means, if it is allowed
            (Equinox: the table the ``@sharded`` layers compose into).

    Returns:
        The table as a :class:`~einshard.Rules`, or ``None`` where ``none`` allows it.

    Raises:
        EinshardError: The table anywhere but second (by keyword, first, among
            the factory's arguments, after ``tx``), missing, or an argument of
            the builder's own that is not what it should be; the hint shows the
            call with the table second.
    """
    after = after or {}
    positional = args if rules is None else (rules, *args)  # what follows the target, in order
    if "rules" in kwargs and not _names_rules(target):
        rest = {name: value for name, value in kwargs.items() if name != "rules"}
        raise EinshardError(
            f"{verb} takes the rule table right after {noun}, not as rules= after its arguments",
            hint=f"Call {_call(verb, target, after, positional, rest)}.",
        )
    if is_table(target) and rules is not None and not is_table(rules):
        raise EinshardError(
            f"{verb} takes {noun} first, then the rule table: here the table comes first",
            hint=f"Call {_call(verb, rules, after, args, kwargs)}.",
        )
    if rules is None and none is not None:
        return _checked_after(verb, target, after, None, args, kwargs)
    if rules is None and not any(map(is_table, args)):
        raise EinshardError(
            f"{verb} needs the rule table, right after {noun}",
            hint=f"Call {_call(verb, target, after, args, kwargs)}.",
        )
    if isinstance(rules, Rules):
        return _checked_after(verb, target, after, rules, args, kwargs)
    if is_table(rules) or not (_no_table(rules) or is_optimizer(rules) or any(map(is_table, args))):
        try:
            table = Rules(rules)  # pyright: ignore[reportArgumentType]
        except EinshardError as error:
            if isinstance(rules, (list, tuple, Mapping)):  # a table with a mistake: its message says which
                raise error.add_context(f"in the rule table of {verb}") from None
        else:
            return _checked_after(verb, target, after, table, args, kwargs)
    at = next((i for i, value in enumerate(positional) if is_table(value)), None)
    if at is not None:  # the table among the arguments: the call with it moved to its place
        rest = positional[:at] + positional[at + 1 :]
        call = _call(verb, target, after, rest, kwargs)
        if after and at <= len(after):
            raise EinshardError(
                f"{verb} takes the rule table right after {noun}, then {' and '.join(after)}",
                hint=f"Call {call}.",
            )
        raise EinshardError(
            f"the argument after {noun} is the rule table, not {_describe(rules)}",
            hint=f"Move the table there: {call}.",
        )
    hint = f"Put the table first, then the arguments for {_name(target)}: "
    hint += _call(verb, target, after, positional, kwargs)
    if none is not None:
        hint += f"; or, for {none}, {_call(verb, target, after, positional, kwargs, table='None')}"
    raise EinshardError(
        f"the argument after {noun} is the rule table, not {_describe(rules)}",
        hint=hint + ".",
    )


def _checked_after(
    verb: str,
    target: Any,
    after: After,
    table: Rules | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Rules | None:
    """The table, once the builder's own arguments after it are what they should be."""
    for i, (name, test) in enumerate(after.items()):
        if i >= len(args) or not test(args[i]):
            given = "nothing" if i >= len(args) else _describe(args[i])
            raise EinshardError(
                f"the argument after the rule table of {verb} is {name}, not {given}",
                hint=f"Call {_call(verb, target, after, args, kwargs)}.",
            )
    return table


def table_second(verb: str, target: Any, rules: Any, *, noun: str, is_target: Callable[[Any], bool]) -> None:
    """Refuses ``verb(rules, target)``, the table and what it applies to swapped.

    Args:
        verb: The function's name (``shard_module``).
        target: The argument in the first place.
        rules: The argument in the table's place.
        noun: What the first argument should be (``an NNX object``).
        is_target: Whether a value is one.

    Raises:
        EinshardError: ``target`` is a table and ``rules`` what it applies to.
    """
    if is_table(target) and is_target(rules):
        raise EinshardError(
            f"{verb} takes {noun} first, then the rule table: here the table comes first",
            hint=f"Call {verb}({_name(rules)}, rules).",
        )


def _no_table(value: Any) -> bool:
    """Values that cannot be a rule table: numbers, strings, arrays (PRNG keys), non-iterables."""
    return value is None or isinstance(value, _SHOWN) or is_array(value) or not isinstance(value, Iterable)


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
    """How a hint writes what a builder works on: a class or function by name, an instance as ``Dense(...)``.

    A nested class goes by its path, a local one by its name.
    """
    if isinstance(target, (type, Callable)) and hasattr(target, "__qualname__"):
        qualname = target.__qualname__  # a nested class by its path, a local one by its name
        return target.__name__ if "<" in qualname else qualname
    return type(target).__name__ + "(...)"  # a module instance (linen, NNX, Equinox), shown by its class


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
    after: After,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    table: str = "rules",
) -> str:
    """The call with the table in its place, arguments shown by value where short (else ``…``).

    The builder's own arguments after the table are written by name (``tx``): a value that
    passes its test is taken from ``args`` for it, else the name stands for one to add.
    """
    rest = list(args)
    own = []
    for name, test in after.items():
        if rest and test(rest[0]):
            rest.pop(0)
        own.append(name)
    keywords = [f"{name}={_shown(value)}" for name, value in kwargs.items()]
    return f"{verb}({', '.join([_name(target), table, *own, *map(_shown, rest), *keywords])})"
