"""An error of einshard's own is raised as it is, never turned into a verdict on the user's step.

* A "please report it" assertion reading the compiled program is raised by ``explain_step`` and
  ``plan``, in this process and from a child process, not turned into "does not compile" (a
  candidate rejected, or a hint to run the step on this machine).
* A compile that fails is failed once: its own error is the one raised, not the error of a second
  compile with other options.
* A record of a child process this process cannot read is said to be that, not "XLA aborted".
"""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard import strategies
from einshard._cost.child import _child
from einshard._cost.pipeline import _analysis, _compile
from tests.child_faults import step

N = jax.device_count()
PARAMS = jax.ShapeDtypeStruct((4 * N, 16), jnp.float32)
BATCH = jax.ShapeDtypeStruct((8 * N, 16), jnp.float32)
CANDIDATES = [strategies.data_parallel(), strategies.fsdp(min_bytes=0)]
REPORT_IT = "please report it"


def _unreadable(*args, **kwargs):
    raise AssertionError("einshard cannot read this XLA text (please report it): a test's fault")


def test_an_assertion_reading_the_program_is_raised_here(monkeypatch):
    assert einshard.explain_step(step, PARAMS, BATCH).rows is not None  # the step itself compiles
    monkeypatch.setattr(_analysis, "_reported", _unreadable)
    with pytest.raises(AssertionError, match=REPORT_IT):
        einshard.explain_step(step, PARAMS, BATCH)
    with pytest.raises(AssertionError, match=REPORT_IT):
        einshard.plan(step, PARAMS, BATCH, candidates=CANDIDATES, quiet=True)


def test_an_assertion_reading_the_program_in_a_child_is_raised_here(monkeypatch):
    monkeypatch.setenv("EINSHARD_TEST_FAULT", "read")
    with pytest.raises(AssertionError, match=REPORT_IT) as raised:
        einshard.explain_step("tests.child_faults:step", PARAMS, BATCH, n_devices=N, quiet=True)
    assert "child process" in "".join(getattr(raised.value, "__notes__", []))
    with pytest.raises(AssertionError, match=REPORT_IT):
        einshard.plan(
            "tests.child_faults:step", PARAMS, BATCH, isolate=True, candidates=CANDIDATES, quiet=True
        )
    monkeypatch.delenv("EINSHARD_TEST_FAULT")
    report = einshard.explain_step(
        "tests.child_faults:step", PARAMS, BATCH, n_devices=N, rules=CANDIDATES[0], quiet=True
    )
    assert report.n_devices == N and report.flops  # the same step, without the fault, is read


class _Lowered:
    """A lowered program whose compiles fail as given, in order; it counts them."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def compile(self, **kwargs):
        self.calls += 1
        raise self.errors.pop(0)


def test_a_compile_that_fails_is_failed_once_with_its_own_error():
    lowered = _Lowered(RuntimeError("RESOURCE_EXHAUSTED: out of memory"), RuntimeError("another error"))
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        _compile._compiled(_compile.Program(lambda: lowered))
    assert lowered.calls == 1


def test_a_backend_that_refuses_the_option_is_compiled_without_it():
    refused = RuntimeError(f"unknown option {_compile._RECOMPILE_OPTION}")
    lowered = _Lowered(refused, RuntimeError("the program's own error"))
    with pytest.raises(RuntimeError, match="own error"):
        _compile._compiled(_compile.Program(lambda: lowered))
    assert lowered.calls == 2


class _Unreadable:
    """``pickle`` for ``_child``, whose answers cannot be read (as if of another einshard)."""

    dumps = staticmethod(pickle.dumps)

    @staticmethod
    def load(stream):
        record = pickle.load(stream)
        if record[0] == "answer":
            raise pickle.UnpicklingError("no class Answer here")
        return record


def test_a_child_s_record_that_cannot_be_read_is_said_to_be_that(monkeypatch):
    monkeypatch.setattr(_child, "pickle", _Unreadable)
    with pytest.raises(AssertionError, match="cannot read what its child process") as raised:
        einshard.explain_step("tests.child_faults:step", PARAMS, BATCH, n_devices=N, quiet=True)
    assert "aborted" not in str(raised.value) and "UnpicklingError" in str(raised.value)
