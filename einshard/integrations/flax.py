"""Flax integration: NNX modules and optimizers, linen variables and train states.

This module imports Flax; ``import einshard`` does not.

**NNX.** :func:`shard_module` shards the state of any NNX object in place (a
module, an ``nnx.Optimizer``, or a tuple / list / dict of them) by a rule
table; :func:`create_sharded` builds one born sharded, so that it never
exists whole on one device. Rules match the state's paths, which are the
attribute and key names joined with ``/`` without Flax's ``.value``
(``linear1/kernel``, ``blocks/0/attn/query/kernel``). An optimizer's state
ends in the path of the parameter it mirrors (``opt_state/0/mu/linear1/kernel``),
so one table written with ``re.search`` patterns such as ``r'linear1/kernel$'``
covers a model and its optimizer alike. Scalars (``step``, ``count``) are
replicated whatever the rules say, and so is RNG state (``nnx.RngState``:
the keys and counts of ``nnx.Rngs``), which is never matched against the
rules. :func:`state_tree` is the state as the rules see it, for
:func:`einshard.explain`. For optimizers whose state does not mirror the
parameters leaf for leaf (Adafactor's factored statistics, ``optax.masked``),
:func:`shard_optimizer` and :func:`create_optimizer` lay the state out like
the model's placed parameters instead, through
:mod:`einshard.integrations.optax`.

**linen.** A linen variable dict is a plain pytree: pass it to
:func:`einshard.shard_pytree` as it is (paths like ``params/Dense_0/kernel``).
:func:`init_sharded` is a born-sharded ``module.init``, and
:func:`create_train_state` a born-sharded
``flax.training.train_state.TrainState`` whose optax state is sharded like the
parameters it mirrors (through :mod:`einshard.integrations.optax`).

>>> import einshard
>>> from flax import nnx
>>> from einshard.integrations.flax import shard_module
>>> rules = [(r'kernel$', 'x y -> x y*'), (r'bias$', 'y -> y*')]
>>> model = shard_module(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), rules)
>>> model.kernel[...].sharding.shard_shape((4, 16))
(4, 2)

Linen variables go through the core functions as they are:

>>> import jax, jax.numpy as jnp
>>> import flax.linen as nn
>>> variables = nn.Dense(16).init(jax.random.key(0), jnp.ones((1, 4)))
>>> placed = einshard.shard_pytree(variables, [(r'params/kernel$', 'x y -> x y*'), (r'.*', '... -> * ...')])
>>> placed['params']['kernel'].sharding.shard_shape((4, 16))
(4, 2)
"""

from __future__ import annotations

try:  # first, so a missing framework says how to get it (as the pictures do for rich)
    from flax import nnx
except ModuleNotFoundError as error:
    if error.name != "flax":
        raise  # Flax is installed but something it imports is not: its own error says what
    raise ImportError(
        "einshard.integrations.flax needs Flax, which is not installed; "
        "install it with: pip install flax (or pip install '.[flax]' in einshard's source folder)"
    ) from error

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax.core import meta as flax_meta

from .._arrays._build import build_sharded
from .._arrays._leaves import is_concrete_array, is_jax_array, partition
from .._arrays._place import place_leaves
from .._language._errors import EinshardError, adding_context
from .._language._expression import REPLICATE
from .._sharding._devices import Devices
from .._trees import _pytrees
from .._trees._calls import is_optimizer, rule_table, table_second
from .._trees._paths import register_value_wrapper
from .._trees._rules import Rules, RulesLike

__all__ = [
    "create_optimizer",
    "create_sharded",
    "create_train_state",
    "init_sharded",
    "shard_module",
    "shard_optimizer",
    "state_tree",
]

T = TypeVar("T")

# Flax's wrappers hold the array as `value`: rules see `linear1/kernel`, not `linear1/kernel/value`.
register_value_wrapper(nnx.Variable)
register_value_wrapper(flax_meta.AxisMetadata)

_REPLICATE = [(r".*", REPLICATE)]


# --- NNX ----------------------------------------------------------------------


def _split_state(obj: Any) -> tuple[Any, Any]:
    """The RNG state and the rest of an NNX object's state, as two ``nnx.State``."""
    nodes = jax.tree_util.tree_leaves(obj, is_leaf=nnx.graph.is_graph_node)
    if not any(nnx.graph.is_graph_node(node) for node in nodes):
        linen = sys.modules.get("flax.linen")  # loaded only by those who use linen
        if linen is not None and isinstance(obj, linen.Module):
            hint = (
                "A linen module holds no state: shard its variables with einshard.shard_pytree("
                "module.init(...), rules), or create them sharded with init_sharded(module, rules, ...)."
            )
        else:
            hint = "Pass an NNX object: a module, an nnx.Optimizer, or a tuple, list or dict of them."
        raise EinshardError(f"{type(obj).__name__} object is not an NNX object", hint=hint)
    try:
        rng_state, state = nnx.state(obj, nnx.RngState, ...)
    except Exception as error:  # nnx's own message says what it could not traverse
        raise EinshardError(
            f"cannot read the NNX state of {type(obj).__name__} object: {error}",
            hint="Pass an NNX object: a module, an nnx.Optimizer, or a tuple, list or dict of them. "
            "For a linen variable dict, use einshard.shard_pytree.",
        ) from None
    return rng_state, state


def state_tree(obj: Any) -> dict[str, Any]:
    """The state of an NNX object as the rules see it: a nested dict of arrays.

    Its paths are those :func:`shard_module` matches against the rules
    (``linear1/kernel``; no ``.value``). RNG state is left out, since
    :func:`shard_module` replicates it whatever the rules say. Works on an
    abstract module (``nnx.eval_shape``), whose leaves are
    ``jax.ShapeDtypeStruct``, so :func:`einshard.explain` can plan a model that
    was never built.

    Args:
        obj: An NNX object: a module, an ``nnx.Optimizer``, or a tuple, list
            or dict of them.

    Returns:
        A nested dict with the state's values at its leaves.

    >>> import einshard
    >>> from flax import nnx
    >>> from einshard.integrations.flax import state_tree
    >>> abstract = nnx.eval_shape(lambda: nnx.Linear(1024, 4096, rngs=nnx.Rngs(0)))
    >>> rules = {'kernel': 'x y -> x y*', 'bias': 'y -> y*'}
    >>> report = einshard.explain(state_tree(abstract), rules, n_devices=64)
    >>> [(row.path, row.shard_shape) for row in report.rows]
    [('bias', (64,)), ('kernel', (1024, 64))]
    """
    _, state = _split_state(obj)
    return nnx.to_pure_dict(state)


def shard_module(
    obj: T,
    rules: RulesLike,
    *,
    devices: Devices | None = None,
) -> T:
    """Shards the state of an NNX object in place, by a rule table, and returns it.

    Every variable is placed as :func:`einshard.shard_pytree` places the leaf
    at its path (``linear1/kernel``, ``opt_state/0/mu/linear1/kernel``: no
    ``.value``). Scalars (``step``, ``count``) are replicated, and so is RNG
    state (``nnx.RngState``), which the rules never see. Inside ``nnx.jit``
    the values become sharding constraints, and on an abstract module
    (``nnx.eval_shape``) ``ShapeDtypeStruct`` values carrying their shardings.

    Args:
        obj: An NNX object: a module, an ``nnx.Optimizer``, or a tuple, list
            or dict of them (shared variables are placed once).
        rules: The rule table, with its policies (see
            :func:`einshard.shard_pytree`). Patterns ending in the parameter's
            path (``r'linear1/kernel$'``) also match the optimizer state that
            mirrors it.
        devices: The devices, in order (see :func:`einshard.make_sharding`).

    Returns:
        ``obj`` itself, its variables now holding the placed arrays.

    Raises:
        EinshardError: A variable no rule matches, or one its rule does not
            fit; the message names the path, the shape and the rule. The
            table first and the object second.

    >>> import optax
    >>> from flax import nnx
    >>> from einshard.integrations.flax import shard_module
    >>> model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> rules = [(r'kernel$', 'x y -> x y*'), (r'.*', '... -> * ...')]
    >>> optimizer = shard_module(optimizer, rules)
    >>> optimizer.opt_state[0].mu['kernel'][...].sharding.shard_shape((4, 16))
    (4, 2)
    """
    table_second("shard_module", obj, rules, noun="the NNX object", is_target=_is_nnx_object)
    _place_state(obj, rules, devices)
    return obj


def _place_state(obj: Any, rules: RulesLike, devices: Devices | None) -> dict[int, Any]:
    """Places an NNX object's variables in place (RNG state replicated); placed value's id -> sharding."""
    rng_state, state = _split_state(obj)
    placed = _place_part(obj, state, lambda tree: _pytrees.leaf_shardings(tree, rules, devices)[2])
    placed |= _place_part(obj, rng_state, lambda tree: _pytrees.leaf_shardings(tree, _REPLICATE, devices)[2])
    nnx.update(obj, state, rng_state)
    return placed


def _place_part(obj: Any, state: Any, shardings_of: Callable[[Any], list[Any]]) -> dict[int, Any]:
    """Places one ``nnx.State`` of ``obj``, in place; returns each placed value's id with its sharding.

    ``shardings_of`` gets the state as a pure dict and gives a flat list, in leaf order (``None``: kept).
    """
    values, treedef = jax.tree_util.tree_flatten(nnx.to_pure_dict(state))
    with adding_context(_state_context, obj):
        shardings = shardings_of(treedef.unflatten(values))
    placed = place_leaves(values, shardings)
    nnx.replace_by_pure_dict(state, treedef.unflatten(placed))
    return {id(v): s for v, s in zip(placed, shardings, strict=True) if s is not None}


def create_sharded(
    factory: Callable[..., T], rules: RulesLike | None = None, /, *args: Any, **kwargs: Any
) -> T:
    """Builds an NNX object born sharded: ``factory(*args, **kwargs)``, every variable placed by its rule.

    The construction is compiled by einshard's born-sharded builder (the one
    :func:`einshard.init_sharded` uses: in parts of bounded size for a big
    model) with every variable of the result given its rule's sharding, so
    each device computes only its own shards and the model never exists
    whole on one device. The values are those an unsharded
    ``factory(*args, **kwargs)`` gives. The result works as any module does
    with ``nnx.jit`` train steps and ``nnx.Optimizer``.

    NNX objects among the arguments (an ``nnx.Rngs``, a module for an
    ``nnx.Optimizer``) and arrays are passed through the compiled call (by
    NNX's ``update_context``, as ``nnx.jit`` passes them): an ``nnx.Rngs``
    argument is advanced as an eager call would advance it, and a result
    that holds an argument (a module built around a given model) holds that
    very object, placed by the rules too. Other arguments (sizes, optax
    transformations, filters) are passed as they are. Build the
    ``nnx.Rngs`` inside the factory or pass it as an argument: one the
    factory closes over cannot be advanced inside the compiled call.

    The policies are the table's (build a :class:`einshard.Rules` with
    ``unmatched=`` etc. to change them), the devices those of the call
    (:func:`einshard.use_devices`, or the ambient mesh). The arguments come in
    the order of every born-sharded builder (Equinox's
    :func:`einshard.integrations.equinox.create_sharded`,
    :func:`einshard.init_sharded`): the factory, the rules, then the
    factory's own arguments; ``rules=`` after them is refused with an error
    showing that call, unless the factory has a parameter called ``rules``.

    The rules decide every layout, so the factory runs with Flax's eager
    sharding off: a model annotated with ``nnx.with_partitioning`` (logical
    axis names) is built without the mesh those names would need, and its
    annotations are left as metadata.

    Args:
        factory: Builds the object: a module class, ``nnx.Optimizer``, or any
            function returning an NNX object (or a tuple of them, e.g. a model
            and its optimizer).
        rules: The rule table (see :func:`shard_module`).
        *args: Positional arguments for ``factory``.
        **kwargs: Keyword arguments for ``factory``.

    Returns:
        ``factory(*args, **kwargs)``, value for value, each variable placed by
        its rule.

    Raises:
        EinshardError: As :func:`shard_module` would, before anything is
            computed; the rules given by keyword, or a factory argument in
            their place.

    >>> from flax import nnx
    >>> from einshard.integrations.flax import create_sharded
    >>> rules = [(r'kernel$', 'x y -> x y*'), (r'bias$', 'y -> y*')]
    >>> model = create_sharded(nnx.Linear, rules, 4, 16, rngs=nnx.Rngs(0))
    >>> [shard.data.shape for shard in model.kernel[...].addressable_shards][:2]
    [(4, 2), (4, 2)]
    """
    table = _table("create_sharded", factory, rules, args, kwargs, noun="the factory")

    def make(*args: Any, **kwargs: Any) -> Any:
        with _no_eager_sharding():
            return factory(*args, **kwargs)

    return _build(make, lambda built: _place_state(built, table, None), *args, **kwargs)


def _table(
    verb: str, target: Any, rules: RulesLike | None, args: tuple[Any, ...], kwargs: dict[str, Any], **how: Any
) -> Rules:
    table = rule_table(verb, target, rules, args, kwargs, **how)
    assert table is not None  # None is no table here (rule_table refuses it)
    return table


def _build(
    factory: Callable[..., T], place: Callable[[T], dict[int, Any]], /, *args: Any, **kwargs: Any
) -> T:
    """``factory(*args, **kwargs)`` born sharded by ``build_sharded``, ``place`` placing it inside.

    ``place(built)`` places the traced object's variables (constraints) and
    returns each placed value's id with its sharding, which become the
    compiled build's ``out_shardings``. NNX's update context (its public API
    for transforms) carries the NNX arguments through the pure build: an
    ``nnx.Rngs`` argument advances, and a result that holds an argument holds
    that very object.
    """
    (nodes, arrays), combine = partition(
        (args, kwargs), _is_nnx_node, is_concrete_array, is_leaf=_is_nnx_node
    )
    out_shardings: list[Any] = []  # of the output's leaves, filled while tracing

    def build(node_state: Any, array_values: list[Any]) -> Any:
        with nnx.merge_context(_TAG, inner=True) as ctx:
            inner_nodes = ctx.merge(graphdef, node_state)
        call_args, call_kwargs = combine(inner_nodes, array_values)
        built = factory(*call_args, **call_kwargs)
        shardings_by_id = place(built)
        with nnx.split_context(_TAG) as ctx:
            out = ctx.split((built, inner_nodes))
        out_shardings[:] = [shardings_by_id.get(id(leaf)) for leaf in jax.tree_util.tree_leaves(out)]
        # NNX hands the values it was given back as they are; if it ever copied them, say so here.
        assert sum(s is not None for s in out_shardings) == len(shardings_by_id), "NNX copied the values"
        return out

    with nnx.update_context(_TAG):
        with nnx.split_context(_TAG) as ctx:
            graphdef, node_state = ctx.split(nodes)
        out_graphdef, out_state = build_sharded(
            build,
            lambda abstract: jax.tree_util.tree_structure(abstract).unflatten(out_shardings),
            node_state,
            arrays,
        )
        with nnx.merge_context(_TAG, inner=False) as ctx:
            built, _ = ctx.merge(out_graphdef, out_state)
    return built


_TAG = "einshard.create_sharded"


def shard_optimizer(optimizer: Any, model: Any) -> Any:
    """Shards an ``nnx.Optimizer``'s state in place like the model's parameters it mirrors.

    No rules needed: each state leaf that mirrors a parameter (``mu``,
    ``nu``, momentum) gets the sharding that parameter has in ``model``, one
    with an axis reduced (Adafactor's factored ``v_row`` / ``v_col``) keeps
    the split of its surviving axes, and scalars (``step``, ``count``) and
    everything else are replicated (see :mod:`einshard.integrations.optax`).
    Use it for optimizers whose state a rule table written for the
    parameters does not fit (Adafactor, ``optax.masked``); for the common
    ones (``adamw``, ``sgd``), :func:`shard_module` with the model's rules
    gives the same layout.

    Args:
        optimizer: An ``nnx.Optimizer``.
        model: The module it optimizes, already placed (e.g. by
            :func:`shard_module` or :func:`create_sharded`).

    Returns:
        ``optimizer`` itself, its state now placed.

    >>> import optax
    >>> from flax import nnx
    >>> from einshard.integrations.flax import shard_module, shard_optimizer
    >>> rules = {'kernel': 'x y -> x y*', 'bias': 'y -> y*'}
    >>> model = shard_module(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), rules)
    >>> optimizer = nnx.Optimizer(model, optax.adafactor(1e-3, min_dim_size_to_factor=8), wrt=nnx.Param)
    >>> optimizer = shard_optimizer(optimizer, model)
    >>> optimizer.opt_state[0].v_col['kernel'][...].sharding.shard_shape((64,))  # kernel's columns, split
    (8,)
    """
    params = nnx.to_pure_dict(nnx.state(model, optimizer.wrt))
    _place_like(optimizer, params)
    return optimizer


def create_optimizer(model: Any, tx: Any, *, wrt: Any = nnx.Param) -> Any:
    """An ``nnx.Optimizer(model, tx, wrt=wrt)`` born sharded like the model's parameters.

    The state is computed by einshard's born-sharded builder (as in
    :func:`create_sharded`) with the layouts :func:`shard_optimizer` gives,
    so no leaf ever exists whole on one device, whatever the optimizer
    (Adafactor's factored statistics included).

    Args:
        model: The module to optimize, already placed (e.g. by :func:`create_sharded`).
        tx: An optax ``GradientTransformation``.
        wrt: The variables to optimize, as for ``nnx.Optimizer`` (default ``nnx.Param``).

    Returns:
        The ``nnx.Optimizer``, value for value as an unsharded one, every state leaf placed.

    >>> import optax
    >>> from flax import nnx
    >>> from einshard.integrations.flax import create_optimizer, create_sharded
    >>> rules = {'kernel': 'x y -> x y*', 'bias': 'y -> y*'}
    >>> model = create_sharded(nnx.Linear, rules, 16, 64, rngs=nnx.Rngs(0))
    >>> optimizer = create_optimizer(model, optax.adamw(1e-3))
    >>> [shard.data.shape for shard in optimizer.opt_state[0].mu['kernel'][...].addressable_shards][:2]
    [(16, 8), (16, 8)]
    """
    params = nnx.to_pure_dict(nnx.state(model, wrt))
    # Only the layouts are needed inside the compiled call, not the values.
    layouts = jax.tree.map(_struct_with_sharding, params)

    return _build(
        lambda model: nnx.Optimizer(model, tx, wrt=wrt), lambda opt: _place_like(opt, layouts), model
    )


def _struct_with_sharding(leaf: Any) -> Any:
    if is_jax_array(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _place_like(optimizer: Any, params: Any) -> dict[int, Any]:
    """Places an optimizer's state in place like the params it mirrors; placed value's id -> sharding."""
    # optax is an extra of its own: imported when an optimizer is placed, not with Flax.
    from . import optax as optax_integration

    def shardings_of(state: Any) -> list[Any]:
        optax_integration.check_params_for_state(state, params)
        shardings = optax_integration.opt_state_shardings(state, params)
        return jax.tree_util.tree_structure(state).flatten_up_to(shardings)

    state = nnx.state(optimizer)
    placed = _place_part(optimizer, state, shardings_of)
    nnx.update(optimizer, state)
    return placed


def _is_nnx_node(leaf: Any) -> bool:
    return isinstance(leaf, (nnx.Pytree, nnx.Variable))


def _is_nnx_object(value: Any) -> bool:
    """Whether ``value`` is what :func:`shard_module` places: an NNX object, or a container of them."""
    return any(
        nnx.graph.is_graph_node(node)
        for node in jax.tree_util.tree_leaves(value, is_leaf=nnx.graph.is_graph_node)
    )


def _no_eager_sharding() -> contextlib.AbstractContextManager[Any]:
    """Turns off Flax's eager sharding (by ``with_partitioning`` annotations), where Flax has it."""
    use_eager_sharding = getattr(nnx, "use_eager_sharding", None)
    return contextlib.nullcontext() if use_eager_sharding is None else use_eager_sharding(False)


def _state_context(error: EinshardError, obj: Any) -> None:
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}" if isinstance(obj, nnx.Pytree) else kind.__name__
    error.add_context(f"in the state of {name}")


# --- linen --------------------------------------------------------------------


def init_sharded(module: Any, rules: RulesLike | None = None, /, *init_args: Any, **init_kwargs: Any) -> Any:
    """A born-sharded ``module.init(*init_args, **init_kwargs)`` for a linen module.

    The variables are computed by one compiled call whose outputs carry the
    rules' shardings (:func:`einshard.init_sharded`), so they never exist
    whole on one device. Rules match paths like ``params/Dense_0/kernel`` and
    ``batch_stats/BatchNorm_0/mean``. Metadata boxes (``nn.with_partitioning``)
    are unboxed: the rules decide the layout.

    Args:
        module: A ``flax.linen.Module``.
        rules: The rule table (see :func:`einshard.shard_pytree`); its policies apply.
        *init_args: Arguments for ``module.init``: the RNG key(s), then sample inputs.
        **init_kwargs: Keyword arguments for ``module.init`` (``train=False``, ``method=``, ...).

    Returns:
        The variable dict ``module.init`` returns, value for value, each array
        placed by its rule.

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> from einshard.integrations.flax import init_sharded
    >>> rules = [(r'kernel$', 'x y -> x y*'), (r'bias$', 'y -> y*')]
    >>> variables = init_sharded(nn.Dense(16), rules, jax.random.key(0), jnp.ones((1, 4)))
    >>> variables['params']['kernel'].sharding.shard_shape((4, 16))
    (4, 2)
    """
    import flax.linen as nn

    table = _table("init_sharded", module, rules, init_args, init_kwargs)

    def init(*args: Any, **kwargs: Any) -> Any:
        return nn.unbox(module.init(*args, **kwargs))

    return _pytrees.init_sharded(init, table, *init_args, **init_kwargs)


def create_train_state(
    module: Any,
    rules: RulesLike | None = None,
    tx: Any = None,
    /,
    *init_args: Any,
    state_class: type | None = None,
    **init_kwargs: Any,
) -> Any:
    """A born-sharded ``TrainState`` for a linen module, its optax state sharded like its parameters.

    The parameters are initialized by :func:`init_sharded` (rules match
    ``params/Dense_0/kernel``, the path the state's ``params`` field gives),
    then the optimizer state by :func:`einshard.integrations.optax.init_opt_state`:
    each leaf that mirrors a parameter (``mu``, ``nu``, momentum) is born with
    that parameter's sharding, scalars (``count``) replicated. ``step`` is a
    replicated ``int32`` zero. Nothing exists whole on one device.

    Collections other than ``params`` (``batch_stats``) are kept when
    ``state_class`` has a field of that name (a ``TrainState`` subclass), and
    sharded by the rules (``batch_stats/BatchNorm_0/mean``); otherwise they
    are dropped, as ``TrainState.create(params=variables['params'])`` drops them.

    The rule table comes second, as in every builder (:func:`create_sharded`,
    :func:`init_sharded`), then the optimizer. The order of einshard 0.3's
    first version, ``create_train_state(module, tx, rules, ...)``, is refused
    with an error showing this call.

    Args:
        module: A ``flax.linen.Module``; ``module.apply`` becomes ``apply_fn``.
        rules: The rule table (see :func:`einshard.shard_pytree`).
        tx: An optax ``GradientTransformation``.
        *init_args: Arguments for ``module.init``: the RNG key(s), then sample inputs.
        state_class: The state class, ``flax.training.train_state.TrainState``
            by default, or a subclass with extra fields.
        **init_kwargs: Keyword arguments for ``module.init``.

    Returns:
        ``state_class(step=0, apply_fn=module.apply, params=..., tx=tx,
        opt_state=tx.init(params), ...)``, every array placed.

    >>> import jax, jax.numpy as jnp, optax
    >>> import flax.linen as nn
    >>> from einshard.integrations.flax import create_train_state
    >>> rules = [(r'kernel$', 'x y -> x y*'), (r'bias$', 'y -> y*')]
    >>> state = create_train_state(nn.Dense(16), rules, optax.adam(1e-3), jax.random.key(0), jnp.ones((1, 4)))
    >>> state.opt_state[0].mu['kernel'].sharding.shard_shape((4, 16))
    (4, 2)
    """
    import flax.linen as nn
    import jax.numpy as jnp
    from flax.training import train_state

    from . import optax as optax_integration  # optax is an extra of its own: imported when used

    table = _table(
        "create_train_state", module, rules, (tx, *init_args), init_kwargs, after={"tx": is_optimizer}
    )
    cls: Any = train_state.TrainState if state_class is None else state_class
    fields = {field.name for field in dataclasses.fields(cls)}
    extra_fields = fields - {"step", "apply_fn", "params", "tx", "opt_state"}

    def init(*args: Any, **kwargs: Any) -> dict[str, Any]:
        variables = nn.unbox(module.init(*args, **kwargs))
        return {name: value for name, value in variables.items() if name == "params" or name in extra_fields}

    variables = dict(_pytrees.init_sharded(init, table, *init_args, **init_kwargs))
    if "params" not in variables:
        raise EinshardError(
            f"{type(module).__name__}.init returned no 'params' collection",
            hint="A TrainState needs parameters to optimize.",
        )
    params = variables.pop("params")
    opt_state = optax_integration.init_opt_state(tx, params)
    step = _pytrees.shard_pytree(jnp.zeros((), jnp.int32), _REPLICATE)
    return cls(step=step, apply_fn=module.apply, params=params, tx=tx, opt_state=opt_state, **variables)
