"""orbax checkpoints: a sharded model and its optax state restored straight into rule-derived shardings."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from conftest import N_DEVICES
from einshard import EinshardError

pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
from einshard.integrations import orbax as ckpt  # noqa: E402  (after the importorskip)
from einshard.integrations.optax import (  # noqa: E402
    init_opt_state,
    opt_state_shardings,
    shard_opt_state,
)

ROOT = Path(__file__).resolve().parents[1]
REPLICATE = "... -> * ..."
D_IN, HIDDEN, D_OUT = 2 * N_DEVICES, 8 * N_DEVICES, 2 * N_DEVICES
RULES = [
    (r"hidden/w$", "x y -> x y*"),  # Megatron: column-parallel
    (r"hidden/b$", "y -> y*"),
    (r"out/w$", "y z -> y* z"),  # row-parallel
    (r".*", REPLICATE),
]
# Another layout of the same tree: the hidden layer split along its input, the output layer
# split along its output, the biases replicated.
OTHER_RULES = [
    (r"hidden/w$", "x y -> x* y"),
    (r"out/w$", "y z -> y z*"),
    (r".*", REPLICATE),
]


# --- helpers (independent of einshard's own planning) ------------------------------------------


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)


def keys_of(path):
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def by_path(tree):
    return {"/".join(keys_of(p)): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def expression_for(path, shape, rules):
    if not shape:
        return REPLICATE
    return next(expression for pattern, expression in rules if re.search(pattern, path))


def index_map(sharding, shape):
    return {
        device.id: tuple(s.indices(size)[:2] for s, size in zip(slices, shape, strict=True))
        for device, slices in sharding.devices_indices_map(tuple(shape)).items()
    }


def check_restored(restored, original, rules, devices=None):
    """Same paths and values as ``original``; every array laid out as make_sharding gives for its rule."""
    got, want = by_path(restored), by_path(original)
    assert got.keys() == want.keys()
    arrays = 0
    for path, leaf in got.items():
        if not isinstance(want[path], jax.Array):  # the step: an array if the abstract tree made it one
            assert np.asarray(leaf) == want[path], path
            assert type(leaf) is type(want[path]) or isinstance(leaf, jax.Array), path
            continue
        arrays += 1
        assert isinstance(leaf, jax.Array), path
        assert leaf.dtype == want[path].dtype and leaf.shape == want[path].shape, path
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[path]), err_msg=path)
        expected = einshard.make_sharding(
            expression_for(path, leaf.shape, rules), shape=leaf.shape, devices=devices
        )
        assert index_map(leaf.sharding, leaf.shape) == index_map(expected, leaf.shape), path
    return arrays


def trained_state():
    """A sharded model, its adamw state after two steps (mu, nu, count not at their initial values)."""
    k1, k2, kx, ky = jax.random.split(jax.random.key(0), 4)
    params = einshard.shard_pytree(
        {
            "hidden": {"w": jax.random.normal(k1, (D_IN, HIDDEN)), "b": jnp.zeros(HIDDEN)},
            "out": {"w": jax.random.normal(k2, (HIDDEN, D_OUT)), "b": jnp.zeros(D_OUT)},
        },
        RULES,
    )
    tx = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = init_opt_state(tx, params)
    x, y = jax.random.normal(kx, (32, D_IN)), jax.random.normal(ky, (32, D_OUT))
    for _ in range(2):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = einshard.shard_pytree(optax.apply_updates(params, updates), RULES)
        opt_state = shard_opt_state(opt_state, params)
    return {"params": params, "opt_state": opt_state, "step": 2}


@pytest.fixture(scope="module")
def state():
    return trained_state()


@pytest.fixture(scope="module")
def saved(state, tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoints") / "step_2"
    ckpt.save(path, state)
    return path


# --- in one process ---------------------------------------------------------------------------


class TestRoundTrip:
    def test_saved_state_is_sharded(self, state):
        mu = state["opt_state"][0].mu["hidden"]["w"]
        assert int(state["opt_state"][0].count) == 2 and float(jnp.abs(mu).sum()) > 0
        assert mu.sharding == state["params"]["hidden"]["w"].sharding
        assert not mu.sharding.is_fully_replicated

    def test_same_rules_into_the_abstract_structure(self, state, saved):
        restored = ckpt.restore(saved, RULES, abstract=jax.eval_shape(lambda: state))
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
        assert type(restored["opt_state"][0]).__name__ == "ScaleByAdamState"
        assert check_restored(restored, state, RULES) == 13  # 4 params, mu and nu of each, count

    def test_same_rules_from_the_checkpoints_metadata(self, state, saved):
        restored = ckpt.restore(saved, RULES)  # orbax's stored structure: dicts and lists
        assert isinstance(restored["opt_state"], list) and isinstance(restored["opt_state"][0], dict)
        assert check_restored(restored, state, RULES) == 13

    def test_a_different_rule_table(self, state, saved):
        restored = ckpt.restore(saved, OTHER_RULES, abstract=jax.eval_shape(lambda: state))
        check_restored(restored, state, OTHER_RULES)
        w = restored["opt_state"][0].nu["hidden"]["w"]
        assert w.sharding.shard_shape(w.shape) == (D_IN // N_DEVICES, HIDDEN)

    @pytest.mark.skipif(N_DEVICES < 2, reason="needs a smaller device set to restore onto")
    def test_onto_fewer_devices(self, state, saved):
        devices = jax.devices()[: N_DEVICES // 2]
        restored = ckpt.restore(saved, RULES, abstract=jax.eval_shape(lambda: state), devices=devices)
        check_restored(restored, state, RULES, devices=devices)
        assert {d.id for leaf in jax.tree.leaves(restored) for d in leaf.sharding.device_set} == {
            d.id for d in devices
        }

    def test_python_scalars_stay_python_scalars(self, saved):
        restored = ckpt.restore(saved, RULES)
        assert restored["step"] == 2 and type(restored["step"]) is int


class TestTargets:
    def test_from_eval_shape_and_from_metadata_agree(self, state, saved):
        from_shapes = ckpt.restore_target(jax.eval_shape(lambda: state), RULES)
        from_metadata = ckpt.restore_target(ckpt.abstract_checkpoint(saved), RULES)
        a, b = by_path(from_shapes), by_path(from_metadata)
        assert a.keys() == b.keys()
        # The step: jax.eval_shape makes the Python int an array; the metadata keeps it a Python int.
        assert isinstance(a.pop("step"), jax.ShapeDtypeStruct) and b.pop("step") == 0
        for path, leaf in a.items():
            assert (leaf.shape, leaf.dtype, leaf.sharding) == (b[path].shape, b[path].dtype, b[path].sharding)

    def test_abstract_checkpoint_reads_shapes_not_values(self, state, saved):
        abstract = ckpt.abstract_checkpoint(saved)
        assert abstract["step"] == 0
        w = abstract["opt_state"][0]["mu"]["out"]["w"]
        assert isinstance(w, jax.ShapeDtypeStruct) and w.shape == (HIDDEN, D_OUT) and w.sharding is None

    def test_a_given_target(self, state, saved):
        target = ckpt.restore_target(jax.eval_shape(lambda: state), OTHER_RULES)
        check_restored(ckpt.restore(saved, target), state, OTHER_RULES)

    def test_a_target_built_from_opt_state_shardings(self, state, saved):
        abstract = jax.eval_shape(lambda: state)
        params = ckpt.restore_target(abstract["params"], OTHER_RULES)
        shardings = opt_state_shardings(abstract["opt_state"], params)
        opt_target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract["opt_state"], shardings
        )
        restored = ckpt.restore(saved, {"params": params, "opt_state": opt_target, "step": 0})
        check_restored(restored, state, OTHER_RULES)

    def test_placed_arrays_as_the_target(self, state, saved):
        like = einshard.shard_pytree(jax.tree.map(jnp.zeros_like, state), OTHER_RULES)
        check_restored(ckpt.restore(saved, like), state, OTHER_RULES)

    def test_a_target_without_shardings_is_an_error(self, state, saved):
        with pytest.raises(EinshardError, match=r"'opt_state/0/count' \(shape \(\)\) has no sharding"):
            ckpt.restore(saved, jax.eval_shape(lambda: state))

    def test_abstract_with_a_target_is_an_error(self, state, saved):
        target = ckpt.restore_target(jax.eval_shape(lambda: state), RULES)
        with pytest.raises(EinshardError, match="abstract= goes with a rule table"):
            ckpt.restore(saved, target, abstract=target)

    def test_rules_that_do_not_fit_name_the_leaf(self, saved):
        rules = [(r"out/w$", "z -> z*"), (r".*", REPLICATE)]  # out/w has two axes
        with pytest.raises(EinshardError, match="out/w"):
            ckpt.restore(saved, rules)

    def test_save_refuses_to_overwrite_unless_forced(self, state, tmp_path):
        ckpt.save(tmp_path / "ckpt", {"w": state["params"]["hidden"]["w"]})
        # orbax's own ValueError, passed through (an EinshardError, a ValueError too, would also do).
        with pytest.raises(ValueError, match=r"ckpt already exists"):
            ckpt.save(tmp_path / "ckpt", {"w": state["params"]["out"]["w"]})
        ckpt.save(tmp_path / "ckpt", {"w": state["params"]["out"]["w"]}, force=True)
        restored = ckpt.restore(tmp_path / "ckpt", RULES)
        np.testing.assert_array_equal(restored["w"], state["params"]["out"]["w"])


# --- across device counts: one process saves, another restores -----------------------------------

# Each child process simulates its own device count. Sizes are fixed so that the rules fit 4 and
# 8 devices alike. The saving child writes the values it saved; the restoring child checks the
# layouts on its devices and writes the values it restored.
CHILD = textwrap.dedent(
    """
    import json, re, sys, warnings
    warnings.simplefilter("error")
    mode, n_devices, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n_devices)
    import jax.numpy as jnp, numpy as np, optax
    import einshard
    from einshard.integrations import orbax as ckpt
    from einshard.integrations.optax import init_opt_state, shard_opt_state

    RULES = json.loads(sys.argv[4])
    tx = optax.adamw(1e-2, weight_decay=0.1)

    def make_params():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {
            "hidden": {"w": jax.random.normal(k1, (16, 32)), "b": jnp.zeros(32)},
            "out": {"w": jax.random.normal(k2, (32, 8)), "b": jnp.zeros(8)},
        }

    def make():
        kx = jax.random.key(1)
        params = einshard.shard_pytree(make_params(), RULES)
        opt_state = init_opt_state(tx, params)
        loss = lambda p, x: jnp.sum(jax.nn.relu(x @ p["hidden"]["w"] + p["hidden"]["b"]) @ p["out"]["w"])
        grads = jax.grad(loss)(params, jax.random.normal(kx, (4, 16)))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = einshard.shard_pytree(optax.apply_updates(params, updates), RULES)
        return {"params": params, "opt_state": shard_opt_state(opt_state, params), "step": 1}

    def flat(tree):
        return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    def index_map(sharding, shape):
        return {
            device.id: tuple(s.indices(size)[:2] for s, size in zip(slices, shape))
            for device, slices in sharding.devices_indices_map(tuple(shape)).items()
        }

    if mode == "save":
        state = make()
        assert len(state["params"]["hidden"]["w"].sharding.device_set) == n_devices
        ckpt.save(directory + "/ckpt", state)
    else:
        # The structure to restore into, never materialised: shapes only.
        params = jax.eval_shape(make_params)
        abstract = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": 0}
        state = ckpt.restore(directory + "/ckpt", RULES, abstract=abstract)
        assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(abstract)
        assert state["step"] == 1 and type(state["step"]) is int
        for (path, leaf) in jax.tree_util.tree_flatten_with_path(state)[0]:
            if not isinstance(leaf, jax.Array):
                continue
            name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
            expression = next(e for r, e in RULES if re.search(r, name)) if leaf.ndim else "... -> * ..."
            expected = einshard.make_sharding(expression, shape=leaf.shape)
            assert len(leaf.sharding.device_set) == n_devices, name
            assert index_map(leaf.sharding, leaf.shape) == index_map(expected, leaf.shape), name
    values = {k: np.asarray(v) for k, v in flat(state).items() if isinstance(v, jax.Array)}
    np.savez(directory + "/" + mode + ".npz", **values)
    print(json.dumps({"devices": jax.device_count(), "leaves": len(values)}))
    """
)


def run_child(mode, n_devices, directory, rules):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("EINSHARD_TEST_DEVICES", None)
    env.pop("XLA_FLAGS", None)  # the child sets its own device count
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(n_devices), str(directory), json.dumps(rules)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=90,
    )
    assert result.returncode == 0, f"{mode} on {n_devices} devices failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("save_on", "restore_on"), [(8, 4), (4, 8)])
def test_restore_onto_a_different_device_count(save_on, restore_on, tmp_path):
    assert run_child("save", save_on, tmp_path, RULES) == {"devices": save_on, "leaves": 13}
    assert run_child("restore", restore_on, tmp_path, OTHER_RULES if save_on > restore_on else RULES) == {
        "devices": restore_on,
        "leaves": 13,
    }
    saved, restored = np.load(tmp_path / "save.npz"), np.load(tmp_path / "restore.npz")
    assert sorted(saved.files) == sorted(restored.files)
    for name in saved.files:
        np.testing.assert_array_equal(saved[name], restored[name], err_msg=name)
