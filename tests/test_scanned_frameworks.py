"""Scanned models written with Flax (linen ``nn.scan``, NNX ``nnx.scan``) and Equinox, kept split.

Each framework's scan is a ``jax.lax.scan`` underneath: under FSDP, a plain table that splits the
batch gives a program that all-reduces the whole batch's activations in every layer (the
finding ``activations reduced in a loop``); the strategy itself as ``rules=`` keeps the carry in
the batch's layout (the report's loops say where, forward and backward) and reduces none;
``einshard.like_batch`` in the layer's body gives the same program, and without any strategy the
model that calls it computes what it computed before. The loops and findings name this file's
lines, never the framework's.

At a small batch (the activations smaller than the MLP's weights), the carry kept, XLA's
partitioner still moves activations in the loop: it keeps the weights' split and gathers the
activations (tensor parallelism's program, per matmul). The report does not tell the user to
add the ``like_batch`` the body already has: it names what the partitioner did
(``activations gathered in place of weights``), counts the all-reduces a reduce-scatter would do,
and ``like_batch`` on the MLP's hidden activation, as its fix says, gathers the weights instead.
"""

from __future__ import annotations

from pathlib import Path

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
    (finding,) = [f for f in plain.findings if f.kind == "activations reduced in a loop"]
    assert finding.sources and all(s.startswith("test_scanned_frameworks.py:") for s in finding.sources)
    assert [(loop.backward, loop.constrained) for loop in kept.batch_loops] == [(False, 1), (True, 1)]
    assert all(loop.source.startswith("test_scanned_frameworks.py:") for loop in kept.batch_loops)
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


def linen_model(marked: bool, hidden_marked: bool = False, mlp: int = F):
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            if marked:
                x = einshard.like_batch(x)
            h = jnp.tanh(nn.Dense(mlp)(x))  # the hidden activation
            if hidden_marked:
                h = einshard.like_batch(h)
            return x + nn.Dense(H)(h), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(V, H)(tokens)
            blocks = nn.scan(
                nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=L
            )
            x, _ = blocks()(x, None)  # the loop
            return nn.Dense(V)(x)

    return Model()


def linen_step(module):
    def step(params, batch):
        grads = jax.grad(lambda p: cross_entropy(module.apply({"params": p}, batch), batch))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def line_of(text: str) -> str:
    """This file's line ending with ``text`` (one), as reports write it."""
    source = Path(__file__).read_text(encoding="utf-8").splitlines()
    lines = [i for i, line in enumerate(source, 1) if line.endswith(text)]
    assert len(lines) == 1, text
    return f"test_scanned_frameworks.py:{lines[0]}"


def test_flax_linen_nn_scan_is_kept_split():
    pytest.importorskip("flax")
    model, marked = linen_model(False), linen_model(True)
    params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]
    check(linen_step(model), params, linen_step(marked))
    # Outside any strategy, the marked model is the model: it runs on one device as written.
    real = model.init(jax.random.key(0), TOKENS)
    assert jnp.allclose(model.apply(real, TOKENS), marked.apply(real, TOKENS))


def test_kept_loops_that_still_move_activations_are_named_for_what_the_partitioner_did():
    """An MLP 16 times the hidden size: each layer's activations (B x S x H) are smaller than its
    weights (H x 4F), and the partitioner keeps the weights' split. The loops are the model's
    (its like_batch), no finding says to add it; the one finding names the loop's line, counts
    the all-reduces each device slices (half their bytes), and its alternative applied (like_batch
    on the hidden activation, at the matmul's line it names) moves no activation in the loop: the
    weights are gathered instead, which sends more at these sizes, as the finding warns. Without
    the model's like_batch and with a plain table, the program and the finding are the same: it
    does not tell the user to keep a carry whose constraint would change nothing."""
    pytest.importorskip("flax")
    mlp = 4 * F
    marked, hidden = linen_model(True, mlp=mlp), linen_model(True, hidden_marked=True, mlp=mlp)
    params = jax.eval_shape(marked.init, jax.random.key(0), TOKENS)["params"]
    report = einshard.explain_step(linen_step(marked), params, TOKENS, rules=FSDP)
    assert [(loop.backward, loop.constrained_by) for loop in report.batch_loops] == [
        (False, "model"),
        (True, "model"),
    ]
    loop = line_of("x, _ = blocks()(x, None)  # the loop")
    assert {loop.source for loop in report.batch_loops} == {loop}
    assert "activations reduced in a loop" not in [f.kind for f in report.findings]
    (finding,) = [f for f in report.findings if f.kind == "activations gathered in place of weights"]
    assert finding.sources == (loop,)
    moved = [report.rows[p] for p in finding.rows]
    assert moved and all(row.param is None and row.times == L and B in row.shape for row in moved)
    sliced = [row for row in moved if row.kind == "all-reduce"]
    assert finding.bytes == sum(row.traffic - round((N - 1) / N * row.bytes) * row.times for row in sliced)
    assert f"after the matmul at {line_of('(x))  # the hidden activation')}" in finding.fix
    assert "target='h100'" in finding.fix
    # Without the model's like_batch, under the table written out: the loop's program is the same
    # (the partitioner moves the smaller operand either way), and so is the finding, which says
    # that keeping the carry changes nothing.
    plain = einshard.explain_step(linen_step(linen_model(False, mlp=mlp)), params, TOKENS, rules=PLAIN)
    assert not plain.batch_loops
    assert "activations reduced in a loop" not in [f.kind for f in plain.findings]
    (same,) = [f for f in plain.findings if f.kind == finding.kind]
    assert (same.bytes, same.sources) == (finding.bytes, finding.sources)
    assert [(r.kind, r.shape, r.times) for r in map(plain.rows.__getitem__, same.rows)] == [
        (r.kind, r.shape, r.times) for r in moved
    ]
    assert "does not change this" in same.cause
    # The alternative the fix gives, applied: the weights gathered in the loop, no activation moved.
    after = einshard.explain_step(linen_step(hidden), params, TOKENS, rules=FSDP)
    assert not [row for row in after.rows if row.param is None and row.times > 1 and B in row.shape]
    assert "activations gathered in place of weights" not in [f.kind for f in after.findings]
    gathered = [row for row in after.rows if row.kind == "all-gather" and row.times == L]
    assert {row.shape for row in gathered} >= {(H, mlp), (mlp, H)}
    assert after.traffic > report.traffic  # the partitioner moved the smaller operand


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
