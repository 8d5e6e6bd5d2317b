"""Rule tables over pytrees: paths, precedence, policies, born-sharded init and explain."""

import dataclasses
import functools
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_v020 import blocks_v020, expected_blocks, index_blocks

import einshard
from conftest import N_DEVICES
from einshard import EinshardError, EinshardWarning, Rules

REPLICATE = "... -> * ..."


def index_map(sharding, shape):
    return {
        device.id: tuple(s.indices(size)[:2] for s, size in zip(slices, shape, strict=True))
        for device, slices in sharding.devices_indices_map(tuple(shape)).items()
    }


def same_layout(array, expression):
    expected = einshard.make_sharding(expression, shape=array.shape)
    return index_map(array.sharding, array.shape) == index_map(expected, array.shape)


class Block(NamedTuple):
    kernel: jax.Array
    bias: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    attn: Block
    scale: jax.Array
    activation: str = dataclasses.field(default="relu", metadata={"static": True})


def paths_of(tree):
    assignment, _ = einshard._trees._assign.assign_rules(tree, [(".*", REPLICATE)], n_devices=N_DEVICES)
    return [leaf.path for _, leaf in assignment.leaves if leaf is not None]


class TestPaths:
    def test_dicts_lists_tuples(self):
        tree = {"layers": [{"w": np.zeros(2)}, ({"w": np.zeros(2)}, np.zeros(2))], "head": np.zeros(2)}
        assert paths_of(tree) == ["head", "layers/0/w", "layers/1/0/w", "layers/1/1"]

    def test_namedtuples_and_dataclasses(self):
        layer = Layer(attn=Block(kernel=np.zeros((2, 2)), bias=np.zeros(2)), scale=np.zeros(2))
        assert paths_of({"layers": [layer]}) == [
            "layers/0/attn/kernel",
            "layers/0/attn/bias",
            "layers/0/scale",
        ]

    def test_none_and_non_array_leaves_pass_through(self):
        tree = {"w": np.ones((2, N_DEVICES)), "none": None, "n": 3, "s": "text", "f": len, "x": 1.5}
        out = einshard.shard_pytree(tree, [("w", "a b -> a b*")])
        assert out["none"] is None and out["n"] == 3 and out["s"] == "text" and out["f"] is len
        assert out["x"] == 1.5 and isinstance(out["x"], float)
        assert same_layout(out["w"], "a b -> a b*")


class TestRulesTable:
    def test_first_match_wins(self):
        tree = {"mlp": {"w1": np.ones((4, 2 * N_DEVICES)), "w2": np.ones((2 * N_DEVICES, 4))}}
        rules = [(r"w1$", "x y -> x y*"), (r"mlp/w", "y z -> y* z"), (r".*", REPLICATE)]
        out = einshard.shard_pytree(tree, rules)
        assert same_layout(out["mlp"]["w1"], "x y -> x y*")
        assert same_layout(out["mlp"]["w2"], "y z -> y* z")

    def test_search_not_match(self):
        rules = Rules([("kernel", "a b -> a b*")])
        assert rules.match("layers/0/kernel") is not None
        assert rules.match("kern") is None

    def test_built_from_list_dict_and_rules_alike(self):
        pairs = [("a$", "x -> x*"), ("b$", REPLICATE)]
        assert Rules(pairs) == Rules(dict(pairs)) == Rules(Rules(pairs))
        assert Rules(pairs).pairs() == tuple(pairs)

    def test_combine(self):
        specific = Rules([("w1$", "x y -> x y*")])
        general = [(".*", REPLICATE)]
        combined = specific + general
        assert combined.pairs() == (("w1$", "x y -> x y*"), (".*", REPLICATE))
        assert (general + specific).pairs()[0] == (".*", REPLICATE)

    def test_policies_travel_with_the_table(self):
        rules = Rules([("a", "x -> x*")], unmatched="replicate", indivisible="next", strict=True)
        again = Rules(rules) + Rules([("b", REPLICATE)])
        assert (again.unmatched, again.indivisible, again.strict) == ("replicate", "next", True)

    def test_bad_regex_caret(self):
        with pytest.raises(EinshardError) as info:
            Rules([("ok", REPLICATE), ("mlp/(w1", "x y -> x y*")])
        lines = str(info.value).split("\n")
        assert lines[0] == "the regex of rule 1 does not compile: missing ), unterminated subpattern"
        assert lines[1:3] == ["    'mlp/(w1'", "         ^"]
        assert lines[-1] == "  in rule 1 ('mlp/(w1', 'x y -> x y*')"

    def test_bad_expression_names_the_rule(self):
        with pytest.raises(EinshardError) as info:
            Rules([("w1/kernel$", "x y -> x z*")])
        assert str(info.value).split("\n") == [
            "axis 'z' is on the right-hand side but not on the left",
            "    'x y -> x z*'",
            "              ^^",
            "The left-hand side names the array's axes: x, y.",
            "  in rule 0 ('w1/kernel$', 'x y -> x z*')",
        ]

    @pytest.mark.parametrize("bad", ["x -> x*", [("a",)], [("a", 3)], 5])
    def test_bad_tables(self, bad):
        with pytest.raises(EinshardError, match="rule"):
            Rules(bad)

    def test_bad_policy(self):
        with pytest.raises(EinshardError, match="unmatched='skip' is not a policy"):
            Rules([], unmatched="skip")  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("policy", "allowed"),
        [
            ({"unmatched": ""}, "Use unmatched='error' or 'replicate'."),
            ({"indivisible": "pad"}, "Use indivisible='error', 'replicate' or 'next'."),
            ({"strict": "no"}, "Use strict=True or strict=False."),
            ({"strict": 1}, "Use strict=True or strict=False."),
        ],
    )
    def test_bad_policy_values_name_the_allowed_ones(self, policy, allowed):
        # An empty string is a value too, not "the default": it was silently taken as one.
        for make in (lambda: Rules([], **policy), lambda: Rules([]).replace(**policy)):
            with pytest.raises(EinshardError) as info:
                make()
            assert str(info.value).split("\n")[1] == allowed

    def test_replace_makes_a_variant_and_keeps_the_rest(self):
        rules = Rules([("w", "x y -> x y*")], indivisible="next", strict=True)
        variant = rules.replace(unmatched="replicate")
        assert (variant.unmatched, variant.indivisible, variant.strict) == ("replicate", "next", True)
        assert (rules.unmatched, rules.indivisible, rules.strict) == ("error", "next", True)
        assert variant.pairs() == rules.pairs() and variant != rules

    def test_functions_take_no_policies(self):
        for function in (einshard.shard_pytree, einshard.pytree_shardings):
            with pytest.raises(TypeError):
                function({"w": np.ones(4)}, [("w", "a -> a*")], unmatched="replicate")


def assert_first_match(rules, patterns, path):
    """The table's answer is the first re.search match, from its memo and from a search."""
    expected = next((i for i, p in enumerate(patterns) if re.search(p, path)), None)
    for _ in range(2):  # searched, then from the memo
        found = rules.match(path)
        assert (found.index if found else None) == expected
    assert rules._table.search(path) == (-1 if expected is None else expected)


PATTERNS = ["a", "b$", "^a", "a/b", "(a|c)/", ".*", "x", "b/\\d+", "c$", "^$", "a.*c", "[bc]+$"]


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=6),
    path=st.text(alphabet="abcx/0123", max_size=8),
)
def test_a_table_decides_as_the_first_search(patterns, path):
    """A table gives the rule a loop of re.search would."""
    rules = Rules([(p, REPLICATE) for p in patterns])
    assert_first_match(rules, patterns, path)
    assert [r.index for r in rules.matches(path)] == [i for i, p in enumerate(patterns) if re.search(p, path)]


class TestUnusedAndUnmatched:
    """*Unused*: decided no leaf (the assignment says); *unmatched*: matches no path (the table says)."""

    def test_unmatched_rules_match_no_path_and_the_catch_all_matches_all(self):
        rules = Rules([("w$", "x -> x*"), ("typo$", "x -> x*"), ("layers/1/w", "x -> x*"), (".*", REPLICATE)])
        paths = ["layers/0/w", "layers/2/w", "layers/0/b"]
        # A table naming a digit is not digit-blind: 'layers/1/w' is looked for as written.
        assert [rule.pattern for rule in rules.unmatched_rules(paths)] == ["typo$", "layers/1/w"]
        assert [rule.pattern for rule in rules.matching_all(paths)] == [".*"]
        assert rules.unmatched_rules([]) == tuple(rules) and rules.matching_all([]) == ()
        blind = Rules([(r"layers/\d+/w$", "x -> x*"), ("b$", REPLICATE)])
        assert blind.unmatched_rules(f"layers/{i}/w" for i in range(100)) == (blind[1],)

    def test_an_unused_rule_that_matches_is_not_unmatched(self):
        tree = {"w": np.zeros((8, 8))}
        rules = Rules([("w", REPLICATE), ("w$", "x y -> x y*"), ("bias", "x -> x*")])
        assignment, _ = einshard._trees._assign.assign_rules(tree, rules, n_devices=N_DEVICES)
        assert [rule.pattern for rule in assignment.unused] == ["w$", "bias"]
        assert [rule.pattern for rule in assignment.unmatched] == ["bias"]
        report = einshard.explain(tree, rules, n_devices=N_DEVICES)
        assert (report.unused_rules, report.unmatched_rules) == (assignment.unused, assignment.unmatched)


class TestPolicies:
    tree = {"w": np.ones((3, 2 * N_DEVICES), np.float32), "norm": np.ones(4, np.float32)}

    def test_unmatched_error(self):
        with pytest.raises(EinshardError) as info:
            einshard.shard_pytree(self.tree, [("w", "x y -> x y*")])
        assert str(info.value).split("\n") == [
            "no rule matches 'norm' (shape (4,))",
            "Add a rule for it, e.g. (r'norm$', 'a -> * a'), end the table with "
            "(r'.*', '... -> * ...') to replicate the rest, or build the table with unmatched='replicate'.",
            "  rules tried: 'w'",
        ]

    def test_unmatched_replicate(self):
        out = einshard.shard_pytree(self.tree, Rules([("w", "x y -> x y*")], unmatched="replicate"))
        assert out["norm"].sharding.is_fully_replicated
        assert len(out["norm"].sharding.device_set) == N_DEVICES

    def test_indivisible_error(self):
        with pytest.raises(EinshardError) as info:
            einshard.shard_pytree(self.tree, [("w", "x y -> x* y"), (".*", REPLICATE)])
        lines = str(info.value).split("\n")
        assert lines[0] == (
            f"axis 'x' (axis 0 of shape (3, {2 * N_DEVICES})) has size 3, which does not split into "
            f"{N_DEVICES} shards ('x*' resolves to {N_DEVICES} on {N_DEVICES} devices)"
        )
        assert lines[1:3] == ["    'x y -> x* y'", "            ^^"]
        assert lines[-1] == (
            f"  while sharding 'w' (shape (3, {2 * N_DEVICES})) with rule ('w', 'x y -> x* y') "
            f"on {N_DEVICES} devices"
        )

    def test_indivisible_replicate_is_reported(self):
        rules = Rules([("w", "x y -> x* y"), (".*", REPLICATE)]).replace(indivisible="replicate")
        out = einshard.shard_pytree(self.tree, rules)
        assert out["w"].sharding.is_fully_replicated
        row = einshard.explain(self.tree, rules).rows[1]
        assert row.path == "w" and row.rule is None and "does not divide" in row.note

    def test_indivisible_next(self):
        rules = Rules([("w", "x y -> x* y"), ("w", "x y -> x y*"), (".*", REPLICATE)], indivisible="next")
        out = einshard.shard_pytree(self.tree, rules)
        assert same_layout(out["w"], "x y -> x y*")
        row = einshard.explain(self.tree, rules).rows[1]
        assert row.rule == "w" and row.note == f"rule 0 did not divide (3, {2 * N_DEVICES}): rule 1 used"

    def test_indivisible_next_with_nothing_left(self):
        with pytest.raises(EinshardError, match=r"no matching rule divides 'w'"):
            einshard.shard_pytree({"w": self.tree["w"]}, Rules([("w", "x y -> x* y")], indivisible="next"))

    def test_rank_mismatch_names_the_leaf(self):
        with pytest.raises(EinshardError) as info:
            einshard.shard_pytree(self.tree, [(".*", "x y -> x y*")])
        assert str(info.value).split("\n")[-1] == (
            f"  while sharding 'norm' (shape (4,)) with rule ('.*', 'x y -> x y*') on {N_DEVICES} devices"
        )

    def test_strict_warns_about_unused_rules(self):
        rules = Rules([(".*", REPLICATE), ("never", "x -> x*")], strict=True)
        unused = r"unused rules \(they decided no leaf\): \('never', 'x -> x\*'\)"
        with pytest.warns(EinshardWarning, match=unused):
            einshard.shard_pytree(self.tree, rules)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            einshard.shard_pytree(self.tree, rules.replace(strict=False))

    def test_scalars_are_replicated_whatever_the_rules(self):
        out = einshard.shard_pytree({"step": jnp.int32(3)}, [(".*", "x -> x*")])
        assert out["step"].sharding.is_fully_replicated and int(out["step"]) == 3


class TestAbstractAndBorn:
    @staticmethod
    def init(key, width):
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (16, width)),
            "w2": jax.random.normal(k2, (width, 16)),
            "b": jnp.zeros(width),
        }

    rules = [("w1", "x y -> x y*"), ("w2", "y z -> y* z"), (".*", REPLICATE)]

    def test_concrete_and_abstract_give_equal_shardings(self):
        key = jax.random.key(0)
        concrete = self.init(key, 4 * N_DEVICES)
        abstract = jax.eval_shape(functools.partial(self.init, width=4 * N_DEVICES), key)
        assert einshard.pytree_shardings(concrete, self.rules) == einshard.pytree_shardings(
            abstract, self.rules
        )

    def test_init_sharded_is_born_sharded(self):
        key = jax.random.key(1)
        params = einshard.init_sharded(self.init, self.rules, key, 4 * N_DEVICES)
        plain = self.init(key, 4 * N_DEVICES)
        for name in plain:
            np.testing.assert_allclose(np.asarray(params[name]), np.asarray(plain[name]), rtol=1e-6)
        assert same_layout(params["w1"], "x y -> x y*")
        assert same_layout(params["w2"], "y z -> y* z")
        assert params["b"].sharding.is_fully_replicated

    def test_init_sharded_never_materialises_whole(self):
        # The compiled init's outputs are sharded: each device holds its own block of w1, and only it.
        key = jax.random.key(2)
        params = einshard.init_sharded(self.init, self.rules, key, 4 * N_DEVICES)
        plain = self.init(key, 4 * N_DEVICES)
        for name, expression in (("w1", "x y -> x y*"), ("w2", "y z -> y* z")):
            shape = plain[name].shape
            shards, _ = blocks_v020(expression, 2, N_DEVICES)
            assert index_blocks(params[name].sharding, shape, shards) == expected_blocks(
                expression, shape, jax.devices()
            )
            for shard in params[name].addressable_shards:
                assert shard.data.shape != shape
                np.testing.assert_allclose(
                    np.asarray(shard.data), np.asarray(plain[name])[shard.index], rtol=1e-6
                )

    def test_shape_dtype_structs_get_their_sharding(self):
        abstract = jax.eval_shape(functools.partial(self.init, width=4 * N_DEVICES), jax.random.key(0))
        placed = einshard.shard_pytree(abstract, self.rules)
        assert isinstance(placed["w1"], jax.ShapeDtypeStruct)
        assert placed["w1"].sharding == einshard.make_sharding("x y -> x y*", n_dims=2)

    def test_inside_jit(self):
        @jax.jit
        def step(params):
            params = jax.tree.map(lambda p: p * 2, params)
            return einshard.shard_pytree(params, self.rules)

        params = self.init(jax.random.key(3), 4 * N_DEVICES)
        out = step(params)
        assert same_layout(out["w1"], "x y -> x y*")
        np.testing.assert_allclose(np.asarray(out["w2"]), 2 * np.asarray(params["w2"]))


class TestExplain:
    tree = {
        "embed": jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
        "layers": [
            {
                "w": jax.ShapeDtypeStruct((512, 2048), jnp.float32),
                "n": jax.ShapeDtypeStruct((512,), jnp.float32),
            }
        ],
        "config": {"depth": 1},
    }
    rules = [("embed", "v d -> v* d"), ("w$", "x y -> x y*"), ("norm", "x -> x*"), (".*", REPLICATE)]

    def test_rows_and_totals_for_256_devices(self):
        report = einshard.explain(self.tree, self.rules, n_devices=256)
        assert [row.path for row in report.rows] == ["embed", "layers/0/n", "layers/0/w"]
        embed, norm, w = report.rows
        assert (embed.shard_shape, embed.bytes_per_device, embed.dtype) == ((4, 512), 4 * 512 * 2, "bfloat16")
        assert (w.rule, w.expression, w.shard_shape) == ("w$", "x y -> x y*", (512, 8))
        assert norm.rule == ".*" and norm.bytes_per_device == 512 * 4
        assert report.total_bytes == 1024 * 512 * 2 + 512 * 4 + 512 * 2048 * 4
        assert report.max_bytes_per_device == 4 * 512 * 2 + 512 * 4 + 512 * 8 * 4
        assert [rule.pattern for rule in report.unused_rules] == ["norm"]
        # Only n (2048 bytes) is replicated: 255 extra copies over the 5,244,928 bytes of the model.
        assert report.replication_overhead == pytest.approx((5_244_928 + 255 * 2048) / 5_244_928)

    @pytest.mark.parametrize(
        ("rules", "overhead"),
        [
            ([(".*", "x y -> x* y")], 1.0),  # both split: one copy in all
            ([(".*", REPLICATE)], 4.0),  # both whole on each of 4 devices
            ([("a", "x y -> x y*"), (".*", REPLICATE)], 2.5),  # a once, b four times: 5 arrays' worth of 2
            ([("a", "x y -> 2 x2 y"), (".*", "x y -> x* y")], 1.5),  # a twice, b once: 3 of 2
        ],
    )
    def test_replication_overhead_by_hand(self, rules, overhead):
        tree = {
            "a": jax.ShapeDtypeStruct((8, 8), jnp.float32),
            "b": jax.ShapeDtypeStruct((8, 8), jnp.float32),
        }
        report = einshard.explain(tree, rules, n_devices=4)
        assert report.total_bytes == 2 * 8 * 8 * 4
        assert report.replication_overhead == overhead

    def test_table(self):
        text = str(einshard.explain(self.tree, self.rules, n_devices=256))
        assert "layers/0/w" in text and "(512, 8)" in text
        assert "3 arrays, 5.0 MiB on 256 devices" in text
        assert "unused rules: ('norm', 'x -> x*')" in text

    def test_plain_table_without_rich(self, monkeypatch):
        import builtins

        real_import = builtins.__import__

        def no_rich(name, *args, **kwargs):
            if name.startswith("rich"):
                raise ImportError(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_rich)
        lines = str(einshard.explain(self.tree, self.rules, n_devices=8)).split("\n")
        assert lines[0].split() == [
            "path",
            "shape",
            "dtype",
            "rule",
            "expression",
            "shard",
            "shape",
            "per",
            "device",
        ]
        assert lines[4].startswith("layers/0/w") and "(512, 256)" in lines[4]

    def test_needs_no_devices(self):
        report = einshard.explain(
            {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}, {"w": "x y -> x y*"}, n_devices=4096
        )
        assert report.rows[0].shard_shape == (4096, 1)


# --- Property: random trees and tables ------------------------------------------------------

EXPRESSIONS = {1: ["a -> a*", "a -> * a", "a -> a"], 2: ["a b -> a b*", "a b -> a* b", "a b -> * a b"]}


@st.composite
def trees(draw):
    def leaf():
        rank = draw(st.integers(0, 2))
        shape = tuple(N_DEVICES * draw(st.integers(1, 2)) for _ in range(rank))
        dtype = draw(st.sampled_from([np.float32, np.int32, np.float16]))
        return (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)

    names = st.sampled_from(["w", "b", "kernel", "scale", "emb"])
    children = draw(
        st.lists(st.tuples(names, st.integers(0, 2)), min_size=1, max_size=5, unique_by=lambda t: t[0])
    )
    tree = {}
    for name, kind in children:
        if kind == 0:
            tree[name] = leaf()
        elif kind == 1:
            tree[name] = [leaf() for _ in range(draw(st.integers(1, 3)))]
        else:
            tree[name] = {"inner": leaf(), "none": None, "n": draw(st.integers())}
    return tree


@settings(max_examples=40, deadline=None)
@given(tree=trees(), data=st.data())
def test_shard_pytree_keeps_values_and_follows_make_sharding(tree, data):
    patterns = data.draw(st.lists(st.sampled_from(["w", "b$", "inner", "kernel", "/0", "scale"]), max_size=4))
    rules = Rules(
        [(p, data.draw(st.sampled_from(EXPRESSIONS[data.draw(st.integers(1, 2))]))) for p in patterns]
        + [(".*", REPLICATE)]
    )
    try:
        out = einshard.shard_pytree(tree, rules)
    except EinshardError as error:
        assert "while sharding" in str(error)  # a rule of the wrong rank, named with its leaf
        return
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    flat_in = jax.tree_util.tree_flatten_with_path(tree)[0]
    flat_out = jax.tree_util.tree_leaves(out)
    for (path, before), after in zip(flat_in, flat_out, strict=True):
        if not isinstance(before, np.ndarray):
            assert after is before or after == before
            continue
        np.testing.assert_array_equal(np.asarray(after), before)
        assert after.dtype == before.dtype
        rule = rules.match(einshard._trees._paths.path_string(path))
        expression = REPLICATE if before.ndim == 0 else rule.expression
        assert same_layout(after, expression)


def test_flax_wrappers_are_not_part_of_paths():
    """SPEC: Flax NNX's ``.value`` (and linen's metadata boxes) do not show in paths."""
    nnx = pytest.importorskip("flax.nnx")
    linen = pytest.importorskip("flax.linen")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 2 * N_DEVICES, rngs=rngs)

    model = Model(nnx.Rngs(0))
    rules = [("up/kernel$", "x y -> x y*"), (".*", REPLICATE)]
    report = einshard.explain(nnx.state(model), rules)
    assert [(row.path, row.rule) for row in report.rows] == [("up/bias", ".*"), ("up/kernel", "up/kernel$")]
    state = einshard.shard_pytree(nnx.state(model), rules)
    nnx.update(model, state)
    assert same_layout(model.up.kernel[...], "x y -> x y*")

    boxed = linen.Dense(8, kernel_init=linen.with_partitioning(linen.initializers.ones, (None, "m")))
    variables = boxed.init(jax.random.key(0), jnp.ones((1, 4)))
    assert [row.path for row in einshard.explain(variables, [(".*", REPLICATE)]).rows] == [
        "params/bias",
        "params/kernel",
    ]


def test_init_sharded_in_parts(monkeypatch):
    """A big init is compiled in parts (bounding XLA's scratch memory), with the same result."""
    monkeypatch.setattr(einshard._arrays._build, "_PART_BYTES", 4 * 16 * 8 * N_DEVICES)

    def init(key):
        keys = jax.random.split(key, 5)
        return {f"w{i}": jax.random.normal(k, (16, 8 * N_DEVICES)) for i, k in enumerate(keys)}

    shapes = jax.tree_util.tree_leaves(jax.eval_shape(init, jax.random.key(0)))
    assert len(einshard._arrays._build._parts(shapes)) == 5
    params = einshard.init_sharded(init, [("w", "x y -> x y*")], jax.random.key(0))
    plain = init(jax.random.key(0))
    for name, value in plain.items():
        np.testing.assert_array_equal(np.asarray(params[name]), np.asarray(value))
        assert same_layout(params[name], "x y -> x y*")


@settings(max_examples=300, deadline=None)
@given(
    patterns=st.lists(
        st.sampled_from(["a", "^a/\\d+", ".*", "/\\d/", "a/.$", "a/..$", "\\w{2}", "[0-5]", "x1", "[/-:]+b"]),
        min_size=1,
        max_size=5,
    ),
    path=st.text(alphabet="ab/0123789", max_size=9),
)
def test_digit_blind_matching_is_exact(patterns, path):
    """Tables whose regexes cannot tell digits apart match once per digit pattern, exactly."""
    rules = Rules([(p, REPLICATE) for p in patterns])
    assert_first_match(rules, patterns, path)


def test_doubtful_regex_is_a_warning_naming_the_rule():
    with pytest.warns(EinshardWarning, match=r"rule 0 \('\[\[a\]', 'x -> x\*'\): Possible nested set"):
        Rules([("[[a]", "x -> x*")])


_PLAIN_TREES = st.recursive(
    st.one_of(st.integers(), st.none(), st.floats(allow_nan=False)),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(
            st.one_of(st.sampled_from(["w", "b", "layers", "0", "x/y"]), st.integers(0, 12)),
            children,
            max_size=3,
        ),
        st.dictionaries(st.sampled_from(["a", "b"]), children, max_size=2).map(
            lambda d: {"layers": [d, d, d]}
        ),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(tree=_PLAIN_TREES)
def test_paths_read_off_the_structure_are_those_of_the_key_paths(tree):
    """Dicts, lists, tuples and None: the structure gives the paths tree_flatten_with_path gives."""
    from einshard._trees import _paths

    try:
        treedef = jax.tree_util.tree_structure(tree)
    except ValueError:  # dict keys of mixed types JAX cannot sort
        return
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    expected = [einshard._trees._paths.path_string(key_path) for key_path, _ in flat]
    assert _paths._structure_paths(treedef) == expected
