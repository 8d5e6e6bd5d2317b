"""optax state sharded like the params it mirrors: born sharded, kept through training, explained."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_v020 import expected_blocks, index_blocks

import einshard
from conftest import N_DEVICES
from einshard import EinshardError

optax = pytest.importorskip("optax")
from einshard.integrations.optax import (  # noqa: E402  (after the importorskip)
    explain_opt_state,
    init_opt_state,
    opt_state_shardings,
    shard_opt_state,
)

REPLICATE = "... -> * ..."
D_IN, HIDDEN, D_OUT, BATCH = 16, 8 * N_DEVICES, 8, 32
RULES = [
    (r"hidden/w$", "x y -> x y*"),  # Megatron: column-parallel
    (r"hidden/b$", "y -> y*"),
    (r"out/w$", "y z -> y* z"),  # row-parallel
    (r".*", REPLICATE),
]
MASK = {"hidden": {"w": True, "b": False}, "out": {"w": True, "b": False}}

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
    "masked": lambda: optax.masked(optax.adamw(1e-2), MASK),
    "masked_prefix": lambda: optax.masked(optax.adam(1e-2), {"hidden": True, "out": False}),
    "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}
# State fields that hold a copy of the parameter tree (for adafactor, `v` where not factored).
MIRROR_FIELDS = {"mu", "nu", "trace", "acc_grads", "v"}


def make_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "hidden": {"w": jax.random.normal(k1, (D_IN, HIDDEN)) * 0.3, "b": jnp.zeros(HIDDEN)},
        "out": {"w": jax.random.normal(k2, (HIDDEN, D_OUT)) * 0.3, "b": jnp.zeros(D_OUT)},
    }


def make_batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return np.asarray(jax.random.normal(kx, (BATCH, D_IN))), np.asarray(jax.random.normal(ky, (BATCH, D_OUT)))


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)


def make_step(tx):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def index_map(sharding, shape):
    return {
        device.id: tuple(s.indices(size)[:2] for s, size in zip(slices, shape, strict=True))
        for device, slices in sharding.devices_indices_map(tuple(shape)).items()
    }


def same_layout(a, b, shape):
    return index_map(a, shape) == index_map(b, shape)


def keys_of(path):
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def mirrored_param(path, leaf, params_by_path):
    """The path of the parameter a state leaf mirrors, found by field name (independently of einshard)."""
    names = keys_of(path)
    for i, name in enumerate(names):
        if name in MIRROR_FIELDS:
            param = params_by_path.get("/".join(names[i + 1 :]))
            if param is not None and param.shape == leaf.shape:
                return "/".join(names[i + 1 :])
    return None


def by_path(tree):
    return {"/".join(keys_of(p)): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_layout(state, params):
    """Every mirroring leaf is laid out like its parameter (and not whole anywhere); scalars replicated."""
    params_by_path = by_path(params)
    mirrors = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = jax.tree_util.keystr(path)
        assert isinstance(leaf, jax.Array), where
        if leaf.ndim == 0:
            assert leaf.sharding.is_fully_replicated, where
            continue
        param_path = mirrored_param(path, leaf, params_by_path)
        if param_path is None:
            continue
        mirrors += 1
        param = params_by_path[param_path]
        assert same_layout(leaf.sharding, param.sharding, leaf.shape), where
        if not param.sharding.is_fully_replicated:
            assert all(shard.data.shape != leaf.shape for shard in leaf.addressable_shards), where
    return mirrors


def expected_mirrors(name):
    return {
        "adam": 8,
        "adamw": 8,
        "sgd_momentum": 4,
        "lion": 4,
        "chain": 8,
        "inject_hyperparams": 8,
        "masked": 4,  # mu and nu of the two weights; the biases are masked out
        "masked_prefix": 4,  # mu and nu of the hidden layer
        "multisteps": 12,  # mu, nu, acc_grads
        "adafactor": 2,  # v of the two biases; the weights are factored
    }[name]


@pytest.fixture(scope="module")
def params():
    return make_params()


@pytest.fixture(scope="module")
def sharded(params):
    return einshard.shard_pytree(params, RULES)


def assert_trees_close(a, b, **tolerance):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tolerance)


def full_weight_all_gathers(hlo, shapes):
    """All-gather ops of a compiled module whose result has the shape of a whole weight."""
    found = []
    for match in re.finditer(r"=\s*(.*?)\s+all-gather(?:-start)?\(", hlo):
        result = {
            tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", match[1])
        }
        found += [shape for shape in shapes if shape in result]
    return found


@pytest.mark.parametrize("name", list(OPTIMIZERS))
class TestOptimizers:
    def test_born_sharded_init(self, name, params, sharded):
        tx = OPTIMIZERS[name]()
        state = init_opt_state(tx, sharded)
        assert check_layout(state, sharded) == expected_mirrors(name)
        assert_trees_close(state, tx.init(params))

    def test_training_matches_unsharded_and_keeps_layout(self, name, params, sharded):
        tx = OPTIMIZERS[name]()
        x, y = make_batch()
        state = init_opt_state(tx, sharded)
        shardings = opt_state_shardings(state, sharded)
        step = jax.jit(make_step(tx))
        compiled = step.lower(sharded, state, x, y).compile()
        # (c) Megatron layout: the update step gathers no weight whole.
        weights = [(D_IN, HIDDEN), (HIDDEN, D_OUT)]
        assert full_weight_all_gathers(compiled.as_text(), weights) == []
        p_sharded, s_sharded = sharded, state
        p_plain, s_plain = params, tx.init(params)
        for _ in range(3):
            p_sharded, s_sharded, loss_sharded = compiled(p_sharded, s_sharded, x, y)
            p_plain, s_plain, loss_plain = step(p_plain, s_plain, x, y)
            np.testing.assert_allclose(float(loss_sharded), float(loss_plain), rtol=1e-5)
        assert_trees_close(p_sharded, p_plain, rtol=1e-4, atol=1e-5)
        assert_trees_close(s_sharded, s_plain, rtol=1e-4, atol=1e-5)
        assert check_layout(s_sharded, p_sharded) == expected_mirrors(name)
        for leaf, sharding in zip(jax.tree.leaves(s_sharded), jax.tree.leaves(shardings), strict=True):
            assert same_layout(leaf.sharding, sharding, leaf.shape)

    def test_shard_existing_state(self, name, params, sharded):
        tx = OPTIMIZERS[name]()
        plain = tx.init(params)
        state = shard_opt_state(plain, sharded)
        assert check_layout(state, sharded) == expected_mirrors(name)
        assert_trees_close(state, plain)
        born = init_opt_state(tx, sharded)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(born), strict=True):
            assert same_layout(a.sharding, b.sharding, a.shape)

    def test_abstract_params_give_abstract_state(self, name, sharded):
        tx = OPTIMIZERS[name]()
        abstract_params = jax.eval_shape(lambda p: p, sharded)
        abstract_params = einshard.shard_pytree(abstract_params, RULES)  # ShapeDtypeStructs with shardings
        abstract = init_opt_state(tx, abstract_params)
        born = init_opt_state(tx, sharded)
        assert jax.tree.structure(abstract) == jax.tree.structure(born)
        for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(born), strict=True):
            assert isinstance(a, jax.ShapeDtypeStruct)
            assert a.shape == b.shape and a.dtype == b.dtype
            assert same_layout(a.sharding, b.sharding, a.shape)

    def test_every_row_explained(self, name, sharded):
        state = init_opt_state(OPTIMIZERS[name](), sharded)
        report = explain_opt_state(state, params=sharded)
        assert len(report.rows) == len(jax.tree.leaves(state))
        assert all(row.note for row in report.rows)
        assert report.n_devices == N_DEVICES
        assert sum(row.note.startswith("mirrors ") for row in report.rows) == expected_mirrors(name)


def test_the_all_gather_counter_sees_a_gathered_weight(sharded):
    # The control for test (c): forcing a replicated copy of a sharded weight must show up.
    replicated = einshard.make_sharding(REPLICATE, n_dims=2)
    hlo = jax.jit(lambda w: w * 2, out_shardings=replicated).lower(sharded["hidden"]["w"]).compile().as_text()
    assert full_weight_all_gathers(hlo, [(D_IN, HIDDEN)]) == [(D_IN, HIDDEN)]


class TestAdafactor:
    def tx(self):
        return OPTIMIZERS["adafactor"]()

    def test_factored_statistics_keep_the_surviving_axes(self, sharded):
        state = init_opt_state(self.tx(), sharded)[0]
        column = einshard.make_sharding("y -> y*", shape=(HIDDEN,))
        # hidden/w (D_IN, HIDDEN) split on HIDDEN: v_row reduces HIDDEN (the largest axis), v_col keeps it.
        assert state.v_row["hidden"]["w"].shape == (D_IN,)
        assert state.v_row["hidden"]["w"].sharding.is_fully_replicated
        assert state.v_col["hidden"]["w"].shape == (HIDDEN,)
        assert same_layout(state.v_col["hidden"]["w"].sharding, column, (HIDDEN,))
        # out/w (HIDDEN, D_OUT) split on HIDDEN: v_row reduces HIDDEN, v_col reduces D_OUT.
        assert state.v_row["out"]["w"].shape == (D_OUT,)
        assert state.v_row["out"]["w"].sharding.is_fully_replicated
        assert same_layout(state.v_col["out"]["w"].sharding, column, (HIDDEN,))
        # Placeholders of shape (1,) are replicated; every spec has the leaf's rank.
        for leaf in (state.v_row["hidden"]["b"], state.v_col["out"]["b"], state.v["hidden"]["w"]):
            assert leaf.shape == (1,) and leaf.sharding.is_fully_replicated
        for leaf in jax.tree.leaves(state):
            assert len(leaf.sharding.spec) <= leaf.ndim

    def test_report(self, sharded):
        state = init_opt_state(self.tx(), sharded)
        notes = {row.path: row.note for row in explain_opt_state(state, params=sharded).rows}
        assert notes["0/count"] == "scalar"
        assert notes["0/v_row/hidden/w"] == "adafactor v_row of hidden/w (axis 1 reduced): replicated"
        assert notes["0/v_col/hidden/w"] == "adafactor v_col of hidden/w (axis 0 reduced)"
        assert notes["0/v_row/out/w"] == "adafactor v_row of out/w (axis 0 reduced): replicated"
        assert notes["0/v_col/out/w"] == "adafactor v_col of out/w (axis 1 reduced)"
        assert notes["0/v/hidden/b"] == "mirrors hidden/b"
        assert notes["0/v/hidden/w"] == "adafactor placeholder beside hidden/w: replicated"
        assert notes["0/v_row/hidden/b"] == "adafactor placeholder beside hidden/b: replicated"
        rows = {row.path: row for row in explain_opt_state(state, params=sharded).rows}
        assert rows["0/v_col/hidden/w"].expression == f"a -> a{N_DEVICES}"
        assert rows["0/v_row/hidden/w"].expression == REPLICATE
        assert rows["0/v/hidden/b"].shard_shape == (8,)
        assert "adafactor v_row of hidden/w" in str(explain_opt_state(state, params=sharded))

    def test_report_plans_for_any_device_count(self, params):
        abstract = jax.eval_shape(lambda: params)
        state = jax.eval_shape(self.tx().init, abstract)
        report = explain_opt_state(state, RULES, abstract, n_devices=2 * N_DEVICES)
        rows = {row.path: row for row in report.rows}
        assert report.n_devices == 2 * N_DEVICES
        assert rows["0/v_col/hidden/w"].expression == "y -> y*"
        assert rows["0/v_col/hidden/w"].shard_shape == (4,)
        assert rows["0/v_col/hidden/w"].rule == "hidden/w$"
        assert rows["0/v_row/hidden/w"].expression == "x -> x *"
        assert rows["0/v_row/out/w"].expression == "z -> * z"
        assert rows["0/v/hidden/b"].expression == "y -> y*"
        assert rows["0/v/hidden/b"].note == "mirrors hidden/b"
        assert rows["0/count"].expression == REPLICATE

    def test_square_weight_follows_optax_choice_of_axes(self):
        # A tie: optax reduces axis 1 for v_row and axis 0 for v_col (np.argsort order).
        size = 8 * N_DEVICES
        params = einshard.shard_pytree({"w": jnp.ones((size, size))}, {"w": "x y -> x y*"})
        state = init_opt_state(self.tx(), params)[0]
        assert state.v_row["w"].sharding.is_fully_replicated
        column = einshard.make_sharding("y -> y*", shape=(size,))
        assert same_layout(state.v_col["w"].sharding, column, (size,))
        tx = self.tx()
        updates, _ = jax.jit(tx.update)(params, init_opt_state(tx, params), params)
        assert updates["w"].shape == (size, size)


class TestMatching:
    """How state leaves are matched to parameters, on hand-made states."""

    def test_reduced_axis_outside_adafactor(self):
        params = einshard.shard_pytree({"w": jnp.ones((4, 8 * N_DEVICES))}, {"w": "x y -> x y*"})
        state = {"stat": {"w": jnp.zeros(8 * N_DEVICES)}, "step": jnp.zeros((), jnp.int32)}
        placed = shard_opt_state(state, params)
        stat = placed["stat"]["w"]  # the surviving axis 1 of w, split as w's y is
        assert index_blocks(stat.sharding, stat.shape, (N_DEVICES,)) == expected_blocks(
            "y -> y*", stat.shape, jax.devices()
        )
        assert placed["step"].sharding.is_fully_replicated
        notes = [row.note for row in explain_opt_state(state, params=params).rows]
        assert notes == ["reduces w (axis 0 reduced)", "scalar"]

    def test_ambiguous_reduction_is_replicated(self):
        size = 8 * N_DEVICES
        params = einshard.shard_pytree({"w": jnp.ones((size, size))}, {"w": "x y -> x y*"})
        state = {"stat": {"w": jnp.zeros(size)}}
        assert shard_opt_state(state, params)["stat"]["w"].sharding.is_fully_replicated
        (row,) = explain_opt_state(state, params=params).rows
        assert row.note == "reduces w, axis 0 or 1 (ambiguous): replicated"

    def test_reduction_of_a_replicated_axis_is_not_ambiguous(self):
        params = einshard.shard_pytree({"w": jnp.ones((8, 8, 8 * N_DEVICES))}, {"w": "a b c -> a b c*"})
        placed = shard_opt_state({"s": {"w": jnp.zeros((8, 8 * N_DEVICES))}}, params)
        s = placed["s"]["w"]  # axes b and c of w survive, c split as w's is
        assert index_blocks(s.sharding, s.shape, (1, N_DEVICES)) == expected_blocks(
            "b c -> b c*", s.shape, jax.devices()
        )

    def test_unmatched_arrays_are_replicated_and_reported(self, sharded):
        state = {"other": jnp.zeros((3, 5)), "hidden": {"w": jnp.zeros((D_IN, HIDDEN))}}
        placed = shard_opt_state(state, sharded)
        assert placed["other"].sharding.is_fully_replicated
        # A lone array of a parameter's shape is not a copy of the parameter tree.
        assert placed["hidden"]["w"].sharding.is_fully_replicated
        notes = {row.path: row.note for row in explain_opt_state(state, params=sharded).rows}
        assert notes["other"] == "mirrors no parameter: replicated"

    def test_wrong_shape_inside_a_param_shaped_tree(self, sharded):
        state = jax.tree.map(lambda p: jnp.zeros((2, 3)), sharded)
        placed = shard_opt_state(state, sharded)
        assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(placed))
        notes = {row.path: row.note for row in explain_opt_state(state, params=sharded).rows}
        assert notes["hidden/w"] == "shape (2, 3) beside hidden/w: replicated"

    def test_non_array_leaves_pass_through(self, sharded):
        state = (optax.EmptyState(), {"label": "adam", "mu": jax.tree.map(jnp.zeros_like, sharded)}, None)
        placed = shard_opt_state(state, sharded)
        assert placed[1]["label"] == "adam" and placed[2] is None
        assert placed[1]["mu"]["out"]["w"].sharding == sharded["out"]["w"].sharding
        shardings = opt_state_shardings(state, sharded)
        assert shardings[1]["label"] is None

    def test_unplaced_params_replicate(self, params):
        numpy_params = jax.tree.map(np.asarray, params)
        state = optax.adam(1e-3).init(numpy_params)
        placed = shard_opt_state(state, numpy_params)
        assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(placed))
        notes = {row.path: row.note for row in explain_opt_state(state, params=numpy_params).rows}
        assert notes["0/mu/hidden/w"] == "mirrors hidden/w, which is not placed: replicated"

    def test_params_on_a_device_subset(self, params):
        devices = jax.devices()[:2]
        with einshard.use_devices(devices):
            placed = einshard.shard_pytree(params, RULES)
        state = init_opt_state(optax.adam(1e-3), placed)
        for leaf in jax.tree.leaves(state):
            assert leaf.sharding.device_set == set(devices)
        assert explain_opt_state(state, params=placed).n_devices == 2

    def test_ambient_mesh(self, params):
        mesh = jax.make_mesh((2, N_DEVICES // 2), ("data", "model"))
        with jax.set_mesh(mesh):
            placed = einshard.shard_pytree(params, RULES)
            state = init_opt_state(optax.adafactor(1e-2, min_dim_size_to_factor=8), placed)
        assert state[0].v_col["hidden"]["w"].sharding.mesh == mesh
        assert state[0].v_col["hidden"]["w"].sharding.spec == jax.sharding.PartitionSpec(("data", "model"))
        assert state[0].count.sharding.mesh == mesh
        rows = {row.path: row for row in explain_opt_state(state, params=placed).rows}
        assert rows["0/v_col/hidden/w"].expression == f"a -> a{N_DEVICES}"

    def test_multi_transform(self, params, sharded):
        labels = {"hidden": {"w": "adam", "b": "sgd"}, "out": "adam"}  # a prefix label tree
        tx = optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)}, labels)
        state = init_opt_state(tx, sharded)
        assert check_layout(state, sharded) == 7  # mu, nu of three arrays; trace of one
        assert_trees_close(state, tx.init(params))

    def test_wrapper_nodes_of_another_type(self):
        # Like Flax NNX: parameters in one wrapper type, optimizer state in another, same keys.
        @jax.tree_util.register_pytree_with_keys_class
        class Param:
            def __init__(self, value):
                self.value = value

            def tree_flatten_with_keys(self):
                return ((jax.tree_util.GetAttrKey("value"), self.value),), None

            @classmethod
            def tree_unflatten(cls, _, children):
                return cls(*children)

        @jax.tree_util.register_pytree_with_keys_class
        class OptVariable(Param):
            pass

        params = {"w": Param(einshard.einshard(jnp.ones((4, 8 * N_DEVICES)), "x y -> x y*"))}
        state = {"mu": {"w": OptVariable(jnp.zeros((4, 8 * N_DEVICES)))}}
        placed = shard_opt_state(state, params)
        assert placed["mu"]["w"].value.sharding == params["w"].value.sharding
        assert [row.note for row in explain_opt_state(state, params=params).rows] == ["mirrors w/value"]

    def test_traced_params_are_an_error(self, sharded):
        state = optax.adam(1e-3).init(sharded)

        def inside(params):
            return opt_state_shardings(state, params)

        with pytest.raises(EinshardError, match="traced value"):
            jax.jit(inside)(sharded)

    def test_traced_state_gets_a_constraint(self, sharded):
        tx = optax.sgd(1e-2, momentum=0.9)
        plain = tx.init(sharded)
        out = jax.jit(lambda s: shard_opt_state(s, sharded))(plain)
        assert out[0].trace["hidden"]["w"].sharding.is_equivalent_to(sharded["hidden"]["w"].sharding, 2)

    def test_traced_state_is_resharded_under_an_explicit_mesh(self):
        explicit = (jax.sharding.AxisType.Explicit,) * 2
        mesh = jax.make_mesh((2, N_DEVICES // 2), ("data", "model"), axis_types=explicit)
        with jax.set_mesh(mesh):
            params = einshard.shard_pytree({"w": jnp.ones((16, 8 * N_DEVICES))}, {"w": "x y -> x y*"})
            plain = optax.sgd(1e-2, momentum=0.9).init({"w": jnp.ones((16, 8 * N_DEVICES))})
            out = jax.jit(lambda s: shard_opt_state(s, params))(plain)
        assert out[0].trace["w"].sharding == params["w"].sharding

    def test_mixed_abstract_and_concrete_params_are_an_error(self, sharded):
        mixed = dict(sharded, out=jax.eval_shape(lambda p: p, sharded["out"]))
        with pytest.raises(EinshardError, match="mix abstract"):
            init_opt_state(optax.adam(1e-3), mixed)

    def test_explain_device_count_must_match_placed_params(self, sharded):
        state = init_opt_state(optax.adam(1e-3), sharded)
        with pytest.raises(EinshardError, match="pass the rule table"):
            explain_opt_state(state, params=sharded, n_devices=2 * N_DEVICES)
        assert explain_opt_state(state, params=sharded, n_devices=N_DEVICES).n_devices == N_DEVICES

    def test_jit_with_out_shardings_does_not_recompile(self, sharded):
        tx = optax.adam(1e-2)
        x, y = make_batch()
        state = init_opt_state(tx, sharded)
        param_shardings = jax.tree.map(lambda p: p.sharding, sharded)
        step = jax.jit(
            make_step(tx), out_shardings=(param_shardings, opt_state_shardings(state, sharded), None)
        )
        p, s = sharded, state
        for _ in range(3):
            p, s, _ = step(p, s, x, y)
        assert step._cache_size() == 1


def test_a_param_left_on_one_device_gets_its_state_replicated_beside_placed_ones():
    # A bias no rule names stays where it was built; jit moves it, so its state goes beside the others.
    params = make_params()
    params["hidden"]["w"] = einshard.einshard(params["hidden"]["w"], "x y -> x y*")
    tx = optax.adam(1e-2)
    state = init_opt_state(tx, params)
    mu = state[0].mu
    assert mu["hidden"]["w"].sharding == params["hidden"]["w"].sharding
    for path in (("hidden", "b"), ("out", "w"), ("out", "b")):
        leaf = mu[path[0]][path[1]]
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == params["hidden"]["w"].sharding.device_set
    notes = {row.path: row.note for row in explain_opt_state(state, params=params).rows}
    assert notes["0/mu/hidden/b"] == "mirrors hidden/b, which is on one device: replicated"
    # The step runs with the mixed params, and matches plain optax.
    x, y = make_batch()
    new_params, _, _ = jax.jit(make_step(tx))(params, state, x, y)
    plain = make_params()
    expected, _, _ = make_step(tx)(plain, tx.init(plain), x, y)
    leaves = jax.tree_util.tree_leaves
    for got, want in zip(leaves(new_params), leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- many optimizers: what mirrors a parameter gets its layout, and a step matches one device ---

CONTRIB = pytest.importorskip("optax.contrib")
MANY = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "novograd": lambda: optax.novograd(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
    "lbfgs": lambda: optax.lbfgs(1e-2, linesearch=None),
    "lookahead": lambda: optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "masked": lambda: optax.masked(optax.adamw(1e-2), MASK),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)},
        {"hidden": {"w": "adam", "b": "sgd"}, "out": "adam"},
    ),
    "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
    "adamax": lambda: optax.adamax(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "adan": lambda: optax.adan(1e-2),
    "galore": lambda: CONTRIB.galore(1e-2, rank=4),
    "schedule_free": lambda: CONTRIB.schedule_free_adamw(1e-2),
}


def index_of(sharding, shape):
    return {
        d: tuple(s.indices(n)[:2] for s, n in zip(i, shape, strict=True))
        for d, i in sharding.devices_indices_map(tuple(shape)).items()
    }


def expected_index(leaf_shape, slot, param):
    """The block each device should hold of a state leaf derived from ``param``, or None if not derived."""
    shape, blocks = tuple(param.shape), index_of(param.sharding, param.shape)
    if tuple(leaf_shape) == shape:
        return blocks
    lead = len(leaf_shape) - len(shape)
    if lead > 0 and tuple(leaf_shape[lead:]) == shape:  # a history: leading axes whole
        return {d: tuple((0, n) for n in leaf_shape[:lead]) + b for d, b in blocks.items()}
    if slot is not None and tuple(leaf_shape) == (shape[slot],):  # one statistic per axis (SM3)
        return {d: (b[slot],) for d, b in blocks.items()}
    return None


def check_many_layouts(state, model_params):
    """Each state leaf at a parameter's path (optionally /k) holds that parameter's blocks; scalars whole."""
    params_by_path = by_path(model_params)
    checked = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = jax.tree_util.keystr(path)
        assert leaf.sharding.device_set == set(jax.devices()), where
        if leaf.ndim == 0:
            assert leaf.sharding.is_fully_replicated, where
            continue
        names = keys_of(path)
        slot = int(names[-1]) if names[-1].isdigit() else None
        for param_path, param in params_by_path.items():
            tail = names[:-1] if slot is not None and not "/".join(names).endswith(param_path) else names
            if "/".join(tail).endswith(param_path):
                expected = expected_index(leaf.shape, slot if tail is not names else None, param)
                if expected is not None:
                    assert index_of(leaf.sharding, leaf.shape) == expected, where
                    checked += 1
                break
    return checked


@pytest.mark.parametrize("name", list(MANY))
def test_many_optimizers_layouts_and_one_step(name, params, sharded):
    tx = MANY[name]()
    lookahead = name == "lookahead"
    model_sharded = sharded
    if lookahead:
        plain_params, sharded = (
            optax.LookaheadParams.init_synced(params),
            optax.LookaheadParams.init_synced(sharded),
        )
    else:
        plain_params = params
    state = init_opt_state(tx, sharded)
    assert check_many_layouts(state, model_sharded) >= 2
    assert_trees_close(state, tx.init(plain_params))
    # Restored without its optimizer, the state is laid out the same way (structural matching).
    restored = shard_opt_state(tx.init(plain_params), sharded)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert index_of(a.sharding, a.shape) == index_of(b.sharding, b.shape)

    def step(params, state, x, y):
        model = params.fast if lookahead else params
        loss, grads = jax.value_and_grad(loss_fn)(model, x, y)
        extra = {}
        if name == "lbfgs":
            extra = {"value": loss, "grad": grads, "value_fn": lambda p: loss_fn(p, x, y)}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    x, y = make_batch()
    got = jax.jit(step)(sharded, state, x, y)
    with jax.default_device(jax.devices()[0]):
        want = jax.jit(step)(plain_params, tx.init(plain_params), x, y)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    assert check_many_layouts(got[1], got[0].fast if lookahead else got[0]) >= 2


def test_lookahead_fast_state_follows_the_fast_params_not_the_slow(params):
    fast = einshard.shard_pytree(params, RULES)
    slow = einshard.shard_pytree(params, [(r".*", REPLICATE)])
    state = init_opt_state(optax.lookahead(optax.adam(1e-2), 2, 0.5), optax.LookaheadParams(fast, slow))
    assert state.fast_state[0].mu["hidden"]["w"].sharding == fast["hidden"]["w"].sharding
    report = explain_opt_state(state, params=optax.LookaheadParams(fast, slow))
    assert {row.note for row in report.rows if "/mu/" in row.path} == {
        f"mirrors fast/{p}" for p in ("hidden/w", "hidden/b", "out/w", "out/b")
    }
    assert report.replication_overhead < 1.5


def test_optax_s_placeholder_params_are_not_logged_and_absl_s_level_stays(params, caplog):
    """optax's tree_map_params inits lookahead with placeholder params, which lookahead logs have no
    ``fast``: that notice is dropped for the call by a filter, not by raising absl's level for all."""
    import logging

    absl = logging.getLogger("absl")
    level, filters = absl.level, list(absl.filters)
    fast = einshard.shard_pytree(params, RULES)
    tx = optax.lookahead(optax.adam(1e-2), 2, 0.5)
    with caplog.at_level(logging.WARNING):
        init_opt_state(tx, optax.LookaheadParams(fast, fast))
        assert not [r for r in caplog.records if "has no attribute `fast`" in r.getMessage()]
        assert (absl.level, absl.filters) == (level, filters)
        tx.init(params)  # the user's own params without `fast`: lookahead's notice shows
        assert [r for r in caplog.records if "has no attribute `fast`" in r.getMessage()]


def test_a_restored_lookahead_state_follows_the_fast_params_by_structure(params):
    """Without the optimizer (a restored state), its fast state is found as a copy of ``params.fast``."""
    fast = einshard.shard_pytree(params, RULES)
    slow = einshard.shard_pytree(params, [(r".*", REPLICATE)])
    tx = optax.lookahead(optax.adam(1e-2), 2, 0.5)
    restored = shard_opt_state(
        tx.init(optax.LookaheadParams(params, params)), optax.LookaheadParams(fast, slow)
    )
    for moment in ("mu", "nu"):
        for path in (("hidden", "w"), ("out", "w")):
            leaf = getattr(restored.fast_state[0], moment)[path[0]][path[1]]
            assert leaf.sharding == fast[path[0]][path[1]].sharding, (moment, path)
    # Planned for another device count from shapes alone: the same derivations.
    abstract = jax.eval_shape(lambda: optax.LookaheadParams(params, params))
    state = jax.eval_shape(tx.init, abstract)
    rows = {row.path: row for row in explain_opt_state(state, RULES, abstract, n_devices=4 * N_DEVICES).rows}
    assert rows["fast_state/0/mu/hidden/w"].note == "mirrors fast/hidden/w"
    assert rows["fast_state/0/mu/hidden/w"].shard_shape == (D_IN, HIDDEN // (4 * N_DEVICES))


def test_leading_axes_keep_tuple_spec_entries_on_an_ambient_mesh(params):
    mesh = jax.make_mesh((2, N_DEVICES // 2), ("data", "model"))
    with jax.set_mesh(mesh):
        placed = einshard.shard_pytree(params, RULES)
        state = init_opt_state(optax.lbfgs(1e-2, linesearch=None), placed)
    spec = placed["hidden"]["w"].sharding.spec
    assert tuple(spec)[-1] == ("data", "model")
    history = state[0].diff_params_memory["hidden"]["w"]
    assert history.sharding.spec == jax.sharding.PartitionSpec(None, *spec)
    assert history.sharding.mesh == mesh


def test_derived_layouts_planned_by_rules(params):
    abstract = jax.eval_shape(lambda: params)
    state = jax.eval_shape(optax.chain(optax.sm3(1e-2), optax.lbfgs(linesearch=None)).init, abstract)
    rows = {row.path: row for row in explain_opt_state(state, RULES, abstract, n_devices=2 * N_DEVICES).rows}
    assert rows["1/0/diff_params_memory/hidden/w"].expression == "a x y -> a x y*"
    assert rows["1/0/diff_params_memory/hidden/w"].shard_shape == (10, D_IN, HIDDEN // (2 * N_DEVICES))
    assert rows["1/0/diff_params_memory/hidden/w"].note == "stacks hidden/w (1 leading axis)"
    assert rows["0/0/mu/hidden/w/1"].expression == "y -> y*"
    assert rows["0/0/mu/hidden/w/1"].note == "reduces hidden/w (axis 0 reduced)"
    assert rows["0/0/mu/out/w/1"].expression == "z -> * z"
    assert rows["1/0/weights_memory"].note == "mirrors no parameter: replicated"


def test_optax_says_where_the_parameter_copies_are_when_the_optimizer_is_at_hand(params, sharded):
    # A state tree shaped like the params that is not a copy of them: a table of constants.
    table = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), params)

    def init(p):
        return {"copy": jax.tree.map(jnp.zeros_like, p), "table": jax.tree.map(jnp.copy, table)}

    tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    born = init_opt_state(tx, sharded)
    assert born["copy"]["hidden"]["w"].sharding == sharded["hidden"]["w"].sharding
    assert born["table"]["hidden"]["w"].sharding.is_fully_replicated  # optax: not a parameter copy
    notes = {row.path: row.note for row in explain_opt_state(born, params=sharded, tx=tx).rows}
    assert notes["table/hidden/w"] == "mirrors no parameter: replicated"
    # Without the optimizer, structure alone cannot tell them apart.
    assert shard_opt_state(born, sharded)["table"]["hidden"]["w"].sharding == sharded["hidden"]["w"].sharding


def test_optax_tree_map_params_hands_over_whole_parameter_copies(params):
    # einshard relies on this documented use of optax's is_leaf: f sees each copy of the params whole.
    tx = optax.adam(1e-2)
    seen = []
    optax.tree_utils.tree_map_params(tx, seen.append, tx.init(params), is_leaf=lambda _: True)
    assert [jax.tree.structure(copy) for copy in seen] == [jax.tree.structure(params)] * 2


def test_adafactor_reduces_the_axes_einshard_assumes():
    # einshard follows optax's private choice of factored axes: v_row is the mean over axis 1 and
    # v_col over axis 0, also for a square parameter (optax._src.factorized._factored_dims).
    size = 8 * N_DEVICES
    grads = {"w": jnp.arange(1.0, size * size + 1).reshape(size, size) ** 0.5}
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    _, state = tx.update(grads, tx.init(grads), grads)
    squared = np.asarray(grads["w"]) ** 2
    v_row, v_col = np.asarray(state[0].v_row["w"]), np.asarray(state[0].v_col["w"])
    np.testing.assert_allclose(v_row / v_row[0], squared.mean(1) / squared.mean(1)[0], rtol=1e-4)
    np.testing.assert_allclose(v_col / v_col[0], squared.mean(0) / squared.mean(0)[0], rtol=1e-4)


def test_large_state_no_layout_follows_for_warns(sharded):
    big = {"stat": jnp.zeros((512, 1024)), "mu": jax.tree.map(jnp.zeros_like, sharded)}  # 2 MiB stat
    with pytest.warns(einshard.EinshardWarning, match=r"1 optimizer state leaves \(2\.0 MiB\) follow no"):
        placed = shard_opt_state(big, sharded)
    assert placed["stat"].sharding.is_fully_replicated
    small = {"stat": jnp.zeros((4, 4)), "mu": jax.tree.map(jnp.zeros_like, sharded)}
    shard_opt_state(small, sharded)  # below the bar: no warning (warnings are errors here)
    notes = {row.path: row.note for row in explain_opt_state(big, params=sharded).rows}
    assert notes["stat"] == "mirrors no parameter: replicated"


def test_derived_expressions_spell_out_an_ellipsis():
    params = {"w": jax.ShapeDtypeStruct((3, 8 * N_DEVICES, 16), jnp.float32)}
    state = jax.eval_shape(optax.chain(optax.sm3(1e-2), optax.lbfgs(linesearch=None)).init, params)
    rows = {row.path: row for row in explain_opt_state(state, {"w": "... o i -> ... o* i"}, params).rows}
    assert rows["1/0/diff_params_memory/w"].expression == "b a o i -> b a o* i"
    assert rows["1/0/diff_params_memory/w"].shard_shape == (10, 3, 8, 16)
    assert rows["0/0/mu/w/1"].expression == "o -> o*"
    assert rows["0/0/mu/w/1"].note == "reduces w (axes 0, 2 reduced)"
    assert rows["0/0/mu/w/2"].expression == "i -> * i"


def test_explain_opt_state_takes_the_rules_second_and_the_earlier_order_still_works():
    """One order: rules second. The earlier order (params second) warns and gives the same rows."""
    params = {"w": jax.ShapeDtypeStruct((16, 8 * N_DEVICES), jnp.float32)}
    state = jax.eval_shape(optax.adam(1e-3).init, params)
    rules = [("w", "x y -> x y*")]
    new = explain_opt_state(state, rules, params, n_devices=N_DEVICES)
    with pytest.warns(einshard.EinshardDeprecationWarning, match="takes the rules second now"):
        old = explain_opt_state(state, params, rules, n_devices=N_DEVICES)
    assert old == new
    strategy = einshard.strategies.fsdp(min_bytes=0)  # a Strategy is a table too
    assert explain_opt_state(state, strategy, params, n_devices=N_DEVICES).rows
    with pytest.warns(einshard.EinshardDeprecationWarning, match="takes the rules second now"):
        assert explain_opt_state(state, params, strategy, n_devices=N_DEVICES).rows
    with pytest.raises(EinshardError, match="needs the parameters the optimizer state belongs to"):
        explain_opt_state(state, einshard.Rules(rules), n_devices=N_DEVICES)
