"""A small decoder-only transformer in Equinox, tensor- and data-parallel on 8 simulated CPU devices.

The model is built from Equinox's own layers (``eqx.nn.Embedding``,
``eqx.nn.MultiheadAttention``, ``eqx.nn.Linear``, ``eqx.nn.LayerNorm``) and
knows nothing about sharding; like any Equinox model it is written for one
sequence and batched with ``jax.vmap``. A rule table over its field paths
(``blocks/0/attn/query_proj/weight``) lays it out on 2 × 4 devices: every
weight is copied twice (the standalone ``2``, the data-parallel axis) and
split four ways (the ``*``) over attention heads and the MLP's hidden axis,
Megatron style (Equinox weights are ``(out, in)``, and the heads are the
leading part of a projection's output features); the batch is split over the
same ``2`` and copied over the ``*``. The model and its adamw state are born
sharded, then trained a few steps on a synthetic task (count upwards, modulo
the vocabulary).

Run with ``python examples/equinox_transformer.py`` (needs equinox and optax).
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import einshard
from einshard.integrations.equinox import create_sharded
from einshard.integrations.optax import init_opt_state

VOCAB, D_MODEL, HEADS, D_FF, LAYERS = 64, 64, 8, 256, 2
SEQ, BATCH, STEPS = 16, 16, 25

# 2 × 4: the '2' copies a weight over the data-parallel axis, the '*' splits it over the other 4 devices.
RULES = einshard.Rules(
    [
        (r"attn/(query|key|value)_proj/weight$", "o i -> 2 o* i"),  # split the heads...
        (r"attn/output_proj/weight$", "o i -> 2 o i*"),  # ...and sum them in the output projection
        (r"mlp_in/weight$", "f d -> 2 f* d"),  # split the MLP's hidden axis...
        (r"mlp_in/bias$", "f -> 2 f*"),
        (r"mlp_out/weight$", "d f -> 2 d f*"),  # ...in both weights
        (r"head/weight$", "v d -> 2 v* d"),  # split the vocabulary of the logits
        (r"head/bias$", "v -> 2 v*"),
        (r".*", "... -> * ..."),  # embeddings, layer norms, residual biases: replicated
    ]
)
BATCH_EXPRESSION = "b t -> b2 t *"  # split the batch over the '2', copy it over the '*'


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k_attn, k_in, k_out = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(D_MODEL)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D_MODEL, key=k_attn)
        self.ln2 = eqx.nn.LayerNorm(D_MODEL)
        self.mlp_in = eqx.nn.Linear(D_MODEL, D_FF, key=k_in)
        self.mlp_out = eqx.nn.Linear(D_FF, D_MODEL, key=k_out)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # x: (SEQ, D_MODEL)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.nn.gelu(jax.vmap(self.mlp_in)(jax.vmap(self.ln2)(x)))
        return x + jax.vmap(self.mlp_out)(h)


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, LAYERS + 3)
        self.embed = eqx.nn.Embedding(VOCAB, D_MODEL, key=keys[0])
        self.position = eqx.nn.Embedding(SEQ, D_MODEL, key=keys[1])
        self.blocks = [Block(k) for k in keys[2:-1]]
        self.ln_f = eqx.nn.LayerNorm(D_MODEL)
        self.head = eqx.nn.Linear(D_MODEL, VOCAB, key=keys[-1])

    def __call__(self, tokens: jax.Array) -> jax.Array:  # one sequence: (SEQ,) -> (SEQ, VOCAB)
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.position)(jnp.arange(tokens.shape[0]))
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), dtype=bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def make_train_step(tx: optax.GradientTransformation, keep):
    """The step, keeping the layouts ``keep`` (from ``einshard.shardings_of``) through every call."""

    @eqx.filter_jit
    def train_step(model: Transformer, state: optax.OptState, tokens: jax.Array):
        def loss_fn(model: Transformer) -> jax.Array:
            logits = jax.vmap(model)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        # Without this, XLA may re-lay some outputs, and the next step would compile again.
        model, state = eqx.filter_shard((eqx.apply_updates(model, updates), state), keep)
        return model, state, loss

    return train_step


def batch(step: int) -> jax.Array:
    """Sequences that count upwards modulo the vocabulary, from random starts, placed by the batch rule."""
    starts = np.random.default_rng(step).integers(0, VOCAB, size=(BATCH, 1))
    tokens = (starts + np.arange(SEQ + 1)) % VOCAB
    return einshard.einshard(tokens.astype(np.int32), BATCH_EXPRESSION)


def main() -> None:
    print(f"{jax.device_count()} devices\n")
    model = create_sharded(Transformer, RULES, jax.random.key(0))  # never whole on one device
    tx = optax.adamw(3e-3)
    state = init_opt_state(tx, eqx.filter(model, eqx.is_array))  # adamw's mu and nu sharded like the weights
    print(einshard.explain(model, RULES))

    # Check the layouts against the rules: the weights and the adamw state that mirrors them.
    query = model.blocks[0].attn.query_proj.weight
    assert query.sharding.is_equivalent_to(einshard.make_sharding("o i -> 2 o* i", n_dims=2), 2)
    mu = state[0].mu.blocks[0].mlp_in.weight
    assert mu.sharding.is_equivalent_to(model.blocks[0].mlp_in.weight.sharding, 2)
    shard = query.addressable_shards[0].data.shape
    print(f"\nquery weight {query.shape}: each device holds {shard} (heads split 4 ways, copied twice)")

    train_step = make_train_step(tx, einshard.shardings_of((model, state)))
    losses = []
    for step in range(STEPS):
        model, state, loss = train_step(model, state, batch(step))
        losses.append(float(loss))
    print("losses:", " ".join(f"{loss:.3f}" for loss in losses))
    if not losses[-1] < losses[0] / 2:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
