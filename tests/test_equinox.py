"""The Equinox integration: whole modules by rules, per-layer decorators, born-sharded construction.

A 2-layer MLP with the Megatron layout (column-parallel then row-parallel
Linear, the hidden axis split in both weights) is built from decorated
layers, sharded, born sharded and trained; every leaf must have the layout
its rule gives, nothing sharded may be whole on a device, training must
match an unsharded run, and the compiled step must not gather a weight.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

from layouts import (  # noqa: E402
    REPLICATE,
    all_gather_shapes,
    assert_follows,
    assert_layout,
    assert_never_whole,
    assert_trees_close,
)

import einshard  # noqa: E402
from conftest import N_DEVICES  # noqa: E402
from einshard.integrations import optax as einshard_optax  # noqa: E402
from einshard.integrations.equinox import (  # noqa: E402
    create_sharded,
    field_expressions,
    module_rules,
    shard_module,
    sharded,
)

D_IN, HIDDEN, D_OUT, BATCH = 24, 8 * N_DEVICES, 10, 4
SHARDED_SHAPES = {(HIDDEN, D_IN), (HIDDEN,), (D_OUT, HIDDEN)}


@sharded(weight="... o i -> ... o* i", bias="... o -> ... o*", output="o -> o*")
class ColumnLinear(eqx.nn.Linear):
    """Splits the output features; called per example under vmap."""


@sharded(weight="... o i -> ... o i*", output="o -> * o")
class RowLinear(eqx.nn.Linear):
    """Splits the input features; its output is replicated (after the all-reduce)."""


class MLP(eqx.Module):
    layers: tuple
    activation: object
    depth: int = eqx.field(static=True)

    def __init__(self, key, column=ColumnLinear, row=RowLinear):
        k1, k2 = jax.random.split(key)
        self.layers = (column(D_IN, HIDDEN, key=k1), row(HIDDEN, D_OUT, key=k2))
        self.activation = jax.nn.relu
        self.depth = 2

    def __call__(self, x):
        return self.layers[1](self.activation(self.layers[0](x)))


MLP_RULES = [
    (r"(^|/)layers/0/weight$", "... o i -> ... o* i"),
    (r"(^|/)layers/0/bias$", "... o -> ... o*"),
    (r"(^|/)layers/1/weight$", "... o i -> ... o i*"),
    (r".*", REPLICATE),
]


def plain_mlp(key):
    return MLP(key, eqx.nn.Linear, eqx.nn.Linear)


# --- helpers -------------------------------------------------------------------


def data(seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (BATCH, D_IN)), jax.random.normal(ky, (BATCH, D_OUT))


def make_step(tx):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


# --- decorators ------------------------------------------------------------------


def test_a_decorated_layer_is_placed_when_built_and_stays_a_module():
    layer = ColumnLinear(D_IN, HIDDEN, key=jax.random.key(0))
    assert type(layer) is ColumnLinear and isinstance(layer, eqx.nn.Linear)
    assert_layout(layer.weight, "o i -> o* i")
    assert_layout(layer.bias, "o -> o*")
    assert (layer.in_features, layer.out_features, layer.use_bias) == (D_IN, HIDDEN, True)
    assert [f.name for f in dataclasses.fields(layer)] == [f.name for f in dataclasses.fields(eqx.nn.Linear)]
    reference = eqx.nn.Linear(D_IN, HIDDEN, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(layer.weight), np.asarray(reference.weight))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.weight = layer.weight  # pyright: ignore[reportAttributeAccessIssue]
    # Rebuilt by tree_unflatten (tree_at, jit outputs): not re-placed, and tree_at works.
    replaced = eqx.tree_at(lambda m: m.bias, layer, jnp.ones(HIDDEN))
    assert type(replaced) is ColumnLinear and replaced.bias.sharding.is_fully_replicated
    no_bias = ColumnLinear(D_IN, HIDDEN, use_bias=False, key=jax.random.key(0))
    assert no_bias.bias is None


def test_the_output_constraint_sees_one_example_under_vmap():
    layer = ColumnLinear(D_IN, HIDDEN, key=jax.random.key(0))
    x = jnp.ones((BATCH, D_IN))
    out = jax.jit(jax.vmap(layer))(x)
    assert_layout(out, "b o -> b o*")
    np.testing.assert_allclose(np.asarray(out), np.asarray(x @ layer.weight.T + layer.bias), rtol=1e-5)

    @sharded(output="b o -> b o*")
    class BatchedColumn(ColumnLinear):  # called on the batch directly: the batch axis is named
        def __call__(self, x, *, key=None):
            return x @ self.weight.T + self.bias

    batched = BatchedColumn(D_IN, HIDDEN, key=jax.random.key(0))
    call = eqx.filter_jit(lambda layer, x: layer(x))
    assert_layout(call(batched, x), "b o -> b o*")
    with pytest.raises(einshard.EinshardError, match=r"under jax\.vmap the expression sees one example"):
        call(batched, x[0])


def test_decorators_compose_into_one_model_wide_table():
    model = MLP(jax.random.key(0))
    rules = module_rules(model)
    assert rules.pairs() == tuple(MLP_RULES)
    assert_follows(eqx.filter(model, lambda leaf: leaf is not model.layers[1].bias), MLP_RULES[:3])
    report = einshard.explain(model, rules)
    assert [row.path for row in report.rows] == [
        "layers/0/weight",
        "layers/0/bias",
        "layers/1/weight",
        "layers/1/bias",
    ]
    assert report.rows[0].shard_shape == (HIDDEN // N_DEVICES, D_IN)
    assert not report.unused_rules
    # shard_module uses the composed table when given none; non-array fields survive.
    reference = plain_mlp(jax.random.key(0))
    on_one = jax.tree.map(
        lambda leaf: jax.device_put(leaf, jax.devices()[0]) if eqx.is_array(leaf) else leaf, model
    )
    placed = shard_module(on_one)
    assert_follows(placed, MLP_RULES)
    assert placed.activation is jax.nn.relu and placed.depth == 2
    with pytest.raises(einshard.EinshardError, match="no layers decorated with @sharded"):
        shard_module(reference)
    assert module_rules(reference).pairs() == ((r".*", REPLICATE),)
    assert module_rules(reference, default=None).pairs() == ()


def test_module_rules_match_a_step_s_paths_and_never_take_another_layer():
    """(^|/) lets the table match explain_step's 'model/...' paths; a rule whose path another leaf
    of the model ends with (a nested plain layer) is anchored at the start, so it takes only its own."""

    class Inner(eqx.Module):
        up: eqx.nn.Linear

    class Outer(eqx.Module):
        up: ColumnLinear
        inner: Inner

    key = jax.random.key(0)
    model = Outer(ColumnLinear(D_IN, HIDDEN, key=key), Inner(eqx.nn.Linear(D_IN, HIDDEN, key=key)))
    rules = module_rules(model)
    assert rules.pairs()[:2] == ((r"^up/weight$", "... o i -> ... o* i"), (r"^up/bias$", "... o -> ... o*"))
    report = einshard.explain(model, rules)
    shards = {row.path: row.shard_shape for row in report.rows}
    assert shards["up/weight"] == (HIDDEN // N_DEVICES, D_IN)
    assert shards["inner/up/weight"] == (HIDDEN, D_IN)  # the plain layer is not taken by up's rule
    mlp_rules = module_rules(MLP(key))
    assert all(pattern.startswith("(^|/)") for pattern, _ in mlp_rules.pairs()[:-1])
    step_paths = {f"model/{row.path}" for row in einshard.explain(MLP(key), mlp_rules).rows}
    assert all(any(re.search(p, path) for path in step_paths) for p, _ in mlp_rules.pairs())


def test_subclasses_inherit_and_may_override():
    class Inherits(ColumnLinear):
        pass

    @sharded(weight="... o i -> ... o i*", bias=None)
    class Overrides(ColumnLinear):
        pass

    checks = []

    @sharded(bias="... o -> ... * o")
    class WithOwnInit(ColumnLinear):
        scale: float

        def __init__(self, scale, *, key):
            super().__init__(D_IN, HIDDEN, key=key)
            self.scale = scale

        def __check_init__(self):
            checks.append(self.scale)

    key = jax.random.key(0)
    assert field_expressions(Inherits) == field_expressions(ColumnLinear)
    assert_layout(Inherits(D_IN, HIDDEN, key=key).weight, "o i -> o* i")
    overrides = Overrides(HIDDEN, HIDDEN, key=key)
    assert_layout(overrides.weight, "o i -> o i*")
    assert field_expressions(Overrides) == {"weight": "... o i -> ... o i*", "output": "o -> o*"}
    own = WithOwnInit(0.5, key=key)
    assert checks == [0.5] and own.scale == 0.5
    assert_layout(own.weight, "o i -> o* i")
    assert_layout(own.bias, "o -> * o")
    assert field_expressions(ColumnLinear)["bias"] == "... o -> ... o*"  # the base is unchanged

    class Model(eqx.Module):
        layers: list

        def __init__(self, key):
            self.layers = [Overrides(HIDDEN, HIDDEN, key=key), WithOwnInit(2.0, key=key)]

    assert module_rules(Model(key), default=None).pairs() == (
        (r"(^|/)layers/0/weight$", "... o i -> ... o i*"),
        (r"(^|/)layers/1/weight$", "... o i -> ... o* i"),
        (r"(^|/)layers/1/bias$", "... o -> ... * o"),
    )


def test_decorator_mistakes_are_clear_errors():
    with pytest.raises(einshard.EinshardError, match="has no field 'wieght'"):
        sharded(wieght="o i -> o* i")(type("Bad", (eqx.nn.Linear,), {"__module__": __name__}))
    with pytest.raises(einshard.EinshardError, match="is static"):
        sharded(in_features="... -> * ...")(type("Bad", (eqx.nn.Linear,), {"__module__": __name__}))
    with pytest.raises(einshard.EinshardError, match="for every user of it") as info:
        sharded(weight="o i -> o* i")(eqx.nn.Linear)
    assert "class ShardedLinear(equinox.nn.Linear): pass" in str(info.value)  # the public path
    with pytest.raises(einshard.EinshardError, match="the expression for 'weight' is an int, not a string"):
        sharded(weight=4)
    with pytest.raises(einshard.EinshardError, match="not on the left"):
        sharded(weight="o i -> o z*")
    with pytest.raises(einshard.EinshardError, match=r"eqx\.Module subclass"):
        sharded(weight="o i -> o* i")(dict)

    @sharded(weight="o i -> o i*")
    class Indivisible(eqx.nn.Linear):
        pass

    with pytest.raises(einshard.EinshardError, match="while building Indivisible: field 'weight'"):
        Indivisible(N_DEVICES + 1, 4, key=jax.random.key(0))


def test_building_inside_a_trace_gives_constraints():
    abstract = eqx.filter_eval_shape(MLP, jax.random.key(0))
    assert isinstance(abstract.layers[0].weight, jax.ShapeDtypeStruct)
    assert module_rules(abstract).pairs() == tuple(MLP_RULES)
    structs = shard_module(abstract)
    assert_layout(structs.layers[0].weight, "o i -> o* i")
    built = jax.jit(lambda key: eqx.filter(MLP(key), eqx.is_array))(jax.random.key(0))
    assert_follows(built, MLP_RULES)  # the constraints decided the jit's output layouts


# --- Equinox's own layers, by rules ----------------------------------------------


def test_eqx_nn_layers_are_sharded_by_rules():
    key = jax.random.key(0)
    width = 8 * N_DEVICES
    mlp = eqx.nn.MLP(D_IN, D_OUT, width, 2, key=key)
    attention = eqx.nn.MultiheadAttention(4, width, key=key)
    model = {
        "mlp": mlp,
        "attn": attention,
        "embed": eqx.nn.Embedding(50, width, key=key),
        "norm": eqx.nn.LayerNorm(width),
    }
    rules = [
        (r"mlp/layers/0/weight$", "o i -> o* i"),
        (r"mlp/layers/0/bias$", "o -> o*"),
        (r"mlp/layers/1/weight$", "o i -> o* i"),
        (r"mlp/layers/2/weight$", "o i -> o i*"),
        (r"attn/(query|key|value)_proj/weight$", "o i -> o* i"),
        (r"attn/output_proj/weight$", "o i -> o i*"),
        (r"embed/weight$", "v d -> v d*"),
        (r".*", REPLICATE),
    ]
    placed = shard_module(model, rules)
    paths = assert_follows(placed, rules)
    assert "attn/query_proj/weight" in paths and "norm/weight" in paths
    assert placed["mlp"].activation is mlp.activation
    assert placed["mlp"].final_activation is mlp.final_activation
    assert placed["attn"].dropout.p == attention.dropout.p
    assert placed["attn"].num_heads == 4 and placed["norm"].eps == model["norm"].eps
    assert_trees_close(placed, model, rtol=0, atol=0)
    x = jax.random.normal(key, (3, width))
    out = eqx.filter_jit(lambda m, x: m["attn"](x, x, x))(placed, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attention(x, x, x)), rtol=1e-5, atol=1e-5)


def test_rules_that_miss_a_field_name_its_path():
    with pytest.raises(einshard.EinshardError, match="layers/1/bias"):
        shard_module(plain_mlp(jax.random.key(0)), MLP_RULES[:3])


# --- stacked layers ------------------------------------------------------------


def test_stacked_layers_use_ellipsis():
    n_layers = 3
    keys = jax.random.split(jax.random.key(0), n_layers)
    stacked = eqx.filter_vmap(lambda key: ColumnLinear(HIDDEN, HIDDEN, key=key))(keys)
    assert stacked.weight.shape == (n_layers, HIDDEN, HIDDEN)
    rules = module_rules(stacked)
    assert rules.pairs()[0] == (r"(^|/)weight$", "... o i -> ... o* i")
    placed = shard_module(stacked)
    assert_layout(placed.weight, "l o i -> l o* i")
    assert_layout(placed.bias, "l o -> l o*")
    born = create_sharded(eqx.filter_vmap(lambda key: ColumnLinear(HIDDEN, HIDDEN, key=key)), None, keys)
    assert_follows(born, rules)
    assert_trees_close(born, placed, rtol=0, atol=0)

    @eqx.filter_jit
    def forward(layers, x):
        params, static = eqx.partition(layers, eqx.is_array)

        def body(h, layer_params):
            return jax.nn.tanh(jax.vmap(eqx.combine(layer_params, static))(h)), None

        return jax.lax.scan(body, x, params)[0]

    x = jax.random.normal(jax.random.key(1), (BATCH, HIDDEN))
    expected = x
    for i in range(n_layers):
        expected = jnp.tanh(expected @ np.asarray(stacked.weight[i]).T + np.asarray(stacked.bias[i]))
    np.testing.assert_allclose(np.asarray(forward(placed, x)), np.asarray(expected), rtol=1e-4, atol=1e-5)


# --- born sharded ----------------------------------------------------------------


def test_create_sharded_is_born_sharded_with_the_unsharded_values():
    model = create_sharded(MLP, None, jax.random.key(0))
    assert type(model) is MLP and model.activation is jax.nn.relu and model.depth == 2
    assert_follows(model, MLP_RULES)
    assert_never_whole(model, MLP_RULES)
    assert_trees_close(model, plain_mlp(jax.random.key(0)), rtol=0, atol=0)
    # Explicit rules, on Equinox's own MLP.
    rules = [(r"layers/0/weight$", "o i -> o* i"), (r"layers/1/weight$", "o i -> o i*"), (r".*", REPLICATE)]
    mlp = create_sharded(eqx.nn.MLP, rules, D_IN, D_OUT, HIDDEN, 1, key=jax.random.key(2))
    assert_follows(mlp, rules)
    assert_never_whole(mlp, rules)
    assert_trees_close(mlp, eqx.nn.MLP(D_IN, D_OUT, HIDDEN, 1, key=jax.random.key(2)), rtol=0, atol=0)
    with pytest.raises(einshard.EinshardError, match="no layers decorated"):
        create_sharded(plain_mlp, None, jax.random.key(0))


# --- training --------------------------------------------------------------------


def test_train_steps_match_unsharded():
    x, y = data()
    tx = optax.adamw(1e-2)
    step = make_step(tx)
    model = create_sharded(MLP, None, jax.random.key(0))
    opt_state = einshard_optax.init_opt_state(tx, eqx.filter(model, eqx.is_array))
    reference = plain_mlp(jax.random.key(0))
    reference_state = tx.init(eqx.filter(reference, eqx.is_array))

    losses, expected = [], []
    for _ in range(3):
        model, opt_state, loss = step(model, opt_state, x, y)
        reference, reference_state, reference_loss = step(reference, reference_state, x, y)
        losses.append(float(loss))
        expected.append(float(reference_loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert_trees_close(model, reference)
    assert_trees_close(opt_state, reference_state)
    assert_follows(model, MLP_RULES)  # the steps kept every layout
    assert opt_state[0].mu.layers[0].weight.sharding == model.layers[0].weight.sharding
    assert opt_state[0].count.sharding.is_fully_replicated
    assert model.activation is jax.nn.relu


def test_compiled_step_gathers_no_weight():
    x, y = data()
    tx = optax.adamw(1e-2)
    model = create_sharded(MLP, None, jax.random.key(0))
    opt_state = einshard_optax.init_opt_state(tx, eqx.filter(model, eqx.is_array))
    hlo = make_step(tx).lower(model, opt_state, x, y).compile().compiled.as_text()  # eqx wraps jax's
    assert "all-reduce" in hlo  # the row-parallel matmul's partial sums
    assert not SHARDED_SHAPES & set(all_gather_shapes(hlo))


def test_the_decorator_builds_a_subclass_through_equinox_and_leaves_the_written_class_alone():
    # Equinox's development line collects each class's __check_init__ once, when it builds the
    # class: the placing hook must be in a class Equinox builds, not patched in afterwards.
    class Written(eqx.nn.Linear):
        pass

    Placed = sharded(weight="o i -> o* i")(Written)
    assert Placed.__bases__ == (Written,) and type(Placed) is type(Written)
    assert Placed.__name__ == "Written" and Placed.__module__ == Written.__module__
    assert "__check_init__" in Placed.__dict__ and "__check_init__" not in Written.__dict__
    assert [f.name for f in dataclasses.fields(Placed)] == [f.name for f in dataclasses.fields(Written)]
    assert_layout(Placed(D_IN, HIDDEN, key=jax.random.key(0)).weight, "o i -> o* i")
    assert len(Written(D_IN, HIDDEN, key=jax.random.key(0)).weight.sharding.device_set) == 1
    # A class that subclasses the decorated one, built later, places too (its MRO has the hook).
    assert_layout(
        type("Later", (Placed,), {"__module__": __name__})(D_IN, HIDDEN, key=jax.random.key(0)).weight,
        "o i -> o* i",
    )


def test_a_filter_jit_step_is_reported_and_planned_on_abstract_arguments():
    """equinox.filter_jit holds a ShapeDtypeStruct static, as anything not an array: a report of
    such a step on abstract arguments (and every plan, which lays them out as structs) compiles
    it inside einshard's own jit, as it does for concrete ones, with the same figures."""

    @eqx.filter_jit
    def step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))

    model = eqx.nn.MLP(16, 16, 8 * N_DEVICES, 1, key=jax.random.key(0))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if eqx.is_array(a) else a, model)
    x = jnp.ones((8 * N_DEVICES, 16))
    fsdp = einshard.strategies.fsdp(min_bytes=0)
    concrete = einshard.explain_step(step, model, x, rules=fsdp)
    structs = einshard.explain_step(step, abstract, jax.ShapeDtypeStruct(x.shape, x.dtype), rules=fsdp)
    assert concrete.rows and [(r.kind, r.shape) for r in structs.rows] == [
        (r.kind, r.shape) for r in concrete.rows
    ]
    assert structs.peak_bytes == concrete.peak_bytes and structs.donated == "model"
    plan = einshard.plan(
        step, abstract, x, candidates=[einshard.strategies.data_parallel(), fsdp], quiet=True
    )
    assert [row.rejected for row in plan.rows] == [None, None]
