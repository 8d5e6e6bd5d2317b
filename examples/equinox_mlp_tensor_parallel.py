"""Tensor parallelism for the tutorial's 2-layer MLP, as decorated Equinox layers, on 8 simulated CPU devices.

``Z = relu(X @ W1) @ W2``, written with ``eqx.nn.Linear`` (whose weights are
``(out, in)``). Two decorated subclasses carry the layout: a column-parallel
layer splits its output features (the hidden axis) and a row-parallel one
splits its input features (the same hidden axis), so each device computes
its slice of the hidden activations with no communication and the second
matmul ends in a single all-reduce. The layers are placed when they are
built; the model itself knows nothing about sharding, and the decorators
compose into one rule table for ``einshard.explain``.

Then a few AdamW steps, with the optimizer state born sharded like the
weights it mirrors (``einshard.integrations.optax``), against the same steps
with plain ``eqx.nn.Linear`` layers on one device.

Run with ``python examples/equinox_mlp_tensor_parallel.py`` (needs equinox and optax).
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
from einshard.integrations.equinox import module_rules, sharded
from einshard.integrations.optax import init_opt_state


@sharded(weight="y x -> y* x", output="y -> y*")  # W1: split the hidden axis y (its rows here)...
class ColumnLinear(eqx.nn.Linear):
    """Column-parallel: each device computes a slice of the output features."""


@sharded(weight="z y -> z y*")  # ...and W2 along the same y (its columns)
class RowLinear(eqx.nn.Linear):
    """Row-parallel: each device sums over its slice of the input features; one all-reduce."""


class MLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]

    def __init__(self, key: jax.Array, column: type = ColumnLinear, row: type = RowLinear):
        k1, k2 = jax.random.split(key)
        self.layers = (column(128, 256, use_bias=False, key=k1), row(256, 64, use_bias=False, key=k2))

    def __call__(self, x: jax.Array) -> jax.Array:  # one example; batches go through jax.vmap
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


def loss_fn(model: MLP, x: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - target) ** 2)


def train(model: MLP, x: jax.Array, target: jax.Array, steps: int) -> tuple[MLP, list[float]]:
    """AdamW steps; the optimizer state starts with the layout of the model's weights."""
    tx = optax.adamw(1e-3)
    state = init_opt_state(tx, eqx.filter(model, eqx.is_array))  # mu and nu born sharded like W1, W2

    keep = einshard.shardings_of((model, state))  # the layouts to keep through every step

    @eqx.filter_jit
    def step(model: MLP, state: optax.OptState) -> tuple[MLP, optax.OptState, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, target)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        # Without this, XLA may re-lay some outputs, and the next step would compile again.
        model, state = eqx.filter_shard((eqx.apply_updates(model, updates), state), keep)
        return model, state, loss

    losses = []
    for _ in range(steps):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    return model, losses


def count_collectives(model: MLP, x: jax.Array) -> dict[str, int]:
    forward = jax.jit(lambda params, x: jax.vmap(eqx.combine(params, static))(x))
    params, static = eqx.partition(model, eqx.is_array)
    hlo = forward.lower(params, x).compile().as_text()
    return {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in ("all-reduce", "all-gather")}


def main() -> None:
    key_model, key_x, key_target = jax.random.split(jax.random.key(42), 3)
    model = MLP(key_model)  # placed as it is built
    reference = MLP(key_model, eqx.nn.Linear, eqx.nn.Linear)  # the same values, on one device
    x = jax.random.normal(key_x, (8, 128))
    target = jax.random.normal(key_target, (8, 64))

    print(f"{jax.device_count()} devices\n")
    rules = module_rules(model)
    print("the decorators compose into one table:", rules, sep="\n")
    print(einshard.explain(model, rules))
    for layer, expression in ((model.layers[0], "y x -> y* x"), (model.layers[1], "z y -> z y*")):
        expected = einshard.make_sharding(expression, shape=layer.weight.shape)
        assert layer.weight.sharding.is_equivalent_to(expected, 2)

    collectives = count_collectives(model, x)
    print(f"\nforward pass: {collectives['all-reduce']} all-reduce, {collectives['all-gather']} all-gather")
    out = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, x)
    expected = jax.vmap(reference)(x)
    same = np.allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-4)
    print(f"output {out.shape}: sharded == unsharded: {same}")
    if not same:
        raise SystemExit("the sharded result differs from the unsharded one")

    trained, losses = train(model, x, target, steps=5)
    _, reference_losses = train(reference, x, target, steps=5)
    print("\nAdamW, loss per step (sharded):  ", " ".join(f"{loss:.4f}" for loss in losses))
    print("AdamW, loss per step (1 device): ", " ".join(f"{loss:.4f}" for loss in reference_losses))
    still = trained.layers[0].weight.sharding.is_equivalent_to(model.layers[0].weight.sharding, 2)
    print(f"W1 keeps its layout through training: {still}")
    if not (np.allclose(losses, reference_losses, rtol=1e-4) and losses[-1] < losses[0] and still):
        raise SystemExit("sharded training does not match training on one device")


if __name__ == "__main__":
    main()
