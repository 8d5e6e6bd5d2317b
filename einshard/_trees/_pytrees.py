"""Whole pytrees: ``shard_pytree``, ``pytree_shardings``, ``init_sharded``, and ``shardings_of``.

Each array leaf gets the expression of the first rule whose regex matches its
path (:mod:`einshard._trees._assign`, pure); the devices are decided once per
call, each kind of leaf (expression and rank) turned into a sharding once
(:mod:`einshard._sharding._expression_sharding`), and the leaves placed by
:func:`~einshard._arrays._place.place_leaves`. The table's policies apply
(``Rules(..., unmatched=...)``, or ``rules.replace(...)`` for one call).

:func:`shardings_of` goes the other way: it reads the layout a placed tree has, to keep it
through a compiled step. A plain ``jax.jit`` lets XLA choose the layout of every output: a
replicated norm scale can come back split, and the next step then compiles again for the new
layout. Its shardings, pinned as ``out_shardings`` (or as a constraint inside the step, e.g.
Equinox's ``eqx.filter_shard``), keep the rules' layouts through every step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding

from .._arrays._build import build_sharded
from .._arrays._leaves import carried_sharding, is_array
from .._arrays._place import place_leaves
from .._language._errors import EinshardError, EinshardWarning, adding_context
from .._sharding._devices import Devices, call_devices
from .._sharding._expression_sharding import expression_sharding
from ._assign import Assignment, TableAssignment, as_rules, assign_rules, leaf_context
from ._calls import rule_table  # the one home of the builders' argument checks
from ._rules import RulesLike

__all__ = ["init_sharded", "leaf_shardings", "pytree_shardings", "shard_pytree", "shardings_of"]


def shard_pytree(tree: Any, rules: RulesLike, *, devices: Devices | None = None) -> Any:
    """Places every array leaf of a pytree by the first rule that matches its path.

    Array leaves (``jax.Array``, NumPy arrays, ``ShapeDtypeStruct``, traced
    values inside ``jit``) are placed as :func:`~einshard.einshard` places
    one array; scalar arrays are replicated; other leaves (``None``, Python
    numbers, strings, functions) pass through untouched.

    Args:
        tree: Any pytree: nested dicts, lists, tuples, dataclasses, modules.
        rules: A :class:`~einshard.Rules` or what builds one: ``(regex,
            expression)`` pairs, or a dict. The first rule whose regex
            ``re.search``-matches a leaf's path (``layers/0/mlp/w1/kernel``)
            wins. Its policies (``unmatched``, ``indivisible``, ``strict``)
            decide the leaves no rule fits.
        devices: The devices, in order (see :func:`~einshard.make_sharding`).

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
    assigned, treedef, shardings = leaf_shardings(tree, rules, devices)
    return jax.tree_util.tree_unflatten(treedef, place_leaves([leaf for leaf, _ in assigned], shardings))


def pytree_shardings(tree: Any, rules: RulesLike, *, devices: Devices | None = None) -> Any:
    """The tree of ``NamedSharding`` objects the rules give, for a concrete or an abstract tree.

    For ``jax.eval_shape`` output (``ShapeDtypeStruct`` leaves) this is what
    ``jax.jit(..., out_shardings=...)`` needs to create a model already
    sharded; a concrete tree with the same shapes gives equal shardings.
    Leaves that are not arrays become ``None``.

    Args:
        tree: A pytree of arrays or ``ShapeDtypeStruct`` leaves.
        rules: The rule table, with its policies (see :func:`shard_pytree`).
        devices: The devices, in order.

    Returns:
        A tree of the same structure with a ``jax.sharding.NamedSharding`` at
        every array leaf.

    >>> import jax, jax.numpy as jnp, einshard
    >>> abstract = jax.eval_shape(lambda: {'w': jnp.zeros((16, 8))})
    >>> einshard.pytree_shardings(abstract, {'w': 'x y -> x* y'})['w'].shard_shape((16, 8))
    (2, 8)
    """
    _, treedef, shardings = leaf_shardings(tree, rules, devices)
    return jax.tree_util.tree_unflatten(treedef, shardings)


def leaf_shardings(
    tree: Any, rules: RulesLike, devices: Devices | None
) -> tuple[list[tuple[Any, Assignment | None]], Any, list[NamedSharding | None]]:
    """Every leaf with its assignment, the tree structure, and each leaf's sharding (``None``: not an array).

    The devices are decided once; each kind of leaf (expression, rank)
    gets its sharding once. Warns about the table's unused rules when it is strict.
    """
    table = as_rules(rules)
    shape = tuple(getattr(tree, "shape", ())) if is_array(tree) else ()
    if shape and table.unmatched == "error" and table.match("") is None:  # a scalar needs no rule
        raise EinshardError(
            f"one array (shape {shape}) where a tree goes: its path is '' and no rule matches it",
            hint="Place one array with einshard.einshard(x, expression), e.g. einshard.einshard(x, "
            "'... -> * ...'); shard_pytree and pytree_shardings take a tree (a dict, a list, a module).",
        )
    target = call_devices(devices)
    assignment, treedef = assign_rules(tree, table, n_devices=target.count)
    return assignment.leaves, treedef, assignment_shardings(assignment, target)


def assignment_shardings(assignment: TableAssignment, target: Any) -> list[NamedSharding | None]:
    """Each assigned leaf's sharding on the call's devices ``target`` (``None``: not an array).

    Once per kind of leaf (expression, rank). Warns about the table's unused rules when it is strict.
    """
    if assignment.table.strict and assignment.unused:
        listed = ", ".join(str(rule) for rule in assignment.unused)
        warnings.warn(f"unused rules (they decided no leaf): {listed}", EinshardWarning, stacklevel=4)
    by_kind: dict[tuple[str, int], NamedSharding] = {}  # one lookup per kind of leaf
    shardings: list[NamedSharding | None] = []
    append, of_kind = shardings.append, by_kind.get
    for _, leaf in assignment.leaves:
        if leaf is None:
            append(None)
            continue
        key = (leaf.expression, len(leaf.shape))
        sharding = of_kind(key)
        if sharding is None:
            path, shape, rule = leaf.path, leaf.shape, leaf.rule
            with adding_context(leaf_context, path, shape, rule, target.describe()):
                _, sharding = expression_sharding(leaf.expression, len(shape), target)
            by_kind[key] = sharding
        append(sharding)
    return shardings


def init_sharded(init_fn: Callable[..., Any], rules: RulesLike, *args: Any, **kwargs: Any) -> Any:
    """Runs ``init_fn(*args, **kwargs)`` so that its result is born sharded.

    The result's shapes are found abstractly (``jax.eval_shape``), the rules
    give their shardings, and ``init_fn`` is compiled with those as
    ``out_shardings``: every device computes only its own shards, and the
    model never exists whole on one device (a big model is made in parts, so
    XLA's scratch memory is bounded by a part). Array arguments are traced;
    other arguments are passed as they are. The policies are the table's and
    the devices those of the call (:func:`~einshard.use_devices` sets them).

    Args:
        init_fn: A function returning a pytree of arrays.
        rules: The rule table (see :func:`shard_pytree`).
        *args: Positional arguments for ``init_fn``.
        **kwargs: Keyword arguments for ``init_fn``.

    Returns:
        ``init_fn(*args, **kwargs)``, value for value, each array placed by its rule.

    Raises:
        EinshardError: The table anywhere but second (``init_sharded(rules,
            init_fn, ...)``, or among ``args``), or with a mistake; a leaf its
            rule does not fit. The hint shows the call to write.

    >>> import jax, einshard
    >>> def init(key):
    ...     return {'w': jax.random.normal(key, (8, 64))}
    >>> params = einshard.init_sharded(init, [('w', 'x y -> x y*')], jax.random.key(0))
    >>> params['w'].sharding.shard_shape((8, 64))
    (8, 8)
    """
    table = rule_table("init_sharded", init_fn, rules, args, kwargs, noun="the function")
    assert table is not None  # None is no table here (rule_table refuses it)
    return build_sharded(init_fn, lambda abstract: pytree_shardings(abstract, table), *args, **kwargs)


def shardings_of(tree: Any) -> Any:
    """The sharding of every array leaf of ``tree``; ``None`` for every other leaf.

    Pass the result as ``out_shardings`` of ``jax.jit`` for the outputs that
    are the next step's inputs, so each leaf keeps the layout its rule gave it
    (and the second step does not compile again); ``None`` lets JAX choose,
    which is what a loss or metrics need.

    Args:
        tree: A pytree of placed arrays (``jax.Array`` or ``ShapeDtypeStruct``
            with a sharding), e.g. a train state from
            :func:`einshard.integrations.flax.create_train_state`. Other
            leaves (Python numbers, NumPy arrays, functions) give ``None``.

    Returns:
        A pytree of the same structure: a ``jax.sharding.Sharding`` per placed
        array, ``None`` elsewhere.

    Raises:
        EinshardError: If called inside ``jit`` (traced values carry no
            layout of their own): read the shardings outside, before the step.

    >>> import jax, jax.numpy as jnp, einshard
    >>> params = einshard.shard_pytree({'w': jnp.ones((8, 64)), 'b': jnp.ones(64)},
    ...                                [('w', 'x y -> x y*'), ('b', '... -> * ...')])
    >>> def grow(params):
    ...     return {'w': params['w'] * 2, 'b': params['b'] + params['w'].sum(0)}
    >>> step = jax.jit(grow, out_shardings=einshard.shardings_of(params))
    >>> step(params)['b'].sharding.is_fully_replicated
    True
    """
    return jax.tree_util.tree_map(_sharding_of, tree)


def _sharding_of(leaf: Any) -> Any:
    if isinstance(leaf, Tracer):
        raise EinshardError(
            "shardings_of was given a traced value: inside jit, values carry no layout of their own",
            hint="Read the shardings outside the step, from the placed inputs: "
            "step = jax.jit(train_step, out_shardings=(einshard.shardings_of(state), None)).",
        )
    return carried_sharding(leaf)  # None for NumPy arrays, Python numbers, functions: no layout to keep
