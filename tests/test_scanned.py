"""Scanned models planned as they are trained: the batch kept split inside loops.

* The reading of which axis of each value is the batch's (``_tracing._batch_axes``), on programs
  whose answer is worked out by hand: an embedding lookup, products, reductions over the batch,
  a weight's gradient, loops whose carry starts as zeros, an RNN scanning over time, a carry with
  the batch second.
* The rewrite (``_tracing._loops``) keeps every value: the constrained step's results equal the
  step's, and the one-device step's, on 8 (16, 6) simulated devices.
* On a small scanned model under FSDP, a plain table that splits the batch gives a program that
  all-reduces the whole batch's activations in every layer (the finding ``activations reduced
  in a loop`` names them); the strategy itself as ``rules=`` keeps the carry split (the report's
  loops say where) and those all-reduces are gone; the step with ``like_batch`` in its body
  compiles to the same program.
* Donation: a step returning its first argument updated is compiled with it donated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard._tracing import _batch_axes, _loops
from einshard._tracing._batch_axes import ABSENT, REDUCED, UNKNOWN

N = len(jax.devices())
B = 2 * N  # the batch: divides by every simulated device count
# Every weight's axes divide by the device count too, so FSDP splits them at 6 devices as at 8.
V, H, F, L, S = 8 * N, 4 * N, 8 * N, 3, 8


# --- the reading, by hand ---------------------------------------------------------------------------


def axes_of(fn, args, batch_positions):
    """The batch's axis of each output of ``fn`` (flat), with the batch first in ``batch_positions``."""
    flat, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *f: jax.tree.leaves(fn(*jax.tree.unflatten(tree, f))))(*flat)
    in_axes = [0 if i in batch_positions else None for i in range(len(flat))]
    return _batch_axes.batch_axes_of(closed.jaxpr, in_axes).outputs


def test_an_embedding_lookup_and_the_products_after_it_keep_the_batch_first():
    """tokens (B, S) -> embed[tokens] (B, S, H): the lookup's output batch dims are the indices'.

    x @ w keeps it (a free axis of the left operand comes first after no batch dims); the
    transpose (S, B, H) moves it to axis 1; a mean over the batch leaves none (reduced); a
    weight's gradient, x^T dy, contracts it away (reduced); the vocabulary table alone has none.
    """

    def fn(embed, w, tokens):
        x = embed[tokens]
        y = x @ w
        return y, jnp.transpose(y, (1, 0, 2)), y.mean(0), jnp.einsum("bsh,bsf->hf", x, y), embed * 2

    outs = axes_of(fn, (jnp.ones((V, H)), jnp.ones((H, F)), jnp.zeros((B, S), jnp.int32)), {2})
    assert outs == [0, 1, REDUCED, REDUCED, ABSENT]


def test_a_reshape_keeps_the_batch_where_it_stays_major_and_a_slice_where_it_takes_all():
    """(B, S, H) -> (B*S, H): the batch is the merged axis's major factor (axis 0); -> (S, B*H)
    puts it inside another axis (unknown). x[:, 1:] keeps it; x[1:] cuts it (unknown)."""

    def fn(x):
        return x.reshape(B * S, H), x.reshape(S, B * H), x[:, 1:], x[1:]

    assert axes_of(fn, (jnp.ones((B, S, H)),), {0}) == [0, UNKNOWN, 0, UNKNOWN]


def test_a_carry_that_starts_as_zeros_and_an_rnn_over_time_are_batch_major():
    """A scan carrying h = tanh(h @ w + x_t), with h0 = zeros (absent: no batch) and x scanned over
    time (T, B, H): each x_t has the batch first, so every h does; the joined carry is axis 0,
    and the stacked outputs (T, B, H) have it at axis 1. A loss summed over the carry is reduced.
    """

    def fn(w, xs):
        def cell(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h

        h, hs = jax.lax.scan(cell, jnp.zeros((B, H)), xs)
        return h, hs, jnp.sum(h)

    assert axes_of(fn, (jnp.ones((H, H)), jnp.ones((5, B, H))), set()) == [ABSENT] * 3  # no batch given
    closed = jax.make_jaxpr(fn)(jnp.ones((H, H)), jnp.ones((5, B, H)))
    outs = _batch_axes.batch_axes_of(closed.jaxpr, [None, 1]).outputs  # the batch is axis 1 of xs
    assert outs == [0, 1, REDUCED]


def test_a_gradient_accumulated_in_a_loop_is_reduced_and_a_batch_second_carry_is_not_first():
    """A carry acc += x^T x (a weight-shaped sum over the batch) is reduced, never constrained; a
    carry transposed to (H, B) has the batch at axis 1: the rewrite leaves it, and says why."""

    def fn(x):
        def body(carry, _):
            acc, xt = carry
            return (acc + x.T @ x, jnp.tanh(xt)), None

        (acc, xt), _ = jax.lax.scan(body, (jnp.zeros((H, H)), x.T), None, length=3)
        return acc, xt

    closed = jax.make_jaxpr(fn)(jnp.ones((B, H)))
    assert _batch_axes.batch_axes_of(closed.jaxpr, [0]).outputs == [REDUCED, 1]
    rewritten, notes = _loops.constrained_jaxpr(closed.jaxpr, [0], lambda x: x)
    assert rewritten is closed.jaxpr  # nothing to constrain
    (note,) = notes
    assert note.constrained == 0 and note.primitive == "scan"
    assert f"axis 1 of its carry float32[{H},{B}]" in note.reason
    assert note.source.startswith("test_scanned.py:")


def test_a_while_loop_and_a_cond_in_its_body_are_read_through():
    """A while_loop carrying (i, x) with x updated by a cond of two batch-preserving branches:
    the counter is absent, x keeps the batch first."""

    def fn(x):
        def body(carry):
            i, x = carry
            x = jax.lax.cond(i % 2 == 0, jnp.tanh, jnp.sin, x)
            return i + 1, x

        return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, x))

    closed = jax.make_jaxpr(fn)(jnp.ones((B, H)))
    assert _batch_axes.batch_axes_of(closed.jaxpr, [0]).outputs == [ABSENT, 0]
    _, notes = _loops.constrained_jaxpr(closed.jaxpr, [0], lambda x: x)
    assert [(n.primitive, n.constrained) for n in notes] == [("while", 1)]


# --- a small scanned model ----------------------------------------------------------------------------


def loss(params, batch, marked=False):
    x = params["embed"][batch]

    def layer(x, p):
        if marked:
            x = einshard.like_batch(x)
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"], None

    x, _ = jax.lax.scan(jax.checkpoint(layer), x, params["layers"])
    logits = x @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[..., None] % V, -1))


def step(params, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def marked_step(params, batch):
    value, grads = jax.value_and_grad(lambda p: loss(p, batch, marked=True))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def make_params(key=0):
    keys = jax.random.split(jax.random.key(key), 4)
    return {
        "embed": jax.random.normal(keys[0], (V, H)) * 0.1,
        "layers": {
            "w1": jax.random.normal(keys[1], (L, H, F)) * 0.1,
            "w2": jax.random.normal(keys[2], (L, F, H)) * 0.1,
        },
        "head": jax.random.normal(keys[3], (H, V)) * 0.1,
    }


BATCH = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) % V
FSDP = einshard.strategies.fsdp(min_bytes=0)
# FSDP's table with its batch rule written in, as a user would write it: a plain table, no strategy.
PLAIN = einshard.Rules([("^batch(/|$)", "b ... -> b* ..."), *FSDP.pairs()])


def full_batch_reductions(report):
    """The all-reduces in a loop of arrays with the whole batch first: activations reduced there."""
    return [
        row for row in report.rows if row.kind == "all-reduce" and row.times > 1 and row.shape[:1] == (B,)
    ]


@pytest.fixture(scope="module")
def reports():
    params = make_params()
    return {
        "plain": einshard.explain_step(step, params, BATCH, rules=PLAIN),
        "strategy": einshard.explain_step(step, params, BATCH, rules=FSDP),
        "marked": einshard.explain_step(marked_step, params, BATCH, rules=FSDP),
        "constrained": einshard.explain_step(
            einshard.constrain_loops(step, FSDP), params, BATCH, rules=PLAIN
        ),
    }


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_a_plain_table_reduces_the_whole_batch_in_every_layer_and_the_finding_names_it(reports):
    """With the batch rule written in a plain table, XLA's partitioner drops the batch split inside
    the loop: all-reduces of (B, S, H) activations, run L times each, forward and backward. The
    finding counts exactly those rows, says where, and gives the fix."""
    report = reports["plain"]
    reduced = full_batch_reductions(report)
    assert reduced and all(row.times == L and row.shape == (B, S, H) for row in reduced)
    assert not report.batch_loops  # a plain table: nothing was constrained
    (finding,) = [f for f in report.findings if f.kind == "activations reduced in a loop"]
    assert finding.bytes == sum(row.traffic for row in reduced)
    assert [report.rows[i] for i in finding.rows] == reduced
    assert "like_batch" in finding.fix and "constrain_loops" in finding.fix
    assert any(source.endswith(".py:" + source.rsplit(":", 1)[1]) for source in finding.sources)


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_the_strategy_keeps_the_carry_split_and_the_activations_are_not_reduced(reports):
    """The strategy as rules= constrains both loops' carries (the forward scan and its transpose),
    says so with the loop's line, and the program reduces no activation: it sends less, and its
    peak is lower (each device holds its part of the batch)."""
    plain, report = reports["plain"], reports["strategy"]
    assert [(loop.primitive, loop.backward, loop.constrained) for loop in report.batch_loops] == [
        ("scan", False, 1),
        ("scan", True, 1),
    ]
    assert all(loop.source.startswith("test_scanned.py:") for loop in report.batch_loops)
    assert not full_batch_reductions(report)
    assert "activations reduced in a loop" not in [f.kind for f in report.findings]
    assert report.traffic < plain.traffic
    assert report.peak_bytes < plain.peak_bytes
    assert "loops kept in the batch's layout" in str(report)


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_like_batch_in_the_body_and_constrain_loops_compile_to_the_strategy_s_program(reports):
    """The step whose body already calls like_batch, and constrain_loops(step) under a plain table,
    give the program the strategy gives: the same collectives, bytes and peak."""
    expected = reports["strategy"]
    for name in ("marked", "constrained"):
        report = reports[name]
        assert [(r.kind, r.shape, r.times) for r in report.rows] == [
            (r.kind, r.shape, r.times) for r in expected.rows
        ], name
        assert report.bytes_by_kind == expected.bytes_by_kind, name
        assert report.peak_bytes == expected.peak_bytes, name


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_the_model_s_like_batch_is_reported_as_keeping_its_loops(reports):
    """With the strategy as rules=, the marked step's loops are kept by the model (einshard adds
    nothing); under a plain table, with a use_strategy block around the call, like_batch alone keeps
    them: the report lists both loops, by the model, and the program is the strategy's."""
    marked = reports["marked"]
    assert [(loop.backward, loop.constrained, loop.constrained_by) for loop in marked.batch_loops] == [
        (False, 1, "model"),
        (True, 1, "model"),
    ]
    assert "by the model's own constraint (einshard.like_batch in the body)" in " ".join(str(marked).split())
    assert {loop.constrained_by for loop in reports["strategy"].batch_loops} == {"einshard"}
    with einshard.use_strategy(FSDP):
        blocked = einshard.explain_step(marked_step, make_params(), BATCH, rules=PLAIN)
    assert [(loop.backward, loop.constrained_by) for loop in blocked.batch_loops] == [
        (False, "model"),
        (True, "model"),
    ]
    assert blocked.bytes_by_kind == reports["strategy"].bytes_by_kind
    assert not full_batch_reductions(blocked)
    assert [f.kind for f in blocked.findings] == [f.kind for f in reports["strategy"].findings]
    assert all(loop.source.startswith("test_scanned.py:") for loop in blocked.batch_loops)


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
@pytest.mark.parametrize("how", ["static_argnums", "static_argnames", "a dynamic Python number"])
def test_a_jitted_step_with_static_or_number_arguments_keeps_its_loops(reports, how):
    """jax.jit(step, static_argnums=...) and a jit given a Python float among its dynamic
    arguments (which einshard's own compile holds static): the program's parameters are matched
    to the call's leaves, and the loops are kept as the plain step's are."""

    def scaled_step(params, batch, lr):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), value

    params = make_params()
    if how == "static_argnums":
        report = einshard.explain_step(jax.jit(scaled_step, static_argnums=2), params, BATCH, 0.1, rules=FSDP)
    elif how == "static_argnames":
        jitted = jax.jit(scaled_step, static_argnames="lr")
        report = einshard.explain_step(jitted, params, BATCH, lr=0.1, rules=FSDP)
    else:
        report = einshard.explain_step(jax.jit(scaled_step), params, BATCH, 0.1, rules=FSDP)
    assert [(loop.backward, loop.constrained, loop.constrained_by) for loop in report.batch_loops] == [
        (False, 1, "einshard"),
        (True, 1, "einshard"),
    ]
    assert not full_batch_reductions(report)
    assert report.bytes_by_kind == reports["strategy"].bytes_by_kind


@pytest.mark.skipif(N == 1, reason="one device: nothing to split")
def test_a_jit_like_step_whose_program_einshard_cannot_match_says_its_loops_are_not_kept():
    """A wrapper whose program takes the call's arguments in another order: einshard cannot tell
    which parameter is the batch, so it adds nothing, and the report says so for each loop
    (forward and backward), instead of dropping them silently."""

    class Swapped:
        def __init__(self):
            self.jitted = jax.jit(lambda batch, params: step(params, batch))

        def trace(self, params, batch):
            return self.jitted.trace(batch, params)

        def lower(self, params, batch):
            return self.jitted.lower(batch, params)

    report = einshard.explain_step(Swapped(), make_params(), BATCH, rules=FSDP)
    assert [(loop.backward, loop.constrained) for loop in report.batch_loops] == [(False, 0), (True, 0)]
    assert all("cannot tell which of the call's arguments" in loop.reason for loop in report.batch_loops)
    assert "loop not kept in the batch's layout" in str(report)


def test_the_constrained_step_computes_what_the_step_computes_on_one_device():
    """jit(constrain_loops(step, fsdp)) on params and batch sharded by the strategy: new params and
    loss equal the one-device step's (float32, rtol 1e-5), and the result is laid out as given."""
    params = make_params(1)
    expected_params, expected_loss = jax.jit(step)(params, BATCH)
    sharded = einshard.shard_pytree({"params": params, "batch": BATCH}, FSDP.replace(unmatched="replicate"))
    batch = einshard.einshard(BATCH, FSDP.batch)
    run = jax.jit(einshard.constrain_loops(step, FSDP))
    new_params, value = run(sharded["params"], batch)
    np.testing.assert_allclose(value, expected_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), new_params, expected_params
    )
    assert batch.sharding.devices_indices_map(batch.shape)[jax.devices()[-1]][0] == slice(B - 2, B)
    lowered = run.lower(sharded["params"], batch).as_text()
    assert "sharding" in lowered  # the carry's constraint is in the program


def test_like_batch_does_nothing_outside_a_strategy_and_constrains_inside():
    """Outside any strategy like_batch returns its argument (the same object); inside
    use_strategy (nested: the innermost wins) it splits the first axis as the batch is."""
    x = jnp.ones((B, 4))
    assert einshard.like_batch(x) is x
    with einshard.use_strategy(FSDP):
        split = einshard.like_batch(x)
        with einshard.use_strategy("... -> * ..."):
            whole = einshard.like_batch(x)
    assert split.sharding.shard_shape(x.shape) == (B // N, 4)
    assert whole.sharding.shard_shape(x.shape) == (B, 4)
    assert einshard.like_batch(x) is x  # the blocks have ended


def test_like_batch_and_use_strategy_say_what_is_wrong():
    with pytest.raises(einshard.EinshardError, match="not a scalar"), einshard.use_strategy(FSDP):
        einshard.like_batch(jnp.float32(1.0))
    with pytest.raises(einshard.EinshardError, match="takes a Strategy or a batch expression"):
        einshard.use_strategy(3).__enter__()
    with pytest.raises(einshard.EinshardError, match="takes a Strategy or a batch expression"):
        einshard.constrain_loops(step, {"batch": "b ... -> b* ..."})
    if N > 1:
        with pytest.raises(einshard.EinshardError, match="does not split"), einshard.use_strategy(FSDP):
            einshard.like_batch(jnp.ones((N + 1, 4)))


# --- donation ------------------------------------------------------------------------------------------


def test_a_step_returning_its_first_argument_updated_is_compiled_with_it_donated():
    """step(params, batch) -> (params', loss): params donated, its bytes aliased, said in the
    report; donate=False compiles it without; a step whose result is not its argument is not;
    a jax.jit step keeps its own (none here)."""
    params = make_params()
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    donated = einshard.explain_step(step, params, BATCH)
    kept = einshard.explain_step(step, params, BATCH, donate=False)
    other = einshard.explain_step(lambda params, batch: loss(params, batch), params, BATCH)
    jitted = einshard.explain_step(jax.jit(step), params, BATCH)
    assert donated.donated == "params" and donated.alias_bytes == nbytes
    assert "donated" in str(donated)
    assert kept.donated is None and kept.alias_bytes == 0
    assert donated.peak_bytes <= kept.peak_bytes
    assert other.donated is None and other.alias_bytes == 0
    assert jitted.donated is None and jitted.alias_bytes == 0
    assert dataclasses.replace(donated, donated=None).bytes_by_kind == kept.bytes_by_kind


def test_a_jitted_scanned_step_is_kept_split_and_keeps_its_own_donation(reports):
    """jax.jit(step, donate_argnums=0) under the strategy: traced through, its loops constrained,
    the same collectives as the plain step's, and its own donation (params) kept."""
    params = make_params()
    jitted = einshard.explain_step(jax.jit(step, donate_argnums=0), params, BATCH, rules=FSDP)
    expected = reports["strategy"]
    assert [(loop.backward, loop.constrained) for loop in jitted.batch_loops] == [(False, 1), (True, 1)]
    assert jitted.bytes_by_kind == expected.bytes_by_kind
    # Each device's block of the params, split by FSDP: what both alias.
    assert jitted.donated is None and jitted.alias_bytes == expected.alias_bytes > 0


@pytest.mark.parametrize("value", [0, 1, None, "no", "", [], float("nan")])
def test_donate_takes_true_or_false_on_every_verb(value):
    """donate= is checked before any compile: a truthy "no" must not donate silently."""
    params = make_params()
    verbs = [
        (einshard.explain_step, {}),
        (einshard.plan, {}),
        (einshard.plan_batches, {"memory_per_device": 2**30}),
    ]
    for verb, figures in verbs:
        with pytest.raises(einshard.EinshardError, match="donate= takes True or False"):
            verb(step, params, BATCH, donate=value, **figures)
