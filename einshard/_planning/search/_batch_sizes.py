"""The batch sizes one candidate of ``plan_batches`` compiles at, and the batch scaled to each.

A candidate's search (:class:`SizeSearch`) goes in units of its batch split: the batch given,
doubled once (halved when it does not fit), then where a line through the peaks of the two
compiles nearest the limit meets it, or a bisection between the last fit and the first miss;
with sizes given, a bisection among those. Each round compiles every candidate still searching
at its next size (:func:`next_round`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ..._arrays._leaves import is_traced
from ..._cost.report._report import StepReport
from ..._language._errors import EinshardError
from ..._language._layout import compile_layout
from ..._tracing._call import StepCall, traced_dtype
from ..._trees._strategy import Strategy
from ._candidates import MEMORY, Rejection

__all__ = [
    "SizeSearch",
    "Tried",
    "batch_leaves",
    "check_multiple",
    "checked_sizes",
    "granularity",
    "next_round",
    "scaled",
    "tokens_per_example",
]


@dataclasses.dataclass(frozen=True)
class Tried:
    """One compile of the search: a global batch size and what it gave.

    Attributes:
        batch_size: The global batch size compiled (the leading axis of every batch leaf).
        peak_bytes: Memory per device at the peak of its compiled program, or ``None`` when it
            was not compiled (see ``reason``).
        fits: Whether the peak is within the memory limit.
        reason: Why there is no program (the step does not compile or lay out at this size, or
            this machine's memory ended its compile), or ``None``.
    """

    batch_size: int
    peak_bytes: int | None
    fits: bool
    reason: str | None = None


def checked_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    if isinstance(sizes, (int, str)) or not sizes:
        raise EinshardError(
            f"batch_sizes must be a non-empty list of global batch sizes, not {sizes!r}",
            hint="Give the sizes to choose among, e.g. batch_sizes=[64, 128, 256, 512].",
        )
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EinshardError(
                f"a batch size must be a positive integer, not {size!r}",
                hint="Give global batch sizes (the batch's leading axis), e.g. batch_sizes=[64, 128, 256].",
            )
    return tuple(sorted(set(sizes)))


def batch_leaves(batch: Any) -> tuple[list[Any], int]:
    """The batch's array leaves and their shared leading-axis size."""
    import jax

    leaves = [leaf for leaf in jax.tree_util.tree_leaves(batch) if is_traced(leaf)]
    if not leaves or any(not leaf.shape for leaf in leaves):
        raise EinshardError(
            "the batch to scale has no leading axis: it is a scalar, or has no arrays",
            hint="Give the batch as arrays (or ShapeDtypeStructs) whose first axis is the batch axis, "
            "e.g. jax.ShapeDtypeStruct((32, 1024), jnp.int32) for 32 sequences of 1024 tokens.",
        )
    sizes = sorted({leaf.shape[0] for leaf in leaves})
    if len(sizes) > 1:
        shapes = ", ".join(str(tuple(leaf.shape)) for leaf in leaves[:4])
        raise EinshardError(
            f"the batch's leaves do not share a leading axis: sizes {sizes} ({shapes})",
            hint="Give every leaf of the batch the batch axis first, with one size (inputs and "
            "targets of (b, ...) each); per-step constants belong with the params.",
        )
    if sizes[0] < 1:
        raise EinshardError(
            f"a batch size must be a positive integer, not {sizes[0]!r}",
            hint="Give a batch whose leading axis is at least the candidates' split (e.g. the device count).",
        )
    return leaves, sizes[0]


def granularity(strategy: Strategy, leaves: list[Any], n_devices: int) -> int:
    """How many parts the strategy's batch expression splits the leading axis into.

    A batch expression that does not fit a leaf's rank gives 1 here: its compile rejects
    the candidate, with the reason.
    """
    parts = 1
    for rank in sorted({len(leaf.shape) for leaf in leaves}):
        try:
            layout = compile_layout(strategy.batch, rank, n_devices)
        except EinshardError:
            continue
        parts = math.lcm(parts, layout.shards[0])
    return parts


def check_multiple(size: int, unit: int, strategy: Strategy, listed: bool) -> None:
    if size % unit:
        where = "batch_sizes= holds" if listed else "the batch given has"
        raise EinshardError(
            f"{where} a batch of {size}, which {strategy.name!r} cannot split: its batch expression "
            f"{strategy.batch!r} splits the leading axis into {unit} parts",
            hint=f"Give batch sizes that are multiples of {unit} (e.g. {max(unit, size // unit * unit)}), "
            "or leave that candidate out.",
        )


def tokens_per_example(leaves: list[Any]) -> int | None:
    """Tokens per example for a batch of integer tokens of one shape; else ``None``."""
    import numpy as np

    shapes = {tuple(leaf.shape[1:]) for leaf in leaves}
    if len(shapes) != 1 or not all(np.issubdtype(np.dtype(leaf.dtype), np.integer) for leaf in leaves):
        return None
    return math.prod(shapes.pop())


def scaled(call: StepCall, size: int) -> StepCall:
    """The same call with every batch leaf's leading axis ``size``: ``ShapeDtypeStruct((size, *rest))``."""
    import jax

    leaves = list(call.leaves)
    for i in call.argument_leaves(1):
        leaf = leaves[i]
        if is_traced(leaf):
            leaves[i] = jax.ShapeDtypeStruct((size, *leaf.shape[1:]), traced_dtype(leaf.dtype))
    return call.with_leaves(leaves)


def next_round(searches: list[SizeSearch]) -> list[tuple[int, list[int]]]:
    """The next round: each batch size wanted, with the candidates that want it, smallest first."""
    wanted: dict[int, list[int]] = {}
    for index, search in enumerate(searches):
        size = search.next_size()
        if size is not None:
            wanted.setdefault(size, []).append(index)
    return sorted(wanted.items())


class SizeSearch:
    """One candidate's search, in units of its granularity: the largest fit, the smallest miss."""

    def __init__(self, unit: int, start: int, ladder: tuple[int, ...] | None, limit: int, budget: int):
        self.unit = unit
        self.limit = limit
        self.budget = budget
        self.start = start // unit
        self.ladder = None if ladder is None else [size // unit for size in ladder]
        self.tried: list[Tried] = []
        self.reports: dict[int, StepReport] = {}
        self.peaks: dict[int, int] = {}
        self.lo = 0  # the largest fit, in units (0: none yet)
        self.hi: int | None = None  # the smallest miss, in units
        self.failed: Rejection | None = None  # a first compile that failed for another reason than memory
        self.bisect = False  # the last guess shrank the interval by less than half: bisect next

    def _between(self) -> list[int]:
        assert self.ladder is not None
        return [u for u in self.ladder if u > self.lo and (self.hi is None or u < self.hi)]

    def next_size(self) -> int | None:
        """The next global batch size to compile, or ``None`` when the search is over."""
        if self.failed is not None or len(self.tried) >= self.budget:
            return None
        if self.ladder is not None:
            between = self._between()
            return between[len(between) // 2] * self.unit if between else None
        if not self.tried:
            return self.start * self.unit
        if self.hi is not None and self.hi <= self.lo + 1:
            return None
        guess = None if self.bisect else self._linear_guess()
        if self.hi is None:  # no miss yet: double, or the guess where the peak meets the limit
            # (at most 4 times the last fit: a peak that hardly grows, as with the first argument
            # donated, puts the guess far off, and XLA's peak far from the fits is no line)
            # (a guess at or below the last fit: the next size up, to confirm it)
            units = 2 * self.lo if guess is None else max(self.lo + 1, min(guess, 4 * self.lo))
        elif self.lo == 0:  # no fit yet: halve, or the guess
            units = self.hi // 2 if guess is None else guess
        else:
            units = (self.lo + self.hi) // 2 if guess is None else guess
        top = self.hi - 1 if self.hi is not None else max(units, self.lo + 1)
        return max(self.lo + 1, min(units, top)) * self.unit

    def _linear_guess(self) -> int | None:
        """Where a line through the peaks of the two compiles nearest the limit meets it, in units."""
        fits = sorted(u for u in self.peaks if self.peaks[u] <= self.limit)
        misses = sorted(u for u in self.peaks if self.peaks[u] > self.limit)
        if fits and misses:
            points = [fits[-1], misses[0]]
        elif len(fits) >= 2:
            points = fits[-2:]
        elif len(misses) >= 2:
            points = misses[:2]
        else:
            return None
        (u1, u2), (p1, p2) = points, (self.peaks[points[0]], self.peaks[points[1]])
        if p2 <= p1:
            return None
        return u1 + math.floor((self.limit - p1) * (u2 - u1) / (p2 - p1))

    def record(self, size: int, report: StepReport | None, reason: Rejection | None) -> None:
        units = size // self.unit
        width = None if self.hi is None else self.hi - self.lo
        peak = None if report is None else report.peak_bytes
        if peak is None and reason is None:
            reason = Rejection("compile", "the compiled program gives no peak memory")
        fits = peak is not None and peak <= self.limit
        self.tried.append(Tried(size, peak, fits, reason))
        if peak is not None:
            self.peaks[units] = peak
        if fits:
            assert report is not None
            self.reports[units] = report
            self.lo = max(self.lo, units)
        elif reason is not None and reason.kind != MEMORY and not self.tried[:-1] and self.ladder is None:
            self.failed = reason  # not a memory verdict at the batch given: the candidate is rejected
        else:
            self.hi = units if self.hi is None else min(self.hi, units)
        new_width = None if self.hi is None else self.hi - self.lo
        self.bisect = (
            width is not None and new_width is not None and new_width * 2 > width and not self.bisect
        )
