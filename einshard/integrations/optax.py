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
    import optax  # noqa: F401 (used by ._optax_state, imported below)
except ModuleNotFoundError as error:
    if error.name != "optax":
        raise  # optax is installed but something it imports is not: its own error says what
    raise ImportError(
        "einshard.integrations.optax needs optax, which is not installed; "
        "install it with: pip install optax (or pip install '.[optax]' in einshard's source folder)"
    ) from error

import math
import warnings
from collections.abc import Sequence
from typing import Any

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
from .._trees._paths import flatten_or_explain, flatten_with_paths
from .._trees._rules import RulesLike
from ._optax_state import Initable, _Derivation, _derivations, _Param

__all__ = ["explain_opt_state", "init_opt_state", "init_sharded", "opt_state_shardings", "shard_opt_state"]

LARGE_REPLICATED_BYTES = 1 << 20  # replicated state no layout follows for, above which placing warns


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
