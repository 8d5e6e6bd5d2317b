"""The devices' links: a collective's time on GPU hosts, against worked numbers and nccl-tests.

A group with ``g`` devices on each of ``h`` hosts, across hosts, costs ``f(n) B / min(g x share,
NVLink x g / (g - 1))`` (``f``: ``(n-1)/n`` for an all-gather or reduce-scatter, ``2(n-1)/n`` for
an all-reduce; ``share``: the NICs of a host over its GPUs, one NIC per GPU on a DGX), with the
network's latency on the ``2(h-1)`` (all-reduce) or ``h-1`` steps between hosts and NVLink's on
the others. The numbers below are worked by hand from the DGX figures (NVLink 300 / 450 / 900
GB/s per A100 / H100 / B200; one NIC per GPU at what NCCL reaches, 24 GB/s on 200 Gb/s, 48 GB/s on
400 Gb/s; 1 us per step on NVLink, 5 us between hosts), not from the module's formulas.

Measured (the rule pinned to them): an all-reduce of 1 GiB over 4 DGX H100 hosts (32 GPUs, 8 x
400 Gb/s NICs each) reaches 331-366 GB/s of bus bandwidth in nccl-tests (NVIDIA/nccl-tests#309:
365.84 GB/s over 4 nodes of 8 GPU-NIC pairs; #319); NCCL's maintainers quote 46-48 GB/s per 400
Gb/s NIC (NVIDIA/nccl-tests#290) and 24 GB/s per 200 Gb/s one (NVIDIA/nccl-tests#119); NVIDIA
measures 192 GB/s across DGX A100 nodes (8 x 200 Gb/s).
"""

from __future__ import annotations

import dataclasses

import pytest

import einshard
from einshard._cost.hardware import _compilers, _figures, _links, _target
from einshard._cost.report._report import estimated
from tests.test_targets import needs_gpu

GiB = 2**30
US = 1e-6
# (compute capability, NVLink links): what XLA's specs give (the A100's spec has none: 12).
GPUS = {"a100": (8, None), "h100": (9, 18), "b200": (10, 18)}
# Bytes per second across 4 hosts, per g (devices of the group on each host), worked by hand.
ACROSS = {
    "a100": {1: 24e9, 2: 48e9, 4: 96e9, 8: 192e9},  # g x 24 GB/s; NVLink x g/(g-1) = 600, 400, 342.9
    "h100": {1: 48e9, 2: 96e9, 4: 192e9, 8: 384e9},  # g x 48 GB/s; NVLink x g/(g-1) = 900, 600, 514.3
    "b200": {1: 48e9, 2: 96e9, 4: 192e9, 8: 384e9},  # g x 48 GB/s; NVLink x g/(g-1) = 1800, 1200, 1028.6
}
NVLINK = {"a100": 300e9, "h100": 450e9, "b200": 900e9}


def links(gpu: str, **changes) -> _links.GpuHosts:
    """A DGX of ``gpu`` as the target's figures make it (``changes``: figures given instead)."""
    major, count = GPUS[gpu]
    figures, sources = _links.gpu_wiring(major, count, "a spec")
    assert set(figures) <= set(sources)  # every figure with its source
    figures = {**figures, **changes}
    return _links.GpuHosts(
        figures["devices_per_host"],
        figures["bandwidth"],
        figures["latency"],
        figures["nics_per_host"],
        figures["network_bandwidth"],
        figures["network_latency"],
    )


def spread(g: int, hosts: int = 4) -> tuple[tuple[int, ...], ...]:
    """One group: devices ``0..g-1`` of each of ``hosts`` hosts of 8 (ids ``8h + i``)."""
    return (tuple(8 * h + i for h in range(hosts) for i in range(g)),)


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_a_collective_across_hosts_runs_on_g_devices_shares_of_the_nics(gpu, g):
    model = links(gpu)
    n, rate = 4 * g, ACROSS[gpu][g]
    # An all-gather and a reduce-scatter: (n-1)/n of B; n-1 steps, 3 of them between the 4 hosts.
    gather = (n - 1) / n * GiB / rate + 3 * 5 * US + (n - 1 - 3) * 1 * US
    assert model.seconds("all-gather", GiB, spread(g)) == pytest.approx(gather)
    assert model.seconds("reduce-scatter", GiB, spread(g)) == pytest.approx(gather)
    # An all-reduce: 2(n-1)/n of B; 2(n-1) steps, 2(4-1) = 6 of them between hosts.
    reduce = 2 * (n - 1) / n * GiB / rate + 6 * 5 * US + (2 * (n - 1) - 6) * 1 * US
    assert model.seconds("all-reduce", GiB, spread(g)) == pytest.approx(reduce)
    # An all-to-all: (n-g)/n of B leaves each device for other hosts, on its own NIC (48 or 24
    # GB/s: the rails do not help), (g-1)/n on NVLink at once; steps as an all-gather's.
    nic = ACROSS[gpu][1]
    to_all = max((n - g) / n * GiB / nic, (g - 1) / n * GiB / NVLINK[gpu]) + 3 * 5 * US + (n - 4) * US
    assert model.seconds("all-to-all", GiB, spread(g)) == pytest.approx(to_all)
    # A permute across hosts: B on the device's NIC, one step between hosts.
    assert model.seconds("collective-permute", GiB, spread(g)) == pytest.approx(GiB / nic + 5 * US)
    assert _links.spanned_hosts(model, spread(g)) == 4


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("g", [2, 4, 8])
def test_inside_a_host_every_collective_runs_on_nvlink(gpu, g):
    model = links(gpu)
    group = spread(g, hosts=1)
    expected = (g - 1) / g * GiB / NVLINK[gpu] + (g - 1) * US
    assert model.seconds("all-gather", GiB, group) == pytest.approx(expected)
    assert model.seconds("all-reduce", GiB, group) == pytest.approx(2 * expected)
    assert model.seconds("collective-permute", GiB, group) == pytest.approx(GiB / NVLINK[gpu] + US)
    assert _links.spanned_hosts(model, group) == 1


def test_with_more_nics_nvlink_decides():
    """16 NICs per host: g x 96 GB/s (or 48) against NVLink x 8/7 for g = 8."""
    expected = {"a100": 300e9 * 8 / 7, "h100": 450e9 * 8 / 7, "b200": 768e9}
    for gpu, rate in expected.items():
        model = links(gpu, nics_per_host=16)
        seconds = model.seconds("all-gather", GiB, spread(8)) - (3 * 5 + 28) * US
        assert seconds == pytest.approx(31 / 32 * GiB / rate), gpu
    # Fewer NICs than GPUs: each device's share is half a NIC.
    half = links("h100", nics_per_host=4)
    assert half.seconds("all-gather", GiB, spread(1)) == pytest.approx(3 / 4 * GiB / 24e9 + 15 * US)


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_a_group_spread_unevenly_runs_at_its_least_populated_host(gpu):
    """12 devices: 8 on host 0, 4 on host 1: g = 4."""
    model = links(gpu)
    group = (tuple(range(12)),)
    assert model.spread(group[0]) == (4, 2)
    expected = 11 / 12 * GiB / ACROSS[gpu][4] + 1 * 5 * US + 10 * US
    assert model.seconds("all-gather", GiB, group) == pytest.approx(expected)
    # All groups run at once: the slowest decides (here the spread group, beside one inside a host).
    both = (tuple(range(12)), tuple(range(16, 24)))
    assert model.seconds("all-gather", GiB, both) == pytest.approx(expected)


def test_an_all_reduce_of_1_gib_over_4_dgx_h100s_reaches_what_nccl_tests_measure():
    """331-366 GB/s of bus bandwidth measured (NVIDIA/nccl-tests#309, #319); the model: 378 GB/s.

    nccl-tests' bus bandwidth of an all-reduce is ``2(n-1)/n B / t``.
    """
    n = 32
    seconds = links("h100").seconds("all-reduce", GiB, spread(8, hosts=4))
    bus = 2 * (n - 1) / n * GiB / seconds
    assert 331e9 * 0.9 <= bus <= 366e9 * 1.1
    assert bus == pytest.approx(378e9, rel=0.005)


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_an_all_reduce_across_dgx_a100s_reaches_nvidia_s_192_gb_s(hosts):
    """NVIDIA: 192 GB/s of all-reduce bus bandwidth across DGX A100 nodes (8 x 200 Gb/s)."""
    n = 8 * hosts
    seconds = links("a100").seconds("all-reduce", GiB, spread(8, hosts=hosts))
    assert 2 * (n - 1) / n * GiB / seconds == pytest.approx(192e9, rel=0.02)


def test_the_latency_is_the_network_s_between_hosts_and_nvlink_s_inside():
    """A one-byte all-reduce over 3 hosts of 8: 2(3-1) = 4 steps at 5 us, 2(24-1) - 4 = 42 at 1 us."""
    model = links("h100")
    assert model.seconds("all-reduce", 1, spread(8, hosts=3)) == pytest.approx(4 * 5 * US + 42 * US, rel=1e-3)
    assert model.seconds("all-gather", 1, spread(8, hosts=3)) == pytest.approx(2 * 5 * US + 21 * US, rel=1e-3)
    assert model.seconds("all-reduce", 1, ((3,),)) == 0.0  # a device alone sends nothing


def test_one_link_is_the_ring_formula_at_one_bandwidth():
    """CPU devices, a TPU slice, and any target given bandwidth=: every collective at it."""
    one = _links.OneLink(100e9, 2 * US, devices_per_host=8)
    group = spread(8, hosts=4)  # across hosts, yet at 100 GB/s
    assert one.seconds("all-reduce", GiB, group) == pytest.approx(2 * 31 / 32 * GiB / 100e9 + 62 * 2 * US)
    assert one.seconds("collective-permute", GiB, group) == pytest.approx(GiB / 100e9 + 2 * US)
    assert _links.spanned_hosts(one, group) == 4  # where the devices are is still known
    assert _links.spanned_hosts(_links.OneLink(100e9), group) == 1
    assert one.least_seconds(10e9, 5e9) == pytest.approx(0.1)
    assert one.assumed() == "100 GB/s per device for every collective, within and across hosts, latency 2 µs"
    assert _links.OneLink(10e9).assumed() == "10 GB/s per device, latency 0 ns"


def test_the_bounds_send_what_crosses_hosts_on_each_device_s_share_of_the_nics():
    model = links("h100")
    assert model.least_seconds(10e9, 2e9) == pytest.approx(8e9 / 450e9 + 2e9 / 48e9)
    assert model.host(15) == 1 and model.host(16) == 2


def test_the_footer_s_words_say_what_was_assumed():
    assert links("h100").assumed() == (
        "450 GB/s per device within a host of 8, latency 1 µs; across hosts: 8 NICs × 48 GB/s per host, "
        "latency 5 µs"
    )
    assert "8 NICs × 24 GB/s per host" in links("a100").assumed()


# --- the figures, and the report's rows asked with their groups ----------------------------------------

H100 = _figures.Hardware(
    device="an H100 by hand",
    memory_bytes=80 * 10**9,
    memory_bandwidth=3.35e12,
    peak_flops_per_second=989e12,
    efficiency=0.75,
    bandwidth=450e9,
    network_bandwidth=48e9,
    devices_per_host=8,
    sources={},
    nics_per_host=8,
)


def figures(hardware: _figures.Hardware = H100) -> _figures.Figures:
    return _figures.Figures(
        target="h100",
        hardware=hardware,
        bandwidth=hardware.bandwidth,
        network_bandwidth=hardware.network_bandwidth,
        latency=hardware.latency,
        network_latency=hardware.network_latency or hardware.latency,
        flops_per_second=hardware.flops_per_second,
    )


def test_figures_make_gpu_hosts_and_nics_given_change_them():
    model = figures().links
    assert isinstance(model, _links.GpuHosts) and model.share == 48e9
    fewer = figures(H100.replace({"nics_per_host": 4, "network_bandwidth": 24e9})).links
    assert isinstance(fewer, _links.GpuHosts) and fewer.share == 12e9
    # A bandwidth given is every collective's: one link, the hosts still known.
    at = figures().at(bandwidth=100e9).links
    assert at == _links.OneLink(100e9, 1e-6, 8)
    assert _figures.Figures().links is None  # no bandwidth, no time
    with pytest.raises(
        einshard.EinshardError, match=r"hardware=\{'nics_per_host': 2.5\} must be a whole number"
    ):
        H100.replace({"nics_per_host": 2.5})


def _row(kind: str, nbytes: int, groups, instruction: str, times: int = 1) -> einshard.StepRow:
    size = max(len(group) for group in groups)
    return einshard.StepRow(
        kind=kind,
        dtype="bf16",
        shape=(nbytes // 2,),
        bytes=nbytes,
        group_size=size,
        axes=None,
        times=times,
        times_known=True,
        traffic=round(_links.sent_fraction(kind, size) * nbytes) * times,
        seconds=None,
        phase="backward",
        op_name="",
        source=None,
        param=None,
        instruction=instruction,
        groups=groups,
    )


def _report(rows) -> einshard.StepReport:
    return einshard.StepReport(
        rows=tuple(rows),
        n_devices=32,
        mesh=(("devices", 32),),
        collectives=len({row.instruction for row in rows}),
        bytes=sum(row.total_bytes for row in rows),
        bytes_by_kind={},
        traffic=sum(row.traffic for row in rows),
        flops=None,
        argument_bytes=None,
        output_bytes=None,
        alias_bytes=None,
        temp_bytes=None,
        peak_bytes=None,
        bandwidth=None,
        latency=0.0,
        flops_per_second=None,
        communication_seconds=None,
        compute_seconds=None,
        compile_seconds=0.0,
        analysis_seconds=0.0,
    )


def test_a_report_s_rows_are_timed_by_the_links_with_their_groups_and_again_at_other_figures():
    everywhere = spread(8, hosts=4)  # FSDP's groups: all 32 devices
    per_host = tuple(tuple(8 * h + i for h in range(4)) for i in range(8))  # one device of each host
    inside = tuple(tuple(range(8 * h, 8 * h + 8)) for h in range(4))
    # A combined reduce-scatter of two arrays (one run: its latency paid once, shared by bytes).
    rows = [
        _row("reduce-scatter", GiB, everywhere, "rs", times=2),
        _row("reduce-scatter", GiB // 2, everywhere, "rs", times=2),
        _row("all-reduce", GiB, per_host, "ar"),
        _row("all-gather", GiB, inside, "ag"),
    ]
    report = estimated(_report(rows), figures())
    run = 31 / 32 * (GiB + GiB // 2) / 384e9 + (3 * 5 + 28) * US
    seconds = [row.seconds for row in report.rows]
    assert seconds[0] == pytest.approx(2 * run * 2 / 3) and seconds[1] == pytest.approx(2 * run / 3)
    assert seconds[2] == pytest.approx(2 * 3 / 4 * GiB / 48e9 + 6 * 5 * US)  # g = 1: one NIC
    assert seconds[3] == pytest.approx(7 / 8 * GiB / 450e9 + 7 * US)
    assert [row.hosts for row in report.rows] == [4, 4, 4, 1]
    assert report.communication_seconds == pytest.approx(sum(seconds))
    # .at(bandwidth=...): every row at that bandwidth, by the ring formula, the hosts still known.
    at = report.at(bandwidth=100e9, latency=0)
    assert [row.seconds for row in at.rows] == pytest.approx([row.traffic / 100e9 for row in rows])
    assert [row.hosts for row in at.rows] == [4, 4, 4, 1]
    # The rows keep their groups through it all (so a plan's .at() re-prices them too).
    assert [row.groups for row in at.rows] == [row.groups for row in rows]
    # Fewer NICs: what crosses hosts slows down, what stays inside does not.
    fewer = estimated(_report(rows), figures(H100.replace({"nics_per_host": 4})))
    assert fewer.rows[2].seconds == pytest.approx(2 * 3 / 4 * GiB / 24e9 + 6 * 5 * US)
    assert fewer.rows[3].seconds == report.rows[3].seconds


def test_a_report_s_all_to_all_and_uneven_group_across_hosts():
    """An all-to-all over 4 hosts of 8: 3/4 of its array on each device's one NIC; an all-gather
    over 8 + 2 devices of 2 hosts: g = 2."""
    rows = [
        _row("all-to-all", GiB, spread(8, hosts=4), "a2a"),
        _row("all-gather", GiB, (tuple(range(10)),), "ag"),
    ]
    report = estimated(_report(rows), figures())
    assert report.rows[0].seconds == pytest.approx(24 / 32 * GiB / 48e9 + (3 * 5 + 28) * US)
    assert report.rows[1].seconds == pytest.approx(9 / 10 * GiB / 96e9 + 5 * US + 8 * US)
    assert [row.hosts for row in report.rows] == [4, 2]


def test_a_row_made_without_groups_is_one_group_of_its_size():
    (row,) = estimated(
        _report([dataclasses.replace(_row("all-gather", GiB, inside_one(), "x"), groups=())]), figures()
    ).rows
    assert row.seconds == pytest.approx(7 / 8 * GiB / 450e9 + 7 * US) and row.hosts == 1


def inside_one() -> tuple[tuple[int, ...], ...]:
    return (tuple(range(8)),)


# --- the compile-only devices: which host each is on -----------------------------------------------------


@needs_gpu
def test_the_compile_only_gpus_hosts_are_the_links_answer():
    """JAX's compile-only GPUs for ``1xHx8``: ids 0..n-1 in order, 8 per host (``process_index``),
    as ``GpuHosts.host`` says; this fails loudly when JAX lays them out otherwise."""
    import os

    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    target = _target.parse_target("h100", 24)
    assert target.topology == "1x3x8"
    devices = _compilers.target_devices(target)
    assert [device.id for device in devices] == list(range(24))
    model = _figures.resolve_figures(target).links
    assert isinstance(model, _links.GpuHosts)
    assert [device.process_index for device in devices] == [model.host(device.id) for device in devices]


@needs_gpu
@pytest.mark.parametrize(
    ("gpu", "nvlink", "nic"),
    [("a100", 300e9, 24e9), ("h100", 450e9, 48e9), ("h200", 450e9, 48e9), ("b200", 900e9, 48e9)],
)
def test_each_gpu_s_links_come_with_their_sources(gpu, nvlink, nic):
    hardware = _figures.hardware_of(_target.parse_target(gpu, 16))
    assert hardware is not None
    assert (hardware.bandwidth, hardware.network_bandwidth, hardware.nics_per_host) == (nvlink, nic, 8)
    assert (hardware.devices_per_host, hardware.latency, hardware.network_latency) == (8, 1e-6, 5e-6)
    for name in (
        "bandwidth",
        "network_bandwidth",
        "nics_per_host",
        "devices_per_host",
        "latency",
        "network_latency",
    ):
        assert hardware.sources[name], name
    assert "nccl-tests" in hardware.sources["network_bandwidth"]
    given = _figures.hardware_of(_target.parse_target(gpu, 16), {"nics_per_host": 4})
    assert given is not None and given.nics_per_host == 4 and given.sources["nics_per_host"] == "given"
