"""The strategy table (:class:`Strategy`: rules with their batch's expression) and FSDP's per-leaf rule.

Pure: no step is read here. The ready-made tables that use them are in ``_planning._strategies``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .._arrays._leaves import nbytes
from .._language._errors import EinshardError
from .._language._expression import LETTERS, REPLICATE, parse, split_expression
from .._language._numbers import checked_count
from .._language._text import size_text
from ._rules import ByShape, Indivisible, Rules, RulesLike, Unmatched

__all__ = ["DEFAULT_MIN_BYTES", "SplitLargest", "Strategy", "batch_pattern", "with_batch"]

DEFAULT_MIN_BYTES = 1 << 20
"""FSDP's default: leaves smaller than this are replicated."""


class Strategy(Rules):
    """A rule table for one parallelism strategy, with the expression for its batch.

    An ordinary :class:`~einshard.Rules` in every other way: ``shard_pytree``, ``explain``,
    ``init_sharded`` and the integrations take it as they take any table. Rules added in front
    (``my_rules + strategy``) or behind keep the strategy's name and batch expression.

    Attributes:
        name: What the strategy is, e.g. ``'fsdp'`` or ``'hybrid model=4'``.
        batch: The expression to shard each batch array with (its first axis is the batch
            axis), so that the batch is laid out consistently with the parameters.
        model: How many neighbouring devices share each split weight (the model axis): a
            hybrid's ``model``, a derived tensor-parallel table's device count, ``0`` for the
            name-based tensor-parallel table (all devices, whatever their count), ``None``
            for strategies without a model axis (data parallel, FSDP).

    >>> import einshard
    >>> strategy = einshard.strategies.data_parallel()
    >>> strategy.name, strategy.batch
    ('data parallel', 'b ... -> b* ...')
    >>> (einshard.Rules([('embed', 'v d -> v d*')]) + strategy).batch
    'b ... -> b* ...'
    """

    __slots__ = ("batch", "model", "name")

    def __init__(
        self,
        rules: RulesLike = (),
        *,
        batch: str,
        name: str,
        model: int | None = None,
        unmatched: Unmatched | None = None,
        indivisible: Indivisible | None = None,
        strict: bool | None = None,
    ) -> None:
        super().__init__(rules, unmatched=unmatched, indivisible=indivisible, strict=strict)
        parse(batch)
        if model is not None:
            hint = "Give how many devices share each split weight, e.g. model=4 (0: all devices)."
            checked_count(model, "model", hint, minimum=0, kind="a non-negative integer or None")
        self.batch = batch
        self.name = name
        self.model = model

    def _like(self, rules: Rules) -> Strategy:
        return Strategy(rules, batch=self.batch, name=self.name, model=self.model)

    def __add__(self, other: RulesLike) -> Strategy:
        return self._like(Rules.__add__(self, other))

    def __radd__(self, other: RulesLike) -> Strategy:
        return self._like(Rules.__radd__(self, other))

    def replace(
        self,
        *,
        unmatched: Unmatched | None = None,
        indivisible: Indivisible | None = None,
        strict: bool | None = None,
    ) -> Strategy:
        """The same strategy with other policies (those not given are kept)."""
        return self._like(Rules.replace(self, unmatched=unmatched, indivisible=indivisible, strict=strict))

    def __eq__(self, other: object) -> bool:
        same_extra = not isinstance(other, Strategy) or (other.batch, other.name) == (self.batch, self.name)
        return Rules.__eq__(self, other) and same_extra

    def __hash__(self) -> int:
        return Rules.__hash__(self)

    def __repr__(self) -> str:
        defaults = {"unmatched": "error", "indivisible": "error", "strict": False}
        policies = "".join(f", {k}={v!r}" for k, v in self._policies().items() if v != defaults[k])
        return f"Strategy({self.name!r}, batch={self.batch!r}, {Rules.__repr__(self)}{policies})"


def with_batch(rules: RulesLike, batch_name: str | None) -> RulesLike:
    """The table that lays out a step's arguments: a strategy's rules with its batch rule in front.

    One function for every verb that takes a strategy and a step (``plan``, ``explain_step``), so
    that one strategy gives one program wherever it goes. The batch rule matches the argument
    ``batch_name`` (a path ``batch`` or ``batch/...``) and gives it ``.batch``; the result is still
    the strategy (its name, batch expression and model axis), so the compile knows the batch's
    layout for the step's loops. A table that is not a :class:`Strategy`, or a step without a
    batch argument (``batch_name`` ``None``), is returned as it is.
    """
    if not isinstance(rules, Strategy) or batch_name is None:
        return rules
    batch_rule = (batch_pattern(batch_name), rules.batch)
    return Strategy(
        [batch_rule, *rules.pairs()],
        batch=rules.batch,
        name=rules.name,
        model=rules.model,
        **rules._policies(),
    )


def batch_pattern(batch_name: str) -> str:
    """The pattern of a step's batch rule: the argument ``batch_name`` and every path below it.

    >>> batch_pattern('batch')
    '^batch(/|$)'
    """
    return rf"^{re.escape(batch_name)}(/|$)"


@dataclasses.dataclass(frozen=True)
class SplitLargest(ByShape):
    """FSDP's per-leaf decision, as a rule's expression: split the largest axis that divides.

    A leaf of at least ``min_bytes`` is split over ``parts`` devices (all of them when ``None``;
    the other devices hold copies) on its largest axis whose length ``parts`` divides, the next
    largest when it does not (ties: the first such axis). A smaller leaf, or one no axis of which
    divides, is replicated; the reason is the leaf's note in :func:`~einshard.explain`.

    ``parts`` devices are one of every ``n_devices // parts`` in the device order (the copies
    are neighbours: a hybrid's data axis); ``group`` devices are neighbours (the copies are
    ``group`` apart: within a host, copied across hosts, as HSDP splits). One of the two at most.

    Attributes:
        min_bytes: Leaves smaller than this are replicated.
        axis: ``'largest'``, or an axis (``0``, ``-1``) to try first, then the largest ones.
        parts: How many devices each leaf is split over, or ``None`` for all.
        group: How many neighbouring devices each leaf is split over (``'a b -> 2 a b8'`` on
            16 devices with ``group=8``), or ``None``.

    >>> import einshard
    >>> einshard.strategies.SplitLargest(min_bytes=1024).expression_for((16, 4096), 'float32', 8)
    ('a b -> a b8', None)
    >>> einshard.strategies.SplitLargest(min_bytes=1024).expression_for((16, 4100), 'float32', 8)
    ('a b -> a8 b', 'axis 1 (4100) does not divide by 8: axis 0 split')
    >>> einshard.strategies.SplitLargest(min_bytes=1024, group=8).expression_for((16, 4096), 'float32', 16)
    ('a b -> 2 a b8', None)
    """

    min_bytes: int = DEFAULT_MIN_BYTES
    axis: str | int = "largest"
    parts: int | None = None
    group: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise EinshardError(
                f"min_bytes must be a non-negative integer, not {self.min_bytes!r}",
                hint="Give a size in bytes, e.g. min_bytes=1 << 20 (leaves below it are replicated).",
            )
        if self.axis != "largest" and (isinstance(self.axis, bool) or not isinstance(self.axis, int)):
            raise EinshardError(
                f"axis must be 'largest' or an axis number, not {self.axis!r}",
                hint="Use axis='largest' (the default), or e.g. axis=0 to try the first axis first.",
            )
        if self.parts is not None and (
            isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1
        ):
            raise EinshardError(
                f"parts must be a positive integer or None, not {self.parts!r}",
                hint="Give how many devices each leaf is split over, or None for all of them.",
            )
        if self.group is not None and (
            isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1
        ):
            raise EinshardError(
                f"group must be a positive integer or None, not {self.group!r}",
                hint="Give how many neighbouring devices each leaf is split over, e.g. group=8 (a host).",
            )
        if self.group is not None and self.parts is not None:
            raise EinshardError(
                f"SplitLargest takes parts={self.parts} or group={self.group}, not both",
                hint="parts: split over devices one group apart (copies are neighbours); group: split "
                "over neighbours (copies one group apart). Give one of them.",
            )

    def expression_for(self, shape: tuple[int, ...], dtype: Any, n_devices: int) -> tuple[str, str | None]:
        if self.group is not None:
            parts = self.group
            if n_devices % parts:
                return REPLICATE, f"group={parts} does not divide the {n_devices} devices: replicated"
        else:
            parts = n_devices if self.parts is None else self.parts
        if n_devices % parts:
            return REPLICATE, f"parts={parts} does not divide the {n_devices} devices: replicated"
        size = nbytes(shape, dtype)
        if parts == 1 or not shape:
            return REPLICATE, None
        if size < self.min_bytes:
            return REPLICATE, f"{size_text(size)} < min_bytes {size_text(self.min_bytes)}: replicated"
        if len(shape) > len(LETTERS):
            return REPLICATE, f"rank {len(shape)} > {len(LETTERS)}: replicated"
        order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
        if self.axis != "largest":
            first = int(self.axis) % len(shape) if -len(shape) <= int(self.axis) < len(shape) else None
            if first is not None:
                order.remove(first)
                order.insert(0, first)
        split = next((i for i in order if shape[i] % parts == 0), None)
        if split is None:
            return REPLICATE, f"no axis of {shape} divides by {parts}: replicated"
        counts = [parts if i == split else 1 for i in range(len(shape))]
        if self.group is None:
            expression = split_expression(counts, n_devices)
        else:  # the copies major, in front: each block on one device of every group of neighbours
            left, right = split_expression(counts, parts).split(" -> ")
            copies = n_devices // parts
            expression = f"{left} -> {copies} {right}" if copies > 1 else f"{left} -> {right}"
        if split == order[0]:
            return expression, None
        largest = order[0]
        return expression, f"axis {largest} ({shape[largest]}) does not divide by {parts}: axis {split} split"

    def __repr__(self) -> str:
        fields = [f"min_bytes={self.min_bytes}"]
        if self.axis != "largest":
            fields.append(f"axis={self.axis!r}")
        if self.parts is not None:
            fields.append(f"parts={self.parts}")
        if self.group is not None:
            fields.append(f"group={self.group}")
        return f"SplitLargest({', '.join(fields)})"
