"""The core services the integrations build on: placing a tree, building born sharded, the target."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import einshard
from conftest import N_DEVICES
from einshard._arrays._build import build_sharded
from einshard._arrays._place import place_leaves
from einshard._sharding._devices import call_devices


def sharding(expression, shape):
    return einshard.make_sharding(expression, shape=shape)


def place_tree(tree, shardings):
    """A tree placed through the placing service, which takes flat leaves (as its callers have them)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not isinstance(shardings, list):
        shardings = treedef.flatten_up_to(shardings)
    return jax.tree_util.tree_unflatten(treedef, place_leaves(leaves, shardings))


def blocks(array):
    return array.sharding.devices_indices_map(tuple(array.shape))


class TestPlaceTree:
    shape = (4, 2 * N_DEVICES)

    def test_every_kind_of_leaf(self):
        row, column = sharding("x y -> x y*", self.shape), sharding("x y -> x* y", (N_DEVICES, 4))
        values = np.arange(np.prod(self.shape), dtype=np.float32).reshape(self.shape)
        tree = {
            "jax": jnp.asarray(values),  # on one device
            "numpy": np.ones((N_DEVICES, 4), np.float32),
            "struct": jax.ShapeDtypeStruct(self.shape, jnp.bfloat16),
            "kept": jnp.zeros(3),  # its sharding is None: left as it is
            "step": 7,
        }
        shardings = {"jax": row, "numpy": column, "struct": row, "kept": None, "step": None}
        placed = place_tree(tree, shardings)
        assert blocks(placed["jax"]) == row.devices_indices_map(self.shape)
        np.testing.assert_array_equal(np.asarray(placed["jax"]), values)
        assert blocks(placed["numpy"]) == column.devices_indices_map((N_DEVICES, 4))
        assert placed["struct"].sharding == row and placed["struct"].dtype == jnp.bfloat16
        assert placed["kept"] is tree["kept"] and placed["step"] == 7

    def test_traced_leaves_get_a_constraint(self):
        row = sharding("x y -> x y*", self.shape)

        @jax.jit
        def f(tree):
            return jax.tree.map(lambda v: v * 2, place_tree(tree, {"w": row}))

        out = f({"w": jnp.ones(self.shape)})
        assert blocks(out["w"]) == row.devices_indices_map(self.shape)
        np.testing.assert_array_equal(np.asarray(out["w"]), 2 * np.ones(self.shape))

    def test_a_flat_list_of_shardings(self):
        row = sharding("x y -> x y*", self.shape)
        kept = np.zeros(self.shape)
        # One entry per leaf: a None node is no leaf, so it has none.
        placed = place_tree([np.ones(self.shape), None, kept], [row, None])
        assert placed[1] is None and placed[2] is kept
        assert blocks(placed[0]) == row.devices_indices_map(self.shape)


def test_build_sharded_gives_the_unsharded_values_born_placed():
    seen = []

    def shardings_for(abstract):
        seen.append(abstract)
        return {name: sharding("x y -> x y*", leaf.shape) for name, leaf in abstract.items()}

    def init(key, scale, *, width):
        a, b = jax.random.split(key)
        return {"a": scale * jax.random.normal(a, (4, width)), "b": jax.random.normal(b, (8, width))}

    args = (jax.random.key(1), np.float32(3.0))
    built = build_sharded(init, shardings_for, *args, width=2 * N_DEVICES)
    plain = init(*args, width=2 * N_DEVICES)
    assert isinstance(seen[0]["a"], jax.ShapeDtypeStruct) and seen[0]["a"].shape == (4, 2 * N_DEVICES)
    for name, value in plain.items():
        np.testing.assert_allclose(np.asarray(built[name]), np.asarray(value), rtol=1e-6)  # fused or not
        assert blocks(built[name]) == sharding("x y -> x y*", value.shape).devices_indices_map(value.shape)


class TestDeviceTarget:
    def test_the_precedence(self):
        devices = jax.devices()
        assert call_devices(None).order == tuple(devices)
        with einshard.use_devices(devices[:2]):
            assert call_devices(None).order == tuple(devices[:2])
            assert call_devices(devices[:1]).count == 1  # devices= wins over the block
            if N_DEVICES % 2 == 0:
                mesh = jax.make_mesh((2, N_DEVICES // 2), ("data", "model"))
                with jax.set_mesh(mesh):  # the ambient mesh wins over the block
                    target = call_devices(None)
                    assert target.mesh is not None and target.count == N_DEVICES
                    assert target.describe() == f"on the ambient mesh data=2, model={N_DEVICES // 2}"

    def test_it_decides_every_sharding(self):
        # make_sharding and a tree's leaves resolve on the same target: the same sharding.
        with einshard.use_devices(jax.devices()[::-1]):
            one = einshard.make_sharding("x y -> x y*", n_dims=2)
            tree = einshard.pytree_shardings({"w": jnp.zeros((4, N_DEVICES))}, {"w": "x y -> x y*"})
        assert isinstance(one, NamedSharding) and tree["w"] == one
        assert list(one.mesh.devices.flat) == jax.devices()[::-1]

    def test_bad_devices_say_so(self):
        with pytest.raises(einshard.EinshardError, match="devices= is empty"):
            call_devices([])
