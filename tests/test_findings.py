"""The step report's findings: each kind of waste named on a program that has it, with its bytes
worked out by hand, and silent on the same program without it; ``accelerator=``'s error; the
compiler's messages; the headline; the planner's findings column."""

from __future__ import annotations

import inspect
import math
import os

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies

N = jax.device_count()
F32 = 4


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def ring_all_reduce(nbytes: int, n: int = N) -> int:
    return round(2 * (n - 1) / n * nbytes)


def ring_once(nbytes: int, n: int = N) -> int:  # all-gather, reduce-scatter, all-to-all
    return round((n - 1) / n * nbytes)


def sgd(loss):
    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def kinds(report: einshard.StepReport) -> list[str]:
    return [finding.kind for finding in report.findings]


def only(report: einshard.StepReport, kind: str):
    found = [finding for finding in report.findings if finding.kind == kind]
    assert len(found) == 1, report.findings_text()
    return found[0]


# --- a parameter's gradient reduced twice: tied embeddings under data parallel --------------------

VOCAB, DIM = 64, 32
DATA_PARALLEL = [(r"^batch", "b s -> b* s"), (r".*", "... -> * ...")]


def tied_loss(params, tokens):
    h = jnp.tanh(params["embed"][tokens] @ params["w"])
    logits = h @ params["embed"].T  # the embedding again, as the output layer
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def untied_loss(params, tokens):
    h = jnp.tanh(params["embed"][tokens] @ params["w"])  # untied
    return -jnp.mean(jax.nn.log_softmax(h @ params["head"])[..., 0])


TOKENS = jax.ShapeDtypeStruct((4 * N, 8), jnp.int32)


def test_a_tied_embedding_under_data_parallel_is_reduced_twice_and_named():
    params = {"embed": f32(VOCAB, DIM), "w": f32(DIM, DIM)}
    report = einshard.explain_step(sgd(tied_loss), params, TOKENS, rules=DATA_PARALLEL)
    embed = VOCAB * DIM * F32
    rows = [row for row in report.rows if row.param == "params/embed"]
    assert [(row.kind, row.bytes) for row in rows] == [("all-reduce", embed)] * 2
    finding = only(report, "repeated")
    assert finding.params == ("params/embed",)
    assert finding.bytes == ring_all_reduce(embed)  # one of the two all-reduces, by hand
    assert {report.rows[p].param for p in finding.rows} == {"params/embed"}
    assert "reduced 2 times" in finding.cause and "psum" in finding.fix
    assert report.waste_bytes == finding.bytes == report.traffic - ring_all_reduce(embed + DIM * DIM * F32)
    # What a GPU makes of it is its own compiler's to say (tests/test_targets.py: it keeps both).


def test_untied_embeddings_under_data_parallel_have_no_findings():
    params = {"embed": f32(VOCAB, DIM), "w": f32(DIM, DIM), "head": f32(DIM, VOCAB)}
    report = einshard.explain_step(sgd(untied_loss), params, TOKENS, rules=DATA_PARALLEL)
    assert report.findings == () and report.waste_bytes == 0
    assert sorted(row.param for row in report.rows) == ["params/embed", "params/head", "params/w"]
    assert "no waste found" in str(report)


# --- partial sums reduced one by one: separate q, k, v under Megatron -----------------------------

HEADS, HEAD_DIM, LAYERS, BATCH, SEQ = N, 4, 2, 2, 8
MEGATRON = [
    (r"w[qkv]$", "d h -> d h*"),
    (r"wqkv$", "d n h -> d n* h"),
    (r"wo$", "h d -> h* d"),
    (r"w1$", "d f -> d f*"),
    (r"w2$", "f d -> f* d"),
    (r"w0$", "... -> * ..."),  # copied on purpose: a rule of its own says so
    (r".*", "... -> * ..."),
]


def transformer_loss(params, x):
    x = jnp.tanh(x @ params["w0"])  # a replicated layer in front: the first block's input has a gradient
    for layer in params["layers"]:
        if "wqkv" in layer:  # fused: one projection, split by heads
            q, k, v = jnp.split(jnp.einsum("bsd,dnh->bsnh", x, layer["wqkv"]), 3, axis=-1)
        else:
            q, k, v = ((x @ layer[name]).reshape(BATCH, SEQ, HEADS, HEAD_DIM) for name in ("wq", "wk", "wv"))
        weights = jax.nn.softmax(jnp.einsum("bsnh,btnh->bnst", q, k), axis=-1)
        attended = jnp.einsum("bnst,btnh->bsnh", weights, v).reshape(BATCH, SEQ, HEADS * HEAD_DIM)
        x = x + attended @ layer["wo"]
        x = x + jax.nn.relu(x @ layer["w1"]) @ layer["w2"]
    return jnp.sum(x**2)


def _transformer(fused: bool) -> dict:
    width = HEADS * HEAD_DIM
    layer = {"wo": f32(width, DIM), "w1": f32(DIM, 4 * N), "w2": f32(4 * N, DIM)}
    if fused:
        layer["wqkv"] = f32(DIM, HEADS, 3 * HEAD_DIM)
    else:
        layer.update(wq=f32(DIM, width), wk=f32(DIM, width), wv=f32(DIM, width))
    return {"w0": f32(DIM, DIM), "layers": [dict(layer) for _ in range(LAYERS)]}


def test_separate_qkv_under_megatron_reduces_three_partial_sums_where_fused_reduces_one():
    x = f32(BATCH, SEQ, DIM)
    step = sgd(transformer_loss)
    separate = einshard.explain_step(step, _transformer(False), x, rules=MEGATRON)
    fused = einshard.explain_step(step, _transformer(True), x, rules=MEGATRON)
    activation = BATCH * SEQ * DIM * F32  # b·s·h, replicated on every device
    count = lambda r: sum(1 for row in r.rows if row.kind == "all-reduce" and row.bytes == activation)  # noqa: E731
    assert (count(separate), count(fused)) == (6 * LAYERS, 4 * LAYERS)  # 2 forward, 4 or 2 backward
    finding = only(separate, "unsummed")
    assert finding.bytes == 2 * LAYERS * ring_all_reduce(activation)  # 2 all-reduces too many per layer
    assert finding.bytes == separate.traffic - fused.traffic  # what fusing q, k and v saves
    assert set(finding.params) == {f"params/layers/{i}/w{n}" for i in range(LAYERS) for n in "qkv"}
    assert "QKV" in finding.fix and len(finding.rows) == 3 * LAYERS
    assert "unsummed" not in kinds(fused) and fused.findings == ()


# --- an all-reduce whose result is only sliced: FSDP on CPU --------------------------------------

HIDDEN = 16 * N


def mlp_loss(params, batch):
    return jnp.mean((jax.nn.relu(batch @ params["up"]) @ params["down"]) ** 2)


FSDP_PARAMS = {"up": f32(HIDDEN, HIDDEN), "down": f32(HIDDEN, HIDDEN)}  # both split on their first axis
FSDP_BATCH = f32(4 * N, HIDDEN)


def _fsdp_report(**kwargs) -> einshard.StepReport:
    rules = einshard.Rules([(r"^batch", "b d -> b* d")]) + strategies.fsdp(min_bytes=0)
    return einshard.explain_step(sgd(mlp_loss), FSDP_PARAMS, FSDP_BATCH, rules=rules, **kwargs)


def test_fsdp_gradients_all_reduced_then_sliced_are_named():
    report = _fsdp_report()
    sizes = {"params/up": HIDDEN * HIDDEN * F32, "params/down": HIDDEN * HIDDEN * F32}
    reduced = {row.param: row for row in report.rows if row.kind == "all-reduce"}
    assert {p: row.bytes for p, row in reduced.items()} == sizes  # each gradient whole
    finding = only(report, "sliced all-reduce")
    assert set(finding.params) == set(sizes)
    assert finding.bytes == sum(ring_all_reduce(s) - ring_once(s) for s in sizes.values())
    assert "reduce-scatter" in finding.cause and "target=" in finding.fix and "psum_scatter" in finding.fix
    # Gather plus all-reduce: 3(N-1)/N of the parameters on CPU; with a reduce-scatter, 2(N-1)/N.
    gathered = sum(row.traffic for row in report.rows if row.param in sizes and row.kind == "all-gather")
    assert gathered == sum(ring_once(s) for s in sizes.values())
    assert report.traffic - finding.bytes == sum(2 * ring_once(s) for s in sizes.values()) + sum(
        row.traffic for row in report.rows if row.param not in sizes
    )


def test_the_sliced_all_reduce_s_fix_on_a_tpu_sends_to_no_other_target():
    # The same program read as a TPU's: it is already the target's own, so the fix names no
    # target= to try (and says why a TPU keeps all-reduces), only what the user's code can do.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard._cost.pipeline._analysis import report_of_text

    mesh = jax.make_mesh((N,), ("d",))
    split = NamedSharding(mesh, P("d"))
    shaped = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=split) for k, v in FSDP_PARAMS.items()}
    batch = jax.ShapeDtypeStruct(FSDP_BATCH.shape, FSDP_BATCH.dtype, sharding=split)
    text = jax.jit(sgd(mlp_loss), out_shardings=split).lower(shaped, batch).compile().as_text()
    cpu, tpu = (only(report_of_text(text, platform=p), "sliced all-reduce") for p in ("cpu", "tpu"))
    assert (cpu.bytes, cpu.rows) == (tpu.bytes, tpu.rows)
    assert "target=" in cpu.fix and "h100" in cpu.fix
    assert "target=" not in tpu.fix and "GPU" not in tpu.fix
    assert "psum_scatter" in tpu.fix and "XLA's TPU compiler" in tpu.fix and "padded_gathers" in tpu.fix


def test_data_parallel_gradients_are_used_whole_so_no_sliced_all_reduce():
    rules = [(r"^batch", "b d -> b* d"), (r".*", "... -> * ...")]
    params = {"up": f32(DIM, HIDDEN), "down": f32(HIDDEN, DIM)}
    report = einshard.explain_step(sgd(mlp_loss), params, f32(8 * N, DIM), rules=rules)
    assert report.findings == ()


def test_at_does_not_recompile(monkeypatch):
    report = _fsdp_report(bandwidth=1e9)
    import einshard._cost.pipeline._analysis as analysis

    def no_compile(*args, **kwargs):
        raise AssertionError("recompiled")

    monkeypatch.setattr(analysis, "compile_step", no_compile)
    faster = report.at(bandwidth=1e10)
    assert faster.communication_seconds < report.communication_seconds


def test_accelerator_is_gone_and_its_error_names_target():
    with pytest.raises(einshard.EinshardError, match=r"accelerator='gpu' is gone: give target= instead"):
        einshard.explain_step(lambda x: x * 2, jnp.ones(4), accelerator="gpu")
    with pytest.raises(einshard.EinshardError, match="'h100'") as raised:
        _fsdp_report().at(accelerator="gpu")
    assert "pip install '.[gpu-target]'" in raised.value.hint  # from the source at hand
    with pytest.raises(einshard.EinshardError, match="give target= instead"):
        einshard.plan(sgd(mlp_loss), FSDP_PARAMS, FSDP_BATCH, accelerator="gpu")
    # A dead parameter no more: no signature lists it.
    for function in (einshard.explain_step, einshard.plan, einshard.StepReport.at, einshard.Plan.at):
        assert "accelerator" not in inspect.signature(function).parameters, function


def test_a_step_that_takes_accelerator_gets_it_from_explain_step():
    """explain_step's keywords go to the step: one that takes accelerator= is not refused."""

    def step(x, accelerator="none"):
        return x * 2 if accelerator == "gpu" else x

    report = einshard.explain_step(step, jnp.ones(4), accelerator="gpu")
    assert report.rows == ()


# --- a large parameter copied on every device under a table meant to split it -------------------


def test_a_weight_no_split_rule_matches_is_named_with_the_memory_it_costs():
    params = {"fc": f32(DIM, HIDDEN), "proj": f32(HIDDEN, DIM)}
    x = f32(8, DIM)
    missing = [(r"fc$", "d f -> d f*"), (r".*", "... -> * ...")]  # 'proj' is not 'down': no row rule
    report = einshard.explain_step(sgd(mlp_loss_named), params, x, rules=missing)
    finding = only(report, "copied")
    proj = HIDDEN * DIM * F32
    assert finding.params == ("params/proj",)
    assert finding.memory_bytes == proj - proj // N and finding.bytes == 0
    assert "catch-all" in finding.cause and f"'a b -> a{N} b'" in finding.fix
    complete = [*missing[:1], (r"proj$", "f d -> f* d"), *missing[1:]]
    assert "copied" not in kinds(einshard.explain_step(sgd(mlp_loss_named), params, x, rules=complete))
    # Data parallel copies every weight by design: nothing to name.
    everywhere = [(r".*", "... -> * ...")]
    assert "copied" not in kinds(einshard.explain_step(sgd(mlp_loss_named), params, x, rules=everywhere))


def mlp_loss_named(params, batch):
    return jnp.mean((jax.nn.relu(batch @ params["fc"]) @ params["proj"]) ** 2)


def test_a_weight_its_rule_cannot_split_is_named_with_the_reason():
    odd = 8 * N + 1  # no device count here divides it
    params = {"fc": f32(DIM, HIDDEN), "proj": f32(HIDDEN, odd)}
    rules = einshard.Rules(
        [(r"fc$", "d f -> d f*"), (r"proj$", "f d -> f d*"), (r".*", "... -> * ...")], indivisible="replicate"
    )
    report = einshard.explain_step(sgd(mlp_loss_named), params, f32(8, DIM), rules=rules)
    finding = only(report, "copied")
    size = HIDDEN * odd * F32
    assert finding.params == ("params/proj",) and finding.memory_bytes == size - size // N
    assert "its rule does not split it (e.g. params/proj: " in finding.cause


# --- a reshard between two layouts, and the compiler's involuntary full rematerialization --------


def _moved(after: str, before: str = "a b -> a* b"):
    def step(x):
        return einshard.einshard(jnp.sin(x), after) * 2

    x = jax.ShapeDtypeStruct((8 * N, 8 * N), jnp.float32, sharding=einshard.make_sharding(before))
    return step, x


def test_a_reshard_by_all_to_all_names_both_layouts_and_its_bytes():
    step, x = _moved("a b -> a b*")
    report = einshard.explain_step(step, x)
    finding = only(report, "reshard")
    local = 8 * N * 8 * N * F32 // N  # the bytes each device holds, all of them exchanged
    assert report.bytes_by_kind == {"all-to-all": local}
    assert finding.bytes == report.traffic == sum(ring_once(row.bytes) for row in report.rows)
    assert abs(finding.bytes - ring_once(local)) <= len(report.rows)  # per-array rounding
    assert f"'a b -> a{N} b' to 'a b -> a b{N}'" in finding.cause
    assert finding.sources == (f"{__file__}:{_line_of('einshard.einshard(jnp.sin(x), after)')}",)
    same, x = _moved("a b -> a* b")
    assert einshard.explain_step(same, x).findings == ()


def test_an_involuntary_full_rematerialization_is_captured_attributed_and_passed_on(capfd):
    step, x = _moved("a b -> a b2 *")
    report = einshard.explain_step(step, x)
    printed = capfd.readouterr().err
    assert "Involuntary full rematerialization" in printed  # XLA's words still reach stderr
    finding = only(report, "rematerialization")
    whole = 8 * N * 8 * N * F32
    assert finding.bytes == ring_once(whole)  # every device gathers the array whole
    assert finding.params == ("x",)
    assert f"'a b -> a{N} b' to 'a b -> a b2 {N // 2}'" in finding.cause
    assert finding.sources == (f"{__file__}:{_line_of('einshard.einshard(jnp.sin(x), after)')}",)
    assert "reshard" not in kinds(report)  # the same gather is not counted twice


def test_a_step_jax_compiled_before_still_reports_its_rematerialization():
    step, x = _moved("a b -> a b2 *")
    jitted = jax.jit(step)
    jitted.lower(x).compile()  # in JAX's cache now
    for _ in range(2):
        assert "rematerialization" in kinds(einshard.explain_step(jitted, x))


def test_stderr_is_restored_after_a_compile_that_fails():
    fd = os.dup(2)
    try:
        before = os.fstat(2)

        def broken(x):
            raise ValueError("broken step")

        with pytest.raises(ValueError, match="broken step"):
            einshard.explain_step(broken, jnp.ones(4))
        after = os.fstat(2)
        assert (before.st_ino, before.st_dev) == (after.st_ino, after.st_dev)
    finally:
        os.close(fd)


def _at(text: str) -> str:
    return f"{__file__}:{_line_of(text)}"


def _line_of(text: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


# --- headlines, printing, the planner -------------------------------------------------------------


def test_the_headline_counts_combined_collectives_and_their_arrays():
    params = {"embed": f32(VOCAB, DIM), "w": f32(DIM, DIM), "head": f32(DIM, VOCAB)}
    report = einshard.explain_step(sgd(untied_loss), params, TOKENS, rules=DATA_PARALLEL)
    assert len({row.instruction for row in report.rows}) == 1  # XLA's CPU compiler combines them
    assert report.collectives == 1 and len(report.rows) == 3
    assert str(report).count("1 combined all-reduce of 3 arrays on") == 1


def test_each_array_of_a_combined_all_reduce_carries_its_own_line():
    params = {"embed": f32(VOCAB, DIM), "w": f32(DIM, DIM), "head": f32(DIM, VOCAB)}
    report = einshard.explain_step(sgd(untied_loss), params, TOKENS, rules=DATA_PARALLEL)
    assert len({row.instruction for row in report.rows}) == 1  # one combined all-reduce
    untied = _at("@ params['w'])  # untied".replace("'", '"'))
    head = _at("jax.nn.log_softmax(h @ params['head'])".replace("'", '"'))
    assert {row.param: row.source for row in report.rows} == {
        "params/embed": untied,
        "params/w": untied,
        "params/head": head,
    }
    tied = einshard.explain_step(
        sgd(tied_loss), {"embed": f32(VOCAB, DIM), "w": f32(DIM, DIM)}, TOKENS, rules=DATA_PARALLEL
    )
    first = _at("h = jnp.tanh(params['embed'][tokens] @ params['w'])".replace("'", '"'))
    logits = _at("logits = h @ params['embed'].T".replace("'", '"'))
    assert sorted(row.source for row in tied.rows if row.param == "params/embed") == sorted([first, logits])
    assert set(only(tied, "repeated").sources) == {first, logits}


def test_findings_print_under_the_table_with_cause_and_fix():
    text = str(_fsdp_report())
    table, _, below = text.partition("waste found")
    assert "all-reduce" in table and "sliced all-reduce: +" in below
    assert "   cause: " in below and "   fix: " in below


def test_the_planner_shows_each_candidates_findings():
    plan = einshard.plan(
        sgd(mlp_loss),
        FSDP_PARAMS,
        FSDP_BATCH,
        candidates=[strategies.data_parallel(), strategies.fsdp(min_bytes=0)],
        bandwidth=1e9,
    )
    by_name = {row.name: row for row in plan.rows}
    fsdp = by_name["fsdp"].report
    assert fsdp is not None and fsdp.findings and not by_name["data parallel"].report.findings
    text = str(plan)
    assert "findings" in text.splitlines()[0]
    assert f"fsdp: {len(fsdp.findings)} findings, the largest {fsdp.findings[0].headline()}" in text
    # Each row's traffic is in whole bytes (its ring share rounded): within half a byte per run.
    rounding = sum(row.times for row in fsdp.rows) / 2
    assert math.isclose(fsdp.communication_seconds, fsdp.traffic / 1e9, abs_tol=rounding / 1e9)
    assert fsdp.communication_seconds > 0
    with pytest.raises(einshard.EinshardError, match="give target= instead"):
        plan.at(accelerator="gpu")


# --- a batch left whole under FSDP: activations moved instead of weights ----------------------------

GPT_DIVIDES = pytest.mark.skipif(
    N < 2 or 256 % N, reason="the GPT's widths (256) split over 2, 4, 8 or 16 devices"
)


@GPT_DIVIDES
def test_a_batch_left_to_the_catch_all_under_fsdp_moves_activations_and_is_named():
    """tests/gpt_steps.py's GPT with AdamW under FSDP given as a plain table (the Strategy's rules
    without its batch rule): the batch falls to the catch-all, and the partitioner moves
    activations. The finding names it; with the batch split (the Strategy itself), it is gone,
    and the bytes drop by what it said."""
    optax = pytest.importorskip("optax")
    import gpt_steps

    adamw_step, train = gpt_steps.adamw_train(optax.adamw(1e-3))

    tokens = jax.ShapeDtypeStruct((2 * N, gpt_steps.S), jnp.int32)
    fsdp = strategies.fsdp(min_bytes=0)
    mistaken = einshard.explain_step(adamw_step, train, tokens, rules=einshard.Rules(fsdp.pairs()))
    finding = only(mistaken, "activations gathered over the batch")
    assert finding.params == () and finding.bytes > 0.3 * mistaken.traffic
    assert "The batch (tokens) is" in finding.cause and "serve no parameter" in finding.cause
    assert "('^tokens(/|$)', 'b ... -> b* ...')" in finding.fix and "rules=" in finding.fix
    assert all(mistaken.rows[p].param is None for p in finding.rows)
    split = einshard.explain_step(adamw_step, train, tokens, rules=fsdp)
    assert "activations gathered over the batch" not in kinds(split)
    assert mistaken.traffic - split.traffic >= 0.9 * finding.bytes


@GPT_DIVIDES
def test_tensor_parallel_keeps_its_batch_whole_on_purpose_and_is_not_named():
    """Megatron's all-reduces of activations serve no parameter either, by design: no parameter is
    gathered, so the batch left whole is not this finding."""
    import gpt_steps

    tokens = jax.ShapeDtypeStruct((2 * N, gpt_steps.S), jnp.int32)
    report = einshard.explain_step(gpt_steps.step, gpt_steps.gpt_params(), tokens, rules=gpt_steps.TP)
    assert report.rows and "activations gathered over the batch" not in kinds(report)
