"""What ``plan`` and ``plan_batches`` share: where they compile, their candidates, why one is rejected.

Both verbs resolve the target, figures and device count once (:func:`where_to_plan`), take the
candidates given or the defaults for the step (:func:`candidate_strategies`), say why a candidate
cannot be used with a typed :class:`Rejection` (a kind and a detail, its text made from them and
never read back), and rank what is left with one tie band (:func:`tie_ranked`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ..._cost._step import reports
from ..._cost.child._child import Crash
from ..._cost.child._progress import Progress
from ..._cost.hardware._figures import Figures, resolve_figures
from ..._cost.hardware._target import Target, parse_target
from ..._cost.pipeline._analysis import Answer, DoesNotFitError
from ..._language._errors import EinshardError
from ..._language._text import seconds_text, size_text
from ..._sharding._devices import call_devices, count_to_plan
from ..._tracing._call import StepCall, trace
from ..._trees._rules import RulesLike
from ..._trees._strategy import Strategy, with_batch
from ..tables._roles import read_call
from ..tables._strategies import derived_defaults
from ._bounds import Bounds, StepCosts, bounds, step_costs

__all__ = [
    "TIE",
    "Prepared",
    "Rejection",
    "Timings",
    "Where",
    "candidate_strategies",
    "compile_in_order",
    "prepared",
    "rejection_of",
    "tie_ranked",
    "where_to_plan",
]

TIE = 0.02
"""Estimates within 2% of each other count as equal: the earlier candidate ranks first."""

_Row = TypeVar("_Row")

# The kinds of rejection, with the word a row's verdict shows and how its text begins.
MEMORY = "memory"
SHAPES = "shapes"
COMPILE = "compile"
KILLED_HERE = "killed here"
NOT_COMPILED = "not compiled"
CANNOT_WIN = "cannot win"
BUDGET = "budget"
FROM_LAYERS = "sampled"  # ranked from compiles at two small depths (_sampled), not compiled whole
_LEADS = {
    MEMORY: "does not fit memory",
    SHAPES: "does not fit the shapes or devices",
    COMPILE: "does not compile",
    KILLED_HERE: "not compiled on this machine",
    NOT_COMPILED: "not compiled",
    BUDGET: "not compiled",
    CANNOT_WIN: "",  # its detail names the winner: "cannot beat fsdp: at least 97 ms"
    FROM_LAYERS: "",  # "cannot beat fsdp: about 512 ms, extrapolated from 2 and 3 of its 32 layers"
}


class Rejection(str):
    """Why a candidate cannot be used: a ``kind`` and a ``detail``; the text is made from them.

    A ``str`` (a row's ``rejected`` prints and compares as its text), so code that asks why reads
    :attr:`kind`, never the text. The kinds: ``'memory'`` (over the memory per device: compiled, or
    by its arguments alone before compiling), ``'shapes'`` (the table does not fit the shapes or
    the devices), ``'compile'`` (the step does not compile under it), ``'killed here'`` (this
    machine's memory ended its compile: no verdict on the step), ``'cannot win'`` (left uncompiled:
    its lower bound is slower than a compiled candidate), ``'budget'`` (left uncompiled:
    ``max_seconds`` was spent) and ``'not compiled'`` (ranked again at other figures, it has no
    program to rank).

    >>> rejection = Rejection('memory', 'needs 2.0 GiB > 1.0 GiB per device')
    >>> rejection
    'does not fit memory: needs 2.0 GiB > 1.0 GiB per device'
    >>> rejection.kind, rejection.compiled
    ('memory', True)
    """

    kind: str
    detail: str
    compiled: bool

    def __new__(cls, kind: str, detail: str, *, compiled: bool = True) -> Rejection:
        lead = _LEADS[kind]
        text = f"{lead}: {detail}" if lead else detail
        if not compiled:
            text += " (not compiled)"
        self = super().__new__(cls, text)
        self.kind, self.detail, self.compiled = kind, detail, compiled
        return self

    def __reduce__(self) -> tuple:
        return (_rejection, (self.kind, self.detail, self.compiled))

    def __repr__(self) -> str:
        return str.__repr__(self)


def _rejection(kind: str, detail: str, compiled: bool) -> Rejection:
    return Rejection(kind, detail, compiled=compiled)


def rejection_of(error: Any) -> Rejection:
    """The rejection of a table whose compile gave no report (its ``Answer.error``)."""
    if isinstance(error, DoesNotFitError):  # the target's compiler refused it for memory
        return Rejection(
            MEMORY,
            f"XLA's compiler needs {size_text(error.needed)} > {size_text(error.available)} per device "
            f"for a program on {error.target}",
        )
    if isinstance(error, EinshardError):
        where = f" ({error.context[0]})" if error.context else ""
        return Rejection(SHAPES, f"{error.headline}{where}")
    if isinstance(error, Crash) and error.killed:
        return Rejection(KILLED_HERE, str(error))
    return Rejection(COMPILE, str(error if error is not None else "no report"))


def over_memory(needed: int, memory_per_device: int, *, arguments: bool = False) -> Rejection:
    """``does not fit memory: needs X > Y per device``; with ``arguments``, decided before compiling."""
    has = size_text(memory_per_device)
    if arguments:
        return Rejection(
            MEMORY, f"its arguments alone need {size_text(needed)} > {has} per device", compiled=False
        )
    return Rejection(MEMORY, f"needs {size_text(needed)} > {has} per device")


def bounded_over(bound: Bounds, memory_per_device: int) -> Rejection:
    """The rejection of a candidate whose memory bound is over the memory, decided before compiling."""
    if bound.argument_bytes > memory_per_device:
        return over_memory(bound.argument_bytes, memory_per_device, arguments=True)
    return Rejection(
        MEMORY,
        f"it needs at least {size_text(bound.memory_bytes)} > {size_text(memory_per_device)} per device "
        f"(its arguments {size_text(bound.argument_bytes)}, with its outputs and largest dot result "
        "spread over the devices)",
        compiled=False,
    )


def cannot_win(winner: str, seconds: float | None, traffic: int) -> Rejection:
    """``cannot beat <winner>: at least X``: its lower bound is slower than the winner's estimate."""
    least = seconds_text(seconds) if seconds is not None else f"{size_text(traffic)} sent per device"
    return Rejection(CANNOT_WIN, f"cannot beat {winner}: at least {least} (not compiled)")


@dataclasses.dataclass(frozen=True)
class Where:
    """What a plan compiles for, resolved once for ``plan`` and ``plan_batches``.

    Attributes:
        target: The target named (CPU devices, a GPU, a TPU slice) for the device count.
        figures: The target's figures with the caller's in their place (:func:`resolve_figures`).
        count: The device count planned for.
        child: The device count a child process compiles for, or ``None``: in this process.
        compiled_for: The target a child compiles with, or ``None``: simulated CPU devices.
    """

    target: Target
    figures: Figures
    count: int
    child: int | None
    compiled_for: Target | None


def where_to_plan(
    target: str,
    n_devices: int | None,
    hardware: Mapping[str, float] | None,
    bandwidth: float | None,
    latency: float | None,
    flops_per_second: float | None,
    memory_per_device: int | None,
    isolate: bool,
    slices: int | None = None,
) -> Where:
    """The target, figures and device count of a plan, and where its candidates compile.

    Raises:
        EinshardError: For a device count, target or figure that is not one.
    """
    given = count_to_plan(n_devices, hint="Give the device count to plan for, e.g. n_devices=64.")
    chosen = parse_target(target, n_devices, slices)
    figures = resolve_figures(
        chosen,
        hardware,
        latency=latency,
        bandwidth=bandwidth,
        memory_per_device=memory_per_device,
        flops_per_second=flops_per_second,
    )
    if figures.hardware is not None:  # a GPU or TPU: its compiler, in a child
        return Where(chosen, figures, chosen.n_devices, chosen.n_devices, chosen)
    local = call_devices(None).count
    return Where(chosen, figures, given, given if isolate or given != local else None, None)


def candidate_strategies(
    call: StepCall, candidates: Sequence[Strategy] | None, where: Where, min_bytes: int, traced: Any = None
) -> list[Strategy]:
    """The candidates given (checked), or the defaults for the step, the device count and its hosts.

    ``traced``: the step's jaxpr, when it is at hand (the defaults read the roles from it).

    Raises:
        EinshardError: If a candidate is not a :class:`Strategy`, or none is given.
    """
    if candidates is None:
        hardware = where.figures.hardware
        per_host = hardware.devices_per_host if hardware is not None else None
        return derived_defaults(read_call(call, traced), where.count, min_bytes, per_host)
    if isinstance(candidates, Strategy):
        candidates = [candidates]
    strategies = list(candidates)
    if not strategies:
        raise EinshardError(
            "candidates= is empty: there is nothing to compile or rank",
            hint="Leave candidates= out for the defaults (data parallel, FSDP, tensor parallel and the "
            "hybrids), or give at least one strategy, e.g. candidates=[einshard.strategies.fsdp()].",
        )
    for candidate in strategies:
        if not isinstance(candidate, Strategy):
            raise EinshardError(
                f"a planner candidate must be a Strategy, not {type(candidate).__name__}",
                hint="Use einshard.strategies.fsdp() and friends, or wrap a table: "
                "einshard.strategies.Strategy(rules, batch='b ... -> b* ...', name='mine').",
            )
    return strategies


def tie_ranked(
    rows: Iterable[_Row],
    measure: Callable[[_Row], float],
    index: Callable[[_Row], int],
    *,
    higher: bool = False,
) -> list[_Row]:
    """The rows best first by ``measure`` (lower is better, or higher with ``higher``).

    Measures within :data:`TIE` of the best left are not told apart: the row with the smallest
    ``index`` (the candidate given first, the simpler strategy in the default order) goes first.
    """
    sign = -1.0 if higher else 1.0
    left = sorted(rows, key=lambda row: (sign * measure(row), index(row)))
    ranked: list[_Row] = []
    while left:
        best = measure(left[0])
        if higher:
            near = [row for row in left if measure(row) >= best * (1 - TIE)]
        else:
            near = [row for row in left if measure(row) <= best * (1 + TIE)]
        pick = min(near, key=index)
        left.remove(pick)
        ranked.append(pick)
    return ranked


def out_of_time(max_seconds: float, bound: Bounds | None) -> Rejection:
    """``not compiled: max_seconds=S was spent first``, with what the candidate needs at least."""
    least = ""
    if bound is not None:
        time_bound = f"{seconds_text(bound.seconds)}, " if bound.seconds is not None else ""
        least = f"; it needs at least {time_bound}{size_text(bound.memory_bytes)} per device"
    return Rejection(BUDGET, f"max_seconds={max_seconds:g} was spent before its turn{least}")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A plan's candidates, ready to compile: their tables and bounds, and what it took.

    Attributes:
        strategies: The candidates, in the order given (or the defaults').
        tables: Each one's table with its batch rule (``with_batch``).
        bounds: Each one's bounds (:func:`~einshard._planning.search._bounds.bounds`), or ``None`` when
            its table does not fit the arguments (its compile says why).
        costs: What the step computes, read once from its jaxpr, or ``None`` when the step could
            not be traced here (the candidates given were then not bounded in time).
        trace_seconds: How long tracing the step took.
        roles_seconds: How long reading its roles took (the default candidates need them).
        bounds_seconds: How long reading its costs and bounding the candidates took.
    """

    strategies: list[Strategy]
    tables: list[RulesLike]
    bounds: list[Bounds | None]
    costs: StepCosts | None
    trace_seconds: float = 0.0
    roles_seconds: float = 0.0
    bounds_seconds: float = 0.0


def prepared(call: StepCall, candidates: Sequence[Strategy] | None, where: Where, min_bytes: int) -> Prepared:
    """The candidates (checked first), the step traced once for their roles and bounds, their bounds.

    Raises:
        EinshardError: As :func:`candidate_strategies` raises, and when the default candidates
            need the step's roles and it cannot be traced.
    """
    if candidates is not None:
        strategies = candidate_strategies(call, candidates, where, min_bytes)
    start = time.perf_counter()
    try:
        traced = trace(call)
    except EinshardError:
        if candidates is None:
            raise
        traced = None  # the step's own business (a mesh this process lacks): no time bounds
    traced_at = time.perf_counter()
    if candidates is None:
        strategies = candidate_strategies(call, None, where, min_bytes, traced)
    read_at = time.perf_counter()
    tables = [with_batch(strategy, call.batch_name) for strategy in strategies]
    costs = step_costs(call, traced) if traced is not None else None
    bounded = [bounds(call, table, where.count, costs, where.figures) for table in tables]
    return Prepared(
        strategies,
        tables,
        bounded,
        costs,
        trace_seconds=traced_at - start,
        roles_seconds=read_at - traced_at,
        bounds_seconds=time.perf_counter() - read_at,
    )


def compile_in_order(
    call: StepCall,
    tables: Sequence[RulesLike],
    bounded: Sequence[Bounds | None],
    skip: Mapping[int, Rejection],
    where: Where,
    progress: Progress,
    estimate: Callable[[Answer], float | None],
    *,
    exhaustive: bool = False,
    max_seconds: float | None = None,
) -> tuple[dict[int, Answer], dict[int, Rejection]]:
    """Compiles the candidates most promising first; those that cannot win, or out of time, are left.

    The order is the bounds' (the fastest time, or the fewest bytes without a bandwidth, first;
    a table whose bounds are unknown first: it fails fast or compiles). Before each compile, a
    candidate whose bound is slower than the best ``estimate`` so far beyond the tie band is
    left (``'cannot win'``: no candidate can rank before one within the band of the fastest, and
    its time is at least its bound), unless ``exhaustive``; once ``max_seconds`` have passed,
    every candidate left is (``'budget'``). ``skip``: the candidates not to compile at all.

    Returns:
        The answers of the candidates compiled, and why each of the others was left, by index.
    """
    figures = where.figures
    measures = [bound.measure(figures) if bound is not None else None for bound in bounded]
    order = sorted(
        (i for i in range(len(tables)) if i not in skip),
        key=lambda i: (-1.0 if measures[i] is None else measures[i], i),
    )
    left: dict[int, Rejection] = {}
    estimates: dict[int, float | None] = {}
    start = time.perf_counter()

    def choose(answers: dict[int, Answer], compiling: frozenset[int]) -> int | None:
        for index, answer in answers.items():
            if index not in estimates:
                estimates[index] = estimate(answer)
        known = [(m, i) for i, m in estimates.items() if m is not None]
        best = min(known) if known else None
        for index in order:
            if index in answers or index in left or index in compiling:
                continue
            bound, measure = bounded[index], measures[index]
            if not exhaustive and best is not None and measure is not None and measure > best[0] * (1 + TIE):
                assert bound is not None
                left[index] = cannot_win(f"candidate {best[1]}", bound.seconds, bound.traffic)
                progress.left_out(index, "cannot win")
                continue
            if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                left[index] = out_of_time(max_seconds, bound)
                progress.left_out(index, "max_seconds spent")
                continue
            return index
        return None

    answers = reports(call, tables, where.child, where.compiled_for, choose, progress)
    return answers, left


@dataclasses.dataclass(frozen=True)
class Timings:
    """Where a plan's time went, in seconds, and the memory its child process reached.

    Attributes:
        seconds: The plan's wall time, from the call to its answer.
        child_start: Starting the child processes (importing JAX, reading the step): all of them.
        tracing: Tracing the step once (``jax.make_jaxpr``), for its roles and bounds.
        roles: Reading the parameters' roles from the trace (the default candidates).
        bounds: Reading what the step computes and bounding each candidate.
        compiles: The candidates' compiles, all of them (each one's is its report's
            ``compile_seconds``).
        reading: Reading each compiled program (each one's: its report's ``analysis_seconds``).
        other: The rest (sending the step, waiting for the child, ranking).
        child_peak_bytes: The largest resident memory a child process reached (0 in this process).
        compiled: How many candidates were compiled (whole).
        samples: How many compiles of the step at small depths ranked them (a plan from a few
            layers; their time is in ``other``).
        children: How many child processes compiled them (0: compiled in this process). More
            than one where the first compile was long and the machine's cores and available
            memory (twice the first child's peak per child) held them side by side; one where
            not, as at 8 B unrolled on 24 GiB. A child started again after XLA aborted counts.
    """

    seconds: float = 0.0
    child_start: float = 0.0
    tracing: float = 0.0
    roles: float = 0.0
    bounds: float = 0.0
    compiles: float = 0.0
    reading: float = 0.0
    other: float = 0.0
    child_peak_bytes: int = 0
    compiled: int = 0
    children: int = 0
    samples: int = 0

    @classmethod
    def of(
        cls, ready: Prepared, progress: Progress, rows: Sequence[Any], seconds: float, samples: int = 0
    ) -> Timings:
        """A plan's timings from its preparation, its progress (the child's records) and its rows."""
        reports_ = [row.report for row in rows if row.report is not None]
        compiles = sum(report.compile_seconds for report in reports_)
        reading = sum(report.analysis_seconds for report in reports_)
        child = sum(progress.child_seconds)
        known = child + ready.trace_seconds + ready.roles_seconds + ready.bounds_seconds + compiles + reading
        prepared = (ready.trace_seconds, ready.roles_seconds, ready.bounds_seconds)
        left = max(seconds - known, 0.0)
        return cls(
            seconds,
            child,
            *prepared,
            compiles,
            reading,
            left,
            progress.child_peak_bytes,
            len(reports_),
            len(progress.child_seconds),
            samples,
        )
