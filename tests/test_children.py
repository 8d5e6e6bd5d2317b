"""Children side by side: a plan's candidates compiled in several child processes at once.

* Where each compile is long, more children start (up to the cores, 4, and what the memory
  holds at the first child's peak) and the plan is the same as one child's: the same rows, in
  the same order, with the same figures, and the same winner when candidates are left out.
* How many children a machine runs: its cores, at most 4, and its available memory at twice
  the first child's peak each.
* The progress of tables compiling at once: each table's seconds from its own start.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._cost.child import _child
from einshard._cost.child._progress import Progress
from tests.test_planner import D
from tests.test_planner import mlp_params as params

CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0), strategies.tensor_parallel()]
STEP = "tests.test_planner:sgd_step"
GIB = 2**30


def _plan(batch_rows: int, **kwargs) -> einshard.Plan:
    batch = jax.ShapeDtypeStruct((batch_rows, D), jnp.float32)
    return einshard.plan(STEP, params(), batch, n_devices=4, candidates=CANDIDATES, quiet=True, **kwargs)


def _figures(plan: einshard.Plan) -> list[tuple]:
    return [(row.name, row.rejected_for, row.seconds, row.traffic, row.peak_bytes) for row in plan.rows]


def test_children_side_by_side_plan_what_one_child_plans(compiles, side_by_side):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_child, "SECOND_CHILD_AFTER", float("inf"))  # as short compiles are
        one = _plan(32, exhaustive=True)
    assert len(side_by_side) == 1
    side_by_side.clear()
    several = _plan(32, exhaustive=True)
    assert len(set(side_by_side)) == 3, "the first child's answer starts two more, one per candidate left"
    assert _figures(several) == _figures(one)
    assert several.timings.compiled == 3 and several.timings.child_peak_bytes > 0
    assert several.timings.child_start > 0
    assert (one.timings.children, several.timings.children) == (1, 3)


def test_children_side_by_side_leave_out_what_cannot_win_and_keep_the_winner(compiles, side_by_side):
    """A small batch: data parallel cannot beat the others, in one child or in several."""
    several = _plan(4)
    assert len(set(side_by_side)) >= 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_child, "SECOND_CHILD_AFTER", float("inf"))
        one = _plan(4)
    assert several.usable[0].name == one.usable[0].name
    rows = {row.name: row for row in several.rows}
    assert rows["data parallel"].rejected_for == "cannot win" and rows["data parallel"].report is None


def test_an_error_in_a_child_started_beside_the_first_reaches_the_caller(compiles, monkeypatch):
    """Not a thread's log: the plan raises it, after the other children end."""
    main = threading.get_ident()
    run_child = _child._run_child

    def failing_beside(compiles, first):
        if threading.get_ident() != main:
            raise einshard.EinshardError("the child process with 4 devices failed (exit code 1)")
        return run_child(compiles, first)

    monkeypatch.setattr(_child, "SECOND_CHILD_AFTER", 0.0)
    monkeypatch.setattr(_child, "_room_for_children", lambda peak_bytes: 2)
    monkeypatch.setattr(_child, "_run_child", failing_beside)
    with pytest.raises(einshard.EinshardError, match=r"exit code 1"):
        _plan(32, exhaustive=True)


@pytest.mark.parametrize(
    ("available_gib", "children"),
    [(None, 1), (3, 1), (4, 2), (9, 3), (100, 4)],
)
def test_the_children_a_machine_runs_are_its_cores_at_most_four_and_its_memory(
    monkeypatch, available_gib, children
):
    """At a first child's peak of 2 GiB, each further child needs 4 GiB available."""
    monkeypatch.setattr(_child.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    available = None if available_gib is None else available_gib * GIB
    monkeypatch.setattr(_child, "_available_memory", lambda: available)
    assert _child._room_for_children(2 * GIB) == children


def test_the_children_a_machine_runs_are_at_most_its_cores(monkeypatch):
    monkeypatch.setattr(_child.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(_child, "_available_memory", lambda: 1000 * GIB)
    assert _child._room_for_children(GIB) == 2


def test_the_available_memory_is_read_where_linux_says_it():
    available = _child._available_memory()
    try:
        with open("/proc/meminfo") as meminfo:
            listed = "MemAvailable:" in meminfo.read()
    except OSError:
        listed = False
    assert (available is not None and available > 0) == listed


def test_progress_of_tables_compiling_at_once_times_each_from_its_own_start():
    with Progress("plan", ["a", "b"], quiet=True) as progress:
        progress.compiling(0)
        time.sleep(0.3)
        progress.compiling(1)
        assert progress.current == 1
        progress.finished(0)
        assert progress.current == 1, "b is still compiling"
        progress.finished(1)
        assert progress.current is None
    assert progress.seconds[0] >= 0.3 > progress.seconds[1]
