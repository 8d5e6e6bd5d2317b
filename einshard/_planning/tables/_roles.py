"""Roles: each parameter leaf's tensor-parallel role, chosen for one model-axis size, and why.

:func:`read` traces the step and runs the jaxpr reader (``_jaxpr``); :func:`choose_splits` picks, for
one model-axis size, the groups that split the most parameter bytes per byte of communication,
one axis per leaf, and says why for every leaf; :class:`Roles` is the printable table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..._arrays._leaves import is_traced, nbytes
from ..._language._text import table_text
from ..._sharding._devices import count_to_plan
from ..._tracing._call import StepCall, trace
from ..._tracing._parameter_axes import Reader
from ..._tracing._values import ACT, CORE, PARAM, Value, plain

__all__ = ["LeafRole", "Roles", "choose_splits", "read", "read_call", "roles"]

# --- reading a step ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the dataflow says of every parameter leaf, for any model-axis size (see :func:`choose_splits`)."""

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


def read(step: Callable[..., Any] | str, params: Any, batch: Any) -> Reading:
    """Traces ``step(params, batch)`` on abstract inputs and reads every parameter leaf's axes."""
    return read_call(StepCall.of(step, (params, batch), {}))


def read_call(call: StepCall, traced: Any = None) -> Reading:
    """:func:`read` for a step whose arguments are already named and flattened (the planner's).

    The parameters are the call's first argument; their paths are as rules see them below it
    (``layers/0/kernel``, without the step's parameter name). ``traced``: the step's jaxpr
    (:func:`~einshard._tracing._call.trace`), when the caller has traced it already.
    """
    import time

    import jax
    import numpy as np

    start = time.perf_counter()
    params_leaves = call.argument_leaves(0)
    param_leaves = [call.leaves[i] for i in params_leaves]
    paths = [call.paths[i].partition("/")[2] for i in params_leaves]
    leaves = call.leaves
    dynamic = list(call.arrays)
    if traced is None:
        traced = trace(call)
    n_params = len(param_leaves)
    is_param = [i < n_params and is_traced(leaves[i]) for i in range(len(leaves))]
    param_index = {i: i for i in range(n_params)}
    shapes = tuple(tuple(np.shape(leaf)) if is_traced(leaf) else () for leaf in param_leaves)
    reader = Reader(shapes)
    inputs = []
    for i in dynamic:
        shape = tuple(np.shape(leaves[i]))
        if is_param[i]:
            leaf = param_index[i]
            base = reader.offsets[leaf]
            axes = tuple(frozenset({(base + k, 1, size)}) for k, size in enumerate(shape))
            inputs.append(Value(PARAM, axes, frozenset({leaf})))
        else:
            inputs.append(plain(ACT, len(shape)))
    reader.run(traced, inputs)
    cost = [0.0] * len(reader.node_leaf)
    for (_, _, node), amount in reader.costs.items():
        cost[node] += amount
    dtypes, sizes, floating = [], [], []
    for leaf in param_leaves:
        if is_traced(leaf):
            dtypes.append(str(leaf.dtype))
            try:
                sizes.append(nbytes(np.shape(leaf), leaf.dtype))
                floating.append(bool(jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)))
            except Exception:  # extended dtypes (random keys)
                sizes.append(0)
                floating.append(False)
        else:
            dtypes.append("")
            sizes.append(0)
            floating.append(False)
    return Reading(
        paths=tuple(paths),
        shapes=shapes,
        dtypes=tuple(dtypes),
        nbytes=tuple(sizes),
        floating=tuple(floating),
        offsets=tuple(reader.offsets),
        node_leaf=tuple(reader.node_leaf),
        node_axis=tuple(reader.node_axis),
        group=tuple(reader.find(n) for n in range(len(reader.node_leaf))),
        limit=tuple(reader.limit),
        roles=tuple(frozenset(r) for r in reader.words),
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
        return nbytes(row.shape, row.dtype)
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


def choose_splits(reading: Reading, model: int) -> tuple[LeafRole, ...]:
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
        if not any(reading.roles[n] & CORE for n in nodes):
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
            elif not reading.roles[n] & CORE and top:
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
    cores = [n for n in nodes if reading.roles[n] & CORE] or nodes
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
        cores = cores or [n for n in group.split if reading.roles[n] & CORE]
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
        # The axis whose break limits it most: the one a split would have taken.
        known = [n for n in nodes if n in reading.why]
        stopped = min(
            known, key=lambda n: (reading.limit[n], -reading.shapes[leaf][reading.node_axis[n]]), default=None
        )
        if stopped is None:
            return "no split: read by an operation einshard cannot see into"
        return f"no split: axis {reading.node_axis[stopped]} is {reading.why[stopped]}"
    cores = [n for n in nodes if reading.roles[n] & CORE and "layer" not in reading.roles[n]]
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
    model = count_to_plan(n_devices, hint="Give the model axis's size, e.g. n_devices=8.")
    reading = read(step, params, batch)
    return Roles(choose_splits(reading, model), model, reading.stops, reading.seconds)
