"""A step's loops with their batch-major carries kept in the batch's layout.

Inside a ``while`` loop, XLA's partitioner gives a loop-carried value one layout for every
iteration, and it is free to choose it: under FSDP it drops the activations' batch split and
computes each layer's products as contractions over the split hidden axis, all-reducing the whole
batch's activations in every layer, forward and backward. A scanned model (``jax.lax.scan``,
Flax's ``nn.scan`` and ``nnx.scan``, Equinox's scan over stacked layers) is such a loop. One
sharding constraint of the carry to the batch's layout, at the top and the bottom of the body,
gives the program such models are trained with: weights gathered, gradients reduce-scattered,
activations never reduced.

:func:`constrained_jaxpr` rewrites a step's jaxpr (from ``jax.make_jaxpr`` or ``jit(...).trace``):
it finds the loops whose carry comes from the batch with the batch on its first axis
(``_batch_axes``), and adds the constraint there, through ``jit``, ``checkpoint``, custom
derivatives and ``cond`` to any depth. The program computes the same values: a constraint
changes a layout, never a value. Each loop found is a :class:`LoopNote` (its source line, and
which carries were constrained or why none could be).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .._language._errors import EinshardError
from ._batch_axes import ABSENT, REDUCED, UNKNOWN, Axis, loop_carries, read
from ._jaxprs import (
    closed_jaxpr,
    evaluate,
    inner_jaxpr,
    is_backward,
    is_jaxpr,
    scan_counts,
    user_line,
    var_shape,
)

__all__ = ["LoopNote", "constrained_jaxpr", "has_loop"]

_LOOPS = frozenset({"scan", "while"})
_BODY = {"scan": "jaxpr", "while": "body_jaxpr"}


@dataclasses.dataclass(frozen=True)
class LoopNote:
    """A loop of the step whose carry comes from the batch.

    Attributes:
        source: The user's line of the loop (``'model.py:42'``), or ``''`` where JAX kept none.
        primitive: ``'scan'`` or ``'while'``.
        backward: Whether it is the loop of the backward pass (JAX's transpose of a forward loop).
        constrained: How many of its carries were constrained to the batch's layout.
        reason: Why none could be, or ``None`` (``'the batch is axis 1 of its carry f32[16,8,64]'``).
    """

    source: str
    primitive: str
    backward: bool
    constrained: int
    reason: str | None = None

    def __str__(self) -> str:
        where = self.source or "a loop without a source line"
        kind = f"{self.primitive}, backward" if self.backward else self.primitive
        if self.constrained:
            carries = "carry" if self.constrained == 1 else "carries"
            return f"{where} ({kind}): {self.constrained} {carries} kept in the batch's layout"
        return f"{where} ({kind}): not constrained: {self.reason}"


def has_loop(jaxpr: Any, memo: dict[int, bool] | None = None) -> bool:
    """Whether the jaxpr has a ``scan`` or ``while`` anywhere (inside calls and branches too).

    ``memo``: answers already found, by the jaxpr's id, for the calls of one walk (a program
    shares its sub-jaxprs between call sites); kept by the caller only while the jaxprs live.
    """
    memo = {} if memo is None else memo
    jaxpr = inner_jaxpr(jaxpr)
    known = memo.get(id(jaxpr))
    if known is not None:
        return known
    found = False
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _LOOPS or any(has_loop(sub, memo) for sub in _sub_jaxprs(eqn)):
            found = True
            break
    memo[id(jaxpr)] = found
    return found


def _sub_jaxprs(eqn: Any) -> list[Any]:
    out = []
    for value in eqn.params.values():
        if is_jaxpr(value):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out += [item for item in value if is_jaxpr(item)]
    return out


Fits = Callable[[tuple[int, ...]], "str | None"]


def constrained_jaxpr(
    jaxpr: Any,
    in_axes: Sequence[Axis],
    constrain: Callable[[Any], Any],
    fits: Fits | None = None,
) -> tuple[Any, tuple[LoopNote, ...]]:
    """``jaxpr`` (open) with its loops' batch-major carries passed through ``constrain``.

    Args:
        jaxpr: The step's program (open or closed).
        in_axes: The batch's axis of each input (``0`` for the batch argument's leaves, ``None``
            for the others).
        constrain: The sharding constraint of a batch-major array (its first axis the batch),
            traced inside the loop's body.
        fits: Why a batch-major carry of this shape cannot take the constraint (its first axis
            does not divide), or ``None`` when it can; default: every carry can.

    Returns:
        The open jaxpr (the same object when nothing changed), and a note per loop whose carry
        comes from the batch, outermost first.
    """
    notes: list[LoopNote] = []
    rewrite = _Rewrite(constrain, fits or (lambda shape: None), notes)
    rewritten = rewrite.jaxpr(inner_jaxpr(jaxpr), list(in_axes))
    return rewritten, tuple(notes)


class _Rewrite:
    def __init__(self, constrain: Callable[[Any], Any], fits: Fits, notes: list[LoopNote]) -> None:
        self.constrain = constrain
        self.fits = fits
        self.notes = notes
        self.loops: dict[int, bool] = {}  # has_loop's answers for this walk (its jaxprs stay alive)

    def has_loop(self, jaxpr: Any) -> bool:
        return has_loop(jaxpr, self.loops)

    def jaxpr(self, jaxpr: Any, in_axes: list[Axis]) -> Any:
        return _rewrite(jaxpr, in_axes, self)


def _rewrite(jaxpr: Any, in_axes: list[Axis], rewrite: _Rewrite) -> Any:
    if not rewrite.has_loop(jaxpr):
        return jaxpr
    reading = read(jaxpr, in_axes)
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        ins = reading.inputs(eqn)
        name = eqn.primitive.name
        if name in _LOOPS:
            new = _loop(eqn, ins, rewrite)
        elif name == "cond":
            new = _branches(eqn, ins[1:], rewrite)
        else:
            new = _calls(eqn, ins, rewrite)
        changed |= new is not eqn
        eqns.append(new)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _with_param(
    eqn: Any, key: str, original: Any, open_jaxpr: Any, consts: Sequence[Any] | None = None
) -> Any:
    """The equation with one sub-program replaced, of the same type (closed or open) as before.

    ``consts``: the new program's constants (default: the old one's, for a program rewritten in
    place); an open program takes none.
    """
    if hasattr(original, "consts"):
        value: Any = closed_jaxpr(open_jaxpr, original.consts if consts is None else consts)
    else:
        assert not consts, "an open jaxpr takes no constants"
        value = open_jaxpr
    return eqn.replace(params={**eqn.params, key: value})


def _calls(eqn: Any, ins: list[Axis], rewrite: _Rewrite) -> Any:
    """A call (``jit``, ``checkpoint``, a custom derivative) whose program has loops: rewritten inside."""
    for key, value in eqn.params.items():
        if not is_jaxpr(value):
            continue
        inner = inner_jaxpr(value)
        if len(inner.invars) != len(ins) or not rewrite.has_loop(inner):
            continue
        new = _rewrite(inner, ins, rewrite)
        if new is not inner:
            eqn = _with_param(eqn, key, value, new)
    return eqn


def _branches(eqn: Any, operands: list[Axis], rewrite: _Rewrite) -> Any:
    branches = eqn.params["branches"]
    new = []
    for branch in branches:
        inner = inner_jaxpr(branch)
        rewritten = _rewrite(inner, operands, rewrite)
        if rewritten is inner:
            new.append(branch)
        elif hasattr(branch, "consts"):
            new.append(closed_jaxpr(rewritten, branch.consts))
        else:
            new.append(rewritten)
    if all(a is b for a, b in zip(new, branches, strict=True)):
        return eqn
    return eqn.replace(params={**eqn.params, "branches": type(branches)(new)})


def _loop(eqn: Any, ins: list[Axis], rewrite: _Rewrite) -> Any:
    name = eqn.primitive.name
    notes = rewrite.notes
    try:
        found = loop_carries(eqn, ins)
    except EinshardError as error:  # a loop this JAX version writes in a way einshard cannot read
        notes.append(LoopNote(user_line(eqn), name, is_backward(eqn), 0, error.headline))
        return eqn
    assert found is not None
    carries, body_inputs = found
    key = _BODY[name]
    original = eqn.params[key]
    body = inner_jaxpr(original)
    position = len(notes)
    inner = _rewrite(body, body_inputs, rewrite)
    first = len(body_inputs) - len(carries) if name == "while" else scan_counts(eqn.params, len(ins))[0]
    leading = [i for i, axis in enumerate(carries) if axis == 0]
    refused = {i: rewrite.fits(var_shape(body.invars[first + i])) for i in leading}
    targets = [i for i in leading if refused[i] is None]
    other = [(i, axis) for i, axis in enumerate(carries) if axis not in (ABSENT, REDUCED, 0)]
    note = None
    if targets:
        closed = hasattr(original, "consts")
        consts = original.consts if closed else ()
        retraced = _retraced(inner, consts, first, targets, rewrite.constrain, closed)
        if retraced is None:
            note = LoopNote(user_line(eqn), name, is_backward(eqn), 0, _NOT_RETRACED)
        else:
            new_open, new_consts = retraced
            note = LoopNote(user_line(eqn), name, is_backward(eqn), len(targets))
            notes.insert(position, note)
            return _with_param(eqn, key, original, new_open, new_consts)
    elif leading:
        index = leading[0]
        shape = var_shape(body.invars[first + index])
        reason = f"{refused[index]} (its carry {_aval_text(body.invars[first + index], shape)})"
        note = LoopNote(user_line(eqn), name, is_backward(eqn), 0, reason)
    elif other:
        index, axis = other[0]
        shape = var_shape(body.invars[first + index])
        where = f"axis {axis}" if axis != UNKNOWN else "an axis einshard cannot tell"
        note = LoopNote(
            user_line(eqn),
            name,
            is_backward(eqn),
            0,
            f"the batch is {where} of its carry {_aval_text(body.invars[first + index], shape)}, "
            "not its first",
        )
    if note is not None:
        notes.insert(position, note)
    return eqn if inner is body else _with_param(eqn, key, original, inner)


_NOT_RETRACED = "its body could not be traced again with the constraint (please report it)"


def _aval_text(var: Any, shape: tuple[int, ...]) -> str:
    dtype = getattr(getattr(var, "aval", None), "dtype", "")
    return f"{getattr(dtype, 'name', dtype)}[{','.join(map(str, shape))}]"


def _retraced(
    body: Any,
    consts: Sequence[Any],
    first: int,
    targets: list[int],
    constrain: Callable[[Any], Any],
    closed: bool,
) -> tuple[Any, list[Any]] | None:
    """The loop body traced again with ``constrain`` on its carries ``targets``, in and out.

    ``None`` where the new body's inputs or outputs differ from the old one's in type (the loop
    would not accept it), or where it has constants and the loop takes an open program.
    """
    import jax

    def constrained(*args: Any) -> list[Any]:
        args_list = list(args)
        for i in targets:
            args_list[first + i] = constrain(args_list[first + i])
        outs = evaluate(body, consts, *args_list)
        for i in targets:
            outs[i] = constrain(outs[i])
        return outs

    structs = [_struct(var) for var in body.invars]
    try:
        traced = jax.make_jaxpr(constrained)(*structs)
    except Exception:
        return None
    new = traced.jaxpr
    same = [_type(v) for v in new.invars] == [_type(v) for v in body.invars] and [
        _type(v) for v in new.outvars
    ] == [_type(v) for v in body.outvars]
    if not same or (traced.consts and not closed):
        return None
    return new, list(traced.consts)


def _struct(var: Any) -> Any:
    import jax

    aval = var.aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _type(atom: Any) -> tuple:
    aval = atom.aval
    return (
        tuple(getattr(aval, "shape", ())),
        str(getattr(aval, "dtype", "")),
        getattr(aval, "weak_type", False),
    )
