"""One step report: compile the step, read the program, attribute its collectives, total them."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import time
from collections.abc import Iterator

from .._language._errors import EinshardError
from .._trees._rules import RulesLike
from . import _hlo
from ._attribution import attributed_rows
from ._call import StepCall
from ._compile import Compiled, compile_step, cpu_flops
from ._findings import find_waste
from ._flow import Flow
from ._report import StepReport, report_of
from ._target import Target

__all__ = ["Answer", "analyse", "answer", "report_of_text"]


def analyse(call: StepCall, rules: RulesLike | None, target: Target | None = None) -> StepReport:
    """Compiles the step (its arguments sharded by ``rules``, if given) and reports what it costs.

    With a GPU or TPU ``target``, the einshard device order is that target's compile-only devices
    (the child process sets it); the flops, which such a program does not count, come from the
    same step compiled for as many CPU devices.
    """
    placed = call.with_rules(rules) if rules is not None else call
    compiled = compile_step(placed)
    with _without_gc():
        report = _read(placed, compiled)
    if target is None or target.platform == "cpu":
        return report
    flops, source = report.flops, None
    if flops is None:
        flops = cpu_flops(call, rules, report.n_devices)
        source = f"XLA's CPU compiler's count for the same step on {report.n_devices} CPU devices"
    return dataclasses.replace(
        report, flops=flops, flops_source=source, target=target.name, topology=target.topology
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


def _read(call: StepCall, compiled: Compiled) -> StepReport:
    start = time.perf_counter()
    text = compiled.text()
    module = _hlo.parse_module(text)
    n = module.num_partitions
    mesh, positions = compiled.mesh(n)
    flow = Flow(module)
    parameter_paths = _parameter_paths(module, call)
    rows, origins = attributed_rows(module, flow, mesh, positions, parameter_paths, compiled.hosts(n))
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
    flops = compiled.flops()
    analysis_seconds = time.perf_counter() - start
    report = report_of(rows, n, mesh, memory, flops, compiled.seconds, analysis_seconds, findings)
    if call.unused:
        below = {path.partition("/")[2] for path in call.paths}  # as shard_pytree sees an argument
        relative = tuple(
            rule.pattern for rule in call.unused if any(re.search(rule.pattern, p) for p in below)
        )
        unmatched = tuple(rule.pattern for rule in call.unused)
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
