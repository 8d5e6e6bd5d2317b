"""Every figure a user gives is checked once, the same way, on every path that takes one.

The paths: the keywords of ``explain_step``, ``plan`` and ``plan_batches`` (``bandwidth``,
``latency``, ``flops_per_second``, ``memory_per_device``), ``hardware=`` (through each of them
and ``Hardware.replace``), ``StepReport.at`` and ``Plan.at``. What each figure must be:

* a rate (a bandwidth, FLOP/s): a finite number above 0;
* a time (a latency, the launch floor): a finite number of seconds, 0 or more;
* a fraction (an efficiency): above 0 and at most 1;
* a size (``memory_per_device``, ``memory_bytes``): a whole number of bytes above 0 (a float
  that is whole, ``80e9`` or ``80.5e9``, is taken; ``2.5`` is not);
* a count (``nics_per_host``): a whole number above 0, the same way.

A bool is not a number. Each bad value is an ``EinshardError`` whose headline names the figure
and the value as the user wrote them and what the figure must be. On the keyword and
``hardware=`` paths the error comes before anything is compiled, before a child process starts
and before a target's compiler is looked for: the step here fails if it is ever looked at, and
one of the targets is a GPU whose compiler need not be installed. The ``.at()`` paths reuse one
report and one plan of a small MLP step, compiled once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard import strategies
from einshard._cost.hardware import _figures, _target
from einshard._tracing._call import StepCall
from tests.test_planner import D, mlp_params, sgd_step

N = jax.device_count()
BATCH = jax.ShapeDtypeStruct((8 * N, D), jnp.float32)

MUST_BE = {
    "rate": "a finite number above 0",
    "time": "a finite number of seconds, 0 or more",
    "fraction": "a fraction above 0 and at most 1",
    "bytes": "a whole number of bytes above 0",
    "count": "a whole number above 0",
}
BAD = {
    "rate": [0, 0.0, -1, -1e9, math.nan, math.inf, -math.inf, True, False, "fast", "450e9", 1j, [450e9]],
    "time": [-1, -1e-6, math.nan, math.inf, -math.inf, True, "1us", "0"],
    "fraction": [0, 0.0, -0.5, 2.0, 1.0000001, math.nan, math.inf, True, "0.7"],
    "bytes": [0, -1, 2.5, 80e9 + 0.5, 0.5, -80e9, math.nan, math.inf, True, "80GB", np.float64(1.5)],
    "count": [0, -1, 2.5, 0.5, -8, math.nan, math.inf, True, False, "8", np.float64(1.5), [8]],
}
KIND = {
    "bandwidth": "rate",
    "network_bandwidth": "rate",
    "memory_bandwidth": "rate",
    "peak_flops_per_second": "rate",
    "flops_per_second": "rate",
    "latency": "time",
    "network_latency": "time",
    "launch_seconds": "time",
    "efficiency": "fraction",
    "memory_efficiency": "fraction",
    "memory_bytes": "bytes",
    "memory_per_device": "bytes",
    "nics_per_host": "count",
}
HARDWARE_NAMES = [
    "memory_bytes",
    "memory_bandwidth",
    "peak_flops_per_second",
    "efficiency",
    "memory_efficiency",
    "launch_seconds",
    "bandwidth",
    "network_bandwidth",
    "nics_per_host",
    "latency",
    "network_latency",
]


def never_looked_at(params, batch):
    raise AssertionError("the step was traced: the figure should have been checked first")


@pytest.fixture
def nothing_compiled(monkeypatch):
    """Fails a test whose call gets as far as resolving the step (which precedes every compile and child)."""

    def refused(*args, **kwargs):
        raise AssertionError("the step was resolved before the figures were checked")

    monkeypatch.setattr(StepCall, "of", refused)


def _assert_refused(call, shown: str, kind: str) -> None:
    """``call()`` raises the figure's error, its headline naming ``shown`` and what it must be."""
    with pytest.raises(einshard.EinshardError) as caught:
        call()
    assert caught.value.headline == f"{shown} must be {MUST_BE[kind]}", shown
    assert caught.value.hint is not None and "e.g. " in caught.value.hint, shown


def _keyword_paths():
    """Each entry point with each figure keyword it takes, at a device count that needs a child."""
    explain = {"bandwidth", "latency", "flops_per_second"}
    planning = explain | {"memory_per_device"}
    for name in sorted(explain):
        yield "explain_step", name
        yield "explain_step h100", name
    for verb in ("plan", "plan_batches"):
        for name in sorted(planning):
            yield verb, name


def _calling(path: str, **figures):
    verb, _, target = path.partition(" ")
    extra = {"target": target, "n_devices": 8} if target else {"n_devices": 4}
    if verb == "explain_step":
        return lambda: einshard.explain_step(never_looked_at, mlp_params(), BATCH, **extra, **figures)
    candidates = [strategies.data_parallel()]
    function = einshard.plan if verb == "plan" else einshard.plan_batches
    return lambda: function(never_looked_at, mlp_params(), BATCH, candidates=candidates, **extra, **figures)


@pytest.mark.parametrize(("path", "name"), list(_keyword_paths()))
def test_a_bad_keyword_figure_is_refused_before_anything_is_compiled(path, name, nothing_compiled):
    kind = KIND[name]
    for value in BAD[kind]:
        _assert_refused(_calling(path, **{name: value}), f"{name}={value!r}", kind)


@pytest.mark.parametrize(
    "path", ["explain_step v5e", "explain_step h100", "plan v5e", "plan_batches h100", "replace"]
)
@pytest.mark.parametrize("name", HARDWARE_NAMES)
def test_a_bad_hardware_figure_is_refused_on_every_path(path, name, nothing_compiled):
    kind = KIND[name]
    for value in BAD[kind]:
        if path == "replace":  # a Hardware's figures replaced directly (a TPU's: no compiler needed)
            hardware = _figures._tpu_hardware("v5e")

            def call(hardware=hardware, value=value):
                return hardware.replace({name: value})
        else:
            call = _calling(path, hardware={name: value})
        _assert_refused(call, f"hardware={{{name!r}: {value!r}}}", kind)


@pytest.mark.parametrize("given", ["fast", 0.9, ["efficiency"], True, 0])
def test_hardware_must_be_a_mapping_of_known_names(given, nothing_compiled):
    for path in ("explain_step v5e", "explain_step", "plan", "plan_batches h100"):
        with pytest.raises(einshard.EinshardError) as caught:
            _calling(path, hardware=given)()
        assert (
            caught.value.headline
            == f"hardware= must be a mapping of figures by name, not {type(given).__name__}"
        )
        assert caught.value.hint is not None and all(name in caught.value.hint for name in HARDWARE_NAMES)


def test_an_unknown_hardware_name_lists_the_known_ones(nothing_compiled):
    with pytest.raises(einshard.EinshardError) as caught:
        _calling("plan v5e", hardware={"flops": 1e15})()
    assert caught.value.headline == "hardware={'flops': ...} is not a figure of a target"
    assert caught.value.hint == f"Give any of {', '.join(HARDWARE_NAMES)}."


def test_good_figures_are_taken_as_numbers_of_their_kind():
    """Whole floats are bytes (80e9 is 80,000,000,000), a latency of 0 is none, 1 is the whole peak."""
    assert _figures.checked_figure("memory_per_device", 80e9) == 80_000_000_000
    assert type(_figures.checked_figure("memory_per_device", 80e9)) is int
    assert _figures.checked_figure("memory_per_device", 80.5e9) == 80_500_000_000  # whole too
    assert _figures.checked_figure("memory_per_device", np.int64(1 << 30)) == 1 << 30
    assert _figures.checked_figure("memory_per_device", 2**70) == 2**70  # an int of any size is whole
    assert _figures.checked_figure("latency", 0) == 0.0
    assert _figures.checked_figure("bandwidth", np.float32(1e9)) == pytest.approx(1e9)
    assert type(_figures.checked_figure("bandwidth", 450)) is float
    hardware = _figures._tpu_hardware("v5e").replace({"efficiency": 1, "memory_bytes": 16e9})
    assert hardware.efficiency == 1.0 and hardware.memory_bytes == 16_000_000_000
    assert type(hardware.memory_bytes) is int
    assert hardware.flops_per_second == hardware.peak_flops_per_second  # at the whole peak
    assert (
        _figures.checked_figure("nics_per_host", 4.0) == 4
        and type(_figures.checked_figure("nics_per_host", 4.0)) is int
    )
    assert _figures.checked_figure("nics_per_host", np.int64(16)) == 16


# --- .at(): one report and one plan, compiled once -------------------------------------------------


@pytest.fixture(scope="module")
def report() -> einshard.StepReport:
    return einshard.explain_step(sgd_step, mlp_params(), BATCH, rules=strategies.data_parallel())


@pytest.fixture(scope="module")
def planned() -> einshard.Plan:
    return einshard.plan(sgd_step, mlp_params(), BATCH, candidates=[strategies.data_parallel()])


@pytest.mark.parametrize("name", ["bandwidth", "latency", "flops_per_second"])
def test_a_bad_figure_is_refused_by_a_reports_at(report, name):
    kind = KIND[name]
    for value in BAD[kind]:
        _assert_refused(lambda value=value: report.at(**{name: value}), f"{name}={value!r}", kind)


@pytest.mark.parametrize("name", ["bandwidth", "latency", "flops_per_second", "memory_per_device"])
def test_a_bad_figure_is_refused_by_a_plans_at(planned, name):
    kind = KIND[name]
    for value in BAD[kind]:
        _assert_refused(lambda value=value: planned.at(**{name: value}), f"{name}={value!r}", kind)


def test_at_takes_whole_float_bytes_and_a_latency_of_zero(report, planned):
    """At 1e9 B/s and no latency, communication is the rows' traffic over 1e9 B/s, nothing more."""
    at = report.at(bandwidth=1e9, latency=0)
    traffic = sum(row.traffic for row in report.rows)
    assert traffic > 0 and at.latency == 0.0 and at.communication_seconds == pytest.approx(traffic / 1e9)
    plan = planned.at(memory_per_device=80e9)
    assert plan.memory_per_device == 80_000_000_000 and type(plan.memory_per_device) is int
    assert plan.best.name == "data parallel"


def test_a_given_network_latency_of_zero_is_kept(monkeypatch):
    """hardware={'network_latency': 0} is a figure (a time may be 0), not a missing one: it is not
    replaced by the NVLink latency. A device without a network (a TPU slice) takes its link's."""
    gpu = _figures.Hardware(
        device="a GPU",
        memory_bytes=80 << 30,
        memory_bandwidth=3e12,
        peak_flops_per_second=1e15,
        efficiency=0.75,
        bandwidth=450e9,
        network_bandwidth=50e9,
        devices_per_host=8,
        sources={},
        latency=1e-6,
        network_latency=5e-6,
    )
    tpu = _figures.Hardware(**{**gpu.__dict__, "network_bandwidth": None, "network_latency": None})
    monkeypatch.setattr(_figures, "check_compiler", lambda target: None)
    monkeypatch.setattr(_figures, "_gpu_hardware", lambda name: gpu)
    monkeypatch.setattr(_figures, "_tpu_hardware", lambda name: tpu)
    h100 = _target.parse_target("h100", 16)
    given = _figures.resolve_figures(h100, {"network_latency": 0})
    assert (given.network_latency, given.latency) == (0.0, 1e-6)
    assert _figures.resolve_figures(h100).network_latency == 5e-6
    assert _figures.resolve_figures(_target.parse_target("v5e", 8)).network_latency == 1e-6
