"""The planner's bound before compiling: a candidate whose arguments alone exceed the memory per
device is rejected without a compile, and says so; one that fits is compiled as before. The bound
is checked against XLA's own argument sizes of the compiled programs."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._language._text import size_text
from einshard._planning.search._bounds import argument_bytes_per_device
from einshard._tracing._call import StepCall
from einshard._trees._strategy import with_batch
from tests.test_planner import HIDDEN, D, sgd_step
from tests.test_planner import mlp_params as params
from tests.test_targets import needs_gpu

N = jax.device_count()

BATCH = jax.ShapeDtypeStruct((8 * N, D), jnp.float32)
CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0), strategies.tensor_parallel()]
# By hand: data parallel holds both weights whole and 1/N of the batch; FSDP 1/N of everything.
WEIGHTS = 2 * D * HIDDEN * 4
BATCH_BLOCK = 8 * D * 4
DP_ARGUMENTS = WEIGHTS + BATCH_BLOCK
FSDP_ARGUMENTS = WEIGHTS // N + BATCH_BLOCK


def test_the_bound_is_xlas_own_argument_size():
    plan = einshard.plan(sgd_step, params(), BATCH, candidates=CANDIDATES, quiet=True, exhaustive=True)
    call = StepCall.of(sgd_step, (params(), BATCH), {})
    by_name = {row.name: row for row in plan.rows}
    assert argument_bytes_per_device(call, with_batch(CANDIDATES[0], "batch"), N) == DP_ARGUMENTS
    assert argument_bytes_per_device(call, with_batch(CANDIDATES[1], "batch"), N) == FSDP_ARGUMENTS
    for strategy in CANDIDATES:
        bound = argument_bytes_per_device(call, with_batch(strategy, "batch"), N)
        assert bound == by_name[strategy.name].report.argument_bytes
        assert bound <= by_name[strategy.name].peak_bytes


@pytest.mark.skipif(N < 2, reason="a split needs two devices")
def test_a_candidate_whose_arguments_exceed_the_memory_is_not_compiled(compiles):
    free = einshard.plan(sgd_step, params(), BATCH, candidates=CANDIDATES, quiet=True, exhaustive=True)
    compiles.clear()
    limit = DP_ARGUMENTS - 1
    fitting = {row.name for row in free.rows if row.report.argument_bytes <= limit}
    assert "data parallel" not in fitting and any(name.startswith("fsdp") for name in fitting)
    plan = einshard.plan(
        sgd_step, params(), BATCH, candidates=CANDIDATES, memory_per_device=limit, quiet=True, exhaustive=True
    )
    assert len(compiles) == len(fitting)  # data parallel was never compiled
    row = next(row for row in plan.rows if row.name == "data parallel")
    assert row.report is None and row.argument_bytes == DP_ARGUMENTS
    assert row.rejected == (
        f"does not fit memory: its arguments alone need {size_text(DP_ARGUMENTS)} > "
        f"{size_text(limit)} per device (not compiled)"
    )
    assert row.rejected_for == "memory"
    text = str(plan)
    bounded = [row.name for row in plan.rows if row.name not in fitting]
    count = len(bounded)
    assert f"{count} candidate{'' if count == 1 else 's'} not compiled ({', '.join(bounded)})" in text
    assert "rejected data parallel: does not fit memory: its arguments alone need" in text
    # The others are compiled as before: the same report as without a memory limit.
    for name in fitting:
        kept = next(row for row in plan.rows if row.name == name)
        unbounded = next(row for row in free.rows if row.name == name)
        assert kept.report is not None and kept.argument_bytes is None
        assert kept.peak_bytes == unbounded.peak_bytes
        assert kept.traffic == unbounded.traffic
        assert kept.bytes_by_kind == unbounded.bytes_by_kind
    # Ranked again at more memory, it has no report to rank: it says to plan again.
    more = plan.at(memory_per_device=10 * DP_ARGUMENTS)
    row = next(row for row in more.rows if row.name == "data parallel")
    assert row.rejected_for == "not compiled" and "plan again" in row.rejected
    assert more.best.name != "data parallel"
    # At less memory still, the bound is said again at that memory.
    less = plan.at(memory_per_device=limit // 2)
    row = next(row for row in less.rows if row.name == "data parallel")
    assert row.rejected.endswith(f"> {size_text(limit // 2)} per device (not compiled)")


def test_without_a_memory_limit_every_candidate_is_compiled(compiles):
    plan = einshard.plan(sgd_step, params(), BATCH, candidates=CANDIDATES, quiet=True, exhaustive=True)
    assert len(compiles) == len(CANDIDATES)
    assert all(row.argument_bytes is None for row in plan.rows)


def test_when_every_candidate_is_bounded_out_nothing_is_compiled(compiles):
    plan = einshard.plan(sgd_step, params(), BATCH, candidates=CANDIDATES, memory_per_device=1, quiet=True)
    assert compiles == []
    assert all(row.rejected.endswith("(not compiled)") for row in plan.rows)
    assert "3 candidates not compiled" in str(plan)
    with pytest.raises(einshard.EinshardError, match="no candidate strategy fits"):
        _ = plan.best


@needs_gpu
@pytest.mark.parametrize("name", ["dp", "fsdp", "tp_unfused", "derived_hybrid4"])
def test_the_compile_only_gpu_options_leave_the_program_s_figures_unchanged(name, monkeypatch):
    """``_child.COMPILE_ONLY_GPU_FLAGS`` (each shortens the compile) against XLA's defaults for them."""
    from einshard._cost.child._child import COMPILE_ONLY_GPU_FLAGS
    from tests import gpt_steps as gpt

    defaults = {
        "xla_gpu_autotune_level": "4",
        "xla_gpu_disable_gpuasm_optimizations": "false",
        "xla_llvm_disable_expensive_passes": "false",
    }
    assert set(COMPILE_ONLY_GPU_FLAGS) == set(defaults)
    assert all(COMPILE_ONLY_GPU_FLAGS[option] != default for option, default in defaults.items())
    params, rules, batch = gpt.cases(8)[name]

    def report() -> einshard.StepReport:
        return einshard.explain_step(
            gpt.step, params, gpt.TOKENS, rules=gpt.table(rules, batch), target="h100", n_devices=8
        )

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    fast = report()
    monkeypatch.setenv("XLA_FLAGS", " ".join(f"--{option}={value}" for option, value in defaults.items()))
    slow = report()
    assert [(r.kind, r.bytes, r.group_size, r.times) for r in fast.rows] == [
        (r.kind, r.bytes, r.group_size, r.times) for r in slow.rows
    ]
    assert fast.bytes_by_kind == slow.bytes_by_kind and fast.traffic == slow.traffic
    assert (fast.peak_bytes, fast.argument_bytes, fast.temp_bytes) == (
        slow.peak_bytes,
        slow.argument_bytes,
        slow.temp_bytes,
    )
    assert fast.flops == slow.flops
    assert fast.simulated_seconds == pytest.approx(slow.simulated_seconds, rel=1e-9)


@needs_gpu
def test_a_child_s_kernel_cache_leaves_the_figures_unchanged_and_is_removed(monkeypatch):
    """Each child of a GPU plan keeps XLA's compiled kernels in a file of its own (``KERNEL_CACHE_FLAG``):
    the later candidates' figures are those of compiles without it, the file was written, and its
    folder is gone with the plan."""
    import tempfile

    from einshard._cost.child import _child
    from tests import gpt_steps as gpt

    seen: list[tuple[str, dict[str, int]]] = []

    class Recorded(tempfile.TemporaryDirectory):
        def cleanup(self) -> None:
            files = {entry.name: entry.stat().st_size for entry in os.scandir(self.name)}
            seen.append((self.name, files))
            super().cleanup()

    def plan() -> einshard.Plan:
        params, _, _ = gpt.cases(8)["fsdp"]
        # Two candidates: the second compile in the one child reuses the first one's kernels.
        candidates = [strategies.fsdp(min_bytes=0), strategies.tensor_parallel()]
        return einshard.plan(
            gpt.step,
            params,
            gpt.TOKENS,
            candidates=candidates,
            target="h100",
            n_devices=8,
            quiet=True,
            exhaustive=True,
        )

    def figures(plan: einshard.Plan) -> list[tuple]:
        return [
            (
                row.name,
                row.peak_bytes,
                row.report.traffic,
                row.report.bytes_by_kind,
                row.report.flops,
                row.report.simulated_seconds,
            )
            for row in plan.rows
        ]

    monkeypatch.setattr(_child.tempfile, "TemporaryDirectory", Recorded)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cached = plan()
    assert len(seen) == 1
    folder, files = seen[0]
    assert files.get("child-1.bin", 0) > 0  # XLA wrote the first child's kernels
    assert not os.path.exists(folder)
    monkeypatch.setenv("XLA_FLAGS", f"--{_child.KERNEL_CACHE_FLAG}=")  # the user's setting wins: none
    uncached = plan()
    assert len(seen) == 1  # no folder made for a plan whose XLA_FLAGS names the cache
    assert figures(cached) == figures(uncached)
