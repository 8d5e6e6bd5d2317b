"""Training steps over a table mixing full splits and partial replication keep their layouts.

The model is a small grouped-query attention block: the query heads are split over
all devices, the two key/value heads are split two ways and copied over the rest
(the "KV-head" layout, ``... k2 ... *``), the output projection is row-parallel
and the norm is replicated. For Flax linen (``create_train_state`` and a jitted
``apply_gradients``), Flax NNX (``nnx.Optimizer`` under ``nnx.jit``) and Equinox
(``eqx.filter_jit`` with optax), each checks that the step runs, that its losses
equal one device's, that every leaf keeps its rule's layout, and that the second
step does not compile again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from conftest import N_DEVICES  # type: ignore[import-not-found]

optax = pytest.importorskip("optax")

D, HEAD = 16, 4
HEADS = 2 * N_DEVICES  # query heads: split over every device
KV_HEADS = 2  # key/value heads: split 2, copied over the rest
STEPS = 3
LEARNING_RATE = 1e-2

# Flax's kernels are (in, heads, head) etc.: queries split over all devices, the two KV heads
# split 2 and copied over the rest, the output row-parallel, the norm replicated.
FLAX_RULES = [
    (r"q/kernel$", "d h k -> d h* k"),
    (r"q/bias$", "h k -> h* k"),
    (r"kv/kernel$", "d c k h -> d c k2 h *"),
    (r"kv/bias$", "c k h -> c k2 h *"),
    (r"o/kernel$", "h k d -> h* k d"),
    (r".*", "... -> * ..."),
]

_COMPILES = [0]


def _count(event: str, duration: float, **kwargs: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, D)).astype(np.float32), rng.normal(size=(8, D)).astype(np.float32)


def _attention(x, q, kv, out, norm):
    """``q``: (B, H, hd); ``kv``: (B, 2, KV, hd); ``out`` maps (B, H, hd) to (B, D)."""
    k, v = kv[:, 0], kv[:, 1]
    k = jnp.repeat(k, HEADS // KV_HEADS, axis=1)
    v = jnp.repeat(v, HEADS // KV_HEADS, axis=1)
    scores = jax.nn.sigmoid(jnp.einsum("bhd,bhd->bh", q, k) / HEAD)
    return norm(out(v * scores[..., None]) + x)


def _layouts(tree) -> dict[str, dict]:
    """Each array leaf's device → index map, by path: the layout itself, not its spelling."""
    return {
        jax.tree_util.keystr(path): leaf.sharding.devices_indices_map(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(leaf, jax.Array)
    }


def _assert_kept(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    changed = [path for path in before if before[path] != after[path]]
    assert not changed, f"layouts changed by the step: {changed[:5]}"


def _assert_mixed(layouts: dict[str, dict]) -> None:
    """The table really mixes: the KV weight is split 2 ways (so copied over N/2 devices), and
    the query weight over all N."""
    for name, blocks in (("kv", 2), ("q", N_DEVICES)):
        kernel = next(
            m for path, m in layouts.items() if f"{name}']" in path or f".{name}." in path if "mu" not in path
        )
        found = {tuple((s.start, s.stop) for s in index) for index in kernel.values()}
        assert len(found) == blocks, (name, found)


# --- Flax linen -----------------------------------------------------------------------------


def test_linen_train_state_step_keeps_layouts_and_matches_one_device():
    nn = pytest.importorskip("flax.linen")
    from einshard.integrations.flax import create_train_state

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            q = nn.DenseGeneral((HEADS, HEAD), name="q")(x)
            kv = nn.DenseGeneral((2, KV_HEADS, HEAD), name="kv")(x)
            out = nn.DenseGeneral(D, axis=(-2, -1), name="o")
            return _attention(x, q, kv, out, nn.LayerNorm(name="norm"))

    rules = FLAX_RULES
    x, y = _data()
    tx = optax.adamw(LEARNING_RATE)
    state = create_train_state(Block(), rules, tx, jax.random.key(0), x)

    def train_step(state, x, y):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    # The one line that keeps the rules' layouts through the step.
    step = jax.jit(train_step, out_shardings=(einshard.shardings_of(state), None))
    reference = jax.jit(train_step)
    single = jax.device_put(state, jax.devices()[0])

    before = _layouts(state)
    _assert_mixed(before)
    losses, reference_losses = [], []
    for i in range(STEPS):
        compiled_before = _COMPILES[0]
        state, loss = step(state, x, y)
        if i == 0:
            assert _COMPILES[0] > compiled_before  # the listener sees compiles at all
        else:
            assert _COMPILES[0] == compiled_before, f"step {i + 1} compiled again"
        single, reference_loss = reference(single, x, y)
        losses.append(float(loss))
        reference_losses.append(float(reference_loss))
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=1e-6)
    _assert_kept(before, _layouts(state))
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_plain_jit_relays_some_leaves_which_shardings_of_prevents():
    """Why the line is needed: without out_shardings, XLA re-lays replicated leaves."""
    params = einshard.shard_pytree(
        {"w": jnp.ones((8, 4 * N_DEVICES)), "scale": jnp.ones(4 * N_DEVICES)},
        [("w", "x y -> x y*"), ("scale", "... -> * ...")],
    )

    def step(params):
        return {"w": params["w"] * params["scale"], "scale": params["scale"] + params["w"].sum(0)}

    plain = jax.jit(step)(params)
    kept = jax.jit(step, out_shardings=einshard.shardings_of(params))(params)
    assert params["scale"].sharding.is_fully_replicated
    if N_DEVICES > 1:
        assert not plain["scale"].sharding.is_fully_replicated  # XLA chose to split it
    _assert_kept(_layouts(params), _layouts(kept))
    np.testing.assert_array_equal(np.asarray(kept["scale"]), np.asarray(plain["scale"]))


@pytest.mark.parametrize("kind", ["arrays", "structs"])
def test_shardings_of_reads_every_placed_leaf_and_none_elsewhere(kind):
    expressions = {"w": "x y -> x y*", "b": "... -> * ...", "e": "v d -> v2 d *"}
    shapes = {"w": (8, 4 * N_DEVICES), "b": (4 * N_DEVICES,), "e": (6, 4)}
    placed = einshard.shard_pytree(
        {name: jnp.ones(shape) for name, shape in shapes.items()},
        [(f"^{name}$", expression) for name, expression in expressions.items()],
    )
    if kind == "structs":  # abstract leaves carrying shardings, as for a born-sharded init
        placed = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in placed.items()}
    tree = {**placed, "step": 3, "host": np.ones(2), "nothing": None}
    got = einshard.shardings_of(tree)
    assert jax.tree.structure(got, is_leaf=lambda x: x is None) == jax.tree.structure(
        tree, is_leaf=lambda x: x is None
    )
    for name, expression in expressions.items():
        expected = einshard.make_sharding(expression, shape=shapes[name])
        assert got[name] == expected, name
        assert got[name].devices_indices_map(shapes[name]) == expected.devices_indices_map(shapes[name])
    assert got["step"] is None and got["host"] is None and got["nothing"] is None


# --- Flax NNX ---------------------------------------------------------------------------------


def test_nnx_optimizer_step_keeps_layouts_and_matches_one_device():
    nnx = pytest.importorskip("flax.nnx")
    from einshard.integrations.flax import create_sharded, shard_module

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.LinearGeneral(D, (HEADS, HEAD), rngs=rngs)
            self.kv = nnx.LinearGeneral(D, (2, KV_HEADS, HEAD), rngs=rngs)
            self.o = nnx.LinearGeneral((HEADS, HEAD), D, axis=(-2, -1), rngs=rngs)
            self.norm = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, x):
            return _attention(x, self.q(x), self.kv(x), self.o, self.norm)

    rules = FLAX_RULES
    x, y = _data()

    def make(placed: bool):
        model = create_sharded(Block, rules, nnx.Rngs(0)) if placed else Block(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
        if placed:
            shard_module(optimizer, rules)
        return model, optimizer

    def train_step(model, optimizer, keep: bool):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        if keep:
            # The one line that keeps the rules' layouts: inside nnx.jit, constraints.
            shard_module((model, optimizer), rules)
        return loss

    step = nnx.jit(train_step, static_argnums=2)
    model, optimizer = make(placed=True)
    single_model, single_optimizer = make(placed=False)
    before = _layouts(nnx.state((model, optimizer)))
    _assert_mixed(before)
    losses, reference_losses = [], []
    for i in range(STEPS):
        compiled_before = _COMPILES[0]
        losses.append(float(step(model, optimizer, True)))
        if i == 0:
            assert _COMPILES[0] > compiled_before
        else:
            assert _COMPILES[0] == compiled_before, f"step {i + 1} compiled again"
        reference_losses.append(float(step(single_model, single_optimizer, False)))
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=1e-6)
    _assert_kept(before, _layouts(nnx.state((model, optimizer))))


# --- Equinox ----------------------------------------------------------------------------------


def test_equinox_filter_jit_step_keeps_layouts_and_matches_one_device():
    eqx = pytest.importorskip("equinox")
    from einshard.integrations.optax import init_opt_state

    class Block(eqx.Module):
        q: eqx.nn.Linear
        kv: eqx.nn.Linear
        o: eqx.nn.Linear
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            kq, kkv, ko = jax.random.split(key, 3)
            self.q = eqx.nn.Linear(D, HEADS * HEAD, key=kq)
            self.kv = eqx.nn.Linear(D, 2 * KV_HEADS * HEAD, key=kkv)
            self.o = eqx.nn.Linear(HEADS * HEAD, D, key=ko)
            self.norm = eqx.nn.LayerNorm(D)

        def __call__(self, x):
            q = jax.vmap(self.q)(x).reshape(-1, HEADS, HEAD)
            kv = jax.vmap(self.kv)(x).reshape(-1, 2, KV_HEADS, HEAD)
            out = jax.vmap(lambda h: self.o(h.reshape(-1)))
            return _attention(x, q, kv, out, jax.vmap(self.norm))

    # Equinox weights are (out, in); kv's rows are (c, k, h) flattened: split 2 = one KV head each.
    rules = [
        (r"q/weight$", "o i -> o* i"),
        (r"q/bias$", "o -> o*"),
        (r"kv/weight$", "o i -> o2 i *"),
        (r"kv/bias$", "o -> o2 *"),
        (r"o/weight$", "o i -> o i*"),
        (r".*", "... -> * ..."),
    ]
    x, y = _data()
    tx = optax.adamw(LEARNING_RATE)
    model = einshard.shard_pytree(Block(jax.random.key(0)), rules)
    opt_state = init_opt_state(tx, eqx.filter(model, eqx.is_array))
    keep = einshard.shardings_of((model, opt_state))

    @eqx.filter_jit
    def step(model, opt_state, x, y, keep):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        if keep is not None:
            # The one line that keeps the layouts: Equinox's own constraint, einshard's shardings.
            model, opt_state = eqx.filter_shard((model, opt_state), keep)
        return model, opt_state, loss

    single = jax.device_put(Block(jax.random.key(0)), jax.devices()[0])
    single_state = tx.init(eqx.filter(single, eqx.is_array))
    before = _layouts((model, opt_state))
    _assert_mixed(before)
    losses, reference_losses = [], []
    for i in range(STEPS):
        compiled_before = _COMPILES[0]
        model, opt_state, loss = step(model, opt_state, x, y, keep)
        if i == 0:
            assert _COMPILES[0] > compiled_before
        else:
            assert _COMPILES[0] == compiled_before, f"step {i + 1} compiled again"
        single, single_state, reference_loss = step(single, single_state, x, y, None)
        losses.append(float(loss))
        reference_losses.append(float(reference_loss))
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=1e-6)
    _assert_kept(before, _layouts((model, opt_state)))
