"""einshard.plan: rankings checked against the step reports' own figures (fast link, too little
memory, slow link with large activations), rejections, another device count in a child process,
and the winner trained for a few steps giving one device's losses (Flax NNX and Equinox)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import einshard
from einshard import strategies
from einshard._planning.search._candidates import Rejection

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
        rules=plan.best,  # a Strategy: its .batch lays out the batch, as in the plan
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


@pytest.mark.parametrize("name", [strategy.name for strategy in CANDIDATES])
def test_a_candidate_whose_peak_is_exactly_the_limit_fits(planned, name):
    (peak,) = [row.peak_bytes for row in planned.rows if row.name == name]
    fits = {row.name: row.rejected for row in planned.at(memory_per_device=peak).rows}
    assert fits[name] is None
    over = {row.name: row.rejected for row in planned.at(memory_per_device=peak - 1).rows}
    assert over[name].startswith("does not fit memory: needs ")


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
        exhaustive=True,
    )
    rows = {row.name: row for row in plan.rows}
    assert rows["data parallel"].report.n_devices == 3 and rows["fsdp"].report.n_devices == 3
    assert rows["hybrid model=2"].rejected is not None  # 2 does not divide 3 devices
    # Data parallelism's only collective is the gradients' all-reduce: the weights' bytes.
    assert rows["data parallel"].bytes_by_kind == {"all-reduce": 2 * D * 48 * 4}
    assert plan.n_devices == 3


def tied_embedding_step(params, tokens):
    """A tied embedding and a head-split projection: XLA aborts on one layout of these at 6 devices."""

    def loss(p):
        x = p["emb"][tokens]
        y = x + jnp.einsum("BTNH,NDH->BTD", jnp.einsum("BTD,NDH->BTNH", x, p["q"]), p["q"])
        return jnp.mean(jax.nn.logsumexp(y @ p["emb"].T, axis=-1))

    loss_value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss_value


def test_a_candidate_on_which_xla_aborts_is_rejected_and_the_others_kept():
    """In a child process, XLA's abort (a failed check, not an exception) costs one candidate only."""
    params = {
        "emb": jax.ShapeDtypeStruct((384, 96), jnp.float32),
        "q": jax.ShapeDtypeStruct((8, 96, 16), jnp.float32),
    }
    tokens = jax.ShapeDtypeStruct((12, 16), jnp.int32)
    aborting = strategies.Strategy(
        [("emb", "v i -> i* v3"), ("q", "a b c -> a b6 c")], batch="b ... -> b* ... 3", name="aborting"
    )
    candidates = [strategies.data_parallel(), aborting, strategies.fsdp(min_bytes=0)]
    plan = einshard.plan(
        "tests.test_planner:tied_embedding_step",
        params,
        tokens,
        n_devices=6,
        candidates=candidates,
        isolate=True,  # where this machine has 6 devices too, the abort must still hit a child only
    )
    rows = {row.name: row for row in plan.rows}
    if rows["aborting"].report is not None:
        pytest.skip("this XLA compiles the layout that aborts jaxlib 0.12's partitioner")
    assert rows["aborting"].rejected.startswith("does not compile: XLA aborted the process compiling it")
    # The candidates before and after it were compiled: one child up to the abort, a new one after.
    assert rows["data parallel"].report.n_devices == 6 and rows["fsdp"].report.n_devices == 6
    assert rows["data parallel"].rejected is None and rows["fsdp"].rejected is None
    assert [row.name for row in plan.rows][-1] == "aborting"


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


# --- the ranking against a plain reference --------------------------------------------------------

TIE_MARGIN = 0.02  # the documented margin: estimates within 2% count as equal
HOPS = {  # ring steps per run, for a group of g devices (each pays the latency once)
    "all-reduce": lambda g: 2 * (g - 1),
    "all-gather": lambda g: g - 1,
    "reduce-scatter": lambda g: g - 1,
    "all-to-all": lambda g: g - 1,
    "collective-permute": lambda g: 1,
}
SENT = {  # bytes each device sends per run, as a multiple of its array, for a group of g devices
    "all-reduce": lambda g: 2 * (g - 1) / g,
    "all-gather": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    "collective-permute": lambda g: 1.0,
}


def _report(collectives, flops, peak) -> einshard.StepReport:
    """A step report with these collectives ``[(kind, array bytes, group size), ...]``, one each."""
    rows = tuple(
        einshard.StepRow(
            kind=kind,
            dtype="f32",
            shape=(nbytes // 4,),
            bytes=nbytes,
            group_size=group,
            axes=None,
            times=1,
            times_known=True,
            traffic=round(SENT[kind](group) * nbytes),
            seconds=None,
            phase="backward",
            op_name="",
            source=None,
            param=None,
            instruction=f"{kind}.{i}",
            groups=(tuple(range(group)),),
        )
        for i, (kind, nbytes, group) in enumerate(collectives)
    )
    by_kind: dict[str, int] = {}
    for row in rows:
        by_kind[row.kind] = by_kind.get(row.kind, 0) + row.bytes
    return einshard.StepReport(
        rows=rows,
        n_devices=N,
        mesh=(("a0", N),),
        collectives=len(rows),
        bytes=sum(row.bytes for row in rows),
        bytes_by_kind=by_kind,
        traffic=sum(row.traffic for row in rows),
        flops=flops,
        argument_bytes=None if peak is None else peak // 2,
        output_bytes=None if peak is None else peak - peak // 2,
        alias_bytes=None if peak is None else 0,
        temp_bytes=None if peak is None else 0,
        peak_bytes=peak,
        bandwidth=None,
        latency=0.0,
        flops_per_second=None,
        communication_seconds=None,
        compute_seconds=None,
        compile_seconds=0.0,
        analysis_seconds=0.0,
    )


# Bytes as a base times one of these: equal, within the margin of each other, just outside it.
MULTIPLIERS = [1.0, 1.0, 1.005, 1.0199, 1.0201, 1.05, 2.0]


@st.composite
def candidate_lists(draw):
    """Candidates in the order given, each ``(index, report or None, stale memory rejection)``,
    the plan's figures, and the order the rows are stored in (a plan's rows need not be in
    the order given)."""
    base = draw(st.integers(10**6, 10**9))
    n = draw(st.integers(1, 6))
    candidates = []
    for index in range(n):
        if draw(st.integers(0, 7)) == 0:  # does not compile, or does not divide
            candidates.append((index, None, None))
            continue
        collectives = []
        for _ in range(draw(st.integers(0, 2))):
            kind = draw(st.sampled_from(list(HOPS)))
            nbytes = 4 * round(base * draw(st.sampled_from(MULTIPLIERS)))
            collectives.append((kind, nbytes, draw(st.sampled_from([2, 3, 8, 16]))))
        flops = draw(st.one_of(st.none(), st.sampled_from(MULTIPLIERS).map(lambda m: round(m * base * 1e3))))
        peak = draw(st.one_of(st.none(), st.sampled_from([1 << 20, 3 << 20, 5 << 20])))
        stale = draw(st.booleans())  # rejected for memory at earlier figures
        candidates.append((index, _report(collectives, flops, peak), stale))
    figures = {
        "bandwidth": draw(st.sampled_from([None, 1e8, 1e11])),
        "latency": draw(st.sampled_from([0.0, 1e-6, 1e-3])),
        "flops_per_second": draw(st.sampled_from([None, 1e12, 1e15])),
        "memory_per_device": draw(st.sampled_from([None, 1 << 20, (3 << 20) - 1, 3 << 20, 5 << 20])),
    }
    storage = draw(st.permutations(range(n)))
    return candidates, figures, storage


def _hand_time(report: einshard.StepReport, figures: dict) -> float:
    """Communication by the ring (the bytes sent over bandwidth, latency per ring step) plus compute."""
    total = 0.0
    for row in report.rows:
        sent = SENT[row.kind](row.group_size) * row.bytes
        total += sent / figures["bandwidth"] + HOPS[row.kind](row.group_size) * figures["latency"]
    if figures["flops_per_second"] is not None and report.flops is not None:
        total += report.flops / figures["flops_per_second"]
    return total


def reference_ranking(candidates: list[tuple[int, float]]) -> tuple[list[int], bool]:
    """The documented order of the usable candidates ``(index, estimate)``: by estimate, and among
    estimates within 2% of the fastest left the one given first; repeated until none is left.

    Also says whether an estimate lies so close to the margin that floating point decides.
    """
    left = sorted(candidates)  # in the order given
    order, close = [], False
    while left:
        fastest = min(estimate for _, estimate in left)
        limit = fastest * (1 + TIE_MARGIN)
        close = close or any(0 < abs(estimate - limit) <= 1e-9 * fastest for _, estimate in left)
        pick = next(item for item in left if item[1] <= limit)
        left.remove(pick)
        order.append(pick[0])
    return order, close


def _candidate(index: int) -> strategies.Strategy:
    return strategies.Strategy([(r".*", "... -> * ...")], batch="b ... -> b* ...", name=f"c{index}")


@given(candidate_lists())
def test_the_ranking_is_the_reference_order_at_any_figures(drawn):
    candidates, figures, storage = drawn
    rows = []
    for index, report, stale in candidates:
        if report is None:
            rows.append(
                einshard.PlanRow(_candidate(index), None, Rejection("compile", "XlaRuntimeError"), index)
            )
        else:
            rejected = Rejection("memory", "needs 5.0 MiB > 1.0 MiB per device") if stale else None
            rows.append(einshard.PlanRow(_candidate(index), report, rejected, index))
    start = einshard.Plan(tuple(rows[i] for i in storage), N, None, None, 0.0, None)
    plan = start.at(**{k: v for k, v in figures.items() if v is not None})
    assert (plan.bandwidth, plan.flops_per_second, plan.memory_per_device) == (
        figures["bandwidth"],
        figures["flops_per_second"],
        figures["memory_per_device"],
    )

    # Who is rejected: what does not compile, and (decided again at these figures) what needs
    # more memory than there is.
    limit = figures["memory_per_device"]
    by_index = {index: report for index, report, _ in candidates}
    too_large = {
        index
        for index, report in by_index.items()
        if report is not None and limit is not None and (report.peak_bytes or 0) > limit
    }
    rejected = too_large | {index for index, report in by_index.items() if report is None}
    assert {row.index for row in plan.rows if row.rejected is not None} == rejected
    for row in plan.rows:
        if row.index in rejected and row.report is not None:
            assert row.rejected.startswith("does not fit memory: needs "), row.rejected
    # Each estimate, by hand; without a bandwidth the bytes sent rank instead.
    estimates = {}
    for index, report in by_index.items():
        if index in rejected:
            continue
        if figures["bandwidth"] is None:
            estimates[index] = float(report.traffic)
        else:
            estimates[index] = _hand_time(report, figures)
            (row,) = [row for row in plan.rows if row.index == index]
            if report.rows or (figures["flops_per_second"] and report.flops is not None):
                assert row.seconds == pytest.approx(estimates[index], rel=1e-9, abs=1e-15)
    expected, close = reference_ranking(list(estimates.items()))
    assume(not close)  # not a question the reference can answer
    assert [row.index for row in plan.rows[: len(expected)]] == expected
    assert len(plan.rows) == len(candidates) and len(plan.usable) == len(expected)
    if expected:
        assert plan.best.name == f"c{expected[0]}"
    else:
        # None fits, or none compiled: the error and the plan's first line say which.
        any_compiled = any(report is not None for _, report, _ in candidates)
        said = "fits" if any_compiled else "compiled for"
        with pytest.raises(einshard.EinshardError, match=f"no candidate strategy {said}"):
            _ = plan.best
        assert str(plan).startswith("No candidate fits" if any_compiled else "No candidate compiled")
    # Ranking the ranked plan again at the same figures changes nothing.
    assert [row.index for row in plan.at().rows] == [row.index for row in plan.rows]


# --- real steps: the winner wherever it stands in the list ----------------------------------------

FIGURES = [  # (bandwidth, FLOP/s): a fast link, a slow one, between
    (1e15, 1e12),
    (1e6, 1e12),
    (1e9, 1e12),
]


def _assert_reference_order(plan: einshard.Plan) -> None:
    """The plan's order is the reference's, from the rows' own estimates and given positions."""
    assert all(row.rejected is None for row in plan.rows)
    expected, close = reference_ranking([(row.index, row.seconds) for row in plan.rows])
    assert not close
    assert [row.index for row in plan.rows] == expected, [(row.name, row.seconds) for row in plan.rows]


@pytest.fixture(scope="module")
def planned_in_reverse() -> einshard.Plan:
    """As ``planned``, with the candidates given in reverse: data parallelism last."""
    batch = jax.ShapeDtypeStruct((64 * N, D), jnp.float32)
    return einshard.plan(sgd_step, mlp_params(), batch, candidates=CANDIDATES[::-1])


@pytest.mark.parametrize(("bandwidth", "flops_per_second"), FIGURES)
def test_a_list_in_reverse_ranks_by_the_same_estimates(
    planned, planned_in_reverse, bandwidth, flops_per_second
):
    given = planned.at(bandwidth=bandwidth, flops_per_second=flops_per_second)
    reverse = planned_in_reverse.at(bandwidth=bandwidth, flops_per_second=flops_per_second)
    _assert_reference_order(given)
    _assert_reference_order(reverse)
    assert [row.name for row in reverse.rows] != [row.name for row in reversed(reverse.rows)] or N == 1
    # The same compiled steps under both lists: the same estimates, by name; each communication
    # plus compute, as the reports estimate them at these figures.
    assert {row.name: row.seconds for row in given.rows} == {row.name: row.seconds for row in reverse.rows}
    for row in given.rows:
        report = row.report.at(bandwidth=bandwidth, flops_per_second=flops_per_second)
        assert row.seconds == pytest.approx(report.communication_seconds + report.compute_seconds, rel=1e-12)
        assert report.compute_seconds == pytest.approx(row.report.flops / flops_per_second, rel=1e-12)
    # The large batch makes data parallelism the fastest by more than the margin on the slow link:
    # first in either list, though the reversed list gives it last.
    if bandwidth == 1e6:
        assert given.best.name == reverse.best.name == "data parallel"
        assert reverse.rows[0].index == len(CANDIDATES) - 1
    # On the fast link the three are within the margin of each other: the first given wins.
    fastest = min(row.seconds for row in given.rows)
    if all(row.seconds <= fastest * (1 + TIE_MARGIN) for row in given.rows):
        assert given.rows[0].index == reverse.rows[0].index == 0
        assert given.best.name == "data parallel" and reverse.best.name == "tensor parallel"


@pytest.fixture(scope="module")
def small_batch_plans() -> tuple[einshard.Plan, einshard.Plan]:
    """A batch much smaller than the weights, planned with the candidates as given and reversed."""
    batch = jax.ShapeDtypeStruct((2 * N, D), jnp.float32)
    return tuple(
        einshard.plan(
            sgd_step,
            mlp_params(),
            batch,
            bandwidth=1e9,
            flops_per_second=1e12,
            candidates=candidates,
            exhaustive=True,
        )
        for candidates in (CANDIDATES, CANDIDATES[::-1])
    )


def test_a_small_batch_ranks_tensor_parallel_first_from_the_end_of_the_list(small_batch_plans):
    given, reverse = small_batch_plans
    # Tensor parallelism sends the (small) activations, data parallelism every weight's gradient.
    traffic = {row.name: row.traffic for row in given.rows}
    assert traffic["tensor parallel"] < traffic["fsdp"] < traffic["data parallel"]
    assert given.best.name == reverse.best.name == "tensor parallel"
    assert given.rows[0].index == len(CANDIDATES) - 1  # the last one given
    assert [row.name for row in given.rows] == [row.name for row in reverse.rows]
    for plan in (given, reverse):
        _assert_reference_order(plan)
        assert [row.traffic for row in plan.rows] == sorted(row.traffic for row in plan.rows)


# --- derived tables, and what each row splits -------------------------------------------------------


def _gpt():
    from test_roles import gpt_params, gpt_step, tokens

    params = jax.eval_shape(lambda: gpt_params(jax.random.key(0)))
    return gpt_step(), params, jax.ShapeDtypeStruct(tokens(batch=2 * N).shape, jnp.int32)


@pytest.fixture(scope="module")
def gpt_plan() -> einshard.Plan:
    """The GPT's plan over the default candidates, compiled once for the tests below."""
    step, params, batch = _gpt()
    return einshard.plan(step, params, batch, min_bytes=0, bandwidth=1e10)


def test_plan_reads_the_tensor_parallel_tables_from_the_step(gpt_plan):
    plan = gpt_plan
    rows = {row.name: row for row in plan.rows}
    models = [m for m in range(2, N) if N % m == 0]
    assert set(rows) == {"data parallel", "fsdp", "tensor parallel", *(f"hybrid model={m}" for m in models)}
    # The names (e, blocks/0/x, w1 ...) match no name-based rule: the tables come from the dataflow.
    for name in ("tensor parallel", *(f"hybrid model={m}" for m in models)):
        row = rows[name]
        assert row.model_parallel and row.split_share >= 0.5 and not row.splits_little, name
        assert all(rule.note for rule in row.strategy), name
        assert not row.unmatched_rules, name
    assert rows["data parallel"].split_share == 0 and not rows["data parallel"].model_parallel
    assert rows["fsdp"].split_share > 0.9  # FSDP splits over all devices (no model axis)
    text = str(plan)
    assert " split " in text.splitlines()[0] and "splits only" not in text


def test_explain_step_given_a_candidate_reports_its_plan_row_byte_for_byte(gpt_plan):
    """One program per strategy: a Strategy given as rules= lays out the batch by its .batch,
    as the plan did, so explain_step's report of every default candidate is the plan's row."""
    step, params, batch = _gpt()
    for row in gpt_plan.rows:
        if row.report is None:
            continue
        report = einshard.explain_step(step, params, batch, rules=row.strategy, bandwidth=1e10)
        assert report.rows == row.report.rows, row.name
        assert report.bytes_by_kind == row.report.bytes_by_kind, row.name
        assert report.peak_bytes == row.report.peak_bytes, row.name
        assert [f.kind for f in report.findings] == [f.kind for f in row.report.findings], row.name


def test_a_strategy_for_a_step_of_one_argument_is_a_table_like_any_other():
    """No batch argument: the strategy's rules lay out the one argument; its .batch is not used."""
    w = jax.ShapeDtypeStruct((8 * N, 4), jnp.float32)

    def total(w):
        return w.sum(0)

    by_strategy = einshard.explain_step(total, w, rules=strategies.fsdp(min_bytes=0))
    by_table = einshard.explain_step(total, w, rules=strategies.fsdp(min_bytes=0).pairs())
    assert by_strategy.rows == by_table.rows and by_strategy.rows


def test_a_model_parallel_candidate_that_splits_little_says_so():
    step, params, batch = _gpt()
    named = strategies.tensor_parallel()  # by layer names: none of them is in this model
    plan = einshard.plan(step, params, batch, candidates=[strategies.data_parallel(), named], bandwidth=1e10)
    row = next(row for row in plan.rows if row.name == "tensor parallel")
    assert row.split_share == 0 and row.splits_little and len(row.unmatched_rules) == 5
    text = str(plan)
    assert "splits only 0%" in text and "fits" not in text.split("tensor parallel")[1].splitlines()[0]
    assert "tensor parallel splits only 0% of the parameter bytes over its model axis" in text
    assert "tensor parallel: 5 unmatched rules (matching no parameter's path)" in text
    # explain flags the same rules: their regexes match no path of this tree at all.
    report = einshard.explain(params, named)
    assert len(report.unmatched_rules) == 5 and "5 rules match no path of this tree" in str(report)


WIDE = 24  # divides by every data axis of a hybrid on 6, 8, 12 and 16 devices


def mixed_mlp():
    """An MLP with a square layer between its pair, named so that no name-based rule takes it."""
    shapes = {"up": (WIDE, HIDDEN), "mix": (HIDDEN, HIDDEN), "down": (HIDDEN, WIDE)}
    params = {name: {"kernel": jax.ShapeDtypeStruct(shape, jnp.float32)} for name, shape in shapes.items()}

    def step(params, batch):
        def loss(p):
            h = jax.nn.relu(batch @ p["up"]["kernel"]) @ p["mix"]["kernel"]
            return jnp.mean((h @ p["down"]["kernel"]) ** 2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, params, jax.ShapeDtypeStruct((2 * N, WIDE), jnp.float32)


@pytest.mark.parametrize("model", sorted({2, N // 2}))
def test_a_name_based_hybrid_splits_only_its_pair_over_the_model_axis(model):
    if N % 2 or model < 2:
        pytest.skip("needs a (data, model) grid")
    step, params, batch = mixed_mlp()
    # up and down split over the model axis (Megatron's pair); mix, which no name matches, split
    # as FSDP over every device: over the data axis too, so not over the model axis alone.
    pair = 2 * WIDE * HIDDEN * 4
    share = pair / (pair + HIDDEN * HIDDEN * 4)
    assert share < 0.5
    hybrid = strategies.hybrid(model, min_bytes=0)
    plan = einshard.plan(step, params, batch, candidates=[hybrid], bandwidth=1e10)
    (row,) = plan.rows
    assert row.split_share == pytest.approx(share) and row.splits_little
    assert f"splits only {share:.0%} of the parameter bytes over its model axis of {model}" in str(plan)
    # The layouts the share is counted from: up over (data, model), mix over all devices.
    shards = {row.path: row.shard_shape for row in einshard.explain(params, hybrid).rows}
    assert shards["up/kernel"] == (WIDE // (N // model), HIDDEN // model)
    assert math.prod(shards["mix/kernel"]) == HIDDEN * HIDDEN // N


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


def test_a_plan_resolves_the_step_and_flattens_the_params_once(monkeypatch):
    """One StepCall per plan: the roles reader, every candidate's table and compile, and the split
    shares use its one resolution and flattening (default candidates: the derived tables too), and
    each candidate's one assignment (the compile's, which the split share reuses)."""
    import sys

    from einshard._tracing import _call
    from einshard._trees import _assign, _paths

    resolved, flattened, assigned = [], [], []
    resolve, flatten, assign = _call.resolve_step, _paths.flatten_with_paths, _assign.assign_leaves
    monkeypatch.setattr(_call, "resolve_step", lambda fn: resolved.append(fn) or resolve(fn))

    def counting_assign(paths, leaves, rules, **kwargs):
        assigned.append(rules)
        return assign(paths, leaves, rules, **kwargs)

    for name, module in list(sys.modules.items()):  # wherever a module holds it by name
        if name.startswith("einshard") and getattr(module, "assign_leaves", None) is assign:
            monkeypatch.setattr(module, "assign_leaves", counting_assign)

    def counting_flatten(tree, *args, **kwargs):
        flattened.append(tree)
        return flatten(tree, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("einshard") and getattr(module, "flatten_with_paths", None) is flatten:
            monkeypatch.setattr(module, "flatten_with_paths", counting_flatten)
    batch = jax.ShapeDtypeStruct((8 * N, D), jnp.float32)
    plan = einshard.plan("tests.test_planner:sgd_step", mlp_params(), batch)
    assert len(plan.rows) >= 3 and any(row.report is not None for row in plan.rows)
    assert resolved == ["tests.test_planner:sgd_step"]
    assert len(flattened) == 1  # the step's arguments, in StepCall.of
    candidates = [row.strategy for row in plan.rows]
    assert len(assigned) == len(candidates)  # once per candidate: for its compile, and its split share
    assert {len(table) for table in assigned} == {len(strategy) + 1 for strategy in candidates}  # + batch
