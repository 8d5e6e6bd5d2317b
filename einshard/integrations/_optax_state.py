"""Which parameter each leaf of an optax state follows, and along which axes: its derivation.

Pure reading of shapes and structure (no placing): the state's parameter copies (where optax's
``tree_map_params`` says, else found by structure), each array leaf matched to the parameter it
mirrors, the axes it carries, and why. ``integrations/optax.py`` reads the shardings and
``explain_opt_state``'s rows off these derivations.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
import optax  # integrations/optax.py has checked it is installed, and says how to get it

from .._arrays._leaves import is_array
from .._trees._paths import flatten_with_key_paths

KeyPath = tuple[Any, ...]
Axes = tuple[int | None, ...]  # per leaf axis: the parameter axis whose split it takes, or None


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
