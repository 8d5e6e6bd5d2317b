"""Placing arrays: layouts checked device by device, inside and outside jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from reference_v020 import expected_blocks, index_blocks, make_sharding_v020

import einshard
from conftest import N_DEVICES
from einshard import EinshardError


def index_map(sharding, shape):
    """Device id -> the block it holds, as (start, stop) pairs."""
    return {
        device.id: tuple(s.indices(size)[:2] for s, size in zip(slices, shape, strict=True))
        for device, slices in sharding.devices_indices_map(tuple(shape)).items()
    }


def expected_map(expression, shape, devices=None):
    """The same map from the pure layout, over the given device order."""
    devices = list(devices or jax.devices())
    layout = einshard.layout(expression, shape, n_devices=len(devices))
    return {
        devices[position].id: tuple(s.indices(size)[:2] for s, size in zip(slices, shape, strict=True))
        for position, slices in layout.indices(shape).items()
    }


# Expressions 0.2.0 accepted, with a shape they divide, for the device count under test.
V020_CASES = [
    ("x y -> x y*", (4, 8 * N_DEVICES)),
    ("x y -> x* y", (2 * N_DEVICES, 4)),
    ("x y -> x2 y*", (4, 3 * N_DEVICES)),
    ("x y -> y2 x*", (6 * N_DEVICES, 4)),
    ("a b -> * a2 b", (4, 8)),
    ("a b -> a2 b *", (4, 8)),
    ("a b -> 2 a* b", (2 * N_DEVICES, 8)),
    ("a ... d -> * a2 ... d", (4, 3, 5, 2)),
    ("... -> * ...", (3, 5)),
    ("... -> * ...", ()),
    ("a b c -> 2 c* a b", (2, 3, 6 * N_DEVICES)),
    ("a b -> 1 a* 1 b 1", (2 * N_DEVICES, 3)),
]


@pytest.mark.parametrize(("expression", "shape"), V020_CASES)
def test_same_devices_as_v020(expression, shape):
    ours = einshard.make_sharding(expression, shape=shape)
    theirs = make_sharding_v020(expression, len(shape))
    assert index_map(ours, shape) == index_map(theirs, shape)
    assert index_map(ours, shape) == expected_map(expression, shape)


@st.composite
def accepted_by_v020(draw):
    """A random expression without '...' that 0.2.0 accepts on this device count."""
    n_axes = draw(st.integers(1, 3))
    names = ["a", "b", "c"][:n_axes]
    factors = []
    remaining = N_DEVICES
    for p in (2, 3, 5, 7):
        while remaining % p == 0:
            factors.append(p)
            remaining //= p
    slots = names + ["" for _ in range(draw(st.integers(0, 2)))]
    counts = dict.fromkeys(range(len(slots)), 1)
    for factor in factors:
        counts[draw(st.integers(0, len(slots) - 1))] *= factor
    elements = []
    for i, slot in enumerate(slots):
        count = counts[i]
        if slot == "" and count == 1:
            count = 1 if draw(st.booleans()) else None
            if count is None:
                continue
        elements.append(f"{slot}{count if (count > 1 or slot == '') else ''}")
    order = draw(st.permutations(elements))
    shape = tuple(counts[i] * draw(st.integers(1, 2)) for i in range(len(names)))
    return " ".join(names) + " -> " + " ".join(order), shape


@settings(max_examples=60, deadline=None)
@given(case=accepted_by_v020())
def test_random_expressions_match_v020(case):
    expression, shape = case
    ours = einshard.make_sharding(expression, shape=shape)
    assert index_map(ours, shape) == index_map(make_sharding_v020(expression, len(shape)), shape)


@pytest.mark.skipif(N_DEVICES != 16, reason="the README's pictures are drawn for 16 devices")
def test_readme_layouts_on_16_devices():
    x = einshard.einshard(jnp.zeros((4, 8)), "a b -> * a2 b")
    groups = {}
    for device, (rows, _) in index_map(x.sharding, (4, 8)).items():
        groups.setdefault(rows, []).append(device)
    assert groups == {(0, 2): [0, 2, 4, 6, 8, 10, 12, 14], (2, 4): [1, 3, 5, 7, 9, 11, 13, 15]}
    x = einshard.einshard(jnp.zeros((4, 8)), "a b -> 2 a2* b*")
    blocks = {}
    for device, block in index_map(x.sharding, (4, 8)).items():
        blocks.setdefault(block, []).append(device)
    assert blocks[((0, 1), (0, 4))] == [0, 8]
    assert blocks[((3, 4), (4, 8))] == [7, 15]


class TestInputs:
    def test_numpy_keeps_values(self):
        x = np.arange(4 * 2 * N_DEVICES, dtype=np.float32).reshape(4, 2 * N_DEVICES)
        y = einshard.einshard(x, "a b -> a b*")
        np.testing.assert_array_equal(np.asarray(y), x)
        assert index_map(y.sharding, x.shape) == expected_map("a b -> a b*", x.shape)

    def test_jax_array_is_resharded(self):
        x = einshard.einshard(jnp.arange(6.0 * N_DEVICES).reshape(N_DEVICES, 6), "a b -> a* b")
        y = einshard.einshard(x, "a b -> * a b")
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        assert y.sharding.is_fully_replicated
        z = einshard.einshard(y, "a b -> a* b")
        assert index_map(z.sharding, z.shape) == expected_map("a b -> a* b", z.shape)

    def test_python_scalar_and_list(self):
        s = einshard.einshard(3.5, "... -> * ...")
        assert s.shape == () and float(s) == 3.5 and s.sharding.is_fully_replicated
        assert len(s.sharding.device_set) == N_DEVICES
        t = einshard.einshard(7, " -> *")
        assert int(t) == 7
        values = [[float(i + j) for j in range(N_DEVICES)] for i in range(2)]
        u = einshard.einshard(values, "r c -> r c*")
        np.testing.assert_array_equal(np.asarray(u), np.array(values, dtype=np.float32))

    def test_shape_dtype_struct(self):
        struct = jax.ShapeDtypeStruct((8, 4 * N_DEVICES), jnp.bfloat16)
        placed = einshard.einshard(struct, "x y -> x y*")
        assert isinstance(placed, jax.ShapeDtypeStruct)
        assert (placed.shape, placed.dtype) == (struct.shape, struct.dtype)
        assert placed.sharding == einshard.make_sharding("x y -> x y*", n_dims=2)
        # Born sharded: the struct's sharding drives jit's output.
        made = jax.jit(lambda: jnp.ones(struct.shape, struct.dtype), out_shardings=placed.sharding)()
        assert index_map(made.sharding, made.shape) == expected_map("x y -> x y*", made.shape)

    def test_object_arrays_are_rejected(self):
        with pytest.raises(EinshardError, match="Python objects"):
            einshard.einshard(["a", object()], "x -> x*")
        with pytest.raises(EinshardError, match="cannot shard an array of dtype <U1"):
            einshard.einshard(["a", "b"], "... -> * ...")

    def test_a_bool_is_no_device_count(self):
        with pytest.raises(EinshardError, match="the device count must be a positive integer, not True"):
            einshard.layout("x -> x*", (8,), n_devices=True)

    def test_indivisible_axis_fails_before_jax(self):
        with pytest.raises(EinshardError, match=r"has size 3, which does not split into") as info:
            einshard.einshard(np.zeros((3, 4)), "a b -> a* b")
        assert "while sharding an array of shape (3, 4)" in str(info.value)


class TestTraced:
    def test_inside_jit(self):
        @jax.jit
        def f(x):
            return einshard.einshard(x * 2, "a b -> a b*")

        x = jnp.arange(4.0 * N_DEVICES).reshape(4, N_DEVICES)
        y = f(x)
        np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
        assert index_map(y.sharding, y.shape) == expected_map("a b -> a b*", y.shape)

    def test_grad(self):
        def loss(w):
            w = einshard.einshard(w, "a b -> a* b")
            return jnp.sum(w**2)

        w = jnp.arange(2.0 * N_DEVICES * 3).reshape(2 * N_DEVICES, 3)
        # The cotangent is constrained like the value: the gradient comes out laid out as 'a* b'.
        expected = expected_blocks("a b -> a* b", w.shape, jax.devices())
        for grad in (jax.jit(jax.grad(loss))(w), jax.grad(loss)(w)):
            np.testing.assert_allclose(np.asarray(grad), 2 * np.asarray(w))
            assert index_blocks(grad.sharding, w.shape, (N_DEVICES, 1)) == expected

    def test_vmap_constrains_the_example_axes(self):
        @jax.jit
        def f(batch):
            return jax.vmap(lambda row: einshard.einshard(row + 1, "f -> f*"))(batch)

        x = jnp.arange(3.0 * 2 * N_DEVICES).reshape(3, 2 * N_DEVICES)
        y = f(x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x) + 1)
        # The vmapped axis stays whole; each device holds its columns of every row.
        assert index_blocks(y.sharding, y.shape, (1, N_DEVICES)) == expected_blocks(
            "b f -> b f*", y.shape, jax.devices()
        )
        for shard in y.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index] + 1)

    def test_errors_inside_jit_are_einshard_errors(self):
        with pytest.raises(EinshardError, match="right-hand side but not on the left"):
            jax.jit(lambda x: einshard.einshard(x, "a -> b*"))(jnp.zeros(N_DEVICES))


class TestDeviceOrder:
    def test_different_expressions_meet_in_one_jit(self):
        a = einshard.einshard(jnp.ones((N_DEVICES, 2 * N_DEVICES)), "x y -> x* y")
        b = einshard.einshard(jnp.ones((N_DEVICES, 2 * N_DEVICES)), "x y -> x y*")
        c = einshard.einshard(
            jnp.ones((N_DEVICES, 2 * N_DEVICES)), "x y -> 2 x y*" if N_DEVICES % 2 == 0 else "x y -> * x y"
        )
        out = jax.jit(lambda a, b, c: a + b + c)(a, b, c)
        np.testing.assert_array_equal(np.asarray(out), 3)

    def test_equal_layouts_do_not_recompile(self):
        f = jax.jit(lambda x: x + 1)
        x = jnp.zeros((4, 2 * N_DEVICES))
        f(einshard.einshard(x, "x y -> x y*"))
        f(einshard.einshard(x, "p q -> p q* 1"))
        f(einshard.einshard(x, "r s -> 1 r1 s*"))
        assert f._cache_size() == 1
        assert hash(einshard.make_sharding("x y -> x y*")) == hash(einshard.make_sharding("u v -> u v*"))

    def test_devices_argument_sets_the_order(self):
        devices = jax.devices()[::-1]
        shape = (4, 2 * N_DEVICES)
        x = einshard.einshard(np.zeros(shape), "x y -> x y*", devices=devices)
        assert index_map(x.sharding, shape) == expected_map("x y -> x y*", shape, devices)

    def test_subset_of_devices(self):
        devices = jax.devices()[:2]
        x = einshard.einshard(np.zeros((4, 6)), "x y -> x* y", devices=devices)
        assert x.sharding.device_set == set(devices)
        assert index_map(x.sharding, (4, 6)) == expected_map("x y -> x* y", (4, 6), devices)

    def test_mesh_means_its_flat_order(self):
        mesh = jax.make_mesh((N_DEVICES,), ("i",), devices=jax.devices()[::-1], axis_types=(AxisType.Auto,))
        x = einshard.einshard(np.zeros((N_DEVICES, 3)), "x y -> x* y", devices=mesh)
        assert index_map(x.sharding, x.shape) == expected_map("x y -> x* y", x.shape, jax.devices()[::-1])

    def test_use_devices_block(self):
        devices = jax.devices()[::-1]
        with einshard.use_devices(devices):
            inner = einshard.make_sharding("x y -> x y*", shape=(2, N_DEVICES))
        outer = einshard.make_sharding("x y -> x y*", shape=(2, N_DEVICES))
        assert index_map(inner, (2, N_DEVICES)) == expected_map("x y -> x y*", (2, N_DEVICES), devices)
        assert index_map(outer, (2, N_DEVICES)) == expected_map("x y -> x y*", (2, N_DEVICES))

    @pytest.mark.parametrize(
        ("devices", "message"),
        [([], "devices= is empty"), ([0, 1], "not a jax.Device"), ("cpu", "not a jax.Device")],
    )
    def test_bad_devices(self, devices, message):
        with pytest.raises(EinshardError, match=message):
            einshard.make_sharding("x -> x*", devices=devices)

    def test_repeated_device(self):
        device = jax.devices()[0]
        with pytest.raises(EinshardError, match="more than once"):
            einshard.make_sharding("x -> x*", devices=[device, device])


@pytest.mark.skipif(N_DEVICES % 2, reason="needs an even device count for a 2 x N/2 mesh")
class TestAmbientMesh:
    @pytest.fixture(params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
    def mesh(self, request):
        return jax.make_mesh((2, N_DEVICES // 2), ("data", "model"), axis_types=(request.param,) * 2)

    def test_spec_uses_the_mesh_axes(self, mesh):
        with jax.set_mesh(mesh):
            assert einshard.make_sharding("x y -> x y*").spec == P(None, ("data", "model"))
            assert einshard.make_sharding(f"x y -> 2 x{N_DEVICES // 2} y").spec == P("model", None)
            assert einshard.make_sharding("x y -> x2 y*").spec == P("data", "model")

    def test_layout_is_the_expressions(self, mesh):
        shape = (4, 2 * N_DEVICES)
        flat = list(mesh.devices.flat)
        with jax.set_mesh(mesh):
            x = einshard.einshard(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), "x y -> x2 y*")
            assert x.sharding.mesh == mesh
            y = jax.jit(lambda x: x * 2)(x)
        assert index_map(x.sharding, shape) == expected_map("x y -> x2 y*", shape, flat)
        np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))

    def test_inside_jit_under_the_mesh(self, mesh):
        shape = (4, 2 * N_DEVICES)
        with jax.set_mesh(mesh):
            # From a replicated input: XLA 0.12 aborts resharding (None, (data, model)) to
            # (data, model) on a 2 x 3 mesh ("Could not slice dimension 1 with size 3").
            x = einshard.einshard(np.ones(shape, np.float32), "x y -> * x y")
            y = jax.jit(lambda x: einshard.einshard(x + 1, "x y -> x2 y*"))(x)
        assert index_map(y.sharding, shape) == expected_map("x y -> x2 y*", shape, list(mesh.devices.flat))
        np.testing.assert_array_equal(np.asarray(y), 2)

    def test_mismatch_names_the_mesh_and_suggests(self, mesh):
        if N_DEVICES // 2 == 2:
            pytest.skip("every split fits a 2 x 2 mesh")
        with jax.set_mesh(mesh), pytest.raises(EinshardError) as info:
            einshard.make_sharding(f"x y -> x{N_DEVICES // 2} y2")
        message = str(info.value)
        assert f"does not fit the ambient mesh Mesh('data': 2, 'model': {N_DEVICES // 2})" in message
        suggestion = message.split("An expression that fits: ")[1].split("\n")[0].strip("'")
        with jax.set_mesh(mesh):
            fitted = einshard.make_sharding(suggestion, shape=(8 * N_DEVICES, 2 * N_DEVICES))
        assert fitted.mesh == mesh
        # The suggestion keeps every axis's shard count, reordering the elements to fit.
        assert suggestion == f"x y -> y2 x{N_DEVICES // 2}"
        assert fitted.shard_shape((8 * N_DEVICES, 2 * N_DEVICES)) == (16, N_DEVICES)


def test_tutorial_mlp_is_one_all_reduce():
    """The tutorial's 2-layer MLP: same result as unsharded, one all-reduce, no all-gather."""
    hidden = 32 * N_DEVICES
    k1, k2, k3 = jax.random.split(jax.random.key(42), 3)
    w1 = jax.random.normal(k1, (128, hidden))
    w2 = jax.random.normal(k2, (hidden, 64))
    x = jax.random.normal(k3, (8, 128))

    def forward(w1, w2, x):
        return jax.nn.relu(x @ w1) @ w2

    expected = forward(w1, w2, x)
    sharded = (
        einshard.einshard(w1, "x y -> x y*"),
        einshard.einshard(w2, "y z -> y* z"),
        einshard.einshard(x, "... -> * ..."),
    )
    out = jax.jit(forward)(*sharded)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-5, atol=2e-4)
    hlo = jax.jit(forward).lower(*sharded).compile().as_text()
    assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") == 1
    assert "all-gather" not in hlo
    assert isinstance(out.sharding, NamedSharding) or out.sharding.is_fully_replicated


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="xyab .*->0123456789", max_size=16),
    shape=st.lists(st.integers(0, 2 * N_DEVICES), max_size=3).map(tuple),
)
def test_any_string_gives_a_sharding_or_an_einshard_error(text, shape):
    """Through JAX, too: never an AssertionError, KeyError or a failure inside JAX."""
    try:
        sharding = einshard.make_sharding(text, shape=shape)
    except EinshardError:
        return
    assert index_map(sharding, shape) == expected_map(text, shape)
