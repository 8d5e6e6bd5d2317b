"""Tensor parallelism for a 2-layer MLP, on 8 simulated CPU devices.

The tutorial's example: ``Z = relu(X @ W1) @ W2``. Splitting the hidden axis
``y`` of both weights over all devices makes each device compute its slice of
``Y`` with no communication, and the second matmul, which reduces over ``y``,
ends in a single all-reduce. The model code does not change.

Run with ``python examples/mlp_tensor_parallel.py``.
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import einshard
from einshard import einshard as shard


class Params(NamedTuple):
    W1: jax.Array
    W2: jax.Array


def init_params(key: jax.Array) -> Params:
    k1, k2 = jax.random.split(key)
    return Params(jax.random.normal(k1, (128, 256)), jax.random.normal(k2, (256, 64)))


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


if __name__ == "__main__":
    main()
