"""Findings against their formulas, on generated steps with known waste (hypothesis, few examples).

* a weight used ``k`` times (tied): ``repeated`` sends ``(k - 1)`` all-reduces of it too many;
* ``m`` branches split Megatron-style that read one input: ``unsummed``, ``(m - 1)`` all-reduces
  of the input's gradient per place;
* scans nested ``d`` deep with random lengths: the gradient's reduction runs the product of the
  trip counts, and still serves the weight;
* FSDP over shapes of which no axis, or some axis, divides the device count: ``copied`` holds
  ``P - P/n`` of each that stays whole, and every all-reduce of a split gradient is sliced.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import einshard
from einshard import strategies

N = jax.device_count()
pytestmark = pytest.mark.skipif(N != 8, reason="shapes chosen for 8 devices")
F32, D = 4, 32
DP = [(r"^batch", "b d -> b* d"), (r".*", "... -> * ...")]
COPIED: list = []  # the examples that had a copied weight
FEW = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def ring_all_reduce(nbytes: int) -> int:
    return round(2 * (N - 1) / N * nbytes)


def sgd(loss):
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def findings(report: einshard.StepReport, kind: str) -> list:
    return [f for f in report.findings if f.kind == kind]


@FEW
@given(k=st.integers(2, 5), width=st.sampled_from([16, 32, 48]))
def test_a_weight_used_k_times_is_reduced_k_minus_one_times_too_often(k, width):
    def loss(params, x):
        for _ in range(k):
            x = jnp.tanh(x @ params["w"])
        return jnp.sum(x**2)

    report = einshard.explain_step(sgd(loss), {"w": f32(width, width)}, f32(4 * N, width), rules=DP)
    (finding,) = findings(report, "repeated")
    assert finding.params == ("params/w",) and len(finding.rows) == k
    assert finding.bytes == (k - 1) * ring_all_reduce(width * width * F32)
    assert report.waste_bytes == finding.bytes  # nothing else counts these bytes
    assert report.traffic - finding.bytes == ring_all_reduce(width * width * F32)  # one reduction kept


@FEW
@given(m=st.integers(2, 4))
def test_m_branches_reading_one_input_reduce_m_partial_sums_one_by_one(m):
    rules = [(r"a\d$", "d f -> d f*"), (r"b\d$", "f d -> f* d"), (r".*", "... -> * ...")]

    def loss(params, x):
        x = jnp.tanh(x @ params["w0"])
        y = sum(jax.nn.relu(x @ params[f"a{i}"]) @ params[f"b{i}"] for i in range(m))
        return jnp.sum(y**2)

    params = {"w0": f32(D, D)}
    params.update({f"a{i}": f32(D, 2 * N) for i in range(m)})
    params.update({f"b{i}": f32(2 * N, D) for i in range(m)})
    x = f32(8, D)
    report = einshard.explain_step(sgd(loss), params, x, rules=rules)
    (finding,) = findings(report, "unsummed")
    activation = 8 * D * F32
    per_place = len(finding.rows) // m
    assert len(finding.rows) == m * per_place
    assert finding.bytes == per_place * (m - 1) * ring_all_reduce(activation)
    assert report.waste_bytes == finding.bytes


@FEW
@given(lengths=st.lists(st.integers(2, 4), min_size=1, max_size=3))
def test_scans_nested_d_deep_reduce_the_gradient_the_product_of_their_lengths(lengths):
    def loss(params, x):
        def nest(x, depth):
            if depth == len(lengths):
                return jnp.tanh(x @ params["w"])
            body = lambda c, _: (nest(c, depth + 1), None)  # noqa: E731
            return jax.lax.scan(body, x, None, length=lengths[depth])[0]

        return jnp.sum(nest(x, 0) ** 2)

    report = einshard.explain_step(sgd(loss), {"w": f32(D, D)}, f32(4 * N, D), rules=DP)
    (row,) = report.rows
    assert (row.kind, row.param, row.times) == ("all-reduce", "params/w", math.prod(lengths))
    assert row.traffic == ring_all_reduce(D * D * F32) * math.prod(lengths)
    assert report.findings == ()


@FEW
@example(shapes=[(8, 7), (45, 9)])  # one split, one larger that no axis of divides: copied
@given(
    shapes=st.lists(
        st.tuples(st.sampled_from([3, 5, 8, 16, 45]), st.sampled_from([7, 8, 9, 32])), min_size=2, max_size=4
    )
)
def test_fsdp_over_varied_shapes_names_what_stays_whole_and_every_sliced_reduction(shapes):
    seen = COPIED
    params = {f"w{i}": f32(a, b) for i, (a, b) in enumerate(shapes)}

    def loss(params, x):
        return sum(jnp.sum(jnp.tanh(x[:, : w.shape[0]] @ w) ** 2) for w in params.values())

    rules = einshard.Rules([(r"^batch", "b d -> b* d")]) + strategies.fsdp(min_bytes=0)
    report = einshard.explain_step(sgd(loss), params, f32(4 * N, 48), rules=rules)
    whole = {f"params/w{i}": a * b * F32 for i, (a, b) in enumerate(shapes) if a % N and b % N}
    split = {f"params/w{i}" for i, (a, b) in enumerate(shapes) if not (a % N and b % N)}
    copied = findings(report, "copied")
    if whole and split:
        smallest = min(
            shapes[int(p[len("params/w") :])][0] * shapes[int(p[len("params/w") :])][1] for p in split
        )
        held = {p: s for p, s in whole.items() if s >= smallest * F32}
        if held:
            seen.append(held)
            (finding,) = copied
            assert set(finding.params) == set(held)
            assert finding.memory_bytes == sum(s - s // N for s in held.values())
    sliced = findings(report, "sliced all-reduce")
    reduced = {row.param for row in report.rows if row.kind == "all-reduce" and row.param in split}
    if reduced:
        (finding,) = sliced
        assert set(finding.params) >= reduced
        assert sum(f.bytes for f in report.findings) <= report.traffic + sum(f.memory_bytes for f in copied)


@FEW
@example(lengths=[2, 3])
@given(lengths=st.lists(st.integers(2, 4), min_size=2, max_size=3))
def test_a_forward_reduction_in_nested_loops_runs_the_product_of_their_trip_counts(lengths):
    def forward(w, x):
        def nest(x, depth):
            if depth == len(lengths):
                return jnp.tanh(x @ w)  # w split on its rows: a partial sum, all-reduced per trip
            return jax.lax.fori_loop(0, lengths[depth], lambda _, c: nest(c, depth + 1), x)

        return nest(x, 0)

    w = jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=einshard.make_sharding("a b -> a* b"))
    report = einshard.explain_step(forward, w, f32(8, D))
    reductions = [row for row in report.rows if row.kind == "all-reduce"]
    assert reductions and all(row.times == math.prod(lengths) for row in reductions)
    assert sum(row.traffic for row in reductions) == sum(
        ring_all_reduce(row.bytes) * math.prod(lengths) for row in reductions
    )
