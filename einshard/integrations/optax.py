"""optax: optimizer state sharded like the parameters it mirrors.

An optax state holds copies of the parameter tree (Adam's ``mu`` and ``nu``,
momentum's ``trace``, Lion's ``mu``, ``MultiSteps``' ``acc_grads``), scalars
(``count``, injected hyperparameters) and, for some optimizers, statistics
that are not parameter-shaped (Adafactor's factored ``v_row`` / ``v_col``).
This module gives every state leaf a layout that fits it:

* a leaf that **mirrors a parameter** (same place in a parameter-shaped
  subtree, same shape) gets exactly that parameter's sharding;
* a leaf that is a parameter with **one axis reduced** (Adafactor's factored
  statistics) gets the parameter's sharding with that axis dropped: the
  surviving axes stay split as they were, so it is never a spec of the wrong
  rank (for ``v_row`` / ``v_col`` the reduced axis is the one optax reduces);
* **scalars** and every other array (Adafactor's shape-``(1,)`` placeholders,
  anything that mirrors no parameter) are **replicated**, on the parameters'
  devices.

Which leaf mirrors which parameter is found structurally, without the
transformation: a subtree of the state whose tree structure is that of
``params`` is matched to ``params`` leaf by leaf, and each leaf's shape
decides as above. A subtree also matches when its leaves sit at the same key
paths as the parameters', with ``optax.MaskedNode`` standing in for the
masked-out parameters or subtrees of ``optax.masked`` and
``optax.multi_transform`` (and with wrapper nodes of another type, such as
Flax NNX's optimizer variables). So it works for any state, including
restored or abstract ones. :func:`explain_opt_state` shows the decision for
every leaf, the way :func:`einshard.explain` does for a rule table.

The parameters' layouts are read from ``params`` itself: placed
``jax.Array`` leaves, or ``jax.ShapeDtypeStruct`` leaves carrying
shardings. Importing ``einshard`` does not import optax; this module does.

>>> import jax.numpy as jnp, optax, einshard
>>> from einshard.integrations.optax import init_sharded
>>> rules = [('w', 'x y -> x y*'), ('b', 'y -> y*')]
>>> params = einshard.shard_pytree({'w': jnp.ones((4, 64)), 'b': jnp.zeros(64)}, rules)
>>> state = init_sharded(optax.adam(1e-3), params)
>>> state[0].mu['w'].sharding == params['w'].sharding
True
>>> state[0].count.sharding.is_fully_replicated
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import jax
import numpy as np
import optax
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from .._arrays import make_sharding
from .._devices import Devices
from .._errors import EinshardError
from .._explain import Report, ReportRow, _itemsize
from .._expression import parse
from .._inputs import check_params_for_state
from .._layout import Layout, compile_layout
from .._pytrees import REPLICATE, LeafPlan, _device_count, is_array_leaf, plan_tree
from .._rules import Rules, RulesLike, path_string

__all__ = ["explain_opt_state", "init_sharded", "opt_state_shardings", "shard_opt_state"]

KeyPath = tuple[Any, ...]


class Initable(Protocol):
    """Anything with optax's ``init(params) -> state``: a ``GradientTransformation``, ``MultiSteps``."""

    def init(self, params: Any) -> Any:
        """Makes the optimizer state for ``params``."""
        ...


# --- matching state leaves to parameters (pure: shapes and tree structure only) ---


@dataclasses.dataclass(frozen=True)
class _Param:
    """One leaf of ``params``: its path, and its shape (``None`` if it is not an array)."""

    path: str
    shape: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class _Match:
    """What one array leaf of the state is.

    ``kind`` is ``'scalar'``, ``'mirror'`` (same shape as ``param``),
    ``'reduced'`` (``param`` with one of ``axes`` reduced) or ``'other'``
    (an array that mirrors no parameter; ``param`` is the one at its place in
    a parameter-shaped subtree, if any).
    """

    kind: Literal["scalar", "mirror", "reduced", "other"]
    param: int | None = None
    axes: tuple[int, ...] = ()
    adafactor: str | None = None  # the FactoredState field the leaf is under


_FACTORED_STATE: type | None = getattr(optax, "FactoredState", None)  # Adafactor's state


def _is_masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


class _Matcher:
    """Walks a state top-down and matches its parameter-shaped subtrees to ``params``."""

    def __init__(self, params: Any) -> None:
        path_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.leaves = [leaf for _, leaf in path_leaves]
        self.params = [
            _Param(path_string(path), tuple(leaf.shape) if is_array_leaf(leaf) else None)
            for path, leaf in path_leaves
        ]
        self.index = {tuple(path): i for i, (path, _) in enumerate(path_leaves)}
        self.matches: dict[KeyPath, _Match] = {}

    def run(self, state: Any) -> dict[KeyPath, _Match]:
        self._visit(state, (), None)
        return self.matches

    def _visit(self, node: Any, path: KeyPath, adafactor: str | None) -> None:
        aligned = self._align(node)
        if aligned is not None:
            for subpath, leaf, param in aligned:
                if is_array_leaf(leaf):
                    self.matches[path + subpath] = self._decide(leaf, param, adafactor)
            return
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda child: child is not node)
        if len(children) == 1 and children[0][0] == ():  # a leaf
            if is_array_leaf(node):
                self.matches[path] = self._decide(node, None, adafactor)
            return
        factored = _FACTORED_STATE is not None and isinstance(node, _FACTORED_STATE)
        for (key,), child in children:
            field = getattr(key, "name", None) if factored else adafactor
            self._visit(child, (*path, key), field)

    def _align(self, node: Any) -> list[tuple[KeyPath, Any, int | None]] | None:
        """The node's leaves with their parameters, if the node is shaped like ``params``."""
        if not self.params:
            return None
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_masked)
        if len(path_leaves) > len(self.params):
            return None
        if treedef == self.treedef:
            return [(tuple(p), leaf, i) for i, (p, leaf) in enumerate(path_leaves)]
        # By key path: each leaf at a parameter's path, each MaskedNode standing for the
        # parameter or subtree at its path. Wrapper nodes may differ in type (Flax NNX keeps
        # parameters in Param variables and optimizer state in OptVariable ones).
        covered = [False] * len(self.params)
        aligned: list[tuple[KeyPath, Any, int | None]] = []
        for p, leaf in path_leaves:
            p = tuple(p)
            if _is_masked(leaf):
                under = [i for q, i in self.index.items() if q[: len(p)] == p]
                if not under:
                    return None
            else:
                i = self.index.get(p)
                if i is None:
                    return None
                under = [i]
                aligned.append((p, leaf, i))
            for i in under:
                if covered[i]:
                    return None
                covered[i] = True
        return aligned if all(covered) else None

    def _decide(self, leaf: Any, param: int | None, adafactor: str | None) -> _Match:
        shape = tuple(leaf.shape)
        if not shape:
            return _Match("scalar", param, adafactor=adafactor)
        target = None if param is None else self.params[param].shape
        if target is None:
            return _Match("other", param, adafactor=adafactor)
        if shape == target:
            return _Match("mirror", param, adafactor=adafactor)
        if len(shape) == len(target) - 1:
            axes = tuple(a for a in range(len(target)) if target[:a] + target[a + 1 :] == shape)
            if adafactor in ("v_row", "v_col") and len(axes) > 1:
                # optax reduces the largest axis for v_row and the next largest for v_col
                # (optax._src.factorized._factored_dims), ties broken by np.argsort.
                order = np.argsort(target)
                exact = int(order[-1] if adafactor == "v_row" else order[-2])
                axes = (exact,) if exact in axes else axes
            if axes:
                return _Match("reduced", param, axes, adafactor)
        return _Match("other", param, adafactor=adafactor)


def _match(opt_state: Any, params: Any) -> tuple[_Matcher, list[tuple[KeyPath, Any, _Match | None]]]:
    matcher = _Matcher(params)
    matches = matcher.run(opt_state)
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    return matcher, [(tuple(p), leaf, matches.get(tuple(p))) for p, leaf in path_leaves]


# --- from matches to shardings ---


def _param_sharding(leaf: Any, path: str) -> Sharding | None:
    if isinstance(leaf, Tracer):
        raise EinshardError(
            f"the parameter {path!r} is a traced value: its sharding is not known inside jit",
            hint="Compute opt_state_shardings(...) outside the traced function (from placed or "
            "abstract params) and pass it to jax.jit(..., out_shardings=...).",
        )
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return leaf.sharding  # None for a ShapeDtypeStruct without one
    return None  # NumPy arrays and Python scalars are not placed


def _pad_spec(spec: PartitionSpec, rank: int) -> tuple[Any, ...]:
    entries = tuple(spec)
    return entries + (None,) * (rank - len(entries))


def _axis_names(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _fits(sharding: Sharding, shape: tuple[int, ...]) -> bool:
    """Whether a sharding has the leaf's rank and splits every axis evenly."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(shape):
            return False
        sizes = dict(sharding.mesh.shape)
        return all(
            size % math.prod(sizes[name] for name in _axis_names(entry)) == 0
            for size, entry in zip(shape, spec, strict=False)
        )
    try:
        sharding.shard_shape(shape)
    except Exception:  # the sharding's own check: rank or divisibility
        return False
    return True


class _Placer:
    """Turns matches into shardings on the parameters' devices, with a note for each."""

    def __init__(self, matcher: _Matcher) -> None:
        self.matcher = matcher
        placed = [
            _param_sharding(leaf, param.path) if param.shape is not None else None
            for leaf, param in zip(matcher.leaves, matcher.params, strict=True)
        ]
        named = [s for s in placed if isinstance(s, NamedSharding)]
        self.default = max(named, key=lambda s: s.num_devices, default=None) or next(
            (s for s in placed if isinstance(s, SingleDeviceSharding)), None
        )
        # Beside placed params, a param on one device is one left as built (a bias no rule or
        # decorator names): jit moves it to the others' devices, so its state goes there too,
        # replicated, instead of pinning the compiled init to two device sets.
        spread = self.default is not None and self.default.num_devices > 1
        self.on_one_device = [spread and isinstance(s, SingleDeviceSharding) for s in placed]
        self.shardings = [None if one else s for s, one in zip(placed, self.on_one_device, strict=True)]

    def replicated(self, rank: int, near: Sharding | None = None) -> Sharding:
        """A replicated sharding on the devices of ``near``, else on those of the params."""
        for candidate in (near, self.default):
            if isinstance(candidate, NamedSharding):
                return NamedSharding(candidate.mesh, PartitionSpec(), memory_kind=candidate.memory_kind)
            if isinstance(candidate, SingleDeviceSharding):
                return candidate
        return make_sharding(REPLICATE, n_dims=rank)

    def place(self, leaf: Any, match: _Match) -> tuple[Sharding, str]:
        shape = tuple(leaf.shape)
        rank = len(shape)
        if match.kind == "scalar":
            near = self.shardings[match.param] if match.param is not None else None
            return self.replicated(rank, near), "scalar"
        if match.param is None:
            return self.replicated(rank), "mirrors no parameter: replicated"
        param = self.matcher.params[match.param]
        sharding = self.shardings[match.param]
        if match.kind == "other":
            what = "adafactor placeholder" if match.adafactor and shape == (1,) else f"shape {shape}"
            return self.replicated(rank, sharding), f"{what} beside {param.path}: replicated"
        if sharding is None:
            where = "is on one device" if self.on_one_device[match.param] else "is not placed"
            note = f"{'mirrors' if match.kind == 'mirror' else 'reduces'} {param.path}, which {where}"
            return self.replicated(rank), note + ": replicated"
        if match.kind == "mirror":
            if _fits(sharding, shape):
                return sharding, f"mirrors {param.path}"
            return self.replicated(rank, sharding), f"mirrors {param.path}, whose sharding does not fit"
        assert param.shape is not None
        candidates = [(axis, _reduce(sharding, param.shape, axis)) for axis in match.axes]
        axis, reduced = candidates[0]
        origin = f"adafactor {match.adafactor} of" if match.adafactor else "reduces"
        if reduced is None or not _fits(reduced, shape):
            return self.replicated(rank, sharding), f"{origin} {param.path}: replicated"
        if any(r is None or not r.is_equivalent_to(reduced, rank) for _, r in candidates[1:]):
            axes = " or ".join(str(a) for a, _ in candidates)
            note = f"{origin} {param.path}, axis {axes} (ambiguous): replicated"
            return self.replicated(rank, sharding), note
        note = f"{origin} {param.path} (axis {axis} reduced)"
        if reduced.is_fully_replicated and not sharding.is_fully_replicated:
            note += ": replicated"
        return reduced, note


def _reduce(sharding: Sharding, shape: tuple[int, ...], axis: int) -> Sharding | None:
    """The sharding of ``shape`` with ``axis`` removed: the other axes split as before."""
    if isinstance(sharding, NamedSharding):
        spec = _pad_spec(sharding.spec, len(shape))
        kept = spec[:axis] + spec[axis + 1 :]
        return NamedSharding(sharding.mesh, PartitionSpec(*kept), memory_kind=sharding.memory_kind)
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    return None


def _plan(opt_state: Any, params: Any) -> tuple[list[tuple[str, Any, Sharding | None, str | None]], Any]:
    """Every leaf of the state with its sharding (``None``: not an array) and note."""
    matcher, matched = _match(opt_state, params)
    placer = _Placer(matcher)
    planned = []
    for path, leaf, match in matched:
        if match is None:
            planned.append((path_string(path), leaf, None, None))
            continue
        sharding, note = placer.place(leaf, match)
        planned.append((path_string(path), leaf, sharding, note))
    return planned, jax.tree_util.tree_structure(opt_state)


# --- the public API ---


def opt_state_shardings(opt_state: Any, params: Any) -> Any:
    """The tree of shardings for an optimizer state, each leaf laid out like what it mirrors.

    A state leaf that mirrors a parameter gets that parameter's sharding; a
    parameter with one axis reduced (Adafactor's ``v_row`` / ``v_col``) gets
    the parameter's sharding without that axis; scalars and arrays that mirror
    no parameter are replicated on the parameters' devices. See the module
    documentation for how leaves are matched, and :func:`explain_opt_state`
    for the decision on each leaf.

    Args:
        opt_state: An optax state, concrete or abstract (``jax.eval_shape(tx.init, params)``).
        params: The parameters the state belongs to (the tree ``tx.init`` was
            given), placed (``jax.Array`` leaves) or abstract
            (``jax.ShapeDtypeStruct`` leaves carrying shardings).

    Returns:
        A tree with the structure of ``opt_state``: a ``jax.sharding.Sharding``
        at every array leaf, ``None`` at other leaves. Use it as
        ``jax.jit(..., out_shardings=...)`` for a training step, or as a
        checkpoint restore target.

    Raises:
        EinshardError: If a parameter is a traced value (inside ``jit``).

    >>> import jax, jax.numpy as jnp, optax, einshard
    >>> from einshard.integrations.optax import opt_state_shardings
    >>> params = einshard.shard_pytree({'w': jnp.ones((4, 64))}, {'w': 'x y -> x y*'})
    >>> abstract = jax.eval_shape(optax.sgd(0.1, momentum=0.9).init, params)
    >>> opt_state_shardings(abstract, params)[0].trace['w'] == params['w'].sharding
    True
    """
    planned, treedef = _plan(opt_state, params)
    return jax.tree_util.tree_unflatten(treedef, [sharding for _, _, sharding, _ in planned])


def shard_opt_state(opt_state: Any, params: Any) -> Any:
    """Places an existing optimizer state like the params it mirrors.

    Concrete leaves are placed in one batched ``jax.device_put``; abstract
    leaves (``jax.ShapeDtypeStruct``) come back carrying their shardings;
    traced leaves (inside ``jit``) get a sharding constraint. Other leaves
    pass through.

    Args:
        opt_state: An optax state, e.g. ``tx.init(params)`` made unsharded, or restored.
        params: The parameters it belongs to, placed or abstract with shardings
            (see :func:`opt_state_shardings`).

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
    planned, treedef = _plan(opt_state, params)
    out = [leaf for _, leaf, _, _ in planned]
    batch_at, batch_leaves, batch_shardings = [], [], []
    for i, (_, leaf, sharding, _) in enumerate(planned):
        if sharding is None:
            continue
        if isinstance(leaf, Tracer):
            out[i] = jax.lax.with_sharding_constraint(leaf, sharding)
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            out[i] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type)
        else:
            batch_at.append(i)
            batch_leaves.append(leaf)
            batch_shardings.append(sharding)
    if batch_leaves:
        for i, placed in zip(batch_at, jax.device_put(batch_leaves, batch_shardings), strict=True):
            out[i] = placed
    return jax.tree_util.tree_unflatten(treedef, out)


def init_sharded(tx: Initable, params: Any) -> Any:
    """Runs ``tx.init(params)`` so that the state is born sharded.

    The state's shapes are found abstractly (``jax.eval_shape``), their
    shardings derived from the params' (:func:`opt_state_shardings`), and
    ``tx.init`` compiled with those as ``out_shardings``: each device computes
    only its own shards, and no state leaf ever exists whole on one device.

    Args:
        tx: An optax ``GradientTransformation`` (any: ``chain``,
            ``inject_hyperparams``, ``masked``, ...) or anything else with
            ``init(params)``, such as ``optax.MultiSteps``.
        params: The parameters, placed (``jax.Array`` leaves, e.g. from
            :func:`einshard.shard_pytree` or :func:`einshard.init_sharded`).
            If every array leaf is a ``jax.ShapeDtypeStruct`` carrying a
            sharding, the result is the abstract state, each leaf carrying its
            sharding (a checkpoint restore target); nothing is computed.

    Returns:
        ``tx.init(params)``, value for value, every leaf placed.

    Raises:
        EinshardError: If ``params`` mixes abstract and concrete arrays.

    >>> import jax.numpy as jnp, optax, einshard
    >>> from einshard.integrations.optax import init_sharded
    >>> params = einshard.shard_pytree({'w': jnp.ones((4, 64))}, {'w': 'x y -> x y*'})
    >>> state = init_sharded(optax.MultiSteps(optax.lion(1e-4), every_k_schedule=4), params)
    >>> [shard.data.shape for shard in state.acc_grads['w'].addressable_shards][:2]
    [(4, 8), (4, 8)]
    """
    arrays = [leaf for leaf in jax.tree_util.tree_leaves(params) if is_array_leaf(leaf)]
    abstract_params = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in arrays]
    if any(abstract_params):
        if not all(abstract_params):
            raise EinshardError(
                "params mix abstract (jax.ShapeDtypeStruct) and concrete arrays",
                hint="Pass placed params to create the state, or abstract ones for an abstract state.",
            )
        return shard_opt_state(jax.eval_shape(tx.init, params), params)
    abstract = jax.eval_shape(tx.init, params)
    shardings = opt_state_shardings(abstract, params)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def explain_opt_state(
    opt_state: Any,
    params: Any,
    rules: RulesLike | None = None,
    *,
    n_devices: int | None = None,
    devices: Devices | None = None,
) -> Report:
    """Explains how an optimizer state is laid out: one row per array leaf, with why.

    The counterpart of :func:`einshard.explain` for optax states. Each row's
    ``note`` says what the leaf is: ``'mirrors w1'``, ``'adafactor v_row of
    w1 (axis 1 reduced): replicated'``, ``'adafactor placeholder beside w1:
    replicated'``, ``'scalar'``, ``'mirrors no parameter: replicated'``.

    Two modes:

    * without ``rules``, the parameters' layouts are read from ``params``
      (placed, or abstract with shardings), as :func:`opt_state_shardings`
      does; the ``expression`` column spells each leaf's layout as an
      einshard expression over its mesh;
    * with ``rules``, the parameters are planned by the rule table for
      ``n_devices`` devices, as :func:`einshard.explain` plans them, so a run
      on more devices than the machine has can be planned from
      ``jax.eval_shape`` output; the ``rule`` column names the rule of the
      parameter a leaf mirrors.

    Args:
        opt_state: An optax state, concrete or abstract.
        params: The parameters the state belongs to.
        rules: A rule table to plan the parameters by (see
            :func:`einshard.shard_pytree`), or ``None`` to read their shardings.
        n_devices: With ``rules``, the device count to plan for (defaults to
            that of ``devices`` or of the einshard device order). Without
            ``rules``, it must be the parameters' device count if given.
        devices: With ``rules``, the devices, when ``n_devices`` is not given.

    Returns:
        An :class:`einshard.Report`.

    Raises:
        EinshardError: As :func:`einshard.explain` would with ``rules``; without
            them, if ``n_devices`` differs from the parameters' device count.

    >>> import jax, jax.numpy as jnp, optax
    >>> from einshard.integrations.optax import explain_opt_state
    >>> params = {'w1': jax.ShapeDtypeStruct((512, 1024), jnp.float32)}
    >>> tx = optax.adafactor(1e-3)
    >>> state = jax.eval_shape(tx.init, params)
    >>> report = explain_opt_state(state, params, [('w1', 'x y -> x y*')], n_devices=256)
    >>> for row in report.rows[1:3]:
    ...     print(row.path, '|', row.expression, '|', row.shard_shape, '|', row.note)
    0/v_row/w1 | x -> x * | (512,) | adafactor v_row of w1 (axis 1 reduced): replicated
    0/v_col/w1 | y -> y* | (4,) | adafactor v_col of w1 (axis 0 reduced)
    >>> report.rows[0].note, report.rows[3].note
    ('scalar', 'adafactor placeholder beside w1: replicated')
    """
    if rules is not None:
        return _explain_planned(opt_state, params, rules, n_devices, devices)
    planned, _ = _plan(opt_state, params)
    rows = []
    holds: dict[Any, int] = {}
    for path, leaf, sharding, note in planned:
        if sharding is None:
            continue
        shape = tuple(leaf.shape)
        shard_shape = tuple(sharding.shard_shape(shape))
        itemsize = _itemsize(leaf.dtype)
        per_device = math.prod(shard_shape) * itemsize
        rows.append(
            ReportRow(
                path=path,
                shape=shape,
                dtype=str(leaf.dtype),
                rule=None,
                expression=_spell(sharding, len(shape)),
                shard_shape=shard_shape,
                bytes=math.prod(shape) * itemsize,
                bytes_per_device=per_device,
                note=note,
            )
        )
        for device in _holders(sharding):
            holds[device] = holds.get(device, 0) + per_device
    count = len(holds)
    if n_devices is not None and count and n_devices != count:
        raise EinshardError(
            f"the parameters are placed on {count} devices, not n_devices={n_devices}",
            hint="To plan for another device count, pass the rule table: "
            "explain_opt_state(opt_state, params, rules, n_devices=...).",
        )
    return Report(
        rows=tuple(rows),
        n_devices=count or (n_devices or 1),
        total_bytes=sum(row.bytes for row in rows),
        max_bytes_per_device=max(holds.values(), default=0),
        unused_rules=(),
    )


def _holders(sharding: Sharding) -> Sequence[Any]:
    try:
        return list(sharding.device_set)
    except Exception:  # a sharding on an abstract mesh: positions stand for devices
        return list(range(sharding.num_devices))


def _spell(sharding: Sharding, rank: int) -> str:
    """An einshard expression for a sharding, over its mesh's device order; else its spec."""
    if sharding.is_fully_replicated:
        return REPLICATE
    if not isinstance(sharding, NamedSharding) or rank > 26:
        return str(sharding)
    sizes = dict(sharding.mesh.shape)
    names = [name for name in sharding.mesh.axis_names if sizes[name] > 1]
    letters = "abcdefghijklmnopqrstuvwxyz"[:rank]
    owner: dict[str, int] = {}  # mesh axis -> array axis
    for axis, entry in enumerate(_pad_spec(sharding.spec, rank)):
        run = [name for name in _axis_names(entry) if sizes[name] > 1]
        if not run:
            continue
        start = names.index(run[0])
        if run != names[start : start + len(run)] or any(name in owner for name in run):
            return str(sharding.spec)  # not a run of consecutive mesh axes: no expression says it
        for name in run:
            owner[name] = axis
    right: list[tuple[int | None, str]] = []  # (array axis or None, element)
    i = 0
    while i < len(names):
        axis = owner.get(names[i])
        j = i
        while j < len(names) and owner.get(names[j]) == axis:
            j += 1
        count = math.prod(sizes[name] for name in names[i:j])
        right.append((axis, f"{letters[axis] if axis is not None else ''}{count}"))
        i = j
    sharded = {axis for axis, _ in right if axis is not None}
    for axis in sorted(set(range(rank)) - sharded, reverse=True):
        at = next((k for k, (other, _) in enumerate(right) if other is not None and other > axis), len(right))
        right.insert(at, (axis, letters[axis]))
    return f"{' '.join(letters)} -> {' '.join(element for _, element in right)}"


def _explain_planned(
    opt_state: Any, params: Any, rules: RulesLike, n_devices: int | None, devices: Devices | None
) -> Report:
    table = rules if isinstance(rules, Rules) else Rules(rules)
    count = n_devices if n_devices is not None else _device_count(devices)
    planned, _, _ = plan_tree(
        params, table, n_devices=count, unmatched=table.unmatched, indivisible=table.indivisible
    )
    plans = [plan for _, plan in planned]
    matcher, matched = _match(opt_state, params)
    rows = []
    for path, leaf, match in matched:
        if match is None:
            continue
        shape = tuple(leaf.shape)
        plan = plans[match.param] if match.param is not None else None
        rule, expression, layout, note = _plan_leaf(matcher, shape, match, plan, count)
        itemsize = _itemsize(leaf.dtype)
        shard_shape = layout.shard_shape(shape)
        rows.append(
            ReportRow(
                path=path_string(path),
                shape=shape,
                dtype=str(leaf.dtype),
                rule=rule,
                expression=expression,
                shard_shape=shard_shape,
                bytes=math.prod(shape) * itemsize,
                bytes_per_device=math.prod(shard_shape) * itemsize,
                note=note,
            )
        )
    return Report(
        rows=tuple(rows),
        n_devices=count,
        total_bytes=sum(row.bytes for row in rows),
        max_bytes_per_device=sum(row.bytes_per_device for row in rows),
        unused_rules=(),
    )


def _plan_leaf(
    matcher: _Matcher, shape: tuple[int, ...], match: _Match, plan: LeafPlan | None, count: int
) -> tuple[str | None, str, Layout, str]:
    """Rule, expression, layout and note of one state leaf, planned from its parameter's plan."""
    rank = len(shape)

    def replicated(note: str) -> tuple[str | None, str, Layout, str]:
        return None, REPLICATE, compile_layout(REPLICATE, rank, count), note

    if match.kind == "scalar":
        return replicated("scalar")
    if match.param is None:
        return replicated("mirrors no parameter: replicated")
    param = matcher.params[match.param]
    if match.kind == "other":
        what = "adafactor placeholder" if match.adafactor and shape == (1,) else f"shape {shape}"
        return replicated(f"{what} beside {param.path}: replicated")
    assert plan is not None and param.shape is not None
    rule = None if plan.rule is None else plan.rule.pattern
    if match.kind == "mirror":
        return rule, plan.expression, plan.layout, f"mirrors {param.path}"
    candidates = [(axis, _reduce_expression(plan.layout, axis)) for axis in match.axes]
    axis, expression = candidates[0]
    layout = compile_layout(expression, rank, count)
    origin = f"adafactor {match.adafactor} of" if match.adafactor else "reduces"
    indices = layout.indices(shape)
    if any(compile_layout(e, rank, count).indices(shape) != indices for _, e in candidates[1:]):
        axes = " or ".join(str(a) for a, _ in candidates)
        return replicated(f"{origin} {param.path}, axis {axes} (ambiguous): replicated")
    note = f"{origin} {param.path} (axis {axis} reduced)"
    if layout.replication == count and plan.layout.replication != count:
        note += ": replicated"
    return rule, expression, layout, note


def _reduce_expression(layout: Layout, axis: int) -> str:
    """The expression of ``layout`` for the array with ``axis`` removed: the other axes as before.

    The removed axis's name leaves both sides; its element, if it had a count
    or a star, stays as a standalone count, so the device mesh is unchanged.
    """
    expression = layout.expression
    element = layout.axis_elements[axis]
    if element is None:  # under '...': one axis fewer there
        return str(expression)
    name = expression.right[element].name
    left = [str(e) for e in expression.left if e.name != name]
    right = []
    for e in expression.right:
        if e.name != name or e.is_ellipsis:
            right.append(str(e))
        elif e.count is not None or e.star:
            right.append(f"{'' if e.count is None else e.count}{'*' if e.star else ''}")
    text = f"{' '.join(left)} -> {' '.join(right)}".strip()
    parse(text)  # a derived expression is well formed by construction; fail loudly if not
    return text
