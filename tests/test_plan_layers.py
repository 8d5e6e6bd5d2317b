"""Plans from a few layers: repeated layers found in the step, the step cut to a smaller depth,
candidates ranked from two small depths, and the winner compiled whole.

The cut step must be the program a model with fewer layers traces to (the same equations, after
dead code), and compile to the same figures; a plan that samples must pick the exhaustive plan's
winner, with each extrapolated figure within the band the plan states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import einshard
from einshard import strategies
from einshard._cost.pipeline._analysis import answer
from einshard._planning.search._sampled import DEPTHS
from einshard._tracing._blocks import MIN_BLOCKS, _needed, _signature, repeated_blocks
from einshard._tracing._call import StepCall
from einshard._tracing._depth import AtDepth, repeated_layers
from tests.test_targets import needs_gpu, needs_tpu

N = jax.device_count()
D, H, VOCAB, SEQ = 48, 96, 96, 8  # divisible by 6, 8 and 16 devices
OPTIMIZER = optax.adamw(1e-3)
CANDIDATES = [
    strategies.data_parallel(),
    strategies.fsdp(min_bytes=0),
    strategies.tensor_parallel(column=["up"], row=["down"]),
]


def _params(layers: int) -> dict:
    def layer() -> dict:
        return {
            "norm": jax.ShapeDtypeStruct((D,), jnp.float32),
            "up": {"kernel": jax.ShapeDtypeStruct((D, H), jnp.float32)},
            "down": {"kernel": jax.ShapeDtypeStruct((H, D), jnp.float32)},
        }

    return {
        "embed": jax.ShapeDtypeStruct((VOCAB, D), jnp.float32),
        "layers": [layer() for _ in range(layers)],
        "head": jax.ShapeDtypeStruct((D, VOCAB), jnp.float32),
    }


def _state(layers: int) -> dict:
    params = _params(layers)
    return {"params": params, "opt_state": jax.eval_shape(OPTIMIZER.init, params)}


def _loss(params: dict, tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens[:, :-1]]
    for layer in params["layers"]:  # unrolled, as Hugging Face's Flax models are
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * layer["norm"]
        x = x + jax.nn.gelu(h @ layer["up"]["kernel"]) @ layer["down"]["kernel"]
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def adamw_step(state: dict, batch: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(_loss)(state["params"], batch)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss


def _batch() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((4 * N, SEQ + 1), jnp.int32)


def _call(layers: int) -> StepCall:
    return StepCall.of(adamw_step, (_state(layers), _batch()), {})


def _program(jaxpr) -> list:
    """The equations that reach the outputs, as structure (dead code left out, inside a jit too:
    XLA leaves it out)."""
    seen: dict = {}
    program = []
    for eqn in _needed(jaxpr.eqns, jaxpr.outvars):
        inner = eqn.params.get("jaxpr")
        if eqn.primitive.name in ("pjit", "jit") and inner is not None:
            avals = [str(v.aval) for v in (*eqn.invars, *eqn.outvars)]
            program.append(("jit", avals, _program(inner.jaxpr)))
        else:
            program.append(_signature(eqn, seen))
    return program


def test_an_unrolled_step_s_layers_are_found_and_cut_to_the_program_of_fewer_layers():
    layers = 6
    closed = jax.make_jaxpr(adamw_step)(_state(layers), _batch())
    blocks = repeated_blocks(closed)
    assert not isinstance(blocks, str), blocks
    assert blocks.count == layers
    assert blocks.forward.end <= blocks.backward.start  # the forward pass, then its transpose
    for depth in range(2, layers):
        cut = blocks.at_depth(depth)
        jax.extend.core.check_jaxpr(cut.jaxpr.jaxpr)  # a valid program: no value read before it is made
        fewer = jax.make_jaxpr(adamw_step)(_state(depth), _batch())
        # The same inputs and outputs as the model written with `depth` layers, and the same program.
        assert len(cut.inputs) == len(fewer.jaxpr.invars)
        assert len(cut.outputs) == len(fewer.jaxpr.outvars)
        assert [str(closed.jaxpr.invars[i].aval) for i in cut.inputs] == [
            str(v.aval) for v in fewer.jaxpr.invars
        ]
        assert _program(cut.jaxpr.jaxpr) == _program(fewer.jaxpr)
    whole = blocks.at_depth(layers)
    assert whole.jaxpr is closed


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
@pytest.mark.parametrize("depth", DEPTHS)
def test_the_step_cut_to_a_depth_compiles_to_the_figures_of_the_model_with_that_many_layers(depth):
    whole = _call(6)
    for strategy in CANDIDATES:
        cut = answer(whole, AtDepth(strategy, depth)).report
        fewer = answer(_call(depth), strategy).report
        assert cut is not None and fewer is not None, strategy.name
        assert cut.flops == fewer.flops, strategy.name
        assert cut.bytes_by_kind == fewer.bytes_by_kind, strategy.name
        assert cut.peak_bytes == fewer.peak_bytes, strategy.name
        assert cut.argument_bytes == fewer.argument_bytes, strategy.name
        assert cut.alias_bytes == fewer.alias_bytes, strategy.name  # the state donated, as the whole step's
        assert cut.donated == fewer.donated == "state"


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_a_sampled_plan_picks_the_exhaustive_plan_s_winner_and_ranks_whole_compiles_only():
    args = (adamw_step, _state(8), _batch())
    figures = dict(bandwidth=1e9, flops_per_second=1e11, candidates=CANDIDATES, quiet=True)
    sampled = einshard.plan(*args, sample=True, **figures)
    whole = einshard.plan(*args, exhaustive=True, **figures)
    assert sampled.best.name == whole.best.name
    assert sampled.timings.samples == len(DEPTHS) * len(CANDIDATES)
    assert sampled.sampling is not None and "8 repeated layers" in sampled.sampling
    assert sampled.sampling in str(sampled)
    assert whole.sampling is None and whole.timings.samples == 0  # sampling only when asked
    by_name = {row.name: row for row in whole.rows}
    left_out = 0
    for row in sampled.rows:
        assert row.extrapolated is not None, row.name  # every candidate was sampled
        full = by_name[row.name]
        assert full.seconds is not None
        # On CPU devices the time (communication plus compute) adds up per layer: exact.
        assert row.extrapolated.least == pytest.approx(full.seconds, rel=1e-3), row.name
        if row.report is not None:  # compiled whole: the figures the exhaustive plan has
            assert row.seconds == pytest.approx(full.seconds, rel=1e-9)
            assert row.peak_bytes == full.peak_bytes
        else:  # left out: slower than the winner's whole compile, and its row says so
            left_out += 1
            assert row.rejected_for == "sampled"
            assert f"cannot beat {sampled.best.name}: at least" in row.rejected
            assert f"extrapolated from {DEPTHS[0]} and {DEPTHS[1]} of its 8 layers" in row.rejected
            assert full.seconds > whole.usable[0].seconds * (1 + einshard.Plan.tie)
    assert left_out >= 1  # tensor parallelism all-reduces activations at 1 GB/s: it cannot win
    assert sampled.rows[0].report is not None


def test_a_step_without_repeated_layers_is_compiled_whole_and_the_plan_says_why():
    def step(params, batch):
        grads = jax.grad(lambda p: jnp.mean((batch @ p["w"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"w": jax.ShapeDtypeStruct((16, 16), jnp.float32)}
    batch = jax.ShapeDtypeStruct((8 * N, 16), jnp.float32)
    found = repeated_layers(StepCall.of(step, (params, batch), {}))
    assert isinstance(found, str) and f"no run of {MIN_BLOCKS} or more identical layers" in found
    plan = einshard.plan(step, params, batch, candidates=CANDIDATES[:1], sample=True, quiet=True)
    assert plan.timings.samples == 0
    assert plan.sampling is not None and plan.sampling.startswith("Each candidate compiled whole")
    assert plan.sampling in str(plan)
    assert plan.rows[0].report is not None and plan.rows[0].extrapolated is None


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_a_step_that_calls_like_batch_is_not_sampled_and_the_plan_says_why():
    def step(state, batch):
        def loss(params):
            x = einshard.like_batch(params["embed"][batch[:, :-1]])
            for layer in params["layers"]:
                x = x + jax.nn.gelu(x @ layer["up"]["kernel"]) @ layer["down"]["kernel"]
            return jnp.mean((x @ params["head"]) ** 2)

        grads = jax.grad(loss)(state["params"])
        return {
            "params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads),
            "opt_state": state["opt_state"],
        }

    plan = einshard.plan(step, _state(6), _batch(), candidates=CANDIDATES[:1], sample=True, quiet=True)
    assert plan.sampling is not None and "like_batch" in plan.sampling
    assert plan.timings.samples == 0


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_a_plan_in_a_child_process_samples_as_in_this_one():
    args = (adamw_step, _state(6), _batch())
    here = einshard.plan(
        *args, sample=True, candidates=CANDIDATES, bandwidth=1e9, flops_per_second=1e11, quiet=True
    )
    child = einshard.plan(
        *args,
        sample=True,
        candidates=CANDIDATES,
        bandwidth=1e9,
        flops_per_second=1e11,
        quiet=True,
        isolate=True,
    )
    assert child.timings.children >= 1 and child.timings.samples == here.timings.samples
    assert [row.name for row in child.rows] == [row.name for row in here.rows]
    for a, b in zip(here.rows, child.rows, strict=True):
        assert (a.extrapolated is None) == (b.extrapolated is None)
        if a.extrapolated is not None and b.extrapolated is not None:
            assert a.extrapolated.peak_bytes == b.extrapolated.peak_bytes
            assert a.extrapolated.least == pytest.approx(b.extrapolated.least, rel=1e-9)


def _equinox_step(layers: int):
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.up, self.down = eqx.nn.Linear(D, H, key=k1), eqx.nn.Linear(H, D, key=k2)

    class Model(eqx.Module):
        blocks: list

        def __init__(self, n, key):
            self.blocks = [Block(k) for k in jax.random.split(key, n)]

        def __call__(self, x):
            for block in self.blocks:
                x = x + block.down(jax.nn.gelu(block.up(x)))
            return x

    def step(model, batch):
        grads = jax.grad(lambda m: jnp.mean(jax.vmap(m)(batch) ** 2))(model)
        return jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)

    return step, eqx.filter_eval_shape(Model, layers, jax.random.key(0))


def _nnx_step(layers: int):
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, D, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, n, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(n)])

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Model(layers, nnx.Rngs(0))))

    def step(state, batch):
        def loss(state):
            model = nnx.merge(graphdef, state)
            x = batch
            for block in model.blocks:
                x = x + block.down(jax.nn.gelu(block.up(x)))
            return jnp.mean(x**2)

        grads = jax.grad(loss)(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    return step, state


@pytest.mark.parametrize("framework", [_equinox_step, _nnx_step], ids=["equinox", "nnx"])
def test_an_equinox_or_nnx_model_s_layers_are_found_and_cut_to_the_program_of_fewer_layers(framework):
    batch = jax.ShapeDtypeStruct((4 * N, D), jnp.float32)
    step, model = framework(6)
    closed = jax.make_jaxpr(step)(model, batch)
    blocks = repeated_blocks(closed)
    assert not isinstance(blocks, str), blocks
    assert blocks.count == 6
    for depth in DEPTHS:
        cut = blocks.at_depth(depth)
        fewer_step, fewer_model = framework(depth)
        fewer = jax.make_jaxpr(fewer_step)(fewer_model, batch)
        assert len(cut.inputs) == len(fewer.jaxpr.invars) and len(cut.outputs) == len(fewer.jaxpr.outvars)
        assert _program(cut.jaxpr.jaxpr) == _program(fewer.jaxpr)


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0, float("nan"), []])
def test_sample_takes_true_or_false_only(bad):
    with pytest.raises(einshard.EinshardError, match=r"sample= takes True or False"):
        einshard.plan(adamw_step, _state(6), _batch(), candidates=CANDIDATES[:1], sample=bad, quiet=True)


@pytest.mark.parametrize(
    "target", [pytest.param("h100", marks=needs_gpu), pytest.param("v5e", marks=needs_tpu)]
)
def test_a_sampled_plan_on_a_target_picks_the_winner_of_whole_compiles(target):
    """In the child that compiles for the target, under a use_strategy block (which a plan ignores).

    At 6 layers a v5e's kernels took 79 % longer extrapolated from 2 and 3 than whole: a target's
    samples only order the whole compiles.
    """
    args = (adamw_step, _state(6), _batch())
    candidates = CANDIDATES[:2]
    with einshard.use_strategy(strategies.fsdp()):
        sampled = einshard.plan(
            *args, n_devices=8, target=target, candidates=candidates, sample=True, quiet=True
        )
    whole = einshard.plan(
        *args, n_devices=8, target=target, candidates=candidates, exhaustive=True, quiet=True
    )
    assert sampled.best.name == whole.best.name
    assert sampled.timings.samples == len(DEPTHS) * len(candidates) and sampled.timings.children >= 1
    full = {row.name: row for row in whole.rows}
    for row in sampled.rows:
        # A target's kernels are no line in the depth: nothing is left out, every row is whole.
        assert row.extrapolated is not None and row.extrapolated.least == 0.0
        assert row.report is not None and row.seconds == pytest.approx(full[row.name].seconds, rel=1e-9)


def test_a_sampled_plan_out_of_time_names_every_candidate_left_for_the_budget():
    plan = einshard.plan(
        adamw_step, _state(6), _batch(), candidates=CANDIDATES[:2], sample=True, max_seconds=1e-9, quiet=True
    )
    assert [row.rejected_for for row in plan.rows] == ["budget", "budget"]
    assert not any("cannot beat" in row.rejected for row in plan.rows)


def test_an_exhaustive_plan_is_not_sampled_and_says_so():
    plan = einshard.plan(
        adamw_step, _state(6), _batch(), candidates=CANDIDATES[:1], sample=True, exhaustive=True, quiet=True
    )
    assert plan.timings.samples == 0 and plan.rows[0].report is not None
    assert plan.sampling is not None and "exhaustive=True" in plan.sampling
