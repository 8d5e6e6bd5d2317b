"""A step's loops as einshard reads them: the user's lines, the backward pass, the model's own
constraints, and ``like_batch`` and ``constrain_loops`` on inputs they cannot serve.

* The user's line of an operation is the first frame outside installed libraries (Flax's
  ``linear.py`` is not one), in a jaxpr's traceback and in XLA's stack-frame tables alike; what
  einshard reads of JAX's equations to find it (their tracebacks, innermost first, and the
  name stack's ``transpose(``) is checked here, so a JAX that changes it fails loudly.
* A loop inside a loop of the backward pass is of the backward pass.
* A ``shard_map``'s outputs have no batch axis the reading can tell (its body sees one device's
  block).
* ``like_batch`` at the top of a body is the model's own constraint: the loop is noted as kept,
  by the model, with or without a strategy to add einshard's; a constraint to another layout
  is not taken for it.
* ``like_batch`` on a tuple, a dict, a list or ``None`` says it takes one array; on a
  sequence-major carry, or inside ``jax.vmap``, it warns (the values stay right).
* ``constrain_loops`` raises when a batch-major carry does not split into the batch's parts.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import einshard
from einshard._cost.xla import _hlo
from einshard._language import _sources
from einshard._tracing import _batch_axes, _jaxprs, _loops
from einshard._tracing._batch_axes import UNKNOWN

N = len(jax.devices())
B, S, H = 2 * N, 4, 8
FSDP = einshard.strategies.fsdp(min_bytes=0)
needs_devices = pytest.mark.skipif(N == 1, reason="one device: nothing to split")


# --- the user's line ------------------------------------------------------------------------------


def test_the_user_s_frame_is_the_first_outside_installed_libraries():
    flax = ("/venv/lib/python3.12/site-packages/flax/linen/linear.py", 287)
    stdlib = ("/usr/lib/python3.12/contextlib.py", 81)
    model = ("/home/me/model.py", 16)
    assert _sources.user_frame([flax, stdlib, model, ("/home/me/train.py", 40)]) == model
    # A model installed as a package, called from its own scripts: the first frame not JAX's.
    jax_frame = ("/venv/lib/python3.12/site-packages/jax/_src/core.py", 1)
    assert _sources.user_frame([jax_frame, flax]) == flax
    assert _sources.user_frame([]) is None
    assert not _sources.is_library_file("<stdin>") and not _sources.is_library_file("/work/tests/x.py")


FLAX_STACK = """HloModule jit_step, is_scheduled=true, num_partitions=2

FileNames
1 "/venv/lib/python3.12/site-packages/flax/linen/linear.py"
2 "/venv/lib/python3.12/site-packages/flax/linen/module.py"
3 "/src/model.py"

FunctionNames
1 "__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=287 end_line=287 column=2 end_column=2}
2 {file_name_id=2 function_name_id=1 line=701 end_line=701 column=2 end_column=2}
3 {file_name_id=3 function_name_id=1 line=16 end_line=16 column=2 end_column=2}

StackFrames
1 {file_location_id=3 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=1 parent_frame_id=3}

ENTRY %main (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %r = f32[4,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add, \
metadata={op_name="jit(step)/dot_general" stack_frame_id=3}
}
"""


def test_a_program_s_source_is_the_model_s_line_not_flax_s():
    """XLA's stack-frame tables: linear.py:287 called from module.py:701 called from model.py:16."""
    module = _hlo.parse_module(FLAX_STACK)
    assert module.source(module.instructions()["r"]) == ("jit(step)/dot_general", "/src/model.py", 16)


def _scan_step(x, w):
    def body(x, w_layer):
        return jnp.tanh(x @ w_layer), None

    return jax.lax.scan(body, x, w)[0].sum()


def test_jax_still_writes_what_einshard_reads_of_an_equation():
    """A traceback's frames (file_name, line_num), innermost first, with this file among them;
    the backward pass's equations at the top level name 'transpose(' in their name stack."""
    closed = jax.make_jaxpr(jax.grad(_scan_step, argnums=1))(jnp.ones((B, H)), jnp.ones((3, H, H)))
    scans = [eqn for eqn in closed.jaxpr.eqns if eqn.primitive.name == "scan"]
    assert len(scans) == 2
    frames = scans[0].source_info.traceback.frames
    assert all(hasattr(frame, "file_name") and hasattr(frame, "line_num") for frame in frames)
    files = [frame.file_name for frame in frames]
    assert files.index(__file__) > 0 and "/jax/" in files[0]  # JAX's own frames first: innermost first
    assert _jaxprs.user_line(scans[0]) == f"test_loops.py:{_scan_step.__code__.co_firstlineno + 4}"
    assert [_jaxprs.is_backward(eqn) for eqn in scans] == [False, True]


# --- the backward pass ------------------------------------------------------------------------------


def test_the_inner_loop_of_a_backward_loop_is_of_the_backward_pass():
    """Nested scans: the outer forward, its inner, the outer's transpose, and the inner loop in it."""

    def loss(w, x):
        def outer(x, w2):
            def inner(x, w1):
                return jnp.tanh(x @ w1), None

            return jax.lax.scan(inner, x, w2)[0], None

        return jax.lax.scan(outer, x, w)[0].sum()

    closed = jax.make_jaxpr(jax.grad(loss))(jnp.ones((2, 3, H, H)), jnp.ones((B, H)))
    _, notes = _loops.constrained_jaxpr(closed.jaxpr, [None, 0], lambda x: x)
    assert [(note.backward, note.constrained) for note in notes] == [
        (False, 1),
        (False, 1),
        (True, 1),
        (True, 1),
    ]


# --- shard_map: a stop ------------------------------------------------------------------------------


@needs_devices
def test_a_shard_map_s_outputs_have_no_batch_axis_the_reading_can_tell():
    """The body sees each device's rows; out_specs P(None, 'x') lays those blocks side by side on
    axis 1: the batch is not the output's axis 0, which reading through the body would say."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def fn(x):
        return jax.shard_map(lambda block: block * 2, mesh=mesh, in_specs=P("x"), out_specs=P(None, "x"))(x)

    closed = jax.make_jaxpr(fn)(jnp.ones((B, H)))
    assert closed.out_avals[0].shape == (B // N, N * H)
    assert _batch_axes.batch_axes_of(closed.jaxpr, [0]).outputs == [UNKNOWN]


# --- the model's own constraint -------------------------------------------------------------------


def _marked_loss(w, x, constrain=einshard.like_batch):
    def body(x, w_layer):
        x = constrain(x)
        return x + jnp.tanh(x @ w_layer), None

    return jax.lax.scan(jax.checkpoint(body), x, w)[0].sum()


def _trace(loss, strategy=FSDP):
    with einshard.use_strategy(strategy):
        return jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, H, H)), jnp.ones((B, S, H)))


@needs_devices
def test_like_batch_at_the_top_of_the_body_keeps_both_loops_by_the_model():
    """Read only (no constraint to add): the forward loop's carry is constrained at the top of its
    body, the backward loop's at the bottom (the constraint's transpose): both kept, by the model.
    Rewriting adds nothing to them; the unmarked loss gets einshard's."""
    marked = _trace(_marked_loss)
    rewritten, notes = _loops.constrained_jaxpr(marked.jaxpr, [None, 0], None, parts=N)
    assert rewritten is marked.jaxpr
    assert [(n.backward, n.constrained, n.constrained_by) for n in notes] == [
        (False, 1, "model"),
        (True, 1, "model"),
    ]
    assert all(n.source.startswith("test_loops.py:") for n in notes)
    assert "by the model's own constraint" in str(notes[0])
    again, notes = _loops.constrained_jaxpr(marked.jaxpr, [None, 0], lambda x: x, parts=N)
    assert again is marked.jaxpr and [n.constrained_by for n in notes] == ["model", "model"]
    plain = _trace(lambda w, x: _marked_loss(w, x, constrain=lambda x: x))
    _, notes = _loops.constrained_jaxpr(plain.jaxpr, [None, 0], None, parts=N)
    assert notes == ()  # nothing kept, nothing added: no loop to note
    _, notes = _loops.constrained_jaxpr(plain.jaxpr, [None, 0], lambda x: x, parts=N)
    assert [n.constrained_by for n in notes] == ["einshard", "einshard"]


@needs_devices
def test_a_constraint_to_another_layout_is_not_the_batch_s():
    """The carry constrained replicated, or split on its last axis: not kept in the batch's layout."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    for spec in (P(), P(None, None, "x")):
        sharding = jax.sharding.NamedSharding(mesh, spec)

        def other(x, sharding=sharding):
            return jax.lax.with_sharding_constraint(x, sharding)

        closed = _trace(lambda w, x, other=other: _marked_loss(w, x, constrain=other))
        _, notes = _loops.constrained_jaxpr(closed.jaxpr, [None, 0], None, parts=N)
        assert notes == (), spec


# --- like_batch on what it cannot lay out ----------------------------------------------------------


@pytest.mark.parametrize("value", [(jnp.ones((B, H)),), [jnp.ones((B, H))], {"x": jnp.ones((B, H))}, None])
def test_like_batch_on_a_tuple_a_list_a_dict_or_none_says_it_takes_one_array(value):
    kind = "None" if value is None else f"a {type(value).__name__}"
    for strategy in (None, FSDP):
        with pytest.raises(einshard.EinshardError, match=f"takes one array .*, not {kind}") as caught:
            if strategy is None:
                einshard.like_batch(value)
            else:
                with einshard.use_strategy(strategy):
                    einshard.like_batch(value)
        assert "jax.tree.map(einshard.like_batch, x)" in caught.value.hint


def test_like_batch_maps_over_a_pytree_as_the_hint_says():
    tree = {"x": jnp.ones((B, H)), "y": jnp.ones((B, S, H))}
    with einshard.use_strategy(FSDP):
        laid = jax.tree.map(einshard.like_batch, tree)
    assert [leaf.sharding.shard_shape(leaf.shape)[0] for leaf in jax.tree.leaves(laid)] == [B // N] * 2


def _rnn(w, xs):
    """A sequence-major RNN: the carry h (B, H) is batch-major, the scanned xs (S, B, H) are not."""

    def cell(h, x):
        h = einshard.like_batch(h)
        return jnp.tanh(h @ w + x), None

    return jax.lax.scan(cell, jnp.zeros(xs.shape[1:]), xs)[0].sum()


def _seq_major(w, batch):
    """The same, with the carry itself sequence-major: like_batch splits its sequence axis."""

    def layer(x, w_layer):
        x = einshard.like_batch(x)  # x: (S, B, H)
        return jnp.tanh(x @ w_layer), None

    return jax.lax.scan(layer, jnp.swapaxes(batch, 0, 1), w)[0].sum()


def _per_example(w, batch):
    """like_batch inside jax.vmap over the examples: it sees (S, H) and splits S."""

    def layer(x, w_layer):
        x = jax.vmap(einshard.like_batch)(x)
        return jnp.tanh(x @ w_layer), None

    return jax.lax.scan(layer, batch, w)[0].sum()


@needs_devices
@pytest.mark.parametrize(
    ("loss", "warned"),
    [
        (_seq_major, rf"splits axis 0 of float32\[{N},{B},{H}\], whose batch is axis 1"),
        (_per_example, rf"splits axis 1 of float32\[{B},{N},{H}\] and leaves its batch \(axis 0\) whole"),
    ],
)
def test_like_batch_on_another_axis_than_the_batch_s_warns_and_the_values_stay_right(loss, warned):
    """The sequence (N long, so that it splits as the batch would) laid out in the batch's place."""
    w = jax.random.normal(jax.random.key(0), (3, H, H)) / 4
    batch = jax.random.normal(jax.random.key(1), (B, N, H))
    step = jax.grad(loss)
    with pytest.warns(einshard.EinshardWarning, match=warned) as record:
        got = jax.jit(einshard.constrain_loops(step, FSDP))(w, batch)
    assert any("test_loops.py:" in str(w.message) for w in record)
    # float32 sums in another order across devices: a few ulps (2e-6 on one of 192 values on
    # some CPUs); a layout that changed the values would be off by far more.
    np.testing.assert_allclose(got, jax.jit(step)(w, batch), rtol=1e-4, atol=1e-5)


@needs_devices
def test_like_batch_on_a_batch_major_carry_does_not_warn():
    w = jax.random.normal(jax.random.key(0), (H, H)) / 4
    xs = jax.random.normal(jax.random.key(1), (S, B, H))
    with warnings.catch_warnings():
        warnings.simplefilter("error", einshard.EinshardWarning)
        got = jax.jit(einshard.constrain_loops(jax.grad(_rnn), FSDP))(w, xs)
    np.testing.assert_allclose(got, jax.jit(jax.grad(_rnn))(w, xs), rtol=1e-5, atol=1e-6)


# --- constrain_loops on a batch that does not split ------------------------------------------------


@needs_devices
def test_constrain_loops_raises_when_the_carry_does_not_split_into_the_batch_s_parts():
    """A batch of 1.5 N examples on N devices: its carry cannot be kept split (JAX would refuse
    the batch laid out so too); the error names the loop's line and the sizes."""
    odd = N + N // 2
    w = jnp.ones((3, H, H)) / H
    batch = jnp.ones((odd, S, H))
    step = jax.grad(lambda w, batch: _marked_loss(w, batch, constrain=lambda x: x))
    with pytest.raises(einshard.EinshardError, match=r"cannot keep the loop at test_loops.py:\d+") as caught:
        jax.jit(einshard.constrain_loops(step, FSDP))(w, batch)
    assert f"its first axis ({odd}) does not split into the batch's {N} parts" in str(caught.value)
    assert "pad it" in caught.value.hint
