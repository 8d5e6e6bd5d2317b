"""One step report: compile the step, read the program, attribute its collectives, total them."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator

from .._language._errors import EinshardError
from .._language._expression import REPLICATE
from .._trees._rules import Rules, RulesLike
from . import _hlo, _hlo_kernels, _timing
from ._attribution import attributed_rows
from ._call import StepCall
from ._compile import Compiled, compile_step
from ._findings import find_waste
from ._flow import Flow
from ._report import StepReport, report_of
from ._target import Target

__all__ = ["Answer", "analyse", "answer", "report_of_text"]


def analyse(call: StepCall, rules: RulesLike | None, target: Target | None = None) -> StepReport:
    """Compiles the step (its arguments sharded by ``rules``, if given) and reports what it costs.

    With a GPU or TPU ``target``, the einshard device order is that target's compile-only devices
    (the child process sets it): every argument is laid out on them, by the rules or, without
    rules, replicated, so that no program of another platform is reported under the target's
    name. Its flops are its own dots' (``_hlo_kernels.program_matmul_flops``): XLA's cost analysis of a
    GPU program leaves most of them out, and a compile-only TPU program has none.

    Raises:
        EinshardError: The step compiled for other devices than the target's (its own shardings
            name them).
    """
    on_target = target is not None and target.platform != "cpu"
    if rules is not None:
        placed = call.with_rules(rules)
    elif on_target:
        replicated = call.with_rules(Rules([(".*", REPLICATE)]))
        placed = dataclasses.replace(
            replicated, layouts=call.layouts, table=call.table, unmatched=call.unmatched
        )
    else:
        placed = call
    compiled = compile_step(placed)
    if not on_target:
        with _without_gc():
            return _read(placed, compiled)
    assert target is not None
    platform = compiled.platform()
    if platform != target.platform:
        raise EinshardError(
            f"the step compiled for {platform or 'unknown'} devices, not for {target.label}",
            hint="The step's own shardings name other devices (a jax.jit with in_shardings=, or "
            "arrays placed on this machine): give the step without them, and the arguments' layouts "
            "with rules=.",
        )
    with _without_gc():
        report = _read(placed, compiled, matmul_flops=True)
    return dataclasses.replace(
        report,
        flops_source=f"the dots of the program XLA's compiler made for {target.label}",
        target=target.name,
        topology=target.topology,
    )


@contextlib.contextmanager
def _without_gc() -> Iterator[None]:
    # Reading makes many small objects and no cycles; with JAX's heap in the process, each full
    # collection the reading would trigger costs more than the reading itself.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read(call: StepCall, compiled: Compiled, *, matmul_flops: bool = False) -> StepReport:
    start = time.perf_counter()
    text = compiled.text()
    module = _hlo.parse_module(text)
    n = module.num_partitions
    mesh, positions = compiled.mesh(n)
    flow = Flow(module)
    parameter_paths = _parameter_paths(module, call)
    rows, origins = attributed_rows(module, flow, mesh, positions, parameter_paths, compiled.device_ids(n))
    findings = find_waste(
        rows,
        origins,
        flow,
        n,
        messages=compiled.messages(text),
        layouts=call.layouts,
        paths=call.paths,
        parameter_paths=parameter_paths,
        sizes=call.array_bytes,
        table=call.table,
    )
    memory = compiled.memory()
    flops = _hlo_kernels.program_matmul_flops(module) if matmul_flops else compiled.flops()
    analysis_seconds = time.perf_counter() - start
    report = report_of(rows, n, mesh, memory, flops, compiled.seconds, analysis_seconds, findings)
    report = dataclasses.replace(report, batch_loops=compiled.loops, donated=compiled.donated)
    if matmul_flops:  # a target's program: the order its kernels run in, to simulate its time
        report = dataclasses.replace(report, schedule=_timing.schedule_of(module))
    if call.unmatched:
        below = {path.partition("/")[2] for path in call.paths}  # as shard_pytree sees an argument
        unmatched_below = set(call.table.unmatched_rules(below))
        relative = tuple(rule.pattern for rule in call.unmatched if rule not in unmatched_below)
        unmatched = tuple(rule.pattern for rule in call.unmatched)
        report = dataclasses.replace(report, unmatched_rules=unmatched, relative_rules=relative)
    return report


def report_of_text(text: str, parameter_paths: list[str | None] | None = None) -> StepReport:
    """The report of a compiled program's text alone (``compiled.as_text()``, saved anywhere).

    The rows, bytes and findings that need only the program: its mesh is one axis of all its
    partitions, and it has no memory, flops or table. ``parameter_paths`` names the program's
    parameters by position, for the rows' parameters.
    """
    module = _hlo.parse_module(text)
    n = module.num_partitions
    mesh = (("devices", n),)
    flow = Flow(module)
    rows, origins = attributed_rows(module, flow, mesh, list(range(n)), parameter_paths)
    findings = find_waste(rows, origins, flow, n, parameter_paths=parameter_paths or ())
    memory: dict[str, int | None] = dict.fromkeys(
        ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")
    )
    return report_of(rows, n, mesh, memory, None, 0.0, 0.0, findings)


def _parameter_paths(module: _hlo.Module, call: StepCall) -> list[str | None]:
    """The path of each parameter of the program, by position.

    ``jax.jit`` drops unused arguments from the program (``keep_unused=False``); then the
    positions shift, and each parameter is found by the name JAX wrote in its metadata.
    """
    paths = call.array_paths
    parameters = {
        i.parameter_number: i for i in module.computations[module.entry] if i.parameter_number is not None
    }
    if len(parameters) == len(paths):
        return list(paths)
    by_name = dict(zip(call.array_jax_names(), paths, strict=True))
    count = max(parameters, default=-1) + 1
    return [by_name.get(module.source(parameters[k])[0]) if k in parameters else None for k in range(count)]


@dataclasses.dataclass(frozen=True)
class Answer:
    """The report of the step under one table, or why there is none.

    Attributes:
        report: The report, or ``None``.
        error: The ``EinshardError`` the table raised (it does not fit the shapes or devices), or
            the text of another error (the step does not compile), or ``None``.
    """

    report: StepReport | None
    error: EinshardError | str | None = None


def answer(call: StepCall, rules: RulesLike | None, target: Target | None = None) -> Answer:
    """The step's report under one table; an error is kept, so one table that fails loses no other."""
    try:
        return Answer(analyse(call, rules, target))
    except EinshardError as error:
        return Answer(None, error)
    except Exception as error:
        return Answer(None, f"{type(error).__name__}: {error}")
