"""A TPU target's collectives on the torus axes they use, and between slices on DCN.

The worked table (an all-gather of 1 GiB per device, by hand from the figures: one ICI link one
way carries 45 GB/s on a v5e, 90 on a v5p; DCN 3.125 GB/s per v5e chip; 1 us per ring step on
ICI, 5 us between slices). Before: every TPU collective at half the chip's bidirectional ICI
bandwidth (200 GB/s on a v5e, 600 on a v5p), whatever axes it used.

| group | links one way | GB/s | seconds |
| --- | --- | --- | --- |
| v5e 4x4, a row of 4 (no wraparound) | 1 | 45 | 3/4 GiB / 45e9 + 3 us |
| v5e 16x16, a row of 16 (wraps) | 2 | 90 | 15/16 GiB / 90e9 + 15 us |
| v5e 4x4, all 16 (two axes) | 2 | 90 | 15/16 GiB / 90e9 + 15 us |
| v5p 4x4x4, all 64 (three wrapped axes) | 6 | 540 | 63/64 GiB / 540e9 + 63 us |
| 2 slices of v5e 4x4, a chip and its copy | DCN | 3.125 | 1/2 GiB / 3.125e9 + 5 us |
| 2 slices of v5e 4x4, all 32 | DCN x 16 | 50 | 31/32 GiB / 50e9 + 5 us + 30 us |
"""

from __future__ import annotations

import itertools

import pytest

from einshard import EinshardError
from einshard._cost.hardware import _figures, _target, _tpu
from einshard._cost.hardware._links import OneLink
from einshard._cost.hardware._torus import TpuTorus
from tests.test_targets import needs_tpu

GiB = 2**30
US = 1e-6


def torus(name: str, sizes: tuple[int, ...], slices: int = 1) -> TpuTorus:
    """The links of ``slices`` slices of ``sizes``, at the generation's figures (no libtpu needed).

    A target's own figures make the same torus: ``test_a_tpu_target_s_figures_make_the_torus...``
    (with libtpu, which a TPU target's figures check for).
    """
    chip = _tpu.GENERATIONS[name]
    return TpuTorus(
        name, sizes, slices, chip.link_one_way, _figures.ICI_LATENCY, chip.dcn_per_chip, _figures.DCN_LATENCY
    )


def _prod(sizes: tuple[int, ...]) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out


# (generation, slice, slices, group, links one way (or None: DCN), seconds of an all-gather of 1 GiB)
TABLE = [
    ("v5e", (4, 4), 1, (0, 1, 2, 3), 1, 3 / 4 * GiB / 45e9 + 3 * US),
    ("v5e", (16, 16), 1, tuple(range(16)), 2, 15 / 16 * GiB / 90e9 + 15 * US),
    ("v5e", (4, 4), 1, tuple(range(16)), 2, 15 / 16 * GiB / 90e9 + 15 * US),
    ("v5p", (4, 4, 4), 1, tuple(range(64)), 6, 63 / 64 * GiB / 540e9 + 63 * US),
    ("v5e", (4, 4), 2, (0, 16), None, 1 / 2 * GiB / 3.125e9 + 5 * US),
    ("v5e", (4, 4), 2, tuple(range(32)), None, 31 / 32 * GiB / 50e9 + 5 * US + 30 * US),
]


@pytest.mark.parametrize(("name", "sizes", "slices", "group", "links", "seconds"), TABLE)
def test_the_worked_table(name, sizes, slices, group, links, seconds):
    model = torus(name, sizes, slices)
    if links is not None:
        assert model.links_of(group) == links
    assert model.seconds("all-gather", GiB, (group,)) == pytest.approx(seconds)


def test_one_axis_segment_wrapped_axis_and_three_axes_by_kind():
    v5e = torus("v5e", (16, 16))
    # A segment of 4 of a wrapped axis of 16 runs out and back: one link.
    assert v5e.links_of((0, 1, 2, 3)) == 1
    # The axis of 16 in y (ids 16 apart): wraps, two links.
    assert v5e.links_of(tuple(16 * i for i in range(16))) == 2
    v5p = torus("v5p", (4, 4, 4))
    assert v5p.links_of((0, 1, 2, 3)) == 2  # one wrapped axis: 180 GB/s
    assert v5p.links_of((0, 16, 32, 48)) == 2  # z
    assert v5p.links_of(tuple(range(16))) == 4  # x and y
    # An all-reduce: 2(n-1)/n of the array, 2(n-1) steps; on all 64: 6 links.
    assert v5p.seconds("all-reduce", GiB, (tuple(range(64)),)) == pytest.approx(
        2 * 63 / 64 * GiB / 540e9 + 126 * US
    )
    # v5p smaller than whole cubes: no axis wraps, one link per axis.
    assert torus("v5p", (2, 2, 4)).links_of(tuple(range(16))) == 3


def test_interleaved_groups_share_their_links():
    # v5e 2x4: the groups (0, 4), (1, 5) ... lie 2 apart along y; (0, 4) and (2, 6) share the
    # link y1-y2, so each runs at half a link.
    v5e = torus("v5e", (2, 4))
    assert v5e.links_of((0, 4)) == 0.5
    assert v5e.seconds("all-gather", GiB, ((0, 4), (2, 6))) == pytest.approx(1 / 2 * GiB / 22.5e9 + US)


@pytest.mark.parametrize(
    ("name", "sizes"), [("v5e", (16, 16)), ("v5e", (4, 8)), ("v6e", (16, 4)), ("v5p", (4, 4, 8))]
)
def test_a_collective_on_one_axis_is_never_faster_than_two_links(name, sizes):
    model = torus(name, sizes)
    link = _tpu.GENERATIONS[name].link_one_way
    for axis, size in enumerate(sizes):
        stride = _prod(sizes[:axis])
        for start, length in itertools.product(range(size), range(2, size + 1)):
            if start + length > size:
                continue
            group = tuple(stride * (start + i) for i in range(length))
            assert model.links_of(group) <= 2
            n = len(group)
            assert model.seconds("all-gather", GiB, (group,)) >= (n - 1) / n * GiB / (2 * link)


def test_where_a_device_is_slices_hosts_and_the_bounds():
    model = torus("v5e", (4, 4), slices=2)
    assert model.place(5) == _tpu.Place(0, (1, 1), 0)
    assert model.place(16 + 7) == _tpu.Place(1, (3, 1), 0)
    assert model.place(200007) == _tpu.Place(1, (3, 1), 0)  # libtpu's id of that chip
    assert [model.host(d) for d in (0, 15, 16, 31, 100003, 200000)] == [0, 0, 1, 1, 0, 1]
    # A lower bound: every link of the chip (4 x 45 GB/s) and its DCN for what leaves the slice.
    assert model.least_seconds(GiB, GiB / 4) == pytest.approx(3 / 4 * GiB / 180e9 + 1 / 4 * GiB / 3.125e9)
    assert model.assumed() == (
        "ICI 45 GB/s per link one way, v5e 4x4 torus (no axis wraps): 2 links per wrapped axis a "
        "collective spans, 1 per other; latency 1 µs; 2 slices joined by DCN at 3.125 GB/s per chip, "
        "latency 5 µs"
    )


@needs_tpu
def test_a_tpu_target_s_figures_make_the_torus_and_a_bandwidth_given_is_every_collective_s():
    figures = _figures.resolve_figures(_target.parse_target("v5p", 64))
    assert figures.links == TpuTorus("v5p", (4, 4, 4), 1, 90e9, 1e-6, 6.25e9, 5e-6)
    two_slices = _figures.resolve_figures(_target.parse_target("v5e:4x4", None, 2)).links
    assert two_slices == torus("v5e", (4, 4), slices=2)  # the table's torus is the target's
    given = figures.at(bandwidth=100e9)
    assert given.links == OneLink(100e9, 1e-6, None)
    link = _figures.resolve_figures(_target.parse_target("v5e", 16), {"bandwidth": 40e9}).links
    assert isinstance(link, TpuTorus) and link.link == 40e9  # hardware= changes the link's rate


@pytest.mark.parametrize(
    ("target", "n_devices", "slices", "expected"),
    [
        ("v5e", 32, 2, ("v5e:4x4", 2, 32, "32 V5E (2 slices of v5e:4x4)")),
        ("v5e:2x4", None, 2, ("v5e:2x4", 2, 16, "16 V5E (2 slices of v5e:2x4)")),
        ("v5p:4x4x4", 128, 2, ("v5p:4x4x4", 2, 128, "128 V5P (2 slices of v5p:4x4x4)")),
        ("v6e", 8, 1, ("v6e:2x4", 1, 8, "8 V6E (v6e:2x4)")),
    ],
)
def test_slices_of_a_tpu_target(target, n_devices, slices, expected):
    chosen = _target.parse_target(target, n_devices, slices)
    assert (chosen.topology, chosen.slices, chosen.n_devices, chosen.label) == expected


@pytest.mark.parametrize(
    ("target", "n_devices", "slices", "message"),
    [
        ("v5e", 16, 0, "slices=0 must be a whole number above 0"),
        ("v5e", 16, 2.0, "slices=2.0 must be a whole number above 0"),
        ("v5e", 16, True, "slices=True must be a whole number above 0"),
        ("h100", 16, 2, "slices=2 needs a TPU target, not target='h100'"),
        ("cpu", 16, 2, "slices=2 needs a TPU target, not target='cpu'"),
        ("v5e", 12, 8, "n_devices=12 cannot be cut into slices=8 slices of the same size"),
        ("v5e:2x4", 8, 2, "target='v5e:2x4' with slices=2 has 16 chips, not n_devices=8"),
    ],
)
def test_slices_that_cannot_be_are_errors_with_hints(target, n_devices, slices, message):
    with pytest.raises(EinshardError) as raised:
        _target.parse_target(target, n_devices, slices)
    assert str(raised.value).splitlines()[0] == message
    assert raised.value.hint


# --- with libtpu -----------------------------------------------------------------------------------


@needs_tpu
@pytest.mark.parametrize(("topology", "slices"), [("v5e:4x4", 1), ("v5p:4x4x4", 1), ("v5e:2x4", 2)])
def test_a_device_s_place_is_libtpu_s_own(topology, slices):
    from jax.experimental import topologies

    name, _, shape = topology.partition(":")
    sizes = tuple(int(s) for s in shape.split("x"))
    devices = sorted(
        topologies.get_topology_desc(topology, "tpu", num_slices=slices).devices, key=lambda d: d.id
    )
    model = torus(name, sizes, slices)
    found = _tpu.places(devices, _tpu.GENERATIONS[name].torus_dims)
    assert [model.place(position) for position in range(len(devices))] == found
    assert [model.place(device.id) for device in devices] == found


@needs_tpu
def test_two_slices_fsdp_program_sends_between_slices_at_dcn():
    # FSDP over 2 slices of v5e 2x4: XLA's program is one slice's; its gathers and reductions go
    # on ICI inside the slice, and between the slices as megascale transfers, read as collectives
    # over a chip and its copy, timed at DCN.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard._cost.pipeline._analysis import report_of_text
    from einshard._cost.report._report import estimated

    devices = sorted(topologies.get_topology_desc("v5e:2x4", "tpu", num_slices=2).devices, key=lambda d: d.id)
    mesh = Mesh(np.array(devices), ("d",))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d")))

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).sum())(w)

    text = jax.jit(step).lower(w, x).compile().as_text()
    report = report_of_text(text, platform="tpu")
    across = [row for row in report.rows if row.group_size == 2]
    assert sorted(row.kind for row in across) == ["all-gather", "all-reduce"]
    assert all(row.groups[0] == (0, 8) for row in across)  # a chip and its copy on slice 1
    gather = next(row for row in across if row.kind == "all-gather")
    assert gather.bytes == 2 * 64 * 1024 * 4  # the gathered result of two slices' rows
    figures = _figures.resolve_figures(_target.parse_target("v5e:2x4", None, 2))
    timed = estimated(report, figures)
    row = next(r for r in timed.rows if r.kind == "all-gather" and r.group_size == 2)
    assert row.seconds == pytest.approx(row.times * (1 / 2 * row.bytes / 3.125e9 + 5 * US))
