"""Arrays sharded by any two (or three) expressions meet in one jit.

Every layout over one device order is written on one mesh (the prime factors of
the device count), so JAX can write any output of a jit over arrays of
different layouts. The property tests draw random valid expressions, place
arrays by them, and run elementwise, matmul/einsum, concatenate and reduction
steps that return every input and every result: they compile, their values
equal NumPy's, and every output is a ``NamedSharding`` on the shared mesh. The
layouts that cannot share a mesh (device counts with different prime factors,
counts in the "wrong" order: ``x3 2`` on 6 devices) must instead have been
warned about.

The jits run in a child process (``meet_worker.py``), because jaxlib 0.12's
Shardy partitioner aborts the process on some layouts over meshes whose axis
sizes are coprime (6, 12 devices). Exactly those cases are recognised by the
abort's own message, checked to compile and give the right values under the
GSPMD partitioner, and allowed; any other failure fails the test. A separate
test pins the upstream bug itself: it fails when a jaxlib fixes it, so the
known-limits section of the docs gets updated.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from reference_v020 import blocks_v020, elements_v020, expected_blocks, index_blocks

import einshard
from conftest import N_DEVICES  # type: ignore[import-not-found]
from einshard._language._layout import compile_layout
from einshard._language._numbers import prime_factors
from einshard._sharding import _mesh
from einshard._sharding._mesh import layout_mesh_shape, shared_mesh_shape

HERE = Path(__file__).parent
WORKER = HERE / "meet_worker.py"
XLA_ABORT = "Could not slice dimension"  # hlo_sharding_util.cc's check, see docs/expressions.md
JAXLIB = tuple(int(part) for part in jaxlib.__version__.split(".")[:3] if part.isdigit())
SHARDY_BUG = JAXLIB >= (0, 12, 0)  # first seen in jaxlib 0.12.0; 0.8.1 to 0.11.0 compile these cases

# The suite's own device count (nox -s tests runs this module at 8, 16, 6 and 12).
COUNTS = [N_DEVICES]


class Worker:
    """A long-lived child process running cases; restarted after XLA aborts it."""

    def __init__(self, n_devices: int, partitioner: str) -> None:
        self.args = [sys.executable, str(WORKER), str(n_devices), partitioner]
        self.process: subprocess.Popen[str] | None = None
        self.shared_mesh = ""
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open for the worker's life)

    def _start(self) -> subprocess.Popen[str]:
        self.stderr.seek(0)
        self.stderr.truncate()
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
        process = subprocess.Popen(
            self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )
        assert process.stdout is not None
        ready = process.stdout.readline()
        assert ready, self._stderr_text()
        self.shared_mesh = json.loads(ready)["shared_mesh"]
        return process

    def _stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def ask(self, case: dict) -> dict:
        if self.process is not None and self.process.poll() is not None:
            self._stop()
        if self.process is None:
            self.process = self._start()
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(case) + "\n")
        self.process.stdin.flush()
        placed: dict = {}  # what the child said before compiling: warnings, input meshes
        while True:
            line = self.process.stdout.readline()
            if not line:  # the child died: XLA aborted it
                self._stop()
                return {**placed, "crashed": True, "compiling": bool(placed), "stderr": self._stderr_text()}
            answer = json.loads(line)
            if answer.pop("compiling", False):
                placed = answer
                continue
            assert "worker_error" not in answer, answer["worker_error"]
            return answer

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    stream.close()
            self.process = None

    def close(self) -> None:
        self._stop()
        self.stderr.close()


@pytest.fixture(scope="module")
def workers():
    started: dict[tuple[int, str], Worker] = {}

    def get(n_devices: int, partitioner: str = "shardy") -> Worker:
        key = (n_devices, partitioner)
        if key not in started:
            started[key] = Worker(n_devices, partitioner)
        return started[key]

    yield get
    for worker in started.values():
        worker.close()


# --- random valid expressions for a 2-D array -------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


@st.composite
def expressions(draw: st.DrawFn, n_devices: int) -> str:
    """A valid expression for an array ``x y`` on ``n_devices`` devices: counts in any order,
    standalone copies, unsplit names anywhere, and stars that resolve to the same counts."""
    factors: list[int] = []
    rest = n_devices
    while rest > 1:
        factor = draw(st.sampled_from(_divisors(rest)))
        factors.append(factor)
        rest //= factor
    roles = draw(st.permutations(["x", "y"] + ["r"] * len(factors)))
    elements: list[tuple[str, int]] = []
    counts = iter(factors)
    for role in roles:
        if role == "r":
            elements.append(("", next(counts)))
        else:
            # A name takes the next factor or none (it may also stay unsplit).
            elements.append((role, 1))
    # Give the names some of the factors: a name next to a copy count may absorb it.
    merged: list[tuple[str, int]] = []
    for name, count in elements:
        if name and merged and merged[-1][0] == "" and draw(st.booleans()):
            merged[-1] = (name, merged[-1][1])
        else:
            merged.append((name, count))
    assert math.prod(c for _, c in merged) == n_devices
    star = draw(st.sampled_from([None, *range(len(merged))]))
    parts = []
    for i, (name, count) in enumerate(merged):
        if i == star and count > 1:
            parts.append(f"{name}*")  # '*' on a count c alone resolves to c
        elif name:
            parts.append(f"{name}{count}" if count > 1 else name)
        else:
            parts.append(str(count))
    if star is None and draw(st.booleans()) and all(c == 1 for n, c in merged if n):
        return "... -> * ..." if n_devices > 1 else "... -> ..."
    return "x y -> " + " ".join(parts)


def _meshes(exprs: list[str], n_devices: int) -> set[tuple[int, ...]]:
    return {layout_mesh_shape(compile_layout(e, 2, n_devices)) for e in exprs}


def _check(workers, n_devices: int, case: dict) -> None:
    """Runs ``case`` and asserts what the module docstring says."""
    worker = workers(n_devices)
    answer = worker.ask(case)
    exprs = case["exprs"]
    if case.get("ambient") is None and len(_meshes(exprs, n_devices)) > 1:
        # Layouts on two meshes: documented as unable to meet, and warned about.
        assert not answer.get("crashed") or answer["compiling"], answer
        assert any("cannot meet in one jit" in w for w in answer.get("warnings", [])), (exprs, answer)
        return
    if answer.get("crashed"):
        # Exactly jaxlib's Shardy abort, on meshes with coprime axis sizes; GSPMD compiles the case.
        assert SHARDY_BUG and answer["compiling"] and XLA_ABORT in answer["stderr"], (exprs, answer)
        assert len(set(prime_factors(n_devices))) > 1, (exprs, answer)
        answer = workers(n_devices, "gspmd").ask(case)
        assert not answer.get("crashed"), (exprs, answer)
    assert "jax_error" not in answer, (exprs, answer)
    assert answer["warnings"] == [], (exprs, answer)
    if answer["values_equal"] is not None:
        assert answer["values_equal"], (exprs, answer)
    assert answer["outputs_named"], (exprs, answer)
    # Every output is written on the inputs' one mesh: the shared one, unless the user's
    # ambient mesh, or every input has the same layout of its own order.
    assert len(answer["input_meshes"]) == 1 and answer["output_meshes"] == answer["input_meshes"], answer
    shared = shared_mesh_shape(n_devices)
    fits = all(layout_mesh_shape(compile_layout(e, 2, n_devices)) == shared for e in exprs)
    if case.get("ambient") is None and fits:
        assert answer["input_meshes"] == [worker.shared_mesh], (exprs, answer)


PROPERTY = settings(
    max_examples=int(os.environ.get("EINSHARD_MEET_EXAMPLES", "15")),  # nox -s fuzz: more
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("n_devices", COUNTS)
@PROPERTY
@given(data=st.data())
def test_pairs_meet_in_one_jit(workers, n_devices, data):
    exprs = [data.draw(expressions(n_devices)) for _ in range(2)]
    op = data.draw(st.sampled_from(["add", "matmul", "einsum", "concat", "reduce"]))
    _check(workers, n_devices, {"exprs": exprs, "op": op})


@pytest.mark.parametrize("n_devices", COUNTS)
@PROPERTY
@given(data=st.data())
def test_triples_meet_in_one_jit(workers, n_devices, data):
    exprs = [data.draw(expressions(n_devices)) for _ in range(3)]
    op = data.draw(st.sampled_from(["add", "concat"]))
    _check(workers, n_devices, {"exprs": exprs, "op": op})


@pytest.mark.parametrize("n_devices", COUNTS)
@PROPERTY
@given(data=st.data())
def test_abstract_inputs_lower_in_one_jit(workers, n_devices, data):
    """``ShapeDtypeStruct``s carrying the shardings lower and compile to outputs on the shared mesh."""
    exprs = [data.draw(expressions(n_devices)) for _ in range(2)]
    op = data.draw(st.sampled_from(["add", "matmul", "concat", "reduce"]))
    _check(workers, n_devices, {"exprs": exprs, "op": op, "input": "struct"})


def _ambient(n_devices: int) -> list[list]:
    """A (data, model) mesh for the device count, model the larger factor."""
    factors = prime_factors(n_devices)
    data = factors[0] if len(factors) > 1 else 1
    return [["data", data], ["model", n_devices // data]]


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
@pytest.mark.parametrize("n_devices", COUNTS)
@PROPERTY
@given(data=st.data())
def test_pairs_meet_under_an_ambient_mesh(workers, n_devices, axis_types, data):
    exprs = [data.draw(expressions(n_devices)) for _ in range(2)]
    # Explicit axes: JAX makes the step say how operands of different layouts meet.
    ops = ["add", "concat"] if axis_types == "explicit" else ["add", "matmul", "concat", "reduce"]
    op = data.draw(st.sampled_from(ops))
    case = {"exprs": exprs, "op": op, "ambient": _ambient(n_devices), "axis_types": axis_types}
    answer = workers(n_devices).ask(case)
    # An expression that does not fit the user's mesh is an EinshardError, checked elsewhere.
    assume("einshard_error" not in answer)
    _check(workers, n_devices, case)


# --- the shared mesh, without a jit -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8, 12, 16, 64, 96, 1024])
def test_every_power_of_two_layout_and_every_ordered_one_fits_the_shared_mesh(n):
    shared = shared_mesh_shape(n)
    assert math.prod(shared) == n
    assert list(shared) == sorted(shared)
    # Counts that grow along the right-hand side fit; a power of two always does.
    for text in ["x y -> x y*", "x y -> x* y", "x y -> x y *", "x y -> * x y", "... -> * ..."]:
        assert layout_mesh_shape(compile_layout(text, 2, n)) == shared, text
    if n & (n - 1) == 0 and n >= 4:
        for text in ["x y -> x2 y*", "x y -> y2 x*", "x y -> x* y 2", "x y -> 2 x y*"]:
            assert layout_mesh_shape(compile_layout(text, 2, n)) == shared, text


def test_orders_that_do_not_fit_share_their_own_mesh():
    # On 12 devices 'x3 4' and 'x6 2' (3 first) share a mesh, which is not the shared one.
    own = {layout_mesh_shape(compile_layout(t, 1, 12)) for t in ["x -> x3 4", "x -> x6 2", "x -> x3 2 2"]}
    assert own == {(3, 2, 2)}
    assert layout_mesh_shape(compile_layout("x -> x4 3", 1, 12)) == shared_mesh_shape(12) == (2, 2, 3)


def test_equal_layouts_give_equal_hashable_shardings_on_one_mesh():
    n = N_DEVICES
    a = einshard.make_sharding("x y -> x y*")
    b = einshard.make_sharding("a b -> a b*")
    c = einshard.make_sharding(f"x y -> x y{n}")
    assert a == b == c and hash(a) == hash(b) == hash(c)
    d = einshard.make_sharding("x y -> x* y")
    assert d.mesh is a.mesh  # every layout over the device order: one mesh object
    assert d != a


def _device_subset(k: int) -> tuple:
    devices = jax.devices()
    return tuple(reversed(devices[:k]))


@pytest.mark.skipif(N_DEVICES < 6, reason="needs 6 devices")
def test_layouts_on_two_meshes_warn_once_naming_both_and_a_fitting_order():
    devices = _device_subset(6)
    # This order's first layouts in the process, whatever other tests handed out before.
    _mesh._meshes_seen.pop(devices, None)
    _mesh.layout_sharding.cache_clear()
    first = einshard.make_sharding("x -> x2 3", devices=devices)  # the shared (2, 3) mesh
    with pytest.warns(einshard.EinshardWarning) as record:
        odd = einshard.make_sharding("x -> x3 2", devices=devices)  # needs 3 first: (3, 2)
    assert first.mesh.axis_sizes == (2, 3) and odd.mesh.axis_sizes == (3, 2)
    (message,) = [str(w.message) for w in record]
    assert "'x -> x3 2' and 'x -> x2 3'" in message
    assert "cannot meet in one jit" in message
    assert "An order that fits it: 'x -> 2 x3'" in message
    # The suggestion fits the shared mesh; nothing more is said for the same meshes.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert einshard.make_sharding("x -> 2 x3", devices=devices).mesh is first.mesh
        einshard.make_sharding("y -> y3 2", devices=devices)
        einshard.make_sharding("y -> y2 3", devices=devices)
    # The layout is 0.2.0's all the same: devices 0, 2, 4 hold block 0 ('x3' outer).
    positions = {devices.index(d): idx for d, idx in odd.devices_indices_map((6,)).items()}
    assert [positions[p][0].start for p in range(6)] == [0, 0, 2, 2, 4, 4]


def _reproducer() -> str:
    """The upstream report's reproducer, as docs/expressions.md shows it (so the two cannot drift)."""
    page = (HERE.parent / "docs" / "expressions.md").read_text()
    section = page[page.index("{ #shardy-abort }") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```\n", start)]


def test_the_shardy_abort_is_still_in_this_jaxlib():
    """The upstream bug the docs describe. Fails once a jaxlib fixes it: then update
    'Known limits' in docs/expressions.md and ``SHARDY_BUG`` above."""
    code = _reproducer()
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    if SHARDY_BUG:
        assert result.returncode != 0 and XLA_ABORT in result.stderr, result.stderr[-2000:]
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "P(None, ('a', 'b'))" in result.stdout


def test_gspmd_compiles_the_case_shardy_aborts_on():
    gspmd = "import jax\njax.config.update('jax_use_shardy_partitioner', False)\n"
    code = _reproducer().replace("import jax\n", gspmd, 1)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert np.isclose(float(result.stdout.split()[-1]), 24.0)


# --- the one mesh against a reference, without a jit (in this process) ---------------------------
#
# The docs' rule, written here a second way: the shared mesh's axes are the prime factors of the
# device count, smallest first; a layout fits it when every running product of its counts (left
# to right, size-1 elements aside) is a running product of the mesh's axes, each count then
# taking the axes in between; a layout that does not fit gets its counts' prime factors, largest
# first within each count. Under an ambient mesh the same matching runs over its axes.


def reference_primes(n: int) -> tuple[int, ...]:
    """The prime factors of ``n``, smallest first, by trial division."""
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out)


def reference_shared(n: int) -> tuple[int, ...]:
    return reference_primes(n) or (1,)


def reference_runs(counts, sizes) -> list[tuple[int, ...]] | None:
    """For each count, the indices of the axes of ``sizes`` it takes, or ``None`` if it does not fit."""
    axes = [i for i, size in enumerate(sizes) if size > 1]
    ends, product = {}, 1  # running product of the axes -> the position of the axis it ends at
    for position, i in enumerate(axes):
        product *= sizes[i]
        ends[product] = position
    runs, start, total = [], 0, 1
    for count in counts:
        total *= count
        if count == 1:
            runs.append(())
            continue
        if total not in ends:
            return None
        runs.append(tuple(axes[start : ends[total] + 1]))
        start = ends[total] + 1
    return runs


def reference_counts(expression: str, n_dims: int, n_devices: int) -> list[tuple[str | None, int]]:
    """The ``(name, count)`` a layout needs of the mesh, in order: size-1 elements take nothing,
    and neighbouring standalone counts (copies, no name) are one (``3 2`` copies 6 times either way)."""
    counts: list[tuple[str | None, int]] = []
    for name, count in elements_v020(expression, n_dims, n_devices):
        if count == 1:
            continue
        if name is None and counts and counts[-1][0] is None:
            counts[-1] = (None, counts[-1][1] * count)
        else:
            counts.append((name, count))
    return counts


def reference_own(counts) -> tuple[int, ...]:
    return tuple(p for count in counts for p in reversed(reference_primes(count))) or (1,)


def _assert_layout(sharding, expression: str, shape: tuple[int, ...], devices) -> None:
    """The devices-to-blocks map is 0.2.0's over ``devices``."""
    shards, _ = blocks_v020(expression, len(shape), len(devices))
    assert index_blocks(sharding, shape, shards) == expected_blocks(expression, shape, list(devices)), (
        expression
    )


@pytest.mark.parametrize("k", range(1, N_DEVICES + 1))
def test_the_shared_mesh_of_k_devices_is_their_prime_factors_smallest_first(k):
    devices = jax.devices()[:k]
    mesh = einshard.make_sharding(f"x -> x{k}", devices=devices).mesh
    assert mesh.axis_sizes == reference_shared(k)
    assert mesh is einshard.make_sharding("x y -> x y*", devices=devices).mesh
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]


@pytest.mark.parametrize("n_devices", COUNTS)
@settings(deadline=None)
@given(data=st.data())
def test_a_layout_is_on_the_shared_mesh_exactly_when_its_counts_grow_along_it(n_devices, data):
    expression = data.draw(expressions(n_devices))
    shape = (2 * n_devices, 2 * n_devices)
    counts = [count for _, count in reference_counts(expression, 2, n_devices)]
    sharding = einshard.make_sharding(expression, shape=shape)
    if reference_runs(counts, reference_shared(n_devices)) is not None:
        assert sharding.mesh.axis_sizes == reference_shared(n_devices), expression
        assert sharding.mesh is einshard.make_sharding("x -> x*").mesh, expression
    else:
        assert sharding.mesh.axis_sizes == reference_own(counts), expression
    _assert_layout(sharding, expression, shape, jax.devices())


# The docs' table ("Layouts that cannot share a mesh"): device count -> layouts that fit the shared
# mesh, and those that need a mesh of their own (with its shape).
FIT = {
    6: ["x y -> x2 y 3", "x y -> x y*", "x y -> x* y", "x y -> 2 x3 y", "x y -> x2 y3", "x -> 2 x3"],
    12: ["x -> x4 3", "x y -> x2 y6", "x y -> x y*", "x y -> x2 y2 3", "x y -> 2 x6 y", "x -> 4 x3"],
}
OWN = {
    6: {"x -> x3 2": (3, 2), "x y -> x3 y2": (3, 2), "x -> 3 x2": (3, 2)},
    12: {"x -> x3 4": (3, 2, 2), "x -> x6 2": (3, 2, 2), "x y -> x3 y2 2": (3, 2, 2), "x -> 3 x4": (3, 2, 2)},
}
SHARED = {6: (2, 3), 12: (2, 2, 3)}


def _devices(k: int) -> list:
    if k > N_DEVICES:
        pytest.skip(f"needs {k} devices")
    return jax.devices()[:k]


def _shape(expression: str, k: int) -> tuple[int, ...]:
    return (2 * k,) * len(einshard.parse(expression).left)


@pytest.mark.parametrize(("k", "expression"), [(k, e) for k, es in FIT.items() for e in es])
def test_the_docs_layouts_that_fit_share_the_mesh(k, expression):
    devices = _devices(k)
    sharding = einshard.make_sharding(expression, shape=_shape(expression, k), devices=devices)
    assert sharding.mesh.axis_sizes == SHARED[k]
    assert sharding.mesh is einshard.make_sharding("x -> x*", devices=devices).mesh
    _assert_layout(sharding, expression, _shape(expression, k), devices)


@pytest.mark.parametrize(("k", "expression"), [(k, e) for k, es in OWN.items() for e in es])
def test_the_docs_layouts_that_do_not_fit_get_a_mesh_of_their_own(k, expression):
    devices = _devices(k)
    sharding = einshard.make_sharding(expression, shape=_shape(expression, k), devices=devices)
    assert sharding.mesh.axis_sizes == OWN[k][expression]
    assert sharding.mesh is not einshard.make_sharding("x -> x*", devices=devices).mesh
    _assert_layout(sharding, expression, _shape(expression, k), devices)


# Under an ambient mesh: (device count, mesh axes, expression, the spec, by hand; None: does not fit).
AMBIENT = [
    (6, (("a", 2), ("b", 3)), "x y -> x y*", P(None, ("a", "b"))),
    (6, (("a", 2), ("b", 3)), "x y -> x6 y", P(("a", "b"), None)),
    (6, (("a", 2), ("b", 3)), "x y -> x2 y3", P("a", "b")),
    (6, (("a", 2), ("b", 3)), "x y -> 2 x3 y", P("b", None)),
    (6, (("a", 2), ("b", 3)), "x y -> x3 y2", None),
    (6, (("a", 3), ("b", 2)), "x y -> x3 y2", P("a", "b")),
    (6, (("a", 3), ("b", 2)), "x y -> x y*", P(None, ("a", "b"))),
    (6, (("a", 3), ("b", 2)), "x y -> x2 y3", None),
    (6, (("a", 1), ("b", 6)), "x y -> x* y", P("b", None)),
    (12, (("a", 2), ("b", 2), ("c", 3)), "x y -> x4 y3", P(("a", "b"), "c")),
    (12, (("a", 2), ("b", 2), ("c", 3)), "x y -> 2 x6 y", P(("b", "c"), None)),
    (12, (("a", 2), ("b", 2), ("c", 3)), "x y -> x2 y6", P("a", ("b", "c"))),
    (12, (("a", 3), ("b", 4)), "x y -> x y12", P(None, ("a", "b"))),
    (12, (("a", 3), ("b", 4)), "x y -> x4 y3", None),
]


@pytest.mark.parametrize(("k", "axes", "expression", "spec"), AMBIENT)
def test_under_an_ambient_mesh_each_count_takes_a_run_of_its_axes(k, axes, expression, spec):
    devices = _devices(k)
    mesh = Mesh(np.array(devices).reshape([size for _, size in axes]), [name for name, _ in axes])
    shape = _shape(expression, k)
    with jax.set_mesh(mesh):
        if spec is None:
            with pytest.raises(einshard.EinshardError, match="does not fit the ambient mesh"):
                einshard.make_sharding(expression, shape=shape)
            return
        sharding = einshard.make_sharding(expression, shape=shape)
    assert sharding.mesh == mesh and sharding.spec == spec
    _assert_layout(sharding, expression, shape, devices)


@st.composite
def ambient_meshes(draw, n_devices: int) -> tuple[tuple[str, int], ...]:
    """The prime factors of the count in any order, neighbours merged at random, maybe a size-1 axis."""
    factors = list(draw(st.permutations(reference_primes(n_devices))))
    sizes: list[int] = []
    for factor in factors:
        if sizes and draw(st.booleans()):
            sizes[-1] *= factor
        else:
            sizes.append(factor)
    if not sizes or draw(st.integers(0, 3)) == 0:
        sizes.insert(draw(st.integers(0, len(sizes))), 1)
    return tuple((f"m{i}", size) for i, size in enumerate(sizes))


@pytest.mark.parametrize("n_devices", COUNTS)
@settings(deadline=None)
@given(data=st.data())
def test_under_a_random_ambient_mesh_the_runs_are_the_references(n_devices, data):
    axes = data.draw(ambient_meshes(n_devices))
    expression = data.draw(expressions(n_devices))
    sizes = [size for _, size in axes]
    mesh = Mesh(np.array(jax.devices()).reshape(sizes), [name for name, _ in axes])
    shape = (2 * n_devices, 2 * n_devices)
    counts = reference_counts(expression, 2, n_devices)
    runs = reference_runs([count for _, count in counts], sizes)
    with jax.set_mesh(mesh):
        if runs is None:
            with pytest.raises(einshard.EinshardError, match="does not fit the ambient mesh"):
                einshard.make_sharding(expression, shape=shape)
            return
        sharding = einshard.make_sharding(expression, shape=shape)
    assert sharding.mesh == mesh
    # Each split array axis names its count's run of ambient axes; the others name none.
    run_of = {name: run for (name, _), run in zip(counts, runs, strict=True)}
    entries = (*sharding.spec, None, None)[:2]
    for name, entry in zip(["x", "y"], entries, strict=True):
        given_names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        expected = tuple(axes[i][0] for i in run_of.get(name, ()))
        assert given_names == expected, (expression, axes, entry)
    _assert_layout(sharding, expression, shape, list(mesh.devices.flat))
