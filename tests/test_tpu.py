"""The TPU generations' figures, which slices wrap around, and where a compile-only TPU device sits.

* Every figure of ``_tpu.GENERATIONS`` as Google's pages and "How to Scale Your Model" give it
  (the table below, copied from them), each with its source; a TPU target's ``Hardware`` carries
  them, and says which are assumed.
* Which axes wrap: v5e and v6e an axis of 16; v5p every axis of whole 4 x 4 x 4 cubes.
* With libtpu (``nox -s targets``): its compile-only devices carry their chip's coordinates (and,
  in a topology of several slices, ``slice_index``): this fails loudly when they stop.
"""

from __future__ import annotations

import dataclasses

import pytest

from einshard._cost.hardware import _figures, _tpu
from tests.test_targets import needs_tpu

# ruff: noqa: E501  (the program below is XLA's lines, as it prints them)

# name: (HBM, HBM B/s, bf16, int8, ICI both ways per chip, ports, one link one way, DCN per chip, dims)
PUBLISHED = {
    "v5e": (16 * 2**30, 819e9, 197e12, 393e12, 400e9, 4, 45e9, 3.125e9, 2),
    "v5p": (95 * 2**30, 2765e9, 459e12, 918e12, 1200e9, 6, 90e9, 6.25e9, 3),
    "v6e": (32 * 2**30, 1638e9, 918e12, 1836e12, 800e9, 4, 90e9, 12.5e9, 2),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_generation_has_its_published_figures_each_with_its_source(name):
    chip = _tpu.GENERATIONS[name]
    figures = (
        chip.memory_bytes, chip.memory_bandwidth, chip.matmul_peaks["bf16"], chip.matmul_peaks["s8"],
        chip.ici_bidirectional, chip.ici_ports, chip.link_one_way, chip.dcn_per_chip, chip.torus_dims,
    )  # fmt: skip
    assert figures == PUBLISHED[name]
    for field in dataclasses.fields(chip):
        if field.name not in ("name", "device_kind", "sources"):
            assert field.name in chip.sources, field.name
    assert f"docs.cloud.google.com/tpu/docs/{name}" in chip.sources["memory_bytes"]
    assert "scaling-book" in chip.sources["link_one_way"]
    # A link both ways over the ports is at most the chip's total (the book's is a little below).
    assert 2 * chip.link_one_way * chip.ici_ports <= chip.ici_bidirectional


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_tpu_target_s_hardware_carries_the_figures_and_says_what_is_assumed(name):
    hardware = _figures._tpu_hardware(name)
    chip = _tpu.GENERATIONS[name]
    assert (hardware.memory_bytes, hardware.memory_bandwidth) == (chip.memory_bytes, chip.memory_bandwidth)
    assert (
        hardware.matmul_peaks["s8"] == chip.matmul_peaks["s8"] > hardware.peak_flops_per_second
    )  # int8 runs faster
    assert hardware.matmul_peaks["f32"] == chip.peak_flops_per_second / 6  # 'highest': 6 bf16 passes
    assert (hardware.bandwidth, hardware.network_bandwidth) == (
        chip.link_one_way,
        chip.dcn_per_chip,
    )  # _torus
    for assumed in ("efficiency", "memory_efficiency", "launch_seconds", "latency"):
        assert _figures.TPU_ASSUMED in hardware.sources[assumed]


@pytest.mark.parametrize(
    ("name", "sizes", "wrapped"),
    [
        ("v5e", (16, 16), (True, True)),
        ("v5e", (8, 16), (False, True)),
        ("v5e", (2, 4), (False, False)),
        ("v6e", (4, 16), (False, True)),
        ("v5p", (4, 4, 4), (True, True, True)),
        ("v5p", (4, 4, 8), (True, True, True)),
        ("v5p", (2, 4, 4), (False, False, False)),
        ("v5p", (2, 2, 4), (False, False, False)),
    ],
)
def test_which_axes_of_a_slice_wrap_around(name, sizes, wrapped):
    assert _tpu.wraps(name, sizes) == wrapped


@dataclasses.dataclass
class _Chip:
    id: int
    coords: tuple[int, ...]
    core_on_chip: int = 0


@dataclasses.dataclass
class _SlicedChip(_Chip):
    slice_index: int = 0


def test_a_device_s_place_is_its_slice_and_its_coordinates_in_the_torus():
    devices = [_Chip(0, (0, 0, 0)), _Chip(1, (1, 0, 0)), _Chip(2, (0, 3, 0))]
    found = _tpu.places(devices, 2)
    assert found == [_tpu.Place(0, (0, 0), 0), _tpu.Place(0, (1, 0), 0), _tpu.Place(0, (0, 3), 0)]
    assert _tpu.slice_sizes(found) == (2, 4)
    sliced = _tpu.places([_SlicedChip(200003, (1, 1, 1), 0, 1)], 3)
    assert sliced == [_tpu.Place(1, (1, 1, 1), 0)]


@needs_tpu
@pytest.mark.parametrize(
    ("topology", "sizes"), [("v5e:2x4", (2, 4)), ("v6e:4x4", (4, 4)), ("v5p:2x2x4", (2, 2, 4))]
)
def test_libtpu_s_compile_only_devices_carry_their_chip_s_coordinates(topology, sizes):
    from jax.experimental import topologies

    name = topology.partition(":")[0]
    devices = sorted(topologies.get_topology_desc(topology, "tpu").devices, key=lambda d: d.id)
    assert {device.device_kind for device in devices} == {_tpu.GENERATIONS[name].device_kind}
    found = _tpu.places(devices, _tpu.GENERATIONS[name].torus_dims)
    assert _tpu.slice_sizes(found) == sizes
    assert sorted(place.coords for place in found) == sorted(_every(sizes))  # each chip once
    assert {place.slice for place in found} == {0} and {place.core for place in found} == {0}
    assert all(not hasattr(device, "slice_index") for device in devices)  # one slice: no index


@needs_tpu
def test_libtpu_makes_several_slices_and_their_devices_say_which():
    from jax.experimental import topologies

    devices = sorted(topologies.get_topology_desc("v5e:2x4", "tpu", num_slices=2).devices, key=lambda d: d.id)
    found = _tpu.places(devices, 2)
    assert [place.slice for place in found] == [0] * 8 + [1] * 8
    for index in (0, 1):  # each slice its own 2 x 4 torus, its coordinates from (0, 0)
        assert sorted(p.coords for p in found if p.slice == index) == sorted(_every((2, 4)))
    assert [device.id for device in devices] == [100000 * (s + 1) + i for s in (0, 1) for i in range(8)]


def _every(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*(range(size) for size in sizes)))


# --- gathers written as all-reduces ----------------------------------------------------------------

# Each of 4 devices writes its row of a f32[4,8] into zeros (a fused dynamic-update-slice of a
# broadcast zero, at its partition's offset), and an all-reduce sums the rows: a gather. The
# second array goes through an async copy, as XLA's TPU compiler moves it between memories; the
# third writes two rows of four (no device's 1/4), the fourth into an array that is not zeros.
PADDED = """\
HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%padded (p0: f32[4,8], p1: f32[1,8], p2: u32[]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[1,8]{1,0} parameter(1)
  %p2 = u32[] parameter(2)
  %zero = u32[] constant(0)
  ROOT %dus = f32[4,8]{1,0} dynamic-update-slice(%p0, %p1, %p2, %zero)
}

%half (q0: f32[4,8], q1: f32[2,8], q2: u32[]) -> f32[4,8] {
  %q0 = f32[4,8]{1,0} parameter(0)
  %q1 = f32[2,8]{1,0} parameter(1)
  %q2 = u32[] parameter(2)
  %zero.1 = u32[] constant(0)
  ROOT %dus.1 = f32[4,8]{1,0} dynamic-update-slice(%q0, %q1, %q2, %zero.1)
}

ENTRY %main (w: f32[1,8], v: f32[1,8], h: f32[2,8], x: f32[4,8]) -> f32[4,8] {
  %w = f32[1,8]{1,0} parameter(0)
  %v = f32[1,8]{1,0} parameter(1)
  %h = f32[2,8]{1,0} parameter(2)
  %x = f32[4,8]{1,0} parameter(3)
  %c = f32[] constant(0)
  %zeros = f32[4,8]{1,0} broadcast(%c), dimensions={}
  %pid = u32[] partition-id()
  %gathered = f32[4,8]{1,0} fusion(%zeros, %w, %pid), kind=kLoop, calls=%padded
  %moved = f32[4,8]{1,0} fusion(%zeros, %v, %pid), kind=kLoop, calls=%padded
  %copy-start = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[]) copy-start(%moved)
  %copy-done = f32[4,8]{1,0} copy-done(%copy-start)
  %halves = f32[4,8]{1,0} fusion(%zeros, %h, %pid), kind=kLoop, calls=%half
  %onto = f32[4,8]{1,0} fusion(%x, %w, %pid), kind=kLoop, calls=%padded
  %ar = (f32[4,8]{1,0}, f32[4,8]{1,0}, f32[4,8]{1,0}, f32[4,8]{1,0}) all-reduce(%gathered, %copy-done, %halves, %onto), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%ar), index=0
}
"""


def test_an_all_reduce_of_each_device_s_part_in_zeros_is_read_as_a_gather_and_said():
    from einshard._cost.pipeline._analysis import report_of_text

    report = report_of_text(PADDED)
    assert [row.kind for row in report.rows] == ["all-reduce"] * 4
    assert report.padded_gathers == (0, 1)  # not two rows of four, nor onto an array of values
    text = str(report)
    sent = 2 * 2 * 3 * 128 // 4  # two arrays of 128 B, each 2(n - 1)/n of it sent
    assert f"2 all-reduces gather: each device adds zeros but for its own part, {sent} B sent" in text
    assert "XLA's TPU compiler gathers so on a slice whose torus wraps around" in text
    ones = report_of_text(PADDED.replace("%c = f32[] constant(0)", "%c = f32[] constant(1)"))
    assert ones.padded_gathers == () and "gather" not in str(ones)  # parts written into ones are summed


@needs_tpu
@pytest.mark.parametrize("topology", ["v5e:4x4", "v6e:4x16", "v5p:2x4x4", "v5p:4x4x4"])
def test_xla_s_tpu_compiler_gathers_by_all_reduce_exactly_where_the_slice_wraps(topology):
    # A sharded array made whole on every chip: an all-gather on a slice without wraparound, an
    # all-reduce of each chip's part in zeros on one with (XLA's choice, as _tpu.wraps says).
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard._cost.pipeline._analysis import report_of_text

    name, _, shape = topology.partition(":")
    devices = sorted(topologies.get_topology_desc(topology, "tpu").devices, key=lambda d: d.id)
    mesh = Mesh(np.array(devices), ("d",))
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    whole = jax.jit(lambda w: w * 2, out_shardings=NamedSharding(mesh, P())).lower(x).compile()
    report = report_of_text(whole.as_text())
    wrapped = any(_tpu.wraps(name, [int(size) for size in shape.split("x")]))
    assert [row.kind for row in report.rows] == ["all-reduce" if wrapped else "all-gather"]
    assert report.padded_gathers == ((0,) if wrapped else ())
