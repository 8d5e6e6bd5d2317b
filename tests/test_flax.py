"""The Flax integration: NNX modules and optimizers, linen variables and train states.

A 2-layer MLP with the Megatron layout (hidden axis split in both weights) is
sharded, born sharded and trained, in NNX and in linen; every leaf must have
the layout its rule gives, nothing sharded may be whole on a device, training
must match an unsharded run, and the compiled step must not gather a weight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from layouts import (  # noqa: E402
    REPLICATE,
    all_gather_shapes,
    assert_follows,
    assert_layout,
    assert_never_whole,
    assert_trees_close,
    leaves,
)

import einshard  # noqa: E402
from conftest import N_DEVICES  # noqa: E402
from einshard.integrations.flax import (  # noqa: E402
    create_optimizer,
    create_sharded,
    create_train_state,
    init_sharded,
    shard_module,
    shard_optimizer,
    state_tree,
)

D_IN, HIDDEN, D_OUT, BATCH = 24, 8 * N_DEVICES, 10, 4
SHARDED_SHAPES = {(D_IN, HIDDEN), (HIDDEN,), (HIDDEN, D_OUT)}

NNX_RULES = [
    (r"linear1/kernel$", "x y -> x y*"),
    (r"linear1/bias$", "y -> y*"),
    (r"linear2/kernel$", "y z -> y* z"),
    (r".*", REPLICATE),
]
LINEN_RULES = [
    (r"Dense_0/kernel$", "x y -> x y*"),
    (r"Dense_0/bias$", "y -> y*"),
    (r"Dense_1/kernel$", "y z -> y* z"),
    (r".*", REPLICATE),
]


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, dropout: float = 0.0):
        self.linear1 = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.linear2 = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        h = jax.nn.relu(self.linear1(x))
        if self.dropout is not None:
            h = self.dropout(h)
        return self.linear2(h)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(HIDDEN)(x))  # Dense_0
        return nn.Dense(D_OUT)(h)  # Dense_1


# --- helpers -------------------------------------------------------------------


def data(seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (BATCH, D_IN)), jax.random.normal(ky, (BATCH, D_OUT))


def nnx_train_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def linen_train_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


# --- NNX -----------------------------------------------------------------------


def test_shard_module_places_every_variable_by_its_rule_in_place():
    model = MLP(rngs=nnx.Rngs(0), dropout=0.1)
    expected = jax.tree.map(np.asarray, state_tree(model))
    assert shard_module(model, NNX_RULES) is model
    paths = assert_follows(state_tree(model), NNX_RULES)
    assert paths == ["linear1/bias", "linear1/kernel", "linear2/bias", "linear2/kernel"]
    assert_never_whole(state_tree(model), NNX_RULES)
    assert_trees_close(state_tree(model), expected, rtol=0, atol=0)
    # The RNG state is replicated, not matched against the rules.
    assert_layout(model.dropout.rngs.key[...], REPLICATE)
    assert_layout(model.dropout.rngs.count[...], REPLICATE)


def test_state_tree_and_explain_plan_an_abstract_model():
    abstract = nnx.eval_shape(lambda: MLP(rngs=nnx.Rngs(0), dropout=0.1))
    report = einshard.explain(state_tree(abstract), NNX_RULES, n_devices=8 * N_DEVICES)  # more than we have
    assert [row.path for row in report.rows] == [
        "linear1/bias",
        "linear1/kernel",
        "linear2/bias",
        "linear2/kernel",
    ]
    assert report.rows[1].shard_shape == (D_IN, 1)
    assert report.rows[3].shard_shape == (1, D_OUT)
    assert not report.unused_rules


def test_shard_module_says_what_is_not_an_nnx_object():
    with pytest.raises(einshard.EinshardError, match="Dense object is not an NNX object") as info:
        shard_module(nn.Dense(16), NNX_RULES)
    assert "einshard.shard_pytree(module.init(...), rules)" in str(info.value)
    with pytest.raises(einshard.EinshardError, match="int object is not an NNX object"):
        state_tree(3)


def test_shard_module_on_an_abstract_model_gives_sharded_structs():
    abstract = shard_module(nnx.eval_shape(lambda: MLP(rngs=nnx.Rngs(0))), NNX_RULES)
    kernel = abstract.linear1.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert_layout(kernel, "x y -> x y*")


def test_rules_that_miss_a_variable_name_its_path():
    rules = [(r"kernel$", "x y -> x y*")]
    with pytest.raises(einshard.EinshardError, match="linear1/bias") as caught:
        shard_module(MLP(rngs=nnx.Rngs(0)), rules)
    assert "in the state of" in str(caught.value)
    assert "value" not in str(caught.value).split("rules tried")[0]


def test_rng_state_is_replicated_whatever_the_rules():
    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
            self.streams = nnx.Rngs(1).split(4)  # key and count arrays of shape (4,)

    rules = einshard.Rules([(r"kernel$", "x y -> x y*"), (r"bias$", "y -> y*")], unmatched="error")
    model = shard_module(Noisy(nnx.Rngs(0)), rules)
    assert model.streams.default.key[...].shape == (4,)
    assert_layout(model.streams.default.key[...], REPLICATE)
    assert_layout(model.streams.default.count[...], REPLICATE)
    assert_layout(model.linear.kernel[...], "x y -> x y*")
    born = create_sharded(Noisy, rules, nnx.Rngs(0))
    assert_layout(born.streams.default.key[...], REPLICATE)
    assert_layout(born.linear.kernel[...], "x y -> x y*")


def test_optimizer_state_is_sharded_by_the_same_rules():
    model = shard_module(MLP(rngs=nnx.Rngs(0)), NNX_RULES)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    assert shard_module(optimizer, NNX_RULES) is optimizer
    paths = assert_follows(state_tree(optimizer), NNX_RULES)
    assert "opt_state/0/mu/linear1/kernel" in paths
    assert "opt_state/0/nu/linear2/kernel" in paths
    assert {"step", "opt_state/0/count"} <= set(paths)
    assert_never_whole(state_tree(optimizer), NNX_RULES)


def test_create_sharded_is_born_sharded_with_the_unsharded_values():
    rngs, expected_rngs = nnx.Rngs(0), nnx.Rngs(0)
    model = create_sharded(MLP, NNX_RULES, rngs=rngs, dropout=0.1)
    expected = MLP(rngs=expected_rngs, dropout=0.1)
    assert_follows(state_tree(model), NNX_RULES)
    assert_never_whole(state_tree(model), NNX_RULES)
    assert_trees_close(state_tree(model), state_tree(expected), rtol=0, atol=0)
    assert_layout(model.dropout.rngs.key[...], REPLICATE)
    # The Rngs argument advanced as an eager construction advances it.
    assert int(rngs.default.count[...]) == int(expected_rngs.default.count[...]) > 0
    # A factory that builds its own Rngs works too.
    same = create_sharded(lambda: MLP(rngs=nnx.Rngs(0)), NNX_RULES)
    assert_trees_close(state_tree(same), state_tree(MLP(rngs=nnx.Rngs(0))), rtol=0, atol=0)


class AnnotatedMLP(nnx.Module):
    """Flax's logical-axis annotations, which need a mesh to build eagerly."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(
            D_IN, HIDDEN, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.linear2 = nnx.Linear(
            HIDDEN, D_OUT, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
        )


def test_create_sharded_builds_an_annotated_model_by_the_rules():
    model = create_sharded(AnnotatedMLP, NNX_RULES, rngs=nnx.Rngs(0))
    assert_follows(state_tree(model), NNX_RULES)
    assert_never_whole(state_tree(model), NNX_RULES)
    with nnx.use_eager_sharding(False):
        expected = AnnotatedMLP(rngs=nnx.Rngs(0))
    # Compiled, the initializer's scaling may round differently in the last bit.
    assert_trees_close(state_tree(model), state_tree(expected), rtol=1e-6, atol=0)
    # The annotations stay, as metadata.
    assert model.linear1.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


def test_create_sharded_builds_a_sharded_optimizer():
    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    optimizer = create_sharded(nnx.Optimizer, NNX_RULES, model, optax.adamw(1e-2), wrt=nnx.Param)
    assert isinstance(optimizer, nnx.Optimizer)
    assert_follows(state_tree(optimizer), NNX_RULES)
    assert_never_whole(state_tree(optimizer), NNX_RULES)
    both = create_sharded(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)))(MLP(rngs=nnx.Rngs(0))),
        NNX_RULES,
    )
    assert_follows(state_tree(both), NNX_RULES)


class Head(nnx.Module):
    """A module built around a model it is given: the two share the model's variables."""

    def __init__(self, body: MLP, *, rngs: nnx.Rngs):
        self.body = body
        self.out = nnx.Linear(D_OUT, D_OUT, rngs=rngs)


def test_create_sharded_keeps_an_argument_shared_and_advances_its_rngs():
    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    kernel = model.linear1.kernel
    rngs, expected_rngs = nnx.Rngs(1), nnx.Rngs(1)
    head = create_sharded(Head, NNX_RULES, model, rngs=rngs)
    # The result holds the argument itself, not a copy: a step on one updates the other.
    assert head.body is model and head.body.linear1.kernel is kernel
    expected = Head(MLP(rngs=nnx.Rngs(0)), rngs=expected_rngs)
    assert_trees_close(state_tree(head), state_tree(expected), rtol=0, atol=0)
    assert int(rngs.default.count[...]) == int(expected_rngs.default.count[...]) > 0
    assert_follows(state_tree(head), NNX_RULES)
    assert_never_whole(state_tree(head), NNX_RULES)


def test_create_optimizer_lays_the_state_out_like_the_model():
    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    optimizer = create_optimizer(model, optax.adamw(1e-2))
    assert isinstance(optimizer, nnx.Optimizer)
    assert_follows(state_tree(optimizer), NNX_RULES)  # the layout the rules give it
    assert_never_whole(state_tree(optimizer), NNX_RULES)
    expected = nnx.Optimizer(MLP(rngs=nnx.Rngs(0)), optax.adamw(1e-2), wrt=nnx.Param)
    assert_trees_close(state_tree(optimizer), state_tree(expected), rtol=0, atol=0)


def test_factored_optimizer_state_follows_the_model_not_the_rules():
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    with pytest.raises(einshard.EinshardError, match="opt_state/0/v"):
        shard_module(
            nnx.Optimizer(model, tx, wrt=nnx.Param), NNX_RULES
        )  # a kernel's rule does not fit its factored statistics
    born = create_optimizer(model, tx)
    placed = shard_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param), model)
    for optimizer in (born, placed):
        state = optimizer.opt_state[0]
        for kernel, other in (("linear1", D_IN), ("linear2", D_OUT)):
            # Of a kernel's two factored statistics, the one along the split hidden axis stays split.
            stats = [state.v_row[kernel]["kernel"][...], state.v_col[kernel]["kernel"][...]]
            assert {stat.shape for stat in stats} == {(HIDDEN,), (other,)}
            for stat in stats:
                assert_layout(stat, "y -> y*" if stat.shape == (HIDDEN,) else REPLICATE)
        assert_layout(state.count[...], REPLICATE)
    step = nnx.jit(nnx_train_step)
    assert np.isfinite(float(step(model, born, *data())))


def test_optimizer_state_paths_leave_out_nnx_value_everywhere():
    """Paths read the same in explain and explain_opt_state: no `value` of an NNX variable."""
    from einshard.integrations.optax import explain_opt_state

    params = einshard.shard_pytree(nnx.state(MLP(rngs=nnx.Rngs(0)), nnx.Param), NNX_RULES)
    state = optax.adam(1e-3).init(params)  # its moments hold NNX variables, as the params do
    rows = explain_opt_state(state, params=params).rows
    paths = {f"{layer}/{name}" for layer in ("linear1", "linear2") for name in ("kernel", "bias")}
    assert {row.path for row in einshard.explain(params, NNX_RULES).rows} == paths
    assert {row.path for row in rows} >= {"0/mu/linear1/kernel", "0/nu/linear2/kernel"}
    assert not [row.path for row in rows if "value" in row.path.split("/")]


def test_create_sharded_under_an_explicit_ambient_mesh():
    shape = (2, N_DEVICES // 2)
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    kernel = model.linear1.kernel[...]
    assert kernel.sharding.mesh == mesh
    assert_follows(state_tree(model), NNX_RULES)


def test_nnx_train_steps_match_unsharded():
    x, y = data()
    step = nnx.jit(nnx_train_step)

    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    optimizer = create_sharded(nnx.Optimizer, NNX_RULES, model, optax.adamw(1e-2), wrt=nnx.Param)
    reference = MLP(rngs=nnx.Rngs(0))
    reference_optimizer = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)

    losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    expected = [float(step(reference, reference_optimizer, x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert_trees_close(state_tree(model), state_tree(reference))
    assert_trees_close(state_tree(optimizer), state_tree(reference_optimizer))
    # The steps kept every layout.
    assert_follows(state_tree(model), NNX_RULES)
    assert_follows(state_tree(optimizer), NNX_RULES)


def test_nnx_dropout_model_trains_sharded():
    x, y = data()
    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0), dropout=0.5)
    optimizer = create_sharded(nnx.Optimizer, NNX_RULES, model, optax.adamw(1e-2), wrt=nnx.Param)
    step = nnx.jit(nnx_train_step)
    losses = [float(step(model, optimizer, x, y)) for _ in range(2)]
    assert all(np.isfinite(losses))
    assert int(model.dropout.rngs.count[...]) == 2
    assert_layout(model.dropout.rngs.key[...], REPLICATE)
    assert_follows(state_tree(model), NNX_RULES)


def test_all_gather_shapes_finds_a_whole_weight_gather():
    w = einshard.einshard(jnp.ones((D_IN, HIDDEN)), "x y -> x y*")
    gather = jax.jit(lambda w: w * 2, out_shardings=einshard.make_sharding(REPLICATE, n_dims=2))
    assert (D_IN, HIDDEN) in all_gather_shapes(gather.lower(w).compile().as_text())


def test_nnx_compiled_step_gathers_no_weight():
    x, y = data()
    model = create_sharded(MLP, NNX_RULES, rngs=nnx.Rngs(0))
    optimizer = create_sharded(nnx.Optimizer, NNX_RULES, model, optax.adamw(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = nnx_train_step(model, optimizer, x, y)
        return loss, nnx.state((model, optimizer))

    hlo = step.lower(state, x, y).compile().as_text()
    assert "all-reduce" in hlo  # the second matmul's partial sums
    assert not SHARDED_SHAPES & set(all_gather_shapes(hlo))
    loss, state = step(state, x, y)
    nnx.update((model, optimizer), state)
    assert np.isfinite(float(loss))
    assert_follows(state_tree((model, optimizer)), NNX_RULES)


# --- linen ---------------------------------------------------------------------


def test_linen_variables_go_through_shard_pytree_as_they_are():
    x, _ = data()
    variables = LinenMLP().init(jax.random.key(0), x)
    placed = einshard.shard_pytree(variables, LINEN_RULES)
    paths = assert_follows(placed, LINEN_RULES)
    assert paths == [
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
    ]
    assert_trees_close(placed, variables, rtol=0, atol=0)


def test_linen_init_sharded_is_born_sharded_with_the_unsharded_values():
    x, _ = data()
    variables = init_sharded(LinenMLP(), LINEN_RULES, jax.random.key(0), x)
    assert_follows(variables, LINEN_RULES)
    assert_never_whole(variables, LINEN_RULES)
    assert_trees_close(variables, LinenMLP().init(jax.random.key(0), x), rtol=0, atol=0)


def test_linen_init_sharded_unboxes_partitioning_metadata():
    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return nn.Dense(HIDDEN, kernel_init=init)(x)

    x, _ = data()
    variables = init_sharded(Boxed(), LINEN_RULES, jax.random.key(0), x)
    assert [path for path, _ in leaves(variables)] == ["params/Dense_0/bias", "params/Dense_0/kernel"]
    assert_follows(variables, LINEN_RULES)


def test_linen_train_state_is_born_sharded_with_its_optax_state():
    x, _ = data()
    tx = optax.adamw(1e-2)
    state = create_train_state(LinenMLP(), LINEN_RULES, tx, jax.random.key(0), x)
    assert isinstance(state, train_state.TrainState)
    paths = assert_follows(state, LINEN_RULES)
    expected_paths = {"step", "params/Dense_0/kernel", "opt_state/0/mu/Dense_0/kernel", "opt_state/0/count"}
    assert expected_paths <= set(paths)
    assert_never_whole(state, LINEN_RULES)
    expected = train_state.TrainState.create(
        apply_fn=LinenMLP().apply, params=LinenMLP().init(jax.random.key(0), x)["params"], tx=tx
    )
    assert_trees_close(state, expected, rtol=0, atol=0)


def test_linen_train_state_keeps_collections_its_class_has():
    class BatchNormMLP(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            h = nn.BatchNorm(use_running_average=not train)(nn.Dense(HIDDEN)(x))
            return nn.Dense(D_OUT)(nn.relu(h))

    class State(train_state.TrainState):
        batch_stats: dict

    rules = [(r"BatchNorm_0/(mean|var|scale|bias)$", "y -> y*"), *LINEN_RULES]
    x, _ = data()
    key, tx = jax.random.key(0), optax.adam(1e-2)
    state = create_train_state(BatchNormMLP(), rules, tx, key, x, state_class=State)
    assert isinstance(state, State)
    assert_layout(state.batch_stats["BatchNorm_0"]["mean"], "y -> y*")
    assert_follows(state, rules)
    plain = create_train_state(BatchNormMLP(), rules, tx, key, x)
    assert not hasattr(plain, "batch_stats")


def test_linen_train_steps_match_unsharded_and_gather_no_weight():
    x, y = data()
    tx = optax.adamw(1e-2)
    state = create_train_state(LinenMLP(), LINEN_RULES, tx, jax.random.key(0), x)
    reference = train_state.TrainState.create(
        apply_fn=LinenMLP().apply, params=LinenMLP().init(jax.random.key(0), x)["params"], tx=tx
    )
    step = jax.jit(linen_train_step)
    hlo = step.lower(state, x, y).compile().as_text()
    assert not SHARDED_SHAPES & set(all_gather_shapes(hlo))

    losses, expected = [], []
    for _ in range(3):
        state, loss = step(state, x, y)
        reference, reference_loss = step(reference, x, y)
        losses.append(float(loss))
        expected.append(float(reference_loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert_trees_close(state.params, reference.params)
    assert_trees_close(state.opt_state, reference.opt_state)
    assert_follows(state, LINEN_RULES)
