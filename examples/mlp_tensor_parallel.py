"""Tensor parallelism for a 2-layer MLP, on 8 simulated CPU devices.

The tutorial's example: ``Z = relu(X @ W1) @ W2``. Splitting the hidden axis
``y`` of both weights over all devices makes each device compute its slice of
``Y`` with no communication, and the second matmul, which reduces over ``y``,
ends in a single all-reduce. The model code does not change.

Then a few AdamW steps on synthetic data, with the optimizer state born
sharded like the weights it mirrors, against the same steps on one device.

Run with ``python examples/mlp_tensor_parallel.py`` (needs the ``pictures``
and ``optax`` extras: ``pip install '.[pictures,optax]'`` in einshard's source folder).
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import einshard
from einshard import einshard as shard
from einshard.integrations.optax import init_opt_state


class Params(NamedTuple):
    W1: jax.Array
    W2: jax.Array


def init_params(key: jax.Array) -> Params:
    """Scaled by fan-in, as a layer library would, so activations and losses start near 1."""
    k1, k2 = jax.random.split(key)
    return Params(
        W1=jax.nn.initializers.he_normal()(k1, (128, 256)),  # followed by relu
        W2=jax.nn.initializers.lecun_normal()(k2, (256, 64)),
    )


def shard_params(params: Params) -> Params:
    return Params(
        W1=shard(params.W1, "x y -> x y*"),  # split the hidden axis y...
        W2=shard(params.W2, "y z -> y* z"),  # ...in both weights
    )


@jax.jit
def forward(params: Params, x: jax.Array) -> jax.Array:
    y = jax.nn.relu(x @ params.W1)
    return y @ params.W2


def count_collectives(params: Params, x: jax.Array) -> dict[str, int]:
    hlo = forward.lower(params, x).compile().as_text()
    return {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in ("all-reduce", "all-gather")}


def loss_fn(params: Params, x: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((forward(params, x) - target) ** 2)


def train(params: Params, x: jax.Array, target: jax.Array, steps: int) -> tuple[Params, list[float]]:
    """AdamW steps; the optimizer state starts with the layout of ``params``."""
    tx = optax.adamw(1e-2)
    state = init_opt_state(tx, params)  # mu and nu born sharded like W1 and W2

    def train_step(params: Params, state: optax.OptState) -> tuple[Params, optax.OptState, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    # The outputs that are the next step's inputs keep their layouts (and the step compiles once).
    step = jax.jit(train_step, out_shardings=(*einshard.shardings_of((params, state)), None))

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return params, losses


def main() -> None:
    key_params, key_x = jax.random.split(jax.random.key(42))
    params = init_params(key_params)
    x = jax.random.normal(key_x, (8, 128))
    expected = forward(params, x)  # on one device

    sharded = shard_params(params)
    x_replicated = shard(x, "... -> * ...")
    out = forward(sharded, x_replicated)

    print(f"{jax.device_count()} devices\n")
    print("W1 (128, 256), 'x y -> x y*':")
    einshard.visualize("x y -> x y*", sharded.W1.shape, devices=jax.devices())
    print("\nW2 (256, 64), 'y z -> y* z':")
    einshard.visualize("y z -> y* z", sharded.W2.shape, devices=jax.devices())

    # The pictures are drawn from the expressions; check them against the arrays' own layouts.
    for array, expression in ((sharded.W1, "x y -> x y*"), (sharded.W2, "y z -> y* z")):
        assert array.sharding.is_equivalent_to(einshard.make_sharding(expression, n_dims=2), 2)

    collectives = count_collectives(sharded, x_replicated)
    print(f"\nforward pass: {collectives['all-reduce']} all-reduce, {collectives['all-gather']} all-gather")
    error = float(jnp.max(jnp.abs(out - expected)))
    same = np.allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-4)
    print(f"output {out.shape}: sharded == unsharded: {same} (max abs difference {error:.2e})")
    if not same:
        raise SystemExit("the sharded result differs from the unsharded one")

    # Training: the same 5 AdamW steps, sharded and on one device.
    target = jax.random.normal(jax.random.key(7), out.shape)
    trained, losses = train(sharded, x_replicated, shard(target, "... -> * ..."), steps=5)
    _, reference = train(params, x, target, steps=5)
    print("\nAdamW, loss per step (sharded):  ", " ".join(f"{loss:.4f}" for loss in losses))
    print("AdamW, loss per step (1 device): ", " ".join(f"{loss:.4f}" for loss in reference))
    still = trained.W1.sharding.is_equivalent_to(sharded.W1.sharding, 2)
    print(f"W1 keeps its layout through training: {still}")
    if not (np.allclose(losses, reference, rtol=1e-4) and losses[-1] < losses[0] and still):
        raise SystemExit("sharded training does not match training on one device")


if __name__ == "__main__":
    main()
