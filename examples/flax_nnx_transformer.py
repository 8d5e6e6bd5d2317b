"""A small decoder-only transformer in Flax NNX, tensor- and data-parallel on 8 simulated CPU devices.

The model is built from Flax's own layers (``nnx.Embed``,
``nnx.MultiHeadAttention``, ``nnx.Linear``, ``nnx.LayerNorm``) and knows nothing
about sharding. A rule table lays it out on 2 × 4 devices: every weight is
copied twice (the standalone ``2``, the data-parallel axis) and split four
ways (the ``*``, the rest of the devices) over attention heads and the MLP's
hidden axis, Megatron style; the batch is split over the same ``2`` and
copied over the ``*``. The model and its adamw state are born sharded, then
trained a few steps on a synthetic task (count upwards, modulo the vocabulary).

Run with ``python examples/flax_nnx_transformer.py``.
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import einshard
from einshard.integrations.flax import create_sharded, shard_module, state_tree

VOCAB, D_MODEL, HEADS, D_FF, LAYERS = 64, 64, 8, 256, 2
SEQ, BATCH, STEPS = 16, 16, 25

# 2 × 4: the '2' copies a weight over the data-parallel axis, the '*' splits it over the other 4 devices.
RULES = einshard.Rules(
    [
        (r"attn/(query|key|value)/kernel$", "d h k -> 2 d h* k"),  # split the heads...
        (r"attn/(query|key|value)/bias$", "h k -> 2 h* k"),
        (r"attn/out/kernel$", "h k d -> 2 h* k d"),  # ...and sum them in the output projection
        (r"mlp_in/kernel$", "d f -> 2 d f*"),  # split the MLP's hidden axis...
        (r"mlp_in/bias$", "f -> 2 f*"),
        (r"mlp_out/kernel$", "f d -> 2 f* d"),  # ...in both weights
        (r"head/kernel$", "d v -> 2 d v*"),  # split the vocabulary of the logits
        (r"head/bias$", "v -> 2 v*"),
        (r".*", "... -> * ..."),  # embeddings, layer norms, residual biases: replicated
    ]
)
BATCH_EXPRESSION = "b t -> b2 t *"  # split the batch over the '2', copy it over the '*'


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D_MODEL, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.mlp_in = nnx.Linear(D_MODEL, D_FF, rngs=rngs)
        self.mlp_out = nnx.Linear(D_FF, D_MODEL, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.position = nnx.Embed(SEQ, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.head = nnx.Linear(D_MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    def loss_fn(model: Transformer) -> jax.Array:
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    # Inside nnx.jit, sharding constraints: every variable keeps its rule's layout through the step
    # (XLA would otherwise re-lay some, and the next step would compile again).
    shard_module((model, optimizer), RULES)
    return loss


def batch(step: int) -> jax.Array:
    """Sequences that count upwards modulo the vocabulary, from random starts, placed by the batch rule."""
    starts = np.random.default_rng(step).integers(0, VOCAB, size=(BATCH, 1))
    tokens = (starts + np.arange(SEQ + 1)) % VOCAB
    return einshard.einshard(tokens.astype(np.int32), BATCH_EXPRESSION)


def main() -> None:
    print(f"{jax.device_count()} devices\n")
    model = create_sharded(Transformer, RULES, nnx.Rngs(0))  # never whole on one device
    optimizer = create_sharded(nnx.Optimizer, RULES, model, optax.adamw(3e-3), wrt=nnx.Param)
    print(einshard.explain(state_tree(model), RULES))

    # Check the layouts against the rules: the weights and the adamw state that mirrors them.
    block = model.blocks[0]
    query = block.attn.query.kernel[...]
    assert query.sharding.is_equivalent_to(einshard.make_sharding("d h k -> 2 d h* k", n_dims=3), 3)
    mu = optimizer.opt_state[0].mu["blocks"][0]["mlp_in"]["kernel"][...]
    assert mu.sharding.is_equivalent_to(block.mlp_in.kernel[...].sharding, 2)
    shard = query.addressable_shards[0].data.shape
    print(f"\nquery kernel {query.shape}: each device holds {shard} (heads split 4 ways, copied twice)")

    losses = [float(train_step(model, optimizer, batch(step))) for step in range(STEPS)]
    print("losses:", " ".join(f"{loss:.3f}" for loss in losses))
    if not losses[-1] < losses[0] / 2:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
