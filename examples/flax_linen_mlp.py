"""A Flax linen MLP with a ``TrainState``, tensor- and data-parallel on 8 simulated CPU devices.

The model is plain linen and knows nothing about sharding. A rule table lays
it out on 2 × 4 devices: each weight is copied twice (the standalone ``2``,
the data-parallel axis) and its hidden axis split four ways (the ``*``, the
rest of the devices), Megatron style; the batch is split over the same ``2``.
The ``TrainState`` is born sharded, its adamw state laid out like the
parameters it mirrors, and trained a few steps on a synthetic regression task.

Run with ``python examples/flax_linen_mlp.py``.
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import einshard
from einshard.integrations.flax import create_train_state

D_IN, HIDDEN, D_OUT, BATCH, STEPS = 32, 512, 8, 64, 30

# 2 × 4: the '2' copies a weight over the data-parallel axis, the '*' splits it over the other 4 devices.
# Rules match paths like 'params/Dense_0/kernel', and, by their ends, the optimizer state mirroring them.
RULES = einshard.Rules(
    [
        (r"Dense_0/kernel$", "x y -> 2 x y*"),  # split the hidden axis y...
        (r"Dense_0/bias$", "y -> 2 y*"),
        (r"Dense_1/kernel$", "y z -> 2 y* z"),  # ...in both weights
        (r".*", "... -> * ..."),  # the output bias, step and counts: replicated
    ]
)
BATCH_EXPRESSION = "b f -> b2 f *"  # split the batch over the '2', copy it over the '*'


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Dense(HIDDEN)(x))  # Dense_0
        return nn.Dense(D_OUT)(h)  # Dense_1


def train_step(state: TrainState, x: jax.Array, y: jax.Array) -> tuple[TrainState, jax.Array]:
    def loss_fn(params: dict) -> jax.Array:
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def main() -> None:
    print(f"{jax.device_count()} devices\n")
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)  # the function to learn

    def batch() -> tuple[jax.Array, jax.Array]:
        x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
        y = np.tanh(x @ teacher)
        return einshard.einshard(x, BATCH_EXPRESSION), einshard.einshard(y, BATCH_EXPRESSION)

    sample = jnp.zeros((1, D_IN))
    state = create_train_state(MLP(), RULES, optax.adamw(3e-3), jax.random.key(0), sample)
    print(einshard.explain(state, RULES))

    kernel = state.params["Dense_0"]["kernel"]
    mu = state.opt_state[0].mu["Dense_0"]["kernel"]
    assert kernel.sharding.is_equivalent_to(einshard.make_sharding("x y -> 2 x y*", n_dims=2), 2)
    assert mu.sharding.is_equivalent_to(kernel.sharding, 2)
    shard = kernel.addressable_shards[0].data.shape
    print(f"\nDense_0 kernel {kernel.shape}: each device holds {shard}, and the same of adamw's mu and nu")

    # out_shardings keeps every leaf on its rule's layout through the step (XLA would otherwise
    # re-lay some, and the next step would compile again).
    step = jax.jit(train_step, out_shardings=(einshard.shardings_of(state), None))
    before = einshard.shardings_of(state)
    losses = []
    for _ in range(STEPS):
        state, loss = step(state, *batch())
        losses.append(float(loss))
    assert einshard.shardings_of(state) == before  # every leaf kept its layout
    print("losses:", " ".join(f"{loss:.3f}" for loss in losses))
    if not losses[-1] < losses[0] / 2:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
