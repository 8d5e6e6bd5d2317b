"""Fuzzing: every user input ends in the right result or a catalogued ``EinshardError``.

Each property has an oracle that does not come from einshard: layouts from the
einshard 0.2.0 reference (``reference_v020.py``), rule matches from a
``re.search`` loop over the table, errors from the catalogue (``docs/errors.md``,
as ``test_error_catalogue.py`` reads it). The examples per property come from
the Hypothesis profile: the default one in the test suite, many more in
``nox -s fuzz`` (``HYPOTHESIS_PROFILE=fuzz``).
"""

import re
import warnings

import jax
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from oracles import assert_catalogued
from reference_v020 import blocks_v020, expected_blocks, index_blocks

import einshard
from conftest import N_DEVICES
from einshard import EinshardError, EinshardWarning
from einshard._language._layout import compile_layout

GRAMMAR = "xyzab_模 .*->0123456789\t"
REGEX_ALPHABET = "abw/0123456789.*+?()[]{}|^$\\-"

relaxed = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REPLICATE = "... -> * ..."


def expressions_or_junk():
    return st.one_of(
        st.text(alphabet=GRAMMAR, max_size=30),
        st.text(max_size=30),
        st.sampled_from(["x y -> x y*", "... -> * ...", "a b -> 2 a2* b*", " -> *", "x -> x12*"]),
    )


@relaxed
@given(
    text=expressions_or_junk(),
    n_devices=st.integers(-2, 300),
    n_dims=st.one_of(st.none(), st.integers(-1, 6)),
)
@example(text="a b c -> a* b* c*", n_devices=64, n_dims=None)
@example(text="a b -> * a2 b", n_devices=16, n_dims=2)
def test_layouts(text, n_devices, n_dims):
    try:
        layout = compile_layout(text, n_dims, n_devices)
    except EinshardError as error:
        assert_catalogued(error)
        return
    assert layout.n_devices == n_devices
    shards, blocks = blocks_v020(text, layout.n_dims, n_devices)
    assert layout.shards == shards
    assert {position: layout.block_index(position) for position in range(n_devices)} == blocks
    shape = tuple(2 * count for count in shards)
    starts = {
        p: tuple(s.indices(2 * n)[0] // 2 for s, n in zip(index, shards, strict=True))
        for p, index in layout.indices(shape).items()
    }
    assert starts == blocks


@relaxed
@given(
    text=expressions_or_junk(),
    shape=st.one_of(
        st.lists(st.integers(-1, 3 * N_DEVICES), max_size=4),
        st.lists(st.sampled_from([1.5, "2", None]), min_size=1, max_size=2),
    ),
)
@example(text="x y -> x y*", shape=[4, N_DEVICES + 1])  # does not divide: an error
@example(text="x y -> x* y", shape=[2 * N_DEVICES, 3])
@example(text="a b -> * a2 b", shape=[4, 6])
def test_make_sharding(text, shape):
    try:
        sharding = einshard.make_sharding(text, shape=shape)
    except EinshardError as error:
        assert_catalogued(error)
        return
    shape = tuple(int(size) for size in shape)
    shards, _ = blocks_v020(text, len(shape), N_DEVICES)
    assert all(size % count == 0 for size, count in zip(shape, shards, strict=True)), (text, shape)
    if all(shape):
        assert index_blocks(sharding, shape, shards) == expected_blocks(text, shape, jax.devices())


def _is_bad_rule(regex, expression):
    """Whether a rule cannot be built: its regex does not compile or its expression does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            re.compile(regex)
    except re.error:
        return True
    try:
        einshard.parse(expression)
    except EinshardError:
        return True
    return False


PATH_ALPHABET = "abw/019"


@relaxed
@given(
    table=st.lists(
        st.tuples(st.text(alphabet=REGEX_ALPHABET, max_size=12), expressions_or_junk()),
        max_size=4,
    ),
    paths=st.lists(st.text(alphabet=PATH_ALPHABET, max_size=12), max_size=6),
)
@example(table=[("w", "x -> x*"), ("b", "x -> x"), ("/", "... -> * ...")], paths=["a/b/w", "b/a", "w0/1"])
@example(table=[(r"\d", "x -> x*"), ("a", "x -> x")], paths=["a/1", "a/0", "b/9", "a"])
def test_rule_tables(table, paths):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EinshardWarning)  # doubtful regexes are warned about
            rules = einshard.Rules(table)
    except EinshardError as error:
        assert "rule" in str(error)
        assert_catalogued(error)
        assert any(_is_bad_rule(regex, expression) for regex, expression in table)
        return
    assert rules.pairs() == tuple(table)
    # Each path and the same path twice (the second answer comes from the table's memo).
    for path in [*paths, *paths]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            matching = [i for i, (regex, _) in enumerate(table) if re.search(regex, path)]
        rule = rules.match(path)
        assert (None if rule is None else rule.index) == (matching[0] if matching else None), path
        assert [r.index for r in rules.matches(path)] == matching, path


@st.composite
def trees(draw):
    def leaf():
        shape = tuple(draw(st.lists(st.integers(1, 2 * N_DEVICES), max_size=3)))
        return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)

    keys = st.sampled_from(["w", "b", "kernel", "scale", "emb", "0"])
    return draw(
        st.recursive(
            st.one_of(st.builds(leaf), st.none(), st.integers(), st.text(max_size=3)),
            lambda children: st.one_of(
                st.lists(children, max_size=3), st.dictionaries(keys, children, max_size=3)
            ),
            max_leaves=8,
        )
    )


def _path(keys):
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def expected_expression(path, shape, table, unmatched, indivisible):
    """The expression a leaf must get, or None for an error: first match by re.search, policies."""
    if not shape:
        return REPLICATE  # scalars are replicated whatever the rules say
    matching = [expression for regex, expression in table if re.search(regex, path)]
    if not matching:
        return REPLICATE if unmatched == "replicate" else None
    for expression in matching if indivisible == "next" else matching[:1]:
        parsed = einshard.parse(expression)
        ellipsis = any(e.is_ellipsis for e in parsed.left)
        names = len(parsed.left) - ellipsis
        if names > len(shape) or (names < len(shape) and not ellipsis):
            return None  # a rule of another rank is an error, not a miss
        shards, _ = blocks_v020(expression, len(shape), N_DEVICES)
        if all(size % count == 0 for size, count in zip(shape, shards, strict=True)):
            return expression
        if indivisible == "replicate":
            return REPLICATE
        if indivisible == "error":
            return None
    return None


@relaxed
@given(
    tree=trees(),
    table=st.lists(
        st.tuples(
            st.sampled_from(["w", "b$", "kernel", "0", ".*", "emb|scale"]),
            st.sampled_from(["a -> a*", "a b -> a b*", "a b -> a* b", "... -> * ...", "a b c -> a b c*"]),
        ),
        max_size=4,
    ),
    unmatched=st.sampled_from(["error", "replicate"]),
    indivisible=st.sampled_from(["error", "replicate", "next"]),
)
@example(  # the first rule does not divide 3 rows: an error, the replicated fallback, or the next rule
    tree={"w": np.ones((3, 2 * N_DEVICES), np.float32)},
    table=[("w", "a b -> a* b"), ("w", "a b -> a b*")],
    unmatched="error",
    indivisible="next",
)
@example(
    tree={"w": np.ones((3, 2 * N_DEVICES), np.float32)},
    table=[("w", "a b -> a* b"), ("w", "a b -> a b*")],
    unmatched="error",
    indivisible="error",
)
@example(
    tree={"w": np.ones((3, 2 * N_DEVICES), np.float32)},
    table=[("w", "a b -> a* b"), ("w", "a b -> a b*")],
    unmatched="error",
    indivisible="replicate",
)
@example(
    tree={"kernel": np.ones((2 * N_DEVICES, 4), np.float32), "b": [np.ones(N_DEVICES, np.float32), 3]},
    table=[("kernel", "a b -> a* b"), ("b", "a -> a*"), ("ker", "a b -> a b*")],
    unmatched="error",
    indivisible="error",
)
def test_shard_pytree_fails_cleanly_and_leaves_the_input_alone(tree, table, unmatched, indivisible):
    leaves_before = jax.tree_util.tree_leaves(tree)
    copies = [leaf.copy() if isinstance(leaf, np.ndarray) else leaf for leaf in leaves_before]
    expected = [
        (_path(keys), leaf, expected_expression(_path(keys), leaf.shape, table, unmatched, indivisible))
        for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, np.ndarray)
    ]
    rules = einshard.Rules(table, unmatched=unmatched, indivisible=indivisible)
    try:
        out = einshard.shard_pytree(tree, rules)
    except EinshardError as error:
        assert_catalogued(error)
        assert any(expression is None for _, _, expression in expected), str(error)
    else:
        assert all(expression is not None for _, _, expression in expected)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
        for before, after in zip(leaves_before, jax.tree_util.tree_leaves(out), strict=True):
            if isinstance(before, np.ndarray):
                np.testing.assert_array_equal(np.asarray(after), before)
            else:
                assert after is before
        # Every array is laid out as its expected rule says, device by device.
        placed = dict(
            (_path(keys), leaf)
            for keys, leaf in jax.tree_util.tree_flatten_with_path(out)[0]
            if isinstance(leaf, jax.Array)
        )
        assert sorted(placed) == sorted(path for path, _, _ in expected)
        report = {row.path: row for row in einshard.explain(tree, rules).rows}
        for path, leaf, expression in expected:
            shards, _ = blocks_v020(expression, leaf.ndim, N_DEVICES)
            got = index_blocks(placed[path].sharding, leaf.shape, shards)
            assert got == expected_blocks(expression, leaf.shape, jax.devices()), (path, expression)
            # explain's bytes are what each device holds.
            assert report[path].bytes == leaf.nbytes
            assert {report[path].bytes_per_device} == {s.data.nbytes for s in placed[path].addressable_shards}
    # Placing never touches the input tree, whether it succeeded or not.
    after_call = jax.tree_util.tree_leaves(tree)
    assert len(after_call) == len(copies)
    for leaf, copy in zip(after_call, copies, strict=True):
        if isinstance(copy, np.ndarray):
            np.testing.assert_array_equal(leaf, copy)
        else:
            assert leaf == copy


def test_a_failure_half_way_through_a_tree_places_nothing():
    tree = {"a": np.ones((2 * N_DEVICES, 3), np.float32), "b": np.ones((3, 5), np.float32)}
    try:
        einshard.shard_pytree(tree, [(".*", "x y -> x* y")])
    except EinshardError as error:
        assert "while sharding 'b'" in str(error)
    else:
        raise AssertionError("b does not divide: expected an EinshardError")
    assert isinstance(tree["a"], np.ndarray) and isinstance(tree["b"], np.ndarray)
    # The same tree still works with a table that fits.
    out = einshard.shard_pytree(tree, [("a", "x y -> x* y"), (".*", "... -> * ...")])
    shards = (N_DEVICES, 1)
    assert index_blocks(out["a"].sharding, (2 * N_DEVICES, 3), shards) == expected_blocks(
        "x y -> x* y", (2 * N_DEVICES, 3), jax.devices()
    )
    for shard in out["a"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), tree["a"][shard.index])
