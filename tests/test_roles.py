"""Tensor-parallel roles read from the step's dataflow, on models whose layer names mean nothing.

Each model (plain JAX with arbitrary names, unrolled and ``scan``-stacked; Flax linen; Flax NNX;
Equinox) is read by ``einshard.strategies.tensor_parallel(step=step, params=params, batch=batch)``: the roles
found are checked against what the model does, and the derived table (and a hybrid) trains
three steps with one device's losses, every leaf keeping its layout through the step. The
sizes are chosen so that 8, 16 and 6 devices decide differently: 24 heads split 8 ways on 8
devices, 8 ways and copied twice on 16, 6 ways on 6.
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
D, HEADS, FFN, VOCAB, SEQ, BATCH = 48, 24, 96, 96, 8, 4
HEAD = D // HEADS
STEPS = 3


def heads_split(n: int = N, heads: int = HEADS) -> int:
    return math.gcd(n, heads)


# --- a plain-JAX GPT whose names say nothing ----------------------------------------------------------


def _norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def gpt_params(key, layers=2, stacked=False, fused=True):
    keys = iter(jax.random.split(key, 16 * layers + 4))

    def normal(*shape):
        return (jax.random.normal(next(keys), shape) * 0.1).astype(jnp.float32)

    def block():
        b = {
            "g1": jnp.ones(D),
            "g2": jnp.ones(D),
            "w1": normal(D, FFN),
            "b1": jnp.zeros(FFN),
            "w2": normal(FFN, D),
        }
        if fused:
            b["x"] = normal(D, 3 * D)  # fused q, k, v, laid out head by head (Megatron)
        else:
            b.update(a=normal(D, D), b=normal(D, D), c=normal(D, D))
        b["y"] = normal(D, D)
        return b

    blocks = [block() for _ in range(layers)]
    if stacked:
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {"e": normal(VOCAB, D), "blocks": blocks, "gf": jnp.ones(D), "u": normal(D, VOCAB)}


def _gpt_block(x, b, fused):
    batch, seq, _ = x.shape
    h = _norm(x, b["g1"])
    if fused:
        qkv = (h @ b["x"]).reshape(batch, seq, HEADS, 3, HEAD)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:
        q, k, v = ((h @ b[w]).reshape(batch, seq, HEADS, HEAD) for w in "abc")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD**0.5
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(batch, seq, D)
    x = x + out @ b["y"]
    return x + jax.nn.gelu(_norm(x, b["g2"]) @ b["w1"] + b["b1"]) @ b["w2"]


def gpt_loss(params, tokens, stacked=False, fused=True):
    x = params["e"][tokens[:, :-1]]
    if stacked:
        x, _ = jax.lax.scan(
            lambda x, b: (jax.checkpoint(_gpt_block, static_argnums=2)(x, b, fused), None),
            x,
            params["blocks"],
        )
    else:
        for b in params["blocks"]:
            x = _gpt_block(x, b, fused)
    logits = _norm(x, params["gf"]) @ params["u"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return -jnp.mean(picked)


def gpt_step(stacked=False, fused=True):
    def step(params, tokens):
        loss, grads = jax.value_and_grad(gpt_loss)(params, tokens, stacked, fused)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return step


def tokens(seed=1, batch=BATCH):
    return np.asarray(jax.random.randint(jax.random.key(seed), (batch, SEQ + 1), 0, VOCAB))


# --- training under a table, against one device ------------------------------------------------------


def _layouts(tree):
    return [
        leaf.sharding.devices_indices_map(leaf.shape)
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
    ]


def trains_like_one_device(
    step, params, batch, strategy, loss_of=lambda out: out[1], params_of=lambda out: out[0]
):
    """Three steps under ``strategy``: one device's losses, and every leaf keeps its layout."""
    one = jax.devices()[0]

    def on_one(tree):  # arrays only: an Equinox module's other leaves stay what they are
        return jax.tree.map(
            lambda x: jax.device_put(x, one) if isinstance(x, (jax.Array, np.ndarray)) else x, tree
        )

    reference = on_one(params)
    placed = einshard.shard_pytree(params, strategy)
    placed_batch = jax.tree.map(lambda b: einshard.einshard(b, strategy.batch), batch)
    layouts = _layouts(placed)
    split = [
        leaf
        for leaf in jax.tree.leaves(placed)
        if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1
    ]
    assert split
    run = step if hasattr(step, "lower") else jax.jit(step)  # a jitted step (eqx.filter_jit) as it is
    for _ in range(STEPS):
        out_ref = run(reference, on_one(batch))
        out = run(placed, placed_batch)
        np.testing.assert_allclose(float(loss_of(out)), float(loss_of(out_ref)), rtol=1e-4)
        reference, placed = params_of(out_ref), params_of(out)
        assert _layouts(placed) == layouts
    return placed


def by_path(found):
    return {row.path: row for row in found.leaves}


# --- plain JAX ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_plain_jax_gpt_roles_come_from_the_dataflow(stacked):
    params = gpt_params(jax.random.key(0), stacked=stacked)
    step = gpt_step(stacked)
    found = by_path(roles(step, params, tokens()))
    block = "blocks" if stacked else "blocks/1"
    lead = 1 if stacked else 0  # the stacked layer axis comes first
    assert found[f"{block}/x"].role == "heads" and found[f"{block}/x"].axis == lead + 1
    assert found[f"{block}/y"].role == "heads" and found[f"{block}/y"].axis == lead
    assert found[f"{block}/w1"].role == "column" and found[f"{block}/w1"].axis == lead + 1
    assert found[f"{block}/w2"].role == "row" and found[f"{block}/w2"].axis == lead
    assert found[f"{block}/b1"].role == "follows" and found[f"{block}/b1"].axis == lead
    assert found["e"].role == "vocabulary" and found["e"].axis == 0
    assert found["u"].role == "vocabulary" and found["u"].axis == 1
    assert found[f"{block}/x"].parts == heads_split()
    for norm in (f"{block}/g1", f"{block}/g2", "gf"):
        assert found[norm].axis is None and "stay whole" in found[norm].note
    if stacked:
        assert found["blocks/x"].axes[0] == "layer"
    assert (
        "blocks/*/w2" in found["blocks/1/w1"].note if not stacked else "blocks/w2" in found["blocks/w1"].note
    )


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_plain_jax_gpt_trains_under_the_derived_tables(stacked):
    params = gpt_params(jax.random.key(0), stacked=stacked)
    step = gpt_step(stacked)
    table = tensor_parallel(step=step, params=params, batch=tokens())
    assert table.name == "tensor parallel" and table.batch == "... -> * ..." and table.model == N
    placed = trains_like_one_device(step, params, tokens(), table)
    w1 = placed["blocks"]["w1"] if stacked else placed["blocks"][0]["w1"]
    assert w1.sharding.shard_shape(w1.shape)[-1] == FFN // N
    if N % 2 == 0:  # the batch is split over the data axis: N // 2 devices
        batch = tokens(batch=N)
        hybrid = einshard.strategies.hybrid(2, step=step, params=params, batch=batch)
        assert hybrid.batch == "b ... -> b* ... 2" and hybrid.model == 2
        placed = trains_like_one_device(step, params, batch, hybrid)
        # A model group is 2 neighbouring devices: they split w1's output axis; the data groups
        # hold the same blocks of it.
        w1 = placed["blocks"]["w1"] if stacked else placed["blocks"][0]["w1"]
        assert_split(w1, w1.ndim - 1, 2, model=2)


def test_the_table_is_readable_and_matches_with_or_without_the_parameter_name():
    params = gpt_params(jax.random.key(0), layers=4)
    table = tensor_parallel(step=gpt_step(), params=params, batch=tokens())
    text = repr(table)
    assert (
        r"(^|/)blocks/\\d+/w1$" in text
        and "# column: its output feeds blocks/*/w2's contraction axis" in text
    )
    assert all(rule.note for rule in table)  # every rule says why
    path = "blocks/3/x"
    assert table.match(path).expression == table.match(f"params/{path}").expression != "... -> * ..."
    assert table.match(f"opt_state/0/mu/{path}").expression == table.match(path).expression
    edited = einshard.Rules([(r"blocks/0/w1$", "i o -> i o")]) + table  # your own rules go in front
    assert (
        edited.match("blocks/0/w1").expression == "i o -> i o" and edited.rules[1].note == table.rules[0].note
    )
    assert einshard.Rules(table).rules[0].note == table.rules[0].note


def test_unfused_qkv_heads_and_a_scan_read_alike():
    flat = by_path(roles(gpt_step(fused=False), gpt_params(jax.random.key(0), fused=False), tokens()))
    for name in "abc":
        assert flat[f"blocks/0/{name}"].role == "heads" and flat[f"blocks/0/{name}"].axis == 1
    scanned = by_path(
        roles(gpt_step(True, False), gpt_params(jax.random.key(0), stacked=True, fused=False), tokens())
    )
    unrolled = {
        p.replace("blocks/0/", "blocks/"): (r.role, r.axis) for p, r in flat.items() if "blocks/1" not in p
    }
    stacked = {  # the stacked leaves have the layer axis first
        p: (r.role, None if r.axis is None else r.axis - p.startswith("blocks/")) for p, r in scanned.items()
    }
    assert unrolled == stacked


# --- grouped-query attention: split what divides, copy the rest -----------------------------------------


def gqa(heads, kv_heads, head=4):
    """Grouped-query attention in Gemma's layouts (NDH, CKDH, NHD): a step and its parameters."""
    key = jax.random.key(0)
    params = {
        "q": jax.random.normal(key, (heads, D, head)) * 0.1,
        "kv": jax.random.normal(key, (2, kv_heads, D, head)) * 0.1,
        "o": jax.random.normal(key, (heads, head, D)) * 0.1,
    }

    def attend(p, x):
        batch, seq, _ = x.shape
        q = jnp.einsum("BTD,NDH->BTNH", x, p["q"]).reshape(batch, seq, kv_heads, heads // kv_heads, head)
        k, v = jnp.einsum("BSD,CKDH->CBSKH", x, p["kv"])
        probs = jax.nn.softmax(jnp.einsum("BTKGH,BSKH->BTKGS", q, k), -1)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(batch, seq, heads, head)
        return jnp.einsum("BTNH,NHD->BTD", encoded, p["o"])

    def step(p, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(attend(p, x) ** 2))(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    return step, params


def blocks_along(array, axis):
    """Per device, in ``jax.devices()`` order, the ``(start, stop)`` of its block along ``axis``."""
    index = array.sharding.devices_indices_map(array.shape)
    size = array.shape[axis]
    return [index[d][axis].indices(size)[:2] for d in jax.devices()]


def assert_split(array, axis, parts, model=N):
    """``axis`` is split ``parts`` ways in whole blocks over each group of ``model`` neighbouring
    devices, each block held by ``model // parts`` of them (copies); the model groups agree."""
    blocks = blocks_along(array, axis)
    size = array.shape[axis]
    for group in range(N // model):
        within = blocks[group * model : (group + 1) * model]
        assert sorted(set(within)) == [(i * size // parts, (i + 1) * size // parts) for i in range(parts)]
        assert all(within.count(block) == model // parts for block in set(within))
        assert within == blocks[:model]  # every model group holds the same blocks


@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 2), (12, 4)])
def test_kv_heads_split_what_divides_and_copy_the_rest(heads, kv_heads):
    step, params = gqa(heads, kv_heads)
    x = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, SEQ, D)))
    table = tensor_parallel(step=step, params=params, batch=x)
    kv, q = math.gcd(N, kv_heads), math.gcd(N, heads)
    expected = f"o h{kv} i p {N // kv}" if kv < N else "o h* i p"
    assert table.match("kv").expression == f"o h i p -> {expected}"
    assert table.match("q").expression == (f"h i o -> h{q} i o {N // q}" if q < N else "h i o -> h* i o")
    assert "copies" in table.match("kv").note
    placed = trains_like_one_device(step, params, x, table)
    assert_split(placed["q"], 0, q)
    assert_split(placed["kv"], 1, kv)
    assert_split(placed["o"], 0, q)


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 4), (16, 2)])
def test_heads_split_by_the_largest_divisor_of_every_model_axis(heads, kv_heads):
    # The reading is done for a model axis of any size (n_devices): the heads split as many ways
    # as divide both, the rest of the model axis holds copies. (Where the kv heads do not split
    # at all, they are replicated: no split pairs them.)
    step, params = gqa(heads, kv_heads)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, D), jnp.float32)
    for model in (m for m in range(2, 17) if math.gcd(m, kv_heads) > 1):
        found = by_path(roles(step, params, x, n_devices=model))
        q, kv = math.gcd(model, heads), math.gcd(model, kv_heads)
        assert (found["q"].axis, found["q"].parts) == (0, q), model
        assert (found["kv"].axis, found["kv"].parts) == (1, kv), model
        assert (found["o"].axis, found["o"].parts) == (0, q), model
        assert (f"{model // kv} copies" in found["kv"].note) == (kv < model)
        rows = {
            row.path: row.shard_shape
            for row in einshard.explain(
                params, tensor_parallel(step=step, params=params, batch=x, n_devices=model), n_devices=model
            ).rows
        }
        assert rows == {
            "q": (heads // q, D, 4),
            "kv": (2, kv_heads // kv, D, 4),
            "o": (heads // q, 4, D),
        }, model


def test_axes_that_do_not_divide_are_split_as_far_as_they_do():
    # 8 heads on 6 devices: 2 ways, 3 copies; 128 FFN units on 6: 2 ways; on 8 and 16 the heads
    # split 8 ways (copied twice on 16).
    heads, ffn = 8, 128
    key = jax.random.key(0)
    params = {
        "wq": jax.random.normal(key, (D, D)),
        "wo": jax.random.normal(key, (D, D)),
        "up": jax.random.normal(key, (D, ffn)) * 0.1,
        "down": jax.random.normal(key, (ffn, D)) * 0.1,
    }

    def loss(p, x):
        q = (x @ p["wq"]).reshape(*x.shape[:-1], heads, D // heads)
        mixed = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, q), -1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", mixed, q).reshape(x.shape) @ p["wo"]
        return jnp.mean((x + jax.nn.relu(_norm(x, 1.0) @ p["up"]) @ p["down"]) ** 2)

    def step(p, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, g: a - 1e-3 * g, p, grads), value

    x = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, SEQ, D)))
    found = by_path(roles(step, params, x))
    assert found["wq"].parts == math.gcd(N, heads) and found["wo"].parts == math.gcd(N, heads)
    assert found["up"].parts == math.gcd(N, ffn) and found["down"].parts == math.gcd(N, ffn)
    if math.gcd(N, heads) < N:
        assert f"{N // math.gcd(N, heads)} copies" in found["wq"].note
    trains_like_one_device(step, params, x, tensor_parallel(step=step, params=params, batch=x))


# --- the derived rules: each leaf's own, however alike the names --------------------------------------


def two_mlps():
    """Two MLPs whose leaves are named so that each name ends or starts another: a, ab, b, ba."""
    key = jax.random.key(0)
    shapes = {"a": (D, FFN), "ab": (FFN, D), "b": (D, FFN), "ba": (FFN, D)}
    params = {name: jax.random.normal(key, shape) * 0.1 for name, shape in shapes.items()}

    def loss(p, batch):
        x, y = batch
        first = jax.nn.relu(x @ p["a"]) @ p["ab"]
        second = jax.nn.relu(y @ p["b"]) @ p["ba"]
        return jnp.mean(first**2) + jnp.mean(second**2)

    def step(p, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads), value

    batch = tuple(np.asarray(jax.random.normal(jax.random.key(i), (N, D))) for i in (1, 2))
    return step, params, batch


@pytest.mark.parametrize("kind", ["tensor parallel", "hybrid"])
def test_each_leaf_gets_its_own_rule_when_names_end_or_start_alike(kind):
    if kind == "hybrid" and (N % 2 or N == 2):
        pytest.skip("needs a (data, model=2) grid")
    step, params, batch = two_mlps()
    model = N if kind == "tensor parallel" else 2
    found = by_path(roles(step, params, batch, n_devices=model))
    assert {path: (row.role, row.axis) for path, row in found.items()} == {
        "a": ("column", 1),
        "ab": ("row", 0),
        "b": ("column", 1),
        "ba": ("row", 0),
    }
    if kind == "tensor parallel":
        table = tensor_parallel(step=step, params=params, batch=batch)
    else:
        table = einshard.strategies.hybrid(2, step=step, params=params, batch=batch)
    placed = einshard.shard_pytree(params, table)
    for path, row in found.items():  # 'a' must not take 'ab' or 'ba', 'b' not 'ba'
        assert_split(placed[path], row.axis, model, model=model)
        assert table.match(path).note == row.note


# --- where reading stops -------------------------------------------------------------------------------


def test_reading_stops_at_a_callback_and_says_so():
    def outside(w):
        return np.asarray(w) * 2

    def loss(p, x):
        w = jax.pure_callback(outside, jax.ShapeDtypeStruct(p["w"].shape, p["w"].dtype), p["w"])
        return jnp.mean((jax.nn.relu(x @ p["up"]) @ p["down"] @ w) ** 2)

    params = {k: jnp.ones(s) * 0.1 for k, s in (("w", (D, D)), ("up", (D, FFN)), ("down", (FFN, D)))}
    x = jnp.ones((BATCH, D))
    found = roles(loss, params, x)
    rows = by_path(found)
    assert rows["w"].axis is None and "pure_callback" in rows["w"].note
    assert rows["up"].role == "column" and rows["down"].role == "row"
    assert "pure_callback" in found.stops and "reading stopped at pure_callback" in str(found)


def test_a_step_that_cannot_be_traced_is_an_einshard_error():
    def step(params, x):
        if float(jnp.sum(x)) > 0:  # a Python branch on a value: not traceable
            return params
        return params

    with pytest.raises(einshard.EinshardError, match="cannot read the step's dataflow") as caught:
        tensor_parallel(step=step, params={"w": jnp.ones((4, 4))}, batch=jnp.ones((2, 4)))
    assert "make_jaxpr" in str(caught.value)
    with pytest.raises(einshard.EinshardError, match="needs the step's params and a batch"):
        tensor_parallel(step=lambda p, b: p)
    with pytest.raises(einshard.EinshardError, match="n_devices"):
        roles(lambda p, b: p, {}, jnp.ones(2), n_devices=0)


def test_the_backward_pass_is_marked_as_jax_marks_it():
    # The reading skips the backward pass by JAX's name stack ("transpose(jvp(...))"): if JAX
    # stops marking it, this fails, and the roles would be read from the gradients too.
    jaxpr = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(x @ w)))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    stacks = [
        str(eqn.source_info.name_stack) for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"
    ]
    assert any("transpose(" in s for s in stacks) and any("transpose(" not in s for s in stacks)


# --- Flax linen, Flax NNX, Equinox ---------------------------------------------------------------------


def test_flax_linen_dense_einsum_attention_and_scan():
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(nn.LayerNorm()(x))
            h = nn.gelu(nn.Einsum((D, FFN), "...d,df->...f")(nn.LayerNorm()(x)))
            return x + nn.Dense(D)(h), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, D)(tokens)
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(
                x, None
            )
            return nn.Dense(VOCAB)(nn.LayerNorm()(x))

    model = Model()
    batch = tokens()
    params = model.init(jax.random.key(0), batch)
    tx = optax.adam(1e-2)

    def step(state, batch):
        params, opt_state = state

        def loss(p):
            logits = model.apply(p, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return (optax.apply_updates(params, updates), opt_state), value

    state = (params, tx.init(params))
    found = by_path(roles(step, state, batch))
    attention = "0/params/ScanBlock_0/MultiHeadDotProductAttention_0"
    for name in ("query", "key", "value"):
        assert (
            found[f"{attention}/{name}/kernel"].role == "heads"
            and found[f"{attention}/{name}/kernel"].axis == 2
        )
    assert found[f"{attention}/out/kernel"].axis == 1
    assert found["0/params/ScanBlock_0/Einsum_0/kernel"].role == "column"
    assert found["0/params/ScanBlock_0/Dense_0/kernel"].role == "row"
    assert found["0/params/Embed_0/embedding"].role == "vocabulary"
    assert found["0/params/Dense_0/kernel"].role == "vocabulary"
    assert not any(
        path.startswith("1/") and row.axis is not None for path, row in found.items()
    )  # Adam's state
    table = tensor_parallel(step=step, params=state, batch=batch)
    placed = trains_like_one_device(step, state, batch, table)
    # Adam's moments follow their parameters: the table's rules match them by their path's end.
    params_placed, opt_placed = placed
    kernel = params_placed["params"]["ScanBlock_0"]["Einsum_0"]["kernel"]
    assert opt_placed[0].mu["params"]["ScanBlock_0"]["Einsum_0"]["kernel"].sharding.devices_indices_map(
        kernel.shape
    ) == kernel.sharding.devices_indices_map(kernel.shape)


def test_flax_nnx_linear_and_attention():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
            self.first = nnx.Linear(D, FFN, rngs=rngs)
            self.second = nnx.Linear(FFN, D, rngs=rngs)
            self.norm = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, x):
            x = x + self.attention(self.norm(x))
            return x + self.second(jax.nn.relu(self.first(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.one = Block(rngs)
            self.two = Block(rngs)

        def __call__(self, x):
            return self.two(self.one(x))

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
    x = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, SEQ, D)))

    def step(state, x):
        value, grads = jax.value_and_grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), value

    found = by_path(roles(step, state, x))
    for block in ("one", "two"):
        assert found[f"{block}/attention/query/kernel"].role == "heads"
        assert found[f"{block}/attention/out/kernel"].axis == 0
        assert (
            found[f"{block}/first/kernel"].role == "column" and found[f"{block}/second/kernel"].role == "row"
        )
        assert found[f"{block}/first/bias"].role == "follows"
        assert found[f"{block}/norm/scale"].axis is None
    trains_like_one_device(step, state, x, tensor_parallel(step=step, params=state, batch=x))


def test_equinox_linear_attention_conv_and_a_vmapped_stack():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        first: eqx.nn.Linear
        second: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.attention = eqx.nn.MultiheadAttention(HEADS, D, key=keys[0])
            self.first = eqx.nn.Linear(D, FFN, key=keys[1])
            self.second = eqx.nn.Linear(FFN, D, key=keys[2])

        def __call__(self, x):
            x = x + self.attention(x, x, x)
            return x + jax.vmap(lambda v: self.second(jax.nn.relu(self.first(v))))(x)

    class Model(eqx.Module):
        patches: eqx.nn.Conv2d
        blocks: Block
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.patches = eqx.nn.Conv2d(3, D, 4, stride=4, key=keys[0])
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(keys[1], 2))  # a stacked layer axis
            self.head = eqx.nn.Linear(D, VOCAB, key=keys[2])

        def __call__(self, image):
            x = self.patches(image).reshape(D, -1).T
            arrays, static = eqx.partition(self.blocks, eqx.is_array)
            x, _ = jax.lax.scan(lambda x, layer: (eqx.combine(layer, static)(x), None), x, arrays)
            return self.head(x.mean(0))

    model = Model(jax.random.key(0))
    images = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, 3, 8, 8)))

    @eqx.filter_jit
    def step(model, images):
        value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(images) ** 2))(model)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), value

    found = by_path(roles(step, model, images))
    for name in ("query_proj", "key_proj", "value_proj"):
        assert found[f"blocks/attention/{name}/weight"].role == "heads"
        assert found[f"blocks/attention/{name}/weight"].axis == 1  # (layer, out, in)
    assert found["blocks/attention/output_proj/weight"].axis == 2
    assert found["blocks/first/weight"].role == "column" and found["blocks/first/weight"].axis == 1
    assert found["blocks/second/weight"].role == "row" and found["blocks/second/weight"].axis == 2
    assert found["blocks/first/weight"].axes[0] == "layer"
    assert found["patches/weight"].axes == ("out", "in", "window", "window")
    assert found["head/weight"].role == "vocabulary"
    table = tensor_parallel(step=step, params=model, batch=images)
    trains_like_one_device(step, model, images, table)


# --- bytes against the textbook -------------------------------------------------------------------------


def _megatron_layers(fused: bool, layers: int = 2, d: int = 96, heads: int = 48):
    """A stack of GPT layers on a float input (no embedding, no head): every byte is a layer's."""
    ffn, head = 2 * d, d // heads
    shapes = {"g1": (d,), "g2": (d,), "up": (d, ffn), "down": (ffn, d), "o": (d, d)}
    shapes.update({"qkv": (d, 3 * d)} if fused else {"q": (d, d), "k": (d, d), "v": (d, d)})
    params = {
        "layers": [
            {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()} for _ in range(layers)
        ]
    }

    def layer(x, p):
        b, s, _ = x.shape
        h = _norm(x, p["g1"])
        if fused:
            qkv = (h @ p["qkv"]).reshape(b, s, heads, 3, head)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, k, v = ((h @ p[n]).reshape(b, s, heads, head) for n in "qkv")
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d) @ p["o"]
        return x + jax.nn.gelu(_norm(x, p["g2"]) @ p["up"]) @ p["down"]

    def step(params, x):
        def loss(params):
            y = x
            for p in params["layers"]:
                y = layer(y, p)
            return jnp.mean(y**2)

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step, params


def _traffic(step, params, x, strategy):
    rules = einshard.Rules([(r"^x(/|$)", strategy.batch)]) + strategy
    return einshard.explain_step(step, params, x, rules=rules)


def test_megatron_bytes_equal_the_textbook():
    b, s, d, layers = 2, 8, 96, 2
    x = jax.ShapeDtypeStruct((b, s, d), jnp.float32)
    step, params = _megatron_layers(fused=True, layers=layers, d=d)
    table = tensor_parallel(step=step, params=params, batch=x)
    assert all(table.match(f"layers/0/{n}").expression != "... -> * ..." for n in ("qkv", "o", "up", "down"))
    report = _traffic(step, params, x, table)
    t = N
    textbook = layers * 8 * b * s * d * (t - 1) / t * 4  # elements per layer (Megatron SC21, 3.2), float32
    assert report.traffic == pytest.approx(textbook, rel=0.01)
    assert set(report.bytes_by_kind) == {"all-reduce"}
    # Unfused q, k and v: each column's input gradient is its own partial sum to reduce.
    unfused_step, unfused_params = _megatron_layers(fused=False, layers=layers, d=d)
    unfused = _traffic(
        unfused_step, unfused_params, x, tensor_parallel(step=unfused_step, params=unfused_params, batch=x)
    )
    assert unfused.traffic > report.traffic * 1.1
    assert len(unfused.rows) > len(report.rows)


def test_data_parallel_bytes_equal_the_textbook():
    b, s, d = 2 * N, 8, 96
    step, params = _megatron_layers(fused=True, layers=2, d=d)
    report = _traffic(
        step, params, jax.ShapeDtypeStruct((b, s, d), jnp.float32), einshard.strategies.data_parallel()
    )
    parameter_bytes = sum(math.prod(leaf.shape) * 4 for leaf in jax.tree.leaves(params))
    assert report.traffic == pytest.approx(2 * (N - 1) / N * parameter_bytes, rel=0.01)


def test_a_derived_table_serves_init_sharded_and_optax_state():
    optax = pytest.importorskip("optax")
    from einshard.integrations.optax import init_opt_state

    params = gpt_params(jax.random.key(0))
    table = tensor_parallel(step=gpt_step(), params=params, batch=tokens())
    born = einshard.init_sharded(lambda key: gpt_params(key), table, jax.random.key(0))
    placed = einshard.shard_pytree(params, table)
    for a, b in zip(jax.tree.leaves(born), jax.tree.leaves(placed), strict=True):
        assert a.sharding.devices_indices_map(a.shape) == b.sharding.devices_indices_map(b.shape)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)  # compiled vs eager: an ulp
    state = init_opt_state(optax.adam(1e-3), born)
    w1 = born["blocks"][0]["w1"]
    for moment in (state[0].mu, state[0].nu):
        got = moment["blocks"][0]["w1"]
        assert got.sharding.devices_indices_map(got.shape) == w1.sharding.devices_indices_map(w1.shape)
    # The same table shards the state by its paths too: the rules match the ends of paths.
    by_rules = einshard.shard_pytree(optax.adam(1e-3).init(params), table)
    got = by_rules[0].mu["blocks"][0]["w1"]
    assert got.sharding.devices_indices_map(got.shape) == w1.sharding.devices_indices_map(w1.shape)


def test_cond_while_and_a_layer_loop_with_a_traced_count_are_read_through():
    layers = 3
    key = jax.random.key(0)
    params = {
        "up": jax.random.normal(key, (layers, D, FFN)) * 0.1,
        "down": jax.random.normal(key, (layers, FFN, D)) * 0.1,
    }

    def loss(p, batch):
        x, count = batch

        def body(i, x):
            h = x @ p["up"][i]  # the layer index is traced: a dynamic slice of the stacked weights
            h = jax.lax.cond(jnp.sum(h) > 0, jax.nn.relu, jax.nn.gelu, h)
            return x + h @ p["down"][i]

        return jnp.mean(jax.lax.fori_loop(0, count[0], body, x) ** 2)  # a traced count: a while loop

    batch = (np.ones((BATCH, D), np.float32), np.array([layers], np.int32))
    found = by_path(roles(loss, params, batch))
    assert (found["up"].role, found["up"].axis, found["up"].axes[0]) == ("column", 2, "layer")
    assert (found["down"].role, found["down"].axis) == ("row", 1)
