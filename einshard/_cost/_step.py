"""``explain_step``: what a compiled step costs — collectives, bytes, memory, flops and time.

The step is compiled for its arguments' shardings with public JAX calls
(``jax.jit(fn).lower(...).compile()``, ``.as_text()``, ``.memory_analysis()``,
``.cost_analysis()``); ``_hlo`` reads the program text. With ``n_devices=N`` the same happens in
a child process with ``N`` simulated CPU devices.

Which module of the cost folder decides what (reading the program's text, the step's call, the
compile and its target, attributing collectives over the program's dataflow, the detectors of
waste, the report, its printing and its time) is the layer table of the design note,
``einshard/README.md``: one row per module, held to the code by ``tests/test_layers.py``, so a
module added or moved shows there. This module is ``explain_step``, and :func:`reports`, what the
planner (``einshard._planning``) calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._language._errors import EinshardWarning
from .._language._numbers import checked_count
from .._language._sources import user_stacklevel
from .._tracing._batch_layout import marks
from .._tracing._call import StepCall
from .._trees._assign import as_rules
from .._trees._rules import Rules, RulesLike
from .._trees._strategy import with_batch
from ._entry import entry_point
from .child._child import Order, child_error, in_child, in_turn
from .child._progress import CompileEvents, Progress
from .hardware._figures import Hardware as Hardware
from .hardware._figures import resolve_figures
from .hardware._target import Target, parse_target
from .pipeline._analysis import Answer, analyse, answer
from .pipeline._compile import forget_traces
from .report._report import Finding as Finding
from .report._report import StepReport as StepReport
from .report._report import StepRow as StepRow
from .report._report import estimated

__all__ = [
    "Finding",
    "Hardware",
    "StepReport",
    "StepRow",
    "explain_step",
    "reports",
    "warn_if_only_catch_all",
]


@entry_point(step_kwargs=True)
def explain_step(
    fn: Callable[..., Any] | str,
    *args: Any,
    n_devices: int | None = None,
    rules: RulesLike | None = None,
    target: str = "cpu",
    hardware: Mapping[str, float] | None = None,
    slices: int | None = None,
    bandwidth: float | None = None,
    latency: float | None = None,
    flops_per_second: float | None = None,
    quiet: bool = False,
    donate: bool = True,
    **kwargs: Any,
) -> StepReport:
    """Compiles ``fn(*args, **kwargs)`` for its arguments' shardings and reports what it costs.

    Every collective XLA's partitioner inserted becomes a row (kind, bytes per device, mesh
    axes, how often it runs, the source line, and the parameter it serves where the data flow
    says so), with memory per device and flops from the compiled program, and an estimated
    communication time at ``bandwidth`` with the ring formulas. The waste in the program (a
    gradient reduced twice, partial sums reduced one by one, an all-reduce a reduce-scatter
    would replace, a weight copied that the table meant to split, a reshard, the compiler's forced
    rematerialization) is named in ``report.findings`` with its bytes, cause and fix (see the
    "What does my table cost?" page).

    With ``target='h100'`` (or another GPU, or a TPU generation) the step is compiled by that
    hardware's own XLA compiler for ``n_devices`` compile-only devices, on this machine, with no
    accelerator present (every argument on those devices: by ``rules``, else replicated): the
    rows, bytes, findings, memory and flops are that program's, and ``report.seconds`` is its
    step time simulated at the hardware's figures (:class:`~einshard.Hardware`): its kernels in
    the order they run, each at its element type's gemm rate or the memory's bandwidth, with
    the async collectives running beside the kernels scheduled between their start and done.

    Args:
        fn: The step. A plain function is compiled with ``jax.jit`` (leaves that are not arrays
            are held static, as ``equinox.filter_jit`` does); a function with a ``lower``
            method (``jax.jit``, ``equinox.filter_jit`` ...) is lowered as it is, keeping its own
            shardings and donation. A ``'module:function'`` string is imported.
        *args: The arguments: arrays, or ``jax.ShapeDtypeStruct`` leaves carrying shardings
            (nothing is allocated for those), in any pytree.
        n_devices: Compile in a child process with this many simulated CPU devices instead
            (``fn`` and the arguments must pickle; shardings come from ``rules``, see the page),
            or this many devices of the ``target``.
        rules: A rule table giving the arguments their shardings, by the paths
            ``name/key/...`` of ``fn``'s parameter names (``params/layers/0/kernel``). A
            :class:`~einshard.strategies.Strategy` (``plan(...).best``) also lays out the batch
            by its ``.batch``, as :func:`~einshard.plan` does, so the report is the plan's row:
            the batch is the argument named ``batch`` (by position or keyword), else the last
            positional one (``step(params, batch)``, ``step(params, opt_state, tokens)``), every
            leaf of it; and the step's loops whose carry comes from the batch (a scanned
            model's layers) keep that carry in the batch's layout (as
            :func:`~einshard.constrain_loops` compiles it: ``report.batch_loops`` says where). With a
            single argument there is no batch, and the strategy is a table like any other.
        target: What to compile for: ``'cpu'`` (simulated CPU devices, the default), a GPU
            (``'a100'``, ``'h100'``, ``'h200'``, ``'b200'``: needs the ``gpu-target`` extra)
            or a TPU generation (``'v5e'``, ``'v5p'``, ``'v6e'``, or a slice ``'v5e:2x4'``:
            needs ``tpu-target``). A target other than ``'cpu'`` is always compiled
            in a child process.
        slices: With a TPU target: how many slices the ``n_devices`` chips are, each of
            ``n_devices / slices`` (or the slice named, ``'v5e:4x4'``), joined by the data-center
            network (MaxText's ``num_slices``); collectives between slices run at DCN's rate.
        hardware: Figures of the target to use instead of its own, by name
            (``{'efficiency': 0.6, 'nics_per_host': 4}``; see :class:`~einshard.Hardware`).
        bandwidth: Bytes per second each device sends, for the communication estimate (every
            collective's; default with a target: its NVLink or ICI figure, and its hosts' NICs
            for collectives across hosts).
        latency: Seconds per step of a ring algorithm (default: 0, or the target's figure per
            link: NVLink, its network, ICI).
        flops_per_second: FLOP/s per device the compute estimate assumes; with a target, the
            rate every dot runs at instead of its matrix units' per element type.
        quiet: Show no progress. A compile in a child process that runs over 10 seconds says
            so on standard error (``rich``'s bar on a terminal, else plain lines).
        donate: Compile a plain step that returns its first argument updated (the whole result,
            or its first element: same tree, shapes and dtypes) with that argument donated, as
            a training loop runs it: its buffers hold the result, and the memory shows it
            (``report.donated`` names it). ``False`` compiles it without. A ``jax.jit`` step
            keeps its own ``donate_argnums``.
        **kwargs: Keyword arguments of ``fn``. (``accelerator=``, removed, raises an
            ``EinshardError`` naming ``target=``, unless ``fn`` takes an ``accelerator`` itself.)

    Returns:
        A :class:`StepReport`.

    Raises:
        EinshardError: When ``fn`` or the arguments cannot cross into the child process, or
            ``n_devices`` is not a positive integer, or the target is unknown, or its compiler
            is not installed (the error names the extra to install), or a figure is not one (a
            bandwidth or FLOP/s not a finite number above 0, a latency negative, an efficiency
            outside (0, 1], ``hardware=`` not a mapping of its names: before any compile), or as
            ``rules`` would; or when a step defined in the script being run cannot be found by
            running the script again in the child (the error names the line that failed there).
        DoesNotFitError: The target's compiler refused the step for its memory (libtpu does):
            the bytes it needed and had per device, the target, and the fixes.

    >>> import jax, jax.numpy as jnp, einshard
    >>> w = einshard.einshard(jnp.ones((64, 32)), 'x y -> x* y')
    >>> report = einshard.explain_step(lambda w: w.sum(0), w)
    >>> [(row.kind, row.bytes, row.group_size) for row in report.rows]
    [('all-reduce', 128, 8)]
    """
    if n_devices is not None:
        _check_devices(n_devices)
    chosen = parse_target(target, n_devices, slices)
    figures = resolve_figures(
        chosen, hardware, bandwidth=bandwidth, latency=latency, flops_per_second=flops_per_second
    )
    # Named here in every case: its checks (a float64 argument) speak in this process, and a
    # strategy's batch rule needs the batch argument's name.
    call = StepCall.of(fn, args, kwargs).donating(donate)
    table = with_batch(rules, call.batch_name) if rules is not None else None
    if chosen.platform != "cpu":
        with Progress("explain_step", [chosen.label], quiet=quiet) as progress:
            answers = in_child(fn, args, kwargs, chosen.n_devices, [table], chosen, progress, call.donate)
            result = answers[0]
        if result.report is None:
            raise child_error(result.error or "no report", chosen.n_devices, chosen)
        report = result.report
    elif n_devices is not None:
        with Progress("explain_step", [f"{n_devices} CPU devices"], quiet=quiet) as progress:
            result = in_child(fn, args, kwargs, n_devices, [table], None, progress, call.donate)[0]
        if result.report is None:
            raise child_error(result.error or "no report", n_devices)
        report = result.report
    else:
        report = analyse(call, table)
    if rules is not None:
        warn_if_only_catch_all(as_rules(rules), report, "explain_step")
    return estimated(report, figures)


def warn_if_only_catch_all(
    table: Rules, report: StepReport, caller: str, *, relative_only: bool = False
) -> None:
    """An ``EinshardWarning`` when no rule of the table matched a path of the step but its catch-all.

    Then every argument got the catch-all's layout: nothing the table says of its layers
    applies, and a report of it would look like success. With ``relative_only`` (the planner,
    whose table already says how little a candidate splits), only when the rules would have
    matched the paths below the arguments' names (anchored with ``^`` for ``shard_pytree``).
    """
    missed, relative = set(report.unmatched_rules), set(report.relative_rules)
    specific = [rule for rule in table if not rule.catches_all]
    if not specific or not all(rule.pattern in missed for rule in specific):
        return
    if relative_only and not relative:
        return
    listed = ", ".join(repr(rule.pattern) for rule in specific[:3]) + (" ..." if len(specific) > 3 else "")
    fix = (
        "a step's paths begin with its argument's name ('params/layers/0/kernel'): anchor the rules "
        "with (^|/), not ^"
        if relative
        else "they name layers the step's arguments do not have (explain(params, rules) shows the paths)"
    )
    warnings.warn(
        f"no rule of the table given to {caller} matched a path of the step's arguments but its "
        f"catch-all: {listed} matched nothing; {fix}",
        EinshardWarning,
        stacklevel=user_stacklevel(),
    )


def _check_devices(n_devices: Any) -> None:
    checked_count(n_devices, "n_devices", hint="Give the device count to plan for, e.g. n_devices=64.")


def reports(
    call: StepCall,
    tables: Sequence[RulesLike],
    n_devices: int | None = None,
    target: Target | None = None,
    order: Order | None = None,
    progress: CompileEvents | None = None,
) -> dict[int, Answer]:
    """The step's report under each table compiled, by index: here, or (``n_devices``) in one child process.

    The planner's entry. A table that does not fit the shapes or the devices, or under which
    the step does not compile, gives an :class:`Answer` with its error; the others are kept.
    ``order`` says which table compiles next, given the answers so far and the tables compiling
    now (``None``: stop); without it, every table in turn.

    Raises:
        EinshardError: When the step or its arguments cannot cross into the child process, or
            the child fails as a whole.
    """
    choose = order if order is not None else in_turn(len(tables))
    if n_devices is not None:
        given = (call.given, call.args, call.kwargs)
        return in_child(*given, n_devices, list(tables), target, progress, call.donate, choose)
    answers: dict[int, Answer] = {}
    while True:
        index = choose(answers, frozenset())  # one table at a time here
        if index is None:
            return answers
        if progress is not None:
            progress.compiling(index)
        marked = marks()
        answers[index] = answer(call, tables[index])
        if marks() != marked:  # like_batch followed this table: no later table may reuse its traces
            forget_traces()
        if progress is not None:
            progress.finished(index, "compiled" if answers[index].report is not None else "rejected")
