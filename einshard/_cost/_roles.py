"""Each parameter's role in a step, read from the step's dataflow rather than from its name.

``jax.make_jaxpr`` traces ``step(params, batch)`` on abstract inputs, and a small abstract
interpreter walks the program (into ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint``,
``custom_jvp`` / ``custom_vjp`` calls, ``shard_map``) following every axis of every parameter:

* where a weight meets the activations: the contraction, free and batch axes of a
  ``dot_general``, the feature axes of a convolution, the gathered axis of a lookup;
* where the axes of its output go: through reshapes, transposes, broadcasts, elementwise
  operations and reductions, into the contraction of a later weight (a Megatron column / row
  pair), into the batch axes of an attention product (heads), or into an operation that
  cannot take a split axis without a large collective (a *break*: a contraction with another
  activation, a slice, a sort, a callback).

Axes that must be split together form a group (a union-find over ``(leaf, axis)``); each group
has the bytes of parameters it would split and the bytes of the collectives it would cost per
step. :func:`assign` picks, for one model-axis size, the groups that split the most parameter
bytes per byte of communication, one axis per leaf, and says why for every leaf.

The backward pass of a training step (JAX marks its operations ``transpose(jvp(...))``) and what
is computed from the gradients (the optimizer) are not read: the forward pass decides.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._arrays._build import itemsize
from .._language._errors import EinshardError
from .._language._text import table_text

__all__ = ["LeafRole", "Roles", "assign", "read", "roles"]

_CONST, _PARAM, _ACT, _BACK = 0, 1, 2, 3
"""What a value derives from, in increasing precedence: constants only, parameters (a weight
and constants: a *view* of it), the batch (an activation), or the gradients (backward)."""

_EMPTY: frozenset = frozenset()

# Roles of a (leaf, axis) node, as the reading finds them.
_CORE = frozenset({"contraction", "free", "gathered", "conv-in", "conv-out", "batch"})


class _Value:
    """What the reader knows of one value: its kind, and per axis the tags it carries.

    A tag ``(node, outer, size)`` says that this axis is a factor of a parameter axis ``node``:
    ``outer`` is the product of the parameter axis's factors that are more major than this
    one, ``size`` this factor's length. Splitting the parameter axis ``p`` ways contiguously
    splits this axis too exactly when ``p`` does not divide ``outer``.
    """

    __slots__ = ("axes", "kind", "leaves")

    def __init__(self, kind: int, axes: tuple[frozenset, ...], leaves: frozenset = _EMPTY) -> None:
        self.kind = kind
        self.axes = axes
        self.leaves = leaves


def _plain(kind: int, rank: int) -> _Value:
    return _Value(kind, (_EMPTY,) * rank)


def _rank(var: Any) -> int:
    return len(getattr(var.aval, "shape", ()))


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def _nbytes(var: Any) -> int:
    aval = var.aval
    try:
        return math.prod(aval.shape) * itemsize(aval.dtype)
    except Exception:  # extended dtypes (keys): no meaningful size
        return 0


def _inner(jaxpr: Any) -> Any:
    """The open jaxpr of a ``ClosedJaxpr`` (older JAX) or of a ``Jaxpr`` (newer JAX: itself)."""
    inner = getattr(jaxpr, "jaxpr", None)
    return inner if inner is not None and hasattr(inner, "eqns") else jaxpr


def _is_jaxpr(value: Any) -> bool:
    return hasattr(_inner(value), "eqns")


def _words(text: str) -> list[str]:
    return text.split()


# Primitives that act on each element alone (their outputs have their inputs' shape). Others of
# the same shape are taken as elementwise unless a parameter names an axis (see _same_shape).
_ELEMENTWISE = frozenset(
    _words(
        """
        abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil
        clamp clz conj convert_element_type copy copy_p cos cosh digamma div erf erf_inv erfc exp
        exp2 expm1 floor igamma igammac imag integer_pow is_finite lgamma log log1p logistic max min
        mul ne eq ge gt le lt neg nextafter not or polygamma population_count pow real
        reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
        shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan
        tanh xor zeta one_minus_square random_gamma_grad
        """
    )
)
# One output per operand, each the operand itself (placement and scheduling hints).
_IDENTITY = frozenset(
    _words("optimization_barrier device_put sharding_constraint mesh_cast reshard pvary name")
)
_REDUCE = frozenset(
    _words("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin")
)
_CUMULATIVE = frozenset(_words("cumsum cumprod cummax cummin cumlogsumexp"))
_RANDOM = frozenset(
    _words(
        """
        random_bits random_seed random_split random_fold_in random_wrap random_unwrap threefry2x32
        rng_bit_generator rng_uniform iota
        """
    )
)
_CALLBACKS = frozenset(
    _words("pure_callback io_callback ffi_call custom_call debug_callback pallas_call custom_partitioning")
)
_AXIS_PARAMS = frozenset(
    _words("axis axes dimension dimensions permutation fft_type fft_lengths window_dimensions")
)
_MIXING = frozenset(
    _words(
        """
        cholesky lu qr eig eigh svd triangular_solve tridiagonal tridiagonal_solve schur hessenberg
        householder_product lu_pivots_to_permutation fft rev
        """
    )
)


class _Reader:
    """The abstract interpreter; what it finds stays on it (see :class:`Reading`)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.offsets: list[int] = []
        self.node_leaf: list[int] = []
        self.node_axis: list[int] = []
        for leaf, shape in enumerate(shapes):
            self.offsets.append(len(self.node_leaf))
            for axis in range(len(shape)):
                self.node_leaf.append(leaf)
                self.node_axis.append(axis)
        count = len(self.node_leaf)
        self.parent = list(range(count))
        self.limit = [shapes[leaf][axis] for leaf, axis in zip(self.node_leaf, self.node_axis, strict=True)]
        self.roles: list[set[str]] = [set() for _ in range(count)]
        self.why: dict[int, str] = {}
        self.feeds: set[tuple[int, int]] = set()
        self.costs: dict[tuple, float] = {}
        self.uses: list[set[str]] = [set() for _ in shapes]
        self.stops: dict[str, str] = {}
        self.path: tuple[int, ...] = ()
        self.scale = 1.0

    # --- the groups ---------------------------------------------------------------------------

    def find(self, node: int) -> int:
        parent = self.parent
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def join(self, nodes: Iterable[int]) -> None:
        first = None
        for node in nodes:
            root = self.find(node)
            if first is None:
                first = root
            elif root != first:
                self.parent[root] = first

    def brk(self, tags: Iterable[tuple[int, int, int]], reason: str) -> None:
        """The tagged axes cannot be split here: their parameter axes split only above them."""
        for node, outer, _ in tags:
            self.limit[node] = math.gcd(self.limit[node], outer)
            self.why.setdefault(node, reason)

    def cost(self, eqn: Any, nodes: Iterable[int], amount: float) -> None:
        """A collective of ``amount`` bytes per run, if the nodes' axes were split, at this site."""
        for node in nodes:
            self.costs[(self.path, id(eqn), node)] = amount * self.scale

    def role(self, tags: Iterable[tuple[int, int, int]], word: str) -> None:
        for node, _, _ in tags:
            self.roles[node].add(word)

    # --- walking ------------------------------------------------------------------------------

    def run(self, jaxpr: Any, inputs: Sequence[_Value]) -> list[_Value]:
        jaxpr = _inner(jaxpr)
        env: dict[Any, _Value] = {}
        for var, value in zip(jaxpr.invars, inputs, strict=False):
            env[var] = value
        for var in jaxpr.constvars:
            env[var] = _plain(_CONST, _rank(var))

        def get(var: Any) -> _Value:
            found = env.get(var) if not hasattr(var, "val") else None
            return found if found is not None else _plain(_CONST if hasattr(var, "val") else _ACT, _rank(var))

        for eqn in jaxpr.eqns:
            ins = [get(v) for v in eqn.invars]
            if any(v.kind == _BACK for v in ins) or _backward(eqn):
                outs = [_plain(_BACK, _rank(v)) for v in eqn.outvars]
            else:
                outs = self.eqn(eqn, ins)
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value
        return [get(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        name = eqn.primitive.name
        kind = max((v.kind for v in ins), default=_CONST)
        handler = _HANDLERS.get(name)
        if handler is not None:
            return handler(self, eqn, ins)
        if name in _ELEMENTWISE:
            return self.elementwise(eqn, ins)
        if name in _RANDOM:
            return [_plain(_CONST, _rank(v)) for v in eqn.outvars]
        if name in _CALLBACKS:
            return self.opaque(eqn, ins, f"{name}, which einshard cannot see into")
        subs = [v for v in eqn.params.values() if _is_jaxpr(v)]
        if len(subs) == 1 and len(_inner(subs[0]).invars) == len(ins):
            return self.call(eqn, subs[0], ins)
        if kind == _CONST:
            return [_plain(_CONST, _rank(v)) for v in eqn.outvars]
        if not subs and name not in _MIXING and _same_shape(eqn):
            return self.elementwise(eqn, ins)
        return self.opaque(eqn, ins, f"{name}, which the reading does not follow")

    def call(self, eqn: Any, jaxpr: Any, ins: list[_Value], scale: float = 1.0) -> list[_Value]:
        path, old_scale = self.path, self.scale
        self.path, self.scale = (*path, id(eqn)), old_scale * scale
        try:
            return self.run(jaxpr, ins)
        finally:
            self.path, self.scale = path, old_scale

    def opaque(self, eqn: Any, ins: list[_Value], what: str) -> list[_Value]:
        kind = max((v.kind for v in ins), default=_CONST)
        for value in ins:
            for tags in value.axes:
                self.brk(tags, f"read by {what}")
                if value.kind == _PARAM:
                    self.role(tags, "opaque")
            for leaf in value.leaves:
                self.uses[leaf].add("opaque")
        if any(value.kind in (_PARAM, _ACT) for value in ins):
            self.stops.setdefault(eqn.primitive.name, _where(eqn))
        out = _ACT if kind in (_PARAM, _ACT) else kind
        return [_plain(out, _rank(v)) for v in eqn.outvars]

    # --- elementwise and shape operations -------------------------------------------------------

    def elementwise(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        kind = max((v.kind for v in ins), default=_CONST)
        outs = eqn.outvars
        rank = _rank(outs[0])
        if kind == _CONST:
            return [_plain(_CONST, _rank(v)) for v in outs]
        axes = []
        shape = _shape(outs[0])
        for axis in range(rank):
            merged: frozenset = _EMPTY
            for var, value in zip(eqn.invars, ins, strict=True):
                if len(value.axes) == rank and _shape(var)[axis] == shape[axis] and value.axes[axis]:
                    merged = merged | value.axes[axis]
            if len(merged) > 1:
                self.join(node for node, _, _ in merged)
            axes.append(merged)
        leaves = frozenset().union(*(v.leaves for v in ins))
        if kind == _ACT:
            for value in ins:
                if value.kind == _PARAM:
                    for leaf in value.leaves:
                        self.uses[leaf].add("elementwise")
                    for tags in value.axes:
                        self.role(tags, "elementwise")
            leaves = _EMPTY
        value = _Value(kind, tuple(axes), leaves)
        return [value if _rank(v) == rank else _plain(kind, _rank(v)) for v in outs]

    def identity(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return [ins[i] if i < len(ins) else _plain(_ACT, _rank(v)) for i, v in enumerate(eqn.outvars)]

    def broadcast_in_dim(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        value = ins[0]
        out_shape = _shape(eqn.outvars[0])
        in_shape = _shape(eqn.invars[0])
        axes = [_EMPTY] * len(out_shape)
        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
            if in_shape[i] == out_shape[d]:
                axes[d] = value.axes[i]
        return [_Value(value.kind, tuple(axes), value.leaves)]

    def transpose(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        value = ins[0]
        return [_Value(value.kind, tuple(value.axes[i] for i in eqn.params["permutation"]), value.leaves)]

    def squeeze(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        value = ins[0]
        rank = len(value.axes)
        drop = {d % rank for d in eqn.params["dimensions"]}
        return [_Value(value.kind, tuple(t for i, t in enumerate(value.axes) if i not in drop), value.leaves)]

    def expand_dims(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return self.reshape(eqn, ins)

    def reshape(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        value = ins[0]
        in_shape = _shape(eqn.invars[0])
        out_shape = _shape(eqn.outvars[0])
        axes_in = value.axes
        if eqn.params.get("dimensions"):
            order = eqn.params["dimensions"]
            axes_in = tuple(axes_in[i] for i in order)
            in_shape = tuple(in_shape[i] for i in order)
        axes = [_EMPTY] * len(out_shape)
        for ins_group, outs_group in _reshape_groups(in_shape, out_shape):
            merged = self.merge(in_shape, axes_in, ins_group)
            # Split the merged axis into the output axes, major first.
            outer = 1
            for o in outs_group:
                size = out_shape[o]
                if size != 1:  # a tag covers the major factors of the merged axis it came from
                    axes[o] = frozenset(
                        (node, base * outer, size) for node, base, extent in merged if outer < extent
                    )
                outer *= size
        return [_Value(value.kind, tuple(axes), value.leaves)]

    def merge(self, shape: tuple[int, ...], axes: tuple[frozenset, ...], group: list[int]) -> frozenset:
        """The tags of the axis that merging ``group`` (major first) makes.

        Tags of the major axis stay; a minor axis's tag continues one of them when it is the
        next factor of the same parameter axis; otherwise the merged axis would hold that
        parameter axis strided, which no contiguous split gives: a break.
        """
        merged: dict[int, tuple[int, int, int]] = {}
        first = True
        for i in group:
            if shape[i] == 1:
                continue
            for node, outer, size in axes[i]:
                known = merged.get(node)
                if first:
                    merged[node] = (node, outer, size)
                elif known is not None and known[1] * known[2] == outer:
                    merged[node] = (node, known[1], known[2] * size)
                else:
                    self.brk([(node, outer, size)], "interleaved with another axis by a reshape")
            first = False
        return frozenset(merged.values())

    def reduce(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        value = ins[0]
        axes = set(eqn.params.get("axes", ()))
        if value.kind == _ACT:
            amount = _nbytes(eqn.outvars[0])
            for i in axes:
                self.cost(eqn, (node for node, _, _ in value.axes[i]), amount)
        elif value.kind == _PARAM:
            for i in axes:
                self.brk(value.axes[i], "reduced over (a statistic of the weight)")
        kept = tuple(t for i, t in enumerate(value.axes) if i not in axes)
        out = [_Value(value.kind, kept, value.leaves)]
        return out + [_Value(value.kind, kept, value.leaves) for _ in eqn.outvars[1:]]

    def along(self, eqn: Any, ins: list[_Value], axes: set[int], reason: str) -> list[_Value]:
        """An operation that mixes the elements along ``axes`` (a sort, a scan over an axis)."""
        kind = max((v.kind for v in ins), default=_CONST)
        rank = _rank(eqn.outvars[0])
        out = []
        for axis in range(rank):
            merged: frozenset = _EMPTY
            for value in ins:
                if len(value.axes) == rank and value.axes[axis]:
                    if axis in axes:
                        self.brk(value.axes[axis], reason)
                    else:
                        merged = merged | value.axes[axis]
            if len(merged) > 1:
                self.join(node for node, _, _ in merged)
            out.append(merged)
        leaves = frozenset().union(*(v.leaves for v in ins)) if kind == _PARAM else _EMPTY
        value = _Value(kind, tuple(out), leaves)
        return [value if _rank(v) == rank else _plain(kind, _rank(v)) for v in eqn.outvars]

    def cumulative(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return self.along(eqn, ins, {eqn.params["axis"]}, f"run along by {eqn.primitive.name}")

    def sort(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return self.along(eqn, ins, {eqn.params["dimension"]}, "sorted along")

    def top_k(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        rank = len(ins[0].axes)
        axis = eqn.params.get("axis", -1) % rank if rank else 0
        value = ins[0]
        self.brk(value.axes[axis] if rank else (), "searched along by top_k")
        axes = tuple(_EMPTY if i == axis else t for i, t in enumerate(value.axes))
        return [_Value(value.kind, axes, value.leaves), _plain(value.kind, _rank(eqn.outvars[1]))]

    def slicing(self, eqn: Any, ins: list[_Value], sizes: Sequence[int]) -> list[_Value]:
        """``slice`` / ``dynamic_slice``: axes taken whole keep their tags, the others do not."""
        value = ins[0]
        shape = _shape(eqn.invars[0])
        axes = []
        for i, (full, size) in enumerate(zip(shape, sizes, strict=True)):
            if size == full:
                axes.append(value.axes[i])
                continue
            if value.kind == _PARAM:
                self.role(value.axes[i], "layer" if size == 1 else "sliced")
                reason = "indexed (a layer axis)" if size == 1 else "sliced into parts"
            else:
                reason = "sliced into parts"
            self.brk(value.axes[i], reason)
            axes.append(_EMPTY)
        return [_Value(value.kind, tuple(axes), value.leaves)]

    def slice(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return self.slicing(eqn, ins, _shape(eqn.outvars[0]))

    def dynamic_slice(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return self.slicing(eqn, ins[:1], eqn.params["slice_sizes"])

    def split(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        value = ins[0]
        axis = eqn.params["axis"]
        if value.kind == _PARAM:
            self.role(value.axes[axis], "sliced")
        self.brk(
            value.axes[axis],
            "split into parts (as q, k and v one after another: a contiguous split cuts across them)",
        )
        axes = tuple(_EMPTY if i == axis else t for i, t in enumerate(value.axes))
        return [_Value(value.kind, axes, value.leaves) for _ in eqn.outvars]

    def unstack(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        """``k, v = kv``: each output is one index of ``axis`` (a slice of size 1, dropped)."""
        value = ins[0]
        axis = eqn.params["axis"] % max(len(value.axes), 1)
        if value.kind == _PARAM:
            self.role(value.axes[axis], "sliced")
        self.brk(value.axes[axis], "taken apart into its parts (as k and v)")
        axes = tuple(t for i, t in enumerate(value.axes) if i != axis)
        return [_Value(value.kind, axes, value.leaves) for _ in eqn.outvars]

    def dynamic_update_slice(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        operand, update = ins[0], ins[1]
        shape, part = _shape(eqn.invars[0]), _shape(eqn.invars[1])
        kind = max(operand.kind, update.kind)
        axes = []
        for i, (full, size) in enumerate(zip(shape, part, strict=True)):
            if size == full:
                merged = operand.axes[i] | update.axes[i]
                if len(merged) > 1:
                    self.join(node for node, _, _ in merged)
                axes.append(merged)
            else:
                self.brk(operand.axes[i] | update.axes[i], "updated in parts")
                axes.append(_EMPTY)
        return [_Value(kind, tuple(axes), operand.leaves | update.leaves if kind == _PARAM else _EMPTY)]

    def concatenate(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        return self.along(eqn, ins, {eqn.params["dimension"]}, "concatenated with other arrays")

    def pad(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        padded = {i for i, (lo, hi, inner) in enumerate(eqn.params["padding_config"]) if lo or hi or inner}
        return self.along(eqn, ins[:1], padded, "padded")

    def windowed(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        window = eqn.params.get("window_dimensions", ())
        strides = eqn.params.get("window_strides", ()) or (1,) * len(window)
        mixed = {i for i, (w, s) in enumerate(zip(window, strides, strict=False)) if w != 1 or s != 1}
        return self.along(eqn, ins, mixed, "pooled over (a window runs along it)")

    # --- where weights meet activations ---------------------------------------------------------

    def dot_general(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        kind = max(lhs.kind, rhs.kind)
        lfree = [i for i in range(len(lhs.axes)) if i not in lc and i not in lb]
        rfree = [i for i in range(len(rhs.axes)) if i not in rc and i not in rb]
        if kind == _CONST:
            return [_plain(_CONST, _rank(eqn.outvars[0]))]
        if lhs.kind == _PARAM and rhs.kind == _ACT:
            batch, _ = self.weight(eqn, lhs, rhs, lc, rc, lb, rb)
            axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
            self.role((t for i in lfree for t in lhs.axes[i]), "free")
            return [_Value(_ACT, tuple(axes))]
        if rhs.kind == _PARAM and lhs.kind == _ACT:
            batch, _ = self.weight(eqn, rhs, lhs, rc, lc, rb, lb)
            self.role((t for i in rfree for t in rhs.axes[i]), "free")
            axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
            return [_Value(_ACT, tuple(axes))]
        if kind == _PARAM:  # weights only: a weight computed from others (LoRA, a tied transpose)
            for i, j in zip(lc, rc, strict=True):
                self.join(node for node, _, _ in lhs.axes[i] | rhs.axes[j])
            batch = []
            for i, j in zip(lb, rb, strict=True):
                merged = lhs.axes[i] | rhs.axes[j]
                self.join(node for node, _, _ in merged)
                batch.append(merged)
            axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
            return [_Value(_PARAM, tuple(axes), lhs.leaves | rhs.leaves)]
        # Two activations (attention's scores and values), or an activation and a constant.
        for i, j in zip(lc, rc, strict=True):
            self.brk(lhs.axes[i] | rhs.axes[j], "contracted with another activation (as q with k)")
        batch = []
        for i, j in zip(lb, rb, strict=True):
            merged = lhs.axes[i] | rhs.axes[j]
            self.join(node for node, _, _ in merged)
            self.role(merged, "heads")
            batch.append(merged)
        axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
        return [_Value(_ACT, tuple(axes))]

    def weight(
        self,
        eqn: Any,
        param: _Value,
        act: _Value,
        pc: Sequence[int],
        ac: Sequence[int],
        pb: Sequence[int],
        ab: Sequence[int],
    ) -> tuple[list[frozenset], None]:
        """A weight meets an activation in a ``dot_general``: contraction and batch axes."""
        for leaf in param.leaves:
            self.uses[leaf].add("dot_general")
        amount = _nbytes(eqn.outvars[0])
        for i, j in zip(pc, ac, strict=True):
            mine, theirs = param.axes[i], act.axes[j]
            self.role(mine, "contraction")
            self.cost(eqn, (node for node, _, _ in mine), amount)
            if not mine:
                self.brk(theirs, "contracted with a weight on an axis einshard cannot trace")
                continue
            self.join(node for node, _, _ in mine | theirs)
            for column, _, _ in theirs:
                for row, _, _ in mine:
                    if self.node_leaf[column] != self.node_leaf[row]:
                        self.feeds.add((column, row))
        batch = []
        for i, j in zip(pb, ab, strict=True):
            merged = param.axes[i] | act.axes[j]
            self.role(param.axes[i], "batch")
            self.join(node for node, _, _ in merged)
            batch.append(merged)
        return batch, None

    def conv_general_dilated(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        lhs, rhs = ins
        numbers = eqn.params["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
        groups = eqn.params.get("feature_group_count", 1)
        rank = _rank(eqn.outvars[0])
        if lhs.kind == _CONST and rhs.kind == _CONST:
            return [_plain(_CONST, rank)]
        if lhs.kind != _ACT or rhs.kind != _PARAM or eqn.params.get("batch_group_count", 1) != 1:
            return self.opaque(eqn, ins, "a convolution of two activations")
        for leaf in rhs.leaves:
            self.uses[leaf].add("conv")
        axes = [_EMPTY] * rank
        axes[out_spec[0]] = lhs.axes[lhs_spec[0]]
        out_features, in_features = rhs.axes[rhs_spec[0]], rhs.axes[rhs_spec[1]]
        features = lhs.axes[lhs_spec[1]]
        self.role(out_features, "conv-out")
        for axis in rhs_spec[2:]:
            self.role(rhs.axes[axis], "window")
            self.brk(rhs.axes[axis], "a convolution window")
        for axis in lhs_spec[2:]:
            self.brk(lhs.axes[axis], "run along by a convolution's window")
        if groups == 1:
            self.role(in_features, "conv-in")
            self.cost(eqn, (node for node, _, _ in in_features), _nbytes(eqn.outvars[0]))
            self.join(node for node, _, _ in in_features | features)
            for column, _, _ in features:
                for row, _, _ in in_features:
                    if self.node_leaf[column] != self.node_leaf[row]:
                        self.feeds.add((column, row))
            axes[out_spec[1]] = out_features
        else:  # grouped (depthwise): each input feature goes to its own outputs
            self.join(node for node, _, _ in out_features | features)
            self.brk(in_features, "the input features of a grouped convolution")
            axes[out_spec[1]] = out_features | features
        return [_Value(_ACT, tuple(axes))]

    def gather(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        operand, indices = ins[0], ins[1]
        numbers = eqn.params["dimension_numbers"]
        sizes = eqn.params["slice_sizes"]
        shape = _shape(eqn.invars[0])
        out_rank = _rank(eqn.outvars[0])
        offset_dims = tuple(numbers.offset_dims)
        collapsed = set(numbers.collapsed_slice_dims)
        batching = tuple(getattr(numbers, "operand_batching_dims", ()))
        index_batching = tuple(getattr(numbers, "start_indices_batching_dims", ()))
        kind = max(operand.kind, indices.kind)
        if kind == _CONST:
            return [_plain(_CONST, out_rank)]
        lookup = operand.kind == _PARAM and indices.kind == _ACT
        indexing = operand.kind == _PARAM and indices.kind == _CONST
        axes = [_EMPTY] * out_rank
        rest = [i for i in range(out_rank) if i not in offset_dims]
        index_axes = [i for i in range(len(indices.axes) - 1)]
        for position, axis in zip(rest, index_axes, strict=False):
            axes[position] = indices.axes[axis]
        kept = [i for i in range(len(shape)) if i not in collapsed and i not in batching]
        amount = _nbytes(eqn.outvars[0])
        for position, axis in zip(offset_dims, kept, strict=False):
            if sizes[axis] == shape[axis]:
                axes[position] = operand.axes[axis]
                if lookup:
                    self.role(operand.axes[axis], "free")
        for axis in range(len(shape)):
            if sizes[axis] == shape[axis] or axis in batching:
                continue
            tags = operand.axes[axis]
            if lookup:
                self.role(tags, "gathered")
                self.cost(eqn, (node for node, _, _ in tags), amount)
            elif indexing and math.prod(_shape(eqn.invars[1])[:-1]) > 1:  # a table read by fixed indices
                self.role(tags, "indexed")
                self.brk(tags, "looked up by indices the step computes, not from the batch")
            elif indexing:
                self.role(tags, "layer" if sizes[axis] == 1 else "sliced")
                self.brk(tags, "indexed (a layer axis)" if sizes[axis] == 1 else "sliced into parts")
            elif sizes[axis] == 1:  # a pick along the axis (take_along_axis): partial picks add up
                self.cost(eqn, (node for node, _, _ in tags), amount)
            else:
                self.brk(tags, "gathered along")
        for op_axis, index_axis in zip(batching, index_batching, strict=False):
            position = rest[index_axis] if index_axis < len(rest) else None
            if position is not None:
                merged = axes[position] | operand.axes[op_axis]
                self.join(node for node, _, _ in merged)
                axes[position] = merged
        if lookup:
            for leaf in operand.leaves:
                self.uses[leaf].add("gather")
        out_kind = _PARAM if indexing else _ACT
        return [_Value(out_kind, tuple(axes), operand.leaves if indexing else _EMPTY)]

    def scatter(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        operand = ins[0]
        numbers = eqn.params["dimension_numbers"]
        touched = set(numbers.scatter_dims_to_operand_dims) | set(numbers.inserted_window_dims)
        for value in ins[2:]:
            for tags in value.axes:
                self.brk(tags, "scattered")
        return self.along(eqn, [operand], touched, "scattered into")

    # --- control flow ---------------------------------------------------------------------------

    def scan(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        params = eqn.params
        body = params["jaxpr"]
        consts, carries = _scan_counts(params, len(ins))
        length = int(params.get("length", 1))
        head, carry, xs = ins[:consts], ins[consts : consts + carries], ins[consts + carries :]
        slices = []
        for value in xs:
            if value.kind == _PARAM:
                self.role(value.axes[0], "layer")
            self.brk(value.axes[0], "the axis a scan steps along (a layer axis)")
            slices.append(_Value(value.kind, value.axes[1:], value.leaves))
        carry, outs = self.loop(eqn, body, head, carry, slices, length)
        ys = [_Value(v.kind, (_EMPTY, *v.axes), v.leaves) for v in outs[carries:]]
        return carry + ys

    def loop(
        self,
        eqn: Any,
        body: Any,
        head: list[_Value],
        carry: list[_Value],
        tail: list[_Value],
        scale: float,
    ) -> tuple[list[_Value], list[_Value]]:
        """Runs a loop body until its carries' tags settle (a few rounds at most)."""
        outs: list[_Value] = []
        for _ in range(4):
            outs = self.call(eqn, body, head + carry + tail, scale)
            merged = [_union(a, b, self) for a, b in zip(carry, outs[: len(carry)], strict=True)]
            if all(_same(a, b) for a, b in zip(carry, merged, strict=True)):
                break
            carry = merged
        return carry, outs

    def while_loop(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        params = eqn.params
        cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
        head = ins[cond_consts : cond_consts + body_consts]
        carry = ins[cond_consts + body_consts :]
        carry, _ = self.loop(eqn, params["body_jaxpr"], head, carry, [], 1.0)
        return carry

    def cond(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        results = [self.call(eqn, branch, ins[1:]) for branch in eqn.params["branches"]]
        out = results[0]
        for other in results[1:]:
            out = [_union(a, b, self) for a, b in zip(out, other, strict=True)]
        return out


def _union(a: _Value, b: _Value, reader: _Reader) -> _Value:
    if len(a.axes) != len(b.axes):
        return _plain(max(a.kind, b.kind), len(a.axes))
    axes = []
    for x, y in zip(a.axes, b.axes, strict=True):
        merged = x | y
        if len(merged) > 1:
            reader.join(node for node, _, _ in merged)
        axes.append(merged)
    return _Value(max(a.kind, b.kind), tuple(axes), a.leaves | b.leaves)


def _same(a: _Value, b: _Value) -> bool:
    return a.kind == b.kind and a.axes == b.axes and a.leaves == b.leaves


def _scan_counts(params: dict, n_inputs: int) -> tuple[int, int]:
    """How many of a scan's inputs are constants and carries (the rest are scanned over)."""
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    tree = params.get("ft_in")  # newer JAX: the inputs' structure, (consts, carries, xs)
    if tree is not None:
        try:
            consts, carries, _ = tree.unpack()
            return len(consts), len(carries)
        except Exception:
            pass
    raise EinshardError(
        "cannot read a scan of this JAX version: its parameters name no constants or carries",
        hint="Report this with your JAX version; meanwhile give the table by names: "
        "einshard.strategies.tensor_parallel(column=..., row=...).",
    )


def _same_shape(eqn: Any) -> bool:
    """Whether an unknown primitive looks elementwise: every array in and out has one shape."""
    if _AXIS_PARAMS & set(eqn.params):
        return False
    shapes = {_shape(v) for v in (*eqn.invars, *eqn.outvars) if _rank(v)}
    return len(shapes) <= 1


def _reshape_groups(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[tuple[list[int], list[int]]]:
    """Runs of input and output axes with equal products: each run is merged, then split."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        ins: list[int] = []
        outs: list[int] = []
        a = b = 1
        while not (ins and outs and a == b):
            if (a <= b or j >= m) and i < n:
                a *= in_shape[i]
                ins.append(i)
                i += 1
            elif j < m:
                b *= out_shape[j]
                outs.append(j)
                j += 1
            else:
                break
        while i < n and in_shape[i] == 1:  # trailing size-1 axes join the run
            ins.append(i)
            i += 1
        while j < m and out_shape[j] == 1:
            outs.append(j)
            j += 1
        groups.append((ins, outs))
    return groups


def _backward(eqn: Any) -> bool:
    """Whether JAX's name stack marks the operation as part of a transposed (backward) pass."""
    try:
        return "transpose(" in str(eqn.source_info.name_stack)
    except AttributeError:
        return False


def _where(eqn: Any) -> str:
    """``file:line`` of the innermost user code behind an operation (not JAX's own), or ``''``."""
    frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or ()
    for frame in frames:
        name = str(getattr(frame, "file_name", ""))
        if not any(f"/{package}/" in name for package in ("jax", "jaxlib", "einshard")):
            line = getattr(frame, "line_num", None) or getattr(frame, "start_line", "")
            return f"{name.rsplit('/', 1)[-1]}:{line}"
    return ""


_HANDLERS: dict[str, Callable[[_Reader, Any, list[_Value]], list[_Value]]] = {
    "dot_general": _Reader.dot_general,
    "conv_general_dilated": _Reader.conv_general_dilated,
    "gather": _Reader.gather,
    "broadcast_in_dim": _Reader.broadcast_in_dim,
    "reshape": _Reader.reshape,
    "expand_dims": _Reader.expand_dims,
    "transpose": _Reader.transpose,
    "squeeze": _Reader.squeeze,
    "slice": _Reader.slice,
    "dynamic_slice": _Reader.dynamic_slice,
    "dynamic_update_slice": _Reader.dynamic_update_slice,
    "split": _Reader.split,
    "unstack": _Reader.unstack,
    "concatenate": _Reader.concatenate,
    "pad": _Reader.pad,
    "sort": _Reader.sort,
    "top_k": _Reader.top_k,
    "scan": _Reader.scan,
    "while": _Reader.while_loop,
    "cond": _Reader.cond,
    "reduce_window_sum": _Reader.windowed,
    "reduce_window_max": _Reader.windowed,
    "reduce_window_min": _Reader.windowed,
    "reduce_window": _Reader.windowed,
    "scatter": _Reader.scatter,
    "scatter-add": _Reader.scatter,
    "scatter_add": _Reader.scatter,
    "scatter-mul": _Reader.scatter,
    "scatter-min": _Reader.scatter,
    "scatter-max": _Reader.scatter,
    **{name: _Reader.identity for name in _IDENTITY},
    **{name: _Reader.reduce for name in _REDUCE},
    **{name: _Reader.cumulative for name in _CUMULATIVE},
}


# --- reading a step ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the dataflow says of every parameter leaf, for any model-axis size (see :func:`assign`)."""

    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: tuple[int, ...]
    floating: tuple[bool, ...]
    offsets: tuple[int, ...]
    node_leaf: tuple[int, ...]
    node_axis: tuple[int, ...]
    group: tuple[int, ...]
    limit: tuple[int, ...]
    roles: tuple[frozenset, ...]
    why: dict[int, str]
    cost: tuple[float, ...]
    feeds: frozenset
    uses: tuple[frozenset, ...]
    stops: dict[str, str]
    seconds: float


def _step_function(step: Callable[..., Any] | str) -> Callable[..., Any]:
    """The step as a function: the one place this module uses the step report's helpers."""
    from ._call import resolve_step

    return resolve_step(step)


def read(step: Callable[..., Any] | str, params: Any, batch: Any) -> Reading:
    """Traces ``step(params, batch)`` on abstract inputs and reads every parameter leaf's axes."""
    import time

    import jax
    import numpy as np

    from .._arrays._leaves import is_array, partition
    from .._trees._paths import flatten_with_paths

    start = time.perf_counter()
    fn = _step_function(step)
    param_leaves, paths, _ = flatten_with_paths(params)
    leaves = jax.tree_util.tree_leaves((params, batch))
    dynamic = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    _, combine = partition((params, batch), is_array)

    def flat(*arrays: Any) -> Any:
        call_params, call_batch = combine(arrays)
        out = fn(call_params, call_batch)
        return [leaf for leaf in jax.tree_util.tree_leaves(out) if isinstance(leaf, jax.Array)]

    abstract = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in dynamic]
    try:
        traced = jax.make_jaxpr(flat)(*abstract)
    except EinshardError:
        raise
    except Exception as error:
        raise EinshardError(
            f"cannot read the step's dataflow: tracing step(params, batch) failed: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            hint="The step is traced with jax.make_jaxpr on ShapeDtypeStructs: it must not branch in "
            "Python on array values or read them (float(x), x.item()). Or give the table by layer "
            "names: einshard.strategies.tensor_parallel(column=[...], row=[...]).",
        ) from None
    n_params = len(param_leaves)
    is_param = [i < n_params and is_array(leaves[i]) for i in range(len(leaves))]
    param_index = {i: i for i in range(n_params)}
    shapes = tuple(tuple(np.shape(leaf)) if is_array(leaf) else () for leaf in param_leaves)
    reader = _Reader(shapes)
    inputs = []
    for i in dynamic:
        shape = tuple(np.shape(leaves[i]))
        if is_param[i]:
            leaf = param_index[i]
            base = reader.offsets[leaf]
            axes = tuple(frozenset({(base + k, 1, size)}) for k, size in enumerate(shape))
            inputs.append(_Value(_PARAM, axes, frozenset({leaf})))
        else:
            inputs.append(_plain(_ACT, len(shape)))
    reader.run(traced, inputs)
    cost = [0.0] * len(reader.node_leaf)
    for (_, _, node), amount in reader.costs.items():
        cost[node] += amount
    dtypes, nbytes, floating = [], [], []
    for leaf in param_leaves:
        if is_array(leaf):
            dtypes.append(str(leaf.dtype))
            try:
                nbytes.append(math.prod(np.shape(leaf)) * itemsize(leaf.dtype))
                floating.append(bool(jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)))
            except Exception:  # extended dtypes (random keys)
                nbytes.append(0)
                floating.append(False)
        else:
            dtypes.append("")
            nbytes.append(0)
            floating.append(False)
    return Reading(
        paths=tuple(paths),
        shapes=shapes,
        dtypes=tuple(dtypes),
        nbytes=tuple(nbytes),
        floating=tuple(floating),
        offsets=tuple(reader.offsets),
        node_leaf=tuple(reader.node_leaf),
        node_axis=tuple(reader.node_axis),
        group=tuple(reader.find(n) for n in range(len(reader.node_leaf))),
        limit=tuple(reader.limit),
        roles=tuple(frozenset(r) for r in reader.roles),
        why=dict(reader.why),
        cost=tuple(cost),
        feeds=frozenset(reader.feeds),
        uses=tuple(frozenset(u) for u in reader.uses),
        stops=dict(reader.stops),
        seconds=time.perf_counter() - start,
    )


# --- choosing the splits for one model-axis size -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafRole:
    """One parameter leaf's role for tensor parallelism, and why.

    Attributes:
        path: The leaf's path (as rules see it, without the step's parameter name).
        shape: Its shape.
        dtype: Its dtype.
        axes: What each axis is in the step: ``in`` (contracted with the activations),
            ``out`` (free: part of the output), ``heads`` (an output axis that attention keeps
            apart), ``vocab`` (gathered by a lookup), ``layer`` (stacked layers), ``window``
            (a convolution window), ``index`` (looked up by indices the step computes, not
            from the batch), ``batch`` (meets the batch axis), ``elem`` (only
            elementwise), ``-`` (not read).
        role: ``column``, ``row``, ``heads``, ``vocabulary`` or ``follows`` (split on
            ``axis``), ``replicated`` (read, but not split), or ``unread`` (the forward pass
            does not read it: optimizer state, say; a derived table gives it no rule of its
            own, so it follows the parameter whose path its path ends with).
        axis: The axis split over the model axis, or ``None``.
        parts: How many ways it is split (the model axis's size, or less where the axis does
            not divide: then the leaf is copied ``model // parts`` times).
        note: Why, in one line.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str, ...]
    role: str
    axis: int | None
    parts: int
    note: str


@dataclasses.dataclass(frozen=True)
class Roles:
    """The roles read from a step for one model-axis size; ``print(roles)`` shows a table.

    Attributes:
        leaves: One :class:`LeafRole` per floating-point parameter leaf, in tree order.
        model: The model axis's size the splits are chosen for.
        stops: Where the reading stopped: ``{primitive: 'file:line'}`` of operations it cannot
            see into (``pure_callback``, custom calls); the leaves they read are not split.
        seconds: How long tracing and reading the step took.
    """

    leaves: tuple[LeafRole, ...]
    model: int
    stops: dict[str, str]
    seconds: float

    @property
    def split_share(self) -> float:
        """The share of the parameters' bytes split over the model axis."""
        total = sum(_leaf_bytes(row) for row in self.leaves)
        split = sum(_leaf_bytes(row) for row in self.leaves if row.axis is not None)
        return split / total if total else 0.0

    def __str__(self) -> str:
        header = ["path", "shape", "axes", "role", "split", "why"]
        body = [
            [
                row.path,
                str(row.shape),
                " ".join(row.axes),
                row.role,
                "-" if row.axis is None else f"axis {row.axis} / {row.parts}",
                row.note,
            ]
            for row in self.leaves
        ]
        footer = [
            f"{len(self.leaves)} weights; {self.split_share:.0%} of their bytes split over a model axis "
            f"of {self.model} (read in {self.seconds * 1e3:.0f} ms)"
        ]
        for name, where in self.stops.items():
            footer.append(
                f"reading stopped at {name}"
                + (f" ({where})" if where else "")
                + ": what it reads is not split"
            )
        return table_text(header, body, footer, empty="no floating-point parameters")


def _leaf_bytes(row: LeafRole) -> int:
    try:
        return math.prod(row.shape) * itemsize(row.dtype)
    except Exception:
        return 0


@dataclasses.dataclass
class _Group:
    root: int
    members: list[int]
    split: dict[int, int]
    bytes: int
    cost: float
    chosen: bool = False


def _feeds(reading: Reading) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """The column -> row edges of a reading, by column and by row."""
    rows: dict[int, list[int]] = {}
    columns: dict[int, list[int]] = {}
    for column, row in reading.feeds:
        rows.setdefault(column, []).append(row)
        columns.setdefault(row, []).append(column)
    return rows, columns


def split_nodes(groups: Sequence[_Group]) -> set[int]:
    return {n for group in groups for n in group.split}


def _largest_divisor(model: int, limit: int) -> int:
    return math.gcd(model, limit) if limit > 0 else 1


def assign(reading: Reading, model: int) -> tuple[LeafRole, ...]:
    """The split of every floating-point parameter leaf over a model axis of ``model`` devices."""
    count = len(reading.node_leaf)
    parts = [_largest_divisor(model, reading.limit[n]) for n in range(count)]
    members: dict[int, list[int]] = {}
    for node in range(count):
        if reading.roles[node] and reading.floating[reading.node_leaf[node]]:
            members.setdefault(reading.group[node], []).append(node)
    # Column-side split: a row weight splits no more ways than the columns that feed it.
    rows_of, columns_of = _feeds(reading)
    groups: list[_Group] = []
    invalid: dict[int, str] = {}  # groups that cannot be split, by root: why
    for root, nodes in members.items():
        if not any(reading.roles[n] & _CORE for n in nodes):
            continue
        leaves = [reading.node_leaf[n] for n in nodes]
        if len(set(leaves)) != len(leaves):  # it would split two axes of one leaf
            twice = next(leaf for leaf in leaves if leaves.count(leaf) > 1)
            axes = sorted(reading.node_axis[n] for n in nodes if reading.node_leaf[n] == twice)
            invalid[root] = (
                f"{_short(reading.paths[twice])}'s axes {', '.join(map(str, axes))} meet through the "
                "activations (a residual stream, a tied embedding), so no one split fits"
            )
            continue
        top = max((parts[n] for n in nodes if reading.roles[n] & {"free", "gathered", "conv-out"}), default=0)
        split = {}
        for n in nodes:
            p = parts[n]
            feeding = columns_of.get(n)
            if feeding:
                p = math.gcd(p, max(parts[c] for c in feeding))
            elif not reading.roles[n] & _CORE and top:
                p = math.gcd(p, top)
            if p > 1:
                split[n] = p
        if not split:
            invalid[root] = "no axis it meets through the activations divides by the model axis"
            continue
        size = sum(reading.nbytes[reading.node_leaf[n]] for n in split)
        cost = sum(reading.cost[n] for n in nodes)
        if size:
            groups.append(_Group(root, nodes, split, size, cost))
    # Megatron pairs (a split output axis feeding a split contraction axis) first, then the
    # output-only splits (a lookup's vocabulary, logits); within each, the most parameter bytes
    # per byte of communication. A lone column that is cheap on its own must not take a weight
    # from the pair it belongs to. A lone row (a contraction axis no earlier weight splits) has
    # no partner: splitting it would add an all-reduce of its output, and it is not split.
    splits = split_nodes(groups)
    pairs = {reading.group[c] for c, r in reading.feeds if c in splits and r in splits}
    ranked = []
    for group in groups:
        output = any(reading.roles[n] & {"gathered", "free", "conv-out"} for n in group.split)
        if group.root in pairs or output:
            ranked.append(group)
        else:
            invalid[group.root] = (
                "no partner: no earlier weight splits the activations it contracts, and splitting it "
                "alone would add an all-reduce of its output"
            )
    groups = ranked

    def order(group: _Group) -> tuple:
        return (0 if group.root in pairs else 1, group.cost / group.bytes, -group.bytes, group.root)

    groups.sort(key=order)
    taken: dict[int, tuple[int, int, _Group]] = {}
    for group in groups:
        if any(reading.node_leaf[n] in taken for n in group.split):
            continue
        group.chosen = True
        for n, p in group.split.items():
            taken[reading.node_leaf[n]] = (n, p, group)
    by_root = {g.root: g for g in groups}
    strip = prefix_parts(reading)
    rows = []
    for leaf, path in enumerate(reading.paths):
        if not reading.floating[leaf] or not reading.shapes[leaf]:
            continue
        axes = _axis_words(reading, leaf, columns_of)
        shape, dtype = reading.shapes[leaf], reading.dtypes[leaf]
        if leaf in taken:
            node, p, group = taken[leaf]
            role, note = _split_note(reading, node, group, p, model, strip, (rows_of, columns_of))
            rows.append(LeafRole(path, shape, dtype, axes, role, reading.node_axis[node], p, note))
        elif not reading.uses[leaf] and not any(reading.roles[n] for n in _nodes(reading, leaf)):
            rows.append(
                LeafRole(path, shape, dtype, axes, "unread", None, 1, "not read by the step's forward pass")
            )
        else:
            note = _no_split_note(reading, leaf, by_root, invalid, strip)
            rows.append(LeafRole(path, shape, dtype, axes, "replicated", None, 1, note))
    return tuple(rows)


def _nodes(reading: Reading, leaf: int) -> range:
    start = reading.offsets[leaf]
    return range(start, start + len(reading.shapes[leaf]))


def _axis_words(reading: Reading, leaf: int, columns_of: dict[int, list[int]]) -> tuple[str, ...]:
    words = []
    for node in _nodes(reading, leaf):
        roles = reading.roles[node]
        if "layer" in roles:
            words.append("layer")
        elif "indexed" in roles:
            words.append("index")
        elif "gathered" in roles:
            words.append("vocab")
        elif "heads" in roles or any("heads" in reading.roles[c] for c in columns_of.get(node, ())):
            words.append("heads")  # split by head, or contracting what was
        elif roles & {"contraction", "conv-in"}:
            words.append("in")
        elif roles & {"free", "conv-out"}:
            words.append("out")
        elif "window" in roles:
            words.append("window")
        elif "batch" in roles:
            words.append("batch")
        elif "elementwise" in roles:
            words.append("elem")
        else:
            words.append("-")
    return tuple(words)


def _short(path: str, strip: int = 0) -> str:
    """A path in a note: the parts every path has in front left out, layer numbers as ``*``."""
    return "/".join("*" if part.isdigit() else part for part in path.split("/")[strip:])


def common_parts(paths: Sequence[str]) -> int:
    """How many leading parts all paths share (each keeps at least its last part)."""
    split = [path.split("/") for path in paths]
    common = 0
    while split and all(len(parts) > common + 1 for parts in split) and len({p[common] for p in split}) == 1:
        common += 1
    return common


def prefix_parts(reading: Reading) -> int:
    """How many leading path parts the rules and notes leave out.

    Only when the parameters come with other floating-point leaves the forward pass does not
    read (``step((params, opt_state), batch)``): then the parts the read leaves share in front
    (``0/params``) go, so that each rule also matches the optimizer state that mirrors its leaf
    (``1/0/mu/...``).
    """
    floating = [path for leaf, path in enumerate(reading.paths) if reading.floating[leaf]]
    read = [path for leaf, path in enumerate(reading.paths) if reading.floating[leaf] and reading.uses[leaf]]
    if not read or len(read) == len(floating):
        return 0
    return common_parts(read) if common_parts(floating) < common_parts(read) else 0


def _names(reading: Reading, nodes: Iterable[int], strip: int = 0) -> str:
    nodes = list(nodes)
    cores = [n for n in nodes if reading.roles[n] & _CORE] or nodes
    paths = _compact(sorted({_short(reading.paths[reading.node_leaf[n]], strip) for n in cores}))
    if len(paths) > 3:
        return ", ".join(paths[:3]) + f" and {len(paths) - 3} more"
    return ", ".join(paths)


def _compact(paths: list[str]) -> list[str]:
    """Paths that differ in one part only, as one: ``attn/{key,query,value}/kernel``."""
    split = [path.split("/") for path in paths]
    if len(split) > 1 and len({len(parts) for parts in split}) == 1:
        differ = [i for i in range(len(split[0])) if len({parts[i] for parts in split}) > 1]
        if len(differ) == 1:
            i = differ[0]
            parts = list(split[0])
            parts[i] = "{" + ",".join(p[i] for p in split) + "}"
            return ["/".join(parts)]
    return paths


def _split_note(
    reading: Reading,
    node: int,
    group: _Group,
    parts: int,
    model: int,
    strip: int,
    feeds: tuple[dict[int, list[int]], dict[int, list[int]]],
) -> tuple[str, str]:
    roles = reading.roles[node]
    rows = [r for r in feeds[0].get(node, ()) if r in group.split]
    columns = [c for c in feeds[1].get(node, ()) if c in group.split]
    if "gathered" in roles:
        role, note = "vocabulary", "vocabulary: the lookup's gathered axis (masked lookup, one all-reduce)"
    elif "heads" in roles and rows:
        role, note = "heads", f"heads: split by head; {_names(reading, rows, strip)} contracts them"
    elif "heads" in roles:
        role, note = "heads", "heads: split by head"
    elif roles & {"free", "conv-out"} and rows:
        role, note = "column", f"column: its output feeds {_names(reading, rows, strip)}'s contraction axis"
    elif roles & {"contraction", "conv-in"} and columns:
        heads = any("heads" in reading.roles[c] for c in columns)
        role = "heads" if heads else "row"
        what = "the heads of " if heads else "the output of "
        note = f"{role}: contracts {what}{_names(reading, columns, strip)} (one all-reduce)"
    elif roles & {"free", "conv-out"}:
        role, note = "vocabulary", "vocabulary: its output is only reduced after (softmax, loss)"
    elif roles & {"contraction", "conv-in"}:
        role, note = "row", "row: its input axis is split (one all-reduce of its output)"
    else:
        cores = [n for n in group.split if reading.roles[n] & {"free", "conv-out", "gathered"}]
        cores = cores or [n for n in group.split if reading.roles[n] & _CORE]
        own = reading.paths[reading.node_leaf[node]].split("/")
        nearest = sorted(cores, key=lambda n: -_shared(own, reading.paths[reading.node_leaf[n]].split("/")))
        role, note = "follows", f"follows {_names(reading, nearest[:1], strip) or 'its layer'}'s split axis"
    if parts < model:
        size = reading.shapes[reading.node_leaf[node]][reading.node_axis[node]]
        if size % model:
            why = f"{size} does not divide by {model}"
        else:
            unit = "heads" if "heads" in roles else "parts"
            finer = reading.why.get(node, "split unevenly")
            why = f"{reading.limit[node]} whole {unit}: finer, it would be {finer}"
        note += f"; {parts} of {model} ways, {model // parts} copies ({why})"
    return role, note


def _shared(a: list[str], b: list[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _no_split_note(
    reading: Reading, leaf: int, groups: dict[int, _Group], invalid: dict[int, str], strip: int
) -> str:
    uses = reading.uses[leaf]
    nodes = list(_nodes(reading, leaf))
    if "opaque" in uses or any("opaque" in reading.roles[n] for n in nodes):
        stopped = next((n for n in nodes if n in reading.why), None)
        if stopped is None:
            return "no split: read by an operation einshard cannot see into"
        return f"no split: axis {reading.node_axis[stopped]} is {reading.why[stopped]}"
    cores = [n for n in nodes if reading.roles[n] & _CORE and "layer" not in reading.roles[n]]
    if not cores:
        if any(reading.group[n] in groups and groups[reading.group[n]].chosen for n in nodes):
            return "no split: it meets a split axis only elementwise"
        return "only elementwise, on axes that stay whole (a norm, a bias)"

    # The largest axis first: why it is not split.
    def shared(n: int) -> bool:  # a residual stream's axis: the least telling reason
        group = groups.get(reading.group[n])
        return group is not None and len({reading.node_leaf[m] for m in group.split}) > 4

    for n in sorted(cores, key=lambda n: (shared(n), -reading.shapes[leaf][reading.node_axis[n]])):
        axis = reading.node_axis[n]
        group = groups.get(reading.group[n])
        if n in reading.why and reading.limit[n] == 1:
            return f"no split: axis {axis} is {reading.why[n]}"
        if group is not None and not group.chosen:
            others = {reading.node_leaf[m] for m in group.split} - {leaf}
            if len(others) > 3:
                return (
                    f"no split: axis {axis} is shared through the activations with {len(others)} other "
                    "weights (a residual stream), a split that costs more communication than the ones chosen"
                )
            return (
                f"no split: axis {axis} pairs with "
                f"{_names(reading, group.split, strip) or 'nothing'}, which is split on another axis"
            )
        if reading.group[n] in invalid:
            return f"no split: {invalid[reading.group[n]]}"
        if n in reading.why:
            return f"no split: axis {axis} is {reading.why[n]}"
    return "no split: no partner for its axes"


def roles(step: Callable[..., Any] | str, params: Any, batch: Any, *, n_devices: int | None = None) -> Roles:
    """Reads each parameter's tensor-parallel role from ``step(params, batch)``'s dataflow.

    The step is traced with ``jax.make_jaxpr`` on abstract inputs (nothing runs, nothing is
    allocated) and its forward pass read: which axes of each weight are contracted with the
    activations, which become its output, where that output goes. A weight whose output axis
    reaches a later weight's contraction axis is a *column*, that weight a *row* (Megatron's
    pair: one all-reduce); output axes that attention keeps apart are *heads*; the axis a
    lookup gathers is the *vocabulary*; biases *follow* their layer. The rest is replicated,
    and the note says why.

    Args:
        step: The step, ``step(params, batch)``, or an importable ``'module:function'``.
        params: The parameters (arrays or ``jax.ShapeDtypeStruct`` leaves; any pytree).
        batch: The batch.
        n_devices: The model axis's size to choose the splits for (default: this machine's
            device count).

    Returns:
        :class:`Roles`; ``print`` it for a table.

    Raises:
        EinshardError: If the step cannot be traced on abstract inputs.

    >>> import jax, jax.numpy as jnp, einshard
    >>> def step(params, x):
    ...     h = jax.nn.relu(x @ params['w1'])
    ...     return jnp.mean((h @ params['w2']) ** 2)
    >>> params = {'w1': jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...           'w2': jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    >>> found = einshard.strategies.roles(step, params, jax.ShapeDtypeStruct((32, 64), jnp.float32))
    >>> [(row.path, row.role, row.axis) for row in found.leaves]
    [('w1', 'column', 1), ('w2', 'row', 0)]
    """
    from .._sharding._devices import device_target

    model = _count(n_devices, device_target(None).count)
    reading = read(step, params, batch)
    return Roles(assign(reading, model), model, reading.stops, reading.seconds)


def _count(n_devices: Any, default: int) -> int:
    if n_devices is None:
        return default
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise EinshardError(
            f"n_devices must be a positive integer, not {n_devices!r}",
            hint="Give the model axis's size, e.g. n_devices=8.",
        )
    return n_devices


# --- the rule table --------------------------------------------------------------------------------

_LETTERS = {
    "layer": "lmn",
    "vocab": "vw",
    "heads": "hg",
    "in": "ijk",
    "out": "opqr",
    "window": "stu",
    "batch": "ef",
    "index": "nk",
    "elem": "xyz",
    "-": "abcd",
}


def axis_names(words: Sequence[str]) -> list[str]:
    """One short distinct name per axis, by its role: ``i`` in, ``o`` out, ``h`` heads ..."""
    used: set[str] = set()
    names = []
    spare = iter(c for c in "abcdefghijklmnopqrstuvwxyz")
    for word in words:
        name = next((c for c in _LETTERS.get(word, "xyz") if c not in used), None)
        while name is None or name in used:
            name = next(spare)
        used.add(name)
        names.append(name)
    return names


def tp_expression(row: LeafRole, model: int, data: int, fsdp_axis: int | None) -> str:
    """The expression that splits ``row.axis`` over the model axis (and ``fsdp_axis`` over data).

    Mesh axes follow the right-hand side's order: the data axis, then the model axis, then the
    copies where the split axis does not divide by the whole model axis.
    """
    names = axis_names(row.axes)
    assert row.axis is not None
    left = " ".join(names)
    whole = row.parts == model
    split = f"{names[row.axis]}{'*' if whole and data == 1 else row.parts}"
    copies = [str(model // row.parts)] if row.parts < model else []
    if data == 1:
        right = [split if i == row.axis else name for i, name in enumerate(names)] + copies
        return f"{left} -> {' '.join(right)}"
    rest = [name for i, name in enumerate(names) if i not in (row.axis, fsdp_axis)]
    first = f"{names[fsdp_axis]}*" if fsdp_axis is not None else str(data)
    return f"{left} -> {' '.join([*rest, first, split, *copies])}"


class _Pattern(str):
    r"""A path part given as a regex (``layer_\d+``), not as text to match literally."""


_DIGIT_RUN = re.compile(r"\d+")


def _numbered(part: str) -> bool:
    """A part that numbers its layer inside a name: ``layer_3``, ``h3`` (not ``3``)."""
    return not part.isdigit() and _DIGIT_RUN.search(part) is not None


def rule_patterns(
    paths: Sequence[str], choices: Sequence[tuple[Any, str]], strip: int = 0
) -> list[tuple[str, Any, str]]:
    r"""Compact ``(regex, expression, note)`` rules that give each path its choice.

    Each path becomes ``(^|/)`` + its parts + ``$`` (so it matches with or without the step's
    parameter name in front, and inside optimizer state that mirrors the parameters), with the
    first ``strip`` parts left out; layer numbers become ``\d+`` (``layers/\d+``) where the
    layers agree (for ``layer_\d+``, where all of them agree, notes included); paths differing
    in one part are combined (``(q|k|v)``). Checked: every path resolves to its own expression.
    """
    if not paths:
        return []
    relative = [tuple(path.split("/")[strip:]) for path in paths]
    # Layers numbered inside a name (layer_0, layer_1): one rule when every layer agrees.
    by_name: dict[tuple, list[int]] = {}
    for i, parts in enumerate(relative):
        if any(_numbered(p) for p in parts):
            key = tuple(
                None
                if p.isdigit()
                else _Pattern(_DIGIT_RUN.sub(r"\\d+", re.escape(p)))
                if _numbered(p)
                else p
                for p in parts
            )
            by_name.setdefault(key, []).append(i)
    entries: list[tuple[tuple, Any, str]] = []
    taken: set[int] = set()
    for key, indices in by_name.items():
        if len(indices) < 2:
            continue
        notes = {_unnumbered(choices[i][1], relative[i]) for i in indices}
        expressions = {repr(choices[i][0]) for i in indices}
        if len(notes) == 1 and len(expressions) == 1:
            entries.append(
                (tuple(None if p is None else {p} for p in key), choices[indices[0]][0], notes.pop())
            )
            taken.update(indices)
    groups: dict[tuple, list[int]] = {}
    for i, parts in enumerate(relative):
        if i not in taken:
            groups.setdefault(tuple(None if p.isdigit() else p for p in parts), []).append(i)
    exact: list[tuple[tuple, Any, str]] = []
    for key, indices in groups.items():
        counts: dict[tuple, int] = {}
        for i in indices:
            counts[_choice_key(choices[i])] = counts.get(_choice_key(choices[i]), 0) + 1
        majority = max(counts, key=lambda k: counts[k])
        pick = next(i for i in indices if _choice_key(choices[i]) == majority)
        entries.append((tuple(({p} if p is not None else None) for p in key), *choices[pick]))
        for i in indices:
            if _choice_key(choices[i]) != majority:
                exact.append((tuple({p} for p in relative[i]), *choices[i]))
    entries = _combine(entries)
    # Exceptions first (longest first: a path ending another's is more specific); the general
    # rules match disjoint sets of paths, so their order is free: by path, a layer's together.
    exact = sorted(exact, key=lambda e: -len(e[0]))
    rules = [(_regex(parts), expression, note) for parts, expression, note in exact]
    general = [(_regex(parts), expression, note) for parts, expression, note in entries]
    rules += sorted(general, key=lambda rule: rule[0].replace("(^|/)", "").replace("(", "").lower())
    # Check: each path's first matching rule gives it its expression; else exact paths.
    compiled = [re.compile(rule[0]) for rule in rules]
    for path, (expression, _) in zip(paths, choices, strict=True):
        first = next((rule for rule, c in zip(rules, compiled, strict=True) if c.search(path)), None)
        if first is None or repr(first[1]) != repr(expression):
            return [
                (_regex(tuple({p} for p in parts)), expression, note)
                for parts, (expression, note) in sorted(
                    zip(relative, choices, strict=True), key=lambda e: -len(e[0])
                )
            ]
    return rules


def _unnumbered(note: str, parts: tuple[str, ...]) -> str:
    """A note with the layer names of its own path numbered ``*`` (``layer_*``), to compare layers."""
    for part in parts:
        if _numbered(part):
            note = re.sub(rf"(?<![\w]){re.escape(part)}(?![\w])", _DIGIT_RUN.sub("*", part), note)
    return note


def _choice_key(choice: tuple[Any, str]) -> tuple:
    return (repr(choice[0]), choice[1])


def _combine(entries: list[tuple[tuple, Any, str]]) -> list[tuple[tuple, Any, str]]:
    """Entries with the same choice whose patterns differ in one part become one: ``(a|b)``.

    Only patterns equal in every other part are combined, so the combined pattern matches
    exactly the paths the two matched.
    """
    changed = True
    while changed:
        changed = False
        for position in range(max((len(e[0]) for e in entries), default=0)):
            buckets: dict[tuple, int] = {}
            out: list[tuple[tuple, Any, str]] = []
            for parts, expression, note in entries:
                if position >= len(parts) or parts[position] is None:
                    out.append((parts, expression, note))
                    continue
                rest = tuple(
                    None if p is None else frozenset(p) for i, p in enumerate(parts) if i != position
                )
                key = (len(parts), rest, repr(expression), note)
                index = buckets.get(key)
                if index is None:
                    buckets[key] = len(out)
                    out.append((parts, expression, note))
                else:
                    old = out[index][0]
                    merged = (*old[:position], old[position] | parts[position], *old[position + 1 :])
                    out[index] = (merged, expression, note)
                    changed = True
            entries = out
    return entries


def _regex(parts: tuple) -> str:
    pieces = []
    for part in parts:
        if part is None:
            pieces.append(r"\d+")
            continue
        texts = sorted(p if isinstance(p, _Pattern) else re.escape(p) for p in part)
        pieces.append(texts[0] if len(texts) == 1 else "(" + "|".join(texts) + ")")
    return "(^|/)" + "/".join(pieces) + "$"
