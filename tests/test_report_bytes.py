"""Exact bytes in the integrations' reports: optax states (Adafactor's reduced leaves too), Flax, Equinox.

Each expected number is worked out by hand from the shapes, dtypes and layouts
(shown next to it); on this machine's devices the report is also checked
against the bytes each placed array's shards really take.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from conftest import N_DEVICES

optax = pytest.importorskip("optax")
from einshard.integrations.optax import explain_opt_state, init_opt_state  # noqa: E402

REPLICATE = "... -> * ..."
RULES = [("w1", "x y -> x y*"), (".*", REPLICATE)]
PARAMS = {
    "w1": jax.ShapeDtypeStruct((512, 1024), jnp.float32),
    "b": jax.ShapeDtypeStruct((1024,), jnp.bfloat16),
}


def rows_of(report):
    return {
        row.path: (row.shape, row.dtype, row.shard_shape, row.bytes, row.bytes_per_device)
        for row in report.rows
    }


def assert_report_is_what_devices_hold(report, tree):
    """Each row's bytes per device are what every device holds of the placed leaf, by its shards."""
    leaves = {
        "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, jax.Array)
    }
    held = {device: 0 for device in jax.devices()}
    for row in report.rows:
        leaf = leaves[row.path]
        assert row.bytes == leaf.nbytes, row.path
        assert {shard.data.nbytes for shard in leaf.addressable_shards} == {row.bytes_per_device}, row.path
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    assert report.total_bytes == sum(leaf.nbytes for leaf in leaves.values())
    assert report.max_bytes_per_device == max(held.values())


def test_adafactor_state_planned_for_256_devices():
    state = jax.eval_shape(optax.adafactor(1e-3).init, PARAMS)
    report = explain_opt_state(state, RULES, PARAMS, n_devices=256)
    assert rows_of(report) == {
        "0/count": ((), "int32", (), 4, 4),
        # b is not factored: one-element placeholders beside it, replicated (2 bytes of bfloat16)
        "0/v_row/b": ((1,), "bfloat16", (1,), 2, 2),
        "0/v_col/b": ((1,), "bfloat16", (1,), 2, 2),
        # w1's row statistics lose its split axis 1: all 512 float32 on every device
        "0/v_row/w1": ((512,), "float32", (512,), 512 * 4, 512 * 4),
        # its column statistics keep axis 1, split 256 ways: 4 float32 each
        "0/v_col/w1": ((1024,), "float32", (4,), 1024 * 4, 4 * 4),
        "0/v/b": ((1024,), "bfloat16", (1024,), 1024 * 2, 1024 * 2),
        "0/v/w1": ((1,), "float32", (1,), 4, 4),
    }
    assert report.total_bytes == 4 + 2 + 2 + 2048 + 4096 + 2048 + 4  # 8204
    assert report.max_bytes_per_device == 4 + 2 + 2 + 2048 + 16 + 2048 + 4  # 4124
    assert report.n_devices == 256


def test_adam_state_planned_for_256_devices():
    state = jax.eval_shape(optax.adam(1e-3).init, PARAMS)
    report = explain_opt_state(state, RULES, PARAMS, n_devices=256)
    w1 = ((512, 1024), "float32", (512, 4), 512 * 1024 * 4, 512 * 4 * 4)
    b = ((1024,), "bfloat16", (1024,), 2048, 2048)
    assert rows_of(report) == {
        "0/count": ((), "int32", (), 4, 4),
        "0/mu/b": b,
        "0/mu/w1": w1,
        "0/nu/b": b,
        "0/nu/w1": w1,
    }
    assert report.total_bytes == 4 + 2 * (2048 + 2_097_152)
    assert report.max_bytes_per_device == 4 + 2 * (2048 + 8192)


@pytest.mark.parametrize("split", [0, 1])
def test_adafactor_statistics_of_a_square_kernel_planned_for_256_devices(split):
    # A square kernel: optax's v_row keeps axis 0 and v_col axis 1 (its np.argsort tie order), so
    # the statistic that keeps the split axis is split 256 ways (4 float32 each), the other whole.
    expression = "x y -> x* y" if split == 0 else "x y -> x y*"
    params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    state = jax.eval_shape(optax.adafactor(1e-3).init, params)
    rows = rows_of(explain_opt_state(state, [("w", expression)], params, n_devices=256))
    kept = {"0/v_row/w": 0, "0/v_col/w": 1}
    for path, axis in kept.items():
        per_device = 4 * 4 if axis == split else 1024 * 4
        assert rows[path] == ((1024,), "float32", (per_device // 4,), 1024 * 4, per_device), path


@pytest.mark.parametrize("tx", [optax.adafactor(1e-3), optax.adam(1e-3)], ids=["adafactor", "adam"])
def test_opt_state_report_is_what_the_devices_hold(tx):
    params = einshard.shard_pytree(
        {"w1": jnp.ones((128, 32 * N_DEVICES)), "b": jnp.ones(4 * N_DEVICES)}, RULES
    )
    state = init_opt_state(tx, params)
    report = explain_opt_state(state, params=params)
    assert report.n_devices == N_DEVICES
    assert_report_is_what_devices_hold(report, state)
    by_path = rows_of(report)
    if "0/v_col/w1" in by_path:  # Adafactor: v_row of w1 replicated, v_col split like w1's columns
        assert by_path["0/v_row/w1"][4] == 128 * 4
        assert by_path["0/v_col/w1"][4] == 32 * 4
    else:
        assert by_path["0/mu/w1"][4] == 128 * 32 * 4


# --- Flax ---------------------------------------------------------------------------------------


def test_flax_nnx_report():
    nnx = pytest.importorskip("flax.nnx")
    from einshard.integrations.flax import shard_module, state_tree

    class Model(nnx.Module):  # 192 hidden units: a multiple of 64 planned devices and of 6, 8, 16
        def __init__(self, rngs):
            self.up = nnx.Linear(64, 192, rngs=rngs)
            self.down = nnx.Linear(192, 32, rngs=rngs, param_dtype=jnp.bfloat16)

    rules = [("up/kernel", "x y -> x y*"), ("down/kernel", "y z -> y* z"), (".*", REPLICATE)]
    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    report = einshard.explain(state_tree(abstract), rules, n_devices=64)
    assert rows_of(report) == {
        "down/bias": ((32,), "bfloat16", (32,), 64, 64),
        "down/kernel": ((192, 32), "bfloat16", (3, 32), 192 * 32 * 2, 3 * 32 * 2),
        "up/bias": ((192,), "float32", (192,), 768, 768),
        "up/kernel": ((64, 192), "float32", (64, 3), 64 * 192 * 4, 64 * 3 * 4),
    }
    assert report.total_bytes == 64 + 12288 + 768 + 49152
    assert report.max_bytes_per_device == 64 + 192 + 768 + 768
    model = shard_module(Model(nnx.Rngs(0)), rules)
    here = einshard.explain(state_tree(model), rules)
    assert_report_is_what_devices_hold(here, state_tree(model))
    assert rows_of(here)["up/kernel"][4] == 64 * (192 // N_DEVICES) * 4


def test_flax_linen_report():
    nn = pytest.importorskip("flax.linen")

    model = nn.Dense(16 * N_DEVICES)
    rules = [("kernel", "x y -> x y*"), (".*", REPLICATE)]
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 24)))
    report = einshard.explain(abstract, rules, n_devices=4 * N_DEVICES)
    assert rows_of(report) == {
        "params/bias": ((16 * N_DEVICES,), "float32", (16 * N_DEVICES,), 64 * N_DEVICES, 64 * N_DEVICES),
        "params/kernel": ((24, 16 * N_DEVICES), "float32", (24, 4), 24 * 16 * N_DEVICES * 4, 24 * 4 * 4),
    }
    variables = einshard.init_sharded(model.init, rules, jax.random.key(0), jnp.ones((1, 24)))
    here = einshard.explain(variables, rules)
    assert_report_is_what_devices_hold(here, variables)
    assert here.max_bytes_per_device == 64 * N_DEVICES + 24 * 16 * 4


# --- Equinox ------------------------------------------------------------------------------------


def test_equinox_report():
    eqx = pytest.importorskip("equinox")
    from einshard.integrations.equinox import shard_module

    model = eqx.nn.MLP(12, 5, 8 * N_DEVICES, depth=1, key=jax.random.key(0))  # 12 -> 8N -> 5
    rules = [
        ("layers/0/weight", "o i -> o* i"),
        ("layers/1/weight", "o i -> o i*"),
        ("layers/0/bias", "o -> o*"),
        (".*", REPLICATE),
    ]
    report = einshard.explain(model, rules, n_devices=2 * N_DEVICES)
    hidden = 8 * N_DEVICES
    assert rows_of(report) == {
        "layers/0/weight": ((hidden, 12), "float32", (4, 12), hidden * 12 * 4, 4 * 12 * 4),
        "layers/0/bias": ((hidden,), "float32", (4,), hidden * 4, 4 * 4),
        "layers/1/weight": ((5, hidden), "float32", (5, 4), 5 * hidden * 4, 5 * 4 * 4),
        "layers/1/bias": ((5,), "float32", (5,), 20, 20),
    }
    assert report.max_bytes_per_device == 192 + 16 + 80 + 20
    placed = shard_module(model, rules)
    here = einshard.explain(placed, rules)
    assert_report_is_what_devices_hold(here, placed)
    assert here.max_bytes_per_device == (8 * 12 + 8 + 5 * 8) * 4 + 20
    np.testing.assert_array_equal(np.asarray(placed.layers[0].weight), np.asarray(model.layers[0].weight))
