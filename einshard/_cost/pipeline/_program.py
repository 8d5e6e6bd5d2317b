"""The program a step compiles to, as training runs it: traced once, its state donated, its loops kept split.

A plain step is traced once (``jax.jit(...).trace``), under its strategy when a strategy laid
its arguments out (so that :func:`~einshard.like_batch` in the model constrains to that
strategy's batch). A plan traces it once for all its candidates: a trace in which no
``like_batch`` ran is every strategy's program (the arguments' shardings are given when it is
lowered), kept on the call (:attr:`StepCall.traces <einshard._tracing._call.StepCall>`, the
plan's first trace: its roles' and bounds') and lowered again for each candidate; a step that
calls ``like_batch`` is traced under each candidate's strategy. Then, before lowering:

* **Constants.** Equal constants, and equal equations on them (a table each unrolled layer
  gathers again), are kept once (``_tracing._constants``): XLA would fold each copy on its own,
  slowly, and then merge them.

* **Donation.** A step whose first argument comes back updated (the whole result, or its first
  element, has that argument's tree, shapes and dtypes) is a training step: every training loop
  donates that argument, so its buffers hold the result. The program is compiled so, and the
  report's memory says which argument was donated (``donate=False`` opts out).
* **Loops.** Under a strategy that splits the batch, the step's loops whose carry comes from the
  batch with the batch first (a scanned model's activations) get that carry constrained to the
  batch's layout (``_tracing._loops``), unless the model constrains it so itself
  (``like_batch``); each such loop is a :class:`~einshard._tracing._loops.LoopNote` of the
  report, saying whose constraint keeps it. Under a plain table that splits the batch, the
  loops the model keeps are noted all the same. ``like_batch`` calls that split another axis
  than the batch's are warned of.

A step with its own ``lower`` and ``trace`` (``jax.jit``, ``nnx.jit``: each array leaf, a
``ShapeDtypeStruct`` too, is an argument of their program) keeps its own shardings and donation:
it is lowered as it is, unless it has loops to constrain or note, when it is traced through (its
own donation kept, read from ``Traced.args_info``; its program's parameters matched to the
call's leaves, so a jit with static arguments, or with a Python number among its dynamic ones,
keeps its loops too). Any other step (``equinox.filter_jit``, which holds a ``ShapeDtypeStruct``
leaf static, as it holds whatever is not an array, and whose compiled program has no text) is
compiled as a plain function, inside einshard's own ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..._arrays._arrays import einshard
from ..._arrays._leaves import is_jax_array
from ..._language._errors import EinshardError, EinshardWarning
from ..._sharding._devices import call_devices
from ..._tracing._batch_layout import (
    batch_expression_for,
    batch_split,
    like_batch_calls,
    marks,
    strategy_batch,
    traced_under,
)
from ..._tracing._call import StepCall, Trace, trace_key
from ..._tracing._constants import shared_constants
from ..._tracing._jaxprs import evaluate, inner_jaxpr, is_backward, runs, user_line
from ..._tracing._loops import LoopNote, constrained_jaxpr, has_loop, misplaced_marks
from ..._trees._strategy import Strategy

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

    ``own=False``: a step with a ``lower`` method is compiled as a plain function all the same.
    """
    import jax

    if own and _lowers_itself(call.fn):
        own_program = _own_program(call)
        if own_program is not None:
            return own_program
    arrays = [call.leaves[i] for i in call.arrays]
    key = trace_key(call.donate, arrays)
    kept = call.traces.get(key)
    if kept is not None:  # traced before (the roles' trace, another candidate's), with no like_batch
        closed = shared_constants(kept.jaxpr)
        donated = _updated_first_argument(call, kept.result) if call.donate else None
        jaxpr, loops = _constrained(call, closed, marked=marks())
    else:
        flat, outputs = _flat(call)
        called = like_batch_calls()
        marked = marks()
        traced = jax.jit(traced_under(call.batch_layout, flat), keep_unused=True).trace(*arrays)
        donated = _updated_first_argument(call, outputs) if call.donate else None
        if like_batch_calls() == called:
            # No like_batch in the step: the program is every strategy's (the arguments'
            # shardings are given when it is lowered, not traced into it).
            call.traces[key] = Trace.of(traced.jaxpr, *outputs)
        outputs.clear()  # the traced values: not kept
        closed = shared_constants(traced.jaxpr)
        jaxpr, loops = _constrained(call, closed, marked=marked)
        if closed is traced.jaxpr and jaxpr is closed.jaxpr and donated is None:
            return Program(traced.lower, loops)
    donate = _argument_arrays(call, 0) if donated is not None else ()

    def run(*arrays: Any) -> Any:
        return evaluate(jaxpr, closed.consts, *arrays)

    run.__name__ = getattr(call.fn, "__name__", "step")
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
    and the bottom of the body (as :func:`~einshard.like_batch` would there), unless the model
    constrains it so itself. It is traced under :func:`~einshard.use_strategy` too, so
    ``like_batch`` in the model follows the same strategy; a ``like_batch`` that splits another
    axis than the batch's (a sequence-major carry, inside ``jax.vmap``) is warned of. The values
    it computes are the step's: a constraint moves data, never changes it.

    The batch argument is the one named ``batch``, else the last positional one (as
    :func:`~einshard.explain_step` says). Jit it as you would the step.

    Args:
        step: The training step, ``step(params, batch)`` or ``step(state, batch)``.
        strategy: A :class:`~einshard.strategies.Strategy` (``plan(...).best``), or the batch's
            expression (``'b ... -> b* ...'``).

    Returns:
        A function with the step's signature and results.

    Raises:
        EinshardError: If ``strategy`` is neither, or (when the step is traced) a loop's
            batch-major carry does not split into the batch's parts (a batch of 12 on 8
            devices): the loop cannot be kept split, and JAX would refuse the batch laid out so
            too. (``explain_step`` and ``plan`` report such a loop as not kept instead.)

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
        marked = marks()
        closed = jax.make_jaxpr(traced_under(batch, flat))(*arrays)
        structure, leaves = outputs
        outputs.clear()
        jaxpr, notes = _constrained(call, closed, marked=marked)
        refused = [note for note in notes if note.reason and note.reason.startswith(_INDIVISIBLE)]
        if refused:
            note = refused[0]
            raise EinshardError(
                f"constrain_loops cannot keep the loop at {note.source or 'a line JAX did not keep'} in "
                f"the batch's layout: {note.reason}",
                hint="Give a batch whose first axis divides into the batch's parts (pad it, or drop the "
                "last examples), or a strategy that splits it into fewer parts; the batch argument must "
                "divide so too, to be laid out as the strategy says.",
            )
        results = iter(evaluate(jaxpr, closed.consts, *arrays))
        rebuilt = [next(results) if is_jax_array(leaf) else leaf for leaf in leaves]
        return jax.tree_util.tree_unflatten(structure, rebuilt)

    return constrained


def _lowers_itself(fn: Any) -> bool:
    """Whether a step is lowered as it is: one with ``lower`` and ``trace`` (``jax.jit``, ``nnx.jit``)."""
    return callable(getattr(fn, "lower", None)) and callable(getattr(fn, "trace", None))


def _own_program(call: StepCall) -> Program | None:
    """A ``jax.jit``-like step lowered as it is, or ``None`` when einshard compiles it (see the module)."""
    fn = call.fn
    batch = call.batch_layout
    trace = fn.trace
    constrains = batch is not None and batch_split(batch, call_devices(None).count) > 1
    if not (constrains or _batch_parts(call) > 1):
        return Program(lambda: traced_under(batch, fn.lower)(*call.args, **call.kwargs))
    clear = getattr(fn, "clear_cache", None)
    if constrains and callable(clear):  # a trace under another strategy's like_batch is not this one's
        clear()
    marked = marks()
    traced = traced_under(batch, trace)(*call.args, **call.kwargs)
    if not has_loop(traced.jaxpr):
        return Program(traced.lower)
    return _traced_through(call, traced, marked)


def _traced_through(call: StepCall, traced: Any, marked: int) -> Program:
    """A ``jax.jit`` step with loops: its program rewritten (or its loops noted), its own donation kept."""
    import jax

    closed = traced.jaxpr
    infos = jax.tree_util.tree_leaves(traced.args_info)
    leaves = _dynamic_leaves(call, traced)
    if leaves is None:  # einshard cannot tell which of the call's leaves the program takes
        return Program(traced.lower, _unmatched_loops(closed.jaxpr))
    jaxpr, loops = _constrained(call, closed, leaves, marked=marked)
    if jaxpr is closed.jaxpr:  # nothing added (no strategy, or loops the model keeps itself)
        return Program(traced.lower, loops)
    donate = tuple(k for k, info in enumerate(infos) if getattr(info, "donated", False))
    arrays = set(call.arrays)
    arguments = [
        call.leaves[i] if i in arrays else _struct(var.aval)
        for i, var in zip(leaves, closed.jaxpr.invars, strict=True)
    ]

    def run(*arrays: Any) -> Any:
        return evaluate(jaxpr, closed.consts, *arrays)

    run.__name__ = getattr(call.fn, "__name__", "step")
    program = jax.jit(run, keep_unused=True, donate_argnums=donate)
    return Program(lambda: program.lower(*arguments), loops)


def _dynamic_leaves(call: StepCall, traced: Any) -> list[int] | None:
    """For each parameter of a jit's traced program, the position of the call's leaf it is.

    The jit leaves out its static arguments (``static_argnums``, ``static_argnames``) and takes
    every other leaf, a Python number included (which einshard's own compile holds static):
    its arguments are matched to the call's in order, by their trees and shapes. ``None`` where
    they do not match.
    """
    import jax

    try:
        given_args, given_kwargs = traced.args_info
    except (TypeError, ValueError):
        return None

    def same(info_tree: Any, position: int) -> bool:
        inside = call.argument_leaves(position)
        infos = jax.tree_util.tree_leaves(info_tree)
        if len(infos) != len(inside):
            return False
        return all(
            tuple(getattr(info, "shape", ())) == tuple(getattr(call.leaves[i], "shape", ()))
            for info, i in zip(infos, inside, strict=True)
        )

    positions: list[int] = []
    k = 0
    for tree in given_args:
        while k < len(call.args) and not same(tree, k):
            k += 1
        if k == len(call.args):
            return None
        positions.append(k)
        k += 1
    for name in sorted(given_kwargs):  # a dict's keys flatten sorted
        if name not in call.names or not same(given_kwargs[name], call.names.index(name)):
            return None
        positions.append(call.names.index(name))
    leaves = [i for position in positions for i in call.argument_leaves(position)]
    return leaves if len(leaves) == len(traced.jaxpr.jaxpr.invars) else None


def _unmatched_loops(jaxpr: Any) -> tuple[LoopNote, ...]:
    """A note for each loop of a program whose parameters einshard could not match to the call's."""
    reason = (
        "einshard cannot tell which of the call's arguments the jitted step's program takes "
        "(give the step unjitted: explain_step and plan compile it as jax.jit does)"
    )
    notes: list[LoopNote] = []

    def walk(program: Any) -> None:
        for eqn in inner_jaxpr(program).eqns:
            if eqn.primitive.name in ("scan", "while"):
                notes.append(LoopNote(user_line(eqn), eqn.primitive.name, is_backward(eqn), 0, reason))
                continue  # its body's loops are its own
            called = runs(eqn)
            for sub in called.programs if called is not None else ():
                walk(sub)

    walk(jaxpr)
    return tuple(notes)


def _struct(aval: Any) -> Any:
    import jax

    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


_INDIVISIBLE = "its first axis"  # how the reason a carry cannot be split begins (_constrained's fits)


def _constrained(
    call: StepCall, closed: Any, leaves: Sequence[int] | None = None, *, marked: int | None = None
) -> tuple[Any, tuple[LoopNote, ...]]:
    """The traced program with its batch-major loop carries constrained, and the loops' notes.

    ``leaves``: the call's leaf each parameter of the program is (default: its array leaves, as
    einshard's own compile takes them). With the call's strategy, the carries the model does
    not keep itself are constrained to its batch; without one, the loops the model keeps are
    noted. ``marked``: :func:`~einshard._tracing._batch_layout.marks` before the trace: when
    ``like_batch`` ran in it, the calls that split another axis than the batch's are warned of.
    """
    batch = call.batch_layout
    n_devices = call_devices(None).count
    parts = batch_split(batch, n_devices) if batch is not None else _batch_parts(call)
    if parts == 1 or call.batch_name is None:  # the batch is not split (tensor parallel's copies)
        return closed.jaxpr, ()
    batch_leaves = set(call.argument_leaves(call.names.index(call.batch_name)))
    in_axes = [
        0 if i in batch_leaves and len(getattr(call.leaves[i], "shape", ())) else None
        for i in (call.arrays if leaves is None else leaves)
    ]
    if marked is not None and marks() != marked:
        _warn_misplaced(closed.jaxpr, in_axes)
    if not has_loop(closed.jaxpr):
        return closed.jaxpr, ()
    if batch is None:
        return constrained_jaxpr(closed.jaxpr, in_axes, None, parts=parts)

    def constrain(x: Any) -> Any:
        return einshard(x, batch_expression_for(batch, len(x.shape), n_devices))

    def fits(shape: tuple[int, ...]) -> str | None:
        if shape and shape[0] % parts == 0:
            return None
        size = shape[0] if shape else "none"
        return f"{_INDIVISIBLE} ({size}) does not split into the batch's {parts} parts"

    return constrained_jaxpr(closed.jaxpr, in_axes, constrain, fits, parts)


def _batch_parts(call: StepCall) -> int:
    """Into how many parts the arguments' layout splits the batch (1: not split, or no batch).

    Read off the table's assignment of the batch argument's leaves, or their own shardings.
    """
    if call.batch_name is None:
        return 1
    parts = 1
    for i in call.argument_leaves(call.names.index(call.batch_name)):
        leaf = call.leaves[i]
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            continue
        assignment = call.layouts[i] if call.layouts is not None else None
        if assignment is not None:
            parts = max(parts, int(assignment.layout.shards[0]))
            continue
        sharding = getattr(leaf, "sharding", None)
        try:
            block = sharding.shard_shape(shape) if sharding is not None else shape
        except Exception:  # a sharding that cannot say: as if whole
            block = shape
        parts = max(parts, shape[0] // max(block[0], 1))
    return parts


def _warn_misplaced(jaxpr: Any, in_axes: list[Any]) -> None:
    """An ``EinshardWarning`` for each ``like_batch`` call that splits another axis than the batch's."""
    for line, array, axis, split in dict.fromkeys(misplaced_marks(jaxpr, in_axes)):
        where = line or "a line JAX did not keep"
        if axis > 0:
            warnings.warn(
                f"einshard.like_batch at {where} splits axis 0 of {array}, whose batch is axis {axis}: "
                f"it lays out another axis than the batch's (the values stay right). Call it on a "
                f"batch-major array (jnp.moveaxis(x, {axis}, 0)), or lay this one out yourself with "
                "jax.lax.with_sharding_constraint",
                EinshardWarning,
                stacklevel=2,
            )
        else:
            warnings.warn(
                f"einshard.like_batch at {where} splits axis {split} of {array} and leaves its batch "
                "(axis 0) whole: inside jax.vmap it sees one example, whose first axis is not the "
                "batch's (the values stay right). Call it outside the vmap, on the batched array",
                EinshardWarning,
                stacklevel=2,
            )


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
    import jax

    shape = getattr(given, "shape", None)
    array = is_jax_array(result) or isinstance(result, jax.ShapeDtypeStruct)  # a kept trace's result
    if shape is None or not array:
        return not array and shape is None
    from ..._tracing._call import traced_dtype

    return tuple(shape) == tuple(result.shape) and traced_dtype(given.dtype) == result.dtype
