"""``plan_batches``: the largest batch each candidate strategy fits in memory, found by compiling.

Built on the planner's pieces: the step named once (:class:`StepCall`), its batch scaled along
its leading axis (``jax.ShapeDtypeStruct((b, *rest), dtype)``, nothing allocated), each
candidate's table with its batch rule (``with_batch``), and the compile path of :func:`plan`
(``_cost._step.reports``: in this process, or one child process per batch size for another
device count or a target). Each round compiles every candidate still searching at its next
batch size, the candidates at one size together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..._cost._entry import entry_point
from ..._cost._step import reports
from ..._cost.child._progress import Progress
from ..._cost.hardware._figures import Figures, Hardware
from ..._cost.report._report import StepReport, estimated
from ..._language._errors import EinshardError
from ..._language._numbers import checked_count
from ..._language._text import size_text
from ..._tracing._call import StepCall
from ..._trees._strategy import DEFAULT_MIN_BYTES, Strategy, with_batch
from ._batch_sizes import (
    SizeSearch,
    Tried,
    batch_leaves,
    check_multiple,
    checked_sizes,
    granularity,
    next_round,
    scaled,
    tokens_per_example,
)
from ._batch_text import batch_plan_text
from ._bounds import argument_bytes_per_device
from ._candidates import (
    MEMORY,
    TIE,
    Rejection,
    candidate_strategies,
    over_memory,
    rejection_of,
    tie_ranked,
    where_to_plan,
)

__all__ = ["DEFAULT_MAX_COMPILES", "BatchPlan", "BatchRow", "plan_batches"]

DEFAULT_MAX_COMPILES = 8
"""Compiles per candidate at most, by default."""


@dataclasses.dataclass(frozen=True)
class BatchRow:
    """One candidate of a :class:`BatchPlan`: the largest batch that fits, and its step.

    Attributes:
        strategy: The candidate.
        batch_size: The largest global batch found to fit (compiled: its peak is within the
            limit), or ``None`` when none does.
        report: The step report at that batch, estimated at the plan's figures, or ``None``.
        rejected: Why no batch of the candidate can be used, or ``None``.
        index: The candidate's position in the list given (ties go to the earlier one).
        granularity: What the batch size must be a multiple of for the candidate: how many
            parts its batch expression splits the leading axis into (the device count for data
            parallel and FSDP, the data axis for a hybrid, 1 for a batch it copies).
        tried: Every compile of the search, in order.
        next_size: The next batch size up (``batch_size + granularity``, or the next size of
            the list given), or ``None`` when there is none.
        proven: Whether ``next_size`` was compiled and does not fit: ``batch_size`` is the
            largest. ``False`` when the search stopped at its compile bound first.
        tokens_per_example: The product of the batch's other axes when every batch leaf is
            integer tokens of one shape (``(b, s)``: ``s``), else ``None``.
    """

    strategy: Strategy
    batch_size: int | None
    report: StepReport | None
    rejected: str | None
    index: int
    granularity: int
    tried: tuple[Tried, ...] = ()
    next_size: int | None = None
    proven: bool = False
    tokens_per_example: int | None = None

    @property
    def name(self) -> str:
        """The strategy's name."""
        return self.strategy.name

    @property
    def rejected_for(self) -> str | None:
        """Why, in a word (the rejection's ``kind``, as for a plan's rows); ``None`` when not rejected."""
        if self.rejected is None:
            return None
        return self.rejected.kind if isinstance(self.rejected, Rejection) else "rejected"

    @property
    def compiles(self) -> int:
        """How many times the step was compiled for this candidate."""
        return len(self.tried)

    @property
    def seconds(self) -> float | None:
        """The estimated step time at :attr:`batch_size` (the report's :attr:`StepReport.seconds`)."""
        return None if self.report is None else self.report.seconds

    @property
    def peak_bytes(self) -> int | None:
        """Memory per device at the peak, at :attr:`batch_size`, from its compiled program."""
        return None if self.report is None else self.report.peak_bytes

    @property
    def examples_per_second(self) -> float | None:
        """:attr:`batch_size` over :attr:`seconds`: examples (leading-axis rows) per second."""
        seconds = self.seconds
        if self.batch_size is None or not seconds:
            return None
        return self.batch_size / seconds

    @property
    def tokens_per_second(self) -> float | None:
        """Examples per second times :attr:`tokens_per_example`, for a batch of integer tokens."""
        per_second = self.examples_per_second
        if per_second is None or self.tokens_per_example is None:
            return None
        return per_second * self.tokens_per_example

    @property
    def miss(self) -> Tried | None:
        """The smallest batch size compiled that does not fit, or ``None``."""
        misses = [t for t in self.tried if not t.fits]
        return min(misses, key=lambda t: t.batch_size) if misses else None


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The largest batch each candidate fits, ranked by examples per second; ``print()`` shows a table.

    Attributes:
        rows: One :class:`BatchRow` per candidate: those with a batch that fits by examples
            per second (by the largest batch without a bandwidth; within 2% count as equal, and
            then the candidate given first ranks first), the rejected ones after them.
        n_devices: The device count planned for.
        memory_per_device: The memory limit each batch fits.
        given_batch: The leading-axis size of the batch given, where the search starts.
        batch_sizes: The sizes given to search among, or ``None`` (the search from the batch given).
        max_compiles: Compiles per candidate at most.
        bandwidth: Bytes per second per device, or ``None``.
        flops_per_second: FLOP/s per device, or ``None``.
        target: What the candidates were compiled for.
        hardware: The target's figures, or ``None`` on CPU devices.
        figures: The figures resolved once.
    """

    rows: tuple[BatchRow, ...]
    n_devices: int
    memory_per_device: int
    given_batch: int
    batch_sizes: tuple[int, ...] | None
    max_compiles: int
    bandwidth: float | None
    flops_per_second: float | None
    target: str = "cpu"
    hardware: Hardware | None = dataclasses.field(default=None, repr=False)
    figures: Figures = dataclasses.field(default_factory=Figures, repr=False)

    tie: ClassVar[float] = TIE

    @property
    def usable(self) -> tuple[BatchRow, ...]:
        """The candidates with a batch that fits, best first."""
        return tuple(row for row in self.rows if row.rejected is None)

    @property
    def best(self) -> Strategy:
        """The strategy with the most examples per second at its largest batch.

        Raises:
            EinshardError: If no candidate fits any batch.
        """
        return self._best().strategy

    @property
    def best_batch(self) -> int:
        """The global batch size of :attr:`best`: the largest it fits.

        Raises:
            EinshardError: If no candidate fits any batch.
        """
        size = self._best().batch_size
        assert size is not None
        return size

    @property
    def compiles(self) -> int:
        """How many times the step was compiled in all."""
        return sum(row.compiles for row in self.rows)

    def _best(self) -> BatchRow:
        if not self.usable:
            reasons = "; ".join(f"{row.name}: {row.rejected}" for row in self.rows)
            raise EinshardError(
                f"no candidate strategy fits a batch in {size_text(self.memory_per_device)} per device",
                hint="Give more memory_per_device or devices, or other candidates (FSDP or a hybrid "
                "splits the weights, leaving memory for the batch).",
                context=[f"rejected: {reasons}"] if reasons else [],
            )
        return self.usable[0]

    def __str__(self) -> str:
        return batch_plan_text(self)


@entry_point()
def plan_batches(
    step: Callable[..., Any] | str,
    params: Any,
    batch: Any,
    *,
    n_devices: int | None = None,
    memory_per_device: int | None = None,
    bandwidth: float | None = None,
    latency: float | None = None,
    flops_per_second: float | None = None,
    candidates: Sequence[Strategy] | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    target: str = "cpu",
    hardware: Mapping[str, float] | None = None,
    slices: int | None = None,
    isolate: bool = False,
    quiet: bool = False,
    donate: bool = True,
    batch_sizes: Sequence[int] | None = None,
    max_compiles: int = DEFAULT_MAX_COMPILES,
) -> BatchPlan:
    """The largest batch that fits each candidate strategy, found by compiling, ranked by examples/s.

    The batch's leading axis is scaled (every leaf of it: they must share its size), nothing
    else; each candidate is compiled as :func:`plan` compiles it (its rules lay out ``params``,
    its batch expression the batch). Its largest batch is searched from the batch given:
    doubled once (halved when it does not fit), then each next size is where a line through
    the peaks of the two compiles nearest the limit meets it (peak memory grows about linearly
    with the batch; a guess that gains little is followed by a bisection between the last fit
    and the first miss), until a size fits and the next one up does not, at most
    ``max_compiles`` compiles per candidate. Sizes are multiples of the candidate's batch split
    (:attr:`BatchRow.granularity`). A batch shown fits by its own compile, never by an
    extrapolation; its row says whether the next size up was compiled and does not fit
    (:attr:`BatchRow.proven`). With ``batch_sizes``, the search is a bisection among those.

    The candidates rank by examples per second at their largest batch (the batch size over
    the step time); for a batch of integer tokens, tokens per second are shown too and rank the
    same (only the leading axis changes). Without a bandwidth (or a target) there is no step
    time, and the largest batch ranks first.

    A candidate whose arguments alone exceed the memory at its smallest batch (its split: the
    parameters and optimizer state as it lays them out, and one row of the batch per part) fits
    no batch, and is rejected without a compile.

    The arguments are :func:`plan`'s, in its order, with the two of the search last; those
    marked as for :func:`plan` mean what they mean there.

    Args:
        step: As for :func:`plan`.
        params: As for :func:`plan`.
        batch: The batch: an array or pytree of arrays sharing a leading (batch) axis; its size
            is where the search starts, and must be a multiple of every candidate's split.
        n_devices: As for :func:`plan`.
        memory_per_device: Bytes each device has: a batch fits when its compiled peak is
            within it. Needed, unless the ``target`` gives its device's memory.
        bandwidth: As for :func:`plan`.
        latency: As for :func:`plan`.
        flops_per_second: As for :func:`plan`.
        candidates: As for :func:`plan`.
        min_bytes: As for :func:`plan`.
        target: As for :func:`plan`.
        hardware: As for :func:`plan`.
        slices: As for :func:`plan`.
        isolate: As for :func:`plan`.
        quiet: As for :func:`plan`.
        donate: As for :func:`plan`.
        batch_sizes: Global batch sizes to choose among, by bisection (each a positive
            integer, a multiple of every candidate's split).
        max_compiles: Compiles per candidate at most (a positive integer).

    Returns:
        A :class:`BatchPlan`: ``.best`` and ``.best_batch``, the fastest strategy per example and
        its largest batch.

    Raises:
        EinshardError: Without a memory limit; for a batch whose leaves do not share a leading
            axis, a scalar batch, a size that is not a positive integer or not a multiple of a
            candidate's batch split; and as :func:`plan` raises.

    >>> import jax, jax.numpy as jnp, einshard
    >>> def step(params, batch):
    ...     grads = jax.grad(lambda p: jnp.sum((batch @ p['w']) ** 2))(params)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    >>> params = {'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    >>> batch = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    >>> batches = einshard.plan_batches(step, params, batch, memory_per_device=256 << 10,
    ...                                 candidates=[einshard.strategies.data_parallel()])
    >>> row = batches.rows[0]
    >>> row.granularity, row.peak_bytes <= 256 << 10, row.proven
    (8, True, True)
    """
    where = where_to_plan(
        target, n_devices, hardware, bandwidth, latency, flops_per_second, memory_per_device, isolate, slices
    )
    figures, count = where.figures, where.count
    limit = figures.memory_per_device
    if limit is None:
        raise EinshardError(
            "the largest batch that fits needs a memory limit",
            hint="Give memory_per_device= (bytes per device, e.g. memory_per_device=80 << 30), or "
            "target= (its device's memory, e.g. target='h100').",
        )
    budget = checked_count(
        max_compiles, "max_compiles", "Give a whole number of at least 1, e.g. max_compiles=8."
    )
    leaves, start = batch_leaves(batch)
    ladder = None if batch_sizes is None else checked_sizes(batch_sizes)
    call = StepCall.of(step, (params, batch), {}).donating(donate)
    strategies = candidate_strategies(call, candidates, where, min_bytes)
    granularities = [granularity(strategy, leaves, count) for strategy in strategies]
    for strategy, unit in zip(strategies, granularities, strict=True):
        for size in (start,) if ladder is None else ladder:
            check_multiple(size, unit, strategy, ladder is not None)
    tables = [with_batch(strategy, call.batch_name) for strategy in strategies]
    searches = [SizeSearch(unit, start, ladder, limit, budget) for unit in granularities]
    labels = [strategy.name for strategy in strategies]
    # A candidate whose arguments alone exceed the memory at its smallest batch fits none.
    for table, unit, search in zip(tables, granularities, searches, strict=True):
        needed = argument_bytes_per_device(scaled(call, unit), table, count)
        if needed is not None and needed > limit:
            search.failed = over_memory(needed, limit, arguments=True)

    def named(rounds: list[tuple[int, list[int]]]) -> list[str]:
        return [f"{labels[i]} at batch {size}" for size, indexes in rounds for i in indexes]

    rounds = next_round(searches)
    with Progress("plan_batches", named(rounds), quiet=quiet) as progress:
        done = 0  # the compiles so far: the progress's labels grow by a round at a time
        while rounds:
            if done == len(progress.labels):
                progress.labels.extend(named(rounds))
            for size, indexes in rounds:
                at_size = scaled(call, size)
                compiled = [tables[i] for i in indexes]
                answers = reports(
                    at_size, compiled, where.child, where.compiled_for, None, progress.shifted(done)
                )
                for k, i in enumerate(indexes):
                    result = answers[k]
                    report = None if result.report is None else estimated(result.report, figures)
                    searches[i].record(
                        size, report, None if report is not None else rejection_of(result.error)
                    )
                done += len(indexes)
            rounds = next_round(searches)
    tokens = tokens_per_example(leaves)
    rows = [
        _row(search, strategy, index, tokens)
        for index, (strategy, search) in enumerate(zip(strategies, searches, strict=True))
    ]
    return _ranked(rows, count, figures, start, ladder, budget)


def _row(search: SizeSearch, strategy: Strategy, index: int, tokens: int | None) -> BatchRow:
    """The candidate's row: its largest fit, or why it fits none."""
    tried = tuple(search.tried)
    if search.ladder is not None:
        ups = [u for u in search.ladder if u > search.lo]
        up = ups[0] if ups else None
    else:
        up = search.lo + 1
    miss = search.hi is not None and up is not None and search.hi == up
    next_size = None if up is None else up * search.unit
    proven = miss and all(t.reason is None or _refused(t.reason) for t in tried if t.batch_size == next_size)
    if search.lo:
        return BatchRow(
            strategy, search.lo * search.unit, search.reports[search.lo], None, index, search.unit, tried,
            next_size, proven, tokens,
        )  # fmt: skip
    rejected = search.failed
    if rejected is None:
        smallest = min(tried, key=lambda t: t.batch_size)
        if smallest.peak_bytes is not None:
            detail = (
                f"at batch {smallest.batch_size}, it needs {size_text(smallest.peak_bytes)} > "
                f"{size_text(search.limit)} per device"
            )
            if smallest.batch_size > search.unit:
                detail += f" (smaller batches not compiled: {len(tried)} compiles)"
            rejected = Rejection(MEMORY, detail)
        else:
            reason = smallest.reason
            kind = reason.kind if isinstance(reason, Rejection) else "compile"
            detail = reason.detail if isinstance(reason, Rejection) else str(reason)
            rejected = Rejection(kind, f"at batch {smallest.batch_size}: {detail}")
    return BatchRow(strategy, None, None, rejected, index, search.unit, tried, next_size, False, tokens)


def _refused(reason: str) -> bool:
    """Whether a size has no program because the compiler refused it for memory: it does not fit."""
    return isinstance(reason, Rejection) and reason.kind == MEMORY


def _ranked(
    rows: list[BatchRow],
    n_devices: int,
    figures: Figures,
    start: int,
    ladder: tuple[int, ...] | None,
    budget: int,
) -> BatchPlan:
    timed = figures.bandwidth is not None

    def measure(row: BatchRow) -> float:
        # Higher is better: examples per second with a step time, else the batch itself.
        per_second = row.examples_per_second if timed else None
        return per_second if per_second is not None else float(row.batch_size or 0)

    usable = [row for row in rows if row.rejected is None]
    ranked = tie_ranked(usable, measure, lambda row: row.index, higher=True)
    ranked += [row for row in rows if row.rejected is not None]
    memory = figures.memory_per_device
    assert memory is not None
    return BatchPlan(
        tuple(ranked),
        n_devices,
        memory,
        start,
        ladder,
        budget,
        figures.bandwidth,
        figures.flops_per_second,
        figures.target,
        figures.hardware,
        figures,
    )
