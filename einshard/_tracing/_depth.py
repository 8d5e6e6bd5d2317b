"""The step at a smaller depth, as a call the compile takes like any other.

A plan ranks a step of ``N`` repeated layers from compiles of the same step at two small depths
(:class:`AtDepth`, a table to compile at a depth). :func:`call_at_depth` makes that step: its
program is :meth:`Blocks.at_depth <einshard._tracing._blocks.Blocks.at_depth>`'s, its arguments
the step's with the removed layers' leaves left out (``None``: a pytree node with no leaves, so
every other leaf keeps its path and the rules lay it out as in the whole step), and its result the
step's with the same leaves left out (so a training step's first argument still comes back
updated, and is donated).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._arrays._leaves import is_traced
from .._trees._rules import RulesLike
from ._blocks import Blocks, NotLayers
from ._call import StepCall, Trace, kept_trace
from ._jaxprs import evaluate

__all__ = ["AtDepth", "call_at_depth", "repeated_layers"]


@dataclasses.dataclass(frozen=True)
class AtDepth:
    """A table to compile the step under at ``depth`` of its repeated layers (a plan's sample).

    Pickled into a plan's child process with the other tables: the child cuts its own trace of
    the step, as the parent would.
    """

    rules: RulesLike
    depth: int


def repeated_layers(call: StepCall) -> Blocks | str:
    """The step's repeated layers, or why it cannot be cut (a sentence).

    Raises:
        EinshardError: When the step cannot be traced (:func:`~._call.trace`).
    """
    kept = kept_trace(call)
    if kept is None:
        return "it calls like_batch, so each candidate's program is traced under its own strategy"
    return kept.blocks


def call_at_depth(call: StepCall, depth: int) -> StepCall:
    """``call``'s step at ``depth`` of its repeated layers (see the module); made once per trace and depth.

    Raises:
        NotLayers: When the step has no repeated layers to cut (:func:`repeated_layers` says why).
    """
    kept = kept_trace(call)
    blocks = kept.blocks if kept is not None else None
    if kept is None or not isinstance(blocks, Blocks):
        raise NotLayers(f"the step cannot be cut to {depth} layers: {repeated_layers(call)}")
    if depth not in kept.depths:
        kept.depths[depth] = _cut_call(call, kept, blocks, depth)
    made: StepCall = kept.depths[depth]
    return made.donating(call.donate)


def _cut_call(call: StepCall, kept: Trace, blocks: Blocks, depth: int) -> StepCall:
    import jax

    cut = blocks.at_depth(depth)
    inputs = set(cut.inputs)
    leaves = list(call.leaves)
    for position, leaf_index in enumerate(call.arrays):
        if position not in inputs:
            leaves[leaf_index] = None
    args, kwargs = jax.tree_util.tree_unflatten(call._treedef, leaves)
    structure, result_leaves = kept.result
    array_places = [i for i, leaf in enumerate(result_leaves) if isinstance(leaf, jax.ShapeDtypeStruct)]
    kept_places = [array_places[k] for k in cut.outputs]
    program, consts = cut.jaxpr.jaxpr, cut.jaxpr.consts

    def step_at_depth(*args: Any, **kwargs: Any) -> Any:
        arrays = [leaf for leaf in jax.tree_util.tree_leaves((args, kwargs)) if is_traced(leaf)]
        outputs = evaluate(program, consts, *arrays)
        result: list[Any] = list(result_leaves)
        for place in array_places:
            result[place] = None
        for place, value in zip(kept_places, outputs, strict=True):
            result[place] = value
        return jax.tree_util.tree_unflatten(structure, result)

    step_at_depth.__name__ = f"{getattr(call.fn, '__name__', 'step')}_at_{depth}_layers"
    step_at_depth.__wrapped__ = call.fn  # type: ignore[attr-defined]  # its arguments' names: the step's
    return StepCall.of(step_at_depth, tuple(args), dict(kwargs))
