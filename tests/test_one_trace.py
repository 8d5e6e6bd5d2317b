"""A plan traces the step once for all its candidates, unless it calls ``like_batch``.

A trace with no ``like_batch`` in it (the plan's first, for the roles and bounds, or the first
compile's) is kept on the call (``StepCall.traces``): the arguments' shardings are given when it
is lowered, so the program is every candidate's. Each candidate's report must be the one it gets
traced on its own (``explain_step`` under that strategy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._tracing._batch_layout import current_batch
from tests.test_planner import CANDIDATES, D, mlp_params

N = jax.device_count()
BATCH = jax.ShapeDtypeStruct((8 * N, D), jnp.float32)


def _counted(constrain: bool):
    """The planner's MLP step, counting its traces; ``constrain``: its activations kept like the batch."""
    traces: list[str | None] = []

    def step(params, batch):
        traces.append(current_batch())
        h = jax.nn.relu(batch @ params["up"]["kernel"])
        if constrain:
            h = einshard.like_batch(h)

        def loss(p):
            out = jax.nn.relu(batch @ p["up"]["kernel"])
            return jnp.mean((out @ p["down"]["kernel"]) ** 2) + 0 * jnp.sum(h)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, traces


def _same_as_alone(step, plan) -> None:
    """Each compiled candidate's figures equal its own ``explain_step``'s, traced under it alone."""
    for row in plan.compiled:
        alone = einshard.explain_step(step, mlp_params(), BATCH, rules=row.strategy, quiet=True)
        assert alone.traffic == row.traffic, row.name
        assert alone.peak_bytes == row.peak_bytes, row.name
        assert [(r.kind, r.shape, r.group_size) for r in alone.rows] == [
            (r.kind, r.shape, r.group_size) for r in row.report.rows
        ], row.name


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_a_plan_traces_the_step_once_for_all_its_candidates():
    step, traces = _counted(constrain=False)
    plan = einshard.plan(step, mlp_params(), BATCH, candidates=CANDIDATES, quiet=True, exhaustive=True)
    assert len(plan.compiled) == len(CANDIDATES)
    # One trace, for the step's roles and bounds (under no strategy): every candidate compiles it.
    assert traces == [None]
    _same_as_alone(step, plan)


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_a_step_whose_like_batch_follows_the_strategy_is_traced_for_each_candidate():
    step, traces = _counted(constrain=True)
    plan = einshard.plan(step, mlp_params(), BATCH, candidates=CANDIDATES, quiet=True, exhaustive=True)
    assert len(plan.compiled) == len(CANDIDATES)
    # The roles' trace, then each candidate's own, under its own batch expression.
    assert traces[0] is None
    assert sorted(traces[1:]) == sorted(strategy.batch for strategy in CANDIDATES)
    _same_as_alone(step, plan)


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_plan_batches_traces_the_step_once_per_batch_size():
    step, traces = _counted(constrain=False)
    batches = einshard.plan_batches(
        step, mlp_params(), BATCH, candidates=CANDIDATES[:2], memory_per_device=1 << 20, quiet=True
    )
    sizes = {tried.batch_size for row in batches.rows for tried in row.tried}
    assert len(sizes) >= 2 and batches.compiles > len(sizes)  # candidates shared sizes
    # plan_batches reads no roles (its candidates are given): one trace per size, under a strategy.
    assert len(traces) == len(sizes) and None not in traces, (traces, sizes)


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_inside_a_use_strategy_block_each_candidate_is_traced_under_its_own_strategy():
    """The user's block is not the candidates': a step calling like_batch follows each candidate's
    batch expression, and one that does not is still traced once."""
    outer = strategies.hybrid(model=2)
    for constrain, expected in ((True, 1 + len(CANDIDATES)), (False, 1)):
        step, traces = _counted(constrain=constrain)
        with einshard.use_strategy(outer):
            plan = einshard.plan(
                step, mlp_params(), BATCH, candidates=CANDIDATES, quiet=True, exhaustive=True
            )
        assert len(traces) == expected, traces
        assert traces[0] == outer.batch  # the roles' trace runs in the user's block
        if constrain:
            assert sorted(traces[1:]) == sorted(strategy.batch for strategy in CANDIDATES)
        _same_as_alone(step, plan)
