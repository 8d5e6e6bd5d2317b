"""``plan``: compile a step under each candidate strategy and rank them by the step report.

Every candidate is a :class:`~einshard.strategies.Strategy`; its table and batch expression
give the step's arguments their shardings, and :func:`einshard._cost._step.reports` compiles the
step and reads what it costs (in this process for this machine's device count, else in one child
process with simulated CPU devices for all candidates). Ranking needs no recompile:
:meth:`Plan.at` ranks the same reports at other figures.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..._arrays._leaves import nbytes
from ..._cost._entry import entry_point
from ..._cost._step import warn_if_only_catch_all
from ..._cost.child._progress import Progress
from ..._cost.hardware._figures import Figures, Hardware
from ..._cost.report._report import StepReport, estimated, refuses_accelerator
from ..._language._errors import EinshardError
from ..._language._expression import parse
from ..._language._text import seconds_text, size_text
from ..._tracing._call import StepCall
from ..._trees._rules import RulesLike
from ..._trees._strategy import DEFAULT_MIN_BYTES, Strategy
from ._bounds import Bounds
from ._candidates import (
    CANNOT_WIN,
    FROM_LAYERS,
    MEMORY,
    NOT_COMPILED,
    TIE,
    Rejection,
    Timings,
    bounded_over,
    cannot_win,
    compile_in_order,
    over_memory,
    prepared,
    rejection_of,
    tie_ranked,
    where_to_plan,
)
from ._plan_text import plan_text
from ._sampled import DEPTHS, Extrapolated, cannot_win_sampled, compile_sampled, layers_to_sample

__all__ = ["Plan", "PlanRow", "plan"]

SPLIT_ENOUGH = 0.5
"""A model-parallel candidate splitting less than this share of the parameter bytes says so."""


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One candidate of a :class:`Plan`.

    Attributes:
        strategy: The candidate (its rules and batch expression).
        report: The step report under it, estimated at the plan's figures, or ``None`` when
            the step was not compiled under it, or could not be laid out or compiled.
        rejected: Why the candidate cannot be used, or ``None``: a :class:`Rejection
            <einshard._planning.search._candidates.Rejection>`, a ``str`` whose ``kind`` says why
            (``'memory'``, ``'shapes'``, ``'compile'``, ``'killed here'``, ``'cannot win'``,
            ``'budget'``, ``'not compiled'``, ``'sampled'``) and whose text says it in full.
        index: The candidate's position in the list given (ties go to the earlier one).
        split_share: The share of the parameters' bytes split over the candidate's model axis
            (tensor parallelism, hybrids), or over all devices (data parallel, FSDP: no model
            axis); ``None`` when its rules do not fit the parameters.
        unmatched_rules: The candidate's *unmatched* rules: those whose regex matches no path
            of the parameters (a layer name the model does not have, a typo; a catch-all never
            is one).
        bounds: What the candidate needs at least, known before compiling it (its arguments'
            bytes per device, its memory and step time at least), or ``None`` when its table
            does not fit the arguments.
        extrapolated: Its step time and peak extrapolated from compiles of the step at two
            small depths (a plan from a few layers: see ``plan(sample=...)``), or ``None``.
    """

    strategy: Strategy
    report: StepReport | None
    rejected: str | None
    index: int = 0
    split_share: float | None = None
    unmatched_rules: tuple[Any, ...] = ()
    bounds: Bounds | None = None
    extrapolated: Extrapolated | None = None

    @property
    def argument_bytes(self) -> int | None:
        """The step's arguments' bytes per device under the candidate, when it was not compiled for memory.

        Its bounds (the arguments, with the outputs' and activations' floors) exceed the memory
        per device; else ``None``.
        """
        rejected = self.rejected
        if (
            self.report is None
            and isinstance(rejected, Rejection)
            and rejected.kind == MEMORY
            and not rejected.compiled
        ):
            return None if self.bounds is None else self.bounds.argument_bytes
        return None

    @property
    def model_parallel(self) -> bool:
        """Whether the candidate has a model axis (tensor parallelism or a hybrid)."""
        return self.strategy.model is not None

    @property
    def splits_little(self) -> bool:
        """A candidate meant to split the parameters (tensor parallel, hybrids, FSDP) that splits little.

        Less than half of their bytes: its verdict says ``'splits only N%'``, so that it does not
        pass for data parallel.
        """
        return (
            (self.model_parallel or _meant_to_split(self.strategy))
            and self.split_share is not None
            and self.split_share < SPLIT_ENOUGH
        )

    @property
    def rejected_for(self) -> str | None:
        """Why, in a word or two (the rejection's ``kind``); ``None`` when not rejected.

        ``'memory'``, ``'shapes'``, ``'compile'``, ``'killed here'`` (this machine's memory ended
        its compile: no verdict on the step), ``'cannot win'`` (its bound is slower than a
        candidate compiled: not compiled), ``'sampled'`` (its time extrapolated from compiles at
        two small depths cannot beat the winner: not compiled whole), ``'budget'`` (``max_seconds``
        was spent first) or
        ``'not compiled'`` (ranked at other figures than it was planned with: see :meth:`Plan.at`);
        ``'rejected'`` for a reason given as plain text.
        """
        if self.rejected is None:
            return None
        return self.rejected.kind if isinstance(self.rejected, Rejection) else "rejected"

    @property
    def name(self) -> str:
        """The strategy's name."""
        return self.strategy.name

    @property
    def seconds(self) -> float | None:
        """Estimated step time: the report's (:attr:`StepReport.seconds`): simulated on a target."""
        return None if self.report is None else self.report.seconds

    @property
    def peak_bytes(self) -> int | None:
        """Memory per device at the peak, from the compiled program."""
        return None if self.report is None else self.report.peak_bytes

    @property
    def traffic(self) -> int | None:
        """Bytes each device sends per step (ring formulas)."""
        return None if self.report is None else self.report.traffic

    @property
    def bytes_by_kind(self) -> dict[str, int]:
        """The collectives' bytes per device per step, by kind."""
        return {} if self.report is None else dict(self.report.bytes_by_kind)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Candidate strategies for one step, best first; ``print(plan)`` shows a table and a chart.

    The figures are estimates. With a GPU or TPU target, each candidate's step time is
    simulated from the program its compiler made (kernels in order, async collectives beside
    them). On CPU devices, communication from the program's collectives by the ring formulas at
    the given bandwidth and latency plus XLA's flop count at the given FLOP/s, without overlap.
    Memory from XLA's memory analysis of the program.

    Attributes:
        rows: One :class:`PlanRow` per candidate: the usable ones by estimated step time (by
            bytes sent without a bandwidth; times within 2% count as equal, and then the
            candidate given first, the simpler strategy in the default order, ranks first),
            the rejected ones after them.
        n_devices: The device count planned for.
        memory_per_device: The memory limit, or ``None``.
        bandwidth: Bytes per second per device, or ``None``.
        latency: Seconds per ring step.
        flops_per_second: FLOP/s per device the compute estimate assumes, or ``None``.
        target: What the candidates were compiled for (``'cpu'``, ``'h100'``, ``'v5e'`` ...).
        hardware: The target's figures (:class:`~einshard.Hardware`), or ``None`` on CPU devices.
        network_bandwidth: Bytes per second one NIC sends across hosts, or ``None``.
        figures: The figures resolved once (the target's, with those given instead).
        timings: Where the plan's time went (:class:`~einshard._planning.search._candidates.Timings`):
            the child process's start, tracing the step, reading its roles, each compile and
            reading each program; and the child's peak memory.
        sampling: How the candidates were ranked when the plan could sample the step's layers,
            or was asked to (``sample=True``): from compiles at two small depths, or why they were
            compiled whole (one line of the footer); ``None`` otherwise.
    """

    rows: tuple[PlanRow, ...]
    n_devices: int
    memory_per_device: int | None
    bandwidth: float | None
    latency: float
    flops_per_second: float | None
    target: str = "cpu"
    hardware: Hardware | None = dataclasses.field(default=None, repr=False)
    network_bandwidth: float | None = None
    figures: Figures = dataclasses.field(default_factory=Figures, repr=False)
    timings: Timings = dataclasses.field(default_factory=Timings, repr=False)
    sampling: str | None = None

    tie: ClassVar[float] = TIE
    """Estimated step times within this share of each other count as equal."""

    @property
    def usable(self) -> tuple[PlanRow, ...]:
        """The candidates not rejected, best first."""
        return tuple(row for row in self.rows if row.rejected is None)

    @property
    def compiled(self) -> tuple[PlanRow, ...]:
        """The candidates that have a step report (compiled; usable or over the memory)."""
        return tuple(row for row in self.rows if row.report is not None)

    @property
    def headline(self) -> str | None:
        """What the plan's first line says when no candidate can be used, else ``None``."""
        if self.usable:
            return None
        count = len(self.rows)
        if not self._fits_nothing:
            return (
                f"No candidate compiled: all {count} were rejected before or while compiling "
                "(the reasons below); nothing is ranked."
            )
        return (
            f"No candidate fits {self.n_devices} devices: all {count} need more memory than there is, "
            f"{len(self.compiled)} of them compiled (the reasons below); nothing is ranked."
        )

    @property
    def _fits_nothing(self) -> bool:
        """Whether memory rejected every candidate, or some compiled and none fits."""
        return bool(self.compiled) or all(row.rejected_for == MEMORY for row in self.rows)

    @property
    def best(self) -> Strategy:
        """The winning strategy: its rules shard the parameters, ``.batch`` the batch.

        Raises:
            EinshardError: If every candidate was rejected: none compiled, or none fits.
        """
        usable = self.usable
        if not usable:
            reasons = "; ".join(f"{row.name}: {row.rejected}" for row in self.rows)
            what = "fits" if self._fits_nothing else "compiled for"
            raise EinshardError(
                f"no candidate strategy {what} {self.n_devices} devices",
                hint="Give more memory_per_device or devices, or other candidates (a hybrid with a "
                "larger model axis, fsdp with a smaller min_bytes).",
                context=[f"rejected: {reasons}"] if reasons else [],
            )
        return usable[0].strategy

    @refuses_accelerator()
    def at(
        self,
        *,
        memory_per_device: int | None = None,
        bandwidth: float | None = None,
        flops_per_second: float | None = None,
        latency: float | None = None,
    ) -> Plan:
        """The same candidates ranked at other figures; no recompile.

        The figures not given are kept; a bandwidth given is every collective's (the target's
        NICs are dropped: one link, within and across hosts). Another target is another compile:
        ``plan(..., target=...)``. A candidate left uncompiled (its bounds over the memory, or
        slower than the winner) has no program to rank: at figures where its bounds no longer
        reject it, its row says to plan again with them.
        """
        figures = self.figures.at(
            memory_per_device=memory_per_device,
            bandwidth=bandwidth,
            flops_per_second=flops_per_second,
            latency=latency,
        )
        changed = figures != self.figures
        rows = [dataclasses.replace(row, rejected=_rejected_at(row, figures, changed)) for row in self.rows]
        return _ranked(rows, self.n_devices, figures, self.timings, self.sampling)

    def __str__(self) -> str:
        return plan_text(self)


@entry_point()
def plan(
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
    exhaustive: bool = False,
    max_seconds: float | None = None,
    sample: bool = False,
) -> Plan:
    """Compiles ``step(params, batch)`` under each candidate strategy and ranks them.

    Each candidate's rules shard ``params`` and its batch expression every array of
    ``batch``; the step is compiled for those shardings (nothing is allocated:
    ``ShapeDtypeStruct`` leaves will do) and its :func:`~einshard.explain_step` report gives
    the estimated time, the bytes moved and the peak memory per device. A candidate is
    rejected when its rules do not divide the shapes or the device count, or when its peak
    memory is above ``memory_per_device``.

    Before compiling, each candidate gets lower bounds from the step's jaxpr and its layouts:
    its memory (the arguments as it lays them out, optimizer state included, with a floor for
    the outputs and activations) and its step time (its dots at the matrix units' rate, and the
    gradients its layout must sum over devices). A candidate whose memory bound is over the
    memory is not compiled; the others compile most promising first (the fastest bound first),
    and one whose time bound is slower than the best estimate so far (beyond the 2% within which
    times count as equal) is left uncompiled: it cannot win. Its row says so, with its bound.

    The rules match paths with the step's parameter name in front, as in
    :func:`~einshard.explain_step` (``params/layers/0/kernel``): anchor your own rules with
    ``(^|/)``, not ``^``.

    Args:
        step: The training step, ``step(params, batch)`` (see :func:`~einshard.explain_step`).
        params: The parameters (and optimizer state, if the step takes them together).
        batch: The batch: an array or a pytree of arrays, the batch axis first.
        n_devices: The device count to plan for (default: this machine's). Another count is
            compiled in one child process with that many simulated CPU devices (or devices of
            the ``target``).
        memory_per_device: Bytes each device has; candidates that need more are rejected
            (default with a target: its device's memory).
        bandwidth: Bytes per second each device sends, for the communication estimate (default
            with a target: its NVLink or ICI figure, its hosts' NICs across hosts).
        latency: Seconds per step of a ring algorithm (default: 0, or the target's per link).
        flops_per_second: FLOP/s per device the compute estimate assumes; with a target, the
            rate every dot runs at instead of its matrix units' per element type.
        candidates: The strategies to try; default data parallel, FSDP, tensor parallel and
            a hybrid for every factorization of the device count (:func:`strategies.defaults
            <einshard.strategies.defaults>`), and HSDP for a GPU target over several hosts.
        min_bytes: FSDP's and the hybrids' ``min_bytes`` in the default candidates.
        target: What to compile each candidate for: ``'cpu'`` (the default), a GPU (``'h100'``
            ...) or a TPU (``'v5e'`` ...), as for :func:`~einshard.explain_step`; with a target
            the candidates rank by the step time simulated from each one's program.
        slices: With a TPU target: how many slices the ``n_devices`` chips are, each of
            ``n_devices / slices`` (or the slice named, ``'v5e:4x4'``), joined by the data-center
            network (MaxText's ``num_slices``); collectives between slices run at DCN's rate.
        hardware: Figures of the target to use instead of its own, by name (see
            :class:`~einshard.Hardware`).
        isolate: Compile the candidates in a child process for this machine's device count
            too. XLA aborts the process on some layouts (a failed check in its partitioner, not
            an exception); in a child, such a candidate is rejected ("XLA aborted the process
            compiling it") and the others are compiled in a new child. Another ``n_devices``
            is always compiled that way.
        quiet: Show no progress. A plan that runs over 10 seconds shows which candidate it is
            compiling, how many are done and left, and their times, on standard error
            (``rich``'s bar on a terminal, else plain lines).
        donate: Compile a step that returns its first argument updated (``params``, or a train
            state) with it donated, as a training loop runs it (see
            :func:`~einshard.explain_step`); ``False`` compiles every candidate without.
        exhaustive: Compile every candidate that fits the memory, even those that cannot win
            (to see their figures).
        max_seconds: Stop compiling when this many seconds have passed (a compile that has
            started runs to its end): the candidates compiled are ranked, the others are
            named with their bounds (``'budget'``). Default: no limit.
        sample: Compile each candidate first at 2 and 3 of the step's repeated layers (an
            unrolled model's, found in its program, 4 or more; the plan says why not otherwise),
            then whole in the order of their extrapolated times, leaving out (on CPU
            devices) those whose extrapolated time is slower than a whole compile's (see "Plans from a few
            layers" in the strategies guide). Every row ranked is a whole compile's.

    Returns:
        A :class:`Plan`; ``plan.best`` is the winning :class:`~einshard.strategies.Strategy`.

    Raises:
        EinshardError: If ``candidates`` is empty or holds something that is not a Strategy,
            ``max_seconds`` is not a positive number, the step or its arguments cannot cross
            into the child process, or the target is unknown or its compiler not installed.

    >>> import jax, jax.numpy as jnp, einshard
    >>> def step(params, batch):
    ...     grads = jax.grad(lambda p: jnp.sum((batch @ p['w']) ** 2))(params)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    >>> params = {'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    >>> batch = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    >>> result = einshard.plan(step, params, batch, bandwidth=100e9, flops_per_second=1e12,
    ...                        candidates=[einshard.strategies.data_parallel(),
    ...                                    einshard.strategies.tensor_parallel(column=['w'])])
    >>> result.best.name, result.best.batch
    ('data parallel', 'b ... -> b* ...')
    """
    started = time.perf_counter()
    budget = _checked_seconds(max_seconds)
    if not isinstance(sample, bool):  # "no" is truthy: bool() would sample where the user asked not to
        raise EinshardError(
            f"sample= takes True or False, not {sample!r} ({type(sample).__name__}).",
            hint="sample=True compiles each candidate at 2 and 3 of the step's repeated layers first; "
            "the default, False, compiles each whole.",
        )
    where = where_to_plan(
        target, n_devices, hardware, bandwidth, latency, flops_per_second, memory_per_device, isolate, slices
    )
    figures, count = where.figures, where.count
    # The step is resolved and its arguments named and flattened once, here, for the roles
    # reader, every candidate's table and compile, and the split shares.
    call = StepCall.of(step, (params, batch), {}).donating(donate)
    ready = prepared(call, candidates, where, min_bytes)
    strategies, tables, bounds = ready.strategies, ready.tables, ready.bounds
    layers, sampling = layers_to_sample(call, sample, exhaustive)
    memory = figures.memory_per_device
    over = {
        i: bounded_over(bound, memory)
        for i, bound in enumerate(bounds)
        if bound is not None and memory is not None and bound.memory_bytes > memory
    }
    names = [strategy.name for strategy in strategies]

    def estimate(answer: Any) -> float | None:
        """What ranks a compiled candidate, or ``None`` when it cannot be used."""
        if answer.report is None:
            return None
        report = estimated(answer.report, figures)
        if memory is not None and report.peak_bytes is not None and report.peak_bytes > memory:
            return None
        return _measure(report, figures)

    with Progress("plan", names, quiet=quiet) as progress:
        for i, rejection in over.items():
            progress.left_out(i, rejection.kind)
        extrapolated: dict[int, Extrapolated] = {}
        samples = 0
        ordered = (call, tables, bounds, over, where, progress)  # what both ways of compiling take
        if layers is not None:
            at = functools.partial(_figures_at, figures=figures)
            answers, extrapolated, left, samples = compile_sampled(*ordered, at, layers, max_seconds=budget)
        else:
            answers, left = compile_in_order(*ordered, estimate, exhaustive=exhaustive, max_seconds=budget)
    param_paths = [call.paths[i] for i in call.argument_leaves(0)]
    rows = []
    for index, (strategy, table) in enumerate(zip(strategies, tables, strict=True)):
        share = _split_share(strategy, call, table, count)
        unmatched = strategy.unmatched_rules(param_paths)
        answer = answers.get(index)
        sampled = extrapolated.get(index)
        if answer is None:  # not compiled: over the memory, cannot win, or out of time
            rejected = over.get(index) or left.get(index)
            if rejected is None:  # ranked from its samples (its winner named below)
                assert sampled is not None, "a candidate neither compiled nor left"
                rejected = cannot_win_sampled(sampled, None)
            rows.append(PlanRow(strategy, None, rejected, index, share, unmatched, bounds[index], sampled))
            continue
        rejected = None if answer.report is not None else rejection_of(answer.error)
        rows.append(
            PlanRow(strategy, answer.report, rejected, index, share, unmatched, bounds[index], sampled)
        )
        if candidates is not None and answer.report is not None:  # a table the user wrote
            caller = f"plan (candidate {strategy.name!r})"
            warn_if_only_catch_all(strategy, answer.report, caller, relative_only=True)
    timings = Timings.of(ready, progress, rows, time.perf_counter() - started, samples)
    if layers is not None:
        whole = sum(1 for row in rows if row.report is not None)
        sampling = (
            f"Sampled: each candidate compiled at {DEPTHS[0]} and {DEPTHS[1]} of the step's {layers} "
            f"repeated layers first ({samples} small compiles), then {whole} whole, in the order of their "
            "extrapolated times; ranked from the whole compiles only."
        )
    ranked = _ranked(rows, count, figures, timings, sampling)
    return dataclasses.replace(ranked, rows=_winner_named(ranked.rows))


def _checked_seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise EinshardError(
            f"max_seconds must be a positive number of seconds, not {value!r}",
            hint="Give how long the plan may compile, e.g. max_seconds=300 (five minutes), or leave it out.",
        )
    return float(value)


def _measure(report: StepReport, figures: Figures) -> float:
    """What ranks a report: the step time with a bandwidth, else the bytes each device sends."""
    seconds = report.seconds if figures.bandwidth is not None else None
    return seconds if seconds is not None else float(report.traffic or 0)


def _figures_at(report: StepReport, figures: Figures) -> tuple[float, float, int | None, str]:
    """A compile's (measure, what it needs at least, peak, what that is) at the plan's figures.

    The least is a line in the depth: on CPU devices its time (communication plus compute),
    without a bandwidth its bytes sent. On a target, nothing: its kernels' time is not a line at
    small depths (on a v5e, 79 % above the whole compile's at 6 layers), so no sample leaves it out.
    """
    priced = estimated(report, figures)
    measure = _measure(priced, figures)
    if priced.simulated_seconds is not None:
        return measure, 0.0, priced.peak_bytes, "nothing proven on a target"
    return (
        measure,
        measure,
        priced.peak_bytes,
        "its step time" if figures.bandwidth is not None else "its bytes",
    )


def _winner_named(rows: tuple[PlanRow, ...]) -> tuple[PlanRow, ...]:
    """The candidates left uncompiled because they cannot win, named against the plan's winner.

    The winner is within the tie band of the fastest compiled, and each of those was compared
    with a compiled one no slower than the fastest: it cannot beat the winner either.
    """
    winner = next((row for row in rows if row.rejected is None), None)
    if winner is None:
        return rows
    return tuple(
        dataclasses.replace(row, rejected=cannot_win(winner.name, row.bounds.seconds, row.bounds.traffic))
        if isinstance(row.rejected, Rejection) and row.rejected.kind == CANNOT_WIN and row.bounds is not None
        else dataclasses.replace(row, rejected=cannot_win_sampled(row.extrapolated, winner.name))
        if isinstance(row.rejected, Rejection)
        and row.rejected.kind == FROM_LAYERS
        and row.extrapolated is not None
        else row
        for row in rows
    )


def _rejected_at(row: PlanRow, figures: Figures, changed: bool) -> str | None:
    """A row's rejection at other figures: memory is decided again; what was not compiled says so."""
    rejected = row.rejected
    if not isinstance(rejected, Rejection):
        return rejected
    if rejected.kind == MEMORY and rejected.compiled:
        # Decided again from its report; one the compiler refused for memory has none, and stays.
        return None if row.report is not None else rejected
    bounds = row.bounds
    memory = figures.memory_per_device
    if rejected.kind == MEMORY and bounds is not None:
        if memory is not None and bounds.memory_bytes > memory:
            return bounded_over(bounds, memory)
        return Rejection(
            NOT_COMPILED,
            f"at the memory planned with: it needs at least {size_text(bounds.memory_bytes)} per device, "
            "over the memory it was planned with; plan again with this memory_per_device to compile it",
        )
    if rejected.kind == FROM_LAYERS and changed:
        return Rejection(
            NOT_COMPILED,
            "at the figures planned with: ranked from its layers there, it could not beat the winner; "
            "plan again with these figures to rank it",
        )
    if rejected.kind == CANNOT_WIN and changed and bounds is not None:
        least = seconds_text(bounds.seconds) if bounds.seconds is not None else size_text(bounds.traffic)
        return Rejection(
            NOT_COMPILED,
            f"at the figures planned with: it could not beat the winner there (at least {least}); "
            "plan again with these figures to compile it",
        )
    return rejected


def _split_share(strategy: Strategy, call: StepCall, table: RulesLike, n_devices: int) -> float | None:
    """The share of ``params``' bytes the strategy splits over its model axis (as ``table``: with the batch).

    A leaf counts when the devices of one model group (``model`` neighbours in the device
    order) hold different blocks of it along an axis that the data groups do not split too:
    a weight split over all devices (FSDP inside a hybrid) is not split over the model axis.
    Without a model axis (data parallel, FSDP), the share split over all devices. The leaves'
    layouts are the compile's (one assignment per table: :meth:`StepCall.assigned`); ``None``
    when the table does not fit the arguments.
    """
    assignment = call.fitted(table, n_devices)
    if assignment is None:
        return None
    model = strategy.model or n_devices
    if n_devices % model:
        return None
    groups = n_devices // model
    seen: dict[int, bool] = {}
    total = split = 0
    for i in call.argument_leaves(0):
        leaf = assignment.leaves[i][1]
        if leaf is None or not leaf.shape:
            continue
        size = nbytes(leaf.shape, leaf.dtype)
        total += size
        layout = leaf.layout
        known = seen.get(id(layout))
        if known is None:
            within = [layout.block_index(position) for position in range(model)]
            across = [layout.block_index(group * model) for group in range(groups)]
            known = any(
                len({block[axis] for block in within}) > 1
                and (strategy.model is None or len({block[axis] for block in across}) == 1)
                for axis in range(len(leaf.shape))
            )
            seen[id(layout)] = known
        split += size if known else 0
    return split / total if total else 0.0


def _ranked(
    rows: list[PlanRow],
    n_devices: int,
    figures: Figures,
    timings: Timings | None = None,
    sampling: str | None = None,
) -> Plan:
    memory_per_device = figures.memory_per_device
    priced = []
    for row in rows:
        report = row.report
        if report is not None:
            report = estimated(report, figures)
        rejected = row.rejected
        if (
            rejected is None
            and memory_per_device is not None
            and report is not None
            and report.peak_bytes is not None
            and report.peak_bytes > memory_per_device
        ):
            rejected = over_memory(report.peak_bytes, memory_per_device)
        priced.append(dataclasses.replace(row, report=report, rejected=rejected))

    def measure(row: PlanRow) -> float:
        return _measure(row.report, figures) if row.report is not None else 0.0

    def key(row: PlanRow) -> tuple:
        return (measure(row), row.traffic or 0, row.peak_bytes or 0, row.index)

    usable = tie_ranked((row for row in priced if row.rejected is None), measure, lambda row: row.index)
    rejected = sorted((row for row in priced if row.rejected is not None), key=key)
    return Plan(
        (*usable, *rejected),
        n_devices,
        memory_per_device,
        figures.bandwidth,
        figures.latency,
        figures.flops_per_second,
        figures.target,
        figures.hardware,
        figures.network_bandwidth if figures.bandwidth is not None else None,
        figures,
        timings if timings is not None else Timings(),
        sampling,
    )


def _meant_to_split(strategy: Strategy) -> bool:
    """Whether a table has a rule that splits (a per-leaf rule such as FSDP's, or a split axis)."""
    return any(
        not isinstance(rule.expression, str)
        or any(e.name is not None and (e.star or e.number > 1) for e in parse(rule.expression).right)
        for rule in strategy
    )
