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

The rules, each pinned by at least two test functions: the roofline and each element type's
rate, the launch floor; async collectives hidden fully, partly or not, sync ones, queueing on the
link (TPU's async collective fusions too); loops of a known trip count, nested, of a count read
from the loop's counter, and of an unknown count (counted once, and the report says so); every
branch of a conditional; an in-place update costing its update and a sliced read its slice, in
every form (fused or not, async or not, behind views, converts and copies), in a loop.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from einshard._cost.hardware import _figures, _timing
from einshard._cost.pipeline._analysis import report_of_text
from einshard._cost.report._report import estimated
from einshard._cost.xla import _hlo, _hlo_kernels
from tests import test_step_time as step_time

# ruff: noqa: E501  (the programs below are XLA's lines, as it prints them)

US = 1e-6

# test_step_time's round figures, with a rate for each element type's dots beside bf16's 1e14.
HARDWARE = dataclasses.replace(step_time.HARDWARE, matmul_peaks={"f32": 1e13, "tf32": 5e13, "f8e4m3fn": 2e14})


def figures(**changes) -> _figures.Figures:
    hardware = dataclasses.replace(HARDWARE, **changes)
    return _figures.Figures(
        target="round",
        hardware=hardware,
        bandwidth=hardware.bandwidth,
        flops_per_second=hardware.flops_per_second,
    )


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


def _pipelined_loop(rows: int, trips: int = 4) -> str:
    """XLA's pipelined collective: each trip waits for the all-gather the trip before started
    (read back from the loop's carry), starts the next one, then runs a DOT (20 us)."""
    ag = f"(bf16[{rows},1000]{{1,0}}, bf16[{2 * rows},1000]{{1,0}})"
    state = f"(s32[], bf16[1000,1000]{{1,0}}, {ag})"
    body = f"""
%p.body (p.p: {state}) -> {state} {{
  %p.p = {state} parameter(0)
  %p.i = s32[] get-tuple-element(%p.p), index=0
  %p.x = bf16[1000,1000]{{1,0}} get-tuple-element(%p.p), index=1
  %p.prev = {ag} get-tuple-element(%p.p), index=2
  %p.agd = bf16[{2 * rows},1000]{{1,0}} all-gather-done(%p.prev)
  %p.w = bf16[{rows},1000]{{1,0}} bitcast(%p.x)
  %p.ags = {ag} all-gather-start(%p.w), {GROUPS.format(channel=1)}, dimensions={{0}}
  %p.f = bf16[1000,1000]{{1,0}} fusion(%p.x, %p.x), kind=kCustom, calls=%fused_dot
  ROOT %p.t = {state} tuple(%p.i, %p.f, %p.ags)
}}

%p.cond (p.q: {state}) -> pred[] {{
  %p.q = {state} parameter(0)
  ROOT %p.c = pred[] constant(true)
}}
"""
    entry = (
        f"  %gathered = bf16[{2 * rows},1000]{{1,0}} bitcast(%w)\n"
        f"  %none = {ag} tuple(%w.{rows}, %gathered)\n"
        f"  %p.init = {state} tuple(%zero, %x, %none)\n"
        f'  %p = {state} while(%p.init), condition=%p.cond, body=%p.body, backend_config={{"known_trip_count":{{"n":"{trips}"}}}}\n'
    )
    return program(ZERO + entry, body)


def test_a_collective_pipelined_across_trips_is_waited_for_on_the_next_trip():
    """AG30 started on each of 4 trips and waited for on the next, beside a DOT (20 us): each trip
    waits for the last one's (10 us) and its own starts behind it on the link; the last is waited
    for at the end of the step. 4 * 30 = 120 us, 40 us exposed, 80 us hidden (not the 80 us of
    the DOTs alone, every gather hidden, of a walk that never waits for them)."""
    text = _pipelined_loop(1500)
    (item,) = _timing.schedule_of(_hlo.parse_module(text))
    assert isinstance(item, _timing.Loop)
    assert [type(inner).__name__ for inner in item.items] == ["Done", "Start", "KernelRun"]
    report = simulated(text)
    assert report.communication_seconds == pytest.approx(120 * US)
    assert report.seconds == pytest.approx(120 * US)
    assert report.exposed_seconds == pytest.approx(40 * US)
    assert report.hidden_seconds == pytest.approx(80 * US)


def test_a_collective_pipelined_across_trips_that_is_shorter_than_a_trip_is_hidden():
    """AG10 beside a DOT of 20 us: each gather ends before the next trip waits for it. 4 * 20 = 80
    us, all 40 us of gathers hidden; with 8 trips, twice that."""
    report = simulated(_pipelined_loop(500))
    assert report.seconds == pytest.approx(80 * US)
    assert report.exposed_seconds == pytest.approx(0.0, abs=1e-15)
    assert report.hidden_seconds == pytest.approx(40 * US)
    assert simulated(_pipelined_loop(500, trips=8)).seconds == pytest.approx(160 * US)


def test_a_program_printed_without_sigils_runs_its_loops_as_often():
    """XLA may print names without '%': the loops' bodies run as many times, with every collective."""
    for text in (_pipelined_loop(1500), _gathering_loop(500)):
        bare = text.replace("%", "")
        assert _hlo.parse_module(bare).times() == _hlo.parse_module(text).times()
        with_sigils, without = simulated(text), simulated(bare)
        assert [(r.instruction, r.times) for r in without.rows] == [
            (r.instruction, r.times) for r in with_sigils.rows
        ]
        assert without.seconds == pytest.approx(with_sigils.seconds)


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


def test_a_loop_whose_trip_count_is_unknown_is_counted_once_and_the_report_says_so():
    """No ``known_trip_count``: the body (a DOT and AR20) counted once, 40 us; the row says its
    count is unknown, and the report names the loop, in its field and its printed footer."""
    body, entry = loop(
        "l",
        "  %l.f = bf16[1000,1000]{1,0} fusion(%l.x, %l.x), kind=kCustom, calls=%fused_dot\n"
        f"  %l.ar = bf16[1000,1000]{{1,0}} all-reduce(%l.f), {GROUPS.format(channel=2)}, to_apply=%add\n",
        trip=None,
    )
    text = program(ZERO + entry, body)
    (item,) = _timing.schedule_of(_hlo.parse_module(text))
    assert isinstance(item, _timing.Loop) and (item.times, item.known, item.name) == (1, False, "l")
    report = simulated(text)
    assert report.seconds == pytest.approx(40 * US)
    (row,) = report.rows
    assert (row.times, row.times_known) == (1, False)
    assert _hlo.parse_module(text).times()["l.body"] == (1, False)
    assert report.unknown_loops == ("l",)
    assert "1 loop of a trip count XLA does not know, each counted as running once: l" in str(report)


def test_a_known_trip_count_is_not_reported_as_assumed():
    """Nested loops of known counts, an unknown one inside a known one: only that one is named."""
    inner_body, inner_entry = loop(
        "inner",
        "  %inner.f = bf16[1000,1000]{1,0} fusion(%inner.x, %inner.x), kind=kCustom, calls=%fused_dot\n",
        trip=None,
    )
    outer_body, outer_entry = loop("outer", inner_entry.replace("%zero, %x", "%outer.i, %outer.x"), trip=3)
    report = simulated(program(ZERO + outer_entry, inner_body, outer_body))
    assert report.unknown_loops == ("inner",)
    assert report.seconds == pytest.approx(3 * 20 * US)
    known = simulated(_gathering_loop(500))
    assert known.unknown_loops == ()
    assert "does not know" not in str(known)


def counted_loop(start: int, limit: str, step: int, compare: str) -> str:
    """A loop of a DOT per trip without XLA's ``known_trip_count`` (as TPU's compiler prints a
    ``scan``): its counter starts at ``start`` and grows by ``step``; ``compare`` is the
    condition's root, of the counter ``%c.qi`` and ``limit``'s line ``%c.n``."""
    return program(
        ZERO
        + f"  %c.start = s32[] constant({start})\n"
        + "  %c.init = (s32[], bf16[1000,1000]{1,0}) tuple(%c.start, %x)\n"
        + "  %c = (s32[], bf16[1000,1000]{1,0}) while(%c.init), condition=%c.cond, body=%c.body\n",
        f"""
%c.body (c.p: (s32[], bf16[1000,1000])) -> (s32[], bf16[1000,1000]) {{
  %c.p = (s32[], bf16[1000,1000]{{1,0}}) parameter(0)
  %c.i = s32[] get-tuple-element(%c.p), index=0
  %c.copy = s32[] copy(%c.i)
  %c.x = bf16[1000,1000]{{1,0}} get-tuple-element(%c.p), index=1
  %c.f = bf16[1000,1000]{{1,0}} fusion(%c.x, %c.x), kind=kCustom, calls=%fused_dot
  %c.step = s32[] constant({step})
  %c.next = s32[] add(%c.copy, %c.step)
  ROOT %c.t = (s32[], bf16[1000,1000]{{1,0}}) tuple(%c.next, %c.f)
}}

%c.cond (c.q: (s32[], bf16[1000,1000])) -> pred[] {{
  %c.q = (s32[], bf16[1000,1000]{{1,0}}) parameter(0)
  %c.qi = s32[] get-tuple-element(%c.q), index=0
  %c.n = {limit}
  ROOT %c.lt = pred[] {compare}
}}
""",
    )


@pytest.mark.parametrize(
    ("start", "limit", "step", "compare", "trips"),
    [
        (0, 4, 1, "compare(%c.qi, %c.n), direction=LT", 4),  # a scan of 4
        (0, 4, 1, "compare(%c.qi, %c.n), direction=LE", 5),
        (1, 8, 2, "compare(%c.qi, %c.n), direction=LT", 4),  # 1, 3, 5, 7
        (0, 4, 1, "compare(%c.n, %c.qi), direction=GT", 4),  # 4 > i
        (5, 4, 1, "compare(%c.qi, %c.n), direction=LT", 0),  # never runs
    ],
)
def test_a_loop_s_trip_count_is_read_from_its_counter_when_xla_does_not_print_it(
    start, limit, step, compare, trips
):
    """``i = start; while i < limit: i += step``: ``ceil((limit - start) / step)`` trips of a DOT
    (20 us each), known; the program's flops and the walk's agree."""
    text = counted_loop(start, f"s32[] constant({limit})", step, compare)
    module = _hlo.parse_module(text)
    (item,) = _timing.schedule_of(module)
    assert isinstance(item, _timing.Loop) and (item.times, item.known) == (trips, True)
    assert module.times()["c.body"] == (trips, True)
    assert _hlo_kernels.program_matmul_flops(module) == _flops_walked((item,)) == trips * 2e9
    report = simulated(text)
    assert report.unknown_loops == ()
    assert report.seconds == pytest.approx(trips * 20 * US, rel=1e-5)


def test_a_counter_compared_with_a_value_the_text_does_not_fix_is_unknown():
    """The limit an element of the state (not a constant): the trip count is unknown, counted
    once, and the report says so."""
    text = counted_loop(0, "s32[] get-tuple-element(%c.q), index=0", 1, "compare(%c.qi, %c.n), direction=LT")
    module = _hlo.parse_module(text)
    (item,) = _timing.schedule_of(module)
    assert (item.times, item.known) == (1, False)
    assert module.times()["c.body"] == (1, False)
    assert simulated(text).unknown_loops == ("c",)


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
  ROOT %third.ar = bf16[1000,1000]{1,0} all-reduce(%third.p), channel_id=3, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
}
"""


def _flops_walked(schedule, times: int = 1) -> float:
    """The matrix flops of the schedule's kernels, each times its loops' trips."""
    total = 0.0
    for item in schedule:
        if isinstance(item, _timing.KernelRun):
            total += times * item.flops
        elif isinstance(item, _timing.Loop):
            total += _flops_walked(item.items, times * item.times)
    return total


def test_a_conditional_counts_every_branch_as_run():
    """``then``: a DOT (20 us); ``else``: two ADDs (24 us). Which one runs is decided by data: each
    is counted as run, 44 us (an upper bound); the flops are the DOT's 2e9, in the walk and in
    the program's flops alike."""
    text = program(
        "  %pred = pred[] constant(true)\n"
        "  %c = bf16[1000,1000]{1,0} conditional(%pred, %x, %x), true_computation=%then, false_computation=%else\n",
        BRANCHES,
    )
    module = _hlo.parse_module(text)
    schedule = _timing.schedule_of(module)
    assert [item.name for item in schedule] == ["then.f", "else.a1", "else.a2"]
    assert simulated(text).seconds == pytest.approx(44 * US)
    assert module.times()["then"] == module.times()["else"] == (1, True)
    assert _flops_walked(schedule) == _hlo_kernels.program_matmul_flops(module) == 2e9


@pytest.mark.parametrize("branches", ["%then, %else, %third", "%third, %then, %else"])
def test_a_switch_counts_every_branch_and_its_collectives(branches):
    """``lax.switch``'s three branches (``branch_computations``): a DOT (20 us), two ADDs (24 us),
    an AR20: all on the schedule, in their order, 64 us; the all-reduce's row is on it (a row the
    schedule left out would be an error), its 20 us exposed."""
    text = program(
        "  %index = s32[] constant(0)\n"
        f"  %c = bf16[1000,1000]{{1,0}} conditional(%index, %x, %x, %x), branch_computations={{{branches}}}\n",
        BRANCHES,
    )
    module = _hlo.parse_module(text)
    schedule = _timing.schedule_of(module)
    order = [name.strip("% ") for name in branches.split(",")]
    first = {"then": "then.f", "else": "else.a1", "third": "third.ar"}
    names = [item.name if isinstance(item, _timing.KernelRun) else item.collective for item in schedule]
    assert [name for name in names if name in first.values()] == [first[b] for b in order]
    report = simulated(text)
    assert [row.instruction for row in report.rows] == ["third.ar"]
    assert report.seconds == pytest.approx(64 * US)
    assert report.exposed_seconds == pytest.approx(20 * US)
    assert _flops_walked(schedule) == _hlo_kernels.program_matmul_flops(module) == 2e9


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


# --- in place and sliced, in every form: behind views, converts and copies, async -------------------

FORMS = """
%fused_update_bitcast (ub.p0: bf16[8000,1000], ub.p1: bf16[1000,1000], ub.p2: s32[]) -> bf16[8000,1000] {
  %ub.p0 = bf16[8000,1000]{1,0} parameter(0)
  %ub.stack = bf16[8,1000,1000]{2,1,0} bitcast(%ub.p0)
  %ub.p1 = bf16[1000,1000]{1,0} parameter(1)
  %ub.layer = bf16[1,1000,1000]{2,1,0} bitcast(%ub.p1)
  %ub.p2 = s32[] parameter(2)
  %ub.zero = s32[] constant(0)
  %ub.dus = bf16[8,1000,1000]{2,1,0} dynamic-update-slice(%ub.stack, %ub.layer, %ub.p2, %ub.zero, %ub.zero)
  ROOT %ub.r = bf16[8000,1000]{1,0} bitcast(%ub.dus)
}

%fused_update_reshape (ur.p0: bf16[8000,1000], ur.p1: bf16[1000,1000], ur.p2: s32[]) -> (bf16[8000,1000]) {
  %ur.p0 = bf16[8000,1000]{1,0} parameter(0)
  %ur.stack = bf16[8,1000,1000]{2,1,0} reshape(%ur.p0)
  %ur.p1 = bf16[1000,1000]{1,0} parameter(1)
  %ur.layer = bf16[1,1000,1000]{2,1,0} reshape(%ur.p1)
  %ur.p2 = s32[] parameter(2)
  %ur.zero = s32[] constant(0)
  %ur.dus = bf16[8,1000,1000]{2,1,0} dynamic-update-slice(%ur.stack, %ur.layer, %ur.p2, %ur.zero, %ur.zero)
  %ur.r = bf16[8000,1000]{1,0} reshape(%ur.dus)
  ROOT %ur.t = (bf16[8000,1000]{1,0}) tuple(%ur.r)
}

%fused_update_convert (uc.p0: bf16[8,1000,1000], uc.p1: f32[1,1000,1000], uc.p2: s32[]) -> (bf16[8,1000,1000], f32[10]) {
  %uc.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %uc.p1 = f32[1,1000,1000]{2,1,0} parameter(1)
  %uc.cv = bf16[1,1000,1000]{2,1,0} convert(%uc.p1)
  %uc.p2 = s32[] parameter(2)
  %uc.zero = s32[] constant(0)
  %uc.dus = bf16[8,1000,1000]{2,1,0} dynamic-update-slice(%uc.p0, %uc.cv, %uc.p2, %uc.zero, %uc.zero)
  %uc.small = f32[10]{0} constant({...})
  ROOT %uc.t = (bf16[8,1000,1000]{2,1,0}, f32[10]{0}) tuple(%uc.dus, %uc.small)
}

%fused_read_convert (rc.p0: bf16[8,1000,1000], rc.p1: s32[]) -> f32[1000,1000] {
  %rc.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %rc.cv = f32[8,1000,1000]{2,1,0} convert(%rc.p0)
  %rc.p1 = s32[] parameter(1)
  %rc.zero = s32[] constant(0)
  %rc.ds = f32[1,1000,1000]{2,1,0} dynamic-slice(%rc.cv, %rc.p1, %rc.zero, %rc.zero), dynamic_slice_sizes={1,1000,1000}
  ROOT %rc.r = f32[1000,1000]{1,0} bitcast(%rc.ds)
}

%fused_read_copy (rp.p0: bf16[8,1000,1000], rp.p1: s32[]) -> bf16[1000,1000] {
  %rp.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %rp.cp = bf16[8,1000,1000]{2,0,1} copy(%rp.p0)
  %rp.p1 = s32[] parameter(1)
  %rp.zero = s32[] constant(0)
  %rp.ds = bf16[1,1000,1000]{2,0,1} dynamic-slice(%rp.cp, %rp.p1, %rp.zero, %rp.zero), dynamic_slice_sizes={1,1000,1000}
  ROOT %rp.r = bf16[1000,1000]{1,0} bitcast(%rp.ds)
}

%fused_read_and_sum (rs.p0: bf16[8,1000,1000]) -> f32[8,1000,1000] {
  %rs.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  ROOT %rs.cv = f32[8,1000,1000]{2,1,0} convert(%rs.p0)
}

%wrapped_update (wu.p0: bf16[8,1000,1000], wu.p1: bf16[1,1000,1000], wu.p2: s32[]) -> bf16[8,1000,1000] {
  %wu.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %wu.p1 = bf16[1,1000,1000]{2,1,0} parameter(1)
  %wu.p2 = s32[] parameter(2)
  ROOT %wu.f = bf16[8,1000,1000]{2,1,0} fusion(%wu.p0, %wu.p1, %wu.p2), kind=kLoop, calls=%fused_update
}

%wrapped_slice (ws.p0: bf16[8,1000,1000], ws.p1: s32[]) -> bf16[1,1000,1000] {
  %ws.p0 = bf16[8,1000,1000]{2,1,0} parameter(0)
  %ws.p1 = s32[] parameter(1)
  %ws.zero = s32[] constant(0)
  ROOT %ws.ds = bf16[1,1000,1000]{2,1,0} dynamic-slice(%ws.p0, %ws.p1, %ws.zero, %ws.zero), dynamic_slice_sizes={1,1000,1000}
}
"""
FORMS_ENTRY = STACK_ENTRY + (
    "  %flat = bf16[8000,1000]{1,0} bitcast(%w)\n"
    "  %wide = f32[1,1000,1000]{2,1,0} bitcast(%y)\n"
    "  %ub = bf16[8000,1000]{1,0} fusion(%flat, %x, %zero), kind=kLoop, calls=%fused_update_bitcast\n"
    "  %ur = (bf16[8000,1000]{1,0}) fusion(%flat, %x, %zero), kind=kLoop, calls=%fused_update_reshape\n"
    "  %uc = (bf16[8,1000,1000]{2,1,0}, f32[10]{0}) fusion(%stack, %wide, %zero), kind=kLoop, calls=%fused_update_convert\n"
    "  %rc = f32[1000,1000]{1,0} fusion(%stack, %zero), kind=kLoop, calls=%fused_read_convert\n"
    "  %rp = bf16[1000,1000]{1,0} fusion(%stack, %zero), kind=kLoop, calls=%fused_read_copy\n"
    "  %rs = f32[8,1000,1000]{2,1,0} fusion(%stack), kind=kLoop, calls=%fused_read_and_sum\n"
    "  %fs = ((bf16[8,1000,1000]{2,1,0}, bf16[1,1000,1000]{2,1,0}, s32[]), bf16[8,1000,1000]{2,1,0}, u32[]) fusion-start(%stack, %layer, %zero), kind=kLoop, calls=%fused_update\n"
    "  %fd = bf16[8,1000,1000]{2,1,0} fusion-done(%fs)\n"
    "  %as = ((bf16[8,1000,1000]{2,1,0}, bf16[1,1000,1000]{2,1,0}, s32[]), bf16[8,1000,1000]{2,1,0}, s32[]) async-start(%stack, %layer, %zero), calls=%wrapped_update\n"
    "  %ad = bf16[8,1000,1000]{2,1,0} async-done(%as)\n"
    "  %ss = ((bf16[8,1000,1000]{2,1,0}, s32[]), bf16[1,1000,1000]{2,1,0}, s32[]) async-start(%stack, %zero), calls=%wrapped_slice\n"
    "  %sd = bf16[1,1000,1000]{2,1,0} async-done(%ss)\n"
)


@pytest.mark.parametrize(
    ("name", "moved"),
    [
        # The root a bitcast of the update: reads the layer (2e6 B) and index, writes the layer.
        ("ub", 4_000_004),
        # The same through reshapes, the root a tuple of it.
        ("ur", 4_000_004),
        # The update a convert of an f32 layer (4e6 B read), one output of a tuple: writes the
        # bf16 layer (2e6 B) and the other output (40 B).
        ("uc", 6_000_044),
        # An async fusion's start: what its fusion moves (its done moves nothing).
        ("fs", 4_000_004),
        # An async computation's start: what the fusion it runs moves.
        ("as", 4_000_004),
    ],
)
def test_an_in_place_update_costs_its_update_in_every_form(name, moved):
    """A ``bf16[1,1000,1000]`` layer (2e6 B) written into its ``bf16[8,1000,1000]`` stack (16e6 B),
    never the stack: behind a bitcast, from a convert, in a tuple, async."""
    found = kernels(program(FORMS_ENTRY, STACK, FORMS))
    assert found[name].bytes == moved
    assert "fd" not in found and "ad" not in found


@pytest.mark.parametrize(
    ("name", "moved"),
    [
        # Through a convert: the slice's 1e6 elements at bf16 read (2e6 B) and the index, the
        # f32 layer written (4e6 B).
        ("rc", 6_000_004),
        # Through a copy (a relayout): the slice read, the layer written.
        ("rp", 4_000_004),
        # An async computation's start running an unfused slice: it read and written.
        ("ss", 4_000_000),
        # Not a slice: the whole stack read (16e6 B) and written as f32 (32e6 B).
        ("rs", 48_000_000),
    ],
)
def test_a_sliced_read_costs_its_slice_in_every_form(name, moved):
    """One layer read from the stack behind a convert or a copy, or async: the slice, not the
    stack (and a kernel that does read the whole stack costs it)."""
    assert kernels(program(FORMS_ENTRY, STACK, FORMS))[name].bytes == moved


def _forms_in_a_loop(line: str, trips: int = 4) -> str:
    """``line`` (of ``FORMS``' entry, its operands renamed into the loop) run ``trips`` times."""
    line = line.replace("%stack", "%l.stack").replace("%layer", "%l.layer").replace("%zero", "%l.i")
    line = line.replace("%wide", "%l.wide")
    body, entry = loop(
        "l",
        "  %l.stack = bf16[8,1000,1000]{2,1,0} bitcast(%l.x)\n"
        "  %l.layer = bf16[1,1000,1000]{2,1,0} bitcast(%l.x)\n" + line,
        trip=trips,
    )
    return program(ZERO + entry, STACK, FORMS, body)


def test_a_slice_read_through_a_convert_in_a_loop_costs_its_slice_on_every_trip():
    """The layer read through a convert, 4 trips: 4 * 6,000,004 B at 1e12 B/s = 24.000016 us."""
    text = _forms_in_a_loop(
        "  %l.rc = f32[1000,1000]{1,0} fusion(%stack, %zero), kind=kLoop, calls=%fused_read_convert\n"
    )
    report = simulated(text)
    assert report.kernels == (("l.rc", None, pytest.approx(24.000016 * US)),)
    assert report.seconds == pytest.approx(24.000016 * US)


def test_an_update_behind_a_bitcast_in_a_loop_costs_its_update_on_every_trip():
    """The layer written into the stack seen through bitcasts (the fusion's root one of the
    update), 4 trips: 4 * 4,000,004 B = 16.000016 us, not 4 * 18e6 B."""
    text = _forms_in_a_loop(
        "  %l.flat = bf16[8000,1000]{1,0} bitcast(%l.x)\n"
        "  %l.ub = bf16[8000,1000]{1,0} fusion(%l.flat, %l.x, %zero), kind=kLoop, calls=%fused_update_bitcast\n"
    )
    report = simulated(text)
    assert report.kernels == (("l.ub", None, pytest.approx(16.000016 * US)),)


def test_async_computations_in_a_loop_cost_what_they_run_on_every_trip():
    """An in-place update (4,000,004 B) and a slice (4e6 B), each an async computation, 4 trips:
    4 * 8,000,004 B = 32.000016 us; their dones move nothing."""
    text = (
        _forms_in_a_loop(
            "  %as = ((bf16[8,1000,1000]{2,1,0}, bf16[1,1000,1000]{2,1,0}, s32[]), bf16[8,1000,1000]{2,1,0}, s32[]) async-start(%stack, %layer, %zero), calls=%wrapped_update\n"
            "  %ad = bf16[8,1000,1000]{2,1,0} async-done(%as)\n"
            "  %ss = ((bf16[8,1000,1000]{2,1,0}, s32[]), bf16[1,1000,1000]{2,1,0}, s32[]) async-start(%stack, %zero), calls=%wrapped_slice\n"
            "  %sd = bf16[1,1000,1000]{2,1,0} async-done(%ss)\n"
        )
        .replace("%as ", "%l.as ")
        .replace("(%as)", "(%l.as)")
        .replace("%ss ", "%l.ss ")
        .replace("(%ss)", "(%l.ss)")
    )
    report = simulated(text)
    seconds = {name: s for name, _, s in report.kernels}
    assert seconds == pytest.approx({"l.as": 16.000016 * US, "l.ss": 16 * US})
    assert report.seconds == pytest.approx(32.000016 * US)


ISSUE_STACK = """
%fused_dynamic_update_slice (s.p0: bf16[16,2048,8192], s.p1: s32[], s.p2: bf16[2048,8192]) -> bf16[16,2048,8192] {
  %s.p0 = bf16[16,2048,8192]{2,1,0} parameter(0)
  %s.p2 = bf16[2048,8192]{1,0} parameter(2)
  %s.update = bf16[1,2048,8192]{2,1,0} bitcast(%s.p2)
  %s.p1 = s32[] parameter(1)
  %s.zero = s32[] constant(0)
  ROOT %s.dus = bf16[16,2048,8192]{2,1,0} dynamic-update-slice(%s.p0, %s.update, %s.p1, %s.zero, %s.zero)
}
"""


def test_the_scanned_stack_of_the_issue_costs_its_slice_on_each_of_its_16_trips():
    """A ``bf16[2048,8192]`` slice (33,554,432 B) written into its ``bf16[16,2048,8192]`` stack
    (536,870,912 B) by an async fusion in a 16-trip loop (as XLA's GPU compiler writes a scanned
    model's stacked activations). Each trip reads the slice and the index and writes the slice:
    67,108,868 B, 67.108868 us at 1e12 B/s; 16 trips: 1.073741888 ms (the stack's bytes on every
    trip would be 16 times that, and more)."""
    body, entry = loop(
        "scan",
        "  %scan.i32 = s32[] bitcast(%scan.i)\n"
        "  %scan.layer = bf16[2048,8192]{1,0} bitcast(%scan.x)\n"
        "  %scan.stack = bf16[16,2048,8192]{2,1,0} bitcast(%scan.x)\n"
        "  %fusion-start.21 = ((bf16[16,2048,8192]{2,1,0}, s32[], bf16[2048,8192]{1,0}), bf16[16,2048,8192]{2,1,0}, u32[]) fusion-start(%scan.stack, %scan.i32, %scan.layer), kind=kLoop, calls=%fused_dynamic_update_slice\n"
        "  %fusion-done.21 = bf16[16,2048,8192]{2,1,0} fusion-done(%fusion-start.21)\n",
        trip=16,
    )
    report = simulated(program(ZERO + entry, ISSUE_STACK, body))
    assert report.kernels == (("fusion-start.21", None, pytest.approx(16 * 67.108868 * US)),)
    assert report.seconds == pytest.approx(16 * 67.108868 * US)


# --- collectives launched inside fusions (TPU's async collective fusions) ----------------------------

CHAIN = """
%ag.start (sp0: bf16[{rows},1000]) -> (bf16[{rows},1000], bf16[{rows2},1000], u32[]) {{
  %sp0 = bf16[{rows},1000]{{1,0}} parameter(0)
  %ag.1 = bf16[{rows2},1000]{{1,0}} all-gather(%sp0), channel_id=6, replica_groups={{{{0,1}}}}, dimensions={{0}}, use_global_device_ids=true, frontend_attributes={{chain_id="0"}}
  ROOT %cc.1 = (bf16[{rows},1000]{{1,0}}, bf16[{rows2},1000]{{1,0}}, u32[]) custom-call(%ag.1), custom_call_target="{start}"
}}

%ag.during (dp0: bf16[{rows},1000], dp1: bf16[{rows2},1000], dp2: u32[], dp3: bf16[1000,1000]) -> (bf16[1000,1000], bf16[{rows},1000], bf16[{rows2},1000], u32[]) {{
  %dp3 = bf16[1000,1000]{{1,0}} parameter(3)
  %during.dot = bf16[1000,1000]{{1,0}} dot(%dp3, %dp3), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %dp0 = bf16[{rows},1000]{{1,0}} parameter(0)
  %dp1 = bf16[{rows2},1000]{{1,0}} parameter(1)
  %ag.2 = bf16[{rows2},1000]{{1,0}} all-gather(%dp0), channel_id=6, replica_groups={{{{0,1}}}}, dimensions={{0}}, use_global_device_ids=true, frontend_attributes={{chain_id="0"}}
  %dp2 = u32[] parameter(2)
  ROOT %during.t = (bf16[1000,1000]{{1,0}}, bf16[{rows},1000]{{1,0}}, bf16[{rows2},1000]{{1,0}}, u32[]) tuple(%during.dot, %dp0, %dp1, %dp2)
}}

%ag.done (ep0: bf16[{rows},1000], ep1: bf16[{rows2},1000], ep2: u32[]) -> bf16[{rows2},1000] {{
  %ep0 = bf16[{rows},1000]{{1,0}} parameter(0)
  %ep1 = bf16[{rows2},1000]{{1,0}} parameter(1)
  %ag.3 = bf16[{rows2},1000]{{1,0}} all-gather(%ep0), channel_id=6, replica_groups={{{{0,1}}}}, dimensions={{0}}, use_global_device_ids=true, frontend_attributes={{chain_id="0"}}
  %ep2 = u32[] parameter(2)
  ROOT %cc.3 = bf16[{rows2},1000]{{1,0}} custom-call(%ep0, %ep1, %ag.3, %ep2), custom_call_target="{done}"
}}

%all-reduce-scatter (rp0: bf16[1000,1000]) -> bf16[500,1000] {{
  %rp0 = bf16[1000,1000]{{1,0}} parameter(0)
  %ars.ar = bf16[1000,1000]{{1,0}} all-reduce(%rp0), channel_id=7, replica_groups={{{{0,1}}}}, use_global_device_ids=true, to_apply=%add
  ROOT %ars.s = bf16[500,1000]{{1,0}} slice(%ars.ar), slice={{[0:500], [0:1000]}}
}}
"""
CHAIN_ENTRY = """\
  %acs = (bf16[{rows},1000]{{1,0}}, bf16[{rows2},1000]{{1,0}}, u32[]) fusion(%w.{rows}), kind=kCustom, calls=%ag.start
  %acs.0 = bf16[{rows},1000]{{1,0}} get-tuple-element(%acs), index=0
  %acs.1 = bf16[{rows2},1000]{{1,0}} get-tuple-element(%acs), index=1
  %acs.2 = u32[] get-tuple-element(%acs), index=2
  %during = (bf16[1000,1000]{{1,0}}, bf16[{rows},1000]{{1,0}}, bf16[{rows2},1000]{{1,0}}, u32[]) fusion(%acs.0, %acs.1, %acs.2, %x), kind=kOutput, calls=%ag.during
  %during.1 = bf16[{rows},1000]{{1,0}} get-tuple-element(%during), index=1
  %during.2 = bf16[{rows2},1000]{{1,0}} get-tuple-element(%during), index=2
  %during.3 = u32[] get-tuple-element(%during), index=3
  %acd = bf16[{rows2},1000]{{1,0}} fusion(%during.1, %during.2, %during.3), kind=kCustom, calls=%ag.done
  %ars = bf16[500,1000]{{1,0}} fusion(%g), kind=kCustom, calls=%all-reduce-scatter
"""


def _chained(rows: int, marked: bool = True) -> str:
    marks = ("AsyncCollectiveStart", "AsyncCollectiveDone") if marked else ("Unmarked", "Unmarked")
    fields = {"rows": rows, "rows2": 2 * rows, "start": marks[0], "done": marks[1]}
    return program(CHAIN_ENTRY.format(**fields), CHAIN.format(**fields))


@pytest.mark.parametrize("marked", [True, False])
def test_a_collective_copied_over_async_collective_fusions_runs_beside_the_fusions_between(marked):
    """TPU's form: an all-gather (AG10) started by one fusion, run beside a fusion with a DOT
    (20 us), waited for by a third (each fusion a copy of it, one ``chain_id``); then an
    all-reduce fused with its slice (AR20), waited for where it stands. The gather is hidden:
    20 + 20 = 40 us, 20 us exposed. The chain is named by its first copy (``ag.1``), as the
    report's row; the fusion between moves its DOT's bytes, not the gather's buffers it passes on.
    Without TPU's markers, the chain's first fusion starts it and its last waits for it."""
    text = _chained(500, marked)
    schedule = _timing.schedule_of(_hlo.parse_module(text))
    assert schedule == (
        _timing.Start("ag.1"),
        _timing.KernelRun("during", 2e9, "bf16", 4_000_000, None),
        _timing.Done("ag.1"),
        _timing.Sync("ars.ar"),
    )
    report = simulated(text)
    assert sorted(row.instruction for row in report.rows) == ["ag.1", "ars.ar"]
    assert report.communication_seconds == pytest.approx(30 * US)
    assert report.seconds == pytest.approx(40 * US)
    assert report.exposed_seconds == pytest.approx(20 * US)
    assert report.hidden_seconds == pytest.approx(10 * US)


def test_an_async_collective_fusion_longer_than_its_kernels_is_waited_for():
    """AG30 in the same chain: the DOT covers 20 us of it, the done waits 10: 20 + 10 + 20 = 50 us."""
    report = simulated(_chained(1500))
    assert report.seconds == pytest.approx(50 * US)
    assert report.exposed_seconds == pytest.approx(30 * US)
    assert report.hidden_seconds == pytest.approx(20 * US)


def test_a_report_row_the_schedule_leaves_out_is_an_error():
    """Every row of the report is on the schedule the step time is simulated from; a schedule
    without one (a collective the walk did not see) is refused, not simulated without it."""
    text = _chained(500)
    report = report_of_text(text)
    schedule = tuple(
        item for item in _timing.schedule_of(_hlo.parse_module(text)) if item != _timing.Sync("ars.ar")
    )
    with pytest.raises(AssertionError, match=r"leaves out the collectives ars\.ar"):
        estimated(dataclasses.replace(report, schedule=schedule), figures())
