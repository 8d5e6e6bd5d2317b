"""The program a step compiles to, as training runs it: traced once, its state donated, its loops kept split.

A plain step is traced once (``jax.jit(...).trace``), under its strategy when a strategy laid
its arguments out (so that :func:`~einshard.like_batch` in the model constrains to that
strategy's batch). Then, before lowering:

* **Constants.** Equal constants, and equal equations on them (a table each unrolled layer
  gathers again), are kept once (``_tracing._constants``): XLA would fold each copy on its own,
  slowly, and then merge them.

* **Donation.** A step whose first argument comes back updated (the whole result, or its first
  element, has that argument's tree, shapes and dtypes) is a training step: every training loop
  donates that argument, so its buffers hold the result. The program is compiled so, and the
  report's memory says which argument was donated (``donate=False`` opts out).
* **Loops.** Under a strategy that splits the batch, the step's loops whose carry comes from the
  batch with the batch first (a scanned model's activations) get that carry constrained to the
  batch's layout (``_tracing._loops``); each such loop is a :class:`~einshard._tracing._loops.LoopNote`
  of the report.

A step with its own ``lower`` (``jax.jit``, ``nnx.jit``) keeps its own shardings and donation:
it is lowered as it is, unless it has loops to constrain under a strategy, when it is traced
through (its own donation kept, read from ``Traced.args_info``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from .._arrays._arrays import einshard
from .._arrays._leaves import is_jax_array
from .._sharding._devices import call_devices
from .._tracing._batch_layout import batch_expression_for, batch_split, strategy_batch, traced_under
from .._tracing._constants import shared_constants
from .._tracing._jaxprs import evaluate
from .._tracing._loops import LoopNote, constrained_jaxpr, has_loop
from .._trees._strategy import Strategy
from ._call import StepCall

__all__ = ["Program", "constrain_loops", "step_program"]


@dataclasses.dataclass(frozen=True)
class Program:
    """A step ready to lower: ``lower()`` gives JAX's ``Lowered``, with what was done to it.

    Attributes:
        lower: Lowers the program (no argument: the arguments are the call's).
        loops: The loops whose carry comes from the batch, and what was done to each.
        donated: The name of the argument donated by einshard's compile, or ``None``.
    """

    lower: Callable[[], Any]
    loops: tuple[LoopNote, ...] = ()
    donated: str | None = None


def step_program(call: StepCall, *, own: bool = True) -> Program:
    """The program of ``call``'s step, traced once (see the module's docstring).

    ``own=False``: a step with a ``lower`` method is compiled as a plain function all the same
    (``equinox.filter_jit``, whose compiled program has no text).
    """
    import jax

    if own and callable(getattr(call.fn, "lower", None)):
        own_program = _own_program(call)
        if own_program is not None:
            return own_program
    flat, outputs = _flat(call)
    arrays = [call.leaves[i] for i in call.arrays]
    traced = jax.jit(traced_under(call.batch_layout, flat), keep_unused=True).trace(*arrays)
    donated = _updated_first_argument(call, outputs) if call.donate else None
    outputs.clear()  # the traced values: not kept
    closed = shared_constants(traced.jaxpr)
    jaxpr, loops = _constrained(call, closed)
    if closed is traced.jaxpr and jaxpr is closed.jaxpr and donated is None:
        return Program(traced.lower, loops)
    donate = _argument_arrays(call, 0) if donated is not None else ()

    def run(*arrays: Any) -> Any:
        return evaluate(jaxpr, closed.consts, *arrays)

    run.__name__ = flat.__name__
    program = jax.jit(run, keep_unused=True, donate_argnums=donate)
    return Program(lambda: program.lower(*arrays), loops, donated)


def _flat(call: StepCall) -> tuple[Callable[..., list[Any]], list[Any]]:
    """The step as a function of its array leaves alone, returning its array results.

    The list it returns along with it gets, at each call, the result's tree structure and
    leaves (the non-array ones kept as they are, to rebuild the result).
    """
    import jax

    fn = call.fn
    outputs: list[Any] = []

    def flat(*arrays: Any) -> list[Any]:
        call_args, call_kwargs = call.rebuilt(arrays)
        result = fn(*call_args, **call_kwargs)
        outputs[:] = [jax.tree_util.tree_structure(result), jax.tree_util.tree_leaves(result)]
        # Outputs that are not arrays (an Equinox module's functions) stay out of the program.
        return [leaf for leaf in outputs[1] if is_jax_array(leaf)]

    flat.__name__ = getattr(fn, "__name__", "step")
    return flat, outputs


def constrain_loops(step: Callable[..., Any], strategy: Strategy | str) -> Callable[..., Any]:
    """The step as :func:`~einshard.plan` compiles it: its loops' batch-major carries kept split.

    Inside a loop (a scanned model: ``jax.lax.scan``, Flax's ``nn.scan`` and ``nnx.scan``,
    Equinox's scan over stacked layers), XLA's partitioner may drop the activations' batch
    split; under FSDP every layer then all-reduces the whole batch's activations. The step this
    returns finds, each time it is traced, the loops whose carry comes from the batch argument
    with the batch first, and constrains that carry to the strategy's batch layout at the top
    and the bottom of the body (as :func:`~einshard.like_batch` would there). It is traced under
    :func:`~einshard.use_strategy` too, so ``like_batch`` in the model follows the same strategy.
    The values it computes are the step's: a constraint moves data, never changes it.

    The batch argument is the one named ``batch``, else the last positional one (as
    :func:`~einshard.explain_step` says). Jit it as you would the step.

    Args:
        step: The training step, ``step(params, batch)`` or ``step(state, batch)``.
        strategy: A :class:`~einshard.strategies.Strategy` (``plan(...).best``), or the batch's
            expression (``'b ... -> b* ...'``).

    Returns:
        A function with the step's signature and results.

    Raises:
        EinshardError: If ``strategy`` is neither, or (when the step is traced) a batch array's
            first axis does not divide as the batch expression splits it.

    >>> import jax, jax.numpy as jnp, einshard
    >>> def step(w, batch):
    ...     def layer(x, w_layer):
    ...         return jnp.tanh(x @ w_layer), None
    ...     x, _ = jax.lax.scan(layer, batch, w)
    ...     return x.sum()
    >>> w, batch = jnp.ones((4, 8, 8)) / 8, jnp.ones((16, 8))
    >>> fsdp = einshard.strategies.fsdp(min_bytes=0)
    >>> constrained = jax.jit(einshard.constrain_loops(step, fsdp))
    >>> bool(jnp.allclose(constrained(w, batch), step(w, batch)))
    True
    """
    batch = strategy_batch(strategy, "constrain_loops")

    @functools.wraps(step)
    def constrained(*args: Any, **kwargs: Any) -> Any:
        import jax

        call = dataclasses.replace(StepCall.of(step, args, kwargs), batch_layout=batch, donate=False)
        flat, outputs = _flat(call)
        arrays = [call.leaves[i] for i in call.arrays]
        closed = jax.make_jaxpr(traced_under(batch, flat))(*arrays)
        structure, leaves = outputs
        outputs.clear()
        jaxpr, _ = _constrained(call, closed)
        results = iter(evaluate(jaxpr, closed.consts, *arrays))
        rebuilt = [next(results) if is_jax_array(leaf) else leaf for leaf in leaves]
        return jax.tree_util.tree_unflatten(structure, rebuilt)

    return constrained


def _own_program(call: StepCall) -> Program | None:
    """A ``jax.jit``-like step lowered as it is, or ``None`` when einshard compiles it (see the module)."""
    fn = call.fn
    batch = call.batch_layout
    trace = getattr(fn, "trace", None)
    if batch is None or not callable(trace) or batch_split(batch, call_devices(None).count) == 1:
        return Program(lambda: traced_under(batch, fn.lower)(*call.args, **call.kwargs))
    clear = getattr(fn, "clear_cache", None)
    if callable(clear):  # a trace under another strategy's like_batch is not this one's
        clear()
    traced = traced_under(batch, trace)(*call.args, **call.kwargs)
    if not has_loop(traced.jaxpr):
        return Program(traced.lower)
    return _traced_through(call, traced)


def _traced_through(call: StepCall, traced: Any) -> Program:
    """A ``jax.jit`` step with loops to constrain: its program rewritten, its own donation kept."""
    import jax

    closed = traced.jaxpr
    jaxpr, loops = _constrained(call, closed)
    infos = jax.tree_util.tree_leaves(traced.args_info)
    donate = tuple(k for k, info in enumerate(infos) if getattr(info, "donated", False))
    arrays = [call.leaves[i] for i in call.arrays]
    if len(infos) != len(arrays):  # arguments the jit holds static: its own program, unconstrained
        return Program(traced.lower)

    def run(*arrays: Any) -> Any:
        return evaluate(jaxpr, closed.consts, *arrays)

    run.__name__ = getattr(call.fn, "__name__", "step")
    program = jax.jit(run, keep_unused=True, donate_argnums=donate)
    return Program(lambda: program.lower(*arrays), loops)


def _constrained(call: StepCall, closed: Any) -> tuple[Any, tuple[LoopNote, ...]]:
    """The traced program with its batch-major loop carries constrained, and the loops' notes."""
    batch = call.batch_layout
    if batch is None or not has_loop(closed.jaxpr):
        return closed.jaxpr, ()
    n_devices = call_devices(None).count
    split = batch_split(batch, n_devices)
    if split == 1:  # the batch is not split (tensor parallel's copies): nothing to keep
        return closed.jaxpr, ()
    in_axes = [
        0 if is_batch and len(getattr(call.leaves[i], "shape", ())) else None
        for i, is_batch in zip(call.arrays, call.batch_arrays(), strict=True)
    ]

    def constrain(x: Any) -> Any:
        return einshard(x, batch_expression_for(batch, len(x.shape), n_devices))

    def fits(shape: tuple[int, ...]) -> str | None:
        if shape and shape[0] % split == 0:
            return None
        return (
            f"its first axis ({shape[0] if shape else 'none'}) does not split into the batch's {split} parts"
        )

    return constrained_jaxpr(closed.jaxpr, in_axes, constrain, fits)


def _argument_arrays(call: StepCall, position: int) -> tuple[int, ...]:
    """The program parameters (positions among the array leaves) of one top-level argument."""
    inside = set(call.argument_leaves(position))
    return tuple(k for k, i in enumerate(call.arrays) if i in inside)


def _updated_first_argument(call: StepCall, outputs: list[Any]) -> str | None:
    """The first argument's name when the step returns it updated (same tree, shapes, dtypes), else ``None``.

    The result itself (``step(params, batch) -> params``) or its first element
    (``step(state, batch) -> (state, loss)``).
    """
    import jax

    if not call.args or not outputs or not _argument_arrays(call, 0):
        return None
    structure, leaves = outputs
    first = call.args[0]
    wanted = jax.tree_util.tree_structure(first)
    candidates = [(structure, leaves)]
    if structure.num_nodes > 1 and structure.children():
        head = structure.children()[0]
        candidates.append((head, leaves[: head.num_leaves]))
    given = jax.tree_util.tree_leaves(first)
    for candidate, candidate_leaves in candidates:
        if candidate != wanted or len(candidate_leaves) != len(given):
            continue
        if all(_same_array(a, b) for a, b in zip(given, candidate_leaves, strict=True)):
            return call.names[0]
    return None


def _same_array(given: Any, result: Any) -> bool:
    """Whether a result leaf can take a given leaf's buffer: both arrays of one shape and dtype."""
    shape = getattr(given, "shape", None)
    if shape is None or not is_jax_array(result):
        return not is_jax_array(result) and shape is None
    from ._call import traced_dtype

    return tuple(shape) == tuple(result.shape) and traced_dtype(given.dtype) == result.dtype
