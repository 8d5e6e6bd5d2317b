"""Every public verb on every path it has: in this process, in a child process, on a GPU and a TPU target.

A tiny MLP step (``tests.test_planner:sgd_step``, which a child process imports) goes through
``explain_step``, ``plan``, ``Plan.at`` and ``StepReport.at``, ``explain_step(rules=plan.best)``
and ``plan_batches``:

* on simulated CPU devices in this process, and in a child process (``n_devices=`` and
  ``isolate=True``);
* on 8 H100s and on 8 TPU v5e chips (compile-only devices, XLA's own compilers, always in a child
  process), each in one child process and, for ``plan`` (GPU) and ``plan_batches`` (TPU), in
  several side by side.

On every path the winner's report is the report ``rules=plan.best`` gives, figure for figure; a
plan's and a report's ``.at()`` move the estimate as the figure given says; and the largest batch
``plan_batches`` shows fits the memory given, by its own compile, and the next size up was tried.
The target paths need XLA's compilers (``nox -s targets`` installs them and runs them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._cost.child import _child
from tests.test_planner import D, mlp_params
from tests.test_targets import needs_gpu, needs_tpu

N = jax.device_count()
STEP = "tests.test_planner:sgd_step"
CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0)]
BANDWIDTH = 100e9


def _batch(rows: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, D), jnp.float32)


def _figures(report: einshard.StepReport) -> tuple:
    rows = [(row.kind, row.shape, row.times) for row in report.rows]
    return rows, report.bytes, report.traffic, report.peak_bytes, report.flops, report.seconds


def _check_every_verb(
    report_where: dict, plan_where: dict, n: int, *, rows: int, memory: int
) -> tuple[einshard.Plan, einshard.BatchPlan]:
    """Each verb on one path (``report_where``: its keywords for ``explain_step``, ``plan_where``:
    for ``plan`` and ``plan_batches``), on ``n`` devices; the plan and the batch plan."""
    target = report_where.get("target", "cpu")
    figures = {} if target != "cpu" else {"bandwidth": BANDWIDTH, "flops_per_second": 1e12}
    report = einshard.explain_step(
        STEP, mlp_params(), _batch(rows), rules=CANDIDATES[1], quiet=True, **figures, **report_where
    )
    assert report.n_devices == n and report.target == target
    assert report.rows and report.seconds and report.peak_bytes and report.bandwidth
    # .at(bandwidth=): every collective at the bandwidth given, its latency kept.
    given = report.at(bandwidth=BANDWIDTH)
    slower = report.at(bandwidth=BANDWIDTH / 10)
    for before, after in zip(given.rows, slower.rows, strict=True):
        assert after.seconds - after.traffic / (BANDWIDTH / 10) == pytest.approx(
            before.seconds - before.traffic / BANDWIDTH, abs=1e-12
        )
    assert slower.seconds >= given.seconds

    plan = einshard.plan(
        STEP,
        mlp_params(),
        _batch(rows),
        candidates=CANDIDATES,
        exhaustive=True,
        quiet=True,
        **figures,
        **plan_where,
    )
    assert plan.n_devices == n and plan.target == target
    assert [row.rejected for row in plan.rows] == [None, None]
    fsdp = next(row.report for row in plan.rows if row.name == CANDIDATES[1].name)
    assert fsdp is not None and _figures(fsdp) == _figures(report)  # the plan's row is the report
    winner = plan.rows[0].report
    assert winner is not None
    again = einshard.explain_step(
        STEP, mlp_params(), _batch(rows), rules=plan.best, quiet=True, **figures, **report_where
    )
    assert _figures(again) == _figures(winner)
    at = plan.at(bandwidth=BANDWIDTH / 10)
    assert [row.report.bandwidth for row in at.rows if row.report] == [BANDWIDTH / 10] * 2

    batches = einshard.plan_batches(
        STEP,
        mlp_params(),
        _batch(rows),
        candidates=CANDIDATES,
        memory_per_device=memory,
        max_compiles=2,
        quiet=True,
        **figures,
        **plan_where,
    )
    assert len(batches.rows) == 2
    for row in batches.rows:
        assert row.rejected is None and row.report is not None and row.report.n_devices == n
        assert row.report.peak_bytes <= memory
        assert len(row.tried) == 2 and row.tried[0].batch_size == rows  # the search began there
    return plan, batches


# A memory limit the first few batch sizes fit: the search moves up from the batch given.
MEMORY = 64 << 20


@pytest.mark.parametrize("path", ["in process", "in a child"])
def test_every_verb_on_cpu_devices(path):
    if path == "in process":
        _check_every_verb({}, {}, N, rows=8 * N, memory=MEMORY)
    else:  # explain_step compiles in a child for n_devices=; plan and plan_batches with isolate=True
        _check_every_verb({"n_devices": N}, {"n_devices": N, "isolate": True}, N, rows=8 * N, memory=MEMORY)


TARGETS = [
    pytest.param("h100", marks=needs_gpu, id="h100"),
    pytest.param("v5e", marks=needs_tpu, id="v5e"),
]


ONE_CHILD: dict[str, tuple[einshard.Plan, einshard.BatchPlan]] = {}  # by target, for the next test


def _in_one_child(target: str) -> tuple[einshard.Plan, einshard.BatchPlan]:
    where = {"target": target, "n_devices": 8}
    ONE_CHILD[target] = _check_every_verb(where, where, 8, rows=64, memory=MEMORY)
    return ONE_CHILD[target]


@pytest.mark.parametrize("target", TARGETS)
def test_every_verb_on_a_target_in_one_child(target):
    _in_one_child(target)


@needs_tpu
def test_every_verb_on_two_tpu_slices():
    """16 v5e chips in 2 slices of 2x4 (``slices=2``): the reports cover both slices' devices, and
    what crosses between the slices (a chip and its copy) is timed at DCN, not on the torus."""
    where = {"target": "v5e", "n_devices": 16, "slices": 2}
    plan, _ = _check_every_verb(where, where, 16, rows=128, memory=MEMORY)
    fsdp = next(row.report for row in plan.rows if row.name == CANDIDATES[1].name)
    assert fsdp is not None and fsdp.topology == "2 slices of v5e:2x4"
    assert "16 V5E (2 slices of v5e:2x4)" in str(fsdp)
    assert fsdp.figures is not None
    slice_of = fsdp.figures.links.host  # the slice a device (by id) is in

    def slices_of(group: tuple[int, ...]) -> list[int]:
        return sorted(slice_of(device) for device in group)

    # The gradients' sum between slices: groups of a chip and its copy on the other slice.
    across = [row for row in fsdp.rows if row.groups and all(slices_of(g) == [0, 1] for g in row.groups)]
    assert across, [(row.kind, row.groups) for row in fsdp.rows]
    dcn = 3.125e9  # v5e's DCN per chip (Google's figure, _tpu.GENERATIONS)
    for row in across:
        assert row.seconds >= row.traffic / dcn
    assert any(len(set(slices_of(g))) == 1 for row in fsdp.rows for g in row.groups)  # and within one


@pytest.mark.parametrize("target", TARGETS)
def test_a_target_s_plan_in_several_children_is_the_plan_of_one(target, side_by_side):
    """h100: plan's candidates side by side; v5e: plan_batches's (each round's two at once)."""
    with pytest.MonkeyPatch.context() as patch:  # one child, as short compiles are
        patch.setattr(_child, "SECOND_CHILD_AFTER", float("inf"))
        one_plan, one_batches = ONE_CHILD.get(target) or _in_one_child(target)
    side_by_side.clear()
    where = {"target": target, "n_devices": 8, "candidates": CANDIDATES, "quiet": True}
    if target == "h100":
        several = einshard.plan(STEP, mlp_params(), _batch(64), exhaustive=True, **where)
        assert (one_plan.timings.children, several.timings.children) == (1, 2)
        assert [(row.name, _figures(row.report)) for row in several.rows] == [
            (row.name, _figures(row.report)) for row in one_plan.rows
        ]
    else:
        batches = einshard.plan_batches(
            STEP, mlp_params(), _batch(64), memory_per_device=MEMORY, max_compiles=2, **where
        )
        assert len(side_by_side) == 4  # two rounds of the search, two children side by side in each
        assert [(row.name, row.batch_size, _figures(row.report)) for row in batches.rows] == [
            (row.name, row.batch_size, _figures(row.report)) for row in one_batches.rows
        ]


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_a_use_strategy_block_crosses_into_the_child():
    """``with use_strategy(fsdp): explain_step(..., n_devices=N)``: the child traces the step in the
    block, as this process does, so ``like_batch`` in the model's loop follows it there too; outside
    the block it does nothing, and the loop reduces the whole batch's activations."""
    from tests import test_scanned as scanned

    params, batch, plain = scanned.make_params(), scanned.BATCH, scanned.PLAIN
    with einshard.use_strategy(scanned.FSDP):
        here = einshard.explain_step(scanned.marked_step, params, batch, rules=plain)
        child = einshard.explain_step(
            "tests.test_scanned:marked_step", params, batch, rules=plain, n_devices=N, quiet=True
        )
    outside = einshard.explain_step(
        "tests.test_scanned:marked_step", params, batch, rules=plain, n_devices=N, quiet=True
    )
    assert not scanned.full_batch_reductions(here) and scanned.full_batch_reductions(outside)
    assert _figures(child)[:4] == _figures(here)[:4]


def sequence_major_step(w, batch):
    """``like_batch`` on a sequence-major carry (``tests.test_loops``): einshard warns of it."""
    from tests.test_loops import _seq_major

    return jax.grad(_seq_major)(w, batch)


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_einshard_s_warnings_in_the_child_reach_this_process():
    """explain_step warns of like_batch splitting another axis than the batch's, here and from a child."""
    from tests.test_loops import FSDP, H

    w, batch = jax.ShapeDtypeStruct((3, H, H), jnp.float32), jax.ShapeDtypeStruct((2 * N, N, H), jnp.float32)
    with pytest.warns(einshard.EinshardWarning, match="whose batch is axis 1") as here:
        einshard.explain_step(sequence_major_step, w, batch, rules=FSDP)
    with pytest.warns(einshard.EinshardWarning, match="whose batch is axis 1") as there:
        einshard.explain_step(
            "tests.test_every_path:sequence_major_step", w, batch, rules=FSDP, n_devices=N, quiet=True
        )
    assert [str(w.message) for w in there] == [str(w.message) for w in here]
