"""The simulated step time, against three bf16 GPT steps measured on one H200, and by hand.

* Each of the three steps of ``../shared/accelerators/h200-time`` (``tests/gpu_time_steps.py``),
  compiled here for one compile-only H200, is simulated within 1.5x of its measured time, with
  its peak memory within 1 % of the device's measured peak (with and without a rule table), and
  its flops equal to its dots counted by hand.
* The flops read from a program's dots equal XLA's CPU cost analysis on a matmul step.
* Two programs written here (an FSDP-like gather hidden behind a gemm, a smaller all-reduce
  that nothing hides) rank one way added up and the other way simulated; the times are worked
  out by hand from their text.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard._cost.hardware import _figures, _timing
from einshard._cost.pipeline._analysis import report_of_text
from einshard._cost.report._report import estimated
from einshard._cost.xla import _hlo, _hlo_kernels
from einshard._planning.search._planner import PlanRow, _ranked
from tests import gpu_time_steps as measured
from tests.test_targets import needs_gpu

# ruff: noqa: E501  (the programs below are XLA's lines, as it prints them)

TIME = Path(__file__).resolve().parents[2] / "shared" / "accelerators" / "h200-time" / "time_mem.json"
needs_time = pytest.mark.skipif(
    not TIME.is_file(), reason=f"the H200 measurements are not beside the clone ({TIME})"
)


@pytest.fixture(scope="module")
def h200_reports():
    """Each measured step's report for one H200: without rules, and with a table that replicates."""
    table = einshard.Rules([(".*", "... -> * ...")])
    out = {}
    for index in range(len(measured.CONFIGS)):
        step, params, tokens = measured.case(index)
        # Measured without donation (gpu_time_mem.py: donate_argnums=()): compiled so here too.
        out[index] = [
            einshard.explain_step(step, params, tokens, rules=rules, target="h200", n_devices=1, donate=False)
            for rules in (None, table)
        ]
    return out


@needs_gpu
@needs_time
@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_measured_h200_steps_are_simulated_within_1_5x_and_their_peak_within_1_percent(
    h200_reports, index
):
    row = json.loads(TIME.read_text())[index]
    for report in h200_reports[index]:
        assert report.target == "h200" and report.seconds == report.simulated_seconds
        assert row["measured_s"] / 1.5 <= report.seconds <= row["measured_s"] * 1.5
        assert report.peak_bytes == pytest.approx(row["device_peak_bytes_in_use"], rel=0.01)
        assert report.flops == measured.matmul_flops(index)  # every dot of the program, none left out
        assert 0.2 < report.model_flops_utilisation < 0.8
        assert report.kernels and report.kernels[0][1] is not None  # the slowest kernel's source line
        assert "step time" in str(report) and "utilisation" in str(report)


def test_the_flops_of_a_program_s_dots_are_the_cpu_cost_analysis_s():
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))(w)

    w = (jnp.ones((256, 512)), jnp.ones((512, 128)))
    x = jnp.ones((64, 256))
    compiled = jax.jit(step).lower(w, x).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    dots = _hlo_kernels.program_matmul_flops(_hlo.parse_module(compiled.as_text()))
    assert dots == 2 * 64 * 256 * 512 + 2 * 64 * 512 * 128 * 2 + 2 * 256 * 64 * 512  # forward, backward
    assert dots == pytest.approx(cost["flops"], rel=0.02)  # the rest: the tanh and the sum


# --- overlap, by hand ----------------------------------------------------------------------------

_DOT = """
%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
GATHERED = textwrap.dedent(
    """
    HloModule gathered, num_partitions=2
    """
    + _DOT
    + """
    ENTRY %main (x: bf16[1024,1024], w: bf16[512,1024]) -> bf16[1024,1024] {
      %x = bf16[1024,1024]{1,0} parameter(0)
      %w = bf16[512,1024]{1,0} parameter(1)
      %all-gather-start = (bf16[512,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%w), channel_id=1, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true
      %f1 = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
      %all-gather-done = bf16[1024,1024]{1,0} all-gather-done(%all-gather-start)
      ROOT %f2 = bf16[1024,1024]{1,0} fusion(%f1, %all-gather-done), kind=kCustom, calls=%fused_dot
    }
    """
)
REDUCED = textwrap.dedent(
    """
    HloModule reduced, num_partitions=2
    """
    + _DOT
    + """
    ENTRY %main (x: bf16[1024,1024], g: bf16[256,1024]) -> (bf16[1024,1024], bf16[256,1024]) {
      %x = bf16[1024,1024]{1,0} parameter(0)
      %g = bf16[256,1024]{1,0} parameter(1)
      %f1 = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
      %all-reduce = bf16[256,1024]{1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
      %f2 = bf16[1024,1024]{1,0} fusion(%f1, %x), kind=kCustom, calls=%fused_dot
      ROOT %t = (bf16[1024,1024]{1,0}, bf16[256,1024]{1,0}) tuple(%f2, %all-reduce)
    }
    """
)
# Round figures: 1e14 FLOP/s for every dot, 1e12 B/s of memory, 1e11 B/s of link, no floors.
HARDWARE = _figures.Hardware(
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
)
FIGURES = _figures.Figures(target="round", hardware=HARDWARE, bandwidth=1e11, flops_per_second=1e14)


def _simulated(text: str):
    report = report_of_text(text)
    report = dataclasses.replace(report, schedule=_timing.schedule_of(_hlo.parse_module(text)))
    return estimated(report, FIGURES)


def test_a_gather_hidden_behind_a_gemm_ranks_first_only_when_overlap_is_simulated():
    gemm = 2 * 1024**3 / 1e14  # each fusion: 2.15e9 flops at 1e14 FLOP/s (its 6 MiB at 1e12 B/s: less)
    gathered, reduced = _simulated(GATHERED), _simulated(REDUCED)
    gather = 1024 * 1024 * 2 / 2 / 1e11  # the ring's (n-1)/n of the 2 MiB result
    reduce = 2 * (1 / 2) * 256 * 1024 * 2 / 1e11  # 2(n-1)/n of 512 KiB
    assert gathered.communication_seconds == pytest.approx(gather)
    assert reduced.communication_seconds == pytest.approx(reduce)
    # Added up, the gathered program is the slower one ...
    assert 2 * gemm + gather > 2 * gemm + reduce
    # ... simulated, its gather runs while the first gemm does, and it is the faster.
    assert gathered.seconds == pytest.approx(2 * gemm)
    assert gathered.hidden_seconds == pytest.approx(gather) and gathered.exposed_seconds == 0
    assert reduced.seconds == pytest.approx(2 * gemm + reduce)
    assert reduced.exposed_seconds == pytest.approx(reduce)
    fsdp = PlanRow(einshard.strategies.fsdp(), gathered, None, index=1)
    replicated = PlanRow(einshard.strategies.data_parallel(), reduced, None, index=0)
    plan = _ranked([replicated, fsdp], 2, FIGURES)
    assert [row.name for row in plan.rows] == [fsdp.name, replicated.name]
    assert [row.seconds for row in plan.rows] == [gathered.seconds, reduced.seconds]
