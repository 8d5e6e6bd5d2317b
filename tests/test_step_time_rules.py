"""Every rule of the simulated step time, on programs written here and worked out by hand.

The programs are XLA's text as it prints it (``_hlo.parse_module`` reads them; nothing is
compiled). The figures are round (``HARDWARE``): 1e14 FLOP/s for bf16 dots, 1e12 B/s of memory,
1e11 B/s of link, no launch floor and no latency unless a test says so. The arrays are round too:

* ``DOT``: a fusion of one ``bf16[1000,1000] x bf16[1000,1000]`` dot: 2 * 1000**3 = 2e9 flops,
  20 us at 1e14; it reads 2 * 2e6 B and writes 2e6 B, 6 us at 1e12: compute-bound, **20 us**.
* ``ADD``: a fusion adding two ``f32[1000,1000]``: no flops; reads 8e6 B, writes 4e6 B:
  memory-bound, **12 us**.
* ``SMALL``: a ``bf16[300,300]`` dot: 5.4e7 flops, 0.54 us; 3 * 1.8e5 B = 5.4e5 B, 0.54 us:
  balanced, **0.54 us** (the larger of the two, not their sum).
* Two devices (``{{0,1}}``): an all-gather of ``bf16[N,1000]`` into ``bf16[2N,1000]`` sends half
  its result (``(n-1)/n``): ``AG10`` (N = 500) 1e6 B, **10 us**; ``AG15`` (N = 750) **15 us**;
  ``AG30`` (N = 1500) **30 us**. An all-reduce of ``bf16[1000,1000]`` sends ``2(n-1)/n`` of its
  2e6 B: ``AR20``, **20 us**.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from einshard._cost import _hlo, _hlo_kernels, _target, _timing
from einshard._cost._analysis import report_of_text
from einshard._cost._report import estimated

# ruff: noqa: E501  (the programs below are XLA's lines, as it prints them)

US = 1e-6

HARDWARE = _target.Hardware(
    device="round",
    memory_bytes=2**40,
    memory_bandwidth=1e12,
    peak_flops_per_second=1e14,
    efficiency=1.0,
    bandwidth=1e11,
    network_bandwidth=None,
    devices_per_host=None,
    sources={},
    memory_efficiency=1.0,
    launch_seconds=0.0,
    latency=0.0,
    network_latency=None,
    matmul_peaks={"f32": 1e13, "tf32": 5e13, "f8e4m3fn": 2e14},
)


def figures(**changes) -> _target.Figures:
    hardware = dataclasses.replace(HARDWARE, **changes)
    return _target.Figures(target="round", hardware=hardware, bandwidth=hardware.bandwidth)


# --- the computations the programs call ------------------------------------------------------------

COMPUTATIONS = """
%add (add.a: bf16[], add.b: bf16[]) -> bf16[] {
  %add.a = bf16[] parameter(0)
  %add.b = bf16[] parameter(1)
  ROOT %add.s = bf16[] add(%add.a, %add.b)
}

%fused_dot (dot.p0: bf16[1000,1000], dot.p1: bf16[1000,1000]) -> bf16[1000,1000] {
  %dot.p0 = bf16[1000,1000]{1,0} parameter(0)
  %dot.p1 = bf16[1000,1000]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1000,1000]{1,0} dot(%dot.p0, %dot.p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (add.p0: f32[1000,1000], add.p1: f32[1000,1000]) -> f32[1000,1000] {
  %add.p0 = f32[1000,1000]{1,0} parameter(0)
  %add.p1 = f32[1000,1000]{1,0} parameter(1)
  ROOT %add.1 = f32[1000,1000]{1,0} add(%add.p0, %add.p1)
}

%fused_small (small.p0: bf16[300,300], small.p1: bf16[300,300]) -> bf16[300,300] {
  %small.p0 = bf16[300,300]{1,0} parameter(0)
  %small.p1 = bf16[300,300]{1,0} parameter(1)
  ROOT %small.1 = bf16[300,300]{1,0} dot(%small.p0, %small.p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_tiny (tiny.p0: f32[10]) -> f32[10] {
  %tiny.p0 = f32[10]{0} parameter(0)
  ROOT %tiny.1 = f32[10]{0} negate(%tiny.p0)
}
"""

# The entry's parameters every program may use.
PARAMETERS = """
  %x = bf16[1000,1000]{1,0} parameter(0)
  %y = f32[1000,1000]{1,0} parameter(1)
  %s = bf16[300,300]{1,0} parameter(2)
  %w = bf16[1500,1000]{1,0} parameter(3)
  %g = bf16[1000,1000]{1,0} parameter(4)
  %t = f32[10]{0} parameter(5)
"""
ENTRY_HEAD = (
    "ENTRY %main (x: bf16[1000,1000], y: f32[1000,1000], s: bf16[300,300], w: bf16[1500,1000], "
    "g: bf16[1000,1000], t: f32[10]) -> f32[10] {"
)
DOT = "fusion(%x, %x), kind=kCustom, calls=%fused_dot"
ADD = "fusion(%y, %y), kind=kLoop, calls=%fused_add"
SMALL = "fusion(%s, %s), kind=kCustom, calls=%fused_small"
TINY = "fusion(%t), kind=kLoop, calls=%fused_tiny"
GROUPS = "channel_id={channel}, replica_groups={{{{0,1}}}}, use_global_device_ids=true"


def gather(rows: int, channel: int) -> str:
    """An all-gather of ``bf16[rows,1000]`` (a slice of ``%w``) into twice the rows: ``rows * 2e-8`` s."""
    return f"all-gather-start(%w.{rows}), {GROUPS.format(channel=channel)}, dimensions={{0}}"


def program(body: str, *computations: str, partitions: int = 2) -> str:
    """A module: the shared computations, ``computations``, and an entry of ``body``'s lines.

    ``%w.N`` is ``bf16[N,1000]``, a slice of ``%w`` (a free bitcast: no kernel).
    """
    slices = "".join(f"  %w.{n} = bf16[{n},1000]{{1,0}} bitcast(%w)\n" for n in (500, 750, 1500))
    return (
        f"HloModule m, num_partitions={partitions}\n"
        + COMMON_TEXT
        + "".join(textwrap.dedent(c) for c in computations)
        + "\n"
        + ENTRY_HEAD
        + PARAMETERS
        + slices
        + textwrap.dedent(body)
        + "  ROOT %out = f32[10]{0} parameter(6)\n}\n"
    )


COMMON_TEXT = textwrap.dedent(COMPUTATIONS)


def simulated(text: str, **changes):
    """The report of a program's text at the round figures (``changes``: other figures)."""
    report = report_of_text(text)
    report = dataclasses.replace(report, schedule=_timing.schedule_of(_hlo.parse_module(text)))
    return estimated(report, figures(**changes))


def kernels(text: str) -> dict[str, _timing.KernelRun]:
    """Every kernel of the program's schedule, loops' bodies included, by name."""
    out: dict[str, _timing.KernelRun] = {}

    def walk(items):
        for item in items:
            if isinstance(item, _timing.KernelRun):
                out[item.name] = item
            elif isinstance(item, _timing.Loop):
                walk(item.items)

    walk(_timing.schedule_of(_hlo.parse_module(text)))
    return out


# --- kernels: the roofline, each element type's rate, the launch floor ------------------------------


def test_a_compute_bound_kernel_costs_its_flops_time():
    """DOT: 2e9 flops at 1e14 FLOP/s = 20 us, against its 6e6 B at 1e12 B/s = 6 us."""
    text = program(f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n")
    (kernel,) = kernels(text).values()
    assert (kernel.flops, kernel.matmul, kernel.bytes) == (2e9, "bf16", 6_000_000)
    report = simulated(text)
    assert report.seconds == pytest.approx(20 * US)
    assert report.compute_seconds == pytest.approx(20 * US)
    assert report.kernels == (("f", None, pytest.approx(20 * US)),)


def test_a_memory_bound_kernel_costs_its_bytes_time():
    """ADD: no flops; 2 * 4e6 B read and 4e6 B written at 1e12 B/s = 12 us."""
    text = program(f"  %a = f32[1000,1000]{{1,0}} {ADD}\n")
    (kernel,) = kernels(text).values()
    assert (kernel.flops, kernel.matmul, kernel.bytes) == (0.0, "", 12_000_000)
    assert simulated(text).seconds == pytest.approx(12 * US)
    # Half the bandwidth: twice the time; the matrix rate does not matter.
    assert simulated(text, memory_bandwidth=5e11).seconds == pytest.approx(24 * US)
    assert simulated(text, peak_flops_per_second=1e12).seconds == pytest.approx(12 * US)


def test_a_balanced_kernel_costs_the_larger_of_its_flops_and_bytes_not_their_sum():
    """SMALL: 5.4e7 flops at 1e14 = 0.54 us and 5.4e5 B at 1e12 = 0.54 us: 0.54 us, not 1.08.

    A DOT (20 us of flops, 6 us of bytes) and an ADD (12 us of bytes) beside it: 32.54 us in all.
    """
    text = program(
        f"  %m = bf16[300,300]{{1,0}} {SMALL}\n"
        f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n"
        f"  %a = f32[1000,1000]{{1,0}} {ADD}\n"
    )
    found = kernels(text)
    assert (found["m"].flops, found["m"].bytes) == (5.4e7, 540_000)
    report = simulated(text)
    assert report.seconds == pytest.approx(32.54 * US)
    seconds = {name: s for name, _, s in report.kernels}
    assert seconds == pytest.approx({"f": 20 * US, "a": 12 * US, "m": 0.54 * US})
    # At a tenth of the matrix rate the small dot is compute-bound: 5.4 us.
    assert simulated(text, peak_flops_per_second=1e13, matmul_peaks={}).seconds == pytest.approx(
        200 * US + 12 * US + 5.4 * US
    )


F32_DOT = """
%fused_f32 (f32.p0: f32[1000,1000], f32.p1: f32[1000,1000]) -> f32[1000,1000] {{
  %f32.p0 = f32[1000,1000]{{1,0}} parameter(0)
  %f32.p1 = f32[1000,1000]{{1,0}} parameter(1)
  ROOT %f32.dot = f32[1000,1000]{{1,0}} dot(%f32.p0, %f32.p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}{precision}
}}
"""
F8_DOT = """
%fused_f8 (f8.p0: f8e4m3fn[1000,1000], f8.p1: f8e4m3fn[1000,1000]) -> bf16[1000,1000] {
  %f8.p0 = f8e4m3fn[1000,1000]{1,0} parameter(0)
  %f8.p1 = f8e4m3fn[1000,1000]{1,0} parameter(1)
  ROOT %f8.dot = bf16[1000,1000]{1,0} dot(%f8.p0, %f8.p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


@pytest.mark.parametrize(
    ("computation", "call", "kind", "seconds"),
    [
        # f32 at the default precision runs through TF32: 2e9 / 5e13 = 40 us (its 12e6 B: 12 us).
        (
            F32_DOT.format(precision=""),
            "f32[1000,1000]{1,0} fusion(%y, %y), kind=kCustom, calls=%fused_f32",
            "tf32",
            40 * US,
        ),
        # At the highest precision, full f32: 2e9 / 1e13 = 200 us.
        (
            F32_DOT.format(precision=", operand_precision={highest,highest}"),
            "f32[1000,1000]{1,0} fusion(%y, %y), kind=kCustom, calls=%fused_f32",
            "f32",
            200 * US,
        ),
        # fp8: 2e9 / 2e14 = 10 us (1e6 + 1e6 + 2e6 B: 4 us).
        (F8_DOT, "bf16[1000,1000]{1,0} fusion(%f8, %f8), kind=kCustom, calls=%fused_f8", "f8e4m3fn", 10 * US),
        # bf16: 20 us.
        ("", f"bf16[1000,1000]{{1,0}} {DOT}", "bf16", 20 * US),
    ],
)
def test_each_element_type_runs_at_its_own_rate(computation, call, kind, seconds):
    text = program("  %f8 = f8e4m3fn[1000,1000]{1,0} bitcast(%x)\n" + f"  %k = {call}\n", computation)
    kernel = kernels(text)["k"]
    assert (kernel.flops, kernel.matmul) == (2e9, kind)
    assert simulated(text).seconds == pytest.approx(seconds)


def test_a_type_without_a_rate_runs_at_the_fallback_and_no_flops_cost_no_time():
    """An s8 dot's 2e9 flops at the fallback 4e13 = 50 us; a kernel of bytes only: bytes / memory."""
    rates = _timing.Rates(matmul={"bf16": 1e14}, fallback=4e13, memory=1e12, launch=0.0)
    s8 = _timing.KernelRun("k", 2e9, "s8", 1_000_000, None)
    assert _timing.kernel_seconds(s8, rates) == pytest.approx(50 * US)
    bf16 = _timing.KernelRun("k", 2e9, "bf16", 1_000_000, None)
    assert _timing.kernel_seconds(bf16, rates) == pytest.approx(20 * US)
    copy = _timing.KernelRun("k", 0.0, "", 3_000_000, None)
    assert _timing.kernel_seconds(copy, rates) == pytest.approx(3 * US)


@pytest.mark.parametrize("launch", [5, 50])
def test_every_kernel_costs_at_least_the_launch_floor(launch):
    """At 5 us per kernel: DOT 20 + 5 = 25 us; TINY (80 B: 8e-5 us) 5.00008 us; 30.00008 us in all.
    At 50 us: 70 + 50.00008 = 120.00008 us."""
    text = program(f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n  %n = f32[10]{{0}} {TINY}\n")
    assert kernels(text)["n"].bytes == 80
    report = simulated(text, launch_seconds=launch * US)
    assert report.seconds == pytest.approx((20 + 2 * launch + 0.00008) * US)
    assert report.compute_seconds == pytest.approx((20 + 2 * launch + 0.00008) * US)
    assert simulated(text).seconds == pytest.approx(20.00008 * US)


def test_the_launch_floor_is_paid_on_every_trip():
    """TINY in a loop of 10 trips at 5 us per kernel: 10 * 5.00008 us = 50.0008 us."""
    body, entry = loop("l", "  %l.n = f32[10]{0} fusion(%l.t), kind=kLoop, calls=%fused_tiny\n", trip=10)
    body = body.replace("  %l.n =", "  %l.t = f32[10]{0} bitcast(%l.x)\n  %l.n =", 1)
    report = simulated(program(ZERO + entry, body), launch_seconds=5 * US)
    assert report.seconds == pytest.approx(50.0008 * US)
    assert report.kernels == (("l.n", None, pytest.approx(50.0008 * US)),)


GEMM = (
    '  %k = (f32[1000,1000]{{1,0}}, s8[4194304]{{0}}) custom-call(%y, %y), custom_call_target="{target}", '
    'backend_config={{"operation_queue_id":"0","gemm_backend_config":{{"alpha_real":1,"beta":0,'
    '"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
    '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}},"precision_config":{{"operand_precision":'
    '["{precision}","{precision}"],"algorithm":"ALG_UNSET"}},"epilogue":"DEFAULT"}}}}\n'
)


@pytest.mark.parametrize(
    ("target", "precision", "kind", "seconds"),
    [
        ("__cublas$gemm", "DEFAULT", "tf32", 40 * US),
        ("__cublas$lt$matmul", "DEFAULT", "tf32", 40 * US),
        ("__cublas$gemm", "HIGHEST", "f32", 200 * US),
    ],
)
def test_a_library_gemm_runs_at_its_precision_s_rate_and_its_workspace_is_not_moved(
    target, precision, kind, seconds
):
    """cuBLAS's f32 gemm of two ``f32[1000,1000]``: 2e9 flops, through TF32 at the default
    precision (5e13: 40 us), at full f32 at the highest (1e13: 200 us). It reads 8e6 B and writes
    its 4e6 B result; its ``s8`` workspace (the second result) is not data: 12e6 B."""
    text = program(GEMM.format(target=target, precision=precision))
    kernel = kernels(text)["k"]
    assert (kernel.flops, kernel.matmul, kernel.bytes) == (2e9, kind, 12_000_000)
    assert simulated(text).seconds == pytest.approx(seconds)


# --- collectives -----------------------------------------------------------------------------------


def _async_program(rows: int, between: str) -> str:
    """An all-gather of ``bf16[rows,1000]`` started, ``between`` run, then its done and a DOT on it."""
    return program(
        f"  %ags = (bf16[{rows},1000]{{1,0}}, bf16[{2 * rows},1000]{{1,0}}) {gather(rows, 1)}\n"
        + between
        + f"  %agd = bf16[{2 * rows},1000]{{1,0}} all-gather-done(%ags)\n"
        + "  %after = bf16[1000,1000]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot\n"
    )


def test_an_async_collective_fully_hidden_costs_nothing():
    """AG10 runs beside a DOT (20 us): the done waits for nothing. 20 + 20 = 40 us, 10 us hidden."""
    report = simulated(_async_program(500, f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n"))
    assert report.communication_seconds == pytest.approx(10 * US)
    assert report.seconds == pytest.approx(40 * US)
    assert report.exposed_seconds == pytest.approx(0.0, abs=1e-15)
    assert report.hidden_seconds == pytest.approx(10 * US)


def test_an_async_collective_partly_hidden_costs_what_the_kernels_do_not_cover():
    """AG30 beside a DOT (20 us): the done waits 10 us. 20 + 10 + 20 = 50 us; 10 exposed, 20 hidden."""
    report = simulated(_async_program(1500, f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n"))
    assert report.communication_seconds == pytest.approx(30 * US)
    assert report.seconds == pytest.approx(50 * US)
    assert report.exposed_seconds == pytest.approx(10 * US)
    assert report.hidden_seconds == pytest.approx(20 * US)


def test_an_async_collective_with_nothing_between_is_not_hidden():
    """AG10 started and waited for at once: 10 + 20 = 30 us, all 10 us exposed."""
    report = simulated(_async_program(500, ""))
    assert report.seconds == pytest.approx(30 * US)
    assert report.exposed_seconds == pytest.approx(10 * US)
    assert report.hidden_seconds == pytest.approx(0.0, abs=1e-15)


def test_a_sync_collective_is_waited_for_where_it_stands():
    """DOT, AR20, DOT: nothing runs beside the all-reduce. 20 + 20 + 20 = 60 us, 20 us exposed."""
    text = program(
        f"  %f1 = bf16[1000,1000]{{1,0}} {DOT}\n"
        f"  %ar = bf16[1000,1000]{{1,0}} all-reduce(%g), {GROUPS.format(channel=2)}, to_apply=%add\n"
        f"  %f2 = bf16[1000,1000]{{1,0}} {DOT}\n"
    )
    schedule = _timing.schedule_of(_hlo.parse_module(text))
    assert [type(item).__name__ for item in schedule] == ["KernelRun", "Sync", "KernelRun"]
    report = simulated(text)
    assert report.communication_seconds == pytest.approx(20 * US)
    assert report.seconds == pytest.approx(60 * US)
    assert report.exposed_seconds == pytest.approx(20 * US)
    assert report.hidden_seconds == pytest.approx(0.0, abs=1e-15)


def _two_gathers(dones: str) -> str:
    return (
        f"  %a = (bf16[750,1000]{{1,0}}, bf16[1500,1000]{{1,0}}) {gather(750, 1)}\n"
        f"  %b = (bf16[750,1000]{{1,0}}, bf16[1500,1000]{{1,0}}) {gather(750, 2)}\n"
        f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n"
        + "".join(f"  %{name}d = bf16[1500,1000]{{1,0}} all-gather-done(%{name})\n" for name in dones)
    )


@pytest.mark.parametrize("dones", ["ab", "ba"])
def test_two_collectives_in_flight_queue_on_the_link(dones):
    """AG15 (a) and AG15 (b) started together, a DOT (20 us), then both dones (in either order).

    One link: a runs 0-15 us, b 15-30 us. The DOT ends at 20: a is done, b 10 us later. 30 us in
    all, 10 exposed, 20 hidden (without the queue both would be done by 15 us: 20 us in all).
    """
    report = simulated(program(_two_gathers(dones)))
    assert report.communication_seconds == pytest.approx(30 * US)
    assert report.seconds == pytest.approx(30 * US)
    assert report.exposed_seconds == pytest.approx(10 * US)
    assert report.hidden_seconds == pytest.approx(20 * US)


def test_collectives_in_flight_queue_on_every_trip():
    """The same two gathers and DOT in a loop of 3 trips: 3 * 30 = 90 us, 30 us exposed."""
    lines = _two_gathers("ab").replace("%w.750", "%l.w").replace("%x, %x", "%l.x, %l.x")
    for name in ("a", "b", "f", "ad", "bd"):
        lines = lines.replace(f"%{name} ", f"%l.{name} ").replace(f"(%{name})", f"(%l.{name})")
    body, entry = loop("l", "  %l.w = bf16[750,1000]{1,0} bitcast(%l.x)\n" + lines, trip=3)
    report = simulated(program(ZERO + entry, body))
    assert report.seconds == pytest.approx(90 * US)
    assert report.exposed_seconds == pytest.approx(30 * US)
    assert report.hidden_seconds == pytest.approx(60 * US)


SYNC_GATHER = f"bf16[1000,1000]{{1,0}} all-gather(%w.500), {GROUPS.format(channel=2)}, dimensions={{0}}"
SYNC_REDUCE = f"bf16[1000,1000]{{1,0}} all-reduce(%g), {GROUPS.format(channel=2)}, to_apply=%add"


def _behind_a_gather(sync: str) -> str:
    return (
        f"  %a = (bf16[750,1000]{{1,0}}, bf16[1500,1000]{{1,0}}) {gather(750, 1)}\n"
        f"  %c = {sync}\n"
        f"  %f = bf16[1000,1000]{{1,0}} {DOT}\n"
        "  %ad = bf16[1500,1000]{1,0} all-gather-done(%a)\n"
    )


@pytest.mark.parametrize(("sync", "sync_us"), [(SYNC_REDUCE, 20), (SYNC_GATHER, 10)])
def test_a_sync_collective_queues_behind_one_in_flight(sync, sync_us):
    """AG15 started, then a sync collective at once (AR20, or a sync AG10), a DOT, AG15's done.

    The sync one waits for the link (0-15 us) and runs from 15 us: the step waits 15 + 20 = 35 us
    there (AG10: 25 us). The DOT follows (20 us); the gather was done long before. 55 us (45 us),
    all the communication exposed.
    """
    report = simulated(program(_behind_a_gather(sync)))
    assert report.seconds == pytest.approx((15 + sync_us + 20) * US)
    assert report.exposed_seconds == pytest.approx((15 + sync_us) * US)
    assert report.hidden_seconds == pytest.approx(0.0, abs=1e-15)


def test_in_a_loop_a_sync_collective_queues_behind_one_in_flight():
    """The same with AR20, in a loop of 2 trips: 2 * 55 = 110 us."""
    lines = _behind_a_gather(SYNC_REDUCE.replace("%g", "%l.x")).replace("%w.750", "%l.w")
    lines = lines.replace("%x, %x", "%l.x, %l.x")
    for name in ("a", "c", "f", "ad"):
        lines = lines.replace(f"%{name} ", f"%l.{name} ").replace(f"(%{name})", f"(%l.{name})")
    body, entry = loop("l", "  %l.w = bf16[750,1000]{1,0} bitcast(%l.x)\n" + lines, trip=2)
    report = simulated(program(ZERO + entry, body))
    assert report.seconds == pytest.approx(110 * US)
    assert report.exposed_seconds == pytest.approx(70 * US)


def test_a_ring_step_s_latency_is_paid_by_every_collective():
    """At 1 us per ring step: AR20 over 2 devices takes 2 steps (2(n-1)): 22 us, on the schedule too."""
    text = program(
        f"  %ar = bf16[1000,1000]{{1,0}} all-reduce(%g), {GROUPS.format(channel=2)}, to_apply=%add\n"
    )
    report = estimated(
        dataclasses.replace(report_of_text(text), schedule=_timing.schedule_of(_hlo.parse_module(text))),
        dataclasses.replace(figures(), latency=1 * US),
    )
    assert report.communication_seconds == pytest.approx(22 * US)
    assert report.seconds == pytest.approx(22 * US)


# --- loops ------------------------------------------------------------------------------------------


def loop(name: str, body: str, trip: int | None, carried: str = "bf16[1000,1000]") -> tuple[str, str]:
    """A ``while`` computation pair (body and condition) and the entry line that runs it on ``%x``.

    ``body`` is the body's lines, with ``%{name}.x`` the carried array. ``trip``: the known trip
    count XLA prints in the backend config, or ``None`` for none.
    """
    config = f', backend_config={{"known_trip_count":{{"n":"{trip}"}}}}' if trip is not None else ""
    state = f"(s32[], {carried}{{1,0}})"
    computations = f"""
%{name}.body ({name}.p: (s32[], {carried})) -> (s32[], {carried}) {{
  %{name}.p = {state} parameter(0)
  %{name}.i = s32[] get-tuple-element(%{name}.p), index=0
  %{name}.x = {carried}{{1,0}} get-tuple-element(%{name}.p), index=1
{textwrap.dedent(body)}  ROOT %{name}.t = {state} tuple(%{name}.i, %{name}.x)
}}

%{name}.cond ({name}.q: (s32[], {carried})) -> pred[] {{
  %{name}.q = {state} parameter(0)
  ROOT %{name}.c = pred[] constant(true)
}}
"""
    entry = (
        f"  %{name}.init = {state} tuple(%zero, %x)\n"
        f"  %{name} = {state} while(%{name}.init), condition=%{name}.cond, body=%{name}.body{config}\n"
    )
    return computations, entry


ZERO = "  %zero = s32[] constant(0)\n"


def test_a_loop_runs_its_body_its_trip_count_times():
    """A body of a DOT (20 us) and AR20 (20 us, sync), 4 trips: 4 * 40 = 160 us, 80 us exposed."""
    body, entry = loop(
        "l",
        f"  %l.f = bf16[1000,1000]{{1,0}} fusion(%l.x, %l.x), kind=kCustom, calls=%fused_dot\n"
        f"  %l.ar = bf16[1000,1000]{{1,0}} all-reduce(%l.f), {GROUPS.format(channel=2)}, to_apply=%add\n",
        trip=4,
    )
    text = program(ZERO + entry, body)
    (item,) = _timing.schedule_of(_hlo.parse_module(text))
    assert isinstance(item, _timing.Loop) and item.times == 4
    assert [type(inner).__name__ for inner in item.items] == ["KernelRun", "Sync"]
    report = simulated(text)
    (row,) = report.rows
    assert (row.instruction, row.times, row.times_known) == ("l.ar", 4, True)
    assert report.communication_seconds == pytest.approx(80 * US)
    assert report.seconds == pytest.approx(160 * US)
    assert report.compute_seconds == pytest.approx(80 * US)
    assert report.exposed_seconds == pytest.approx(80 * US)
    assert report.kernels == (("l.f", None, pytest.approx(80 * US)),)
    assert _hlo_kernels.program_matmul_flops(_hlo.parse_module(text)) == 4 * 2e9


def _gathering_loop(rows: int) -> str:
    """4 trips of: AG of ``bf16[rows,1000]`` started, a DOT (20 us), the gather waited for."""
    body, entry = loop(
        "l",
        f"  %l.w = bf16[{rows},1000]{{1,0}} bitcast(%l.x)\n"
        f"  %l.ags = (bf16[{rows},1000]{{1,0}}, bf16[{2 * rows},1000]{{1,0}}) all-gather-start(%l.w), {GROUPS.format(channel=1)}, dimensions={{0}}\n"
        "  %l.f = bf16[1000,1000]{1,0} fusion(%l.x, %l.x), kind=kCustom, calls=%fused_dot\n"
        f"  %l.agd = bf16[{2 * rows},1000]{{1,0}} all-gather-done(%l.ags)\n",
        trip=4,
    )
    return program(ZERO + entry, body)


def test_an_async_collective_in_a_loop_is_hidden_on_every_trip():
    """AG10 beside a DOT on each of 4 trips: 80 us, 40 us hidden. AG30 instead: each trip waits
    10 us, 4 * 30 = 120 us, 40 us exposed and 80 us hidden."""
    assert _hlo_kernels.program_matmul_flops(_hlo.parse_module(_gathering_loop(500))) == 4 * 2e9
    report = simulated(_gathering_loop(500))
    (row,) = report.rows
    assert (row.instruction, row.times) == ("l.ags", 4)
    assert report.communication_seconds == pytest.approx(40 * US)
    assert report.seconds == pytest.approx(80 * US)
    assert report.exposed_seconds == pytest.approx(0.0, abs=1e-15)
    assert report.hidden_seconds == pytest.approx(40 * US)
    report = simulated(_gathering_loop(1500))
    assert report.seconds == pytest.approx(120 * US)
    assert report.exposed_seconds == pytest.approx(40 * US)
    assert report.hidden_seconds == pytest.approx(80 * US)


def test_nested_loops_multiply_their_trip_counts():
    """An outer loop of 3 trips: an ADD (12 us) and an inner loop of 4 DOTs (80 us) per trip.

    3 * (12 + 4 * 20) = 276 us; the DOT runs 12 times (240 us over the step, the slowest kernel),
    12 * 2e9 = 2.4e10 flops.
    """
    inner_body, inner_entry = loop(
        "inner",
        "  %inner.f = bf16[1000,1000]{1,0} fusion(%inner.x, %inner.x), kind=kCustom, calls=%fused_dot\n",
        trip=4,
    )
    outer_lines = (
        "  %outer.a = f32[1000,1000]{1,0} fusion(%y, %y), kind=kLoop, calls=%fused_add\n"
        + inner_entry.replace("%zero, %x", "%outer.i, %outer.x")
    )
    outer_body, outer_entry = loop("outer", outer_lines, trip=3)
    # The outer body reads the entry's %y: give it its own parameter-free stand-in.
    outer_body = outer_body.replace("fusion(%y, %y)", "fusion(%outer.y, %outer.y)").replace(
        "  %outer.a", "  %outer.y = f32[1000,1000]{1,0} constant({...})\n  %outer.a", 1
    )
    text = program(ZERO + outer_entry, inner_body, outer_body)
    (outer,) = _timing.schedule_of(_hlo.parse_module(text))
    assert isinstance(outer, _timing.Loop) and outer.times == 3
    inner = outer.items[-1]
    assert isinstance(inner, _timing.Loop) and inner.times == 4
    report = simulated(text)
    assert report.seconds == pytest.approx(276 * US)
    assert report.kernels[0] == ("inner.f", None, pytest.approx(240 * US))
    assert report.kernels[1] == ("outer.a", None, pytest.approx(36 * US))
    module = _hlo.parse_module(text)
    assert module.times()["inner.body"] == (12, True)
    assert _hlo_kernels.program_matmul_flops(module) == 12 * 2e9


def test_a_loop_whose_trip_count_is_unknown_is_counted_once():
    """No ``known_trip_count``: the body (a DOT and AR20) counted once, 40 us; the row says unknown."""
    body, entry = loop(
        "l",
        "  %l.f = bf16[1000,1000]{1,0} fusion(%l.x, %l.x), kind=kCustom, calls=%fused_dot\n"
        f"  %l.ar = bf16[1000,1000]{{1,0}} all-reduce(%l.f), {GROUPS.format(channel=2)}, to_apply=%add\n",
        trip=None,
    )
    text = program(ZERO + entry, body)
    (item,) = _timing.schedule_of(_hlo.parse_module(text))
    assert isinstance(item, _timing.Loop) and item.times == 1
    report = simulated(text)
    assert report.seconds == pytest.approx(40 * US)
    (row,) = report.rows
    assert (row.times, row.times_known) == (1, False)
    assert _hlo.parse_module(text).times()["l.body"] == (1, False)


# --- conditionals -----------------------------------------------------------------------------------

BRANCHES = """
%then (then.p: bf16[1000,1000]) -> bf16[1000,1000] {
  %then.p = bf16[1000,1000]{1,0} parameter(0)
  ROOT %then.f = bf16[1000,1000]{1,0} fusion(%then.p, %then.p), kind=kCustom, calls=%fused_dot
}

%else (else.p: bf16[1000,1000]) -> bf16[1000,1000] {
  %else.p = bf16[1000,1000]{1,0} parameter(0)
  %else.y = f32[1000,1000]{1,0} constant({...})
  %else.a1 = f32[1000,1000]{1,0} fusion(%else.y, %else.y), kind=kLoop, calls=%fused_add
  %else.a2 = f32[1000,1000]{1,0} fusion(%else.a1, %else.y), kind=kLoop, calls=%fused_add
  ROOT %else.r = bf16[1000,1000]{1,0} bitcast(%else.p)
}

%third (third.p: bf16[1000,1000]) -> bf16[1000,1000] {
  %third.p = bf16[1000,1000]{1,0} parameter(0)
  ROOT %third.r = bf16[1000,1000]{1,0} bitcast(%third.p)
}
"""


def test_a_conditional_runs_its_longest_branch():
    """``then``: a DOT (one kernel, 20 us); ``else``: two ADDs (two kernels, 24 us): the walk takes
    the branch of the most kernels, ``else``: 24 us."""
    text = program(
        "  %pred = pred[] constant(true)\n"
        "  %c = bf16[1000,1000]{1,0} conditional(%pred, %x, %x), true_computation=%then, false_computation=%else\n",
        BRANCHES,
    )
    names = [item.name for item in _timing.schedule_of(_hlo.parse_module(text))]
    assert names == ["else.a1", "else.a2"]
    assert simulated(text).seconds == pytest.approx(24 * US)


@pytest.mark.parametrize("branches", ["%then, %else, %third", "%third, %then, %else"])
def test_a_switch_runs_its_longest_branch(branches):
    """``lax.switch``'s three branches (``branch_computations``): one kernel, two, none: two, 24 us."""
    text = program(
        "  %index = s32[] constant(0)\n"
        f"  %c = bf16[1000,1000]{{1,0}} conditional(%index, %x, %x, %x), branch_computations={{{branches}}}\n",
        BRANCHES,
    )
    names = [item.name for item in _timing.schedule_of(_hlo.parse_module(text))]
    assert names == ["else.a1", "else.a2"]
    assert simulated(text).seconds == pytest.approx(24 * US)


# --- in-place updates and sliced reads (a scanned model's loop) --------------------------------------

STACK = """
%fused_update (update.p0: bf16[8,1000,1000], update.p1: bf16[1,1000,1000], update.p2: s32[]) -> bf16[8,1000,1000] {
  %update.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %update.p1 = bf16[1,1000,1000]{2,1,0} parameter(1)
  %update.p2 = s32[] parameter(2)
  %update.zero = s32[] constant(0)
  ROOT %update.dus = bf16[8,1000,1000]{2,1,0} dynamic-update-slice(%update.p0, %update.p1, %update.p2, %update.zero, %update.zero)
}

%fused_read (read.p0: bf16[8,1000,1000], read.p1: s32[]) -> bf16[1000,1000] {
  %read.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %read.p1 = s32[] parameter(1)
  %read.zero = s32[] constant(0)
  %read.ds = bf16[1,1000,1000]{2,1,0} dynamic-slice(%read.p0, %read.p1, %read.zero, %read.zero), dynamic_slice_sizes={1,1000,1000}
  ROOT %read.r = bf16[1000,1000]{1,0} bitcast(%read.ds)
}
"""
STACK_ENTRY = (
    ZERO
    + "  %stack = bf16[8,1000,1000]{2,1,0} bitcast(%w)\n"
    + "  %layer = bf16[1,1000,1000]{2,1,0} bitcast(%x)\n"
)


def test_an_in_place_update_costs_its_update_fused_or_not():
    """A ``bf16[1,1000,1000]`` layer (2e6 B) written into its ``bf16[8,1000,1000]`` stack (16e6 B).

    Fused: it reads the layer (2e6 B) and the index (4 B) and writes the layer: 4,000,004 B, 4 us.
    Unfused: the update read and written, 4e6 B. Never the stack's 16e6 B.
    """
    text = program(
        STACK_ENTRY
        + "  %u = bf16[8,1000,1000]{2,1,0} fusion(%stack, %layer, %zero), kind=kLoop, calls=%fused_update\n"
        + "  %v = bf16[8,1000,1000]{2,1,0} dynamic-update-slice(%stack, %layer, %zero, %zero, %zero)\n",
        STACK,
    )
    found = kernels(text)
    assert found["u"].bytes == 4_000_004
    assert found["v"].bytes == 4_000_000
    assert simulated(text).seconds == pytest.approx(8.000004 * US)


def test_a_sliced_read_costs_its_slice_fused_or_not():
    """One layer read from the stack: fused (through a bitcast), the slice and the index read and
    the layer written, 4,000,004 B; unfused, the slice read and written, 4e6 B."""
    text = program(
        STACK_ENTRY
        + "  %r = bf16[1000,1000]{1,0} fusion(%stack, %zero), kind=kLoop, calls=%fused_read\n"
        + "  %d = bf16[1,1000,1000]{2,1,0} dynamic-slice(%stack, %zero, %zero, %zero), dynamic_slice_sizes={1,1000,1000}\n",
        STACK,
    )
    found = kernels(text)
    assert found["r"].bytes == 4_000_004
    assert found["d"].bytes == 4_000_000
    assert simulated(text).seconds == pytest.approx(8.000004 * US)


def _scan(trips: int, fused: bool) -> str:
    """A scanned layer: read the layer ``%scan.i`` of the stack carried, a DOT, write it back."""
    if fused:
        read = (
            "  %scan.r = bf16[1000,1000]{1,0} fusion(%scan.stack, %scan.i), kind=kLoop, calls=%fused_read\n"
        )
        write = "  %scan.u = bf16[8,1000,1000]{2,1,0} fusion(%scan.stack, %scan.layer, %scan.i), kind=kLoop, calls=%fused_update\n"
    else:
        read = (
            "  %scan.d = bf16[1,1000,1000]{2,1,0} dynamic-slice(%scan.stack, %scan.i, %scan.zero, %scan.zero), dynamic_slice_sizes={1,1000,1000}\n"
            "  %scan.r = bf16[1000,1000]{1,0} bitcast(%scan.d)\n"
        )
        write = "  %scan.u = bf16[8,1000,1000]{2,1,0} dynamic-update-slice(%scan.stack, %scan.layer, %scan.i, %scan.zero, %scan.zero)\n"
    body, entry = loop(
        "scan",
        "  %scan.zero = s32[] constant(0)\n"
        "  %scan.stack = bf16[8,1000,1000]{2,1,0} bitcast(%scan.x)\n"
        + read
        + "  %scan.f = bf16[1000,1000]{1,0} fusion(%scan.r, %scan.r), kind=kCustom, calls=%fused_dot\n"
        "  %scan.layer = bf16[1,1000,1000]{2,1,0} bitcast(%scan.f)\n" + write,
        trip=trips,
    )
    return program(ZERO + entry, STACK, body)


@pytest.mark.parametrize("trips", [1, 8])
def test_a_scanned_layer_costs_its_slices_on_every_trip(trips):
    """Each trip: read a layer (fused: 4,000,004 B, 4.000004 us), a DOT (20 us), write the layer
    back (fused: 4.000004 us): 28.000008 us per trip, never the stack's 16e6 B."""
    report = simulated(_scan(trips, fused=True))
    assert report.seconds == pytest.approx(trips * 28.000008 * US)
    seconds = {name: s for name, _, s in report.kernels}
    assert seconds == pytest.approx(
        {"scan.f": trips * 20 * US, "scan.r": trips * 4.000004 * US, "scan.u": trips * 4.000004 * US}
    )


@pytest.mark.parametrize("trips", [1, 8])
def test_a_scanned_layer_without_fusions_costs_its_slices_on_every_trip(trips):
    """Unfused: the slice read and written (4 us), a DOT (20 us), the update read and written (4 us)."""
    report = simulated(_scan(trips, fused=False))
    assert report.seconds == pytest.approx(trips * 28 * US)
    seconds = {name: s for name, _, s in report.kernels}
    assert seconds == pytest.approx(
        {"scan.f": trips * 20 * US, "scan.d": trips * 4 * US, "scan.u": trips * 4 * US}
    )
