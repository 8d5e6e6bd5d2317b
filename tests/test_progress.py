"""A long plan says what it is doing, and a compile this machine's memory ended says so.

* ``Progress`` writes nothing before its delay, then each table's start and end as plain lines
  (no terminal), and nothing at all under ``quiet=True``.
* ``plan`` and ``explain_step`` in a child process report each candidate as it is compiled, in order.
* A child killed from outside (SIGKILL, as the kernel's out-of-memory killer does) while it
  compiles a candidate rejects that candidate as "not compiled on this machine", with the
  child's peak memory, not as a step that "does not compile"; the other candidates are kept.
"""

from __future__ import annotations

import io
import os
import signal
import time

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._cost.child import _progress
from einshard._cost.child._progress import Progress


def step(params, batch):
    if os.environ.get("EINSHARD_TEST_KILL_CHILD") not in (None, str(os.getpid())):
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would, in the child only
    grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


PARAMS = {"w": jax.ShapeDtypeStruct((96, 96), jnp.float32)}
BATCH = jax.ShapeDtypeStruct((96, 96), jnp.float32)
CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0)]


def test_progress_is_silent_before_its_delay_then_writes_each_table():
    stream = io.StringIO()
    with Progress("plan", ["data parallel", "fsdp"], stream=stream, show_after=60.0) as progress:
        progress.compiling(0)
        progress.finished(0)
    assert stream.getvalue() == ""

    stream = io.StringIO()
    with Progress("plan", ["data parallel", "fsdp"], stream=stream, show_after=0.0) as progress:
        time.sleep(0.2)  # the timer shows the table being compiled, without waiting for its end
        progress.compiling(0)
        progress.finished(0)
        progress.compiling(1)
        progress.finished(1, "rejected")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("plan: compiling 1 of 2: 'data parallel' (0 done")
    assert lines[1].startswith("plan: 'data parallel' compiled in ")
    assert lines[1].endswith("(1 of 2 done, 1 left)")
    assert lines[2].startswith("plan: compiling 2 of 2: 'fsdp' (1 done")
    assert lines[3].startswith("plan: 'fsdp' rejected in ") and lines[3].endswith("(2 of 2 done, 0 left)")
    assert lines[4].startswith("plan: 2 of 2 done in ")


def test_quiet_progress_writes_nothing():
    stream = io.StringIO()
    with Progress("plan", ["a", "b"], stream=stream, show_after=0.0, quiet=True) as progress:
        time.sleep(0.1)
        progress.compiling(0)
        progress.finished(0)
    assert stream.getvalue() == ""


@pytest.fixture
def shown_at_once(monkeypatch):
    monkeypatch.setattr(_progress, "SHOW_AFTER", 0.0)


def test_a_plan_in_a_child_reports_each_candidate_in_order(shown_at_once, capsys):
    n = jax.device_count() * 2
    result = einshard.plan(step, PARAMS, BATCH, n_devices=n, candidates=CANDIDATES, exhaustive=True)
    assert [row.rejected for row in result.rows] == [None, None]
    err = capsys.readouterr().err
    # Most promising first: FSDP need not sum its gradients across devices, data parallel must.
    assert "plan: compiling 1 of 2: 'fsdp'" in err or "plan: 'fsdp' compiled in" in err
    assert err.index("'fsdp' compiled in") < err.index("'data parallel' compiled in")
    assert "(2 of 2 done, 0 left)" in err

    einshard.plan(step, PARAMS, BATCH, n_devices=n, candidates=CANDIDATES, quiet=True)
    assert capsys.readouterr().err == ""


def test_explain_step_in_a_child_reports_its_compile(shown_at_once, capsys):
    n = jax.device_count() * 2
    report = einshard.explain_step(step, PARAMS, BATCH, n_devices=n, rules=[(".*", "b ... -> b* ...")])
    assert report.n_devices == n
    assert f"explain_step: '{n} CPU devices' compiled in" in capsys.readouterr().err


def test_a_child_killed_from_outside_is_this_machine_s_memory_not_the_step(monkeypatch):
    monkeypatch.setenv("EINSHARD_TEST_KILL_CHILD", str(os.getpid()))
    n = jax.device_count() * 2
    result = einshard.plan(step, PARAMS, BATCH, n_devices=n, candidates=CANDIDATES, quiet=True)
    assert all(row.report is None for row in result.rows)
    for row in result.rows:
        assert row.rejected is not None
        assert row.rejected.startswith("not compiled on this machine: killed while compiling it (SIGKILL")
        assert "at a peak of " in row.rejected and "this machine ran out of memory" in row.rejected
        assert row.rejected_for == "killed here"
    assert "rejected (killed here)" in str(result)
