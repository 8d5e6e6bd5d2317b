"""The step report's traffic against the textbook ring volumes, one collective kind at a time.

Each step is built so that the compiled program has exactly one collective, of the kind under
test (checked on the program's own text); the report's row must then send what the ring
algorithm sends, worked out here by hand from the shapes: for a group of ``g`` devices and a
buffer of ``S`` bytes, all-reduce ``2(g-1)/g * S``, all-gather ``(g-1)/g * S`` (``S`` the
gathered result), reduce-scatter ``(g-1)/g * S`` (``S`` the input), all-to-all ``(g-1)/g * S``,
collective-permute ``S``; the latency is paid ``2(g-1)``, ``g-1``, ``g-1``, ``g-1`` and ``1``
times. Every buffer is sized so that these are whole numbers of bytes at 6, 8 and 16 devices,
so the comparisons are exact. Each kind runs over all devices and over one axis of a
``(2, N/2)`` mesh (groups smaller than the device count), and inside a loop (its trip count
multiplies it); a combined (tuple) all-reduce counts every array and its latency once; the data
parallel and FSDP steps of the docs add up to their textbook volumes.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard

N = jax.device_count()
BANDWIDTH, LATENCY = 1e9, 1e-6
F32 = 4  # bytes

# The kinds, as the report names them; each test writes its ring volume out by hand.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
pytestmark = pytest.mark.skipif(N < 4 or N % 2, reason="needs an even device count, 4 or more")

# An instruction's opcode is the first word followed by "(" after its name and type; a tuple
# type may hold "/*index=5*/" comments, so the type is skipped lazily, not parsed.
_OPCODE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=.*?\s"
    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
)


def collectives_in(fn, *args) -> collections.Counter:
    """The collective instructions of ``fn``'s compiled program, by kind (an async pair counts once)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return collections.Counter(m.group(1) for line in text.splitlines() if (m := _OPCODE.search(line)))


def the_mesh(groups: str) -> tuple[Mesh, int]:
    """A mesh whose axis ``'d'`` holds all devices (``'all'``), or half of them beside a ``'data'``
    axis of 2 (``'half'``); returns it with the size of ``'d'``: the collective's group."""
    devices = np.array(jax.devices())
    if groups == "all":
        return Mesh(devices, ("d",)), N
    return Mesh(devices.reshape(2, N // 2), ("data", "d")), N // 2


def placed(mesh: Mesh, shape: tuple[int, ...], spec: P) -> jax.Array:
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) / 1000
    return jax.device_put(x, NamedSharding(mesh, spec))


def report_of(fn, *args) -> einshard.StepReport:
    return einshard.explain_step(fn, *args, bandwidth=BANDWIDTH, latency=LATENCY)


def the_rows(report: einshard.StepReport, kind: str) -> list:
    """The report's rows, after checking they are one collective instruction of this kind."""
    assert {row.kind for row in report.rows} == {kind}, report
    assert report.collectives == 1, report
    return list(report.rows)


GROUPS = ["all", "half"]


# --- one kind at a time -------------------------------------------------------------------------


@pytest.mark.parametrize("groups", GROUPS)
def test_all_reduce_sends_twice_g_minus_one_over_g_of_its_buffer(groups):
    mesh, g = the_mesh(groups)
    x = placed(mesh, (2 * g, 96), P("d", None))  # rows split over 'd': the column sums are partial

    def step(x):
        return jax.lax.with_sharding_constraint(x.sum(0), NamedSharding(mesh, P()))

    assert collectives_in(step, x) == {"all-reduce": 1}
    report = report_of(step, x)
    (row,) = the_rows(report, "all-reduce")
    size = 96 * F32  # f32[96] on each device: 384 bytes
    assert (row.bytes, row.group_size, row.times) == (size, g, 1)
    assert row.traffic == 2 * (g - 1) * size / g  # 672 bytes at g = 8, 640 at 6, 720 at 16
    assert report.traffic == row.traffic
    assert row.seconds == pytest.approx(row.traffic / BANDWIDTH + 2 * (g - 1) * LATENCY, rel=1e-9)
    np.testing.assert_allclose(step(x), np.asarray(x).sum(0), rtol=1e-6)


@pytest.mark.parametrize("groups", GROUPS)
def test_all_gather_sends_g_minus_one_over_g_of_the_gathered_array(groups):
    mesh, g = the_mesh(groups)
    x = placed(mesh, (48, 2), P("d", None))  # 48 rows: they divide by 3, 4, 6, 8 and 16

    def step(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P()))

    assert collectives_in(step, x) == {"all-gather": 1}
    report = report_of(step, x)
    (row,) = the_rows(report, "all-gather")
    size = 48 * 2 * F32  # the gathered f32[48, 2]: 384 bytes on each device
    assert (row.bytes, row.shape, row.group_size) == (size, (48, 2), g)
    assert row.traffic == (g - 1) * size / g  # 336 bytes at g = 8
    assert row.seconds == pytest.approx(row.traffic / BANDWIDTH + (g - 1) * LATENCY, rel=1e-9)
    np.testing.assert_allclose(step(x), 2 * np.asarray(x), rtol=1e-6)


@pytest.mark.parametrize("groups", GROUPS)
def test_reduce_scatter_sends_g_minus_one_over_g_of_its_input(groups):
    mesh, g = the_mesh(groups)
    x = placed(mesh, (48, 2), P())  # every device holds the whole f32[48, 2]

    def scatter(block):
        return jax.lax.psum_scatter(block, "d", scatter_dimension=0, tiled=True)

    step = jax.shard_map(scatter, mesh=mesh, in_specs=P(), out_specs=P("d", None))
    assert collectives_in(step, x) == {"reduce-scatter": 1}
    report = report_of(step, x)
    (row,) = the_rows(report, "reduce-scatter")
    size = 48 * 2 * F32  # the input, 384 bytes; each device keeps 1/g of the sum
    assert (row.bytes, row.shape, row.group_size) == (size, (48, 2), g)
    assert row.traffic == (g - 1) * size / g
    assert row.seconds == pytest.approx(row.traffic / BANDWIDTH + (g - 1) * LATENCY, rel=1e-9)
    np.testing.assert_allclose(step(x), g * np.asarray(x), rtol=1e-6)


@pytest.mark.parametrize("groups", GROUPS)
def test_all_to_all_sends_g_minus_one_over_g_of_each_block(groups):
    mesh, g = the_mesh(groups)
    # Rows split over 'd', resharded to columns split over 'd'. Each device's block is
    # f32[g, 4g] (16 g² bytes); XLA may send it as g arrays of 16 g bytes, so each array's
    # share is a whole number of bytes too.
    x = placed(mesh, (g * g, 4 * g), P("d", None))

    def step(x):
        return jax.lax.with_sharding_constraint(x + 1, NamedSharding(mesh, P(None, "d")))

    assert collectives_in(step, x) == {"all-to-all": 1}
    report = report_of(step, x)
    rows = the_rows(report, "all-to-all")
    size = g * 4 * g * F32  # the block each device holds: 1024 bytes at g = 8
    assert sum(row.bytes for row in rows) == size
    assert {row.group_size for row in rows} == {g}
    assert report.traffic == sum(row.traffic for row in rows) == (g - 1) * size / g
    # One instruction: its latency is paid once, for g - 1 steps.
    assert report.communication_seconds == pytest.approx(
        report.traffic / BANDWIDTH + (g - 1) * LATENCY, rel=1e-9
    )
    np.testing.assert_allclose(step(x), np.asarray(x) + 1, rtol=1e-6)


@pytest.mark.parametrize("groups", GROUPS)
def test_collective_permute_sends_its_buffer_once(groups):
    mesh, g = the_mesh(groups)
    x = placed(mesh, (3 * g, 8), P("d", None))  # each device's block: f32[3, 8], 96 bytes
    ring = [(i, (i + 1) % g) for i in range(g)]

    def shift(block):
        return jax.lax.ppermute(block, "d", ring)

    step = jax.shard_map(shift, mesh=mesh, in_specs=P("d", None), out_specs=P("d", None))
    assert collectives_in(step, x) == {"collective-permute": 1}
    report = report_of(step, x)
    (row,) = the_rows(report, "collective-permute")
    size = 3 * 8 * F32
    assert (row.bytes, row.group_size) == (size, g)  # one cycle through the g devices of 'd'
    assert row.traffic == size
    assert row.seconds == pytest.approx(size / BANDWIDTH + 1 * LATENCY, rel=1e-9)
    np.testing.assert_allclose(step(x), np.roll(np.asarray(x), 3, axis=0))  # block i goes to i + 1


# --- inside a loop: the trip count multiplies the volume ------------------------------------------

TRIPS = 5


def _loop_body(kind: str, g: int):
    """One step of a loop over a device's block f32[2g, 6] whose only collective is ``kind``.

    Every step's collective reads the carry, so XLA cannot hoist it out of the loop. Returns
    the body and, by hand, the collective's buffer ``S`` in bytes, what one run sends, and its
    ring steps.
    """
    block = 2 * g * 6 * F32  # 48 g bytes
    if kind == "all-reduce":
        return (lambda c: c + jax.lax.psum(c, "d") * 0.5), (block, 2 * (g - 1) * 48, 2 * (g - 1))
    if kind == "all-gather":

        def gather(c):
            whole = jax.lax.all_gather(c, "d", tiled=True)  # f32[2g², 6]: 48 g² bytes
            return c + whole.reshape(g, 2 * g, 6).sum(0) * 0.5

        return gather, (g * block, (g - 1) * 48 * g, g - 1)
    if kind == "reduce-scatter":

        def scatter(c):
            return jnp.tile(jax.lax.psum_scatter(c, "d", scatter_dimension=0, tiled=True), (g, 1)) * 0.5

        return scatter, (block, (g - 1) * 48, g - 1)
    if kind == "all-to-all":

        def exchange(c):
            return jax.lax.all_to_all(c, "d", 0, 0, tiled=True) + 1

        return exchange, (block, (g - 1) * 48, g - 1)
    ring = [(i, (i + 1) % g) for i in range(g)]
    return (lambda c: jax.lax.ppermute(c, "d", ring) + 1), (block, block, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_collective_in_a_loop_runs_its_trip_count_times(kind):
    mesh, g = the_mesh("all")
    body, (size, sent, steps) = _loop_body(kind, g)

    def loop(block):
        return jax.lax.fori_loop(0, TRIPS, lambda _, c: body(c), block)

    step = jax.shard_map(loop, mesh=mesh, in_specs=P("d", None), out_specs=P("d", None))
    x = placed(mesh, (2 * g * g, 6), P("d", None))
    assert collectives_in(step, x) == {kind: 1}
    report = report_of(step, x)
    rows = the_rows(report, kind)
    assert all((row.times, row.times_known, row.group_size) == (TRIPS, True, g) for row in rows)
    assert sum(row.bytes for row in rows) == size
    assert report.bytes == TRIPS * size
    assert report.traffic == TRIPS * sent
    assert report.communication_seconds == pytest.approx(
        TRIPS * (sent / BANDWIDTH + steps * LATENCY), rel=1e-9
    )


def test_a_scan_over_layers_reduces_once_per_layer():
    """The partitioner's own collective in a loop: each layer's partial sums, all-reduced."""
    mesh, g = the_mesh("all")
    weights = placed(mesh, (TRIPS, 4 * g, 4 * g), P(None, "d", None))  # each layer's rows split
    h = placed(mesh, (4, 4 * g), P(None, "d"))

    def layers(weights, h):
        def layer(h, w):
            out = jnp.tanh(h @ w)  # f32[4, 4g] of partial sums: all-reduced
            return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(None, "d"))), None

        return jax.lax.scan(layer, h, weights)[0]

    assert collectives_in(layers, weights, h) == {"all-reduce": 1}
    report = report_of(layers, weights, h)
    (row,) = the_rows(report, "all-reduce")
    size = 4 * 4 * g * F32  # 64 g bytes
    assert (row.bytes, row.times, row.times_known) == (size, TRIPS, True)
    assert report.traffic == TRIPS * 2 * (g - 1) * size / g  # 4,480 bytes at 8 devices
    assert report.communication_seconds == pytest.approx(
        TRIPS * (2 * (g - 1) * size / g / BANDWIDTH + 2 * (g - 1) * LATENCY), rel=1e-9
    )


# --- combined collectives and whole steps ---------------------------------------------------------


def test_a_combined_all_reduce_counts_every_array_and_its_latency_once():
    mesh, g = the_mesh("all")
    x = placed(mesh, (2 * g, 96), P("d", None))

    def step(x):
        sums = (x.sum(0), (x * x)[:, :48].sum(0))  # f32[96] and f32[48], reduced together
        return jax.lax.with_sharding_constraint(sums, NamedSharding(mesh, P()))

    assert collectives_in(step, x) == {"all-reduce": 1}
    report = report_of(step, x)
    rows = the_rows(report, "all-reduce")
    assert sorted(row.bytes for row in rows) == [48 * F32, 96 * F32]
    assert len({row.instruction for row in rows}) == 1
    size = (96 + 48) * F32  # 576 bytes travel in one ring
    assert report.bytes == size
    assert report.traffic == 2 * (g - 1) * size / g
    assert report.communication_seconds == pytest.approx(
        report.traffic / BANDWIDTH + 2 * (g - 1) * LATENCY, rel=1e-9
    )


D, H = 48, 96  # the layer sizes of the steps below; the weights divide by 6, 8 and 16


def sgd_step(params, batch):
    def loss(p):
        return jnp.mean(jnp.tanh(batch @ p["w1"]) @ p["w2"])

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, gr: p - 0.1 * gr, params, grads)


def fsdp_step(params, batch):
    """As ``sgd_step``, with the activations kept split by the batch, as FSDP keeps them."""

    def loss(p):
        h = einshard.einshard(jnp.tanh(batch @ p["w1"]), "b h -> b* h")
        return jnp.mean(einshard.einshard(h @ p["w2"], "b d -> b* d"))

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, gr: p - 0.1 * gr, params, grads)


def _abstract_params() -> dict:
    return {
        "w1": jax.ShapeDtypeStruct((D, H), jnp.float32),
        "w2": jax.ShapeDtypeStruct((H, D), jnp.float32),
    }


WEIGHTS = (D * H + H * D) * F32  # 36,864 bytes


def test_data_parallel_sends_twice_n_minus_one_over_n_of_the_weights():
    batch = jax.ShapeDtypeStruct((4 * N, D), jnp.float32)
    rules = [(r"^batch$", "b d -> b* d"), (r".*", "... -> * ...")]
    report = einshard.explain_step(sgd_step, _abstract_params(), batch, rules=rules)
    assert {row.kind for row in report.rows} == {"all-reduce"}
    assert sorted(row.param for row in report.rows) == ["params/w1", "params/w2"]
    assert report.bytes == WEIGHTS
    assert report.traffic == 2 * (N - 1) * WEIGHTS / N  # 64,512 bytes at 8 devices


def test_fsdp_gathers_the_weights_by_the_textbook_volume():
    batch = jax.ShapeDtypeStruct((4 * N, D), jnp.float32)
    rules = [(r"^batch$", "b d -> b* d"), (r"w1$", "d h -> d h*"), (r"w2$", "h d -> h* d")]
    report = einshard.explain_step(fsdp_step, _abstract_params(), batch, rules=rules)
    gathers = [row for row in report.rows if row.kind == "all-gather"]
    assert sorted((row.param, row.bytes) for row in gathers) == [
        ("params/w1", D * H * F32),
        ("params/w2", H * D * F32),
    ]
    assert sum(row.traffic for row in gathers) == (N - 1) * WEIGHTS / N  # 32,256 bytes at 8
    # The gradients: reduced whole (an all-reduce on CPU) or scattered (GPU, TPU).
    reduces = [row for row in report.rows if row.kind != "all-gather"]
    assert sum(row.bytes for row in reduces) == WEIGHTS
    share = {"all-reduce": 2 * (N - 1) / N, "reduce-scatter": (N - 1) / N}
    assert sum(row.traffic for row in reduces) == sum(share[row.kind] * row.bytes for row in reduces)
