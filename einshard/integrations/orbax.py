"""orbax: checkpoints saved sharded and restored straight into rule-derived shardings.

:func:`save` writes a pytree of sharded arrays (a model, its optimizer state,
Python scalars such as a step count) with orbax's ``StandardCheckpointer``:
every process writes the shards it holds. :func:`restore` reads it back with
every array placed by a rule table, each device reading only its own shards
from storage, so a restored model never exists whole on one device. The rules
are applied on the device count of the restoring run, which need not be the
one that saved: a checkpoint written on 8 devices restores onto 4, 16 or 6
(as long as the rules divide the shapes there).

:func:`restore_target` is the piece in between: the tree of
``jax.ShapeDtypeStruct`` leaves carrying the rules' shardings that orbax
restores into. It takes ``jax.eval_shape`` output, a concrete tree, or the
checkpoint's own metadata (:func:`abstract_checkpoint`), so it also serves
code that drives orbax itself (``ocp.CheckpointManager`` with
``ocp.args.StandardRestore(restore_target(...))``).

Importing ``einshard`` does not import orbax; this module does.

>>> import tempfile, jax.numpy as jnp, einshard
>>> from einshard.integrations import orbax as ckpt
>>> rules = [(r'w$', 'x y -> x y*'), (r'.*', '... -> * ...')]
>>> state = einshard.shard_pytree({'w': jnp.arange(128.0).reshape(8, 16), 'step': 7}, rules)
>>> tmp = tempfile.TemporaryDirectory()
>>> ckpt.save(f'{tmp.name}/ckpt', state)
>>> back = ckpt.restore(f'{tmp.name}/ckpt', [(r'w$', 'x y -> x* y'), (r'.*', '... -> * ...')])
>>> back['w'].sharding.shard_shape((8, 16)), back['step'], bool((back['w'] == state['w']).all())
((1, 16), 7, True)
>>> tmp.cleanup()
"""

from __future__ import annotations

try:  # first, so a missing framework says how to get it (as the pictures do for rich)
    import orbax.checkpoint as ocp
except ModuleNotFoundError as error:
    if error.name not in ("orbax", "orbax.checkpoint"):
        raise  # orbax-checkpoint is installed but something it imports is not: its own error says what
    raise ImportError(
        "einshard.integrations.orbax needs orbax-checkpoint, which is not installed; "
        "install it with: pip install orbax-checkpoint "
        "(or pip install '.[orbax]' in einshard's source folder)"
    ) from error

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from .._arrays._leaves import is_array, is_jax_array
from .._arrays._place import place_leaves
from .._language._errors import EinshardError
from .._sharding._devices import Devices
from .._trees._paths import path_string
from .._trees._pytrees import leaf_shardings
from .._trees._rules import Rules, RulesLike

__all__ = ["abstract_checkpoint", "restore", "restore_target", "save"]

PathLike = str | os.PathLike[str]


def _directory(path: PathLike) -> str:
    """The checkpoint directory as orbax wants it: absolute, unless it is a URL (``gs://...``)."""
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def save(path: PathLike, tree: Any, *, force: bool = False) -> None:
    """Saves a pytree of (sharded) arrays as an orbax checkpoint, and waits until it is written.

    Each process writes the shards it holds (with several processes, every
    process must call this). The tree may hold ``jax.Array`` leaves sharded
    any way, NumPy arrays and Python scalars; ``None`` and empty nodes (such as
    optax's ``EmptyState``) are kept as structure. Saving goes through
    ``orbax.checkpoint.StandardCheckpointer``; its checkpoints restore with
    orbax as usual, and with :func:`restore`.

    Args:
        path: The checkpoint directory to create (a local path, or a URL orbax
            supports such as ``gs://bucket/run/step_100``).
        tree: The pytree to save: a model's parameters, an optimizer state, or
            a dict holding several such trees.
        force: Overwrite an existing checkpoint at ``path`` (otherwise that is an error).

    >>> import os, tempfile, jax.numpy as jnp, einshard
    >>> from einshard.integrations.orbax import save
    >>> params = einshard.shard_pytree({'w': jnp.ones((4, 64))}, {'w': 'x y -> x y*'})
    >>> tmp = tempfile.TemporaryDirectory()
    >>> save(os.path.join(tmp.name, 'step_1'), {'params': params, 'step': 1})
    >>> sorted(os.listdir(tmp.name))
    ['step_1']
    >>> tmp.cleanup()
    """
    with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the write to commit
        checkpointer.save(_directory(path), tree, force=force)


def abstract_checkpoint(path: PathLike) -> Any:
    """The tree a checkpoint holds, from its metadata alone: nothing is read but the metadata.

    Arrays become ``jax.ShapeDtypeStruct`` leaves (shape and dtype as saved,
    no sharding) and saved Python scalars become placeholders of their type
    (``0``, ``0.0``, ``False``). The structure is orbax's stored one: nested
    dicts and lists (a NamedTuple or dataclass node is stored as a dict, a
    tuple as a list, an empty node as ``None``), with the same leaf paths as the
    tree that was saved, so the same rules apply. Pass it to
    :func:`einshard.explain` to plan a restore, or to :func:`restore_target`.

    Args:
        path: The checkpoint directory.

    Returns:
        The checkpoint's tree, abstract.

    >>> import tempfile, jax.numpy as jnp, einshard
    >>> from einshard.integrations.orbax import abstract_checkpoint, save
    >>> tmp = tempfile.TemporaryDirectory()
    >>> save(f'{tmp.name}/ckpt', {'w': jnp.ones((4, 64)), 'step': 3})
    >>> abstract_checkpoint(f'{tmp.name}/ckpt')
    {'step': 0, 'w': ShapeDtypeStruct(shape=(4, 64), dtype=float32)}
    >>> tmp.cleanup()
    """
    _check_checkpoint_exists(path)
    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(_directory(path))
    tree = _unsharded_tree(metadata)
    if tree is None:
        raise EinshardError(
            f"there is no checkpoint at {_directory(path)!r}: the directory holds no checkpoint metadata",
            hint="Pass the directory save() wrote (the one holding _CHECKPOINT_METADATA).",
        )
    return tree


def _check_checkpoint_exists(path: PathLike) -> None:
    """Refuses a local path with no checkpoint (orbax's metadata would be ``None``: an empty plan)."""
    directory = _directory(path)
    if "://" in directory:
        return  # remote (gs://...): orbax reads it
    if not os.path.isdir(directory):
        raise EinshardError(
            f"there is no checkpoint at {directory!r}: "
            f"{'it is a file' if os.path.exists(directory) else 'no such directory'}",
            hint="Pass the directory save() wrote (the one holding _CHECKPOINT_METADATA).",
        )


def _is_metadata(leaf: Any) -> bool:
    return isinstance(leaf, ocp.metadata.ArrayMetadata)


def _abstract_leaf(leaf: Any) -> Any:
    """One leaf as a restore target leaf without sharding (non-arrays pass through)."""
    if isinstance(leaf, ocp.metadata.ScalarMetadata):  # a saved Python scalar: restored as one
        return np.dtype(leaf.dtype).type(0).item()
    if _is_metadata(leaf):
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
    if is_array(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False))
    return leaf


def _unsharded_tree(tree: Any) -> Any:
    """``tree`` with every array leaf a ``ShapeDtypeStruct``; orbax metadata unwrapped."""
    tree = getattr(tree, "item_metadata", tree)  # a StepMetadata: the item's TreeMetadata
    tree = getattr(tree, "tree", tree)  # a TreeMetadata: the tree of ArrayMetadata
    return jax.tree_util.tree_map(_abstract_leaf, tree, is_leaf=_is_metadata)


def restore_target(
    tree: Any,
    rules: RulesLike,
    *,
    devices: Devices | None = None,
) -> Any:
    """The restore target that places every array by the rules: ``ShapeDtypeStruct`` leaves with shardings.

    Shardings come from :func:`einshard.pytree_shardings` on this process's
    devices, so the target fits the run restoring, whatever device count the
    checkpoint was saved from. Non-array leaves (Python scalars, ``None``)
    pass through. Give the result to :func:`restore`, or to orbax directly
    (``ocp.StandardCheckpointer().restore(path, target)``,
    ``ocp.args.StandardRestore(target)``): orbax then has each device read its
    own shards.

    Args:
        tree: The tree to restore, abstract or not: ``jax.eval_shape`` output
            (the usual case: the structure of the model and optimizer state),
            a concrete tree, or a checkpoint's metadata (from
            :func:`abstract_checkpoint`, or orbax's ``StepMetadata`` /
            ``TreeMetadata``). Existing shardings are ignored.
        rules: The rule table, with its policies (see :func:`einshard.shard_pytree`).
        devices: The devices, in order (see :func:`einshard.make_sharding`).

    Returns:
        The tree with every array leaf a ``jax.ShapeDtypeStruct`` carrying its
        rule's ``NamedSharding``.

    Raises:
        EinshardError: A leaf no rule matches, or one its rule does not fit
            on this device count.

    >>> import jax, jax.numpy as jnp
    >>> from einshard.integrations.orbax import restore_target
    >>> abstract = jax.eval_shape(lambda: {'w': jnp.zeros((16, 8)), 'b': jnp.zeros(8)})
    >>> target = restore_target(abstract, [(r'w$', 'x y -> x* y'), (r'b$', 'y -> y*')])
    >>> target['w'].sharding.shard_shape((16, 8)), target['b'].sharding.shard_shape((8,))
    ((2, 8), (1,))
    """
    assigned, treedef, shardings = leaf_shardings(_unsharded_tree(tree), rules, devices)
    return jax.tree_util.tree_unflatten(treedef, place_leaves([leaf for leaf, _ in assigned], shardings))


def _is_rules(value: Any) -> bool:
    """Whether ``restore`` was given a rule table rather than a target tree."""
    if isinstance(value, Rules):
        return True
    leaves = jax.tree_util.tree_leaves(value)
    return not any(is_array(leaf) for leaf in leaves)


def _checked_target(target: Any) -> Any:
    """A given target with every array leaf a ``ShapeDtypeStruct`` that carries a sharding."""

    def leaf_target(key_path: Any, leaf: Any) -> Any:
        if is_jax_array(leaf):
            return jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=leaf.sharding, weak_type=leaf.weak_type
            )
        if isinstance(leaf, (jax.ShapeDtypeStruct, np.ndarray)):
            sharding = getattr(leaf, "sharding", None)
            if not isinstance(sharding, Sharding):
                raise EinshardError(
                    f"the restore target's leaf {path_string(key_path)!r} (shape {tuple(leaf.shape)}) "
                    "has no sharding: orbax would read it whole onto the host",
                    hint="Pass a rule table instead (restore(path, rules, abstract=...)), or build the "
                    "target with restore_target(abstract, rules).",
                )
        return leaf

    return jax.tree_util.tree_map_with_path(leaf_target, target)


def restore(
    path: PathLike,
    rules_or_target: Any,
    *,
    abstract: Any = None,
    devices: Devices | None = None,
) -> Any:
    """Restores a checkpoint with every array placed by a rule table (or by a given target).

    Each device reads only its own shards from storage: the checkpoint never
    exists whole on one device or on the host. The device count may differ
    from the one that saved; the values are the same.

    Args:
        path: The checkpoint directory.
        rules_or_target: A rule table with its policies (see
            :func:`einshard.shard_pytree`), applied on this process's devices; or a restore target: a tree
            whose array leaves are ``jax.ShapeDtypeStruct`` with shardings
            (:func:`restore_target`'s output, or one built from
            ``einshard.integrations.optax.opt_state_shardings``) or placed
            ``jax.Array`` leaves whose shardings are used.
        abstract: With a rule table, the tree to restore into (``jax.eval_shape``
            output of the saved tree's constructor, or the saved tree itself):
            the result has its structure (NamedTuples, dataclasses, optax
            states). By default the checkpoint's own structure
            (:func:`abstract_checkpoint`: nested dicts and lists).
        devices: The devices, in order, with a rule table.

    Returns:
        The restored tree: array leaves are ``jax.Array`` placed by their
        rules (or as the target says). Saved Python scalars (a step count) come
        back as Python scalars, unless ``abstract`` or the target has an array
        there (``jax.eval_shape`` turns Python scalars into arrays).

    Raises:
        EinshardError: A leaf the rules cannot place on this device count; a
            target leaf without a sharding; ``abstract`` given with a target.

    >>> import tempfile, typing, jax, jax.numpy as jnp, einshard
    >>> from einshard.integrations import orbax as ckpt
    >>> class Layer(typing.NamedTuple):
    ...     w: jax.Array
    ...     b: jax.Array
    >>> rules = [(r'w$', 'x y -> x y*'), (r'b$', 'y -> y*')]
    >>> layer = einshard.shard_pytree(Layer(jnp.ones((4, 64)), jnp.zeros(64)), rules)
    >>> tmp = tempfile.TemporaryDirectory()
    >>> ckpt.save(f'{tmp.name}/ckpt', layer)
    >>> back = ckpt.restore(f'{tmp.name}/ckpt', rules, abstract=jax.eval_shape(lambda: layer))
    >>> type(back).__name__, back.w.sharding.shard_shape((4, 64)), back.b.sharding.shard_shape((64,))
    ('Layer', (4, 8), (8,))
    >>> tmp.cleanup()
    """
    directory = _directory(path)
    if _is_rules(rules_or_target):
        if abstract is None:
            abstract = abstract_checkpoint(directory)
        target = restore_target(abstract, rules_or_target, devices=devices)
    else:
        if abstract is not None:
            raise EinshardError(
                "abstract= goes with a rule table, not with a restore target",
                hint="The target already has the tree's structure: drop abstract=.",
            )
        target = _checked_target(rules_or_target)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(directory, target)
