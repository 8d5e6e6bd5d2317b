"""Scanned models written with Flax (linen ``nn.scan``, NNX ``nnx.scan``) and Equinox, kept split.

Each framework's scan is a ``jax.lax.scan`` underneath: under FSDP, a plain table that splits the
batch gives a program that all-reduces the whole batch's activations in every layer (the
finding ``activations reduced in a loop``); the strategy itself as ``rules=`` keeps the carry in
the batch's layout (the report's loops say where, forward and backward) and reduces none;
``einshard.like_batch`` in the layer's body gives the same program, and without any strategy the
model that calls it computes what it computed before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import einshard

N = len(jax.devices())
# Every weight's axes divide by the device count, so FSDP splits them at 6 devices as at 8.
B, S, V, H, F, L = 2 * N, 8, 8 * N, 4 * N, 8 * N, 3
TOKENS = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) % V
FSDP = einshard.strategies.fsdp(min_bytes=0)
PLAIN = einshard.Rules([("^batch(/|$)", "b ... -> b* ..."), *FSDP.pairs()])

pytestmark = pytest.mark.skipif(N == 1, reason="one device: nothing to split")


def reduced_in_loop(report):
    return [
        row for row in report.rows if row.kind == "all-reduce" and row.times > 1 and row.shape[:1] == (B,)
    ]


def check(step, state, marked_step=None):
    """The plain table reduces activations in the loop and names it; the strategy does not."""
    plain = einshard.explain_step(step, state, TOKENS, rules=PLAIN)
    kept = einshard.explain_step(step, state, TOKENS, rules=FSDP)
    assert reduced_in_loop(plain), "the partitioner kept the batch split: nothing to show"
    assert "activations reduced in a loop" in [f.kind for f in plain.findings]
    assert [(loop.backward, loop.constrained) for loop in kept.batch_loops] == [(False, 1), (True, 1)]
    assert not reduced_in_loop(kept)
    assert "activations reduced in a loop" not in [f.kind for f in kept.findings]
    assert kept.traffic < plain.traffic and kept.peak_bytes <= plain.peak_bytes
    if marked_step is not None:
        marked = einshard.explain_step(marked_step, state, TOKENS, rules=FSDP)
        assert marked.bytes_by_kind == kept.bytes_by_kind and marked.peak_bytes == kept.peak_bytes
    return plain, kept


def cross_entropy(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, (tokens + 1) % V).mean()


# --- Flax linen: nn.scan over a remat'd block ------------------------------------------------------


def linen_model(marked: bool):
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            if marked:
                x = einshard.like_batch(x)
            return x + nn.Dense(H)(jnp.tanh(nn.Dense(F)(x))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(V, H)(tokens)
            blocks = nn.scan(
                nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=L
            )
            x, _ = blocks()(x, None)
            return nn.Dense(V)(x)

    return Model()


def test_flax_linen_nn_scan_is_kept_split():
    pytest.importorskip("flax")
    model, marked = linen_model(False), linen_model(True)
    params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]

    def steps(module):
        def step(params, batch):
            grads = jax.grad(lambda p: cross_entropy(module.apply({"params": p}, batch), batch))(params)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

        return step

    check(steps(model), params, steps(marked))
    # Outside any strategy, the marked model is the model: it runs on one device as written.
    real = model.init(jax.random.key(0), TOKENS)
    assert jnp.allclose(model.apply(real, TOKENS), marked.apply(real, TOKENS))


# --- Flax NNX: nnx.scan over blocks made by nnx.vmap -----------------------------------------------


def test_flax_nnx_scan_is_kept_split():
    pytest.importorskip("flax")
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(H, F, rngs=rngs)
            self.down = nnx.Linear(F, H, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, H, rngs=rngs)

            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(rngs)

            self.blocks = blocks(rngs)
            self.head = nnx.Linear(H, V, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def forward(x, block):
                return block(x)

            return self.head(forward(self.embed(tokens), self.blocks))

    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    def step(state, batch):
        grads = jax.grad(lambda s: cross_entropy(nnx.merge(graphdef, s)(batch), batch))(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    check(step, state)


# --- Equinox: a scan over stacked layers -----------------------------------------------------------


def test_an_equinox_scan_over_stacked_layers_is_kept_split():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up = eqx.nn.Linear(H, F, key=k1)
            self.down = eqx.nn.Linear(F, H, key=k2)

        def __call__(self, x):
            return x + jax.vmap(jax.vmap(self.down))(jnp.tanh(jax.vmap(jax.vmap(self.up))(x)))

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: Block
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(V, H, key=k1)
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, L))  # stacked layers
            self.head = eqx.nn.Linear(H, V, key=k3)

        def __call__(self, tokens):
            x = jax.vmap(jax.vmap(self.embed))(tokens)
            params, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(x, block_params):
                return jax.checkpoint(lambda x, p: eqx.combine(p, static)(x))(x, block_params), None

            x, _ = jax.lax.scan(layer, x, params)
            return jax.vmap(jax.vmap(self.head))(x)

    model = Model(jax.random.key(0))  # small: real arrays
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, batch):
        grads = jax.grad(lambda p: cross_entropy(eqx.combine(p, static)(batch), batch))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    check(step, params)
