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
step. ``_roles.choose_splits`` picks, for one model-axis size, the groups that split the most
parameter bytes per byte of communication, one axis per leaf, and says why for every leaf.

The backward pass of a training step (JAX marks its operations ``transpose(jvp(...))``) and what
is computed from the gradients (the optimizer) are not read: the forward pass decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._language._union import UnionFind
from ._jaxprs import (
    CALL,
    PER_DEVICE,
    inner_jaxpr,
    is_backward,
    keeps_shape,
    reshape_groups,
    runs,
    scan_counts,
    user_line,
    var_nbytes,
    var_rank,
    var_shape,
)
from ._primitives import CALLS, CONSTANT, CUMULATIVE, ELEMENTWISE, IDENTITY, RANDOM, REDUCE, STOPS
from ._values import ACT, BACK, CONST, EMPTY, PARAM, Value, plain, same_value

__all__ = ["HANDLED", "READ", "Reader"]


class Reader:
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
        self.sets = UnionFind(range(count))  # the parameter axes split together
        self.limit = [shapes[leaf][axis] for leaf, axis in zip(self.node_leaf, self.node_axis, strict=True)]
        # Per parameter axis (node): words for what it was seen doing ('contraction', 'heads'...).
        self.words: list[set[str]] = [set() for _ in range(count)]
        self.size = list(self.limit)
        self.why: dict[int, str] = {}
        self.bound: dict[int, int] = {}
        self.feeds: set[tuple[int, int]] = set()
        self.costs: dict[tuple, float] = {}
        self.uses: list[set[str]] = [set() for _ in shapes]
        self.stops: dict[str, str] = {}
        self.call_sites: tuple[int, ...] = ()  # the calls (id of each eqn) the walk is inside
        self.scale = 1.0

    # --- the groups ---------------------------------------------------------------------------

    def find(self, node: int) -> int:
        """The representative of the axes split together with parameter axis ``node``."""
        return self.sets.find(node)

    def join(self, nodes: Iterable[int]) -> None:
        """Parameter axes that must be split together."""
        self.sets.join(nodes)

    def pair(self, columns: frozenset, rows: frozenset) -> None:
        """A weight's output axes (``columns``' tags) meet a later weight's contraction axes (``rows``').

        The axes are split together, and each column feeds each row of another leaf (a Megatron pair).
        """
        self.join(node for node, _, _ in rows | columns)
        for column, _, _ in columns:
            for row, _, _ in rows:
                if self.node_leaf[column] != self.node_leaf[row]:
                    self.feeds.add((column, row))

    def brk(self, tags: Iterable[tuple[int, int, int]], reason: str) -> None:
        """The tagged axes cannot be split here: their parameter axes split only above them.

        A parameter axis keeps, as its ``why``, the reason of the break that limits it most on
        its own (the first of equals): a harmless earlier cut between whole heads does not hide
        the break that stops the split altogether.
        """
        for node, outer, _ in tags:
            self.limit[node] = math.gcd(self.limit[node], outer)
            bound = math.gcd(self.size[node], outer)
            if node not in self.why or bound < self.bound[node]:
                self.why[node] = reason
                self.bound[node] = bound

    def cost(self, eqn: Any, nodes: Iterable[int], amount: float) -> None:
        """A collective of ``amount`` bytes per run, if the nodes' axes were split, at this site."""
        for node in nodes:
            self.costs[(self.call_sites, id(eqn), node)] = amount * self.scale

    def mark(self, tags: Iterable[tuple[int, int, int]], word: str) -> None:
        """Notes what the tagged parameter axes were seen doing (``'contraction'``, ``'heads'``...)."""
        for node, _, _ in tags:
            self.words[node].add(word)

    # --- walking ------------------------------------------------------------------------------

    def run(self, jaxpr: Any, inputs: Sequence[Value]) -> list[Value]:
        jaxpr = inner_jaxpr(jaxpr)
        env: dict[Any, Value] = {}
        for var, value in zip(jaxpr.invars, inputs, strict=False):
            env[var] = value
        for var in jaxpr.constvars:
            env[var] = plain(CONST, var_rank(var))

        def get(var: Any) -> Value:
            found = env.get(var) if not hasattr(var, "val") else None
            return found if found is not None else plain(CONST if hasattr(var, "val") else ACT, var_rank(var))

        for eqn in jaxpr.eqns:
            ins = [get(v) for v in eqn.invars]
            if any(v.kind == BACK for v in ins) or is_backward(eqn):
                outs = [plain(BACK, var_rank(v)) for v in eqn.outvars]
            else:
                outs = self.eqn(eqn, ins)
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value
        return [get(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[Value]) -> list[Value]:
        name = eqn.primitive.name
        kind = max((v.kind for v in ins), default=CONST)
        handler = _HANDLERS.get(name)
        if handler is not None:
            return handler(self, eqn, ins)
        if name in ELEMENTWISE:
            return self.elementwise(eqn, ins)
        if name in RANDOM or name in CONSTANT:
            return [plain(CONST, var_rank(v)) for v in eqn.outvars]
        if name in STOPS:
            return self.opaque(eqn, ins, f"{name}, {STOPS[name]}")
        called = runs(eqn)
        # A shard_map's body is read as a call: its leaves' roles are the step's, on blocks.
        if called is not None and called.how in (CALL, PER_DEVICE):
            return self.call(eqn, called.programs[0], ins)
        subs = called.programs if called is not None else ()
        if kind == CONST:
            return [plain(CONST, var_rank(v)) for v in eqn.outvars]
        # A primitive JAX does not define (tests/test_primitives.py holds JAX's own to the lists).
        if not subs and name not in READ and keeps_shape(eqn):
            return self.elementwise(eqn, ins)
        return self.opaque(eqn, ins, f"{name}, which the reading does not follow")

    def call(self, eqn: Any, jaxpr: Any, ins: list[Value], scale: float = 1.0) -> list[Value]:
        sites, old_scale = self.call_sites, self.scale
        self.call_sites, self.scale = (*sites, id(eqn)), old_scale * scale
        try:
            return self.run(jaxpr, ins)
        finally:
            self.call_sites, self.scale = sites, old_scale

    def opaque(self, eqn: Any, ins: list[Value], what: str) -> list[Value]:
        kind = max((v.kind for v in ins), default=CONST)
        for value in ins:
            for tags in value.axes:
                self.brk(tags, f"read by {what}")
                if value.kind == PARAM:
                    self.mark(tags, "opaque")
            for leaf in value.leaves:
                self.uses[leaf].add("opaque")
        if any(value.kind in (PARAM, ACT) for value in ins):
            self.stops.setdefault(eqn.primitive.name, user_line(eqn))
        out = ACT if kind in (PARAM, ACT) else kind
        return [plain(out, var_rank(v)) for v in eqn.outvars]

    # --- elementwise and shape operations -------------------------------------------------------

    def elementwise(self, eqn: Any, ins: list[Value]) -> list[Value]:
        kind = max((v.kind for v in ins), default=CONST)
        outs = eqn.outvars
        rank = var_rank(outs[0])
        if kind == CONST:
            return [plain(CONST, var_rank(v)) for v in outs]
        axes = []
        shape = var_shape(outs[0])
        for axis in range(rank):
            merged: frozenset = EMPTY
            for var, value in zip(eqn.invars, ins, strict=True):
                if len(value.axes) == rank and var_shape(var)[axis] == shape[axis] and value.axes[axis]:
                    merged = merged | value.axes[axis]
            if len(merged) > 1:
                self.join(node for node, _, _ in merged)
            axes.append(merged)
        leaves = frozenset().union(*(v.leaves for v in ins))
        if kind == ACT:
            for value in self.into_activations(ins, "elementwise"):
                for tags in value.axes:
                    self.mark(tags, "elementwise")
            leaves = EMPTY
        value = Value(kind, tuple(axes), leaves)
        return [value if var_rank(v) == rank else plain(kind, var_rank(v)) for v in outs]

    def into_activations(self, ins: list[Value], use: str) -> list[Value]:
        """The parameters among ``ins`` that go into the activations, each leaf's ``use`` recorded."""
        params = [value for value in ins if value.kind == PARAM]
        for value in params:
            for leaf in value.leaves:
                self.uses[leaf].add(use)
        return params

    def identity(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return [ins[i] if i < len(ins) else plain(ACT, var_rank(v)) for i, v in enumerate(eqn.outvars)]

    def broadcast_in_dim(self, eqn: Any, ins: list[Value]) -> list[Value]:
        value, in_shape, out_shape = ins[0], var_shape(eqn.invars[0]), var_shape(eqn.outvars[0])
        axes = [EMPTY] * len(out_shape)
        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
            if in_shape[i] == out_shape[d]:
                axes[d] = value.axes[i]
        return [Value(value.kind, tuple(axes), value.leaves)]

    def transpose(self, eqn: Any, ins: list[Value]) -> list[Value]:
        value = ins[0]
        return [Value(value.kind, tuple(value.axes[i] for i in eqn.params["permutation"]), value.leaves)]

    def squeeze(self, eqn: Any, ins: list[Value]) -> list[Value]:
        value = ins[0]
        rank = len(value.axes)
        drop = {d % rank for d in eqn.params["dimensions"]}
        return [Value(value.kind, tuple(t for i, t in enumerate(value.axes) if i not in drop), value.leaves)]

    def expand_dims(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.reshape(eqn, ins)

    def reshape(self, eqn: Any, ins: list[Value]) -> list[Value]:
        value = ins[0]
        in_shape = var_shape(eqn.invars[0])
        out_shape = var_shape(eqn.outvars[0])
        axes_in = value.axes
        if eqn.params.get("dimensions"):
            order = eqn.params["dimensions"]
            axes_in = tuple(axes_in[i] for i in order)
            in_shape = tuple(in_shape[i] for i in order)
        axes = [EMPTY] * len(out_shape)
        for ins_group, outs_group in reshape_groups(in_shape, out_shape):
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
        return [Value(value.kind, tuple(axes), value.leaves)]

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

    def reduce(self, eqn: Any, ins: list[Value]) -> list[Value]:
        value = ins[0]
        axes = set(eqn.params.get("axes", eqn.params.get("dimensions", ())))
        if value.kind == ACT:
            amount = var_nbytes(eqn.outvars[0])
            for i in axes:
                self.cost(eqn, (node for node, _, _ in value.axes[i]), amount)
        elif value.kind == PARAM:
            for i in axes:
                self.brk(value.axes[i], "reduced over (a statistic of the weight)")
        kept = tuple(t for i, t in enumerate(value.axes) if i not in axes)
        out = [Value(value.kind, kept, value.leaves)]
        return out + [Value(value.kind, kept, value.leaves) for _ in eqn.outvars[1:]]

    def along(self, eqn: Any, ins: list[Value], axes: set[int], reason: str) -> list[Value]:
        """An operation that mixes the elements along ``axes`` (a sort, a scan over an axis).

        The other axes go through as in an elementwise operation; a parameter that goes into
        the activations this way (a class token concatenated in front of them) is read.
        """
        kind = max((v.kind for v in ins), default=CONST)
        rank = var_rank(eqn.outvars[0])
        out = []
        for axis in range(rank):
            merged: frozenset = EMPTY
            for value in ins:
                if len(value.axes) == rank and value.axes[axis]:
                    if axis in axes:
                        self.brk(value.axes[axis], reason)
                    else:
                        merged = merged | value.axes[axis]
                        if kind == ACT and value.kind == PARAM:
                            self.mark(value.axes[axis], "elementwise")
            if len(merged) > 1:
                self.join(node for node, _, _ in merged)
            out.append(merged)
        if kind == ACT:
            self.into_activations(ins, eqn.primitive.name)
        leaves = frozenset().union(*(v.leaves for v in ins)) if kind == PARAM else EMPTY
        value = Value(kind, tuple(out), leaves)
        return [value if var_rank(v) == rank else plain(kind, var_rank(v)) for v in eqn.outvars]

    def cumulative(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.along(eqn, ins, {eqn.params["axis"]}, f"run along by {eqn.primitive.name}")

    def sort(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.along(eqn, ins, {eqn.params["dimension"]}, "sorted along")

    def top_k(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """``top_k`` and ``approx_top_k``: the axis searched along is a break, the others go through."""
        rank = len(ins[0].axes)
        axis = eqn.params.get("axis", eqn.params.get("reduction_dimension", -1))
        axis = axis % rank if rank else 0
        value = ins[0]
        self.brk(value.axes[axis] if rank else (), f"searched along by {eqn.primitive.name}")
        axes = tuple(EMPTY if i == axis else t for i, t in enumerate(value.axes))
        return [Value(value.kind, axes, value.leaves), plain(value.kind, var_rank(eqn.outvars[1]))]

    def slicing(self, eqn: Any, ins: list[Value], sizes: Sequence[int]) -> list[Value]:
        """``slice`` / ``dynamic_slice``: axes taken whole keep their tags, the others do not."""
        value = ins[0]
        shape = var_shape(eqn.invars[0])
        axes = []
        for i, (full, size) in enumerate(zip(shape, sizes, strict=True)):
            if size == full:
                axes.append(value.axes[i])
                continue
            if value.kind == PARAM:
                self.mark(value.axes[i], "layer" if size == 1 else "sliced")
                reason = "indexed (a layer axis)" if size == 1 else "sliced into parts"
            else:
                reason = "sliced into parts"
            self.brk(value.axes[i], reason)
            axes.append(EMPTY)
        return [Value(value.kind, tuple(axes), value.leaves)]

    def slice(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.slicing(eqn, ins, var_shape(eqn.outvars[0]))

    def dynamic_slice(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.slicing(eqn, ins[:1], eqn.params["slice_sizes"])

    def split(self, eqn: Any, ins: list[Value]) -> list[Value]:
        value = ins[0]
        axis = eqn.params["axis"]
        if value.kind == PARAM:
            self.mark(value.axes[axis], "sliced")
        self.brk(
            value.axes[axis],
            "split into parts (as q, k and v one after another: a contiguous split cuts across them)",
        )
        axes = tuple(EMPTY if i == axis else t for i, t in enumerate(value.axes))
        return [Value(value.kind, axes, value.leaves) for _ in eqn.outvars]

    def unstack(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """``k, v = kv``: each output is one index of ``axis`` (a slice of size 1, dropped)."""
        value = ins[0]
        axis = eqn.params["axis"] % max(len(value.axes), 1)
        if value.kind == PARAM:
            self.mark(value.axes[axis], "sliced")
        self.brk(value.axes[axis], "taken apart into its parts (as k and v)")
        axes = tuple(t for i, t in enumerate(value.axes) if i != axis)
        return [Value(value.kind, axes, value.leaves) for _ in eqn.outvars]

    def dynamic_update_slice(self, eqn: Any, ins: list[Value]) -> list[Value]:
        operand, update = ins[0], ins[1]
        shape, part = var_shape(eqn.invars[0]), var_shape(eqn.invars[1])
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
                axes.append(EMPTY)
        return [Value(kind, tuple(axes), operand.leaves | update.leaves if kind == PARAM else EMPTY)]

    def concatenate(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.along(eqn, ins, {eqn.params["dimension"]}, "concatenated with other arrays")

    def stack(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """``jnp.stack``: a concatenate along a new axis (each operand's axes keep their places)."""
        rank = var_rank(eqn.outvars[0])
        axis = eqn.params["axis"] % max(rank, 1)
        grown = [Value(v.kind, (*v.axes[:axis], EMPTY, *v.axes[axis:]), v.leaves) for v in ins]
        return self.along(eqn, grown, {axis}, "stacked with other arrays")

    def tile(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """``jnp.tile``: an axis repeated end to end holds its parameter axis more than once."""
        repeated = {i for i, r in enumerate(eqn.params["reps"]) if r != 1}
        return self.along(eqn, ins, repeated, "repeated end to end (tiled)")

    def rev(self, eqn: Any, ins: list[Value]) -> list[Value]:
        return self.along(eqn, ins, set(eqn.params["dimensions"]), "reversed")

    def fft(self, eqn: Any, ins: list[Value]) -> list[Value]:
        rank = var_rank(eqn.outvars[0])
        count = len(eqn.params["fft_lengths"])
        return self.along(eqn, ins, set(range(rank - count, rank)), "transformed along by an FFT")

    def tie(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """``tie(x, y)`` is ``y`` (``x`` only orders the program)."""
        return [ins[-1]]

    def bitcast_convert_type(self, eqn: Any, ins: list[Value]) -> list[Value]:
        """Elementwise between types of one width; otherwise a new minor axis: a stop."""
        if var_shape(eqn.invars[0]) == var_shape(eqn.outvars[0]):
            return self.elementwise(eqn, ins)
        return self.opaque(eqn, ins, "bitcast_convert_type, which changes the width of its elements")

    def pad(self, eqn: Any, ins: list[Value]) -> list[Value]:
        padded = {i for i, (lo, hi, inner) in enumerate(eqn.params["padding_config"]) if lo or hi or inner}
        return self.along(eqn, ins[:1], padded, "padded")

    def windowed(self, eqn: Any, ins: list[Value]) -> list[Value]:
        window = eqn.params.get("window_dimensions", ())
        strides = eqn.params.get("window_strides", ()) or (1,) * len(window)
        mixed = {i for i, (w, s) in enumerate(zip(window, strides, strict=False)) if w != 1 or s != 1}
        return self.along(eqn, ins, mixed, "pooled over (a window runs along it)")

    # --- where weights meet activations ---------------------------------------------------------

    def dot_general(self, eqn: Any, ins: list[Value]) -> list[Value]:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        kind = max(lhs.kind, rhs.kind)
        lfree = [i for i in range(len(lhs.axes)) if i not in lc and i not in lb]
        rfree = [i for i in range(len(rhs.axes)) if i not in rc and i not in rb]
        if kind == CONST:
            return [plain(CONST, var_rank(eqn.outvars[0]))]
        if lhs.kind == PARAM and rhs.kind == ACT:
            batch = self.weight(eqn, lhs, rhs, lc, rc, lb, rb)
            axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
            self.mark((t for i in lfree for t in lhs.axes[i]), "free")
            return [Value(ACT, tuple(axes))]
        if rhs.kind == PARAM and lhs.kind == ACT:
            batch = self.weight(eqn, rhs, lhs, rc, lc, rb, lb)
            self.mark((t for i in rfree for t in rhs.axes[i]), "free")
            axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
            return [Value(ACT, tuple(axes))]
        if kind == PARAM:  # weights only: a weight computed from others (LoRA, a tied transpose)
            for i, j in zip(lc, rc, strict=True):
                self.join(node for node, _, _ in lhs.axes[i] | rhs.axes[j])
            batch = self.batch_axes(lhs, rhs, lb, rb)
            axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
            return [Value(PARAM, tuple(axes), lhs.leaves | rhs.leaves)]
        # Two activations (attention's scores and values), or an activation and a constant.
        for i, j in zip(lc, rc, strict=True):
            self.brk(lhs.axes[i] | rhs.axes[j], "contracted with another activation (as q with k)")
        batch = self.batch_axes(lhs, rhs, lb, rb, mark="heads")
        axes = batch + [lhs.axes[i] for i in lfree] + [rhs.axes[i] for i in rfree]
        return [Value(ACT, tuple(axes))]

    def batch_axes(
        self, lhs: Value, rhs: Value, lb: Sequence[int], rb: Sequence[int], mark: str | None = None
    ) -> list[frozenset]:
        """A dot's batch axes: each pair's tags joined (and marked, for two activations' heads)."""
        batch = []
        for i, j in zip(lb, rb, strict=True):
            merged = lhs.axes[i] | rhs.axes[j]
            self.join(node for node, _, _ in merged)
            if mark is not None:
                self.mark(merged, mark)
            batch.append(merged)
        return batch

    def weight(
        self,
        eqn: Any,
        param: Value,
        act: Value,
        pc: Sequence[int],
        ac: Sequence[int],
        pb: Sequence[int],
        ab: Sequence[int],
    ) -> list[frozenset]:
        """A weight meets an activation in a ``dot_general``: its contraction axes paired, its batch axes."""
        for leaf in param.leaves:
            self.uses[leaf].add("dot_general")
        amount = var_nbytes(eqn.outvars[0])
        for i, j in zip(pc, ac, strict=True):
            mine, theirs = param.axes[i], act.axes[j]
            self.mark(mine, "contraction")
            self.cost(eqn, (node for node, _, _ in mine), amount)
            if not mine:
                self.brk(theirs, "contracted with a weight on an axis einshard cannot trace")
                continue
            self.pair(theirs, mine)
        batch = []
        for i, j in zip(pb, ab, strict=True):
            merged = param.axes[i] | act.axes[j]
            self.mark(param.axes[i], "batch")
            self.join(node for node, _, _ in merged)
            batch.append(merged)
        return batch

    def conv_general_dilated(self, eqn: Any, ins: list[Value]) -> list[Value]:
        lhs, rhs = ins
        numbers = eqn.params["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
        groups = eqn.params.get("feature_group_count", 1)
        rank = var_rank(eqn.outvars[0])
        if lhs.kind == CONST and rhs.kind == CONST:
            return [plain(CONST, rank)]
        if lhs.kind != ACT or rhs.kind != PARAM or eqn.params.get("batch_group_count", 1) != 1:
            return self.opaque(eqn, ins, "a convolution of two activations")
        for leaf in rhs.leaves:
            self.uses[leaf].add("conv")
        axes = [EMPTY] * rank
        axes[out_spec[0]] = lhs.axes[lhs_spec[0]]
        out_features, in_features = rhs.axes[rhs_spec[0]], rhs.axes[rhs_spec[1]]
        features = lhs.axes[lhs_spec[1]]
        self.mark(out_features, "conv-out")
        for axis in rhs_spec[2:]:
            self.mark(rhs.axes[axis], "window")
            self.brk(rhs.axes[axis], "a convolution window")
        for axis in lhs_spec[2:]:
            self.brk(lhs.axes[axis], "run along by a convolution's window")
        if groups == 1:
            self.mark(in_features, "conv-in")
            self.cost(eqn, (node for node, _, _ in in_features), var_nbytes(eqn.outvars[0]))
            self.pair(features, in_features)
            axes[out_spec[1]] = out_features
        else:  # grouped (depthwise): each input feature goes to its own outputs
            self.join(node for node, _, _ in out_features | features)
            self.brk(in_features, "the input features of a grouped convolution")
            axes[out_spec[1]] = out_features | features
        return [Value(ACT, tuple(axes))]

    def gather(self, eqn: Any, ins: list[Value]) -> list[Value]:
        operand, indices = ins[0], ins[1]
        numbers = eqn.params["dimension_numbers"]
        sizes = eqn.params["slice_sizes"]
        shape = var_shape(eqn.invars[0])
        out_rank = var_rank(eqn.outvars[0])
        offset_dims = tuple(numbers.offset_dims)
        collapsed = set(numbers.collapsed_slice_dims)
        batching = tuple(getattr(numbers, "operand_batching_dims", ()))
        index_batching = tuple(getattr(numbers, "start_indices_batching_dims", ()))
        kind = max(operand.kind, indices.kind)
        if kind == CONST:
            return [plain(CONST, out_rank)]
        lookup = operand.kind == PARAM and indices.kind == ACT
        indexing = operand.kind == PARAM and indices.kind == CONST
        axes = [EMPTY] * out_rank
        rest = [i for i in range(out_rank) if i not in offset_dims]
        index_axes = [i for i in range(len(indices.axes) - 1)]
        for position, axis in zip(rest, index_axes, strict=False):
            axes[position] = indices.axes[axis]
        kept = [i for i in range(len(shape)) if i not in collapsed and i not in batching]
        amount = var_nbytes(eqn.outvars[0])
        for position, axis in zip(offset_dims, kept, strict=False):
            if sizes[axis] == shape[axis]:
                axes[position] = operand.axes[axis]
                if lookup:
                    self.mark(operand.axes[axis], "free")
        for axis in range(len(shape)):
            if sizes[axis] == shape[axis] or axis in batching:
                continue
            tags = operand.axes[axis]
            if lookup:
                self.mark(tags, "gathered")
                self.cost(eqn, (node for node, _, _ in tags), amount)
            elif indexing and math.prod(var_shape(eqn.invars[1])[:-1]) > 1:  # a table read by fixed indices
                self.mark(tags, "indexed")
                self.brk(tags, "looked up by indices the step computes, not from the batch")
            elif indexing:
                self.mark(tags, "layer" if sizes[axis] == 1 else "sliced")
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
        out_kind = PARAM if indexing else ACT
        return [Value(out_kind, tuple(axes), operand.leaves if indexing else EMPTY)]

    def scatter(self, eqn: Any, ins: list[Value]) -> list[Value]:
        operand = ins[0]
        numbers = eqn.params["dimension_numbers"]
        touched = set(numbers.scatter_dims_to_operand_dims) | set(numbers.inserted_window_dims)
        for value in ins[2:]:
            for tags in value.axes:
                self.brk(tags, "scattered")
        return self.along(eqn, [operand], touched, "scattered into")

    # --- control flow ---------------------------------------------------------------------------

    def scan(self, eqn: Any, ins: list[Value]) -> list[Value]:
        params = eqn.params
        body = params["jaxpr"]
        consts, carries = scan_counts(params, len(ins))
        length = int(params.get("length", 1))
        head, carry, xs = ins[:consts], ins[consts : consts + carries], ins[consts + carries :]
        slices = []
        for value in xs:
            if value.kind == PARAM:
                self.mark(value.axes[0], "layer")
            self.brk(value.axes[0], "the axis a scan steps along (a layer axis)")
            slices.append(Value(value.kind, value.axes[1:], value.leaves))
        carry, outs = self.loop(eqn, body, head, carry, slices, length)
        ys = [Value(v.kind, (EMPTY, *v.axes), v.leaves) for v in outs[carries:]]
        return carry + ys

    def loop(
        self,
        eqn: Any,
        body: Any,
        head: list[Value],
        carry: list[Value],
        tail: list[Value],
        scale: float,
    ) -> tuple[list[Value], list[Value]]:
        """Runs a loop body until its carries' tags settle (a few rounds at most)."""
        outs: list[Value] = []
        for _ in range(4):
            outs = self.call(eqn, body, head + carry + tail, scale)
            merged = [_union(a, b, self) for a, b in zip(carry, outs[: len(carry)], strict=True)]
            if all(same_value(a, b) for a, b in zip(carry, merged, strict=True)):
                break
            carry = merged
        return carry, outs

    def while_loop(self, eqn: Any, ins: list[Value]) -> list[Value]:
        params = eqn.params
        cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
        head = ins[cond_consts : cond_consts + body_consts]
        carry = ins[cond_consts + body_consts :]
        carry, _ = self.loop(eqn, params["body_jaxpr"], head, carry, [], 1.0)
        return carry

    def cond(self, eqn: Any, ins: list[Value]) -> list[Value]:
        results = [self.call(eqn, branch, ins[1:]) for branch in eqn.params["branches"]]
        out = results[0]
        for other in results[1:]:
            out = [_union(a, b, self) for a, b in zip(out, other, strict=True)]
        return out


def _union(a: Value, b: Value, reader: Reader) -> Value:
    if len(a.axes) != len(b.axes):
        return plain(max(a.kind, b.kind), len(a.axes))
    axes = []
    for x, y in zip(a.axes, b.axes, strict=True):
        merged = x | y
        if len(merged) > 1:
            reader.join(node for node, _, _ in merged)
        axes.append(merged)
    return Value(max(a.kind, b.kind), tuple(axes), a.leaves | b.leaves)


_HANDLERS: dict[str, Callable[[Reader, Any, list[Value]], list[Value]]] = {
    "dot_general": Reader.dot_general,
    "conv_general_dilated": Reader.conv_general_dilated,
    "gather": Reader.gather,
    "broadcast_in_dim": Reader.broadcast_in_dim,
    "reshape": Reader.reshape,
    "expand_dims": Reader.expand_dims,
    "transpose": Reader.transpose,
    "squeeze": Reader.squeeze,
    "slice": Reader.slice,
    "dynamic_slice": Reader.dynamic_slice,
    "dynamic_update_slice": Reader.dynamic_update_slice,
    "split": Reader.split,
    "unstack": Reader.unstack,
    "concatenate": Reader.concatenate,
    "stack": Reader.stack,
    "tile": Reader.tile,
    "rev": Reader.rev,
    "fft": Reader.fft,
    "tie": Reader.tie,
    "bitcast_convert_type": Reader.bitcast_convert_type,
    "approx_top_k": Reader.top_k,
    "pad": Reader.pad,
    "sort": Reader.sort,
    "top_k": Reader.top_k,
    "scan": Reader.scan,
    "while": Reader.while_loop,
    "cond": Reader.cond,
    "reduce_window_sum": Reader.windowed,
    "reduce_window_max": Reader.windowed,
    "reduce_window_min": Reader.windowed,
    "reduce_window": Reader.windowed,
    "select_and_gather_add": Reader.windowed,
    "select_and_scatter_add": Reader.windowed,
    "select_and_scatter": Reader.windowed,
    "scatter": Reader.scatter,
    "scatter-add": Reader.scatter,
    "scatter_add": Reader.scatter,
    "scatter-mul": Reader.scatter,
    "scatter-min": Reader.scatter,
    "scatter-max": Reader.scatter,
    "scatter-sub": Reader.scatter,
    **{name: Reader.identity for name in IDENTITY},
    **{name: Reader.reduce for name in REDUCE},
    **{name: Reader.cumulative for name in CUMULATIVE},
}


HANDLED = frozenset(_HANDLERS)
"""The primitives with a handler of their own."""

READ = HANDLED | ELEMENTWISE | IDENTITY | REDUCE | CUMULATIVE | RANDOM | CONSTANT | CALLS
"""Every primitive the reader follows (the others of JAX's own stop it: ``_primitives.STOPS``)."""
