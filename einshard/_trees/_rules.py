"""Rule tables: ordered ``(regex, expression)`` pairs, matched against leaf paths.

Pure Python. A leaf's path is its key path joined with ``/`` (``layers/0/attn/q_proj/kernel``,
made by :mod:`einshard._trees._paths`); a rule matches when ``re.search(regex,
path)`` succeeds, and the first matching rule wins (the EasyLM / scalax
convention, so their tables port directly).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Union

from .._language._errors import EinshardError, EinshardWarning
from .._language._expression import parse

__all__ = ["ByShape", "Indivisible", "Rule", "Rules", "RulesLike", "Unmatched", "ending_pattern"]

Unmatched = Literal["error", "replicate"]
"""What to do with an array leaf no rule matches."""

Indivisible = Literal["error", "replicate", "next"]
"""What to do with a leaf whose axis does not divide by its rule's shard count."""


def ending_pattern(path: str) -> str:
    r"""A rule pattern for one leaf: its path below the argument's name, anchored at the end.

    >>> ending_pattern('params/layers/0/w.kernel')
    'layers/0/w\\.kernel$'
    """
    return f"{re.escape(path.split('/', 1)[-1])}$"


class ByShape:
    """An expression decided per leaf, from its shape, dtype and the device count.

    The second element of a rule may be one of these instead of an expression's text
    (``einshard.strategies.fsdp()`` is one): planning a leaf asks it for the expression, and
    the reason it gives is the leaf's note in :func:`~einshard.explain`. Subclasses are frozen
    dataclasses (hashable, comparable and picklable, like the table that holds them).
    """

    def expression_for(self, shape: tuple[int, ...], dtype: Any, n_devices: int) -> tuple[str, str | None]:
        """The expression for a leaf, and why (``None``: nothing to explain)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a rule table.

    Attributes:
        pattern: The regular expression, as written.
        expression: The einshard expression for the leaves it matches, or a :class:`ByShape`
            that decides it per leaf.
        index: The rule's position in its table.
        note: Why the rule is there (a derived table says why for each rule), or ``None``.
    """

    pattern: str
    expression: str | ByShape
    index: int
    note: str | None = dataclasses.field(default=None, repr=False)

    def expression_for(self, shape: tuple[int, ...], dtype: Any, n_devices: int) -> tuple[str, str | None]:
        """The expression for a leaf of this shape and dtype, and why (``None`` for a fixed one)."""
        if isinstance(self.expression, str):
            return self.expression, None
        return self.expression.expression_for(shape, dtype, n_devices)

    @property
    def catches_all(self) -> bool:
        """Whether the rule matches every path (``'.*'``): a table's catch-all for the rest."""
        return self.pattern in _CATCH_ALL

    def __str__(self) -> str:
        return f"({self.pattern!r}, {self.expression!r})"


_CATCH_ALL = frozenset({"", ".*", "^.*", "^.*$", ".*$", "(.*)"})


RulesLike = Union[
    "Rules",
    Sequence["tuple[str, str | ByShape] | tuple[str, str | ByShape, str | None]"],
    Mapping[str, "str | ByShape"],
]
"""What a rule table may be given as: a :class:`Rules`, a list of pairs (or of
``(regex, expression, note)`` triples), or a dict."""


class Rules:
    """An ordered table of ``(regex, expression)`` pairs, compiled once.

    The first rule whose regex ``re.search``-matches a leaf's path decides the
    leaf's expression. Every regex and expression is checked when the table is
    built, so a typo fails at once, naming the rule.

    Tables combine with ``+`` (the left table's rules come first), so a
    general table can be refined by putting specific rules before it.

    Args:
        rules: A list of ``(regex, expression)`` pairs (a third element, a
            note saying why, is kept and printed), a dict from regex to
            expression (in insertion order), or another ``Rules``.
        unmatched: What to do with an array leaf no rule matches: ``'error'``
            (the default) or ``'replicate'``.
        indivisible: What to do when a leaf's axis does not divide by its
            shard count: ``'error'`` (the default), ``'replicate'``, or
            ``'next'`` (use the next matching rule that fits).
        strict: Warn about *unused* rules, those that decided no leaf (default ``False``).

    The policies belong to the table: every function that takes one applies
    them. :meth:`replace` makes a variant for one call
    (``rules.replace(unmatched='replicate')``).

    Raises:
        EinshardError: If a regex does not compile or an expression does not
            parse, with a caret under the fault and the rule named; or a
            policy is not one of its allowed values.

    >>> import einshard
    >>> rules = einshard.Rules([(r'w1/kernel$', 'x y -> x y*'), (r'.*', '... -> * ...')])
    >>> rules.match('mlp/w1/kernel').expression
    'x y -> x y*'
    >>> rules.match('mlp/w1/bias').expression
    '... -> * ...'
    """

    __slots__ = ("_table", "indivisible", "rules", "strict", "unmatched")

    def __init__(
        self,
        rules: RulesLike = (),
        *,
        unmatched: Unmatched | None = None,
        indivisible: Indivisible | None = None,
        strict: bool | None = None,
    ) -> None:
        base = rules if isinstance(rules, Rules) else None
        self.unmatched: Unmatched = (
            unmatched if unmatched is not None else (base.unmatched if base else "error")
        )
        self.indivisible: Indivisible = (
            indivisible if indivisible is not None else (base.indivisible if base else "error")
        )
        self.strict: bool = strict if strict is not None else (base.strict if base else False)
        _check_policies(self.unmatched, self.indivisible, self.strict)
        self._table: _Table = base._table if base is not None else _compile_table(tuple(_pairs(rules)))
        self.rules: tuple[Rule, ...] = self._table.rules

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __getitem__(self, index: int) -> Rule:
        return self.rules[index]

    def __add__(self, other: RulesLike) -> Rules:
        return Rules([*self._triples(), *Rules(other)._triples()], **self._policies())

    def __radd__(self, other: RulesLike) -> Rules:
        return Rules([*Rules(other)._triples(), *self._triples()], **self._policies())

    def _triples(self) -> list[tuple[str, str | ByShape, str | None]]:
        return [(rule.pattern, rule.expression, rule.note) for rule in self.rules]

    def replace(
        self,
        *,
        unmatched: Unmatched | None = None,
        indivisible: Indivisible | None = None,
        strict: bool | None = None,
    ) -> Rules:
        """The same rules with other policies (those not given are kept); the table is shared.

        >>> import einshard
        >>> rules = einshard.Rules([(r'w$', 'x y -> x y*')])
        >>> rules.replace(unmatched='replicate').unmatched, rules.unmatched
        ('replicate', 'error')
        """
        return Rules(self, unmatched=unmatched, indivisible=indivisible, strict=strict)

    def _policies(self) -> dict[str, Any]:
        return {"unmatched": self.unmatched, "indivisible": self.indivisible, "strict": self.strict}

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Rules)
            and self.pairs() == other.pairs()
            and self._policies() == other._policies()
        )

    def __hash__(self) -> int:
        return hash(self.pairs())

    def __repr__(self) -> str:
        rows = "".join(
            f"\n    ({r.pattern!r}, {r.expression!r}),{f'  # {r.note}' if r.note else ''}" for r in self.rules
        )
        return f"Rules([{rows}\n])" if rows else "Rules([])"

    def pairs(self) -> tuple[tuple[str, str | ByShape], ...]:
        """The table as ``(regex, expression)`` pairs."""
        return tuple((rule.pattern, rule.expression) for rule in self.rules)

    def match(self, path: str) -> Rule | None:
        """The first rule whose regex matches ``path``, or ``None``."""
        if type(path) is not str:
            _refuse_path(path)
        index = self._table.first(path)
        return None if index < 0 else self.rules[index]

    def matches(self, path: str) -> Iterator[Rule]:
        """Every rule whose regex matches ``path``, in table order."""
        if type(path) is not str:
            _refuse_path(path)
        for rule, regex in zip(self.rules, self._table.compiled, strict=True):
            if regex.search(path):
                yield rule

    def unmatched_rules(self, paths: Iterable[str]) -> tuple[Rule, ...]:
        """The table's *unmatched* rules: those whose regex matches none of ``paths``, in table order.

        Often a typo, or a layer name the model does not have. A rule that matches a path and
        still decides no leaf (an earlier rule wins, or it does not divide) is *unused*, not
        unmatched: the assignment says which rules are unused
        (:attr:`~einshard._trees._assign.TableAssignment.unused`).
        """
        unmatched, _ = self._table.coverage(paths)
        return tuple(self.rules[i] for i in unmatched)

    def matching_all(self, paths: Iterable[str]) -> tuple[Rule, ...]:
        """The rules whose regex matches every one of ``paths`` (none when there are none)."""
        _, everywhere = self._table.coverage(paths)
        return tuple(self.rules[i] for i in everywhere)


class _Table:
    """A compiled table, shared by every :class:`Rules` built from the same pairs.

    Holds the memo of which rule each path resolved to (it depends on the pairs only).
    """

    __slots__ = ("compiled", "digit_blind", "memo", "rules")

    def __init__(self, rules: tuple[Rule, ...], compiled: tuple[re.Pattern[str], ...]) -> None:
        self.rules = rules
        self.compiled = compiled
        self.digit_blind = _digit_blind(rules)
        self.memo: dict[str, int] = {}

    def first(self, path: str) -> int:
        """The index of the first rule whose regex matches ``path``, or -1; memoised."""
        index = self.memo.get(path)
        if index is None:
            # Digit-blind tables decide once per digit pattern: 'layers/17/w' as 'layers/00/w'.
            # (Both keys share the memo: under digit-blindness they resolve alike.)
            key = _digits_to_zero(path) if self.digit_blind else path
            index = self.memo.get(key)
            if index is None:
                index = self.search(key)
            if len(self.memo) < 1_000_000:  # paths of one model are few; bound it anyway
                self.memo[key] = self.memo[path] = index
        return index

    def coverage(self, paths: Iterable[str]) -> tuple[list[int], list[int]]:
        """The indices of the rules that match none of ``paths``, and of those that match all.

        A digit-blind table reads the paths of one digit pattern once (``layers/0/w`` for them all).
        """
        none = list(range(len(self.compiled)))
        every = list(none)
        seen: set[str] = set()
        for path in paths:
            if type(path) is not str:
                _refuse_path(path)
            key = _digits_to_zero(path) if self.digit_blind else path
            if key in seen:
                continue
            seen.add(key)
            hits = {i for i in set(none) | set(every) if self.compiled[i].search(key)}
            none = [i for i in none if i not in hits]
            every = [i for i in every if i in hits]
        return none, (every if seen else [])

    def search(self, path: str) -> int:
        """The first matching rule's index, or -1, searching rule by rule, without the memo."""
        for i, regex in enumerate(self.compiled):
            if regex.search(path):
                return i
        return -1


def _refuse_path(path: object) -> None:
    if not isinstance(path, str):
        raise EinshardError(
            f"a leaf path is a string, not {type(path).__name__}",
            hint="Pass a path like 'layers/0/mlp/w1/kernel': the leaf's dict keys, attribute names and "
            "indices joined with '/', as einshard.explain's rows show them.",
        )


def _check_policies(unmatched: object, indivisible: object, strict: object) -> None:
    if not isinstance(unmatched, str) or unmatched not in ("error", "replicate"):
        raise EinshardError(
            f"unmatched={unmatched!r} is not a policy", hint="Use unmatched='error' or 'replicate'."
        )
    if not isinstance(indivisible, str) or indivisible not in ("error", "replicate", "next"):
        raise EinshardError(
            f"indivisible={indivisible!r} is not a policy",
            hint="Use indivisible='error', 'replicate' or 'next'.",
        )
    if not isinstance(strict, bool):
        raise EinshardError(f"strict={strict!r} is not a policy", hint="Use strict=True or strict=False.")


def _pairs(rules: object) -> list[tuple[str, str | ByShape, str | None]]:
    if isinstance(rules, Mapping):
        items: Iterable[Any] = rules.items()
    elif isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise EinshardError(
            f"a rule table must be a list of (regex, expression) pairs, a dict or Rules, "
            f"not {type(rules).__name__}",
            hint="For example [(r'mlp/w1/kernel$', 'x y -> x y*'), (r'.*', '... -> * ...')].",
        )
    else:
        items = rules
    pairs = []
    for i, item in enumerate(items):
        if (
            not isinstance(item, (tuple, list))
            or len(item) not in (2, 3)
            or not isinstance(item[0], str)
            or not isinstance(item[1], (str, ByShape))
            or (len(item) == 3 and not isinstance(item[2], (str, type(None))))
        ):
            raise EinshardError(
                f"rule {i} is {item!r}, not a (regex, expression) pair of strings",
                hint="Write each rule as (r'regex', 'expression'), e.g. (r'w1/kernel$', 'x y -> x y*').",
            )
        pairs.append((item[0], item[1], item[2] if len(item) == 3 else None))
    return pairs


@functools.lru_cache(maxsize=64)
def _compile_table(pairs: tuple[tuple[str, str | ByShape, str | None], ...]) -> _Table:
    """Compiles a table once per process; tables built from the same pairs share the work."""
    rules = tuple(Rule(pattern, expression, i, note) for i, (pattern, expression, note) in enumerate(pairs))
    compiled = []
    doubts = []
    with warnings.catch_warnings(record=True) as caught:  # one context for all: entering costs
        warnings.simplefilter("always")
        for rule in rules:
            seen = len(caught)
            compiled.append(_compile_rule(rule))
            doubts += [(rule, warning.message) for warning in caught[seen:]]
    for rule, message in doubts:  # e.g. "possible nested set": name the rule it comes from
        warnings.warn(f"rule {rule.index} {rule}: {message}", EinshardWarning, stacklevel=3)
    return _Table(rules, tuple(compiled))


_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")


def _digits_to_zero(path: str) -> str:
    # On UTF-8 bytes: ASCII digits are single bytes, never part of a longer character's bytes.
    return path.encode("utf-8", "surrogatepass").translate(_DIGITS_TO_ZERO).decode("utf-8", "surrogatepass")


def _digit_blind(rules: Sequence[Rule]) -> bool:
    r"""Whether no regex of the table can tell one ASCII digit from another.

    Then a path matches as it does with every digit made ``0``, so the layers of
    a deep model (``layers/0/...`` to ``layers/319/...``) are matched once, not
    once each. A regex can only tell digits apart by writing one (a literal, a
    range end, an escape such as ``\x31``, a count such as ``{3}``) or by naming
    one (``\N{DIGIT ONE}``), or by comparing text with what a group matched
    (``(?P=name)``, which tells ``11`` from ``12``); classes such as ``\d``,
    ``\w`` and ``.`` treat all digits alike, and a range without a digit end
    holds all digits or none.
    """
    return not any(re.search(r"[0-9]|\\N\{|\(\?P=", rule.pattern) for rule in rules)


def _compile_rule(rule: Rule) -> re.Pattern[str]:
    try:
        regex = re.compile(rule.pattern)
    except re.error as error:
        at = error.pos if error.pos is not None else len(rule.pattern)
        raise EinshardError(
            f"the regex of rule {rule.index} does not compile: {error.msg}",
            expression=rule.pattern,
            span=(at, at + 1),
            hint="Rule regexes are Python regular expressions, matched with re.search against "
            "paths like 'layers/0/mlp/w1/kernel'.",
            context=[f"in rule {rule.index} {rule}"],
        ) from None
    try:
        if isinstance(rule.expression, str):  # a ByShape's expressions are checked per leaf
            parse(rule.expression)
    except EinshardError as error:
        raise error.add_context(f"in rule {rule.index} {rule}") from None
    return regex
