"""The three bf16 GPT training steps measured on one H200 (``../shared/accelerators/h200-time``).

A copy of ``../shared/accelerators/gpu_time_mem.py``'s ``loss``, ``make_step`` and parameter
shapes (that script runs its measurement when imported), with the step a module-level function
so that it crosses into einshard's child process; everything is abstract (``ShapeDtypeStruct``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

CONFIGS = [
    (4, 1024, 4096, 32000, 8, 1024, 16),
    (8, 2048, 8192, 32000, 8, 2048, 16),
    (8, 4096, 16384, 32000, 4, 2048, 32),
]
"""``(layers, hidden, MLP, vocabulary, batch, sequence, heads)``, as in the measured script."""


def params_of(layers: int, hidden: int, mlp: int, vocabulary: int) -> dict:
    """The parameters' shapes (bf16), as ``ShapeDtypeStruct`` leaves."""

    def array(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    return {
        "embed": array(vocabulary, hidden),
        "layers": [
            {
                "qkv": array(hidden, 3 * hidden),
                "out": array(hidden, hidden),
                "up": array(hidden, mlp),
                "down": array(mlp, hidden),
            }
            for _ in range(layers)
        ],
    }


def loss(p, tok, heads):
    x = p["embed"][tok]
    b, s, h = x.shape
    for lp in p["layers"]:
        q, k, v = jnp.split(x @ lp["qkv"], 3, -1)
        q, k, v = (t.reshape(b, s, heads, h // heads) for t in (q, k, v))
        w = jax.nn.softmax(
            (jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(h // heads)).astype(jnp.float32), -1
        ).astype(x.dtype)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, h) @ lp["out"]
        x = x + jax.nn.gelu(x @ lp["up"]) @ lp["down"]
    logits = (x @ p["embed"].T).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tok[:, 1:, None], -1))


def sgd_step(p, tok, heads):
    g = jax.grad(loss)(p, tok, heads)
    return jax.tree.map(lambda a, b: a - (1e-3 * b).astype(a.dtype), p, g)


def case(index: int) -> tuple:
    """``(step, params, tokens)`` of one measured configuration, abstract."""
    layers, hidden, mlp, vocabulary, batch, sequence, heads = CONFIGS[index]
    step = functools.partial(sgd_step, heads=heads)
    tokens = jax.ShapeDtypeStruct((batch, sequence), jnp.int32)
    return step, params_of(layers, hidden, mlp, vocabulary), tokens


def matmul_flops(index: int) -> int:
    """The step's dots, counted by hand: forward 2 x tokens x (the layers' weights + the tied
    output layer) + attention's two batched products; the backward pass twice the forward."""
    layers, hidden, mlp, vocabulary, batch, sequence, _ = CONFIGS[index]
    tokens = batch * sequence
    weights = 4 * hidden * hidden + 2 * hidden * mlp  # qkv (3h^2), out (h^2), up, down
    attention = 2 * 2 * batch * sequence * sequence * hidden  # q k^T and w v, over all heads
    forward = layers * (2 * tokens * weights + attention) + 2 * tokens * vocabulary * hidden
    return 3 * forward
