"""Block-by-block placement on CPU (einshard._arrays._place): device_put's result, bit for bit.

The size thresholds are lowered here so that small arrays take the block-by-block path; each test
checks that it did, so that a case never passes by falling back to device_put unnoticed.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import einshard
from conftest import N_DEVICES
from einshard._arrays import _place

DTYPES = [np.float32, ml_dtypes.bfloat16, np.bool_, np.int32, np.int8]
# (expression, shape): split, partly and fully replicated, odd sizes
LAYOUTS = [
    ("x y -> x y*", (5, 2 * N_DEVICES)),
    ("x y -> x* y", (3 * N_DEVICES, 7)),
    ("x y -> x2 y *", (6, 7)),  # split in 2, each half on N / 2 devices
    ("x y -> x y* 2", (3, N_DEVICES)),  # split over N / 2, each block on 2 devices
    ("... -> * ...", (3, 5, 7)),
    ("... -> * ...", ()),
]


@pytest.fixture(autouse=True)
def blockwise_everywhere(monkeypatch):
    monkeypatch.setattr(_place, "BLOCKWISE_MIN_BYTES_FROM_JAX", 0)
    monkeypatch.setattr(_place, "BLOCKWISE_MIN_BLOCK_BYTES", 0)


def unaligned(values):
    """A copy 16 bytes past a 64-byte boundary: device_put copies it (it would alias an aligned one)."""
    raw = np.empty(values.nbytes + 64, np.uint8)
    start = (16 - raw.ctypes.data) % 64
    out = raw[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


def aligned(values):
    raw = np.empty(values.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


def values_of(shape, dtype, seed=0):
    numbers = np.random.default_rng(seed).standard_normal(shape) * 50
    return unaligned(np.asarray(numbers).astype(dtype))


def inputs(host, expression):
    """(name, a fresh input each call): NumPy, a jax.Array on one device, one with another sharding."""
    other = "x y -> x* y" if expression != "x y -> x* y" and host.ndim == 2 else "... -> ... *"
    if host.ndim == 2 and host.shape[0] % N_DEVICES:
        other = "x y -> x y*" if host.shape[1] % N_DEVICES == 0 else None
    makers = [
        ("numpy", lambda: host),
        ("jax, one device", lambda: jax.device_put(host, jax.devices()[N_DEVICES - 1])),
        ("jax, uncommitted", lambda: jnp.asarray(host)),
    ]
    if other is not None and other != expression and host.ndim == 2:
        sharding = einshard.make_sharding(other, shape=host.shape)
        makers.append((f"jax, {other}", lambda: jax.device_put(host, sharding)))
    return makers


def buffers(x):
    """Each shard's (device, start address, byte count); for NumPy, its own memory."""
    if isinstance(x, np.ndarray):
        return [(None, x.ctypes.data, x.nbytes)]
    return [
        (shard.device, shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
        for shard in x.addressable_shards
    ]


def sharing(result, source):
    """Which of the result's shards share memory with another shard, or with the source."""
    mine = buffers(result)
    theirs = buffers(source)
    pairs = set()
    for i, (device, start, size) in enumerate(mine):
        for j, (other, other_start, other_size) in enumerate(mine):
            if i < j and start < other_start + max(other_size, 1) and other_start < start + max(size, 1):
                pairs.add((str(device), str(other)))
        for _, source_start, source_size in theirs:
            if start < source_start + max(source_size, 1) and source_start < start + max(size, 1):
                pairs.add((str(device), "source"))
    return pairs


def check_same_as_device_put(make_input, sharding, *, blockwise=True):
    x = make_input()
    before = np.array(x, copy=True)
    if blockwise:
        assert _place._blockwise_plan(x, sharding) is not None, (
            "the case did not take the block-by-block path"
        )
    ours = _place.place_leaf(x, sharding)
    reference_input = make_input()
    reference = jax.device_put(reference_input, sharding)
    assert ours.sharding == reference.sharding
    assert ours.sharding.devices_indices_map(ours.shape) == reference.sharding.devices_indices_map(ours.shape)
    assert (ours.shape, ours.dtype, ours.weak_type, ours.committed) == (
        reference.shape,
        reference.dtype,
        reference.weak_type,
        reference.committed,
    )
    assert np.asarray(ours).tobytes() == np.asarray(reference).tobytes()
    for mine, theirs in zip(ours.addressable_shards, reference.addressable_shards, strict=True):
        assert (mine.device, mine.index) == (theirs.device, theirs.index)
        assert np.asarray(mine.data).tobytes() == np.asarray(theirs.data).tobytes()
    # No buffer shared where device_put shares none (with another shard or with the input)
    assert sharing(ours, x) <= sharing(reference, reference_input)
    # The input is intact, and the result does not see later writes to a NumPy input
    assert np.asarray(x).tobytes() == before.tobytes()
    if isinstance(x, np.ndarray) and x.size:
        x.reshape(-1)[0] = ~x.reshape(-1)[0] if x.dtype == np.bool_ else x.reshape(-1)[0] + 1
        assert np.asarray(ours).tobytes() == np.asarray(reference).tobytes()
        x.reshape(-1)[0] = before.reshape(-1)[0]
    return ours


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(("expression", "shape"), LAYOUTS, ids=lambda v: str(v))
def test_bit_for_bit_as_device_put(expression, shape, dtype):
    host = values_of(shape, dtype)
    sharding = einshard.make_sharding(expression, shape=shape)
    for _, make_input in inputs(host, expression):
        check_same_as_device_put(make_input, sharding)


def test_each_block_is_the_buffer_it_was_copied_into(monkeypatch):
    """The CPU client takes the aligned block as the device buffer, uncopied (the speed depends on it)."""
    made = []
    filled_block = _place._filled_block

    def spy(job):
        block = filled_block(job)
        made.append(block.ctypes.data)
        return block

    monkeypatch.setattr(_place, "_filled_block", spy)
    sharding = einshard.make_sharding("x y -> x y* 2", shape=(16, 2 * N_DEVICES))
    placed = _place.place_leaf(values_of((16, 2 * N_DEVICES), np.float32), sharding)
    assert sorted(shard.data.unsafe_buffer_pointer() for shard in placed.addressable_shards) == sorted(made)
    assert len(set(made)) == N_DEVICES


def test_one_device_input_keeps_its_buffer_where_device_put_does():
    host = values_of((4, 8), np.float32)
    source = jax.device_put(host, jax.devices()[0])
    placed = check_same_as_device_put(
        lambda: source, einshard.make_sharding("... -> * ...", shape=host.shape)
    )
    assert placed.addressable_shards[0].data.unsafe_buffer_pointer() == source.unsafe_buffer_pointer()
    assert len({shard.data.unsafe_buffer_pointer() for shard in placed.addressable_shards}) == N_DEVICES


def test_many_copies_in_parallel(monkeypatch):
    monkeypatch.setattr(_place, "_PARALLEL_MIN_BYTES", 0)
    host = values_of((4 * N_DEVICES, 64), np.float32)
    for expression in ("x y -> x* y", "... -> * ..."):
        check_same_as_device_put(lambda: host, einshard.make_sharding(expression, shape=host.shape))


def test_a_donated_result_computes_correctly():
    host = values_of((2 * N_DEVICES, 16), np.float32)
    placed = _place.place_leaf(host, einshard.make_sharding("x y -> x* y", shape=host.shape))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        doubled = jax.jit(lambda v: v * 2, donate_argnums=0)(placed)
    np.testing.assert_array_equal(np.asarray(doubled), host * 2)


def test_a_tree_mixes_both_paths(monkeypatch):
    monkeypatch.setattr(_place, "BLOCKWISE_MIN_BYTES_FROM_JAX", 1024)
    monkeypatch.setattr(_place, "BLOCKWISE_MIN_BLOCK_BYTES", 1024)
    big = values_of((N_DEVICES, 256), np.float32)
    tree = {"big": big, "big_jax": jnp.asarray(big), "small": values_of((N_DEVICES, 2), np.int32), "n": 3}
    shardings = {
        "big": einshard.make_sharding("... -> * ...", shape=big.shape),
        "big_jax": einshard.make_sharding("x y -> x* y", shape=big.shape),
        "small": einshard.make_sharding("x y -> x* y", shape=(N_DEVICES, 2)),
        "n": None,
    }
    assert _place._blockwise_plan(tree["small"], shardings["small"]) is None
    ours = _place.place_tree(tree, shardings)
    assert ours["n"] == 3
    for key in ("big", "big_jax", "small"):
        reference = jax.device_put(tree[key], shardings[key])
        assert ours[key].sharding == reference.sharding
        assert np.asarray(ours[key]).tobytes() == np.asarray(reference).tobytes()


@pytest.mark.parametrize(
    ("case", "make_input"),
    [
        (
            "aligned NumPy (device_put may alias it)",
            lambda: aligned(np.full((N_DEVICES, 3), 2.0, np.float32)),
        ),
        ("float64, converted by device_put", lambda: unaligned(np.ones((N_DEVICES, 3)))),
        ("weakly typed", lambda: jnp.full((N_DEVICES, 3), 1.5)),
        ("a Python float", lambda: 2.5),
    ],
)
def test_left_to_device_put(case, make_input):
    x = make_input()
    if case == "weakly typed":
        assert x.weak_type
    shape = np.shape(x)
    sharding = einshard.make_sharding("x y -> x* y" if shape else "... -> * ...", shape=shape)
    assert _place._blockwise_plan(x, sharding) is None
    ours = _place.place_leaf(x, sharding)
    reference = jax.device_put(x, sharding)
    assert (ours.dtype, ours.weak_type, ours.sharding) == (
        reference.dtype,
        reference.weak_type,
        reference.sharding,
    )
    assert np.asarray(ours).tobytes() == np.asarray(reference).tobytes()


def test_the_same_sharding_is_left_to_device_put():
    host = values_of((N_DEVICES, 3), np.float32)
    sharding = einshard.make_sharding("x y -> x* y", shape=host.shape)
    placed = jax.device_put(host, sharding)
    assert _place._blockwise_plan(placed, sharding) is None
    assert _place.place_leaf(placed, sharding) is placed  # as device_put returns it
