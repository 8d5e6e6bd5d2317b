"""Targets: reports and plans of the programs XLA's GPU and TPU compilers make, on this machine.

* The seven programs XLA's GPU compiler made for 8 real H200s (``../shared/accelerators/``) read
  to exactly their bytes per kind (``bytes_by_kind.json``), with the tied embedding's double
  reduction named and FSDP's reduce-scatter read; ``explain_step(..., target='h200')`` on the same
  seven steps, compiled here for compile-only H200s, gives the same bytes.
* At 64 H100s (FSDP, a derived hybrid) and 8 TPU v5e chips (data parallel, fused tensor parallel,
  FSDP) the report's bytes equal a reading of the program text written here, by regular expressions.
* ``plan(..., target='h100', n_devices=64)`` ranks by time at the H100's figures.
* Without the compilers, a target is an ``EinshardError`` naming the extra, and nothing else breaks.

The tests that compile need XLA's GPU compiler (``jax-cuda13-plugin``) or TPU's (``libtpu``) and
skip without them; ``nox -s targets`` installs both and fails when they are missing. The tests of
the real H200 programs need ``../shared`` beside the clone and skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard._cost.hardware import _compilers, _figures, _target
from einshard._cost.pipeline._analysis import report_of_text
from einshard._tracing._call import StepCall
from tests import gpt_steps as gpt

SHARED = Path(__file__).resolve().parents[2] / "shared" / "accelerators"
H200 = SHARED / "h200x8-jax0.11.2"
STEPS = ["derived_hybrid4", "derived_tp", "dp", "dp_tied", "fsdp", "tp_fused", "tp_unfused"]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


HAS_GPU_COMPILER = _installed("jax_plugins.xla_cuda13")
HAS_TPU_COMPILER = _installed("libtpu")
REQUIRED = os.environ.get("EINSHARD_TARGET_TESTS") == "1"  # nox -s targets: a skip is a failure

needs_shared = pytest.mark.skipif(
    not H200.is_dir(), reason=f"the real H200 programs are not beside the clone ({H200})"
)
needs_gpu = pytest.mark.skipif(
    not HAS_GPU_COMPILER and not REQUIRED,
    reason="XLA's GPU compiler is not installed: pip install '.[gpu-target]' (nox -s targets does)",
)
needs_tpu = pytest.mark.skipif(
    not HAS_TPU_COMPILER and not REQUIRED,
    reason="TPU's compiler is not installed: pip install '.[tpu-target]' (nox -s targets does)",
)


def test_the_targets_session_has_both_compilers():
    if not REQUIRED:
        pytest.skip("only nox -s targets (EINSHARD_TARGET_TESTS=1) requires the compilers")
    assert HAS_GPU_COMPILER and HAS_TPU_COMPILER and H200.is_dir()


# --- an independent reading of a program's text ---------------------------------------------------

_OP = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+)(\d+)[a-z0-9]*\[([\d,]*)\]")


def _bytes(type_text: str) -> list[int]:
    out = []
    for kind, bits, dims in _ARRAY.findall(type_text):
        count = 1
        for d in dims.split(","):
            if d:
                count *= int(d)
        out.append(count * (8 if kind == "pred" else int(bits)) // 8)
    return out


def hand_count(text: str) -> dict[str, int]:
    """Bytes per kind, read line by line: an all-gather's result, a reduce-scatter's operand, the
    others' result; an async pair at its ``-start`` (whose type is ``(operands, results)``); a TPU
    collective split over chained fusions (one ``channel_id`` with a ``chain_id``) once."""
    types = dict(re.findall(r"%([\w.\-]+) = ([a-z]\w*\[[\d,]*\])", text))
    out: dict[str, int] = {}
    seen = set()
    for line in text.splitlines():
        match = _OP.search(line)
        if match is None or " = " not in line:
            continue
        kind, start = match.group(1), bool(match.group(2))
        chain = re.search(r'channel_id=(\d+).*chain_id="(\d+)"', line)
        if chain:
            if (kind, chain.groups()) in seen:
                continue
            seen.add((kind, chain.groups()))
        type_text = line.split(" = ", 1)[1][: match.start() - len(line.split(" = ", 1)[0]) - 3]
        sizes = _bytes(type_text)
        if start:
            half = len(sizes) // 2
            operands, results = sizes[:half], sizes[half:]
        else:
            names = re.findall(r"%([\w.\-]+)", line[match.end() : line.index(")", match.end())])
            operands, results = [_bytes(types.get(n, ""))[0] for n in names if n in types], sizes
        counted = operands if kind == "reduce-scatter" else results
        out[kind] = out.get(kind, 0) + sum(counted)
    return out


def _program(target: str, n: int, params, rules, batch, tokens) -> str:
    """The target's program text, compiled here (this process) for compile-only devices."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    devices = _compilers.target_devices(_target.parse_target(target, n))
    call = StepCall.of(gpt.step, (params, tokens), {})
    with einshard.use_devices(devices):
        placed = call.with_rules(gpt.table(rules, batch))
        return jax.jit(gpt.step).lower(*placed.args).compile().as_text()


# --- the real H200 programs -----------------------------------------------------------------------


@needs_shared
@pytest.mark.parametrize("name", STEPS)
def test_the_real_h200_programs_read_to_their_bytes(name):
    expected = json.loads((H200 / "bytes_by_kind.json").read_text())[name]
    text = (H200 / f"hlo_{name}.txt").read_text()
    report = report_of_text(text, [f"arg{i}" for i in range(64)])
    assert report.bytes_by_kind == expected
    assert hand_count(text) == expected  # the reading of this file agrees


@needs_shared
def test_the_real_tied_embedding_is_reduced_twice_and_named():
    report = report_of_text((H200 / "hlo_dp_tied.txt").read_text(), [f"arg{i}" for i in range(64)])
    # One all-reduce of the embedding's gradient alone, one piece of the concatenated combined one.
    embed = [row for row in report.rows if row.param == "arg0"]
    assert [(row.kind, row.shape) for row in embed] == [("all-reduce", (512, 256))] * 2
    assert len({row.instruction for row in embed}) == 2
    # Every other piece of the concatenated all-reduce serves its own parameter.
    pieces = [row.param for row in report.rows if row.instruction == embed[1].instruction]
    assert len(pieces) == 18 and len(set(pieces)) == 18 and None not in pieces
    (finding,) = report.findings
    assert finding.kind == "repeated" and finding.params == ("arg0",)
    assert finding.bytes == round(2 * 7 / 8 * 512 * 256 * 4)  # one all-reduce of 512 KiB, by the ring


@needs_shared
def test_the_real_fsdp_program_reduce_scatters_and_has_no_sliced_all_reduce():
    report = report_of_text((H200 / "hlo_fsdp.txt").read_text(), [f"arg{i}" for i in range(64)])
    scattered = [row for row in report.rows if row.kind == "reduce-scatter"]
    assert len(scattered) == 14 and len({row.instruction for row in scattered}) == 1
    assert report.findings == ()


@needs_shared
def test_the_spec_figures_are_read_from_the_spec_text():
    figures = _compilers.spec_figures((SHARED / "specs" / "h200.txtpb").read_text())
    assert figures["device_memory_size"] == 151397597184 and figures["memory_bandwidth"] == 4.8e12
    # 2 x 1.8295201 GHz x 4 units x 512 ops x 132 cores: NVIDIA's 989 TFLOP/s dense bf16.
    assert round(figures["peak_flops_per_second"] / 1e12) == 989 and figures["active_links"] == 18
    a100 = _compilers.spec_figures((SHARED / "specs" / "a100_sxm_80.txtpb").read_text())
    assert round(a100["peak_flops_per_second"] / 1e12) == 312 and "active_links" not in a100


@needs_gpu
@needs_shared
def test_the_plugins_specs_are_the_shared_ones():
    for name, file in [("a100", "a100_sxm_80"), ("h100", "h100_sxm"), ("h200", "h200"), ("b200", "b200")]:
        assert _compilers.gpu_spec_text(name) == (SHARED / "specs" / f"{file}.txtpb").read_text()


@needs_gpu
@needs_shared
@pytest.mark.parametrize("name", STEPS)
def test_explain_step_for_8_h200s_gives_the_real_machines_bytes(name):
    expected = json.loads((H200 / "bytes_by_kind.json").read_text())[name]
    params, rules, batch = gpt.cases(8)[name]
    report = einshard.explain_step(
        gpt.step, params, gpt.TOKENS, rules=gpt.table(rules, batch), target="h200", n_devices=8
    )
    assert report.bytes_by_kind == expected
    assert report.target == "h200" and report.topology == "1x1x8" and report.n_devices == 8
    hardware = report.hardware
    assert hardware is not None and hardware.memory_bytes == 151397597184
    assert report.bandwidth == hardware.bandwidth == 18 * 25e9
    # The flops are the target program's own dots (no CPU compile); the time is simulated from it.
    assert report.flops and report.flops_source and "dots of the program" in report.flops_source
    assert report.simulated_seconds is not None and report.seconds == report.simulated_seconds
    assert report.compute_seconds is not None and 0 < report.compute_seconds <= report.seconds
    assert "H200" in str(report) and "measured peak to 0.1 %" in str(report)
    kinds = {finding.kind for finding in report.findings}
    assert "sliced all-reduce" not in kinds
    if name == "dp_tied":
        (finding,) = [f for f in report.findings if f.kind == "repeated"]
        assert finding.params == ("params/embed",)


@needs_gpu
def test_a_finding_only_the_cpu_program_has_is_not_shown_for_a_gpu():
    params, rules, batch = gpt.cases(8)["fsdp"]
    table = gpt.table(rules, batch)
    cpu = einshard.explain_step(gpt.step, params, gpt.TOKENS, rules=table, n_devices=8)
    gpu = einshard.explain_step(gpt.step, params, gpt.TOKENS, rules=table, n_devices=8, target="h100")
    assert "sliced all-reduce" in {f.kind for f in cpu.findings}
    assert "sliced all-reduce" not in {f.kind for f in gpu.findings}
    assert gpu.bytes_by_kind["reduce-scatter"] == cpu.bytes_by_kind["all-reduce"] - 5 * 256 * 4


# --- 64 H100s -------------------------------------------------------------------------------------

TOKENS64 = jax.ShapeDtypeStruct((64, gpt.S), jnp.int32)


@needs_gpu
@pytest.mark.parametrize("name", ["fsdp", "hybrid8"])
def test_64_h100s_bytes_equal_a_reading_of_the_program(name):
    params = gpt.gpt_params()
    if name == "fsdp":
        rules, batch = gpt.FSDP, "b s -> b* s"
    else:
        strategy = einshard.strategies.hybrid(8, step=gpt.step, params=params, batch=TOKENS64, n_devices=64)
        rules, batch = strategy, strategy.batch
    text = _program("h100", 64, params, rules, batch, TOKENS64)
    start = time.perf_counter()
    report = einshard.explain_step(
        gpt.step, params, TOKENS64, rules=gpt.table(rules, batch), target="h100", n_devices=64
    )
    assert time.perf_counter() - start < 60 * 3  # the bar is 60 s on an idle machine
    assert report.bytes_by_kind == hand_count(text) and report.bytes > 0
    assert report.topology == "1x8x8"
    # Groups over all 64 devices (FSDP's) span the 8 hosts, 8 devices on each.
    across = [row for row in report.rows if row.group_size == 64]
    assert all(row.hosts == 8 for row in across) and (across or name == "hybrid8")
    hardware = report.hardware
    assert hardware is not None and (hardware.latency, hardware.network_latency) == (1e-6, 5e-6)
    assert (hardware.bandwidth, hardware.network_bandwidth, hardware.nics_per_host) == (450e9, 48e9, 8)
    # Each run, by hand from its groups (device ids, 8 a host): inside a host its ring formula at
    # NVLink's 450 GB/s with 1 us a step; across h hosts with g devices on the least-populated
    # one at min(g x 48, 450 x g / (g - 1)) GB/s, 5 us on each step between hosts. A combined
    # collective's arrays share one run by their bytes.
    run_bytes: dict[str, int] = {}
    for row in report.rows:
        run_bytes[row.instruction] = run_bytes.get(row.instruction, 0) + row.bytes
    for row in report.rows:
        group = max(row.groups, key=len)
        n = len(group)
        counts = [sum(1 for d in group if d // 8 == h) for h in sorted({d // 8 for d in group})]
        g, h = min(counts), len(counts)
        assert row.hosts == h
        sent = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(row.kind, (n - 1) / n)
        steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(row.kind, n - 1)
        if h == 1:
            rate, latency = 450e9, steps * 1e-6
        else:
            assert row.kind in ("all-reduce", "all-gather", "reduce-scatter"), row.kind
            rate = min(g * 48e9, 450e9 * g / (g - 1)) if g > 1 else 48e9
            between = (2 if row.kind == "all-reduce" else 1) * (h - 1)
            latency = between * 5e-6 + (steps - between) * 1e-6
        run = sent * run_bytes[row.instruction] / rate + latency if n > 1 else 0.0
        assert row.seconds == pytest.approx(run * row.bytes / run_bytes[row.instruction] * row.times)


@needs_gpu
def test_a_plan_for_64_h100s_ranks_by_time_at_their_figures():
    start = time.perf_counter()
    plan = einshard.plan(gpt.step, gpt.gpt_params(), TOKENS64, n_devices=64, target="h100", exhaustive=True)
    seconds = time.perf_counter() - start
    assert seconds < 60 * 6  # the bar is 3 minutes on an idle machine (benchmarks/bench_targets.py)
    hardware = plan.hardware
    assert plan.target == "h100" and hardware is not None
    assert plan.bandwidth == hardware.bandwidth and plan.memory_per_device == hardware.memory_bytes
    assert plan.flops_per_second == hardware.flops_per_second
    usable = plan.usable
    assert len(usable) >= 3 and all(row.seconds is not None for row in usable)
    times = [row.seconds for row in usable]
    assert times[0] <= min(times) * 1.02  # ranked by time (ties within 2%: the simpler first)
    assert all(row.report.target == "h100" for row in usable)
    assert "64 H100" in str(plan)


# --- never a CPU program under a target's name ------------------------------------------------------


def _raw_peak(target: str, n: int, rules) -> int:
    """The peak of ``jax.jit(step).lower(...).compile()`` for the target's compile-only devices,
    with every argument replicated there (``rules=None``) or laid out by the rules."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    devices = _compilers.target_devices(_target.parse_target(target, n))
    params = gpt.gpt_params()
    if rules is None:
        mesh = jax.sharding.Mesh(devices, ("d",))
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        args = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=everywhere), (params, gpt.TOKENS)
        )
    else:
        call = StepCall.of(gpt.step, (params, gpt.TOKENS), {})
        with einshard.use_devices(devices):
            args = call.with_rules(gpt.table(rules, "b s -> b* s")).args
    # The step returns its parameters updated: compiled, as einshard compiles it, with them donated.
    stats = jax.jit(gpt.step, donate_argnums=0).lower(*args).compile().memory_analysis()
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


@needs_gpu
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("with_rules", [False, True])
def test_a_target_report_s_memory_is_the_target_program_s(n, with_rules):
    rules = gpt.REPLICATED if with_rules else None
    table = gpt.table(rules, "b s -> b* s") if rules is not None else None
    report = einshard.explain_step(
        gpt.step, gpt.gpt_params(), gpt.TOKENS, rules=table, target="h100", n_devices=n
    )
    assert report.target == "h100" and report.n_devices == n and report.donated == "params"
    assert report.peak_bytes == _raw_peak("h100", n, rules)


def no_arguments():
    return jnp.arange(8.0) * 2


@needs_gpu
def test_a_step_that_lands_on_cpu_devices_is_not_reported_under_a_target_s_name():
    # No argument to lay out on the H100: JAX compiles it for its default backend, the CPU.
    with pytest.raises(einshard.EinshardError, match="compiled for cpu devices, not for 1 H100"):
        einshard.explain_step(no_arguments, target="h100", n_devices=1)


# --- TPU v5e ----------------------------------------------------------------------------------------


@needs_tpu
@pytest.mark.parametrize("name", ["dp", "tp_fused", "fsdp"])
def test_8_tpu_v5e_chips_bytes_equal_a_reading_of_the_program(name):
    params, rules, batch = gpt.cases(8)[name]
    text = _program("v5e", 8, params, rules, batch, gpt.TOKENS)
    report = einshard.explain_step(
        gpt.step, params, gpt.TOKENS, rules=gpt.table(rules, batch), target="v5e", n_devices=8
    )
    assert report.bytes_by_kind == hand_count(text) and report.bytes > 0
    assert report.topology == "v5e:2x4" and report.hardware is not None
    # One ICI link one way (Google's figure): a collective's time is the links' it spans (_torus).
    assert report.hardware.memory_bytes == 16 * 2**30 and report.bandwidth == 45e9
    if name == "tp_fused":  # Megatron: 8 activations of b*s*h f32 all-reduced, none of the weights
        assert report.bytes_by_kind == {"all-reduce": 8 * gpt.B * gpt.S * gpt.H * 4}
    if name == "dp":  # every gradient once, whole
        total = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
        assert report.bytes_by_kind == {"all-reduce": total}


# --- names, figures and missing compilers (no compiler needed) --------------------------------------


def test_targets_pick_their_topology():
    assert _target.parse_target("h100", 64).topology == "1x8x8"
    assert _target.parse_target("b200", 4).topology == "1x1x4"
    assert _target.parse_target("v5e", 8).topology == "v5e:2x4"
    assert _target.parse_target("v6e", 256).topology == "v6e:16x16"
    assert _target.parse_target("v5p", 64).topology == "v5p:4x4x4"
    assert _target.parse_target("V5E:4x2", None).n_devices == 8
    assert _target.parse_target("cpu", None).platform == "cpu"


@pytest.mark.parametrize(
    ("target", "n", "message"),
    [
        ("h800", 8, "unknown target 'h800'"),
        ("h100", None, "needs n_devices="),
        ("h100", 12, "12 GPUs do not fill hosts of 8"),
        ("v5p:2x4", None, "a v5p slice is 3 sizes"),
        ("v5e:2x4", 16, "has 8 chips, not n_devices=16"),
        (8, 8, "target must be a name"),
    ],
)
def test_a_wrong_target_is_an_einshard_error(target, n, message):
    with pytest.raises(einshard.EinshardError, match=re.escape(message)):
        einshard.explain_step(lambda x: x * 2, jnp.zeros(8), target=target, n_devices=n)


@needs_tpu
def test_figures_can_be_given_and_say_so():
    hardware = _figures.hardware_of(_target.parse_target("v5e", 8), {"efficiency": 0.5, "bandwidth": 1e11})
    assert hardware.efficiency == 0.5 and hardware.flops_per_second == 197e12 * 0.5
    assert (
        hardware.sources["efficiency"] == "given" and "cloud.google.com" in hardware.sources["memory_bytes"]
    )
    with pytest.raises(einshard.EinshardError, match="is not a figure"):
        _figures.hardware_of(_target.parse_target("v5e", 8), {"flops": 1.0})
    with pytest.raises(einshard.EinshardError, match="must be a fraction above 0 and at most 1"):
        _figures.hardware_of(_target.parse_target("v5e", 8), {"efficiency": 0})


def test_no_message_installs_einshard_from_the_package_index():
    """Every install line in the package's messages installs from the source at hand."""
    package = Path(__file__).resolve().parents[1] / "einshard"
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert "install 'einshard[" not in text and 'install "einshard[' not in text, path


def test_without_the_compilers_a_target_names_its_extra_and_nothing_else_breaks(monkeypatch):
    real = importlib.util.find_spec
    hidden = {"jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "libtpu"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a)
    )
    # From the source at hand: the package index has only an older einshard.
    with pytest.raises(
        einshard.EinshardError, match=re.escape("pip install '.[gpu-target]' in einshard's source")
    ):
        einshard.explain_step(lambda x: x * 2, jnp.zeros(8), target="h100", n_devices=8)
    with pytest.raises(
        einshard.EinshardError, match=re.escape("pip install '.[tpu-target]' in einshard's source")
    ):
        _compilers.check_compiler(_target.parse_target("v5e", 8))
    w = einshard.einshard(jnp.ones((8 * jax.device_count(), 32)), "x y -> x* y")
    report = einshard.explain_step(lambda w: w.sum(0), w)  # the CPU report is untouched
    assert report.target == "cpu" and report.hardware is None and report.bytes_by_kind == {"all-reduce": 128}
