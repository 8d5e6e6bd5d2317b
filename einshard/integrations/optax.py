"""optax: optimizer state sharded like the parameters it mirrors.

Each array leaf of an optax state gets one **derivation**, computed once: the
parameter it follows and, per axis, which axis of that parameter it takes the
split of (or none), with the reason. Shardings (:func:`opt_state_shardings`,
:func:`shard_opt_state`, :func:`init_opt_state`) and the rows of
:func:`explain_opt_state` are read off it. A leaf that **mirrors** a parameter
(Adam's ``mu``) gets its sharding; one with **axes reduced** (Adafactor's
``v_row`` / ``v_col``, SM3), **leading axes added** (L-BFGS's history) or
**axes resized** (GaLore) keeps the split of the axes it carries; **scalars**,
and arrays no layout follows for, are **replicated** on the parameters'
devices (placing warns, :class:`einshard.EinshardWarning`, when those are large).

The state's parameter copies are where optax's
``optax.tree_utils.tree_map_params`` says, when the optimizer is at hand;
otherwise (a restored state) they are found by structure. A copy matches
``params`` by tree structure, by key path (``optax.MaskedNode`` standing for
masked-out parts; wrapper nodes of other types, such as NNX's optimizer
variables, allowed), as a prefix of its structure (SM3's per-axis lists), or
as a subtree (``optax.lookahead``'s fast state mirrors ``params.fast``).
The parameters' layouts are read from ``params`` (placed arrays, or
``jax.ShapeDtypeStruct`` leaves carrying shardings). Importing ``einshard``
does not import optax; this module does.

>>> import jax.numpy as jnp, optax, einshard
>>> from einshard.integrations.optax import init_opt_state
>>> rules = [('w', 'x y -> x y*'), ('b', 'y -> y*')]
>>> params = einshard.shard_pytree({'w': jnp.ones((4, 64)), 'b': jnp.zeros(64)}, rules)
>>> state = init_opt_state(optax.adam(1e-3), params)
>>> state[0].mu['w'].sharding == params['w'].sharding
True
>>> state[0].count.sharding.is_fully_replicated
True
"""

from __future__ import annotations

try:  # first, so a missing framework says how to get it (as the pictures do for rich)
    import optax
except ModuleNotFoundError as error:
    if error.name != "optax":
        raise  # optax is installed but something it imports is not: its own error says what
    raise ImportError(
        "einshard.integrations.optax needs optax, which is not installed; "
        "install it with: pip install optax (or pip install '.[optax]' in einshard's source folder)"
    ) from error

import dataclasses
import itertools
import logging
import math
import warnings
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from .._arrays._arrays import make_sharding
from .._arrays._build import build_sharded
from .._arrays._leaves import carried_sharding, is_array, is_jax_array, nbytes
from .._arrays._place import place_leaves
from .._language._errors import EinshardDeprecationWarning, EinshardError, EinshardWarning, short_repr
from .._language._expression import REPLICATE
from .._language._layout import carried_expression, compile_layout
from .._language._text import size_text
from .._sharding._devices import Devices, call_devices
from .._sharding._mesh import spec_entries, spec_expression, spec_split
from .._trees._assign import as_rules, assign_leaves
from .._trees._calls import is_table
from .._trees._explain import Report, report_row
from .._trees._paths import flatten_or_explain, flatten_with_key_paths, flatten_with_paths
from .._trees._rules import RulesLike

__all__ = ["explain_opt_state", "init_opt_state", "init_sharded", "opt_state_shardings", "shard_opt_state"]

KeyPath = tuple[Any, ...]
Axes = tuple[int | None, ...]  # per leaf axis: the parameter axis whose split it takes, or None

LARGE_REPLICATED_BYTES = 1 << 20  # replicated state no layout follows for, above which placing warns


class Initable(Protocol):
    """Anything with optax's ``init(params) -> state``: a ``GradientTransformation``, ``MultiSteps``."""

    def init(self, params: Any) -> Any:
        """Makes the optimizer state for ``params``."""
        ...


# --- one derivation per state leaf (pure: shapes, structure and the params' splits) ---


@dataclasses.dataclass(frozen=True)
class _Param:
    """What the derivation knows of one parameter: its path, shape and split.

    ``split`` has, per axis, what splits it (``None``: nothing); ``None`` if the
    parameter has no layout to follow, ``why`` saying so.
    """

    path: str
    shape: tuple[int, ...] | None
    split: tuple[Hashable, ...] | None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class _Derivation:
    """How one array leaf of the state is laid out, and why (``note``).

    ``axes`` is ``None`` for a replicated leaf; ``param`` is the parameter it
    follows (or sits beside). ``lost`` marks a non-scalar leaf that no layout
    follows for, where one might have.
    """

    param: int | None
    axes: Axes | None
    note: str
    lost: bool = False


def _is_masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


_FACTORED_STATE: type | None = getattr(optax, "FactoredState", None)  # Adafactor's state


def _children(node: Any) -> list[tuple[KeyPath, Any]] | None:
    """A node's children with their keys; ``None`` for a leaf."""
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda child: child is not node)
    return None if len(children) == 1 and children[0][0] == () else [(tuple(k), c) for k, c in children]


def _key_name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


class _Matcher:
    """Finds, for each array leaf of a state, the parameter whose place it holds.

    ``found`` maps a leaf's key path to ``(parameter index, slot)``; the slot is
    the leaf's index in a list or tuple standing at the parameter's place (SM3
    keeps one accumulator per axis there).
    """

    def __init__(self, params: Any, splits: Sequence[tuple[Hashable, ...] | None]) -> None:
        path_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [tuple(path) for path, _ in path_leaves]
        self.index = {path: i for i, path in enumerate(self.paths)}
        self.splits = splits
        self.parts: dict[Any, list[tuple[KeyPath, int]]] = {}  # structure -> (prefix, first leaf)
        self._collect_parts(params, (), 0)
        self.found: dict[KeyPath, tuple[int, int | None]] = {}

    def _collect_parts(self, node: Any, prefix: KeyPath, first: int) -> int:
        """Registers every inner node below the root by its structure; returns its leaf count."""
        children = _children(node)
        if children is None:
            return 1
        if prefix:
            self.parts.setdefault(jax.tree_util.tree_structure(node), []).append((prefix, first))
        count = 0
        for key, child in children:
            count += self._collect_parts(child, prefix + key, first + count)
        return count

    def visit(self, node: Any, path: KeyPath) -> None:
        aligned = self._align(node, path)
        if aligned is not None:
            for subpath, param, slot in aligned:
                self.found[path + subpath] = (param, slot)
            return
        for key, child in _children(node) or ():
            self.visit(child, path + key)

    def _align(self, node: Any, path: KeyPath) -> list[tuple[KeyPath, int, int | None]] | None:
        """The node's leaves with their parameters, if the node is laid out like (part of) ``params``."""
        if not self.paths:
            return None
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_masked)
        leaves = [(tuple(p), leaf) for p, leaf in path_leaves]
        return self._by_key_path(leaves) or self._by_prefix(node) or self._as_part(treedef, leaves, path)

    def _by_key_path(self, leaves: list[tuple[KeyPath, Any]]) -> list[tuple[KeyPath, int, int | None]] | None:
        # Each leaf at a parameter's path, each MaskedNode standing for the parameter or subtree at
        # its path. Wrapper nodes may differ in type (Flax NNX keeps parameters in Param variables
        # and optimizer state in OptVariable ones).
        if len(leaves) > len(self.paths):
            return None
        covered = [False] * len(self.paths)
        aligned: list[tuple[KeyPath, int, int | None]] = []
        for p, leaf in leaves:
            if _is_masked(leaf):
                under = [i for q, i in self.index.items() if q[: len(p)] == p]
            else:
                under = [self.index[p]] if p in self.index else []
                aligned += [(p, i, None) for i in under]
            if not under or any(covered[i] for i in under):
                return None
            for i in under:
                covered[i] = True
        return aligned if all(covered) else None

    def _by_prefix(self, node: Any) -> list[tuple[KeyPath, int, int | None]] | None:
        """Something at every parameter's place, such as SM3's list of accumulators per parameter."""
        if self.treedef.num_nodes == 1:  # a lone parameter is a prefix of anything
            return None
        try:
            places = self.treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            return None
        aligned: list[tuple[KeyPath, int, int | None]] = []
        for i, place in enumerate(places):
            for sub, _ in jax.tree_util.tree_flatten_with_path(place)[0]:
                slot = sub[0].idx if len(sub) == 1 and isinstance(place, (list, tuple)) else None
                aligned.append((self.paths[i] + tuple(sub), i, slot))
        return aligned

    def _as_part(
        self, treedef: Any, leaves: list[tuple[KeyPath, Any]], path: KeyPath
    ) -> list[tuple[KeyPath, int, int | None]] | None:
        """A copy of a subtree of the parameters, such as lookahead's of ``params.fast``."""
        candidates = self.parts.get(treedef, [])
        if len(candidates) > 1:  # the one named in the state's path (fast_state: fast), or any if alike
            names = [_key_name(key) for key in path]
            named = [c for c in candidates if any(n.startswith(_key_name(c[0][-1])) for n in names)]
            size = len(leaves)
            alike = len({tuple(self.splits[first : first + size]) for _, first in candidates}) == 1
            candidates = named if len(named) == 1 else candidates[:1] if alike else []
        if not candidates:
            return None
        first = candidates[0][1]
        return [(p, first + n, None) for n, (p, _) in enumerate(leaves)]


def _derive(
    shape: tuple[int, ...], param: int | None, slot: int | None, field: str | None, params: Sequence[_Param]
) -> _Derivation:
    """The derivation of one array leaf, from its shape and the parameter whose place it holds."""
    if not shape:
        return _Derivation(param, (), "scalar")
    source = params[param] if param is not None else None
    if source is None or source.shape is None:
        return _Derivation(None, None, "mirrors no parameter: replicated", lost=True)
    candidates = _carried_axes(shape, source.shape, slot, field)
    if not candidates:
        placeholder = field is not None and shape == (1,)
        what = "adafactor placeholder" if placeholder else f"shape {shape}"
        return _Derivation(param, None, f"{what} beside {source.path}: replicated", lost=not placeholder)
    verb, detail = _describe(candidates[0], len(source.shape), field)
    if source.split is None:
        return _Derivation(param, None, f"{verb} {source.path}, which {source.why}: replicated")
    rank = len(source.shape)
    results = {tuple(None if a is None else source.split[a] for a in axes) for axes in candidates}
    if len(results) > 1:
        gone = " or ".join(
            sorted(",".join(str(a) for a in range(rank) if a not in axes) for axes in candidates)
        )
        return _Derivation(
            param, None, f"{verb} {source.path}, axis {gone} (ambiguous): replicated", lost=True
        )
    note = f"{verb} {source.path}{detail}"
    if all(s is None for s in results.pop()) and any(s is not None for s in source.split):
        note += ": replicated"
    return _Derivation(param, candidates[0], note)


def _carried_axes(
    shape: tuple[int, ...], target: tuple[int, ...], slot: int | None, field: str | None
) -> list[Axes]:
    """Every way the leaf's axes can be the parameter's: mirrored, reduced, stacked or resized."""
    n, rank = len(shape), len(target)
    if shape == target:
        return [tuple(range(rank))]
    if n > rank and shape[n - rank :] == target:  # extra leading axes, such as a history
        return [(None,) * (n - rank) + tuple(range(rank))]
    if n == rank:  # axes of another size (a projection): the others keep their split
        axes = tuple(a if size == t else None for a, (size, t) in enumerate(zip(shape, target, strict=True)))
        return [axes] if any(a is not None for a in axes) else []
    if n == 0 or rank > 8:
        return []
    kept = [c for c in itertools.combinations(range(rank), n) if tuple(target[a] for a in c) == shape]
    if field in ("v_row", "v_col") and n == rank - 1 and len(kept) > 1:
        # optax reduces the largest axis for v_row and the next largest for v_col
        # (optax._src.factorized._factored_dims), ties broken by np.argsort.
        order = np.argsort(target)
        exact = int(order[-1] if field == "v_row" else order[-2])
        kept = [c for c in kept if exact not in c] or kept
    if slot is not None and n == 1 and (slot,) in kept:  # one statistic per axis, in axis order (SM3)
        kept = [(slot,)]
    return [tuple(c) for c in kept]


def _describe(axes: Axes, rank: int, field: str | None) -> tuple[str, str]:
    """The verb and detail of a note: ``('mirrors', '')``, ``('reduces', ' (axis 1 reduced)')``, ..."""
    carried = [a for a in axes if a is not None]
    if carried == list(range(rank)):
        lead = len(axes) - rank
        return (
            ("mirrors", "") if not lead else ("stacks", f" ({lead} leading ax{'es' if lead > 1 else 'is'})")
        )
    if len(axes) == len(carried):
        gone = [a for a in range(rank) if a not in carried]
        origin = f"adafactor {field} of" if field in ("v_row", "v_col") else "reduces"
        return origin, f" (ax{'es' if len(gone) > 1 else 'is'} {', '.join(map(str, gone))} reduced)"
    resized = [j for j, a in enumerate(axes) if a is None]
    return "resizes", f" (ax{'es' if len(resized) > 1 else 'is'} {', '.join(map(str, resized))} resized)"


def _derivations(
    opt_state: Any, params: Any, sources: Sequence[_Param], tx: Initable | None
) -> tuple[list[tuple[str, Any, _Derivation | None]], Any]:
    """Every leaf of the state with its path and derivation (``None``: not an array), and the structure."""
    matcher = _Matcher(params, [source.split for source in sources])
    for path, node in _parameter_copies(tx, opt_state):
        matcher.visit(node, path)
    fields = _adafactor_fields(opt_state)
    path_leaves, paths, treedef = flatten_with_key_paths(opt_state)  # one flattening: keys and paths
    derived = []
    for (key_path, leaf), path in zip(path_leaves, paths, strict=True):
        key_path = tuple(key_path)
        if not is_array(leaf):
            derived.append((path, leaf, None))
            continue
        param, slot = matcher.found.get(key_path, (None, None))
        derivation = _derive(tuple(leaf.shape), param, slot, fields.get(key_path), sources)
        derived.append((path, leaf, derivation))
    return derived, treedef


class _Copy:
    """Marks where optax keeps a copy of the parameter tree (not a pytree node: a leaf)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _not_lookahead_notice(record: logging.LogRecord) -> bool:
    """Drops lookahead's notice that the params have no ``fast`` (optax's placeholders, not the user's)."""
    return "has no attribute `fast`" not in str(record.msg)


def _parameter_copies(tx: Initable | None, opt_state: Any) -> list[tuple[KeyPath, Any]]:
    """Where the state keeps copies of the parameter tree: optax says, if it can; else search it all."""
    if tx is None:
        return [((), opt_state)]
    absl = logging.getLogger("absl")
    absl.addFilter(_not_lookahead_notice)  # the logger's level stays: other messages still show
    try:
        marked = optax.tree_utils.tree_map_params(tx, _Copy, opt_state, is_leaf=lambda _: True)
    except Exception:  # an optimizer whose init does not take optax's placeholder params
        return [((), opt_state)]
    finally:
        absl.removeFilter(_not_lookahead_notice)
    found = jax.tree_util.tree_flatten_with_path(marked, is_leaf=lambda node: isinstance(node, _Copy))[0]
    return [(tuple(path), node.value) for path, node in found if isinstance(node, _Copy)]


def _adafactor_fields(opt_state: Any) -> dict[KeyPath, str]:
    """The ``FactoredState`` field (``v_row``, ``v_col``, ``v``) each leaf under one is in."""
    if _FACTORED_STATE is None:
        return {}
    factored = _FACTORED_STATE
    fields = {}
    for prefix, node in jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda n: isinstance(n, factored)
    )[0]:
        if isinstance(node, factored):
            for sub, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
                fields[(*prefix, *sub)] = getattr(sub[0], "name", "")
    return fields


# --- the params a state belongs to ---


def check_params_for_state(opt_state: Any, params: Any) -> None:
    """Refuses ``params`` that cannot be the parameters ``opt_state`` belongs to.

    They must be a tree of arrays (``jax.Array``, NumPy arrays or ``jax.ShapeDtypeStruct``;
    ``None`` allowed), at least one; and when the state holds arrays of more than one element,
    at least one of them must have the shape of a parameter (moments mirror their parameter)
    or be made of some of a parameter's sizes (factored statistics, as Adafactor keeps), or a
    part of the state must have the params' structure.
    """
    leaves = flatten_or_explain(jax.tree_util.tree_leaves, params)
    not_arrays = [leaf for leaf in leaves if not is_array(leaf)]
    if not leaves or not_arrays:
        what = f"{type(params).__name__}" if not leaves else f"a tree holding {short_repr(not_arrays[0])}"
        raise EinshardError(
            f"params must be the tree of arrays the optimizer state belongs to, not {what}",
            hint="Pass the parameters, e.g. shard_opt_state(opt_state, params) with params placed "
            "by shard_pytree (or abstract, with shardings).",
        )
    param_shapes = {tuple(leaf.shape) for leaf in leaves}
    state_shapes = {
        tuple(leaf.shape)
        for leaf in jax.tree_util.tree_leaves(opt_state)
        if is_array(leaf) and math.prod(leaf.shape) > 1
    }
    if (
        state_shapes
        and not any(_sizes_within(state, param) for state in state_shapes for param in param_shapes)
        and not _has_subtree_like(opt_state, params)
    ):
        raise EinshardError(
            "the optimizer state does not belong to these params: none of its arrays has the "
            "shape of a parameter, or sizes of one",
            hint="Pass the params the state was made from (tx.init(params)).",
            context=[
                f"state shapes {short_repr(sorted(state_shapes))}, "
                f"param shapes {short_repr(sorted(param_shapes))}"
            ],
        )


def _sizes_within(state: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Whether ``state``'s sizes are some of ``param``'s (each used at most once)."""
    left = list(param)
    for size in state:
        if size not in left:
            return False
        left.remove(size)
    return True


def _has_subtree_like(tree: Any, like: Any) -> bool:
    """Whether a node of ``tree`` has the tree structure of ``like``."""
    structure = jax.tree_util.tree_structure(like)
    kind = type(like)
    found = []

    def is_like(node: Any) -> bool:
        if type(node) is kind and jax.tree_util.tree_structure(node) == structure:
            found.append(node)
            return True
        return False

    jax.tree_util.tree_leaves(tree, is_leaf=is_like)
    return bool(found)


# --- the params' layouts, and the state's shardings read off the derivations ---


def _param_sharding(leaf: Any, path: str) -> Sharding | None:
    if isinstance(leaf, Tracer):
        raise EinshardError(
            f"the parameter {path!r} is a traced value: its sharding is not known inside jit",
            hint="Compute opt_state_shardings(...) outside the traced function (from placed or "
            "abstract params) and pass it to jax.jit(..., out_shardings=...).",
        )
    # None for a ShapeDtypeStruct without one; NumPy arrays and Python scalars are not placed.
    return carried_sharding(leaf)


_WHY_NO_LAYOUT = {SingleDeviceSharding: "is on one device", type(None): "is not placed"}


class _Placed:
    """The placed parameters: what the derivation knows of each, and the state's shardings off it."""

    def __init__(self, params: Any) -> None:
        leaves, paths, _ = flatten_with_paths(params)
        placed = [
            _param_sharding(leaf, path) if is_array(leaf) else None
            for leaf, path in zip(leaves, paths, strict=True)
        ]
        named = [s for s in placed if isinstance(s, NamedSharding)]
        self.default = max(named, key=lambda s: s.num_devices, default=None) or next(
            (s for s in placed if isinstance(s, SingleDeviceSharding)), None
        )
        # Beside placed params, a param on one device is one left as built (a bias no rule or
        # decorator names): jit moves it to the others' devices, so its state goes there too,
        # replicated, instead of pinning the compiled init to two device sets.
        self.spread = self.default is not None and self.default.num_devices > 1
        self.shardings: list[Sharding | None] = []
        self.sources: list[_Param] = []
        for leaf, path, sharding in zip(leaves, paths, placed, strict=True):
            shape = tuple(leaf.shape) if is_array(leaf) else None
            split, why = None, _WHY_NO_LAYOUT.get(type(sharding), f"has a {type(sharding).__name__}")
            if shape is not None and isinstance(sharding, NamedSharding):
                split = spec_split(sharding, len(shape))
            elif shape is not None and isinstance(sharding, SingleDeviceSharding) and not self.spread:
                split = (None,) * len(shape)  # every parameter on one device: so is the state
            else:
                sharding = None
            self.shardings.append(sharding)
            self.sources.append(_Param(path, shape, split, why))

    def sharding(self, derivation: _Derivation, rank: int) -> Sharding:
        """The sharding a derivation gives: the parameter's spec entry for each carried axis."""
        param = derivation.param
        near = self.shardings[param] if param is not None else None
        if derivation.axes is not None and isinstance(near, NamedSharding):
            assert param is not None
            entries = spec_entries(near, len(self.sources[param].shape or ()))
            spec = PartitionSpec(*(None if a is None else entries[a] for a in derivation.axes))
            return NamedSharding(near.mesh, spec, memory_kind=near.memory_kind)
        for candidate in (near, self.default):  # replicated, beside the parameter or the others
            if isinstance(candidate, NamedSharding):
                return NamedSharding(candidate.mesh, PartitionSpec(), memory_kind=candidate.memory_kind)
            if isinstance(candidate, SingleDeviceSharding):
                return candidate
        return make_sharding(REPLICATE, n_dims=rank)


def _laid_out(
    opt_state: Any, params: Any, tx: Initable | None
) -> tuple[list[tuple[str, Any, _Derivation | None, Sharding | None]], Any]:
    """Every leaf of the state with its derivation and sharding (both ``None``: not an array).

    Warns when the leaves no layout follows for are large.
    """
    placed = _Placed(params)
    derived, treedef = _derivations(opt_state, params, placed.sources, tx)
    laid = [
        (path, leaf, d, None if d is None else placed.sharding(d, len(leaf.shape)))
        for path, leaf, d in derived
    ]
    lost = [(path, leaf) for path, leaf, d, _ in laid if d is not None and d.lost]
    total = sum(nbytes(leaf.shape, leaf.dtype) for _, leaf in lost)
    if placed.spread and total >= LARGE_REPLICATED_BYTES:
        examples = ", ".join(path for path, _ in lost[:3]) + (", ..." if len(lost) > 3 else "")
        warnings.warn(
            f"{len(lost)} optimizer state leaves ({size_text(total)}) follow no parameter's layout and are "
            f"replicated on every device: {examples}; explain_opt_state(...) says why",
            EinshardWarning,
            stacklevel=3,
        )
    return laid, treedef


# --- the public API ---


def opt_state_shardings(opt_state: Any, params: Any, *, tx: Initable | None = None) -> Any:
    """The tree of shardings for an optimizer state, each leaf laid out like what it mirrors.

    A state leaf that mirrors a parameter gets that parameter's sharding; one
    derived from a parameter (axes reduced, leading axes added, axes resized)
    keeps the split of the parameter's axes it carries; scalars and arrays no
    layout follows for are replicated on the parameters' devices. See the
    module documentation for how leaves are matched, and
    :func:`explain_opt_state` for the decision on each leaf.

    Args:
        opt_state: An optax state, concrete or abstract (``jax.eval_shape(tx.init, params)``).
        params: The parameters it belongs to (the tree ``tx.init`` was given),
            placed (``jax.Array`` leaves) or abstract (``jax.ShapeDtypeStruct``
            leaves carrying shardings).
        tx: The optimizer, if at hand: optax then says where the parameter copies are.

    Returns:
        A tree with the structure of ``opt_state``: a ``jax.sharding.Sharding``
        at every array leaf, ``None`` at other leaves. Use it as
        ``jax.jit(..., out_shardings=...)`` for a training step, or as a
        checkpoint restore target.

    Raises:
        EinshardError: If a parameter is a traced value (inside ``jit``).

    Warns:
        EinshardWarning: If state leaves no layout follows for hold 1 MiB or more.

    >>> import jax, jax.numpy as jnp, optax, einshard
    >>> from einshard.integrations.optax import opt_state_shardings
    >>> params = einshard.shard_pytree({'w': jnp.ones((4, 64))}, {'w': 'x y -> x y*'})
    >>> abstract = jax.eval_shape(optax.sgd(0.1, momentum=0.9).init, params)
    >>> opt_state_shardings(abstract, params)[0].trace['w'] == params['w'].sharding
    True
    """
    laid, treedef = _laid_out(opt_state, params, tx)
    return jax.tree_util.tree_unflatten(treedef, [sharding for _, _, _, sharding in laid])


def shard_opt_state(opt_state: Any, params: Any, *, tx: Initable | None = None) -> Any:
    """Places an existing optimizer state like the params it mirrors.

    Concrete leaves are placed in one batched call (across processes too);
    abstract leaves (``jax.ShapeDtypeStruct``) come back carrying their
    shardings; traced leaves (inside ``jit``) get a sharding constraint. Other
    leaves pass through.

    Args:
        opt_state: An optax state, e.g. ``tx.init(params)`` made unsharded, or restored.
        params: The parameters it belongs to, placed or abstract with shardings
            (see :func:`opt_state_shardings`).
        tx: The optimizer, if at hand (see :func:`opt_state_shardings`).

    Returns:
        The state with the same values, laid out as :func:`opt_state_shardings` says.

    >>> import jax.numpy as jnp, optax, einshard
    >>> from einshard.integrations.optax import shard_opt_state
    >>> tx = optax.adam(1e-3)
    >>> state = tx.init({'w': jnp.ones((4, 64))})  # whole, on one device
    >>> params = einshard.shard_pytree({'w': jnp.ones((4, 64))}, {'w': 'x y -> x y*'})
    >>> state = shard_opt_state(state, params)
    >>> state[0].nu['w'].sharding.shard_shape((4, 64))
    (4, 8)
    """
    check_params_for_state(opt_state, params)
    laid, treedef = _laid_out(opt_state, params, tx)
    placed = place_leaves([leaf for _, leaf, _, _ in laid], [sharding for _, _, _, sharding in laid])
    return jax.tree_util.tree_unflatten(treedef, placed)


def init_opt_state(tx: Initable, params: Any) -> Any:
    """Runs ``tx.init(params)`` so that the state is born sharded.

    The state's shapes are found abstractly, their shardings derived from
    the params' (:func:`opt_state_shardings`, with optax saying where the
    parameter copies are), and ``tx.init`` compiled with those as
    ``out_shardings`` by einshard's born-sharded builder (in parts of
    bounded size, as :func:`einshard.init_sharded`): each device computes
    only its own shards, and no state leaf ever exists whole on one device.
    It is ``tx.init`` for sharded params: ``init_opt_state(tx, params)``
    where unsharded code has ``tx.init(params)``. (Until einshard 0.3 it was
    called ``init_sharded``, a name that still works, with a warning.)

    Args:
        tx: An optax ``GradientTransformation`` (any: ``chain``,
            ``inject_hyperparams``, ``masked``, ``lookahead``, ...) or anything
            else with ``init(params)``, such as ``optax.MultiSteps``.
        params: The parameters, placed (``jax.Array`` leaves, e.g. from
            :func:`einshard.shard_pytree` or :func:`einshard.init_sharded`).
            If every array leaf is a ``jax.ShapeDtypeStruct`` carrying a
            sharding, the result is the abstract state, each leaf carrying its
            sharding (a checkpoint restore target); nothing is computed.

    Returns:
        ``tx.init(params)``, value for value, every leaf placed.

    Raises:
        EinshardError: If ``params`` mixes abstract and concrete arrays.

    Warns:
        EinshardWarning: If array params are not placed (NumPy arrays), on
            more than one device: their state is then replicated on every
            device, not split like the params would be.

    >>> import jax.numpy as jnp, optax, einshard
    >>> from einshard.integrations.optax import init_opt_state
    >>> params = einshard.shard_pytree({'w': jnp.ones((4, 64))}, {'w': 'x y -> x y*'})
    >>> state = init_opt_state(optax.MultiSteps(optax.lion(1e-4), every_k_schedule=4), params)
    >>> [shard.data.shape for shard in state.acc_grads['w'].addressable_shards][:2]
    [(4, 8), (4, 8)]
    """
    arrays = [leaf for leaf in jax.tree_util.tree_leaves(params) if is_array(leaf)]
    abstract_params = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in arrays]
    if any(abstract_params) and not all(abstract_params):
        raise EinshardError(
            "params mix abstract (jax.ShapeDtypeStruct) and concrete arrays",
            hint="Pass placed params to create the state, or abstract ones for an abstract state.",
        )
    _warn_if_unplaced(arrays, params)
    if any(abstract_params):
        return shard_opt_state(jax.eval_shape(tx.init, params), params, tx=tx)
    return build_sharded(tx.init, lambda abstract: opt_state_shardings(abstract, params, tx=tx), params)


def _warn_if_unplaced(arrays: list[Any], params: Any) -> None:
    """Warns that a state built from unplaced (NumPy) params is replicated on every device."""
    unplaced = [
        leaf for leaf in arrays if not is_jax_array(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if not unplaced or jax.device_count() < 2:
        return
    total = sum(nbytes(np.shape(leaf), np.asarray(leaf).dtype) for leaf in unplaced)
    warnings.warn(
        f"{len(unplaced)} of the params ({size_text(total)}) are not placed (NumPy arrays): "
        f"the optimizer state that mirrors them is replicated on all {jax.device_count()} devices; "
        "place the params first, params = einshard.shard_pytree(params, rules), "
        "then call init_opt_state(tx, params)",
        EinshardWarning,
        stacklevel=3,
    )


def init_sharded(tx: Initable, params: Any) -> Any:
    """Deprecated: the old name of :func:`init_opt_state`, which it calls (with a warning).

    Args:
        tx: The optimizer (see :func:`init_opt_state`).
        params: The parameters (see :func:`init_opt_state`).

    Returns:
        ``init_opt_state(tx, params)``.

    Warns:
        EinshardDeprecationWarning: Always: call :func:`init_opt_state`.
    """
    warnings.warn(
        "einshard.integrations.optax.init_sharded is now init_opt_state: "
        "call init_opt_state(tx, params) (the old name goes in a future release)",
        EinshardDeprecationWarning,
        stacklevel=2,
    )
    return init_opt_state(tx, params)


def _rules_second(rules: Any, params: Any) -> tuple[Any, Any]:
    """``explain_opt_state``'s rules and params, from the earlier order too (with a warning).

    The old order, ``(opt_state, params[, rules])``, is told by type: the second argument is not
    a rule table (:func:`~einshard._trees._calls.is_table`), and the third is one or missing.
    """
    old = rules is not None and not is_table(rules) and (params is None or is_table(params))
    if old:
        warnings.warn(
            "explain_opt_state takes the rules second now: call explain_opt_state(opt_state, rules, "
            "params), or explain_opt_state(opt_state, params=params) without rules (the old order goes "
            "in a future release)",
            EinshardDeprecationWarning,
            stacklevel=3,
        )
        rules, params = params, rules
    if params is None:
        raise EinshardError(
            "explain_opt_state needs the parameters the optimizer state belongs to",
            hint="Call explain_opt_state(opt_state, rules, params), or explain_opt_state(opt_state, "
            "params=params) to read their layouts.",
        )
    return rules, params


def explain_opt_state(
    opt_state: Any,
    rules: RulesLike | None = None,
    params: Any = None,
    *,
    n_devices: int | None = None,
    devices: Devices | None = None,
    tx: Initable | None = None,
) -> Report:
    """Explains how an optimizer state is laid out: one row per array leaf, with why.

    The counterpart of :func:`einshard.explain` for optax states. Each row's
    ``note`` says what the leaf is: ``'mirrors w1'``, ``'adafactor v_row of
    w1 (axis 1 reduced): replicated'``, ``'stacks w1 (1 leading axis)'``,
    ``'adafactor placeholder beside w1: replicated'``, ``'scalar'``,
    ``'mirrors no parameter: replicated'``.

    Like every verb that takes a tree and rules, it takes the rules second:
    ``explain_opt_state(opt_state, rules, params)``, and
    ``explain_opt_state(opt_state, params=params)`` without them. (The order
    of einshard 0.2, ``explain_opt_state(opt_state, params[, rules])``, still
    works, with an ``EinshardDeprecationWarning``: a table is told from the
    parameters by its type.)

    Two modes:

    * without ``rules``, the parameters' layouts are read from ``params``
      (placed, or abstract with shardings), as :func:`opt_state_shardings`
      does; the ``expression`` column spells each leaf's layout as an
      einshard expression over its mesh;
    * with ``rules``, the parameters are planned by the rule table for
      ``n_devices`` devices, as :func:`einshard.explain` plans them, so a run
      on more devices than the machine has can be planned from
      ``jax.eval_shape`` output; the ``rule`` column names the rule of the
      parameter a leaf follows.

    Args:
        opt_state: An optax state, concrete or abstract.
        rules: A rule table to plan the parameters by (see
            :func:`einshard.shard_pytree`), or ``None`` to read their shardings.
        params: The parameters the state belongs to (required).
        n_devices: With ``rules``, the device count to plan for (defaults to
            that of ``devices`` or of the einshard device order). Without
            ``rules``, it must be the parameters' device count if given.
        devices: With ``rules``, the devices, when ``n_devices`` is not given.
        tx: The optimizer, if at hand (see :func:`opt_state_shardings`).

    Returns:
        An :class:`einshard.Report`.

    Raises:
        EinshardError: As :func:`einshard.explain` would with ``rules``; without
            them, if ``n_devices`` differs from the parameters' device count;
            without ``params``.

    Warns:
        EinshardDeprecationWarning: Called in the earlier order (params second).

    >>> import jax, jax.numpy as jnp, optax
    >>> from einshard.integrations.optax import explain_opt_state
    >>> params = {'w1': jax.ShapeDtypeStruct((512, 1024), jnp.float32)}
    >>> tx = optax.adafactor(1e-3)
    >>> state = jax.eval_shape(tx.init, params)
    >>> report = explain_opt_state(state, [('w1', 'x y -> x y*')], params, n_devices=256)
    >>> for row in report.rows[1:3]:
    ...     print(row.path, '|', row.expression, '|', row.shard_shape, '|', row.note)
    0/v_row/w1 | x -> x * | (512,) | adafactor v_row of w1 (axis 1 reduced): replicated
    0/v_col/w1 | y -> y* | (4,) | adafactor v_col of w1 (axis 0 reduced)
    >>> report.rows[0].note, report.rows[3].note
    ('scalar', 'adafactor placeholder beside w1: replicated')
    """
    rules, params = _rules_second(rules, params)
    if rules is None:
        placed = _Placed(params)
        sources = placed.sources
    else:
        count = n_devices if n_devices is not None else call_devices(devices).count
        param_leaves, paths, _ = flatten_with_paths(params)  # one flattening: the rules' and the rows'
        assigned = assign_leaves(paths, param_leaves, as_rules(rules), n_devices=count)
        assignments = [a for _, a in assigned.leaves]
        sources = [
            _Param(path, None, None) if a is None else _Param(path, a.shape, a.layout.spec)
            for path, a in zip(paths, assignments, strict=True)
        ]
    rows, holds = [], {}
    for path, leaf, derivation in _derivations(opt_state, params, sources, tx)[0]:
        if derivation is None:
            continue
        shape, rule = tuple(leaf.shape), None
        if rules is None:  # the layout spelled off the sharding the state gets
            sharding = placed.sharding(derivation, len(shape))
            expression, shard_shape = spec_expression(sharding, len(shape)), sharding.shard_shape(shape)
            holders = _holders(sharding)
        else:  # the parameter's expression, for the axes the leaf carries
            followed = assignments[derivation.param] if derivation.param is not None else None
            expression = REPLICATE
            if followed is not None and derivation.axes is not None and shape:
                rule = None if followed.rule is None else followed.rule.pattern
                expression = carried_expression(followed.layout, derivation.axes)
            shard_shape = compile_layout(expression, len(shape), count).shard_shape(shape)
            holders = [0]  # einshard lays every array over all devices: every device holds the same
        rows.append(report_row(path, shape, leaf.dtype, rule, expression, shard_shape, derivation.note))
        for device in holders:
            holds[device] = holds.get(device, 0) + rows[-1].bytes_per_device
    if rules is None:
        count = len(holds) or n_devices or 1
        if n_devices is not None and holds and n_devices != count:
            raise EinshardError(
                f"the parameters are placed on {count} devices, not n_devices={n_devices}",
                hint="To plan for another device count, pass the rule table: "
                "explain_opt_state(opt_state, rules, params, n_devices=...).",
            )
    return Report(
        rows=tuple(rows),
        n_devices=count,
        total_bytes=sum(row.bytes for row in rows),
        max_bytes_per_device=max(holds.values(), default=0),
        unused_rules=(),
    )


def _holders(sharding: Sharding) -> Sequence[Any]:
    try:
        return list(sharding.device_set)
    except Exception:  # a sharding on an abstract mesh: positions stand for devices
        return list(range(sharding.num_devices))
