"""explain_step: the collectives, bytes, memory and flops of a compiled step, checked against hand
computations; the HLO reader on captured snippets of every format XLA prints."""

# ruff: noqa: E501  (the captured HLO text keeps XLA's long lines)

from __future__ import annotations

import inspect
import math
import pickle
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._cost.xla import _collectives, _hlo

N = jax.device_count()
THIS = Path(__file__).name


def _line(marker: str) -> int:
    """The line of this file that carries ``# marker``."""
    for number, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(marker)


# --- the models -----------------------------------------------------------------------------------


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"])  # first matmul
    return h @ params["w2"]  # second matmul


def loss(params, x):
    return jnp.sum(mlp(params, x) ** 2)


def sgd_step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def fsdp_loss(params, x):
    h = einshard.einshard(jax.nn.relu(x @ params["w1"]), "b f -> b* f")
    out = einshard.einshard(h @ params["w2"], "b f -> b* f")
    return jnp.sum(out**2)


def fsdp_step(params, x):
    grads = jax.grad(fsdp_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


D, F, OUT, B = 16 * N, 32 * N, 8 * N, 4 * N  # every axis divides by the device count


def _params(e1: str, e2: str) -> dict:
    w1 = jax.random.normal(jax.random.key(0), (D, F))
    w2 = jax.random.normal(jax.random.key(1), (F, OUT))
    return {"w1": einshard.einshard(w1, e1), "w2": einshard.einshard(w2, e2)}


def _all_axes(report: einshard.StepReport) -> tuple[str, ...]:
    return tuple(name for name, size in report.mesh if size > 1)


# --- whole steps ------------------------------------------------------------------------------------


def test_tensor_parallel_mlp_forward_is_one_all_reduce_of_the_activations():
    params = _params("x y -> x y*", "y z -> y* z")  # the README's table
    x = einshard.einshard(jnp.ones((B, D)), "... -> * ...")
    report = einshard.explain_step(mlp, params, x)
    assert [(r.kind, r.phase) for r in report.rows] == [("all-reduce", "forward")]
    (row,) = report.rows
    expected = jax.jit(mlp)(params, x)
    assert row.bytes == expected.addressable_shards[0].data.nbytes == B * OUT * 4
    assert (row.dtype, row.shape, row.group_size, row.times) == ("f32", (B, OUT), N, 1)
    assert row.axes == _all_axes(report)
    assert row.source == f"{Path(__file__)}:{_line('second matmul')}"
    assert "dot_general" in row.op_name
    assert report.collectives == 1 and report.bytes == row.bytes
    np.testing.assert_allclose(
        expected, mlp({k: np.asarray(v) for k, v in params.items()}, np.ones((B, D))), rtol=1e-4, atol=1e-3
    )


def test_data_parallel_gradients_are_all_reduced_once_per_parameter_with_its_path():
    params = _params("... -> * ...", "... -> * ...")
    x = einshard.einshard(jnp.ones((B * 4, D)), "b d -> b* d")
    report = einshard.explain_step(sgd_step, params, x)
    assert {r.kind for r in report.rows} == {"all-reduce"}
    assert all(r.phase == "backward" and r.group_size == N for r in report.rows)
    assert sorted(r.param for r in report.rows) == ["params/w1", "params/w2"]
    by_param = {r.param: r.bytes for r in report.rows}
    assert by_param == {"params/w1": params["w1"].nbytes, "params/w2": params["w2"].nbytes}
    assert report.bytes == sum(v.nbytes for v in params.values())  # per dtype: all f32
    assert all(r.axes == _all_axes(report) for r in report.rows)


def test_data_parallel_with_adam_attributes_gradients_to_parameters_not_moments():
    optax = pytest.importorskip("optax")
    tx = optax.adam(1e-3)
    params = _params("... -> * ...", "... -> * ...")
    x = einshard.einshard(jnp.ones((B * 4, D)), "b d -> b* d")

    def step(params, opt_state, x):
        grads = jax.grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    report = einshard.explain_step(step, params, tx.init(params), x)
    assert sorted(r.param for r in report.rows) == ["params/w1", "params/w2"]
    assert report.bytes == sum(v.nbytes for v in params.values())


def test_fsdp_gathers_each_weight_whole_in_the_forward_pass_and_reduces_its_gradient():
    # FSDP: each weight split on its largest axis over all devices, the batch too.
    params = _params("x y -> x y*", "y z -> y* z")
    x = einshard.einshard(jnp.ones((B * 8, D)), "b d -> b* d")
    report = einshard.explain_step(fsdp_step, params, x)
    gathers = [r for r in report.rows if r.kind == "all-gather"]
    assert sorted((r.param, r.bytes, r.phase) for r in gathers) == [
        ("params/w1", D * F * 4, "forward"),
        ("params/w2", F * OUT * 4, "forward"),
    ]
    # XLA's CPU backend reduces a gradient with an all-reduce and keeps its slice, where GPU and
    # TPU emit a reduce-scatter; either is the gradient of one parameter, whole before slicing.
    reduces = [r for r in report.rows if r.kind in ("all-reduce", "reduce-scatter")]
    assert sorted((r.param, r.bytes) for r in reduces) == [
        ("params/w1", D * F * 4),
        ("params/w2", F * OUT * 4),
    ]
    assert report.bytes == 2 * (D * F + F * OUT) * 4  # hand computation: gather + reduce each weight
    assert report.bytes_by_kind == {
        "all-gather": (D * F + F * OUT) * 4,
        reduces[0].kind: (D * F + F * OUT) * 4,
    }


@pytest.mark.parametrize("names", [("data", "model"), ("model", "data")])
def test_groups_map_onto_the_mesh_axis_they_run_over_both_ways_round(names):
    sizes = {"data": 2, "model": N // 2}
    mesh = Mesh(np.array(jax.devices()).reshape([sizes[n] for n in names]), names)
    x = jax.device_put(jnp.ones((4 * N, 4 * N)), NamedSharding(mesh, P("data", "model")))
    replicated = NamedSharding(mesh, P())
    for axis, reduce in (("model", 1), ("data", 0)):
        step = jax.jit(lambda x, r=reduce: x.sum(r), out_shardings=replicated)
        report = einshard.explain_step(step, x)
        reductions = [r for r in report.rows if r.kind == "all-reduce"]
        assert [(r.axes, r.group_size) for r in reductions] == [((axis,), sizes[axis])], report
        np.testing.assert_allclose(step(x), np.full(4 * N, 4.0 * N))
    assert report.mesh == tuple((n, sizes[n]) for n in names)


def test_a_jitted_step_keeps_its_donation_and_totals_are_the_sum_of_the_rows():
    params = _params("... -> * ...", "... -> * ...")
    x = jax.ShapeDtypeStruct((B * 4, D), jnp.float32, sharding=einshard.make_sharding("b d -> b* d"))
    plain = einshard.explain_step(
        sgd_step, params, x, bandwidth=1e9, latency=1e-6, flops_per_second=1e12, donate=False
    )
    donated = einshard.explain_step(jax.jit(sgd_step, donate_argnums=0), params, x)
    by_default = einshard.explain_step(sgd_step, params, x)  # returns params updated: donated
    param_bytes = sum(v.nbytes for v in params.values()) // 1
    assert plain.alias_bytes == 0 and donated.alias_bytes == param_bytes
    assert by_default.donated == "params" and by_default.alias_bytes == param_bytes
    assert plain.donated is None and donated.donated is None  # a jax.jit step: its own donation
    assert plain.peak_bytes == plain.argument_bytes + plain.output_bytes + plain.temp_bytes
    assert plain.argument_bytes == param_bytes + x.size * 4 // N
    assert plain.flops and plain.flops > 2 * (B * 4 // N) * (D * F + F * OUT)  # at least the forward matmuls
    assert plain.bytes == sum(r.total_bytes for r in plain.rows)
    assert plain.traffic == sum(r.traffic for r in plain.rows)
    assert plain.bytes_by_kind == {"all-reduce": plain.bytes}
    assert plain.communication_seconds == pytest.approx(sum(r.seconds for r in plain.rows))
    # The ring formula; the latency once per collective instruction (a combined one counts once).
    ring = sum(2 * (N - 1) / N * r.bytes / 1e9 for r in plain.rows) + plain.collectives * 2 * (N - 1) * 1e-6
    assert plain.communication_seconds == pytest.approx(ring, rel=1e-6)
    assert plain.compute_seconds == pytest.approx(plain.flops / 1e12)
    slower = plain.at(bandwidth=1e8)
    assert slower.communication_seconds > plain.communication_seconds and slower.latency == 1e-6
    text = str(plain)
    assert "params/w1" in text and "all-reduce" in text and f"on {N} devices" in text


def test_a_jitted_step_that_drops_an_unused_argument_still_names_its_parameters():
    params = _params("... -> * ...", "... -> * ...")
    x = einshard.einshard(jnp.ones((B * 4, D)), "b d -> b* d")

    def step(unused, params, x):
        return sgd_step(params, x)

    report = einshard.explain_step(jax.jit(step), jnp.zeros(3), params, x)
    assert sorted(r.param for r in report.rows) == ["params/w1", "params/w2"]


def test_a_loop_body_counts_its_trip_count():
    w = einshard.einshard(jnp.ones((5, D, D)), "l x y -> l x y*")
    x = einshard.einshard(jnp.ones((B, D)), "... -> * ...")

    def layers(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    report = einshard.explain_step(layers, w, x)
    looped = [r for r in report.rows if r.times == 5]
    assert looped and all(r.times_known for r in looped)
    assert report.bytes == sum(r.bytes * r.times for r in report.rows)
    # A loop's forward collectives move activations: they serve no stacked weight.
    assert all(r.param is None and r.phase == "forward" for r in looped)


def _scanned_sgd_step(params, x):
    """An embedding, then layers stacked on a leading axis (two levels when ``layers`` is 4-D)."""

    def loss(p):
        def layer(h, w):
            if w.ndim == 3:  # a block of layers: a scan inside the scan
                return jax.lax.scan(layer, h, w)[0], None
            return jnp.tanh(h @ w), None

        h = jax.lax.scan(layer, x @ p["emb"], p["layers"])[0]
        return jnp.mean(h**2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)


@pytest.mark.parametrize("stack", [(5,), (2, 3)], ids=["scan", "scan-in-scan"])
def test_a_scan_stacked_gradient_reduced_per_layer_is_its_parameters(stack):
    """The backward loop reduces one layer's gradient per trip; those rows serve the stacked weight."""
    n = jax.device_count()
    params = {"emb": jnp.ones((OUT, D)), "layers": jnp.full((*stack, D, D), 0.01)}
    x = einshard.einshard(jnp.ones((2 * n, OUT)), "b d -> b* d")
    dp = einshard.shard_pytree(params, [(r".*", "... -> * ...")])
    report = einshard.explain_step(_scanned_sgd_step, dp, x)
    layer_rows = [r for r in report.rows if r.param == "params/layers"]
    assert layer_rows and all(r.shape == (D, D) for r in layer_rows)
    assert sum(r.times for r in layer_rows) == math.prod(stack)  # once per layer, not once
    assert sum(r.total_bytes for r in layer_rows) == math.prod(stack) * D * D * 4  # the whole stack
    assert sum(r.total_bytes for r in report.rows if r.param == "params/emb") == OUT * D * 4
    # Every reduced weight-sized row serves a parameter: only the loss's scalar is nobody's.
    assert all(r.param is not None for r in report.rows if r.bytes > 4)
    assert not report.findings  # one slice per layer is not the same gradient reduced twice


def test_rules_give_abstract_arguments_their_shardings():
    abstract = jax.eval_shape(lambda: {"w1": jnp.zeros((D, F)), "w2": jnp.zeros((F, OUT))})
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    rules = [(r"w1$", "x y -> x y*"), (r"w2$", "y z -> y* z"), (r"^x$", "... -> * ...")]
    report = einshard.explain_step(mlp, abstract, x, rules=rules)
    assert [(r.kind, r.bytes) for r in report.rows] == [("all-reduce", B * OUT * 4)]


# A module-level step: it pickles by reference, so it crosses into a child process.
def dp_step(params, x):
    return sgd_step(params, x)


@pytest.mark.skipif(
    jax.device_count() != 8, reason="the child's 64 devices do not depend on this run's: once, at 8"
)
def test_planning_64_devices_in_a_child_process_gives_the_formula():
    d, f, o = 128, 256, 64
    abstract = {
        "w1": jax.ShapeDtypeStruct((d, f), jnp.float32),
        "w2": jax.ShapeDtypeStruct((f, o), jnp.float32),
    }
    x = jax.ShapeDtypeStruct((256, d), jnp.float32)
    rules = [(r"^x$", "b d -> b* d"), (r".*", "... -> * ...")]
    report = einshard.explain_step(dp_step, abstract, x, rules=rules, n_devices=64, bandwidth=1e10)
    assert report.n_devices == 64 and math.prod(s for _, s in report.mesh) == 64
    assert sorted((r.kind, r.param, r.bytes, r.group_size) for r in report.rows) == [
        ("all-reduce", "params/w1", d * f * 4, 64),
        ("all-reduce", "params/w2", f * o * 4, 64),
    ]
    assert report.traffic == round(2 * 63 / 64 * d * f * 4) + round(2 * 63 / 64 * f * o * 4)
    assert all(r.axes == _all_axes(report) for r in report.rows)
    assert report.communication_seconds == pytest.approx(report.traffic / 1e10)


def test_a_step_that_cannot_cross_into_the_child_is_an_einshard_error():
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    with pytest.raises(einshard.EinshardError, match="cannot cross into a child process with 16 devices"):
        einshard.explain_step(lambda x: x, x, n_devices=16)
    with pytest.raises(einshard.EinshardError, match="n_devices must be a positive integer"):
        einshard.explain_step(dp_step, x, n_devices=0)
    with pytest.raises(einshard.EinshardError, match="cannot import the step 'einshard:no_such_step'"):
        einshard.explain_step("einshard:no_such_step", x)


def test_the_report_pickles():
    report = einshard.explain_step(mlp, _params("x y -> x y*", "y z -> y* z"), jnp.ones((B, D)))
    assert pickle.loads(pickle.dumps(report)) == report


def test_the_named_mesh_form_of_this_jax_is_read_as_xla_prints_it():
    # Fails loudly when JAX/XLA changes how it prints a collective's groups.
    mesh = Mesh(np.array(jax.devices()).reshape(2, N // 2), ("data", "model"))
    x = jax.device_put(jnp.ones((8, 4 * N)), NamedSharding(mesh, P(None, "model")))
    compiled = jax.jit(lambda x: x.sum(1), out_shardings=NamedSharding(mesh, P())).lower(x).compile()
    module = _hlo.parse_module(compiled.as_text())
    (found,) = _collectives.collectives(module)
    assert found.kind == "all-reduce"
    assert sorted(found.groups) == [tuple(range(0, N // 2)), tuple(range(N // 2, N))]


# --- the HLO reader, on captured text ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "n", "groups"),
    [
        ("{{0,1},{2,3}}", 4, [[0, 1], [2, 3]]),
        ("{{0,2},{1,3}}", 4, [[0, 2], [1, 3]]),
        ("{}", 4, [[0, 1, 2, 3]]),
        ("[2,4]<=[8]", 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", 8, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[1,8]<=[8]", 8, [list(range(8))]),
        ("mesh['data'=2,'model'=4] {'model'}", 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh['data'=2,'model'=4] {'data'}", 8, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['data'=2,'model'=4] {'data','model'}", 8, [list(range(8))]),
        ("mesh['a0'=2,'a1'=2,'a2'=2] {'a0','a2'}", 8, [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("mesh['x'=4] {'x':(1)2}", 4, [[0, 2], [1, 3]]),
        ("mesh['x'=4] {'x':(2)2}", 4, [[0, 1], [2, 3]]),
        ("mesh['x'=2,'y'=2] <=[2,2]T(1,0) {'y'}", 4, [[0, 2], [1, 3]]),
        # jax 0.10 prints the device order as device_ids=(...) after a comma
        ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_replica_groups_in_every_printed_form(text, n, groups):
    assert sorted(_collectives.parse_replica_groups(text, n)) == sorted(groups)
    line = (
        f"  %ar = f32[8]{{0}} all-reduce(%a), channel_id=1, replica_groups={text}, use_global_device_ids=true"
    )
    instruction = _hlo._parse_instruction(line, "main")
    assert instruction is not None and instruction.attribute("replica_groups") == text


OLD_STYLE = """HloModule jit_step, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %p), index=1
  %ars = f32[8]{0} all-reduce-start(f32[8]{0} %v), channel_id=2, replica_groups=[2,2]<=[4], to_apply=%add, metadata={op_name="jit(step)/while/body/transpose(jvp(f))/dot_general" source_file="/src/model.py" source_line=42}
  %ard = f32[8]{0} all-reduce-done(f32[8]{0} %ars)
  %i = s32[] get-tuple-element((s32[], f32[8]{0}) %p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(s32[] %i, f32[8]{0} %ard)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8], b: bf16[2,16]) -> f32[8] {
  %a = f32[8]{0} parameter(0), metadata={op_name="a"}
  %b = bf16[2,16]{1,0} parameter(1), metadata={op_name="b"}
  %ag = bf16[2,64]{1,0} all-gather(bf16[2,16]{1,0} %b), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={1}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp(f)/dot_general" source_file="/src/model.py" source_line=7}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(s32[] %zero, f32[8]{0} %a)
  %w = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %cp = f32[8]{0} collective-permute(f32[8]{0} %a), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %r = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %w), index=1
}
"""


def test_old_style_text_loops_async_pairs_and_inline_sources():
    module = _hlo.parse_module(OLD_STYLE)
    found = {c.instruction.name: c for c in _collectives.collectives(module)}
    assert set(found) == {"ars", "ag", "cp"}  # the -done half is not counted
    assert (found["ars"].kind, found["ars"].times, found["ars"].groups) == ("all-reduce", 3, ((0, 1), (2, 3)))
    assert module.source(found["ars"].instruction) == (
        "jit(step)/while/body/transpose(jvp(f))/dot_general",
        "/src/model.py",
        42,
    )
    assert found["ag"].instruction.shapes == (_hlo.Shape("bf16", (2, 64)),)
    assert found["ag"].instruction.shapes[0].bytes == 2 * 64 * 2
    assert found["cp"].groups == ((0, 1), (2, 3))
    assert module.instructions()["ag"].operands == ("b",)


NEW_STYLE = """HloModule jit_step, is_scheduled=true, num_partitions=8

FileNames
1 "/src/train.py"

FunctionNames
1 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=2 end_column=2}
2 {file_name_id=1 function_name_id=1 line=19 end_line=19 column=6 end_column=6}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%add.clone (x.3: f32[], y.1: f32[]) -> f32[] {
  %x.3 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x.3, %y.1)
}

ENTRY %main.1_spmd (param: f32[128,256], param.1: f32[4,128]) -> (f32[256,128], f32[64,256]) {
  %param = f32[128,256]{1,0} parameter(0), metadata={op_name="p[\\'w1\\']"}
  %param.1 = f32[64,256]{1,0} parameter(1)
  %all-reduce.2 = (f32[128,256]{1,0}, f32[64,256]{1,0}) all-reduce(%param, %param.1), channel_id=1, replica_groups=mesh['axis_0'=8] {'axis_0'}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(step)/transpose(jvp())/dot_general" stack_frame_id=2}
  ROOT %t = (f32[128,256]{1,0}, f32[64,256]{1,0}) tuple(%all-reduce.2)
}
"""


def test_new_style_text_stack_frames_and_combined_all_reduce():
    module = _hlo.parse_module(NEW_STYLE)
    (found,) = _collectives.collectives(module)
    assert found.groups == (tuple(range(8)),)
    assert module.source(found.instruction) == ("jit(step)/transpose(jvp())/dot_general", "/src/train.py", 19)
    assert [str(s) for s in found.instruction.shapes] == ["f32[128,256]", "f32[64,256]"]
    assert found.instruction.operands == ("param", "param.1")
    assert module.source(module.instructions()["param"])[0] == "p['w1']"


def test_rules_that_match_no_path_of_the_step_are_listed_and_a_table_that_misses_entirely_warns():
    """shard_pytree's '^up/kernel$' matches no path of a step ('params/up/kernel'): the report lists
    it, and a table whose rules all miss but its catch-all warns; (^|/) matches in both."""

    def step(params, x):
        return jnp.sum(jax.nn.relu(x @ params["up"]["kernel"]) @ params["down"]["kernel"])

    n = jax.device_count()
    params = {
        "up": {"kernel": jax.ShapeDtypeStruct((16, 8 * n), jnp.float32)},
        "down": {"kernel": jax.ShapeDtypeStruct((8 * n, 16), jnp.float32)},
    }
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    anchored = [(r"^up/kernel$", "i o -> i o*"), (r"^down/kernel$", "i o -> i* o"), (r".*", "... -> * ...")]
    with pytest.warns(
        einshard.EinshardWarning, match=r"no rule of the table given to explain_step matched"
    ) as seen:
        report = einshard.explain_step(step, params, x, rules=anchored)
    # The warning names the line that called explain_step, not one of einshard's own frames
    # (its entry point's decorators stand between).
    assert [(w.filename, w.lineno) for w in seen] == [(__file__, inspect.currentframe().f_lineno - 3)]
    assert report.unmatched_rules == ("^up/kernel$", "^down/kernel$")
    assert "2 rules match no path of the step's arguments" in str(report)
    assert "'^up/kernel$'" in str(report) and not report.rows  # everything replicated: no collective
    fixed = [
        (r"(^|/)up/kernel$", "i o -> i o*"),
        (r"(^|/)down/kernel$", "i o -> i* o"),
        (r".*", "... -> * ..."),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        good = einshard.explain_step(step, params, x, rules=fixed)
    assert good.unmatched_rules == () and "match no path" not in str(good)
    assert [row.kind for row in good.rows] == ["all-reduce"]  # the Megatron pair's one reduction
    partly = [(r"(^|/)up/kernel$", "i o -> i o*"), (r"^down/kernel$", "i o -> i* o"), (r".*", "... -> * ...")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one rule matched: listed, no warning
        assert einshard.explain_step(step, params, x, rules=partly).unmatched_rules == ("^down/kernel$",)
    assert report.relative_rules == report.unmatched_rules  # they match 'up/kernel', below 'params'
    other = [(r"(^|/)q_proj/kernel$", "i o -> i o*"), (r".*", "... -> * ...")]
    with pytest.warns(einshard.EinshardWarning, match="name layers the step's arguments do not have"):
        missing = einshard.explain_step(step, params, x, rules=other)
    assert missing.unmatched_rules == ("(^|/)q_proj/kernel$",) and missing.relative_rules == ()
    assert "a layer name the step's arguments do not have?" in str(missing)
    candidate = einshard.strategies.Strategy(anchored, batch="b ... -> b* ...", name="mine")
    batch = jax.ShapeDtypeStruct((4 * n, 16), jnp.float32)
    with pytest.warns(einshard.EinshardWarning, match=r"plan \(candidate 'mine'\) matched"):
        einshard.plan(step, params, batch, candidates=[candidate])
    by_names = einshard.strategies.tensor_parallel(column=["q"], row=["o"])  # names this model lacks
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plan's row says how little it splits; no warning
        assert einshard.plan(step, params, batch, candidates=[by_names]).rows[0].split_share == 0.0


def squared_matmul_step(params, x):
    return jnp.sum((x @ params["w"]) ** 2)


def test_float64_arguments_warn_once_and_are_reported_as_jax_computes_them():
    """NumPy float64 params without jax_enable_x64: one EinshardWarning naming them, not JAX's warning
    once per struct and compile; the report is of the float32 step, here and in a child process."""

    params = {"w": np.ones((16, 8 * jax.device_count()))}
    rules = [(r"(^|/)w$", "i o -> i o*"), (r".*", "... -> * ...")]
    step = "tests.test_step:squared_matmul_step"  # crosses into the child by name
    for n_devices in (None, 2 * jax.device_count()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = einshard.explain_step(step, params, np.ones((4, 16)), rules=rules, n_devices=n_devices)
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        assert messages[0].startswith("2 of the step's arguments are float64 (the first: 'params/w')")
        assert issubclass(caught[0].category, einshard.EinshardWarning)
        w_bytes = 16 * 8 * jax.device_count() * 4 // report.n_devices  # float32, split n ways
        assert report.argument_bytes == w_bytes + 4 * 16 * 4  # and x, float32, replicated


def test_jax_s_private_device_assignment_that_the_report_reads_is_there():
    # The partition order of a compiled program (which device runs partition i) has no public
    # name in JAX: the report reads the shardings' _device_assignment. This fails loudly when
    # JAX renames it, instead of every report silently falling back to one axis of devices.
    from einshard._cost.pipeline._compile import compile_step
    from einshard._tracing._call import StepCall

    n = jax.device_count()
    devices = np.array(jax.devices()[::-1])  # a device order that is not the ids' order
    sharding = NamedSharding(Mesh(devices, ("d",)), jax.sharding.PartitionSpec("d"))
    x = jax.device_put(jnp.ones((n * 2,)), sharding)
    compiled = compile_step(StepCall.of(lambda x: x * 2, (x,), {}))
    assert all(hasattr(s, "_device_assignment") for s in compiled._shardings())
    assert [d.id for d in compiled.partition_devices(n)] == [d.id for d in devices]
    assert compiled.platform() == "cpu"
    assert compiled.device_ids(n) == [d.id for d in devices]
