"""einshard.plan_batches: the largest batch each candidate fits, found by compiling.

On the small GPT of ``gpt_steps`` with a tight memory limit: the batch found fits (its compiled
peak is within the limit) and the next size up does not (compiled here, independently, with
``explain_step``); the compiles are counted and within the bound; the ranking is the
examples per second of the reported step times; each bad input is an ``EinshardError``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpt_steps import S, gpt_params, step

import einshard
from einshard import strategies
from einshard._planning.search import _batch_sizes, _batches

N = jax.device_count()
TOKENS = jax.ShapeDtypeStruct((2 * N, S), jnp.int32)  # a multiple of every candidate's split
LIMIT = 40 << 20  # bytes per device: a batch of a few dozen sequences fits data parallelism
FIGURES = {"bandwidth": 100e9, "flops_per_second": 1e12}
MAX_COMPILES = 6


@pytest.fixture(scope="module")
def counted():
    """One search of two candidates, with every compile counted as it is handed to ``reports``."""
    sizes: list[tuple[int, int]] = []  # (batch size, tables compiled at it)
    original = _batches.reports

    def counting(call, tables, *args):
        leading = {call.leaves[i].shape[0] for i in call.argument_leaves(1)}
        sizes.append((leading.pop(), len(tables)))
        return original(call, tables, *args)

    _batches.reports = counting
    try:
        batches = einshard.plan_batches(
            step,
            gpt_params(),
            TOKENS,
            memory_per_device=LIMIT,
            candidates=[strategies.data_parallel(), strategies.fsdp(min_bytes=0)],
            max_compiles=MAX_COMPILES,
            quiet=True,
            **FIGURES,
        )
    finally:
        _batches.reports = original
    return batches, sizes


def test_the_largest_batch_fits_and_the_next_size_up_does_not(counted):
    batches, _ = counted
    row = next(row for row in batches.rows if row.name == "data parallel")
    assert row.rejected is None and row.proven
    assert row.granularity == N and row.batch_size % N == 0 and row.next_size == row.batch_size + N
    assert row.batch_size > TOKENS.shape[0]  # the search went up from the batch given
    for size, fits in ((row.batch_size, True), (row.next_size, False)):
        report = einshard.explain_step(
            step, gpt_params(), jax.ShapeDtypeStruct((size, S), jnp.int32), rules=row.strategy, quiet=True
        )
        assert (report.peak_bytes <= LIMIT) is fits, (size, report.peak_bytes, LIMIT)
        if fits:
            assert report.peak_bytes == row.peak_bytes  # the row's report is that program's
    # Every size the search compiled is on the candidate's split, and its verdict is its peak's.
    for tried in row.tried:
        assert tried.batch_size % N == 0 and tried.fits is (tried.peak_bytes <= LIMIT)
    assert max(t.batch_size for t in row.tried if t.fits) == row.batch_size
    assert min(t.batch_size for t in row.tried if not t.fits) == row.next_size


def test_the_compiles_are_counted_and_within_the_bound(counted):
    batches, sizes = counted
    assert sum(n for _, n in sizes) == batches.compiles == sum(row.compiles for row in batches.rows)
    assert all(1 <= row.compiles <= MAX_COMPILES for row in batches.rows)
    assert batches.max_compiles == MAX_COMPILES
    assert f"at most {MAX_COMPILES} compiles per candidate, {batches.compiles} in all" in str(batches)


def test_the_ranking_is_by_examples_per_second_of_the_reported_step_times(counted):
    batches, _ = counted
    rows = batches.usable
    assert len(rows) == 2
    rates = []
    for row in rows:
        report = row.report
        assert row.seconds == report.communication_seconds + report.compute_seconds
        assert row.examples_per_second == pytest.approx(row.batch_size / row.seconds)
        assert row.tokens_per_second == pytest.approx(row.examples_per_second * S)
        rates.append(row.examples_per_second)
    # The first is the fastest, or within 2% of it and given earlier.
    assert rates[0] >= max(rates) * (1 - batches.tie)
    if rates[0] < max(rates):
        assert rows[0].index < rows[1].index
    assert batches.best == rows[0].strategy and batches.best_batch == rows[0].batch_size


def test_a_search_stopped_by_its_bound_says_so():
    batches = einshard.plan_batches(
        step,
        gpt_params(),
        TOKENS,
        memory_per_device=LIMIT,
        candidates=[strategies.data_parallel()],
        max_compiles=1,
        quiet=True,
    )
    (row,) = batches.rows
    assert row.compiles == 1 and row.batch_size == TOKENS.shape[0] and not row.proven
    text = str(batches)
    assert "best, larger untried" in text
    assert f"data parallel: batch {3 * N} not compiled, the search stopped at max_compiles=1" in text


def _bad(batch=TOKENS, **kwargs):
    kwargs.setdefault("memory_per_device", LIMIT)
    kwargs.setdefault("candidates", [strategies.data_parallel()])
    return einshard.plan_batches(step, gpt_params(), batch, quiet=True, **kwargs)


@pytest.mark.parametrize(
    ("batch", "kwargs", "match"),
    [
        (TOKENS, {"memory_per_device": None}, "needs a memory limit"),
        (
            {"a": jax.ShapeDtypeStruct((2 * N, S), jnp.int32), "b": jax.ShapeDtypeStruct((N, S), jnp.int32)},
            {},
            "do not share a leading axis",
        ),
        (jax.ShapeDtypeStruct((), jnp.int32), {}, "has no leading axis"),
        (jax.ShapeDtypeStruct((0, S), jnp.int32), {}, "a batch size must be a positive integer, not 0"),
        (TOKENS, {"batch_sizes": [0, N]}, "a batch size must be a positive integer, not 0"),
        (TOKENS, {"batch_sizes": [N + 0.5]}, "a batch size must be a positive integer"),
        (TOKENS, {"batch_sizes": 4 * N}, "batch_sizes must be a non-empty list"),
        (TOKENS, {"max_compiles": 0}, "max_compiles must be a positive integer"),
        (TOKENS, {"candidates": [einshard.Rules([(".*", "... -> * ...")])]}, "must be a Strategy"),
    ],
)
def test_bad_inputs_are_errors_with_a_hint(batch, kwargs, match):
    with pytest.raises(einshard.EinshardError, match=match) as caught:
        _bad(batch, **kwargs)
    assert caught.value.hint


@pytest.mark.skipif(N == 1, reason="every size is a multiple of one device's split")
def test_a_size_not_on_a_candidates_split_names_the_multiple():
    with pytest.raises(einshard.EinshardError, match=f"splits the leading axis into {N} parts") as caught:
        _bad(jax.ShapeDtypeStruct((N + 1, S), jnp.int32))
    assert f"multiples of {N}" in caught.value.hint
    with pytest.raises(einshard.EinshardError, match="batch_sizes= holds a batch of"):
        _bad(batch_sizes=[N, N + 1])
    # A candidate that copies the batch takes any size; a hybrid's, multiples of its data axis.
    assert _batch_sizes.granularity(strategies.tensor_parallel(), [TOKENS], N) == 1
    if N % 2 == 0 and N > 2:
        assert _batch_sizes.granularity(strategies.hybrid(model=N // 2), [TOKENS], N) == 2
