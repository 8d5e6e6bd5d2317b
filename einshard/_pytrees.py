"""Whole pytrees from a rule table: ``shard_pytree``, ``pytree_shardings``, ``init_sharded``.

Each array leaf gets the expression of the first rule whose regex matches its
path. Planning (which rule, which expression, does it divide) is pure and
needs only a device count, so :func:`~einshard.explain` can plan for devices
the machine does not have; placing goes through the arrays layer.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.core import Tracer, eval_jaxpr

from ._arrays import _resolve, einshard
from ._devices import Devices, resolve_devices
from ._errors import EinshardError, EinshardWarning
from ._inputs import flatten_or_explain
from ._layout import Layout, compile_layout
from ._multihost import place_many
from ._rules import Indivisible, Rule, Rules, RulesLike, Unmatched, _check_policies, path_string
from ._sharding import ambient_mesh

__all__ = [
    "EinshardWarning",
    "LeafPlan",
    "init_sharded",
    "plan_tree",
    "pytree_shardings",
    "shard_pytree",
]

REPLICATE = "... -> * ..."


class LeafPlan(NamedTuple):
    """How one array leaf is laid out.

    Attributes:
        path: The leaf's path, e.g. ``'layers/0/mlp/w1/kernel'``.
        shape: The leaf's shape.
        dtype: The leaf's dtype.
        rule: The rule that decided it, or ``None`` (a scalar, or no rule
            matched and the policy replicates).
        expression: The expression applied.
        layout: The resolved layout.
        note: Why the leaf did not simply follow its first matching rule, or ``None``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    rule: Rule | None
    expression: str
    layout: Layout
    note: str | None = None


def is_array_leaf(leaf: Any) -> bool:
    """Whether a leaf is an array to place: ``jax.Array``, NumPy array or scalar, ``ShapeDtypeStruct``.

    Python scalars, strings, functions and other objects pass through untouched.
    """
    kind = type(leaf)
    if kind in _ARRAY_TYPES:  # by identity first: isinstance against jax.Array's ABC is slow
        return True
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        if not issubclass(kind, Tracer):  # whether a tracer is an array can depend on the tracer
            _ARRAY_TYPES.add(kind)
        return True
    return False


_ARRAY_TYPES: set[type] = {jax.ShapeDtypeStruct, np.ndarray}


def plan_tree(
    tree: Any,
    rules: RulesLike,
    *,
    n_devices: int,
    unmatched: Unmatched = "error",
    indivisible: Indivisible = "error",
) -> tuple[list[tuple[Any, LeafPlan | None]], Any, tuple[Rule, ...]]:
    """Plans every leaf of ``tree``: pure, for any device count.

    Returns:
        ``(leaves, treedef, unused)``: each leaf with its plan (``None`` for
        leaves that pass through), the tree structure, and the rules that
        decided no leaf.
    """
    table = rules if isinstance(rules, Rules) else Rules(rules)
    _check_policies(unmatched, indivisible)
    leaves, paths, treedef = _flatten_with_paths(tree)
    used: set[int] = set()
    planned: list[tuple[Any, LeafPlan | None]] = []
    # Leaves of one kind (same rule, same shape) share a layout: decide each kind once.
    fitting: dict[tuple[int, tuple[int, ...]], Layout] = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if not is_array_leaf(leaf):
            planned.append((leaf, None))
            continue
        shape = tuple(leaf.shape)
        rule = table.match(path) if shape else None
        layout = None if rule is None else fitting.get((rule.index, shape))
        if layout is not None and rule is not None:
            plan = LeafPlan(path, shape, leaf.dtype, rule, rule.expression, layout)
        else:
            plan = _plan_leaf(path, leaf, table, n_devices, unmatched, indivisible)
            if rule is not None and plan.rule is rule and plan.note is None:
                fitting[rule.index, shape] = plan.layout
        if plan.rule is not None:
            used.add(plan.rule.index)
        planned.append((leaf, plan))
    unused = tuple(rule for rule in table if rule.index not in used)
    return planned, treedef, unused


# Tree structure -> the path of each leaf, for the last few structures. Few: a structure's
# hash ignores dict keys, so structures of one shape share a bucket and are compared in turn.
_PATHS: collections.OrderedDict[Any, list[str]] = collections.OrderedDict()
_PATHS_KEPT = 16


def _flatten_with_paths(tree: Any) -> tuple[list[Any], list[str], Any]:
    """The leaves, their ``/``-joined paths and the tree structure; paths cached per structure."""
    leaves, treedef = flatten_or_explain(jax.tree_util.tree_flatten, tree)
    paths = _PATHS.get(treedef)
    if paths is None:
        try:
            paths = _structure_paths(treedef)
        except RecursionError:  # deeper than Python's stack: JAX's own (C++) flattening copes
            paths = None
        if paths is None:
            paths = flatten_or_explain(_leaf_paths, tree)
        _PATHS[treedef] = paths
        if len(_PATHS) > _PATHS_KEPT:
            _PATHS.popitem(last=False)
    else:
        _PATHS.move_to_end(treedef)
    return leaves, paths, treedef


def _structure_paths(treedef: Any) -> list[str] | None:
    """The leaf paths read off a structure of plain dicts, lists, tuples and ``None``.

    Much cheaper than ``tree_flatten_with_path`` for models whose layers repeat: the paths
    inside a subtree are built once per distinct subtree structure (all layers of a model
    share one) and prefixed per occurrence. ``None`` for any other node type (namedtuples,
    Flax variables, Equinox modules, ...), whose keys only their own flattening knows.
    """
    known: dict[Any, list[str] | None] = {}

    def inside(node: Any) -> list[str] | None:
        if node not in known:
            known[node] = _paths_below(node, inside)
        return known[node]

    return inside(treedef)


def _paths_below(node: Any, inside: Callable[[Any], list[str] | None]) -> list[str] | None:
    """The paths of a structure node's leaves relative to it (``inside`` gives its children's)."""
    data = node.node_data()
    if data is None:  # a leaf: its path is the path to it
        return [""]
    kind, keys = data
    children = node.children()
    if kind is dict:
        names = [str(key) for key in keys]
    elif kind is list or kind is tuple or kind is type(None):
        names = [str(i) for i in range(len(children))]
    else:  # namedtuples and registered classes may name their children their own way
        return None
    paths: list[str] = []
    for name, child in zip(names, children, strict=True):
        below = inside(child)
        if below is None:
            return None
        paths += [f"{name}/{path}" if path else name for path in below]
    return paths


def _leaf_paths(tree: Any) -> list[str]:
    """The path of every leaf, without the ``value`` attribute of framework wrappers."""
    wrappers = _wrapper_types()
    if not wrappers:
        return [path_string(key_path) for key_path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    paths = []
    for key_path, node in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, wrappers)
    )[0]:
        if not isinstance(node, wrappers):
            paths.append(path_string(key_path))
            continue
        for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
            if inner and getattr(inner[0], "name", None) == "value":
                inner = inner[1:]
            paths.append(path_string((*key_path, *inner)))
    return paths


def _wrapper_types() -> tuple[type, ...]:
    """Wrappers whose ``value`` is not part of a path: Flax's, when Flax is already imported.

    Looked up in ``sys.modules`` so that einshard never imports a framework itself.
    """
    found = []
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(getattr(nnx, "Variable", None), type):
        found.append(nnx.Variable)
    meta = sys.modules.get("flax.core.meta")
    if meta is not None and isinstance(getattr(meta, "AxisMetadata", None), type):
        found.append(meta.AxisMetadata)
    return tuple(found)


def _describe(path: str, shape: tuple[int, ...]) -> str:
    return f"{path!r} (shape {shape})"


def _leaf_context(path: str, shape: tuple[int, ...], rule: Rule, n_devices: int) -> str:
    return f"while sharding {_describe(path, shape)} with rule {rule} on {n_devices} devices"


def _plan_leaf(
    path: str, leaf: Any, rules: Rules, n_devices: int, unmatched: Unmatched, indivisible: Indivisible
) -> LeafPlan:
    shape = tuple(leaf.shape)
    dtype = leaf.dtype
    if not shape:  # scalars are replicated whatever the rules say
        return LeafPlan(
            path, shape, dtype, None, REPLICATE, compile_layout(REPLICATE, 0, n_devices), "scalar"
        )
    rule = rules.match(path)
    if rule is None:
        if unmatched == "replicate":
            layout = compile_layout(REPLICATE, len(shape), n_devices)
            return LeafPlan(path, shape, dtype, None, REPLICATE, layout, "no rule matched: replicated")
        tried = ", ".join(repr(r.pattern) for r in rules) or "(the table is empty)"
        raise EinshardError(
            f"no rule matches {_describe(path, shape)}",
            hint=f"Add a rule for it, e.g. (r'{_suggest_pattern(path)}', '{_replicate_for(len(shape))}'), "
            f"end the table with "
            f"(r'.*', '{REPLICATE}') to replicate the rest, or pass unmatched='replicate'.",
            context=[f"rules tried: {tried}"],
        )
    skipped: list[Rule] = []
    candidates = rules.matches(path) if indivisible == "next" else iter([rule])
    for candidate in candidates:
        try:
            layout = compile_layout(candidate.expression, len(shape), n_devices)
        except EinshardError as error:
            raise error.add_context(_leaf_context(path, shape, candidate, n_devices)) from None
        try:
            layout.check_shape(shape)
        except EinshardError as error:
            if indivisible == "error":
                raise error.add_context(_leaf_context(path, shape, candidate, n_devices)) from None
            if indivisible == "replicate":
                layout = compile_layout(REPLICATE, len(shape), n_devices)
                note = f"rule {candidate.index} does not divide {shape}: replicated"
                return LeafPlan(path, shape, dtype, None, REPLICATE, layout, note)
            skipped.append(candidate)
            continue
        note = None
        if skipped:
            note = f"rule{'s' if len(skipped) > 1 else ''} {', '.join(str(r.index) for r in skipped)} "
            note += f"did not divide {shape}: rule {candidate.index} used"
        return LeafPlan(path, shape, dtype, candidate, candidate.expression, layout, note)
    tried = ", ".join(str(r) for r in skipped)
    raise EinshardError(
        f"no matching rule divides {_describe(path, shape)} on {n_devices} devices",
        hint=f"Add a rule that fits, or end the table with (r'.*', '{REPLICATE}').",
        context=[f"rules tried: {tried}"],
    )


def _suggest_pattern(path: str) -> str:
    """A regex for one leaf's kind: its last two path parts, unless one is a layer index."""
    parts = [part for part in path.split("/") if part and not part.isdigit()]
    return "/".join(parts[-2:]) + "$" if parts else ".*"


def _replicate_for(rank: int) -> str:
    names = " ".join("abcdefghijklmnopqrstuvwxyz"[:rank]) if rank <= 26 else "..."
    return f"{names} -> * {names}"


def _device_count(devices: Devices | None) -> int:
    if devices is None:
        ambient = ambient_mesh()
        if ambient is not None:
            return ambient[0].size
    return len(resolve_devices(devices))


def _settings(
    rules: RulesLike, unmatched: Unmatched | None, indivisible: Indivisible | None, strict: bool | None
) -> tuple[Rules, Unmatched, Indivisible, bool]:
    table = rules if isinstance(rules, Rules) else Rules(rules)
    return (
        table,
        table.unmatched if unmatched is None else unmatched,
        table.indivisible if indivisible is None else indivisible,
        table.strict if strict is None else strict,
    )


def _warn_unused(unused: Sequence[Rule], strict: bool) -> None:
    if strict and unused:
        listed = ", ".join(str(rule) for rule in unused)
        warnings.warn(f"rules that matched no leaf: {listed}", EinshardWarning, stacklevel=4)


def shard_pytree(
    tree: Any,
    rules: RulesLike,
    *,
    devices: Devices | None = None,
    unmatched: Unmatched | None = None,
    indivisible: Indivisible | None = None,
    strict: bool | None = None,
) -> Any:
    """Places every array leaf of a pytree by the first rule that matches its path.

    Array leaves (``jax.Array``, NumPy arrays, ``ShapeDtypeStruct``, traced
    values inside ``jit``) are placed as :func:`~einshard.einshard` places
    one array; scalar arrays are replicated; other leaves (``None``, Python
    numbers, strings, functions) pass through untouched.

    Args:
        tree: Any pytree: nested dicts, lists, tuples, dataclasses, modules.
        rules: A :class:`~einshard.Rules` or what builds one: ``(regex,
            expression)`` pairs, or a dict. The first rule whose regex
            ``re.search``-matches a leaf's path (``layers/0/mlp/w1/kernel``) wins.
        devices: The devices, in order (see :func:`~einshard.make_sharding`).
        unmatched: A leaf no rule matches: ``'error'`` (the default) or ``'replicate'``.
        indivisible: A leaf whose axis does not divide by its shard count:
            ``'error'`` (the default), ``'replicate'``, or ``'next'`` (the next
            matching rule that fits).
        strict: Warn (:class:`~einshard.EinshardWarning`) about rules that matched nothing.

    The policies default to those of the :class:`~einshard.Rules` table.

    Returns:
        The tree, with the same structure and values, every array leaf placed.

    Raises:
        EinshardError: A leaf no rule matches, or one its rule does not fit;
            the message names the path, the shape and the rule.

    >>> import jax.numpy as jnp, einshard
    >>> params = {'w1': jnp.zeros((128, 256)), 'b1': jnp.zeros(256), 'step': 3}
    >>> rules = [(r'w1$', 'x y -> x y*'), (r'.*', '... -> * ...')]
    >>> placed = einshard.shard_pytree(params, rules)
    >>> placed['w1'].sharding.shard_shape((128, 256)), placed['step']
    ((128, 32), 3)
    """
    planned, treedef, shardings = _planned_shardings(tree, rules, devices, unmatched, indivisible, strict)
    out: list[Any] = [leaf for leaf, _ in planned]
    batch_at, batch_leaves, batch_shardings = [], [], []
    for i, ((leaf, plan), sharding) in enumerate(zip(planned, shardings, strict=True)):
        if plan is None:
            continue
        if isinstance(leaf, (Tracer, jax.ShapeDtypeStruct)):
            out[i] = _with_context(plan, einshard, leaf, plan.expression, devices=devices)
            continue
        batch_at.append(i)
        batch_leaves.append(leaf)
        batch_shardings.append(sharding)
    if batch_leaves:  # one call places them all, as jax.device_put(tree, shardings) would
        for i, placed in zip(batch_at, place_many(batch_leaves, batch_shardings), strict=True):
            out[i] = placed
    return jax.tree_util.tree_unflatten(treedef, out)


def pytree_shardings(
    tree: Any,
    rules: RulesLike,
    *,
    devices: Devices | None = None,
    unmatched: Unmatched | None = None,
    indivisible: Indivisible | None = None,
    strict: bool | None = None,
) -> Any:
    """The tree of ``NamedSharding`` objects the rules give, for a concrete or an abstract tree.

    For ``jax.eval_shape`` output (``ShapeDtypeStruct`` leaves) this is what
    ``jax.jit(..., out_shardings=...)`` needs to create a model already
    sharded; a concrete tree with the same shapes gives equal shardings.
    Leaves that are not arrays become ``None``.

    Args:
        tree: A pytree of arrays or ``ShapeDtypeStruct`` leaves.
        rules: The rule table (see :func:`shard_pytree`).
        devices: The devices, in order.
        unmatched: See :func:`shard_pytree`.
        indivisible: See :func:`shard_pytree`.
        strict: See :func:`shard_pytree`.

    Returns:
        A tree of the same structure with a ``jax.sharding.NamedSharding`` at
        every array leaf.

    >>> import jax, jax.numpy as jnp, einshard
    >>> abstract = jax.eval_shape(lambda: {'w': jnp.zeros((16, 8))})
    >>> einshard.pytree_shardings(abstract, {'w': 'x y -> x* y'})['w'].shard_shape((16, 8))
    (2, 8)
    """
    _, treedef, shardings = _planned_shardings(tree, rules, devices, unmatched, indivisible, strict)
    return jax.tree_util.tree_unflatten(treedef, shardings)


def _planned_shardings(
    tree: Any,
    rules: RulesLike,
    devices: Devices | None,
    unmatched: Unmatched | None,
    indivisible: Indivisible | None,
    strict: bool | None,
) -> tuple[list[tuple[Any, LeafPlan | None]], Any, list[Any]]:
    """The plan of every leaf, the tree structure, and each leaf's sharding (``None`` if not an array)."""
    table, unmatched_, indivisible_, strict_ = _settings(rules, unmatched, indivisible, strict)
    planned, treedef, unused = plan_tree(
        tree, table, n_devices=_device_count(devices), unmatched=unmatched_, indivisible=indivisible_
    )
    _warn_unused(unused, strict_)
    by_kind: dict[tuple[str, int], Any] = {}  # one lookup per kind of leaf
    shardings = []
    for _, plan in planned:
        if plan is None:
            shardings.append(None)
            continue
        key = (plan.expression, len(plan.shape))
        sharding = by_kind.get(key)
        if sharding is None:
            _, sharding = _with_context(plan, _resolve, plan.expression, len(plan.shape), devices, None)
            by_kind[key] = sharding
        shardings.append(sharding)
    return planned, treedef, shardings


def _with_context(plan: LeafPlan, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return call(*args, **kwargs)
    except EinshardError as error:
        rule = f" with rule {plan.rule}" if plan.rule is not None else ""
        raise error.add_context(f"while sharding {_describe(plan.path, plan.shape)}{rule}") from None


def init_sharded(init_fn: Callable[..., Any], rules: RulesLike, *args: Any, **kwargs: Any) -> Any:
    """Runs ``init_fn(*args, **kwargs)`` so that its result is born sharded.

    The result's shapes are found abstractly (``jax.eval_shape``), the rules
    give their shardings, and ``init_fn`` is compiled with those as
    ``out_shardings``: every device computes only its own shards, and the
    model never exists whole on one device. Array arguments are traced; other
    arguments are passed as they are. The policies are the table's (build a
    :class:`~einshard.Rules` with ``unmatched=`` etc. to change them) and the
    devices those of the call (:func:`~einshard.use_devices` sets them).

    Args:
        init_fn: A function returning a pytree of arrays.
        rules: The rule table (see :func:`shard_pytree`).
        *args: Positional arguments for ``init_fn``.
        **kwargs: Keyword arguments for ``init_fn``.

    Returns:
        ``init_fn(*args, **kwargs)``, value for value, each array placed by its rule.

    >>> import jax, einshard
    >>> def init(key):
    ...     return {'w': jax.random.normal(key, (8, 64))}
    >>> params = einshard.init_sharded(init, [('w', 'x y -> x y*')], jax.random.key(0))
    >>> params['w'].sharding.shard_shape((8, 64))
    (8, 8)
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

    def run(*arrays: Any) -> Any:
        filled = list(leaves)
        for i, array in zip(dynamic, arrays, strict=True):
            filled[i] = array
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
        return init_fn(*call_args, **call_kwargs)

    arrays = [leaves[i] for i in dynamic]
    closed, abstract = jax.make_jaxpr(run, return_shape=True)(*arrays)
    shardings = pytree_shardings(abstract, rules)
    groups = _init_groups(jax.tree_util.tree_leaves(abstract))
    if len(groups) == 1:
        return jax.jit(run, out_shardings=shardings)(*arrays)
    # Several programs, each making a part of the outputs: XLA's scratch space for creating
    # them (random bits, say) is then bounded by a part, not the whole model.
    flat_shardings, out_tree = jax.tree_util.tree_flatten(shardings)
    outputs: list[Any] = [None] * len(flat_shardings)
    for group in groups:
        part = functools.partial(_init_part, closed, group)
        made = jax.jit(part, out_shardings=[flat_shardings[i] for i in group])(*arrays)
        for i, value in zip(group, made, strict=True):
            outputs[i] = value
    return jax.tree_util.tree_unflatten(out_tree, outputs)


_INIT_PART_BYTES = 32 << 20  # smallest part of a born-sharded init compiled on its own
_INIT_MAX_PARTS = 64  # the most parts: bigger models get bigger parts, not more compiles


def _init_groups(leaves: Sequence[Any]) -> list[tuple[int, ...]]:
    """Consecutive output leaves, cut into parts of about the same size in bytes."""
    sizes = [math.prod(leaf.shape) * _itemsize(leaf.dtype) for leaf in leaves]
    budget = max(_INIT_PART_BYTES, -(-sum(sizes) // _INIT_MAX_PARTS))
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if current and filled + size > budget:
            groups.append(tuple(current))
            current, filled = [], 0
        current.append(i)
        filled += size
    groups.append(tuple(current))
    return groups


def _itemsize(dtype: Any) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes, such as PRNG keys
        return int(getattr(dtype, "itemsize", 0) or 0)


def _init_part(closed: Any, group: tuple[int, ...], *arrays: Any) -> list[Any]:
    outputs = eval_jaxpr(closed.jaxpr, closed.consts, *arrays)
    return [outputs[i] for i in group]
