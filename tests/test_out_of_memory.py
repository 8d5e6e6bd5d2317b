"""A step that does not fit a target's memory is a verdict, not a crash.

libtpu refuses a program that does not fit a chip's HBM (``RESOURCE_EXHAUSTED: ...
CompileTimeHbmOom ...``). ``explain_step`` raises ``einshard.DoesNotFitError`` with the bytes the
compiler needed, the bytes it had and the target, and the fixes; ``plan`` and ``plan_batches``
reject such a candidate (or batch size) for memory with the same figures. XLA's GPU compiler
does not refuse such a program: it compiles it, and the report's memory says it does not fit.

* Without a compiler: libtpu's two messages read; the error's text, figures and pickling; the
  rejection it becomes; a plan's row keeps it at other figures; a batch search takes a refused
  size as too large.
* With libtpu (``nox -s targets``): the step refused in this process and in a child; a plan and a
  batch plan on v5e; with XLA's GPU compiler, a step far too large for an H100 compiled and said
  not to fit. The arguments are ``jax.ShapeDtypeStruct``: nothing is allocated here.
"""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard._cost.hardware import _compilers, _figures, _target
from einshard._cost.pipeline import _analysis
from einshard._cost.xla import _messages
from einshard._planning.search import _batch_sizes, _candidates, _planner
from einshard._tracing._call import StepCall
from tests.test_targets import needs_gpu, needs_tpu

# libtpu 0.0.50's message, and the older one (a v3-8, LargeWorldModel/LWM#60).
NEWER = (
    "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
    "required for HLO temporaries (23.84G) exceeds available HBM (15.75G). HLO module: jit_step.\n"
    "See https://openxla.org/xla/errors/error_1000 for more details."
)
OLDER = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
    "Used 21.95G of 15.48G hbm.\n Exceeded hbm capacity by 6.47G."
)
G = 2**30


@pytest.mark.parametrize(
    ("message", "needed", "available"),
    [(NEWER, 23.84 * G, 15.75 * G), (OLDER, 21.95 * G, 15.48 * G)],
)
def test_libtpu_s_refusal_is_read_with_its_figures(message, needed, available):
    refusal = _messages.parse_out_of_memory(message)
    assert refusal == _messages.OutOfMemory(round(needed), round(available), "HBM")


@pytest.mark.parametrize(
    "message",
    [
        "INTERNAL: Mosaic failed to compile TPU kernel",
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.",  # at run time, on a GPU
        "Can't reduce memory use below 37.25GiB (40000000000 bytes) by rematerialization",
    ],
)
def test_other_messages_are_no_refusal(message):
    assert _messages.parse_out_of_memory(message) is None


def _refused() -> _analysis.DoesNotFitError:
    refusal = _messages.parse_out_of_memory(NEWER)
    assert refusal is not None
    return _analysis.does_not_fit(refusal, _target.parse_target("v5e", 8))


def test_the_error_says_the_step_does_not_fit_with_its_figures_and_the_fixes():
    error = _refused()
    assert isinstance(error, einshard.EinshardError)
    assert (error.needed, error.available, error.target) == (
        round(23.84 * G),
        round(15.75 * G),
        "8 V5E (v5e:2x4)",
    )
    assert error.headline == (
        "the step does not fit 8 V5E (v5e:2x4): XLA's compiler for it needs 23.8 GiB per device, more "
        "than the 15.8 GiB of HBM it has for a program (of the TPU v5e's 16.0 GiB)"
    )
    assert error.hint is not None
    for fix in ("n_devices=16", "a smaller batch", "jax.checkpoint", "pinned_host"):
        assert fix in error.hint
    assert "this machine first" not in str(error)
    assert type(error).__module__ == "einshard" and einshard.DoesNotFitError is type(error)


def test_the_error_crosses_from_a_child_with_its_figures():
    error = _refused().add_context("in a child process compiling for 8 V5E (v5e:2x4)")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is einshard.DoesNotFitError
    assert (copy.needed, copy.available, copy.target) == (error.needed, error.available, error.target)
    assert str(copy) == str(error)


def test_a_plan_rejects_the_refused_candidate_for_memory_with_the_figures():
    rejection = _candidates.rejection_of(_refused())
    assert rejection.kind == _candidates.MEMORY and rejection.compiled
    assert rejection == (
        "does not fit memory: XLA's compiler needs 23.8 GiB > 15.8 GiB per device for a program on "
        "8 V5E (v5e:2x4)"
    )
    # At other figures (Plan.at), a refusal has no report to decide from again: it stays.
    row = _planner.PlanRow(einshard.strategies.data_parallel(), None, rejection)
    assert _planner._rejected_at(row, _figures.Figures(memory_per_device=10**15), changed=True) is rejection
    assert row.argument_bytes is None  # not a rejection by its bounds


def test_a_batch_search_takes_a_refused_size_as_too_large_not_as_a_failed_candidate():
    search = _batch_sizes.SizeSearch(unit=2, start=64, ladder=None, limit=16 * G, budget=8)
    search.record(64, None, _candidates.rejection_of(_refused()))
    assert search.failed is None and search.hi == 32  # searched below, not rejected
    assert search.next_size() is not None and search.next_size() < 64
    other = _batch_sizes.SizeSearch(unit=2, start=64, ladder=None, limit=16 * G, budget=8)
    other.record(64, None, _candidates.Rejection(_candidates.COMPILE, "a failed check"))
    assert other.failed is not None and other.next_size() is None  # another failure rejects it


# --- compiled: libtpu refuses, XLA's GPU compiler does not -------------------------------------------


def _square(x):
    return (jnp.sin(x) @ jnp.cos(x)).sum()


# 80,000 x 80,000 f32: 23.8 GiB, its sine and cosine as large again: no v5e chip holds it.
TOO_LARGE = jax.ShapeDtypeStruct((80_000, 80_000), jnp.float32)


@needs_tpu
def test_a_step_libtpu_refuses_is_a_verdict_in_this_process():
    from einshard._sharding._devices import use_devices

    target = _target.parse_target("v5e", 1)
    call = StepCall.of(_square, (TOO_LARGE,), {})
    with use_devices(_compilers.target_devices(target)), pytest.raises(einshard.DoesNotFitError) as info:
        _analysis.analyse(call, None, target)
    error = info.value
    assert error.headline.startswith("the step does not fit 1 V5E (v5e:1x1): XLA's compiler for it needs")
    assert error.needed > error.available > 15 * G


@needs_tpu
def test_a_step_libtpu_refuses_is_a_verdict_from_a_child():
    with pytest.raises(einshard.DoesNotFitError) as info:
        einshard.explain_step(_square, TOO_LARGE, target="v5e", n_devices=1, quiet=True)
    error = info.value
    assert error.needed > error.available > 15 * G and error.target == "1 V5E (v5e:1x1)"
    assert error.context == ["in a child process compiling for 1 V5E (v5e:1x1)"]
    assert "this machine first" not in str(error)


def _update(params, batch):
    grads = jax.grad(lambda p: jnp.mean(jnp.tanh(batch @ p["w"]) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@needs_tpu
def test_a_plan_on_v5e_rejects_the_candidate_libtpu_refuses_and_keeps_the_one_that_fits():
    # A 9.3 GiB weight: replicated, it and its gradient overflow a v5e chip's 15.75 GiB; split
    # over 2 chips on its output axis by FSDP (the small batch gathered instead), they fit.
    # memory_per_device is set far above, so that the plan's own bound lets both be compiled:
    # the refusal is the compiler's.
    params = {"w": jax.ShapeDtypeStruct((20_000, 125_000), jnp.float32)}
    batch = jax.ShapeDtypeStruct((16, 20_000), jnp.float32)
    candidates = [einshard.strategies.data_parallel(), einshard.strategies.fsdp()]
    result = einshard.plan(
        _update, params, batch, target="v5e", n_devices=2, memory_per_device=10**15,
        candidates=candidates, exhaustive=True, quiet=True,
    )  # fmt: skip
    rows = {row.name: row for row in result.rows}
    refused = rows["data parallel"]
    assert refused.report is None and refused.rejected_for == "memory"
    assert str(refused.rejected).startswith("does not fit memory: XLA's compiler needs ")
    assert str(refused.rejected).endswith(" per device for a program on 2 V5E (v5e:1x2)")
    assert result.best.name == "fsdp" and rows["fsdp"].report is not None


def _loss(params, batch):
    return jnp.mean(jnp.tanh(batch * params["s"]) ** 2)


@needs_tpu
def test_a_batch_plan_on_v5e_searches_below_the_sizes_libtpu_refuses():
    # Each example is 2**22 f32 (16 MiB): a thousand fill a v5e chip's 16 GiB, more than the
    # 15.75 GiB libtpu has for a program. From 1024 the refused sizes are misses, and the search
    # goes down to one that compiles. memory_per_device is far
    # above: every size the compiler takes fits, so the sizes it refuses bound the search.
    params = {"s": jax.ShapeDtypeStruct((2**22,), jnp.float32)}
    batch = jax.ShapeDtypeStruct((1024, 2**22), jnp.float32)
    result = einshard.plan_batches(
        _loss, params, batch, target="v5e", n_devices=1, memory_per_device=10**15,
        candidates=[einshard.strategies.data_parallel()], max_compiles=3, quiet=True,
    )  # fmt: skip
    (row,) = result.rows
    refused = [t for t in row.tried if t.reason is not None]
    assert refused and all(t.reason.kind == _candidates.MEMORY for t in refused)
    assert refused[0].batch_size == 1024 and "XLA's compiler needs" in refused[0].reason
    assert row.report is not None and 0 < row.batch_size < min(t.batch_size for t in refused)


@needs_gpu
def test_xla_s_gpu_compiler_compiles_a_step_too_large_and_the_report_says_it_does_not_fit():
    # 160,000 x 160,000 f32 (95 GiB): no H100 holds it. XLA's GPU compiler does not refuse it (as
    # libtpu does): if it starts to, this fails, and the refusal should be read as libtpu's is.
    x = jax.ShapeDtypeStruct((160_000, 160_000), jnp.float32)
    report = einshard.explain_step(_square, x, target="h100", n_devices=1, quiet=True)
    assert report.hardware is not None and report.peak_bytes > report.hardware.memory_bytes
    assert f"does NOT fit in the {report.hardware.device}'s" in str(report)
