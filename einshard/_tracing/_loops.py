"""A step's loops with their batch-major carries kept in the batch's layout.

Inside a ``while`` loop, XLA's partitioner gives a loop-carried value one layout for every
iteration, and it is free to choose it: under FSDP, given only the arguments' layouts, it may drop
the activations' batch split and compute each layer's products as contractions over the split
hidden axis, all-reducing the whole batch's activations in every layer, forward and backward. A
scanned model (``jax.lax.scan``, Flax's ``nn.scan`` and ``nnx.scan``, Equinox's scan over stacked
layers) is such a loop. One sharding constraint of the carry to the batch's layout, at the top
and the bottom of the body, keeps the carry split.

:func:`constrained_jaxpr` rewrites a step's jaxpr (from ``jax.make_jaxpr`` or ``jit(...).trace``):
it finds the loops whose carry comes from the batch with the batch on its first axis
(``_batch_axes``), and adds the constraint there, through ``jit``, ``checkpoint``, custom
derivatives and ``cond`` to any depth. The program computes the same values: a constraint
changes a layout, never a value. A carry the model keeps itself (a sharding constraint to the
batch's layout on it at the top or the bottom of the body: ``einshard.like_batch``) is left as
it is. Each loop found is a :class:`LoopNote` (its source line, which carries were kept and by
whom, or why none could be). Without a constraint to add (no strategy), the loops the model
keeps are noted all the same.

:func:`misplaced_marks` finds the ``like_batch`` calls that lay out another axis than the batch's
(a sequence-major array, a ``jax.vmap``'s per-example one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .._language._errors import EinshardError
from ._batch_axes import ABSENT, REDUCED, UNKNOWN, Axis, batch_axes_of, loop_carries
from ._jaxprs import (
    CALL,
    closed_jaxpr,
    evaluate,
    inner_jaxpr,
    is_backward,
    runs,
    scan_counts,
    user_line,
    var_shape,
)

__all__ = ["BY_EINSHARD", "BY_MODEL", "MARK", "LoopNote", "constrained_jaxpr", "has_loop", "misplaced_marks"]

BY_EINSHARD = "einshard"
"""A carry kept by einshard's constraint (``constrain_loops``, ``plan``, ``explain_step`` with a strategy)."""
BY_MODEL = "model"
"""A carry kept by the model's own constraint (``einshard.like_batch`` in the loop's body)."""
MARK = "like_batch"
"""The name scope of :func:`~einshard.like_batch`'s constraints: how the program tells them apart."""

_LOOPS = frozenset({"scan", "while"})
_BODY = {"scan": "jaxpr", "while": "body_jaxpr"}


@dataclasses.dataclass(frozen=True)
class LoopNote:
    """A loop of the step whose carry comes from the batch.

    Attributes:
        source: The user's line of the loop (``'model.py:42'``: the ``jax.lax.scan`` call, or the
            model's call into a library's scan), or ``''`` where JAX kept none.
        primitive: ``'scan'`` or ``'while'``.
        backward: Whether it is a loop of the backward pass (JAX's transpose of a forward loop,
            or a loop inside one).
        constrained: How many of its carries are kept in the batch's layout.
        reason: Why none is, or ``None`` (``'the batch is axis 1 of its carry f32[16,8,64]'``).
        constrained_by: Whose constraint keeps them: ``'einshard'`` (the step compiled by
            :func:`~einshard.constrain_loops`, as ``plan`` and ``explain_step`` with a strategy
            do), ``'model'`` (the model's own: :func:`~einshard.like_batch` in the body), or
            ``None`` when none is kept.
    """

    source: str
    primitive: str
    backward: bool
    constrained: int
    reason: str | None = None
    constrained_by: str | None = None

    def __str__(self) -> str:
        where = self.source or "a loop without a source line"
        kind = f"{self.primitive}, backward" if self.backward else self.primitive
        if self.constrained:
            carries = "carry" if self.constrained == 1 else "carries"
            by = " by the model's own constraint" if self.constrained_by == BY_MODEL else " by einshard"
            return f"{where} ({kind}): {self.constrained} {carries} kept in the batch's layout{by}"
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


def _sub_jaxprs(eqn: Any) -> tuple[Any, ...]:
    called = runs(eqn)
    return called.programs if called is not None else ()


Fits = Callable[[tuple[int, ...]], "str | None"]


def constrained_jaxpr(
    jaxpr: Any,
    in_axes: Sequence[Axis],
    constrain: Callable[[Any], Any] | None,
    fits: Fits | None = None,
    parts: int | None = None,
) -> tuple[Any, tuple[LoopNote, ...]]:
    """``jaxpr`` (open) with its loops' batch-major carries passed through ``constrain``.

    Args:
        jaxpr: The step's program (open or closed).
        in_axes: The batch's axis of each input (``0`` for the batch argument's leaves, ``None``
            for the others).
        constrain: The sharding constraint of a batch-major array (its first axis the batch),
            traced inside the loop's body; ``None``: nothing is added, and only the loops the
            model keeps itself are noted.
        fits: Why a batch-major carry of this shape cannot take the constraint (its first axis
            does not divide), or ``None`` when it can; default: every carry can.
        parts: Into how many parts the batch's layout splits the batch: a carry the model
            constrains so itself (at the top or the bottom of the body) is kept by the model;
            ``None``: no constraint of the model's is recognised.

    Returns:
        The open jaxpr (the same object when nothing changed), and a note per loop whose carry
        comes from the batch, outermost first.
    """
    notes: list[LoopNote] = []
    rewrite = _Rewrite(constrain, fits or (lambda shape: None), notes, parts)
    rewritten = rewrite.jaxpr(inner_jaxpr(jaxpr), list(in_axes))
    return rewritten, tuple(notes)


class _Rewrite:
    def __init__(
        self, constrain: Callable[[Any], Any] | None, fits: Fits, notes: list[LoopNote], parts: int | None
    ) -> None:
        self.constrain = constrain
        self.fits = fits
        self.notes = notes
        self.parts = parts
        self.loops: dict[int, bool] = {}  # has_loop's answers for this walk (its jaxprs stay alive)

    def has_loop(self, jaxpr: Any) -> bool:
        return has_loop(jaxpr, self.loops)

    def jaxpr(self, jaxpr: Any, in_axes: list[Axis]) -> Any:
        return _rewrite(jaxpr, in_axes, self, False)


def _rewrite(jaxpr: Any, in_axes: list[Axis], rewrite: _Rewrite, backward: bool) -> Any:
    """``backward``: the jaxpr is (inside) a loop or call of the backward pass.

    JAX names the transpose in the name stack of the equations it traces at the top level of
    the transposed program; the equations inside a transposed loop's body have name stacks of
    their own, so a loop inside it is of the backward pass by where it is.
    """
    if not rewrite.has_loop(jaxpr):
        return jaxpr
    axes = batch_axes_of(jaxpr, in_axes)
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        ins = axes.inputs(eqn)
        name = eqn.primitive.name
        inside = backward or is_backward(eqn)
        if name in _LOOPS:
            new = _loop(eqn, ins, rewrite, inside)
        elif name == "cond":
            new = _branches(eqn, ins[1:], rewrite, inside)
        else:
            new = _calls(eqn, ins, rewrite, inside)
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


def _calls(eqn: Any, ins: list[Axis], rewrite: _Rewrite, backward: bool) -> Any:
    """A call (``jit``, ``checkpoint``, a custom derivative) whose program has loops: rewritten inside.

    Not a ``shard_map``'s body: it sees one device's block, where the batch's layout means nothing.
    """
    called = runs(eqn)
    if called is None or called.how != CALL:
        return eqn
    (value,), (key,) = called.programs, called.keys
    inner = inner_jaxpr(value)
    if not rewrite.has_loop(inner):
        return eqn
    new = _rewrite(inner, ins, rewrite, backward)
    return eqn if new is inner else _with_param(eqn, key, value, new)


def _branches(eqn: Any, operands: list[Axis], rewrite: _Rewrite, backward: bool) -> Any:
    branches = eqn.params["branches"]
    new = []
    for branch in branches:
        inner = inner_jaxpr(branch)
        rewritten = _rewrite(inner, operands, rewrite, backward)
        if rewritten is inner:
            new.append(branch)
        elif hasattr(branch, "consts"):
            new.append(closed_jaxpr(rewritten, branch.consts))
        else:
            new.append(rewritten)
    if all(a is b for a, b in zip(new, branches, strict=True)):
        return eqn
    return eqn.replace(params={**eqn.params, "branches": type(branches)(new)})


def _loop(eqn: Any, ins: list[Axis], rewrite: _Rewrite, backward: bool) -> Any:
    name = eqn.primitive.name
    notes = rewrite.notes
    line = user_line(eqn)
    try:
        found = loop_carries(eqn, ins)
    except EinshardError as error:  # a loop this JAX version writes in a way einshard cannot read
        notes.append(LoopNote(line, name, backward, 0, error.headline))
        return eqn
    assert found is not None
    carries, body_inputs = found
    key = _BODY[name]
    original = eqn.params[key]
    body = inner_jaxpr(original)
    position = len(notes)
    inner = _rewrite(body, body_inputs, rewrite, backward)
    first = len(body_inputs) - len(carries) if name == "while" else scan_counts(eqn.params, len(ins))[0]
    leading = [i for i, axis in enumerate(carries) if axis == 0]
    own = [i for i in leading if _kept_by_model(body, first + i, i, rewrite.parts)]
    if rewrite.constrain is None:  # nothing to add: the model's own constraints are noted
        if own:
            notes.insert(position, LoopNote(line, name, backward, len(own), None, BY_MODEL))
        return eqn if inner is body else _with_param(eqn, key, original, inner)
    rest = [i for i in leading if i not in own]
    refused = {i: rewrite.fits(var_shape(body.invars[first + i])) for i in rest}
    targets = [i for i in rest if refused[i] is None]
    other = [(i, axis) for i, axis in enumerate(carries) if axis not in (ABSENT, REDUCED, 0)]
    note = None
    if targets:
        closed = hasattr(original, "consts")
        consts = original.consts if closed else ()
        retraced = _retraced(inner, consts, first, targets, rewrite.constrain, closed)
        if retraced is None and own:  # what the model keeps stays kept
            note = LoopNote(line, name, backward, len(own), None, BY_MODEL)
        elif retraced is None:
            note = LoopNote(line, name, backward, 0, _NOT_RETRACED)
        else:
            new_open, new_consts = retraced
            note = LoopNote(line, name, backward, len(targets) + len(own), None, BY_EINSHARD)
            notes.insert(position, note)
            return _with_param(eqn, key, original, new_open, new_consts)
    elif own:
        note = LoopNote(line, name, backward, len(own), None, BY_MODEL)
    elif leading:
        index = leading[0]
        shape = var_shape(body.invars[first + index])
        reason = f"{refused[index]} (its carry {_aval_text(body.invars[first + index], shape)})"
        note = LoopNote(line, name, backward, 0, reason)
    elif other:
        index, axis = other[0]
        shape = var_shape(body.invars[first + index])
        where = f"axis {axis}" if axis != UNKNOWN else "an axis einshard cannot tell"
        note = LoopNote(
            line,
            name,
            backward,
            0,
            f"the batch is {where} of its carry {_aval_text(body.invars[first + index], shape)}, "
            "not its first",
        )
    if note is not None:
        notes.insert(position, note)
    return eqn if inner is body else _with_param(eqn, key, original, inner)


# --- the model's own constraints --------------------------------------------------------------------


def _kept_by_model(body: Any, invar: int, outvar: int, parts: int | None) -> bool:
    """Whether the body constrains a carry to the batch's layout: its input at the top, or its output.

    At the top: a use of the carry as the body receives it (through calls: ``jit``,
    ``checkpoint``, custom derivatives) is a sharding constraint that splits its first axis into
    the batch's ``parts`` (``like_batch`` at the top of a layer). At the bottom: the carry the
    body returns is made by one (the backward loop of such a layer: the constraint's transpose).
    """
    if parts is None or parts < 2:
        return False
    return _constrained_use(body, body.invars[invar], parts, 0) or _constrained_result(
        body, body.outvars[outvar], parts, 0
    )


_DEPTH = 16  # calls inside calls followed at most (a framework's wrappers: a few)


def _constrained_use(jaxpr: Any, var: Any, parts: int, depth: int) -> bool:
    for eqn in jaxpr.eqns:
        if not any(atom is var for atom in eqn.invars):
            continue
        if eqn.primitive.name == "sharding_constraint" and _first_axis_parts(eqn) == parts:
            return True
        inner = _call_body(eqn)
        if inner is not None and depth < _DEPTH:
            for k, atom in enumerate(eqn.invars):
                if atom is var and _constrained_use(inner, inner.invars[k], parts, depth + 1):
                    return True
    return False


def _constrained_result(jaxpr: Any, var: Any, parts: int, depth: int) -> bool:
    for eqn in jaxpr.eqns:
        if not any(out is var for out in eqn.outvars):
            continue
        if eqn.primitive.name == "sharding_constraint":
            return _first_axis_parts(eqn) == parts
        inner = _call_body(eqn)
        if inner is None or depth >= _DEPTH:
            return False
        k = next(k for k, out in enumerate(eqn.outvars) if out is var)
        return _constrained_result(inner, inner.outvars[k], parts, depth + 1)
    return False


def _call_body(eqn: Any) -> Any:
    """The open program of a call whose inputs and outputs are the equation's, or ``None``."""
    called = runs(eqn)
    return called.bodies[0] if called is not None and called.how == CALL else None


def _split_axes(eqn: Any) -> list[int] | None:
    """Into how many parts a sharding constraint splits each axis of its operand, or ``None``."""
    sharding = eqn.params.get("sharding")
    shape = var_shape(eqn.invars[0])
    spec = getattr(sharding, "spec", None)
    mesh_shape = getattr(getattr(sharding, "mesh", None), "shape", None)
    if spec is None or mesh_shape is None:
        try:
            block = sharding.shard_shape(shape)
        except Exception:  # a sharding of another kind: einshard cannot tell
            return None
        return [whole // part if part else 1 for whole, part in zip(shape, block, strict=True)]
    parts = []
    for k in range(len(shape)):
        entry = spec[k] if k < len(spec) else None
        names = entry if isinstance(entry, tuple) else (entry,)
        count = 1
        for axis_name in names:
            if isinstance(axis_name, str):
                count *= int(mesh_shape.get(axis_name, 1))
        parts.append(count)
    return parts


def _first_axis_parts(eqn: Any) -> int | None:
    parts = _split_axes(eqn)
    return parts[0] if parts else None


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


# --- like_batch on another axis than the batch's ----------------------------------------------------


def misplaced_marks(jaxpr: Any, in_axes: Sequence[Axis]) -> list[tuple[str, str, int, int]]:
    """The ``like_batch`` constraints of a step that lay out another axis than the batch's.

    Each as ``(line, array, batch axis, split axis)``: a batch axis above 0 is a constraint that
    splits the first axis of an array whose batch is another, known axis (a sequence-major
    ``(S, B, D)`` array); a batch axis 0 one that leaves it whole and splits another (called
    on a ``jax.vmap``'s per-example array, whose first axis is not the batch). A constraint on
    a value whose batch axis the reading cannot tell is not judged.
    """
    found: list[tuple[str, str, int, int]] = []
    _marks(inner_jaxpr(jaxpr), list(in_axes), found, set())
    return found


def _marks(jaxpr: Any, in_axes: list[Axis], found: list, seen: set) -> None:
    key = (id(jaxpr), tuple(in_axes))
    if key in seen:
        return
    seen.add(key)
    axes = batch_axes_of(jaxpr, in_axes)
    for eqn in jaxpr.eqns:
        ins = axes.inputs(eqn)
        name = eqn.primitive.name
        if name == "sharding_constraint" and MARK in str(getattr(eqn.source_info, "name_stack", "")):
            _judge(eqn, ins[0], found)
        elif name in _LOOPS:
            try:
                loop = loop_carries(eqn, ins)
            except EinshardError:
                continue
            if loop is not None:
                _marks(inner_jaxpr(eqn.params[_BODY[name]]), loop[1], found, seen)
        elif name == "cond":
            for branch in eqn.params["branches"]:
                _marks(inner_jaxpr(branch), ins[1:], found, seen)
        else:
            inner = _call_body(eqn)
            if inner is not None:
                _marks(inner, ins, found, seen)


def _judge(eqn: Any, axis: Axis, found: list) -> None:
    if axis is None or axis < 0:
        return  # no batch, or an axis the reading cannot tell
    parts = _split_axes(eqn)
    if parts is None or not any(p > 1 for p in parts):
        return  # a strategy that copies the batch: nothing split
    var = eqn.invars[0]
    array = _aval_text(var, var_shape(var))
    if axis > 0 and parts[0] > 1:
        found.append((user_line(eqn), array, axis, 0))
    elif axis == 0 and parts[0] == 1:
        found.append((user_line(eqn), array, axis, next(k for k, p in enumerate(parts) if p > 1)))
