"""einshard.plan: rankings checked against the step reports' own figures (fast link, too little
memory, slow link with large activations), rejections, another device count in a child process,
and the winner trained for a few steps giving one device's losses (Flax NNX and Equinox)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard import strategies
from einshard._cost._planner import _with_batch

N = jax.device_count()
D, HIDDEN = 32, 16 * N  # every split axis divides by the device count


def sgd_step(params, batch):
    def loss(p):
        h = jax.nn.relu(batch @ p["up"]["kernel"])
        return jnp.mean((h @ p["down"]["kernel"]) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def mlp_params() -> dict:
    return {
        "up": {"kernel": jax.ShapeDtypeStruct((D, HIDDEN), jnp.float32)},
        "down": {"kernel": jax.ShapeDtypeStruct((HIDDEN, D), jnp.float32)},
    }


CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0), strategies.tensor_parallel()]


@pytest.fixture(scope="module")
def planned() -> einshard.Plan:
    """The step compiled once under each candidate: a batch far larger than the weights."""
    batch = jax.ShapeDtypeStruct((64 * N, D), jnp.float32)
    return einshard.plan(sgd_step, mlp_params(), batch, candidates=CANDIDATES)


def test_a_fast_link_ranks_data_parallel_first(planned):
    plan = planned.at(bandwidth=1e15, flops_per_second=1e12)
    seconds = [row.report.communication_seconds + row.report.compute_seconds for row in plan.rows]
    assert [row.seconds for row in plan.rows] == seconds
    # Data parallelism updates every weight on every device, so its flops are a little higher;
    # within 2% of the fastest, the simpler strategy ranks first.
    assert seconds[0] <= min(seconds) * 1.02
    assert plan.best.name == "data parallel" and plan.rows[0].rejected is None
    # The figures are the step report's: the same as explain_step gives for the winner's table.
    batch = jax.ShapeDtypeStruct((64 * N, D), jnp.float32)
    report = einshard.explain_step(
        sgd_step,
        mlp_params(),
        batch,
        rules=_with_batch(plan.best, "batch"),
        bandwidth=1e15,
        flops_per_second=1e12,
    )
    assert plan.rows[0].report.traffic == report.traffic
    assert plan.rows[0].seconds == pytest.approx(report.step_seconds)
    assert plan.rows[0].peak_bytes == report.peak_bytes
    assert plan.rows[0].bytes_by_kind == report.bytes_by_kind


def test_too_little_memory_for_data_parallel_rejects_it_and_says_why(planned):
    peaks = {row.name: row.peak_bytes for row in planned.rows}
    assert min(peaks.values()) < peaks["data parallel"]  # replicating the weights costs memory
    limit = (peaks["data parallel"] + min(peaks.values())) // 2
    plan = planned.at(memory_per_device=limit, bandwidth=1e15, flops_per_second=1e12)
    rejected = {row.name: row.rejected for row in plan.rows}
    assert rejected["data parallel"].startswith("does not fit memory: needs")
    assert plan.best.name != "data parallel"
    assert all((row.peak_bytes > limit) == (row.rejected is not None) for row in plan.rows)
    assert plan.rows[-1].name == "data parallel" or plan.rows[-1].rejected is not None
    text = str(plan)
    assert "rejected (memory)" in text and "rejected data parallel: does not fit memory: needs" in text
    assert "best" in text
    assert "Estimates, not measurements" in text
    # Given back the memory, it is ranked again.
    assert plan.at(memory_per_device=10 * peaks["data parallel"]).best.name == "data parallel"
    with pytest.raises(einshard.EinshardError, match="no candidate strategy fits"):
        _ = planned.at(memory_per_device=1).best


def test_a_slow_link_with_large_activations_prefers_fewer_bytes(planned):
    plan = planned.at(bandwidth=1e6, flops_per_second=1e12)
    traffic = {row.name: row.traffic for row in plan.rows}
    # Tensor parallelism moves activations (the batch is large), data parallelism the gradients.
    assert traffic["tensor parallel"] > traffic["data parallel"]
    assert plan.rows[0].traffic == min(traffic.values())
    assert [row.traffic for row in plan.rows] == sorted(traffic.values())
    text = str(plan)
    assert "█" in text and "estimated step time" in text


def test_a_candidate_that_does_not_divide_is_rejected_with_the_reason():
    batch = jax.ShapeDtypeStruct((4 * N + 1, D), jnp.float32)  # no device count > 1 divides it
    plan = einshard.plan(
        sgd_step,
        mlp_params(),
        batch,
        bandwidth=1e9,
        candidates=[strategies.data_parallel(), strategies.tensor_parallel()],
    )
    rows = {row.name: row for row in plan.rows}
    assert rows["data parallel"].report is None
    assert rows["data parallel"].rejected.startswith("does not fit the shapes or devices: ")
    assert "'batch'" in rows["data parallel"].rejected
    assert plan.best.name == "tensor parallel" and plan.rows[-1].name == "data parallel"


def test_bad_candidates_are_refused():
    with pytest.raises(einshard.EinshardError, match="must be a Strategy"):
        einshard.plan(
            sgd_step, mlp_params(), jnp.zeros((N, D)), candidates=[einshard.Rules([(".*", "... -> * ...")])]
        )
    with pytest.raises(einshard.EinshardError, match="n_devices must be a positive integer"):
        einshard.plan(sgd_step, mlp_params(), jnp.zeros((N, D)), n_devices=0)


@pytest.mark.skipif(N != 8, reason="one child process is enough: run at 8 devices")
def test_another_device_count_is_planned_in_a_child_process():
    batch = jax.ShapeDtypeStruct((12, D), jnp.float32)
    plan = einshard.plan(
        "tests.test_planner:sgd_step",
        {
            "up": {"kernel": jax.ShapeDtypeStruct((D, 48), jnp.float32)},
            "down": {"kernel": jax.ShapeDtypeStruct((48, D), jnp.float32)},
        },
        batch,
        n_devices=3,
        bandwidth=1e9,
        candidates=[strategies.data_parallel(), strategies.fsdp(min_bytes=0), strategies.hybrid(model=2)],
    )
    rows = {row.name: row for row in plan.rows}
    assert rows["data parallel"].report.n_devices == 3 and rows["fsdp"].report.n_devices == 3
    assert rows["hybrid model=2"].rejected is not None  # 2 does not divide 3 devices
    # Data parallelism's only collective is the gradients' all-reduce: the weights' bytes.
    assert rows["data parallel"].bytes_by_kind == {"all-reduce": 2 * D * 48 * 4}
    assert plan.n_devices == 3


# --- the winner trained -------------------------------------------------------------------------


def _losses(step, state, batch, steps=3):
    losses = []
    for _ in range(steps):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return losses


def _train_winner(step, state, batch):
    """Plans, then trains the winner (not data parallelism: too little memory) and one device."""
    plan = einshard.plan(
        step,
        state,
        batch,
        bandwidth=1e12,
        flops_per_second=1e12,
        candidates=[strategies.data_parallel(), strategies.fsdp(min_bytes=0), strategies.tensor_parallel()],
    )
    peaks = {row.name: row.peak_bytes for row in plan.rows}
    plan = plan.at(memory_per_device=peaks["data parallel"] - 1)
    winner = plan.best
    assert winner.name != "data parallel"
    sharded_state = einshard.shard_pytree(state, winner)
    sharded_batch = einshard.einshard(batch, winner.batch)
    one = jax.devices()[0]
    sharded = _losses(jax.jit(step), sharded_state, sharded_batch)
    single = _losses(jax.jit(step), jax.device_put(state, one), jax.device_put(batch, one))
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert sharded[-1] < sharded[0]  # it trains
    return winner, sharded_state


def test_the_winner_trains_a_flax_nnx_model_like_one_device():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, HIDDEN, rngs=rngs)
            self.down = nnx.Linear(HIDDEN, D, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))

    def step(state, batch):
        def loss(state):
            return jnp.mean((nnx.merge(graphdef, state)(batch) - batch) ** 2)

        value, grads = jax.value_and_grad(loss)(state)
        return jax.tree.map(lambda p, g: p - 0.05 * g, state, grads), value

    batch = jax.random.normal(jax.random.key(1), (8 * N, D))
    winner, sharded = _train_winner(step, state, batch)
    assert any(_block(leaf).shape != leaf.shape for leaf in jax.tree.leaves(sharded)), winner


def test_the_winner_trains_an_equinox_model_like_one_device():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(D, D, HIDDEN, 1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, batch):
        def loss(params):
            out = jax.vmap(eqx.combine(params, static))(batch)
            return jnp.mean((out - batch) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

    batch = jax.random.normal(jax.random.key(1), (8 * N, D))
    winner, sharded = _train_winner(step, params, batch)
    assert any(_block(leaf).shape != leaf.shape for leaf in jax.tree.leaves(sharded)), winner


def _block(array):
    """Device 0's block of an array (checks the layout really splits)."""
    return array.addressable_shards[0].data


# --- derived tables, and what each row splits -------------------------------------------------------


def _gpt():
    from test_roles import gpt_params, gpt_step, tokens

    params = jax.eval_shape(lambda: gpt_params(jax.random.key(0)))
    return gpt_step(), params, jax.ShapeDtypeStruct(tokens(batch=2 * N).shape, jnp.int32)


def test_plan_reads_the_tensor_parallel_tables_from_the_step():
    step, params, batch = _gpt()
    plan = einshard.plan(step, params, batch, min_bytes=0, bandwidth=1e10)
    rows = {row.name: row for row in plan.rows}
    models = [m for m in range(2, N) if N % m == 0]
    assert set(rows) == {"data parallel", "fsdp", "tensor parallel", *(f"hybrid model={m}" for m in models)}
    # The names (e, blocks/0/x, w1 ...) match no name-based rule: the tables come from the dataflow.
    for name in ("tensor parallel", *(f"hybrid model={m}" for m in models)):
        row = rows[name]
        assert row.model_parallel and row.split_share >= 0.5 and not row.splits_little, name
        assert all(rule.note for rule in row.strategy), name
        assert not row.unused_rules, name
    assert rows["data parallel"].split_share == 0 and not rows["data parallel"].model_parallel
    assert rows["fsdp"].split_share > 0.9  # FSDP splits over all devices (no model axis)
    text = str(plan)
    assert " split " in text.splitlines()[0] and "splits only" not in text


def test_a_model_parallel_candidate_that_splits_little_says_so():
    step, params, batch = _gpt()
    named = strategies.tensor_parallel()  # by layer names: none of them is in this model
    plan = einshard.plan(step, params, batch, candidates=[strategies.data_parallel(), named], bandwidth=1e10)
    row = next(row for row in plan.rows if row.name == "tensor parallel")
    assert row.split_share == 0 and row.splits_little and len(row.unused_rules) == 5
    text = str(plan)
    assert "splits only 0%" in text and "fits" not in text.split("tensor parallel")[1].splitlines()[0]
    assert "tensor parallel splits only 0% of the parameter bytes over its model axis" in text
    assert "tensor parallel: 5 rules matched no parameter" in text
    # explain flags the same rules: their regexes match no path of this tree at all.
    report = einshard.explain(params, named)
    assert len(report.unmatched_rules) == 5 and "5 rules match no path of this tree" in str(report)


def test_a_hybrid_split_counts_only_the_model_axis():
    if N % 2 or N == 2:
        pytest.skip("needs a (data, model=2) grid")
    step, params, batch = _gpt()
    fsdp_only = strategies.Strategy(
        [(".*", strategies.SplitLargest(min_bytes=0))],
        batch="b ... -> b* ... 2",
        name="fsdp as hybrid",
        model=2,
    )
    derived = strategies.hybrid(2, step=step, params=params, batch=batch, min_bytes=0)
    plan = einshard.plan(step, params, batch, candidates=[fsdp_only, derived], bandwidth=1e10)
    shares = {row.name: row.split_share for row in plan.rows}
    assert shares["fsdp as hybrid"] == 0  # split over every device: over the data axis too
    assert shares["hybrid model=2"] >= 0.5
