"""Strategy tables: fsdp's per-leaf decisions against a hand computation on 8, 16 and 6 devices,
the placed layouts on this machine's devices, tensor parallel and hybrid tables, and Flax NNX,
optax and Equinox state following a strategy with no extra code."""

from __future__ import annotations

import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import einshard
from einshard.strategies import SplitLargest, Strategy

N = jax.device_count()
MIN_BYTES = 16 << 10
F32 = jnp.float32


def llama_tree() -> dict:
    """LLaMA-shaped (stacked layers), sized so that 8, 16 and 6 devices decide differently."""

    def f32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, F32)

    vocab, d, ffn, layers = 1000, 96, 320, 2
    return {
        "embed": {"embedding": f32(vocab, d)},
        "layers": {
            "attn": {f"{n}_proj": {"kernel": f32(layers, d, d)} for n in "qkvo"},
            "mlp": {
                "gate_proj": {"kernel": f32(layers, d, ffn)},
                "up_proj": {"kernel": f32(layers, d, ffn)},
                "down_proj": {"kernel": f32(layers, ffn, d)},
            },
            "attention_norm": {"scale": f32(layers, d)},
        },
        "norm": {"scale": f32(d)},
        "lm_head": {"kernel": f32(d, vocab)},
        "odd": {"table": f32(1001, 7)},  # 28 KiB, and no axis divides by 6, 8 or 16
        "half": {"small": jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)},  # 12 KiB in bf16: below
        "full": {"large": f32(64, 96)},  # the same shape in f32, 24 KiB: split
    }


# The hand computation: the block each device holds, and whether a note must say why.
HAND = {
    8: {
        "embed/embedding": (125, 96),
        "layers/attn/q_proj/kernel": (2, 12, 96),
        "layers/mlp/gate_proj/kernel": (2, 96, 40),
        "layers/mlp/down_proj/kernel": (2, 40, 96),
        "lm_head/kernel": (96, 125),
        "full/large": (64, 12),
    },
    16: {
        "embed/embedding": (1000, 6),  # 1000 does not divide by 16: the next largest, 96
        "layers/attn/q_proj/kernel": (2, 6, 96),
        "layers/mlp/gate_proj/kernel": (2, 96, 20),
        "layers/mlp/down_proj/kernel": (2, 20, 96),
        "lm_head/kernel": (6, 1000),
        "full/large": (64, 6),
    },
    6: {
        "embed/embedding": (1000, 16),
        "layers/attn/q_proj/kernel": (2, 16, 96),
        "layers/mlp/gate_proj/kernel": (2, 16, 320),  # 320 does not divide by 6: axis 1
        "layers/mlp/down_proj/kernel": (2, 320, 16),
        "lm_head/kernel": (16, 1000),
        "full/large": (64, 16),
    },
}
# Leaves whose largest axis does not divide, split on the next largest (the note says so).
NEXT_LARGEST = {
    8: set(),
    16: {"embed/embedding", "lm_head/kernel"},
    6: {"embed/embedding", "lm_head/kernel", "layers/mlp/gate_proj/kernel", "layers/mlp/up_proj/kernel"}
    | {"layers/mlp/down_proj/kernel"},
}
REPLICATED_SMALL = {"layers/attention_norm/scale", "norm/scale", "half/small"}


@pytest.mark.parametrize("n", [8, 16, 6])
def test_fsdp_explain_agrees_with_the_hand_computation(n):
    report = einshard.explain(llama_tree(), einshard.strategies.fsdp(min_bytes=MIN_BYTES), n_devices=n)
    rows = {row.path: row for row in report.rows}
    for path, block in HAND[n].items():
        assert rows[path].shard_shape == block, path
    assert rows["layers/mlp/up_proj/kernel"].shard_shape == rows["layers/mlp/gate_proj/kernel"].shard_shape
    for path in REPLICATED_SMALL:
        assert rows[path].shard_shape == rows[path].shape
        assert "min_bytes" in rows[path].note
    assert rows["odd/table"].shard_shape == (1001, 7)
    assert rows["odd/table"].note == f"no axis of (1001, 7) divides by {n}: replicated"
    for path, row in rows.items():
        if path in NEXT_LARGEST[n]:
            assert "does not divide" in row.note and "split" in row.note, path
        elif path not in REPLICATED_SMALL and path != "odd/table":
            assert row.note is None, (path, row.note)
            assert math.prod(row.shape) == math.prod(row.shard_shape) * n  # split over all devices
    # The reasons are in the printed report too.
    text = str(report)
    assert "no axis of (1001, 7) divides" in text and "< min_bytes 16.0 KiB: replicated" in text


def test_fsdp_places_the_layouts_explain_predicts():
    tree = jax.tree.map(
        lambda s: jnp.arange(math.prod(s.shape), dtype=s.dtype).reshape(s.shape), llama_tree()
    )
    strategy = einshard.strategies.fsdp(min_bytes=MIN_BYTES)
    placed = einshard.shard_pytree(tree, strategy)
    report = einshard.explain(tree, strategy)
    flat = dict(zip([row.path for row in report.rows], jax.tree.leaves(placed), strict=True))
    for row in report.rows:
        array = flat[row.path]
        indices = array.sharding.devices_indices_map(array.shape)
        ranges = [
            tuple(range(*s.indices(n))[::1] for s, n in zip(i, array.shape, strict=True))
            for i in indices.values()
        ]
        assert {tuple(len(r) for r in block) for block in ranges} == {row.shard_shape}, row.path
        distinct = {tuple((r.start, r.stop) for r in block) for block in ranges}
        assert len(distinct) == math.prod(row.shape) // math.prod(row.shard_shape), row.path
    for original, sharded in zip(jax.tree.leaves(tree), jax.tree.leaves(placed), strict=True):
        np.testing.assert_array_equal(np.asarray(sharded), np.asarray(original))


def test_split_largest_prefers_a_given_axis_and_checks_its_arguments():
    assert SplitLargest(min_bytes=0, axis=0).expression_for((8, 64), "float32", 8) == ("a b -> a8 b", None)
    assert SplitLargest(min_bytes=0, axis=-1).expression_for((64, 12), "float32", 8) == (
        "a b -> a8 b",
        "axis 1 (12) does not divide by 8: axis 0 split",
    )
    assert SplitLargest(min_bytes=0, parts=2).expression_for((8, 64), "float32", 8) == ("a b -> a b2 4", None)
    for bad in ({"min_bytes": -1}, {"axis": "first"}, {"parts": 0}):
        with pytest.raises(einshard.EinshardError):
            SplitLargest(**bad)


def test_strategies_are_rules_that_keep_their_batch_when_extended():
    strategy = einshard.strategies.fsdp(min_bytes=MIN_BYTES)
    assert isinstance(strategy, einshard.Rules)
    mine = [(r"embed/embedding$", "v d -> v* d")]
    extended = mine + strategy
    assert isinstance(extended, Strategy) and extended.batch == strategy.batch
    assert extended.pairs()[0] == mine[0] and extended.pairs()[1:] == strategy.pairs()
    rows = {r.path: r for r in einshard.explain(llama_tree(), extended, n_devices=8).rows}
    assert rows["embed/embedding"].shard_shape == (125, 96) and rows["embed/embedding"].rule == mine[0][0]
    again = pickle.loads(pickle.dumps(extended))
    assert again == extended and again.batch == extended.batch
    assert "SplitLargest(min_bytes=16384)" in repr(strategy)
    assert strategy.replace(strict=True).name == "fsdp"


@pytest.mark.parametrize("n", [8, 16, 6])
def test_tensor_parallel_and_hybrid_split_the_megatron_pairs(n):
    tree = llama_tree()
    rows = {
        r.path: r for r in einshard.explain(tree, einshard.strategies.tensor_parallel(), n_devices=8).rows
    }
    assert rows["layers/attn/q_proj/kernel"].shard_shape == (2, 96, 12)  # column: the output axis
    assert rows["layers/attn/o_proj/kernel"].shard_shape == (2, 12, 96)  # row: the input axis
    assert rows["layers/mlp/down_proj/kernel"].shard_shape == (2, 40, 96)
    assert rows["embed/embedding"].shard_shape == (1000, 96)
    hybrid = einshard.strategies.hybrid(model=2, min_bytes=MIN_BYTES)
    if n % 2 or 96 % (n // 2):
        with pytest.raises(einshard.EinshardError):
            einshard.explain(tree, hybrid, n_devices=n)
        return
    rows = {r.path: r for r in einshard.explain(tree, hybrid, n_devices=n).rows}
    assert rows["layers/mlp/up_proj/kernel"].shard_shape == (2, 96 // (n // 2), 160)
    assert rows["layers/mlp/down_proj/kernel"].shard_shape == (2, 160, 96 // (n // 2))
    assert hybrid.batch == "b ... -> b* ... 2"


def test_equinox_weights_are_read_out_by_in():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(16, 64, key=jax.random.key(0))
    tree = {"up": {"weight": model.weight, "bias": model.bias}}
    rows = {
        r.path: r for r in einshard.explain(tree, einshard.strategies.tensor_parallel(), n_devices=8).rows
    }
    assert rows["up/weight"].shard_shape == (8, 16) and rows["up/bias"].shard_shape == (8,)


def test_flax_nnx_optax_and_equinox_state_follow_a_strategy():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    eqx = pytest.importorskip("equinox")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 8 * N, rngs=rngs)
            self.down = nnx.Linear(8 * N, 16, rngs=rngs)

    _, state = nnx.split(MLP(nnx.Rngs(0)))
    tree = (state, optax.adam(1e-2).init(state))
    strategy = einshard.strategies.fsdp(min_bytes=0)
    placed = by_path(einshard.shard_pytree(tree, strategy), strategy)
    for path in ("0/up/kernel", "1/0/mu/up/kernel", "1/0/nu/up/kernel"):
        assert placed[path].sharding.shard_shape(placed[path].shape) == (16, 8), path
    np.testing.assert_array_equal(
        np.asarray(placed["0/up/kernel"]), np.asarray(by_path(tree, strategy)["0/up/kernel"])
    )
    model = eqx.nn.MLP(16, 16, 8 * N, 1, key=jax.random.key(0))
    placed = by_path(einshard.shard_pytree(model, strategy), strategy)
    assert placed["layers/0/weight"].sharding.shard_shape((8 * N, 16)) == (8, 16)


def by_path(tree, rules) -> dict:
    """The array leaves of a tree by their einshard paths."""
    paths = [row.path for row in einshard.explain(tree, rules).rows]
    leaves = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    return dict(zip(paths, leaves, strict=True))


# --- fsdp's choice against a reference, over random shapes and device counts ----------------------

DTYPES = {"float32": 4, "bfloat16": 2, "int8": 1}


@st.composite
def fsdp_trees(draw):
    """A device count, ``min_bytes``, an ``axis`` preference, and a tree of leaves whose axes
    often divide by the count, often tie in length, and straddle ``min_bytes``."""
    n = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 64, 256]))
    lengths = st.sampled_from(sorted({1, 5, 7, 12, 96, n, 2 * n, 3 * n, 2 * n + 1, max(n - 1, 1)}))
    tree = {}
    for i in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(lengths, max_size=4)))
        tree[f"leaf{i}"] = jax.ShapeDtypeStruct(shape, draw(st.sampled_from(list(DTYPES))))
    sizes = [math.prod(leaf.shape) * DTYPES[str(leaf.dtype)] for leaf in tree.values()]
    # A leaf's own size (not below it) and one byte more (below it by one).
    min_bytes = draw(st.sampled_from([0, 1, 256, 4096, *sizes, *(size + 1 for size in sizes)]))
    axis = draw(st.sampled_from(["largest", "largest", 0, 1, -1]))
    return n, min_bytes, axis, tree


def reference_fsdp(shape: tuple[int, ...], itemsize: int, n: int, min_bytes: int, axis) -> tuple[int, ...]:
    """The block each device holds: the largest axis that ``n`` divides is split ``n`` ways (ties:
    the first; ``axis``, if it names one, is tried before the others); leaves under ``min_bytes``,
    scalars, and leaves no axis of which divides stay whole."""
    if n == 1 or not shape or math.prod(shape) * itemsize < min_bytes:
        return shape
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    if axis != "largest" and -len(shape) <= axis < len(shape):
        first = axis % len(shape)
        order = [first] + [i for i in order if i != first]
    for i in order:
        if shape[i] % n == 0:
            return (*shape[:i], shape[i] // n, *shape[i + 1 :])
    return shape


@given(fsdp_trees())
def test_fsdp_splits_the_largest_axis_that_divides_like_the_reference(drawn):
    n, min_bytes, axis, tree = drawn
    report = einshard.explain(tree, einshard.strategies.fsdp(min_bytes=min_bytes, axis=axis), n_devices=n)
    assert [row.path for row in report.rows] == list(tree)
    for row in report.rows:
        leaf = tree[row.path]
        size = DTYPES[str(leaf.dtype)]
        expected = reference_fsdp(leaf.shape, size, n, min_bytes, axis)
        assert row.shard_shape == expected, (row.path, leaf.shape, leaf.dtype, row.expression, row.note)
        assert row.bytes == math.prod(leaf.shape) * size
        assert row.bytes_per_device == math.prod(expected) * size
        small = bool(leaf.shape) and n > 1 and row.bytes < min_bytes
        assert ("min_bytes" in (row.note or "")) == small, row.note
    assert report.max_bytes_per_device == sum(row.bytes_per_device for row in report.rows)


def test_the_name_based_tables_keep_their_signatures_and_every_strategy_says_its_model_axis():
    tree = {
        "up": {"kernel": jax.ShapeDtypeStruct((16, 64), F32)},
        "down": {"kernel": jax.ShapeDtypeStruct((64, 16), F32)},
    }
    positional = einshard.strategies.tensor_parallel(["up"], ["down"])
    assert positional == einshard.strategies.tensor_parallel(column=["up"], row=["down"])
    rows = {r.path: r.shard_shape for r in einshard.explain(tree, positional, n_devices=8).rows}
    assert rows == {"up/kernel": (16, 8), "down/kernel": (8, 16)}
    assert einshard.strategies.data_parallel().model is None and einshard.strategies.fsdp().model is None
    assert positional.model == 0  # by names: all devices, whatever their count
    assert (
        einshard.strategies.hybrid(4).model == 4
        and (einshard.Rules([("x", "x -> x")]) + einshard.strategies.hybrid(4)).model == 4
    )
    with pytest.raises(einshard.EinshardError, match="model must be"):
        Strategy([], batch="... -> * ...", name="x", model=-1)


def test_rules_keep_their_notes():
    rules = einshard.Rules([("w1$", "x y -> x y*", "column: feeds w2"), ("w2$", "y z -> y* z")])
    assert [rule.note for rule in rules] == ["column: feeds w2", None]
    assert "# column: feeds w2" in repr(rules)
    assert rules == einshard.Rules([("w1$", "x y -> x y*"), ("w2$", "y z -> y* z")])  # notes are commentary
    combined = einshard.Rules([("b$", "x -> x*")]) + rules
    assert [rule.note for rule in combined] == [None, "column: feeds w2", None]
    assert pickle.loads(pickle.dumps(rules))[0].note == "column: feeds w2"
    with pytest.raises(einshard.EinshardError, match="not a \\(regex, expression\\) pair"):
        einshard.Rules([("w1$", "x y -> x y*", 3)])


def test_defaults_read_the_step_once_for_every_derived_table(monkeypatch):
    from einshard._planning.tables import _roles

    calls = []
    read = _roles.read
    monkeypatch.setattr(_roles, "read", lambda *a: calls.append(1) or read(*a))

    def step(params, x):
        return jnp.mean((jax.nn.relu(x @ params["a"]) @ params["b"]) ** 2)

    params = {"a": jax.ShapeDtypeStruct((16, 48), F32), "b": jax.ShapeDtypeStruct((48, 16), F32)}
    candidates = einshard.strategies.defaults(
        N, step=step, params=params, batch=jax.ShapeDtypeStruct((4, 16), F32)
    )
    assert len(calls) == 1
    names = [c.name for c in candidates]
    assert names[:3] == ["data parallel", "fsdp", "tensor parallel"]
    derived = candidates[2]
    assert derived.match("a").expression == "i o -> i o*" and "column" in derived.match("a").note
    assert derived.match("b").expression == "i o -> i* o" and "row" in derived.match("b").note


def test_every_strategy_constructor_takes_the_step_by_keyword_and_the_positional_form_warns():
    """One way: step=, params=, batch= are keyword-only in tensor_parallel, hybrid and defaults.
    The earlier tensor_parallel(step, params, batch) still works, with a deprecation warning."""
    import inspect

    for constructor in (
        einshard.strategies.tensor_parallel,
        einshard.strategies.hybrid,
        einshard.strategies.defaults,
    ):
        parameters = inspect.signature(constructor).parameters
        for name in ("step", "params", "batch"):
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, (constructor, name)

    def step(params, x):
        return jax.numpy.mean((jax.nn.relu(x @ params["w1"]) @ params["w2"]) ** 2)

    params = {"w1": jax.ShapeDtypeStruct((16, 64), F32), "w2": jax.ShapeDtypeStruct((64, 16), F32)}
    batch = jax.ShapeDtypeStruct((8, 16), F32)
    keyword = einshard.strategies.tensor_parallel(step=step, params=params, batch=batch, n_devices=8)
    with pytest.warns(einshard.EinshardDeprecationWarning, match="takes the step by keyword now"):
        positional = einshard.strategies.tensor_parallel(step, params, batch, n_devices=8)
    assert positional == keyword and positional.name == keyword.name
    with (
        pytest.warns(einshard.EinshardDeprecationWarning),
        pytest.raises(einshard.EinshardError, match="got params both by position and by keyword"),
    ):
        einshard.strategies.tensor_parallel(step, params, params=params, batch=batch)
    # The name-based table's column and row stay positional.
    by_names = einshard.strategies.tensor_parallel(["w1"], ["w2"])
    assert by_names == einshard.strategies.tensor_parallel(column=["w1"], row=["w2"])
