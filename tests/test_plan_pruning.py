"""Candidates that cannot win are not compiled: bounds before compiling, and the order compiles go in.

Each candidate's bounds (memory, bytes sent, step time) are checked against its compiled report
on the test models; a plan that leaves candidates uncompiled ranks the same winner as one that
compiles them all (``exhaustive=True``); ``max_seconds`` stops compiling and names what it left.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._cost._step import reports as compile_reports
from einshard._cost.hardware._figures import Figures
from einshard._planning.search import _candidates
from einshard._planning.search._bounds import bounds, step_costs
from einshard._tracing._call import StepCall
from einshard._trees._strategy import with_batch
from tests import gpt_steps as gpt
from tests.test_plan_opt_state import TX, tuple_step
from tests.test_planner import D, sgd_step
from tests.test_planner import mlp_params as params
from tests.test_targets import needs_gpu

N = jax.device_count()
MLP_CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0), strategies.tensor_parallel()]
# (bandwidth, flops_per_second): ranked by bytes sent; by communication; by both.
FIGURES = [(None, None), (1e9, None), (1e10, 1e12)]


def _bench_llama(form: str) -> tuple:
    """``benchmarks/bench_plan_at_size.py``'s LLaMA step (AdamW, bfloat16 weights), small."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_plan_at_size as bench
    finally:
        sys.path.pop(0)
    size = bench.Size(64, 128, 2, 4, 2, batch=2 * N, devices=N, vocab=256, seq=32)
    step = bench.step_scanned if form == "scan" else bench.step_unrolled
    return step, bench.abstract_state(size, form == "scan"), bench.abstract_batch(size), None


def _cases() -> dict:
    """The test models: the planner's MLP, the test GPT's AdamW step (its state in the first
    argument), and the benchmark's LLaMA at a small size, unrolled and scanned.

    The GPT and the LLaMA (most of this file's minute of compiles) at 8 devices alone: the MLP
    checks the bounds' arithmetic at every count, 6 (no power of two) among them.
    """
    cases = {
        "mlp": (sgd_step, params(), jax.ShapeDtypeStruct((8 * N, D), jnp.float32), MLP_CANDIDATES),
        "mlp_small_batch": (sgd_step, params(), jax.ShapeDtypeStruct((N, D), jnp.float32), MLP_CANDIDATES),
    }
    if N == 8:
        state = (gpt.gpt_params(), jax.eval_shape(TX.init, gpt.gpt_params()))
        cases["gpt_adamw"] = (tuple_step, state, gpt.TOKENS, None)
        cases["llama_loop"] = _bench_llama("loop")
        cases["llama_scan"] = _bench_llama("scan")
    return cases


CASES = _cases()


# The cases whose pruned plan replays the exhaustive plan's compiles instead of compiling again
# (``_replayed``): the answers are the same programs' (XLA compiles a program the same way twice), and
# the pruned plan's choices, from the bounds and the answers, are what is tested. The MLP cases compile.
REPLAYED = {"gpt_adamw", "llama_loop", "llama_scan"}


@pytest.fixture(scope="module")
def exhaustive_plans() -> dict:
    """Every case compiled under every candidate (at the first figures; ``.at`` ranks the others).

    Each plan's answers by candidate are kept in ``ANSWERS`` for ``_replayed``.
    """
    plans = {}
    for name, (step, state, batch, candidates) in CASES.items():
        with _recorded() as ANSWERS[name]:
            plans[name] = einshard.plan(
                step, state, batch, candidates=candidates, quiet=True, exhaustive=True
            )
    return plans


ANSWERS: dict[str, dict] = {}  # each case's compiled answers by candidate, from exhaustive_plans


@contextlib.contextmanager
def _recorded():
    """The answers of every compile a plan makes inside the block, by candidate."""
    answers: dict = {}

    def recording(*args, **kwargs):
        answers.update(compile_reports(*args, **kwargs))
        return answers

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_candidates, "reports", recording)
        yield answers


def _replayed(recorded: dict):
    """``reports`` that answers each candidate the plan asks for with its recorded answer, in order."""

    def replay(call, tables, n_devices, target, order, progress):
        assert order is not None  # the plan's order: each next candidate given the answers so far
        answers: dict = {}
        while (index := order(answers, frozenset())) is not None:
            answers[index] = recorded[index]
        return answers

    return replay


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
@pytest.mark.parametrize("name", list(CASES))
def test_the_bounds_are_at_most_what_the_compiled_programs_need(name, exhaustive_plans):
    """Each bound against the candidate's own report: memory, bytes sent, step time at each figure."""
    plan = exhaustive_plans[name]
    assert all(row.report is not None or row.rejected_for == "shapes" for row in plan.rows)
    for bandwidth, flops in FIGURES:
        at = plan.at(bandwidth=bandwidth, flops_per_second=flops) if bandwidth else plan
        for row in at.rows:
            if row.report is None:
                continue
            bound = row.bounds
            assert bound is not None
            assert bound.argument_bytes == row.report.argument_bytes, row.name
            assert bound.memory_bytes <= row.peak_bytes, row.name
            assert bound.traffic <= row.traffic, row.name
    # The time bounds at each figure, made as the plan makes them (no compile), against each report.
    step, state, batch, _ = CASES[name]
    call = StepCall.of(step, (state, batch), {})
    costs = step_costs(call)
    for bandwidth, flops in FIGURES[1:]:
        figures = Figures(bandwidth=bandwidth, flops_per_second=flops, flops_given=flops is not None)
        at = plan.at(bandwidth=bandwidth, flops_per_second=flops)
        for row in at.rows:
            if row.report is not None:
                timed = bounds(call, with_batch(row.strategy, call.batch_name), N, costs, figures)
                assert timed is not None and timed.seconds is not None
                assert timed.seconds <= row.seconds * (1 + 1e-9), (row.name, timed, row.seconds)


# The MLP at every figure; the GPT (default candidates, longer compiles) timed only.
REGRET = [(name, *figures) for name in ("mlp", "mlp_small_batch") for figures in FIGURES] + [
    (name, *FIGURES[-1]) for name in ("gpt_adamw", "llama_loop", "llama_scan") if name in CASES
]


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
@pytest.mark.parametrize(("name", "bandwidth", "flops_per_second"), REGRET)
def test_a_plan_that_leaves_candidates_uncompiled_ranks_the_same_winner(
    name, bandwidth, flops_per_second, exhaustive_plans, monkeypatch
):
    step, state, batch, candidates = CASES[name]
    if name in REPLAYED:
        monkeypatch.setattr(_candidates, "reports", _replayed(ANSWERS[name]))
    plan = einshard.plan(
        step,
        state,
        batch,
        candidates=candidates,
        bandwidth=bandwidth,
        flops_per_second=flops_per_second,
        quiet=True,
    )
    every = exhaustive_plans[name]
    if bandwidth is not None:
        every = every.at(bandwidth=bandwidth, flops_per_second=flops_per_second)
    assert plan.best.name == every.best.name  # regret 0
    assert [row.name for row in plan.rows if row.report is not None] == [
        row.name for row in every.rows if row.name in {r.name for r in plan.rows if r.report is not None}
    ]
    for row in plan.rows:
        if row.rejected_for == "cannot win":
            (compiled,) = [r for r in every.rows if r.name == row.name]
            assert row.report is None and row.bounds is not None
            assert row.rejected.startswith(f"cannot beat {plan.best.name}: at least ")
            assert row.rejected.endswith("(not compiled)")
            # Its real figure is slower than the winner's beyond the tie, as its bound said.
            measure = compiled.seconds if bandwidth is not None else compiled.traffic
            winner = plan.usable[0].seconds if bandwidth is not None else plan.usable[0].traffic
            assert measure > winner * (1 + plan.tie)


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_data_parallel_cannot_beat_tensor_parallel_on_a_small_batch_and_is_not_compiled(compiles):
    """The MLP on a batch of N rows: tensor parallelism sends the small activations; data parallelism
    must sum its gradients over the N batch blocks: at least (N - 1) / N of both weights per device,
    more than tensor parallelism sends in all. Ranked by bytes sent (no bandwidth)."""
    step, state, batch, candidates = CASES["mlp_small_batch"]
    plan = einshard.plan(step, state, batch, candidates=candidates, quiet=True)
    rows = {row.name: row for row in plan.rows}
    weights = sum(4 * leaf.shape[0] * leaf.shape[1] for leaf in jax.tree.leaves(state))
    assert rows["data parallel"].bounds.traffic == weights * (N - 1) // N
    assert plan.best.name == "tensor parallel"
    assert rows["data parallel"].report is None and rows["data parallel"].rejected_for == "cannot win"
    assert len(compiles) == 2  # fsdp and tensor parallel
    text = str(plan)
    assert "rejected data parallel: cannot beat tensor parallel: at least" in text
    assert "1 candidate not compiled (data parallel): the lower bound of each one's step time" in text
    # At other figures it has no report to rank: the row says to plan again.
    other = plan.at(bandwidth=1e9)
    again = next(row for row in other.rows if row.name == "data parallel")
    assert again.rejected_for == "not compiled" and "plan again with these figures" in again.rejected
    # Compiled after all, it sends what its bound said, at least.
    every = einshard.plan(step, state, batch, candidates=candidates, quiet=True, exhaustive=True)
    compiled = next(row for row in every.rows if row.name == "data parallel")
    assert compiled.traffic >= rows["data parallel"].bounds.traffic
    assert len(compiles) == 2 + 3


@pytest.mark.skipif(N != 8, reason="one child process is enough: run at 8 devices")
def test_a_child_process_compiles_only_the_candidates_the_plan_asks_for():
    """Planned for 4 devices (a child process): the same candidate is left as in this process."""
    _, state, _, candidates = CASES["mlp_small_batch"]
    batch = jax.ShapeDtypeStruct((4, D), jnp.float32)
    plan = einshard.plan(
        "tests.test_planner:sgd_step", state, batch, n_devices=4, candidates=candidates, quiet=True
    )
    rows = {row.name: row for row in plan.rows}
    assert rows["data parallel"].rejected_for == "cannot win" and rows["data parallel"].report is None
    assert rows["tensor parallel"].report.n_devices == 4 and rows["fsdp"].report.n_devices == 4
    assert plan.timings.compiled == 2 and plan.timings.child_start > 0
    assert plan.timings.child_peak_bytes > 0 and plan.timings.children == 1


def test_max_seconds_stops_compiling_and_names_what_it_left(compiles):
    step, state, batch, candidates = CASES["mlp"]
    plan = einshard.plan(step, state, batch, candidates=candidates, quiet=True, max_seconds=1e-9)
    assert compiles == []
    assert plan.timings.children == 0  # planned in this process
    assert all(row.rejected_for == "budget" for row in plan.rows)
    assert all(
        re.fullmatch(
            r"not compiled: max_seconds=1e-09 was spent before its turn; it needs at least .+ per device",
            row.rejected,
        )
        for row in plan.rows
    ), [row.rejected for row in plan.rows]
    text = str(plan)
    assert text.startswith("No candidate compiled: all 3 were rejected before or while compiling")
    assert "3 candidates not compiled (" in text and "max_seconds was spent before their turn" in text
    with pytest.raises(einshard.EinshardError, match="no candidate strategy compiled for"):
        _ = plan.best
    # A budget that holds every compile changes nothing.
    roomy = einshard.plan(step, state, batch, candidates=candidates, quiet=True, max_seconds=3600)
    assert all(row.rejected_for != "budget" for row in roomy.rows)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "60"])
def test_max_seconds_must_be_a_positive_number(value):
    step, state, batch, candidates = CASES["mlp"]
    with pytest.raises(einshard.EinshardError, match="max_seconds must be a positive number of seconds"):
        einshard.plan(step, state, batch, candidates=candidates, quiet=True, max_seconds=value)


@pytest.mark.parametrize("verb", [einshard.plan, einshard.plan_batches])
def test_an_empty_list_of_candidates_is_an_error_that_says_what_to_pass(verb, compiles):
    step, state, batch, _ = CASES["mlp"]
    with pytest.raises(
        einshard.EinshardError, match=r"candidates= is empty: there is nothing to compile"
    ) as error:
        verb(step, state, batch, candidates=[], memory_per_device=1 << 30, quiet=True)
    assert "Leave candidates= out for the defaults" in str(error.value)
    assert compiles == []


def test_a_plan_in_which_none_fits_says_so_first(compiles):
    """Compiled, every candidate is over the memory: the first line and the error say none fits."""
    step, state, batch, candidates = CASES["mlp"]
    every = einshard.plan(step, state, batch, candidates=candidates, quiet=True, exhaustive=True)
    plan = every.at(memory_per_device=min(row.peak_bytes for row in every.rows) - 1)
    assert str(plan).startswith(f"No candidate fits {N} devices: all 3 need more memory than there is, 3 of")
    with pytest.raises(einshard.EinshardError, match=f"no candidate strategy fits {N} devices"):
        _ = plan.best


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_plan_batches_rejects_a_candidate_whose_arguments_exceed_the_memory_without_compiling(compiles):
    """Data parallel holds both weights whole at any batch: above the memory, it is not compiled."""
    step, state, batch, _ = CASES["mlp"]
    weights = sum(4 * leaf.shape[0] * leaf.shape[1] for leaf in jax.tree.leaves(state))
    batches = einshard.plan_batches(
        step,
        state,
        batch,
        candidates=[strategies.data_parallel(), strategies.fsdp(min_bytes=0)],
        memory_per_device=weights,  # the weights and one row of the batch per device do not fit
        max_compiles=3,
        quiet=True,
    )
    rows = {row.name: row for row in batches.rows}
    assert rows["data parallel"].compiles == 0 and rows["data parallel"].rejected_for == "memory"
    assert rows["data parallel"].rejected.startswith("does not fit memory: its arguments alone need ")
    assert rows["data parallel"].rejected.endswith("(not compiled)")
    assert all(table.name != "data parallel" for table in compiles if hasattr(table, "name"))
    assert rows["fsdp"].compiles > 0


@needs_gpu
@pytest.mark.skipif("gpt_adamw" not in CASES, reason="the GPT case is planned at 8 devices only (see _cases)")
def test_on_a_gpu_target_the_bounds_hold_and_the_winner_is_the_same(monkeypatch):
    """The GPT's AdamW step for 16 H100s (two hosts): each bound against the simulated program.

    The pruned plan replays the exhaustive plan's compiles (see ``REPLAYED``)."""
    step, state, batch, _ = CASES["gpt_adamw"]
    with _recorded() as answers:
        every = einshard.plan(step, state, batch, n_devices=16, target="h100", quiet=True, exhaustive=True)
    for row in every.rows:
        if row.report is None:
            continue
        assert row.bounds.memory_bytes <= row.peak_bytes, row.name
        assert row.bounds.traffic <= row.traffic, row.name
        assert row.bounds.seconds <= row.seconds, (row.name, row.bounds, row.seconds)
    monkeypatch.setattr(_candidates, "reports", _replayed(answers))
    plan = einshard.plan(step, state, batch, n_devices=16, target="h100", quiet=True)
    assert plan.best.name == every.best.name
    assert [row.name for row in plan.rows] == [row.name for row in every.rows]
