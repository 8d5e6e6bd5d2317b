"""``plan``: compile a step under each candidate strategy and rank them by the step report.

Every candidate is a :class:`~einshard.strategies.Strategy`; its table and batch expression
give the step's arguments their shardings, and :func:`einshard._cost._step.reports` compiles the
step and reads what it costs (in this process for this machine's device count, else in one child
process with simulated CPU devices for all candidates). Ranking needs no recompile:
:meth:`Plan.at` ranks the same reports at other figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from .._arrays._leaves import nbytes
from .._cost._call import StepCall
from .._cost._child import KILLED
from .._cost._progress import Progress
from .._cost._report import StepReport, estimated, refuses_accelerator
from .._cost._step import reports, warn_if_only_catch_all
from .._cost._target import Figures, Hardware, Target, parse_target, resolve_figures
from .._language._errors import EinshardError
from .._language._expression import parse
from .._language._text import size_text
from .._sharding._devices import call_devices, count_to_plan
from .._trees._rules import RulesLike
from .._trees._strategy import DEFAULT_MIN_BYTES, Strategy, with_batch
from ._bounds import argument_bytes_per_device, bound_reason
from ._plan_text import plan_text
from ._roles import read_call
from ._strategies import derived_defaults

__all__ = ["Plan", "PlanRow", "plan"]

TIE = 0.02
"""Estimated step times within 2% of each other count as equal: the earlier candidate ranks first."""
SPLIT_ENOUGH = 0.5
"""A model-parallel candidate splitting less than this share of the parameter bytes says so."""


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One candidate of a :class:`Plan`.

    Attributes:
        strategy: The candidate (its rules and batch expression).
        report: The step report under it, estimated at the plan's figures, or ``None`` when
            the step could not be laid out or compiled under it.
        rejected: Why the candidate cannot be used (does not fit memory, does not divide),
            or ``None``.
        index: The candidate's position in the list given (ties go to the earlier one).
        split_share: The share of the parameters' bytes split over the candidate's model axis
            (tensor parallelism, hybrids), or over all devices (data parallel, FSDP: no model
            axis); ``None`` when its rules do not fit the parameters.
        unmatched_rules: The candidate's *unmatched* rules: those whose regex matches no path
            of the parameters (a layer name the model does not have, a typo; a catch-all never
            is one).
        argument_bytes: The bytes per device of the step's arguments as the candidate lays them
            out, when they alone exceeded the memory per device and the candidate was therefore
            not compiled (its ``report`` is ``None``); else ``None``.
    """

    strategy: Strategy
    report: StepReport | None
    rejected: str | None
    index: int = 0
    split_share: float | None = None
    unmatched_rules: tuple[Any, ...] = ()
    argument_bytes: int | None = None

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
        """Why, in a word or two; ``None`` when not rejected.

        ``'memory'``, ``'compile'``, ``'killed here'`` (this machine's memory ended its compile:
        no verdict on the step), ``'not compiled'`` (bounded out at other figures: see
        :meth:`Plan.at`) or ``'shapes'``.
        """
        if self.rejected is None:
            return None
        if self.rejected.startswith(_MEMORY):
            return "memory"
        if self.rejected.startswith(NOT_COMPILED_HERE):
            return "killed here"
        if self.rejected.startswith(_NOT_COMPILED_AT):
            return "not compiled"
        return "compile" if self.rejected.startswith("does not compile") else "shapes"

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
        network_bandwidth: Bytes per second per device across hosts, or ``None``.
        figures: The figures resolved once (the target's, with those given instead).
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

    tie: ClassVar[float] = TIE
    """Estimated step times within this share of each other count as equal."""

    @property
    def usable(self) -> tuple[PlanRow, ...]:
        """The candidates not rejected, best first."""
        return tuple(row for row in self.rows if row.rejected is None)

    @property
    def best(self) -> Strategy:
        """The winning strategy: its rules shard the parameters, ``.batch`` the batch.

        Raises:
            EinshardError: If every candidate was rejected.
        """
        usable = self.usable
        if not usable:
            reasons = "; ".join(f"{row.name}: {row.rejected}" for row in self.rows)
            raise EinshardError(
                f"no candidate strategy fits {self.n_devices} devices",
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
        latency: float | None = None,
        flops_per_second: float | None = None,
    ) -> Plan:
        """The same candidates ranked at other figures; no recompile.

        The figures not given are kept; a bandwidth given is every collective's (the target's
        network figure is dropped). Another target is another compile: ``plan(..., target=...)``.
        """
        figures = self.figures.at(
            bandwidth=bandwidth,
            latency=latency,
            flops_per_second=flops_per_second,
            memory_per_device=memory_per_device,
        )
        rows = [
            dataclasses.replace(row, rejected=_unfit(row.rejected))
            if row.argument_bytes is None
            else dataclasses.replace(row, rejected=_bounded_at(row.argument_bytes, figures.memory_per_device))
            for row in self.rows
        ]
        return _ranked(rows, self.n_devices, figures)

    def __str__(self) -> str:
        return plan_text(self)


@refuses_accelerator()
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
    isolate: bool = False,
    quiet: bool = False,
) -> Plan:
    """Compiles ``step(params, batch)`` under each candidate strategy and ranks them.

    Each candidate's rules shard ``params`` and its batch expression every array of
    ``batch``; the step is compiled for those shardings (nothing is allocated:
    ``ShapeDtypeStruct`` leaves will do) and its :func:`~einshard.explain_step` report gives
    the estimated time, the bytes moved and the peak memory per device. A candidate is
    rejected when its rules do not divide the shapes or the device count, or when its peak
    memory is above ``memory_per_device``.

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
            with a target: its NVLink or ICI figure, its network's across hosts).
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

    Returns:
        A :class:`Plan`; ``plan.best`` is the winning :class:`~einshard.strategies.Strategy`.

    Raises:
        EinshardError: If a candidate is not a Strategy, or the step or its arguments cannot
            cross into the child process, or the target is unknown or its compiler not installed.

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
    where = where_to_plan(
        target,
        n_devices,
        hardware,
        bandwidth=bandwidth,
        latency=latency,
        flops_per_second=flops_per_second,
        memory_per_device=memory_per_device,
        isolate=isolate,
    )
    figures, count = where.figures, where.count
    # The step is resolved and its arguments named and flattened once, here, for the roles
    # reader, every candidate's table and compile, and the split shares.
    call = StepCall.of(step, (params, batch), {})
    strategies = candidate_strategies(call, candidates, where, min_bytes)
    tables = [with_batch(strategy, call.batch_name) for strategy in strategies]
    # A candidate whose arguments alone exceed the memory is rejected before its compile.
    bounds = _over_memory(call, tables, count, figures.memory_per_device)
    kept = [i for i in range(len(tables)) if i not in bounds]
    with Progress("plan", [strategies[i].name for i in kept], quiet=quiet) as progress:
        kept_tables = [tables[i] for i in kept]
        compiled = reports(call, kept_tables, where.child, where.compiled_for, progress)
    answers: list[Any] = [None] * len(tables)
    for i, compiled_answer in zip(kept, compiled, strict=True):
        answers[i] = compiled_answer
    param_paths = [call.paths[i] for i in call.argument_leaves(0)]
    rows = []
    for index, (strategy, table, answer) in enumerate(zip(strategies, tables, answers, strict=True)):
        share = _split_share(strategy, call, table, count)
        unmatched = strategy.unmatched_rules(param_paths)
        if answer is None:  # bounded out: not compiled
            assert figures.memory_per_device is not None
            reason = bound_reason(bounds[index], figures.memory_per_device)
            rows.append(PlanRow(strategy, None, reason, index, share, unmatched, bounds[index]))
            continue
        rejected = None if answer.report is not None else _reason(answer.error)
        rows.append(PlanRow(strategy, answer.report, rejected, index, share, unmatched))
        if candidates is not None and answer.report is not None:  # a table the user wrote
            caller = f"plan (candidate {strategy.name!r})"
            warn_if_only_catch_all(strategy, answer.report, caller, relative_only=True)
    return _ranked(rows, count, figures)


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
    *,
    bandwidth: float | None,
    latency: float | None,
    flops_per_second: float | None,
    memory_per_device: int | None,
    isolate: bool,
) -> Where:
    """The target, figures and device count of a plan, and where its candidates compile.

    Raises:
        EinshardError: For a device count, target or figure that is not one.
    """
    given = count_to_plan(n_devices, hint="Give the device count to plan for, e.g. n_devices=64.")
    chosen = parse_target(target, n_devices)
    figures = resolve_figures(
        chosen,
        hardware,
        bandwidth=bandwidth,
        latency=latency,
        flops_per_second=flops_per_second,
        memory_per_device=memory_per_device,
    )
    if figures.hardware is not None:  # a GPU or TPU: its compiler, in a child
        return Where(chosen, figures, chosen.n_devices, chosen.n_devices, chosen)
    local = call_devices(None).count
    return Where(chosen, figures, given, given if isolate or given != local else None, None)


def candidate_strategies(
    call: StepCall, candidates: Sequence[Strategy] | None, where: Where, min_bytes: int
) -> list[Strategy]:
    """The candidates given (checked), or the defaults for the step, the device count and its hosts.

    Raises:
        EinshardError: If a candidate is not a :class:`Strategy`.
    """
    if candidates is None:
        hardware = where.figures.hardware
        per_host = hardware.devices_per_host if hardware is not None else None
        return derived_defaults(read_call(call), where.count, min_bytes, per_host)
    strategies = list(candidates)
    for candidate in strategies:
        if not isinstance(candidate, Strategy):
            raise EinshardError(
                f"a planner candidate must be a Strategy, not {type(candidate).__name__}",
                hint="Use einshard.strategies.fsdp() and friends, or wrap a table: "
                "einshard.strategies.Strategy(rules, batch='b ... -> b* ...', name='mine').",
            )
    return strategies


def _over_memory(
    call: StepCall, tables: Sequence[RulesLike], n_devices: int, memory_per_device: int | None
) -> dict[int, int]:
    """The candidates whose arguments alone exceed the memory per device, with those bytes, by index."""
    if memory_per_device is None:
        return {}
    over = {}
    for index, table in enumerate(tables):
        needed = argument_bytes_per_device(call, table, n_devices)
        if needed is not None and needed > memory_per_device:
            over[index] = needed
    return over


def _bounded_at(argument_bytes: int, memory_per_device: int | None) -> str:
    """A bounded-out candidate's rejection at other figures: still over the memory, or not compiled."""
    if memory_per_device is not None and argument_bytes > memory_per_device:
        return bound_reason(argument_bytes, memory_per_device)
    return (
        f"{_NOT_COMPILED_AT}: its arguments alone need {size_text(argument_bytes)} per device, over "
        "the memory it was planned with; plan again with this memory_per_device to compile it"
    )


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


def _reason(error: Any) -> str:
    if isinstance(error, EinshardError):
        where = f" ({error.context[0]})" if error.context else ""
        return f"does not fit the shapes or devices: {error.headline}{where}"
    if isinstance(error, str) and error.startswith(KILLED):
        return f"{NOT_COMPILED_HERE}: {error}"
    return f"does not compile: {error}"


_MEMORY = "does not fit memory"
_NOT_COMPILED_AT = "not compiled at the memory planned with"
NOT_COMPILED_HERE = "not compiled on this machine"
"""A candidate whose compile this machine could not finish (its memory): no verdict on the step."""


def _unfit(reason: str | None) -> str | None:
    """A rejection that does not depend on the figures (memory is decided again)."""
    return None if reason is not None and reason.startswith(_MEMORY) else reason


def _ranked(rows: list[PlanRow], n_devices: int, figures: Figures) -> Plan:
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
            needs, has = size_text(report.peak_bytes), size_text(memory_per_device)
            rejected = f"{_MEMORY}: needs {needs} > {has} per device"
        priced.append(dataclasses.replace(row, report=report, rejected=rejected))
    bandwidth = figures.bandwidth

    def measure(row: PlanRow) -> float:
        # Without a bandwidth the communication has no time: the bytes sent rank instead.
        seconds = row.seconds if bandwidth is not None else None
        return seconds if seconds is not None else float(row.traffic or 0)

    def key(row: PlanRow) -> tuple:
        return (measure(row), row.traffic or 0, row.peak_bytes or 0, row.index)

    usable = sorted((row for row in priced if row.rejected is None), key=key)
    rejected = sorted((row for row in priced if row.rejected is not None), key=key)
    # Estimates within TIE of the fastest left are not told apart: the earlier candidate (the
    # simpler strategy, in the default order) goes first.
    ranked: list[PlanRow] = []
    while usable:
        limit = measure(usable[0]) * (1 + TIE)
        pick = min((row for row in usable if measure(row) <= limit), key=lambda row: row.index)
        usable.remove(pick)
        ranked.append(pick)
    ranked += rejected
    return Plan(
        tuple(ranked),
        n_devices,
        memory_per_device,
        bandwidth,
        figures.latency,
        figures.flops_per_second,
        figures.target,
        figures.hardware,
        figures.network_bandwidth if bandwidth is not None else None,
        figures,
    )


def _meant_to_split(strategy: Strategy) -> bool:
    """Whether a table has a rule that splits (a per-leaf rule such as FSDP's, or a split axis)."""
    return any(
        not isinstance(rule.expression, str)
        or any(e.name is not None and (e.star or e.number > 1) for e in parse(rule.expression).right)
        for rule in strategy
    )
