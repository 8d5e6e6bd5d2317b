"""One step report: compile the step, read the program, attribute its collectives, total them."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator, Sequence

from ..._language._errors import EinshardError
from ..._language._expression import REPLICATE
from ..._language._text import size_text
from ..._tracing._call import StepCall
from ..._tracing._depth import AtDepth, call_at_depth
from ..._trees._rules import Rules, RulesLike
from ..findings._findings import find_waste
from ..hardware import _timing
from ..hardware._figures import hardware_of
from ..hardware._target import Target
from ..hardware._tpu import GENERATIONS
from ..reading._attribution import attributed_rows
from ..reading._flow import Flow, Origin
from ..report._report import StepReport, StepRow, report_of
from ..xla import _hlo, _hlo_kernels, _messages
from ._compile import Compiled, compile_step

__all__ = [
    "Answer",
    "DoesNotFitError",
    "analyse",
    "answer",
    "compiled_or_refused",
    "does_not_fit",
    "padded_gathers",
    "report_of_text",
]


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
        DoesNotFitError: The target's compiler refused the step for its memory (libtpu does; XLA's GPU
            compiler compiles such a step, and its report's memory says it does not fit).
    """
    placed = _placed(call, rules, target)
    return _reported(placed, compiled_or_refused(placed, target), target)


def _placed(call: StepCall, rules: RulesLike | None, target: Target | None) -> StepCall:
    """The call with its arguments laid out by ``rules`` (a target's: replicated without them)."""
    if rules is not None:
        return call.with_rules(rules)
    if target is not None and target.platform != "cpu":
        replicated = call.with_rules(Rules([(".*", REPLICATE)]))
        return dataclasses.replace(
            replicated, layouts=call.layouts, table=call.table, unmatched=call.unmatched
        )
    return call


def _reported(placed: StepCall, compiled: Compiled, target: Target | None) -> StepReport:
    """The report of a compiled step: its program read, its collectives attributed and totalled."""
    on_target = target is not None and target.platform != "cpu"
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
        topology=target.topology if target.slices == 1 else f"{target.slices} slices of {target.topology}",
    )


def compiled_or_refused(placed: StepCall, target: Target | None) -> Compiled:
    """The step compiled; a compiler's refusal for memory made the verdict it is.

    Raises:
        DoesNotFitError: The compiler refused the program for its memory per device (libtpu's
            ``RESOURCE_EXHAUSTED: ... CompileTimeHbmOom``, read by ``_messages.parse_out_of_memory``).
    """
    try:
        return compile_step(placed)
    except Exception as error:
        refusal = _messages.parse_out_of_memory(str(error))
        if refusal is None:
            raise
        raise does_not_fit(refusal, target) from None


class DoesNotFitError(EinshardError):
    """The step does not fit: the target's compiler refused it for its memory per device.

    An :class:`~einshard.EinshardError` (``explain_step`` raises it; ``plan`` and
    ``plan_batches`` reject the candidate for memory with these figures): a verdict on the
    step under its table on that target, not a failure. libtpu refuses such a program; XLA's GPU
    compiler compiles it, and the report's memory says it does not fit.

    Attributes:
        needed: The bytes per device the compiler found the program needs.
        available: The bytes per device the compiler has for a program.
        target: What it was compiled for (``'8 V5E (v5e:2x4)'``).
    """

    def __init__(self, headline: str, *, needed: int, available: int, target: str, **kwargs) -> None:
        super().__init__(headline, **kwargs)
        self.needed, self.available, self.target = needed, available, target

    def __reduce__(self):  # the child sends it to the parent: the figures cross with it
        kwargs = dict(hint=self.hint, context=tuple(self.context))
        return (_rebuilt, (self.headline, self.needed, self.available, self.target, kwargs))


def _rebuilt(headline: str, needed: int, available: int, target: str, kwargs: dict) -> DoesNotFitError:
    return DoesNotFitError(headline, needed=needed, available=available, target=target, **kwargs)


# The public home is the package, so tracebacks read `einshard.DoesNotFitError`.
DoesNotFitError.__module__ = "einshard"


def does_not_fit(refusal: _messages.OutOfMemory, target: Target | None) -> DoesNotFitError:
    """The verdict of a compile the compiler refused for memory, with its figures and the fixes."""
    label = target.label if target is not None else "these devices"
    # A TPU's memory is its generation's figure: the verdict needs no compiler (only TPU's refuses).
    if target is not None and target.platform == "tpu":
        of = f" (of the TPU {target.name}'s {size_text(GENERATIONS[target.name].memory_bytes)})"
    elif target is not None and target.platform == "gpu":
        hardware = hardware_of(target)
        of = f" (of the {hardware.device}'s {size_text(hardware.memory_bytes)})" if hardware else ""
    else:
        of = ""
    more = f"n_devices={2 * target.n_devices}" if target is not None and target.n_devices else "more devices"
    return DoesNotFitError(
        f"the step does not fit {label}: XLA's compiler for it needs {size_text(refusal.needed)} per "
        f"device, more than the {size_text(refusal.available)} of {refusal.memory} it has for a "
        f"program{of}",
        needed=refusal.needed,
        available=refusal.available,
        target=label,
        hint=(
            f"Give it more devices ({more}: each holds a smaller share of what the table splits), a smaller "
            "batch (plan_batches finds the largest that fits), rematerialisation (jax.checkpoint "
            "around each layer: its activations recomputed in the backward pass, not kept), or "
            "offloading to host memory (a jax.checkpoint policy such as "
            "jax.checkpoint_policies.offload_dot_with_no_batch_dims('device', 'pinned_host'), or "
            "the optimizer state on shardings .with_memory_kind('pinned_host'))."
        ),
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
    # Several TPU slices run one slice's program each (its partitions), joined by transfers
    # between slices: the report's devices, mesh and groups are all the slices'.
    n = module.num_partitions
    devices = compiled.partition_devices()
    if devices is not None and len(devices) > n and len(devices) % n == 0:
        n = len(devices)
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
        loops=compiled.loops,
        platform=compiled.platform() or "cpu",
    )
    memory = compiled.memory()
    flops = _hlo_kernels.program_matmul_flops(module) if matmul_flops else compiled.flops()
    analysis_seconds = time.perf_counter() - start
    report = report_of(rows, n, mesh, memory, flops, compiled.seconds, analysis_seconds, findings)
    report = dataclasses.replace(
        report,
        batch_loops=compiled.loops,
        donated=compiled.donated,
        padded_gathers=padded_gathers(rows, origins, flow),
    )
    if matmul_flops:  # a target's program: the order its kernels run in, to simulate its time
        report = dataclasses.replace(report, schedule=_timing.schedule_of(module))
    if call.unmatched:
        below = {path.partition("/")[2] for path in call.paths}  # as shard_pytree sees an argument
        unmatched_below = set(call.table.unmatched_rules(below))
        relative = tuple(rule.pattern for rule in call.unmatched if rule not in unmatched_below)
        unmatched = tuple(rule.pattern for rule in call.unmatched)
        report = dataclasses.replace(report, unmatched_rules=unmatched, relative_rules=relative)
    return report


def report_of_text(
    text: str, parameter_paths: list[str | None] | None = None, platform: str = "cpu"
) -> StepReport:
    """The report of a compiled program's text alone (``compiled.as_text()``, saved anywhere).

    The rows, bytes and findings that need only the program: its mesh is one axis of all its
    partitions, and it has no memory, flops or table. ``parameter_paths`` names the program's
    parameters by position, for the rows' parameters; ``platform`` what it was compiled for
    (``'cpu'``, ``'gpu'``, ``'tpu'``: the findings' fixes say what applies there).
    """
    module = _hlo.parse_module(text)
    n = module.num_partitions
    mesh = (("devices", n),)
    flow = Flow(module)
    rows, origins = attributed_rows(module, flow, mesh, list(range(n)), parameter_paths)
    findings = find_waste(rows, origins, flow, n, parameter_paths=parameter_paths or (), platform=platform)
    memory: dict[str, int | None] = dict.fromkeys(
        ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")
    )
    report = report_of(rows, n, mesh, memory, None, 0.0, 0.0, findings)
    return dataclasses.replace(report, padded_gathers=padded_gathers(rows, origins, flow))


def padded_gathers(rows: Sequence[StepRow], origins: Sequence[Origin], flow: Flow) -> tuple[int, ...]:
    """The all-reduces that gather: each of the group's devices adds zeros but its own ``1/n``.

    XLA's TPU compiler writes many gathers so (FSDP's weights on 64 v5p chips, in the loop of a
    scanned model): the rows are the program's all-reduces, and are costed as such.
    """
    found = []
    for position, (row, origin) in enumerate(zip(rows, origins, strict=True)):
        if row.kind != "all-reduce" or origin.operand is None or row.group_size < 2:
            continue
        share = flow.padded_share(origin.operand)
        if share is not None and share * row.group_size == 1:
            found.append(position)
    return tuple(found)


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


def answer(call: StepCall, rules: RulesLike | AtDepth | None, target: Target | None = None) -> Answer:
    """The step's report under one table; an error is kept, so one table that fails loses no other.

    What the table or the step does wrong is the answer: an ``EinshardError`` (the table does not
    fit the shapes or the devices), or the error the compile raised (the step does not compile
    under it). An error of einshard's own, reading the compiled program (its "please report it"
    assertions), is no verdict on the table: it is raised. An :class:`~einshard._tracing._depth.AtDepth`
    table compiles the step at that depth of its repeated layers (a plan's sample).
    """
    try:
        if isinstance(rules, AtDepth):
            call, table = call_at_depth(call, rules.depth), rules.rules
        else:
            table = rules
        placed = _placed(call, table, target)
        compiled = compiled_or_refused(placed, target)
    except EinshardError as error:  # DoesNotFitError among them: a verdict on the table
        return Answer(None, error)
    except Exception as error:
        return Answer(None, f"{type(error).__name__}: {error}")
    try:
        return Answer(_reported(placed, compiled, target))
    except EinshardError as error:
        return Answer(None, error)
