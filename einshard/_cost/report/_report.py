"""The step report: its rows, totals, estimates (each collective's time from the links' model) and table."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from ..._language._errors import EinshardError
from ..._tracing._loops import LoopNote
from ..hardware._figures import Figures, Hardware
from ..hardware._links import spanned_hosts
from ..hardware._target import FROM_SOURCE, GPU_EXTRA, GPUS, TPU_EXTRA, TPUS
from ..hardware._timing import Rates, Schedule, collectives_of, simulate, unknown_loops
from ..xla._hlo import KINDS
from ._report_text import finding_headline, findings_text, report_text

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "KINDS",
    "Finding",
    "StepReport",
    "StepRow",
    "estimated",
    "refuses_accelerator",
    "report_of",
]


def refuses_accelerator(*, step_kwargs: bool = False) -> Callable[[_F], _F]:
    """A decorator: ``accelerator=`` raises the error naming ``target=``.

    The parameter is gone from the signature (``functools.wraps``: ``inspect.signature`` shows
    the function's own); an old call still learns what to write instead. With ``step_kwargs``
    (``explain_step``, whose other keywords go to the step, its first argument) the keyword is
    refused only when the step takes no ``accelerator`` of its own. The entry points get it
    through :func:`~einshard._cost._entry.entry_point`; ``.at()`` takes it alone.
    """

    def decorator(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if "accelerator" in kwargs and not (step_kwargs and args and _takes_accelerator(args[0])):
                _accelerator_error(kwargs["accelerator"])
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator


def _takes_accelerator(step: Any) -> bool:
    """Whether a step takes an ``accelerator`` keyword (by name, or any keyword)."""
    if isinstance(step, str):
        from ..._tracing._call import resolve_step  # a 'module:function' step, imported to be asked

        try:
            step = resolve_step(step)
        except EinshardError:
            return False
    try:
        parameters = inspect.signature(getattr(step, "__wrapped__", step)).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell: the keyword goes to the step, as any other
    return any(p.name == "accelerator" or p.kind == p.VAR_KEYWORD for p in parameters)


def _accelerator_error(accelerator: Any) -> NoReturn:
    names = ", ".join(repr(name) for name in (*GPUS, *TPUS))
    raise EinshardError(
        f"accelerator={accelerator!r} is gone: give target= instead",
        hint=f"target= with n_devices= compiles the step with that hardware's own XLA compiler, on this "
        f"machine; the targets: {names}. Their compilers: pip install '{GPU_EXTRA}' or '{TPU_EXTRA}' "
        f"{FROM_SOURCE}.",
    )


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One collective of a compiled step (one array of a combined collective).

    Attributes:
        kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
            ``collective-permute``.
        dtype: The element type, as XLA names it (``f32``, ``bf16``, ...).
        shape: The array's shape on each device: the result of an all-gather, the input of a
            reduce-scatter, the array of the others.
        bytes: The bytes of that array on each device, per run.
        group_size: How many devices take part in each group.
        axes: The mesh axes the groups run over (``None`` when they are not whole axes).
        times: How many times it runs per step (a loop body: its trip count).
        times_known: False when it is inside a loop whose trip count XLA does not know
            (counted once).
        traffic: The bytes each device sends per step, by the ring formula, over all runs.
        seconds: The estimated time over all runs on the links the report assumes (the
            arrays of a combined collective share its runs' time by their bytes), or ``None``
            without a bandwidth.
        phase: ``forward``, ``backward``, ``optimizer`` or ``""``, from JAX's op name.
        op_name: JAX's name of the operation it serves.
        source: ``file:line`` of the user code, or ``None``.
        param: The path of the parameter it gathers or whose gradient it reduces, or ``None``.
        instruction: The HLO instruction (rows of one combined collective share it).
        hosts: How many hosts the devices of its widest group are on, by the links' model (1 on
            CPU devices and TPU slices, and before an estimate); a collective across hosts runs on
            their NICs.
        groups: The device groups it runs over, as device ids (a permute: the devices each
            chain of its pairs joins): what its time is asked of the links with (``()`` in a row
            made by hand: one group of ``group_size`` devices, from id 0).
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    axes: tuple[str, ...] | None
    times: int
    times_known: bool
    traffic: int
    seconds: float | None
    phase: str
    op_name: str
    source: str | None
    param: str | None
    instruction: str
    hosts: int = 1
    groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), repr=False)

    @property
    def total_bytes(self) -> int:
        """``bytes * times``: the array's bytes over all runs of the step."""
        return self.bytes * self.times


@dataclasses.dataclass(frozen=True)
class Finding:
    """Waste in a compiled step: what it costs beyond the better program, where, why, and the fix.

    Attributes:
        kind: ``'repeated'``, ``'unsummed'``, ``'sliced all-reduce'``, ``'copied'``,
            ``'reshard'``, ``'rematerialization'``, ``'activations gathered over the batch'``,
            ``'activations reduced in a loop'`` or ``'activations gathered in place of weights'``
            (see the "What does my table cost?" page).
        bytes: The bytes each device sends per step beyond the better program (ring formulas).
        memory_bytes: The bytes each device holds beyond the better program (``'copied'``).
        params: The parameter paths concerned (where the data flow names them).
        sources: The ``file:line`` of the code concerned.
        cause: One sentence: what happens.
        fix: One sentence: what to change.
        rows: The positions in the report's rows of the collectives concerned.
    """

    kind: str
    bytes: int
    memory_bytes: int
    params: tuple[str, ...]
    sources: tuple[str, ...]
    cause: str
    fix: str
    rows: tuple[int, ...]

    @property
    def cost(self) -> int:
        """The larger of the bytes sent and the bytes held: what ranks findings."""
        return max(self.bytes, self.memory_bytes)

    def headline(self) -> str:
        """``kind: +X sent per device per step (params) at sources``."""
        return finding_headline(self)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one compiled step costs on each device; ``str(report)`` is a table.

    The totals are sums over :attr:`rows` (``total_bytes`` of each row, ``traffic``,
    ``seconds``), so a row's share is its part of them.

    Attributes:
        rows: One :class:`StepRow` per collective (per array of a combined one), program order.
        n_devices: The device count the step was compiled for.
        mesh: The mesh the groups are read onto, as ``((axis, size), ...)``.
        collectives: How many collective instructions run (a combined one counts once).
        bytes: The bytes of all collectives' arrays per device per step (``sum(row.total_bytes)``).
        bytes_by_kind: ``bytes``, by kind.
        traffic: The bytes each device sends per step (ring formulas).
        flops: Floating-point operations per device per step (XLA's cost analysis), or ``None``.
        argument_bytes: Per device: the arguments' buffers.
        output_bytes: The outputs' buffers.
        alias_bytes: Output bytes that reuse (donated) argument buffers.
        temp_bytes: Temporaries at the peak.
        peak_bytes: ``argument + output - alias + temp``: memory per device at the peak.
        bandwidth: Bytes per second per device the estimate assumes, or ``None``.
        latency: Seconds per step of a ring algorithm the estimate assumes.
        flops_per_second: Peak FLOP/s per device for the compute estimate, or ``None``.
        communication_seconds: Estimated communication time per step (sum of the rows), or ``None``.
        compute_seconds: ``flops / flops_per_second``, or ``None``.
        compile_seconds: How long lowering and compiling took.
        analysis_seconds: How long reading the program, attributing the rows and finding the
            waste took.
        findings: The waste in the step (:class:`Finding`), the costliest first.
        target: What the step was compiled for: ``'cpu'`` (simulated CPU devices), a GPU
            (``'h100'``) or a TPU generation (``'v5e'``); the rows, bytes, findings and memory
            are that compiler's.
        topology: The target's topology (``'1x8x8'``, ``'v5e:2x4'``, ``'2 slices of v5e:2x4'``), or
            ``None`` on CPU devices.
        hardware: The target's figures (:class:`~einshard.Hardware`), with their sources, or
            ``None`` on CPU devices.
        flops_source: Where :attr:`flops` comes from when the compiled program has no cost
            analysis (a compile-only device's), or ``None``: from the program itself.
        network_bandwidth: Bytes per second one NIC sends to other hosts, for the rows whose
            groups span hosts, or ``None``: every row at :attr:`bandwidth`.
        unmatched_rules: The patterns of the ``rules=`` that matched no path of the step's
            arguments (``params/layers/0/kernel``, ``batch``), as :func:`~einshard.explain` lists
            them: a rule written for ``shard_pytree``'s paths and anchored with ``^`` is one.
        relative_rules: Those of them that match a path below an argument's name
            (``layers/0/kernel``, as ``shard_pytree(params, rules)`` sees it): anchored with
            ``^``, they miss the step's paths; ``(^|/)`` matches both.
        figures: The figures the estimate was made at
            (:func:`~einshard._cost.hardware._figures.resolve_figures`).
        schedule: The target program's kernels and collectives in the order they run (what the
            step time is simulated from), or ``()`` on CPU devices.
        simulated_seconds: The simulated step time of a GPU or TPU target's program, or ``None``.
        exposed_seconds: Communication the kernels do not cover (simulated), or ``None``.
        hidden_seconds: Communication that runs while kernels do (simulated), or ``None``.
        kernels: The kernels that take the most time: ``(instruction, source, seconds)``.
        batch_loops: The step's loops whose carry comes from the batch (a scanned model's layers), each
            with its source line and whether its carry is kept in the batch's layout, and by whose
            constraint (einshard's under a strategy that splits the batch:
            :func:`~einshard.constrain_loops`; the model's own :func:`~einshard.like_batch`, under
            any table), or why not.
        donated: The name of the argument the compile donated because the step returns it
            updated (``'state'``, ``'params'``), or ``None`` (see ``donate=``).
        padded_gathers: The positions in :attr:`rows` of all-reduces that gather: each of the
            ``n`` devices adds zeros but for its own ``1/n`` of the array (as XLA's TPU compiler
            gathers FSDP's weights on 64 chips). They are costed as the all-reduces they are.
    """

    rows: tuple[StepRow, ...]
    n_devices: int
    mesh: tuple[tuple[str, int], ...]
    collectives: int
    bytes: int
    bytes_by_kind: dict[str, int]
    traffic: int
    flops: float | None
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    peak_bytes: int | None
    bandwidth: float | None
    latency: float
    flops_per_second: float | None
    communication_seconds: float | None
    compute_seconds: float | None
    compile_seconds: float
    analysis_seconds: float
    findings: tuple[Finding, ...] = ()
    target: str = "cpu"
    topology: str | None = None
    hardware: Hardware | None = dataclasses.field(default=None, repr=False)
    flops_source: str | None = None
    network_bandwidth: float | None = None
    unmatched_rules: tuple[str, ...] = ()
    relative_rules: tuple[str, ...] = ()
    figures: Figures | None = dataclasses.field(default=None, repr=False)
    schedule: Schedule = dataclasses.field(default=(), repr=False)
    simulated_seconds: float | None = None
    exposed_seconds: float | None = None
    hidden_seconds: float | None = None
    kernels: tuple[tuple[str, str | None, float], ...] = dataclasses.field(default=(), repr=False)
    batch_loops: tuple[LoopNote, ...] = ()
    donated: str | None = None
    padded_gathers: tuple[int, ...] = ()

    @property
    def waste_bytes(self) -> int:
        """The bytes each device sends per step beyond the better program, over all findings."""
        return sum(finding.bytes for finding in self.findings)

    @property
    def seconds(self) -> float | None:
        """The step's estimated time.

        A GPU or TPU target: simulated from its program (kernels in order, async collectives
        beside them). CPU devices: compute plus communication, without overlap (what is
        estimated of them).
        """
        if self.simulated_seconds is not None:
            return self.simulated_seconds
        known = [p for p in (self.communication_seconds, self.compute_seconds) if p is not None]
        return sum(known) if known else None

    @property
    def step_seconds(self) -> float | None:
        """The same as :attr:`seconds`."""
        return self.seconds

    @property
    def unknown_loops(self) -> tuple[str, ...]:
        """The loops of a target's program whose trip count XLA does not know: counted once each.

        As ``'while.3 (model.py:12)'``; ``()`` on CPU devices (their rows say ``1?``).
        """
        return unknown_loops(self.schedule)

    @property
    def model_flops_utilisation(self) -> float | None:
        """The share of the device's bf16 peak that the step's matrix flops in :attr:`seconds` imply."""
        seconds, hardware = self.seconds, self.hardware
        if not seconds or hardware is None or self.flops is None:
            return None
        return self.flops / (seconds * hardware.peak_flops_per_second)

    @property
    def communication_bound(self) -> bool | None:
        """Whether communication is estimated to take longer than compute."""
        if self.communication_seconds is None or self.compute_seconds is None:
            return None
        return self.communication_seconds > self.compute_seconds

    @refuses_accelerator()
    def at(
        self,
        *,
        bandwidth: float | None = None,
        flops_per_second: float | None = None,
        latency: float | None = None,
    ) -> StepReport:
        """The same report at other figures; no recompile.

        Estimated at another bandwidth, latency or FLOP/s; the figures not given are kept. A
        bandwidth given is every collective's (the target's NICs are dropped: one link, within
        and across hosts). Each row's time is asked of the links again, with its groups. Another
        target is another compile: ``explain_step(..., target=...)``.
        """
        figures = self.figures or Figures(self.target, self.hardware)
        return estimated(
            self, figures.at(bandwidth=bandwidth, latency=latency, flops_per_second=flops_per_second)
        )

    def __str__(self) -> str:
        return report_text(self)

    def findings_text(self) -> str:
        """The findings, one paragraph each: kind, bytes, where, cause and fix."""
        return findings_text(self)


def report_of(
    rows: list[StepRow],
    n: int,
    mesh: tuple[tuple[str, int], ...],
    memory: dict[str, int | None],
    flops: float | None,
    compile_seconds: float,
    analysis_seconds: float,
    findings: list[Finding],
) -> StepReport:
    """The report of a compiled step: its rows, their totals and its findings (no estimate yet)."""
    return StepReport(
        rows=tuple(rows),
        n_devices=n,
        mesh=mesh,
        **_totals(rows),
        flops=flops,
        argument_bytes=memory["argument_bytes"],
        output_bytes=memory["output_bytes"],
        alias_bytes=memory["alias_bytes"],
        temp_bytes=memory["temp_bytes"],
        peak_bytes=memory["peak_bytes"],
        bandwidth=None,
        latency=0.0,
        flops_per_second=None,
        communication_seconds=None,
        compute_seconds=None,
        compile_seconds=compile_seconds,
        analysis_seconds=analysis_seconds,
        findings=tuple(findings),
    )


def _totals(rows: Sequence[StepRow]) -> dict[str, Any]:
    by_kind: dict[str, int] = {}
    for row in rows:
        by_kind[row.kind] = by_kind.get(row.kind, 0) + row.total_bytes
    return {
        "collectives": len({row.instruction for row in rows}),
        "bytes": sum(row.total_bytes for row in rows),
        "bytes_by_kind": by_kind,
        "traffic": sum(row.traffic for row in rows),
    }


def estimated(report: StepReport, figures: Figures) -> StepReport:
    """The report with its rows' times and the totals estimated at these figures.

    Each collective's time is the links' model's (:attr:`Figures.links`), asked with its kind, its
    arrays' bytes and its device groups: one run of a combined collective carries its arrays
    together (its latency paid once), and each array's row has its share by its bytes. A GPU or TPU
    target's step time is simulated from its program (:mod:`~einshard._cost.hardware._timing`), each
    collective at that time per run; CPU devices keep ``flops / flops_per_second`` plus the
    collectives, without overlap: simulated CPU devices share one host's cores, and a schedule of
    them describes no hardware.
    """
    bandwidth = figures.bandwidth
    links = figures.links
    first: dict[str, StepRow] = {}
    run_bytes: dict[str, int] = {}
    for row in report.rows:
        first.setdefault(row.instruction, row)
        run_bytes[row.instruction] = run_bytes.get(row.instruction, 0) + row.bytes
    per_run: dict[str, float] = {}
    hosts: dict[str, int] = {}
    if links is not None:
        for name, row in first.items():
            groups = _groups(row)
            per_run[name] = links.seconds(row.kind, run_bytes[name], groups) if run_bytes[name] else 0.0
            hosts[name] = spanned_hosts(links, groups)
    rows = []
    for row in report.rows:
        seconds = None
        if links is not None:
            share = row.bytes / run_bytes[row.instruction] if run_bytes[row.instruction] else 0.0
            seconds = per_run[row.instruction] * share * row.times
        rows.append(dataclasses.replace(row, seconds=seconds, hosts=hosts.get(row.instruction, 1)))
    communication = sum(r.seconds for r in rows if r.seconds is not None) if bandwidth is not None else None
    flops_per_second = figures.flops_per_second
    compute = report.flops / flops_per_second if flops_per_second and report.flops is not None else None
    simulated = {}
    if figures.hardware is not None and report.schedule:
        unscheduled = {row.instruction for row in report.rows} - collectives_of(report.schedule)
        if unscheduled:
            raise AssertionError(
                "einshard cannot read this XLA text (please report it): the step time's schedule "
                f"leaves out the collectives {', '.join(sorted(unscheduled))}"
            )
        time = simulate(report.schedule, per_run, _rates(figures.hardware, figures))
        compute = time.compute_seconds
        simulated = {
            "simulated_seconds": time.seconds,
            "exposed_seconds": time.exposed_seconds,
            "hidden_seconds": time.hidden_seconds,
            "kernels": time.kernels,
        }
    return dataclasses.replace(
        report,
        rows=tuple(rows),
        bandwidth=bandwidth,
        latency=figures.latency,
        flops_per_second=flops_per_second,
        communication_seconds=communication,
        compute_seconds=compute,
        network_bandwidth=figures.network_bandwidth if bandwidth is not None else None,
        hardware=figures.hardware if figures.hardware is not None else report.hardware,
        figures=figures,
        **simulated,
    )


def _groups(row: StepRow) -> tuple[tuple[int, ...], ...]:
    """A row's device groups; a row made without them (by hand): one group of its size, ids from 0."""
    return row.groups or (tuple(range(row.group_size)),)


def _rates(hardware: Hardware, figures: Figures) -> Rates:
    """What the simulation prices kernels at: a given FLOP/s is every dot's rate."""
    if figures.flops_given and figures.flops_per_second:
        matmul: dict[str, float] = {}
        fallback = figures.flops_per_second
    else:
        matmul = hardware.matmul_rates()
        fallback = hardware.flops_per_second
    return Rates(
        matmul=matmul,
        fallback=fallback,
        memory=hardware.memory_bandwidth * hardware.memory_efficiency,
        launch=hardware.launch_seconds,
    )
