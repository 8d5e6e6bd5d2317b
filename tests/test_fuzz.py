"""Fuzzing: no user input ends in anything but a result or an ``EinshardError``.

The examples per property come from the Hypothesis profile: the default one
in the test suite, many more in ``nox -s fuzz`` (``HYPOTHESIS_PROFILE=fuzz``).
"""

import warnings

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einshard
from conftest import N_DEVICES
from einshard import EinshardError, EinshardWarning
from einshard._layout import compile_layout

GRAMMAR = "xyzab_模 .*->0123456789\t"
REGEX_ALPHABET = "abw/0123456789.*+?()[]{}|^$\\-"

relaxed = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


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
def test_layouts(text, n_devices, n_dims):
    try:
        layout = compile_layout(text, n_dims, n_devices)
    except EinshardError as error:
        assert str(error)
        return
    assert layout.n_devices == n_devices


@relaxed
@given(
    text=expressions_or_junk(),
    shape=st.one_of(
        st.lists(st.integers(-1, 3 * N_DEVICES), max_size=4),
        st.lists(st.sampled_from([1.5, "2", None]), min_size=1, max_size=2),
    ),
)
def test_make_sharding(text, shape):
    try:
        einshard.make_sharding(text, shape=shape)
    except EinshardError as error:
        assert str(error)


@relaxed
@given(
    table=st.lists(
        st.tuples(st.text(alphabet=REGEX_ALPHABET, max_size=12), expressions_or_junk()),
        max_size=4,
    )
)
def test_rule_tables(table):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EinshardWarning)  # doubtful regexes are warned about
            rules = einshard.Rules(table)
    except EinshardError as error:
        assert "rule" in str(error)
        return
    assert rules.pairs() == tuple(table)


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
def test_shard_pytree_fails_cleanly_and_leaves_the_input_alone(tree, table, unmatched, indivisible):
    leaves_before = jax.tree_util.tree_leaves(tree)
    copies = [leaf.copy() if isinstance(leaf, np.ndarray) else leaf for leaf in leaves_before]
    try:
        out = einshard.shard_pytree(tree, einshard.Rules(table, unmatched=unmatched, indivisible=indivisible))
    except EinshardError as error:
        assert str(error)
    else:
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
        for before, after in zip(leaves_before, jax.tree_util.tree_leaves(out), strict=True):
            if isinstance(before, np.ndarray):
                np.testing.assert_array_equal(np.asarray(after), before)
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
    assert out["a"].sharding.shard_shape(out["a"].shape) == (2, 3)
