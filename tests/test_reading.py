"""The roles reader on code that once stopped it: GPT-J's rotary attention, ViT's class token, and
the note of a weight a later break leaves whole.

* GPT-J rotates q and k with ``jnp.stack([-x2, x1], -1)`` of two strided slices, which JAX 0.12
  traces as the primitive ``stack``. The reader once stopped there and left q and k whole; the
  updated kernels then came back from ``jax.jit`` split, and the next step recompiled. Here q and
  k are split by heads, and the step trains like one device with every layout kept.
* A parameter that goes into the activations only through a ``concatenate`` (ViT's class token)
  is read, not ``unread``.
* A weight's note names the break that stops its split, not a harmless earlier one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard.strategies import roles, tensor_parallel

N = jax.device_count()
HEADS, HEAD, FFN, VOCAB, SEQ, BATCH, LAYERS = 24, 8, 256, 96, 8, 4, 2
D = HEADS * HEAD
ROTARY = HEAD // 2  # GPT-J rotates part of each head (rotary_dim), and passes the rest
STEPS = 3


def heads_split(n: int = N) -> int:
    return math.gcd(n, HEADS)


# --- GPT-J in plain JAX, laid out as transformers' Flax GPT-J -------------------------------------------


def gptj_params(key=None):
    keys = iter(jax.random.split(jax.random.key(0) if key is None else key, 16 * LAYERS + 4))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.1

    def norm():
        return {"scale": jnp.ones(D), "bias": jnp.zeros(D)}

    def layer():
        attn = {name: {"kernel": normal(D, D)} for name in ("q_proj", "k_proj", "v_proj", "out_proj")}
        mlp = {
            "fc_in": {"kernel": normal(D, FFN), "bias": jnp.zeros(FFN)},
            "fc_out": {"kernel": normal(FFN, D), "bias": jnp.zeros(D)},
        }
        return {"ln_1": norm(), "attn": attn, "mlp": mlp}

    return {
        "wte": normal(VOCAB, D),
        "h": [layer() for _ in range(LAYERS)],
        "ln_f": norm(),
        "lm_head": {"kernel": normal(D, VOCAB), "bias": jnp.zeros(VOCAB)},
    }


def _layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def rotate_every_two(x):
    """transformers' Flax GPT-J: ``jnp.stack`` of the odd and even halves, interleaved back."""
    rotated = jnp.stack((-x[..., 1::2], x[..., ::2]), axis=-1)
    return rotated.reshape((*rotated.shape[:-2], -1))


def apply_rotary(x, sin, cos):
    sin = jnp.repeat(sin[:, None, :], 2, -1)
    cos = jnp.repeat(cos[:, None, :], 2, -1)
    return x * cos + rotate_every_two(x) * sin


def _attention(x, p):
    batch, seq, _ = x.shape
    q, k, v = (
        (x @ p[name]["kernel"]).reshape(batch, seq, HEADS, HEAD) for name in ("q_proj", "k_proj", "v_proj")
    )
    inverse = 1.0 / (10000 ** (jnp.arange(0, ROTARY, 2) / ROTARY))
    angles = jnp.arange(seq)[:, None] * inverse[None]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    q = jnp.concatenate([apply_rotary(q[..., :ROTARY], sin, cos), q[..., ROTARY:]], -1)
    k = jnp.concatenate([apply_rotary(k[..., :ROTARY], sin, cos), k[..., ROTARY:]], -1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD**0.5
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(batch, seq, D)
    return out @ p["out_proj"]["kernel"]


def _mlp(x, p):
    hidden = jax.nn.gelu(x @ p["fc_in"]["kernel"] + p["fc_in"]["bias"])
    return hidden @ p["fc_out"]["kernel"] + p["fc_out"]["bias"]


def gptj_loss(params, tokens):
    x = params["wte"][tokens[:, :-1]]
    for layer in params["h"]:
        h = _layer_norm(x, layer["ln_1"])
        x = x + _attention(h, layer["attn"]) + _mlp(h, layer["mlp"])  # GPT-J's parallel block
    logits = _layer_norm(x, params["ln_f"]) @ params["lm_head"]["kernel"] + params["lm_head"]["bias"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return -jnp.mean(picked)


def sgd_step(loss):
    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return step


def tokens():
    return np.asarray(jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB))


# --- training under a table, against one device ---------------------------------------------------------


def trains_like_one_device(step, params, batch, strategy):
    """``STEPS`` steps of ``jax.jit(step)`` under ``strategy`` and on one device: equal losses and
    parameters, and every parameter comes back with the sharding it went in with."""
    one = jax.devices()[0]
    reference = jax.device_put(params, one)
    placed = einshard.shard_pytree(params, strategy)
    shardings = [leaf.sharding for leaf in jax.tree.leaves(placed)]
    run = jax.jit(step)
    on_one, sharded = jax.device_put(batch, one), einshard.einshard(batch, strategy.batch)
    for _ in range(STEPS):
        reference, loss_ref = run(reference, on_one)
        placed, loss = run(placed, sharded)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
        for leaf, before in zip(jax.tree.leaves(placed), shardings, strict=True):
            assert leaf.sharding.is_equivalent_to(before, leaf.ndim), (leaf.sharding, before)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    return placed


def blocks_along(array, axis):
    """Per device, in ``jax.devices()`` order, the ``(start, stop)`` of its block along ``axis``."""
    index = array.sharding.devices_indices_map(array.shape)
    return [index[d][axis].indices(array.shape[axis])[:2] for d in jax.devices()]


def assert_split_by_heads(array, axis, parts):
    """``axis`` is cut into ``parts`` blocks of whole heads, each held by ``N // parts`` devices."""
    blocks = blocks_along(array, axis)
    size = array.shape[axis]
    assert sorted(set(blocks)) == [(i * size // parts, (i + 1) * size // parts) for i in range(parts)]
    assert all(blocks.count(block) == N // parts for block in set(blocks))
    assert all(start % HEAD == 0 for start, _ in blocks)


def heads_expression(names: str) -> str:
    k = heads_split()
    return f"{names} -> i h*" if k == N else f"{names} -> i h{k} {N // k}"


# --- GPT-J ----------------------------------------------------------------------------------------------


def test_gptj_rotary_attention_keeps_q_and_k_split_by_heads():
    params, batch = gptj_params(), tokens()
    found = {row.path: row for row in roles(sgd_step(gptj_loss), params, batch).leaves}
    k = heads_split()
    for layer in range(LAYERS):
        for name in ("q_proj", "k_proj", "v_proj"):
            row = found[f"h/{layer}/attn/{name}/kernel"]
            assert (row.role, row.axis) == ("heads", 1), row
            assert row.axes == ("in", "heads")
            # q and k are cut inside each head (the rotary slices, q . k): whole heads only. v is
            # not, and splits as far as the model axis goes (16 ways on 16 devices, not 8).
            assert row.parts == (k if name != "v_proj" else math.gcd(N, D)), row
        out = found[f"h/{layer}/attn/out_proj/kernel"]
        assert (out.role, out.axis, out.parts) == ("heads", 0, math.gcd(N, D))
        assert "k_proj" in out.note and "q_proj" in out.note
    table = tensor_parallel(step=sgd_step(gptj_loss), params=params, batch=batch)
    for name in ("q_proj", "k_proj"):
        rule = table.match(f"h/1/attn/{name}/kernel")
        assert rule.expression == heads_expression("i h"), rule.expression
        assert rule.note.startswith("heads: split by head")
    report = einshard.explain(params, table)
    assert "stack" not in str(report)


def test_gptj_trains_like_one_device_with_its_layouts_kept():
    params, batch = gptj_params(), tokens()
    step = sgd_step(gptj_loss)
    table = tensor_parallel(step=step, params=params, batch=batch)
    placed = trains_like_one_device(step, params, batch, table)
    k = heads_split()
    for layer in range(LAYERS):
        attn = placed["h"][layer]["attn"]
        for name in ("q_proj", "k_proj"):
            assert_split_by_heads(attn[name]["kernel"], 1, k)
        if k == N:  # on 16 devices v and the output projection split 16 ways, across heads
            assert_split_by_heads(attn["v_proj"]["kernel"], 1, k)
            assert_split_by_heads(attn["out_proj"]["kernel"], 0, k)
    # q and k are not whole: each device holds a different block of heads (when k > 1).
    q = placed["h"][0]["attn"]["q_proj"]["kernel"]
    assert len(set(blocks_along(q, 1))) == k > 1 or N == 1


# --- a class token --------------------------------------------------------------------------------------


def vit_params():
    keys = iter(jax.random.split(jax.random.key(2), 8))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.1

    return {
        "patch": {"kernel": normal(12, D)},
        "cls_token": normal(1, 1, D),
        "pos": normal(1, SEQ + 1, D),
        "fc1": {"kernel": normal(D, FFN)},
        "fc2": {"kernel": normal(FFN, D)},
        "head": {"kernel": normal(D, 10)},
    }


def vit_loss(params, patches):
    x = patches @ params["patch"]["kernel"]
    cls = jnp.broadcast_to(params["cls_token"], (x.shape[0], 1, D))
    x = jnp.concatenate([cls, x], axis=1) + params["pos"]
    x = x + jax.nn.gelu(x @ params["fc1"]["kernel"]) @ params["fc2"]["kernel"]
    return jnp.mean((x[:, 0] @ params["head"]["kernel"]) ** 2)


def test_a_class_token_concatenated_into_the_activations_is_read():
    params = vit_params()
    patches = np.asarray(jax.random.normal(jax.random.key(3), (BATCH, SEQ, 12)))
    step = sgd_step(vit_loss)
    found = {row.path: row for row in roles(step, params, patches).leaves}
    cls = found["cls_token"]
    assert cls.role != "unread" and "not read" not in cls.note, cls
    assert cls.axes == ("-", "-", "elem")
    assert found["pos"].role == cls.role  # the class token reads like the position embedding beside it
    assert (found["fc1/kernel"].role, found["fc2/kernel"].role) == ("column", "row")
    table = tensor_parallel(step=step, params=params, batch=patches)
    assert "not read" not in table.match("cls_token").note
    trains_like_one_device(step, params, patches, table)


# --- the break that stops a split -----------------------------------------------------------------------


def _stopped_attention(stop):
    """q split into heads; first a cut inside each head (harmless: whole heads still split), then
    ``stop`` on q, which is what keeps q whole."""

    def loss(p, x):
        batch, seq, _ = x.shape
        q = (x @ p["q"]).reshape(batch, seq, HEADS, HEAD)
        half = q[..., : HEAD // 2].sum()  # sliced into parts: a cut between whole heads
        q = stop(q)
        return jnp.mean(q.reshape(batch, seq, D) @ p["o"]) + half

    params = {"q": jnp.ones((64, D)) * 0.1, "o": jnp.ones((D, 64)) * 0.1}
    return loss, params, jnp.ones((BATCH, SEQ, 64))


STOPS = pytest.mark.parametrize(
    ("stop", "words"),
    [
        (lambda q: jnp.sort(q, axis=2), "sorted along"),
        (lambda q: jnp.cumsum(q, axis=2), "run along by cumsum"),
        (
            lambda q: jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(q.shape, q.dtype), q),
            "read by pure_callback",
        ),
    ],
    ids=["sort", "cumsum", "callback"],
)


@STOPS
def test_the_note_names_the_break_that_stopped_the_split(stop, words):
    loss, params, x = _stopped_attention(stop)
    found = {row.path: row for row in roles(loss, params, x, n_devices=8).leaves}
    q = found["q"]
    assert q.axis is None
    assert q.note.startswith(f"no split: axis 1 is {words}"), q.note
    assert "sliced into parts" not in q.note
    # Without the stop, the same cut leaves q split by whole heads.
    loss, params, x = _stopped_attention(lambda q: q)
    free = {row.path: row for row in roles(loss, params, x, n_devices=8).leaves}
    assert (free["q"].axis, free["q"].parts) == (1, 8)


@STOPS
def test_the_derived_rule_of_a_weight_left_whole_carries_that_note(stop, words):
    loss, params, x = _stopped_attention(stop)
    rule = tensor_parallel(step=loss, params=params, batch=x).match("q")
    assert rule.expression.endswith("-> * ...") or "*" not in rule.expression.split("->")[1], rule
    assert f"axis 1 is {words}" in rule.note and "sliced" not in rule.note, rule.note
