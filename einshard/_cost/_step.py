"""``explain_step``: what a compiled step costs — collectives, bytes, memory, flops and time.

The step is compiled for its arguments' shardings with public JAX calls
(``jax.jit(fn).lower(...).compile()``, ``.as_text()``, ``.memory_analysis()``,
``.cost_analysis()``); ``_hlo`` reads the program text. With ``n_devices=N`` the same happens in
a child process with ``N`` simulated CPU devices.

The cost folder, in the order its modules import each other:

* ``_hlo``: reads the compiled program's text (pure: no JAX);
* ``_call``: the step and its arguments, flattened and named once (:class:`StepCall`);
* ``_compile``: compiles the step; the compiled program's mesh, memory and flops;
* ``_report``: :class:`StepRow`, :class:`Finding`, :class:`StepReport`, the ring formulas,
  estimates, an accelerator's rewrites, the table;
* ``_attribution``: each collective as rows, with its mesh axes, phase and parameter;
* ``_findings``: the waste in them (:class:`Finding`), from the data flow and the compiler's messages;
* ``_analysis``: one report (compile, read, attribute, total), or an :class:`Answer` per table;
* ``_child``: the same in a child process with another device count;
* ``_step`` (here): ``explain_step``, and :func:`reports`, what the planner calls;
* ``_strategies``, ``_planner``: candidate tables and their ranking.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._language._numbers import checked_count
from .._trees._rules import RulesLike
from ._analysis import Answer, analyse, answer
from ._call import StepCall
from ._child import child_error, in_child
from ._report import Finding as Finding
from ._report import StepReport as StepReport
from ._report import StepRow as StepRow
from ._report import accelerated, check_accelerator, estimated

__all__ = ["Finding", "StepReport", "StepRow", "explain_step", "reports"]


def explain_step(
    fn: Callable[..., Any] | str,
    *args: Any,
    n_devices: int | None = None,
    rules: RulesLike | None = None,
    bandwidth: float | None = None,
    latency: float = 0.0,
    flops_per_second: float | None = None,
    accelerator: str | None = None,
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

    Args:
        fn: The step. A plain function is compiled with ``jax.jit`` (leaves that are not arrays
            are held static, as ``equinox.filter_jit`` does); a function with a ``lower``
            method (``jax.jit``, ``equinox.filter_jit`` ...) is lowered as it is, keeping its own
            shardings and donation. A ``'module:function'`` string is imported.
        *args: The arguments: arrays, or ``jax.ShapeDtypeStruct`` leaves carrying shardings
            (nothing is allocated for those), in any pytree.
        n_devices: Compile in a child process with this many simulated CPU devices instead
            (``fn`` and the arguments must pickle; shardings come from ``rules``, see the page).
        rules: A rule table giving the arguments their shardings, by the paths
            ``name/key/...`` of ``fn``'s parameter names (``params/layers/0/kernel``).
        bandwidth: Bytes per second each device sends, for the communication estimate.
        latency: Seconds per step of a ring algorithm.
        flops_per_second: Peak FLOP/s per device, for the compute estimate.
        accelerator: ``'gpu'`` costs the program as XLA's GPU compiler rewrites it (an
            all-reduce whose result is only sliced as a reduce-scatter, all-reduces added right
            after as one), for a step compiled on CPU devices and run on GPUs; ``None`` or
            ``'cpu'``: as compiled.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A :class:`StepReport`.

    Raises:
        EinshardError: When ``fn`` or the arguments cannot cross into the child process, or
            ``n_devices`` is not a positive integer, or ``accelerator`` is not one of
            ``'cpu'``, ``'gpu'``, ``None``, or as ``rules`` would.

    >>> import jax, jax.numpy as jnp, einshard
    >>> w = einshard.einshard(jnp.ones((64, 32)), 'x y -> x* y')
    >>> report = einshard.explain_step(lambda w: w.sum(0), w)
    >>> [(row.kind, row.bytes, row.group_size) for row in report.rows]
    [('all-reduce', 128, 8)]
    """
    check_accelerator(accelerator)
    if n_devices is not None:
        _check_devices(n_devices)
        (result,) = in_child(fn, args, kwargs, n_devices, [rules])
        if result.report is None:
            raise child_error(result.error or "no report", n_devices)
        report = result.report
    else:
        report = analyse(StepCall.of(fn, args, kwargs), rules)
    if accelerator not in (None, "cpu"):
        report = accelerated(report, accelerator)
    return estimated(report, bandwidth, latency, flops_per_second)


def _check_devices(n_devices: Any) -> None:
    checked_count(n_devices, "n_devices", hint="Give the device count to compile for, e.g. n_devices=64.")


def reports(call: StepCall, tables: Sequence[RulesLike], n_devices: int | None = None) -> list[Answer]:
    """The step's report under each table: in this process, or (``n_devices``) in one child process.

    The planner's entry. A table that does not fit the shapes or the devices, or under which
    the step does not compile, gives an :class:`Answer` with its error; the others are kept.

    Raises:
        EinshardError: When the step or its arguments cannot cross into the child process, or
            the child fails as a whole.
    """
    if n_devices is None:
        return [answer(call, table) for table in tables]
    return in_child(call.given, call.args, call.kwargs, n_devices, list(tables))
