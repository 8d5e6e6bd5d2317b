"""Leaf paths: the ``/``-joined key path of every leaf of a tree, as rules see it.

The one place paths are made: a leaf's path is its key path joined with ``/``
(``layers/0/mlp/w1/kernel``: dict keys, attribute names, sequence indices; :func:`path_string`).
Rule tables, ``explain``, the optax derivations and the integrations all take their paths from
here. Two things make it cheaper or cleaner than ``jax.tree_util.tree_flatten_with_path``:

* for trees of plain dicts, lists, tuples and ``None`` the paths are read off
  the tree structure, once per distinct subtree, and cached per structure;
* a framework's wrapper nodes whose ``value`` child is an implementation
  detail (Flax's ``nnx.Variable``) leave it out of the path. The core names no
  framework: an integration registers its wrapper types with
  :func:`register_value_wrapper` when it is imported; and ``einshard.integrations``
  registers, with :func:`register_wrapper_finder`, a function that imports those
  integrations whose framework is in use (the way einops finds its backends in
  ``sys.modules``), so paths read the same whether or not the user imported the integration.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from .._language._errors import EinshardError, short_repr

__all__ = [
    "flatten_or_explain",
    "flatten_with_paths",
    "path_string",
    "register_value_wrapper",
    "register_wrapper_finder",
]

T = TypeVar("T")

# Tree structure -> the path of each leaf, for the last few structures. Few: a structure's
# hash ignores dict keys, so structures of one shape share a bucket and are compared in turn.
_PATHS: collections.OrderedDict[Any, list[str]] = collections.OrderedDict()
_PATHS_KEPT = 16

_VALUE_WRAPPERS: list[type] = []


def register_value_wrapper(kind: type) -> None:
    """Leaves out the ``value`` child of ``kind``'s nodes from leaf paths (``kernel``, not ``kernel/value``).

    Called by an integration when it is imported, for its framework's wrappers.
    """
    if kind not in _VALUE_WRAPPERS:
        _VALUE_WRAPPERS.append(kind)
        _PATHS.clear()  # paths read before may have kept a `value`


def register_wrapper_finder(find: Callable[[], None]) -> None:
    """Has ``find()`` called before paths are read off a tree with nodes of other kinds.

    ``find`` registers the wrappers of the frameworks in use (``einshard.integrations`` imports
    the integrations whose framework is in ``sys.modules``); the core itself knows none.
    """
    if find not in _WRAPPER_FINDERS:
        _WRAPPER_FINDERS.append(find)


_WRAPPER_FINDERS: list[Callable[[], None]] = []


def flatten_with_paths(tree: Any) -> tuple[list[Any], list[str], Any]:
    """The leaves, their ``/``-joined paths and the tree structure; paths cached per structure."""
    leaves, treedef = flatten_or_explain(jax.tree_util.tree_flatten, tree)
    return leaves, _paths_of(tree, treedef, None), treedef


def flatten_with_key_paths(tree: Any) -> tuple[list[tuple[Any, Any]], list[str], Any]:
    """:func:`flatten_with_paths` with JAX's key paths too: ``[(key path, leaf)]``, paths, structure.

    One flattening (``tree_flatten_with_path``) gives both, for a caller that needs the key paths
    (the optax derivations); the ``/``-joined paths are those of :func:`flatten_with_paths`.
    """
    path_leaves, treedef = flatten_or_explain(jax.tree_util.tree_flatten_with_path, tree)
    return path_leaves, _paths_of(tree, treedef, path_leaves), treedef


def _paths_of(tree: Any, treedef: Any, path_leaves: list[tuple[Any, Any]] | None) -> list[str]:
    """The tree's leaf paths, cached per structure; from its key paths when given and no wrapper applies."""
    paths = _PATHS.get(treedef)
    if paths is not None:
        _PATHS.move_to_end(treedef)
        return paths
    try:
        paths = _structure_paths(treedef)
    except RecursionError:  # deeper than Python's stack: JAX's own (C++) flattening copes
        paths = None
    if paths is None and path_leaves is not None:
        for find in _WRAPPER_FINDERS:
            find()
        if not _VALUE_WRAPPERS:  # the key paths at hand are the paths: no second flattening
            paths = [path_string(key_path) for key_path, _ in path_leaves]
    if paths is None:
        paths = flatten_or_explain(_leaf_paths, tree)
    _PATHS[treedef] = paths
    if len(_PATHS) > _PATHS_KEPT:
        _PATHS.popitem(last=False)
    return paths


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
    """The path of every leaf, without the ``value`` child of registered wrappers."""
    for find in _WRAPPER_FINDERS:
        find()
    wrappers = tuple(_VALUE_WRAPPERS)
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


def path_string(path: Sequence[Any]) -> str:
    """Joins a JAX key path with ``/``: dict keys, attribute names and indices.

    >>> import jax
    >>> [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path({'a': [1, {'b': 2}]})[0]]
    ['a/0', 'a/1/b']
    """
    return "/".join([_KEY_STRING.get(type(key), _key_string)(key) for key in path])


def _key_string(key: Any) -> str:
    # Any other key type: DictKey.key, GetAttrKey.name, SequenceKey.idx, FlattenedIndexKey.key.
    for attribute in ("key", "name", "idx"):
        value = getattr(key, attribute, None)
        if value is not None:
            return str(value)
    return str(key)


_KEY_STRING: dict[type, Callable[[Any], str]] = {
    # The common key types, read without trying attributes (paths are built for every leaf).
    jax.tree_util.DictKey: lambda key: str(key.key),
    jax.tree_util.GetAttrKey: lambda key: key.name,
    jax.tree_util.SequenceKey: lambda key: str(key.idx),
    jax.tree_util.FlattenedIndexKey: lambda key: str(key.key),
}


# --- flattening any tree, with JAX's failures on malformed ones explained ---


def flatten_or_explain(flatten: Callable[[Any], T], tree: Any) -> T:
    """``flatten(tree)``, with JAX's failures on a malformed tree turned into an :class:`EinshardError`.

    JAX sorts a dict's keys to flatten it (keys of mixed types fail to sort), and its C++
    flattening has a depth limit of its own.
    """
    try:
        return flatten(tree)
    except (ValueError, TypeError) as error:
        if "sorting pytree dictionary keys" not in str(error):
            raise
        keys = _unsortable_keys(tree)
        raise EinshardError(
            "a dict in the tree has keys that cannot be sorted together (e.g. ints and strings)",
            hint="JAX sorts a dict's keys to flatten it: give each dict keys of one type, e.g. all strings.",
            context=[f"in a dict with the keys {short_repr(keys)}"] if keys is not None else [],
        ) from None
    except (RecursionError, SystemError) as error:
        if isinstance(error, SystemError) and "exception set" not in str(error):
            raise
    # Deep trees meet the interpreter's recursion budget, part of which the caller's own stack
    # has used: try once more on a fresh thread (a fresh budget, a large stack).
    try:
        return _on_fresh_thread(flatten, tree)
    except (RecursionError, SystemError):
        raise EinshardError(
            "the tree is nested too deeply to flatten",
            hint="JAX's tree functions (and so einshard's) take trees a few thousand levels deep "
            "at most; flatten the structure, e.g. a dict from path strings to arrays.",
        ) from None


def _on_fresh_thread(function: Callable[[Any], T], argument: Any) -> T:
    """``function(argument)`` on a new thread with a 256 MiB stack; its exception re-raised here."""
    import threading

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, function(argument)))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))

    previous = threading.stack_size(256 * 2**20)
    try:
        thread = threading.Thread(target=run, name="einshard-deep-tree")
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _unsortable_keys(tree: Any, limit: int = 10_000) -> list[Any] | None:
    """The keys of the first dict (breadth first, bounded) whose keys do not sort, or ``None``."""
    queue = [tree]
    for node in queue:
        if len(queue) > limit:
            break
        if isinstance(node, dict):
            try:
                sorted(node)
            except TypeError:
                return list(node)[:10]
            queue.extend(node.values())
        elif isinstance(node, (list, tuple)):
            queue.extend(node)
    return None
