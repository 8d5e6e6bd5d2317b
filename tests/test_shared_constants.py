"""Equal constant work kept once before compiling (``_tracing._constants.shared_constants``).

An unrolled model that builds a constant table in every layer (Hugging Face's Flax LLaMA's rotary
table, gathered at the positions in each attention) hands XLA one fold per layer; the step the
plan compiles shares them. The values are the same, the program's figures are the same, and work
that is not constant, or not equal, or has effects, is left alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard._cost.pipeline import _program
from einshard._tracing._constants import shared_constants

LAYERS, BATCH, SEQ, DIM = 4, 48, 16, 8


def rotary_table(seq: int, dim: int) -> np.ndarray:
    """As Hugging Face's ``create_sinusoidal_positions``: a numpy table each layer makes again."""
    inv_freq = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    freqs = np.einsum("i,j->ij", np.arange(seq), inv_freq).astype("float32")
    emb = np.concatenate((freqs, freqs), axis=-1)
    return np.concatenate((np.sin(emb), np.cos(emb)), axis=-1)


def unrolled(params: dict, tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None, :], tokens.shape)
    for i in range(LAYERS):
        table = jnp.asarray(rotary_table(SEQ, DIM))  # a constant of this layer's own
        sin, cos = jnp.split(table[positions], 2, axis=-1)
        x = jnp.tanh((x * cos + x * sin) @ params["layers"][i])
    return (x**2).mean()


def step(params: dict, tokens: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(unrolled)(params, tokens)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def make_params() -> dict:
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    return {
        "embed": jax.random.normal(keys[0], (32, DIM)),
        "layers": [jax.random.normal(k, (DIM, DIM)) / DIM for k in keys[1:]],
    }


TOKENS = jnp.arange(BATCH * SEQ, dtype=jnp.int32).reshape(BATCH, SEQ) % 32


def gathers(closed) -> int:
    return sum(eqn.primitive.name == "gather" for eqn in closed.jaxpr.eqns) + sum(
        gathers(eqn.params["jaxpr"]) for eqn in closed.jaxpr.eqns if eqn.primitive.name in ("pjit", "jit")
    )


def test_each_layer_s_table_is_gathered_once_with_the_same_values():
    closed = jax.make_jaxpr(step)(make_params(), TOKENS)
    shared = shared_constants(closed)
    assert shared is not closed
    assert len(shared.consts) < len(closed.consts)
    # The tables' gathers (forward; the embedding's and its gradient stay): one layer's, not four.
    assert gathers(shared) <= gathers(closed) - (LAYERS - 1)
    flat = jax.tree.leaves((make_params(), TOKENS))
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
    got = jax.core.eval_jaxpr(shared.jaxpr, shared.consts, *flat)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_work_that_is_not_constant_or_not_equal_is_left_alone():
    def distinct(x):
        first, second = jnp.asarray(np.arange(4.0)), jnp.asarray(np.arange(4.0) + 1)
        return (x * first).sum() + (x * first).sum() + (x * second).sum()

    closed = jax.make_jaxpr(distinct)(jnp.ones(4))
    shared = shared_constants(closed)
    # Two different tables, and the products with x (not constant) repeated: nothing to share.
    assert shared is closed


def test_equations_with_effects_are_kept():
    seen = []

    def effects(x):
        jax.debug.callback(lambda: seen.append(1))
        jax.debug.callback(lambda: seen.append(1))
        return x + 1

    closed = jax.make_jaxpr(effects)(1.0)
    shared = shared_constants(closed)
    assert shared is closed
    jax.core.eval_jaxpr(shared.jaxpr, shared.consts, 1.0)
    assert len(seen) == 2


def test_the_compiled_step_s_figures_are_the_same(monkeypatch):
    n = jax.device_count()
    if BATCH % n:
        pytest.skip(f"the batch of {BATCH} does not split over {n} devices")
    rules = [(r"embed", "v d -> v d *"), (r"layers", "i o -> i o *"), (r"tokens", "b s -> b* s")]

    def report() -> einshard.StepReport:
        return einshard.explain_step(step, make_params(), TOKENS, rules=rules, quiet=True)

    changed = []

    def spied(closed):
        result = shared_constants(closed)
        changed.append(result is not closed)
        return result

    monkeypatch.setattr(_program, "shared_constants", spied)
    shared = report()
    assert changed == [True]  # this step had constant work to share
    monkeypatch.setattr(_program, "shared_constants", lambda closed: closed)
    unshared = report()
    assert shared.rows  # the gradients' all-reduces at least
    assert [(r.kind, r.bytes, r.group_size, r.times) for r in shared.rows] == [
        (r.kind, r.bytes, r.group_size, r.times) for r in unshared.rows
    ]
    assert (shared.peak_bytes, shared.argument_bytes, shared.temp_bytes) == (
        unshared.peak_bytes,
        unshared.argument_bytes,
        unshared.temp_bytes,
    )
    assert shared.flops == unshared.flops
