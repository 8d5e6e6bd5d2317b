"""A property: optax state mirrors its parameters' layouts, device by device, whatever the rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_v020 import blocks_v020, expected_blocks, index_blocks

import einshard
from conftest import N_DEVICES

optax = pytest.importorskip("optax")
from einshard.integrations.optax import init_opt_state, shard_opt_state  # noqa: E402  (after the importorskip)

REPLICATE = "... -> * ..."
SHAPES = [(2 * N_DEVICES, 3), (4, N_DEVICES), (N_DEVICES,), (3, 5)]
EXPRESSIONS = {1: ["a -> a*", REPLICATE], 2: ["a b -> a* b", "a b -> a b*", REPLICATE]}


def _divides(expression, shape):
    shards, _ = blocks_v020(expression, len(shape), N_DEVICES)
    return all(size % count == 0 for size, count in zip(shape, shards, strict=True))


@st.composite
def models(draw):
    """Parameters of a few shapes, each with a rule of its rank that divides it."""
    names = draw(st.lists(st.sampled_from(["w1", "w2", "b", "scale"]), min_size=1, max_size=3, unique=True))
    params, rules = {}, []
    for name in names:
        shape = draw(st.sampled_from(SHAPES))
        fitting = [e for e in EXPRESSIONS[len(shape)] if _divides(e, shape)]
        params[name] = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
        rules.append((f"^{name}$", draw(st.sampled_from(fitting))))
    return params, rules


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models())
def test_adam_state_is_laid_out_as_its_parameters(model):
    params, rules = model
    placed = einshard.shard_pytree(params, rules)
    expressions = dict((regex.strip("^$"), expression) for regex, expression in rules)
    tx = optax.adam(1e-3)
    born = init_opt_state(tx, placed)[0]
    moved = shard_opt_state(tx.update(params, tx.init(params), params)[1], placed)[0]
    for name, value in params.items():
        shards, _ = blocks_v020(expressions[name], value.ndim, N_DEVICES)
        expected = expected_blocks(expressions[name], value.shape, jax.devices())
        assert index_blocks(placed[name].sharding, value.shape, shards) == expected, name
        for state in (born, moved):
            for moment in (state.mu[name], state.nu[name]):
                assert index_blocks(moment.sharding, value.shape, shards) == expected, name
        # The moments of a state placed after a step keep their values, shard by shard.
        for shard in moved.mu[name].addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), 0.1 * value[shard.index], rtol=1e-6)
    assert born.count.sharding.is_fully_replicated and moved.count.sharding.is_fully_replicated
    assert jnp.asarray(moved.count) == 1
