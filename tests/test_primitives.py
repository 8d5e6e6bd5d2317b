"""Every JAX primitive is accounted for by the roles reader: read, or a stop with its reason.

The reader (``einshard/_tracing/_parameter_axes.py``) follows a parameter's axes through the primitives it
knows (``READ``: a handler of its own, or a set of ``_primitives``) and stops at the ones listed in
``_primitives.STOPS``, each with its reason. A primitive in neither would be guessed at (taken as
elementwise when its shapes agree, else a stop with no reason), which is how ``jnp.stack`` once
left q and k whole. So this file goes through every primitive the installed JAX defines and
fails on one in neither list: a new JAX's primitive is placed on purpose.

Which primitives JAX defines:

* **Public**: every ``jax.extend.core.Primitive`` that ``jax.lax``, ``jax.lax.linalg`` or
  ``jax.extend.core.primitives`` (JAX's public list of its primitives, for interpreters like
  this one) holds as an attribute.
* **Private**: JAX defines more primitives than those modules export (``pure_callback``,
  ``shard_map``, ``pvary``, the random-key ones). No public API lists them, so a child process
  imports a fixed set of JAX's public modules and collects every ``Primitive`` held by a module
  of the ``jax`` package (``jax._src.*`` included); a child, so that what other tests imported
  does not change the answer. This relies on JAX defining its primitives at module level, which
  ``test_the_sweep_finds_every_primitive_a_step_traces_to`` checks by tracing steps that use the
  private ones: if JAX moves them, that test fails, loudly.

Pallas's own primitives (``program_id``, ``load``, ...) occur only inside a ``pallas_call``'s
kernel, which the reading never enters (``pallas_call`` is a stop), and are not collected.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from einshard._tracing import _primitives
from einshard._tracing._parameter_axes import HANDLED, READ
from einshard._tracing._primitives import STOPS
from einshard.strategies import roles

IMPORTS = (
    "jax",
    "jax.numpy",
    "jax.nn",
    "jax.random",
    "jax.lax",
    "jax.lax.linalg",
    "jax.scipy.special",
    "jax.scipy.linalg",
    "jax.extend.core.primitives",
    "jax.experimental.checkify",
    "jax.experimental.custom_partitioning",
)
UNSWEPT = ("jax._src.pallas", "jax.experimental.pallas", "jax._src.tpu", "jax.experimental.mosaic")

SWEEP = textwrap.dedent(
    """
    import importlib, json, sys
    for name in {imports!r}:
        importlib.import_module(name)
    from jax.extend.core import Primitive
    found = {{}}
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == "jax" or name.startswith("jax.")):
            continue
        if name.startswith({unswept!r}):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Primitive):
                found.setdefault(value.name, name)
    print(json.dumps(found))
    """
)


def public_primitives() -> dict[str, str]:
    """``{name: module}`` of every primitive JAX's public modules hold."""
    import jax.extend.core.primitives as listed
    import jax.lax.linalg
    from jax.extend.core import Primitive

    found: dict[str, str] = {}
    for module in (jax.lax, jax.lax.linalg, listed):
        for value in vars(module).values():
            if isinstance(value, Primitive):
                found.setdefault(value.name, module.__name__)
    return found


_SWEPT: dict[str, str] = {}


def swept_primitives() -> dict[str, str]:
    """``{name: module}`` of every primitive a module of the ``jax`` package holds (see above)."""
    if not _SWEPT:
        code = SWEEP.format(imports=IMPORTS, unswept=UNSWEPT)
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={"JAX_PLATFORMS": "cpu", "PATH": ""},
        )
        assert done.returncode == 0, done.stderr
        _SWEPT.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return _SWEPT


def jax_primitives() -> dict[str, str]:
    return {**swept_primitives(), **public_primitives()}


def traced_primitives(jaxpr) -> set[str]:
    """The primitives of a jaxpr and of every jaxpr inside it."""
    names: set[str] = set()
    todo = [jaxpr]
    while todo:
        current = todo.pop()
        current = getattr(current, "jaxpr", current)
        for eqn in current.eqns:
            names.add(eqn.primitive.name)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        todo.append(inner)
    return names


# --- the lists -----------------------------------------------------------------------------------------


def test_every_jax_primitive_is_read_or_stops_with_a_reason():
    primitives = jax_primitives()
    public = public_primitives()
    assert len(public) > 150 and {"dot_general", "stack", "concatenate", "gather"} <= set(public)
    missing = {name: module for name, module in primitives.items() if name not in READ and name not in STOPS}
    assert not missing, (
        f"JAX {jax.__version__} defines primitives the roles reader neither reads nor lists as a stop: "
        f"{missing}. Add each to a set of einshard/_tracing/_primitives.py (or a handler in "
        "_parameter_axes.py), "
        "or to STOPS with its reason."
    )


def test_no_primitive_is_both_read_and_a_stop_and_every_stop_has_a_reason():
    assert not READ & set(STOPS)
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in STOPS.values())
    # The sets of _primitives do not overlap either: each says one thing a primitive does.
    sets = {
        name: getattr(_primitives, name)
        for name in ("ELEMENTWISE", "IDENTITY", "REDUCE", "CUMULATIVE", "RANDOM", "CONSTANT", "CALLS")
    }
    for a, left in sets.items():
        for b, right in sets.items():
            assert a == b or not left & right, (a, b, left & right)
    # A handler is the one way its primitive is read (the handled sets aside).
    own = HANDLED - _primitives.REDUCE - _primitives.IDENTITY - _primitives.CUMULATIVE
    assert not own & (_primitives.ELEMENTWISE | _primitives.CALLS | _primitives.RANDOM | _primitives.CONSTANT)


def test_the_sweep_finds_every_primitive_a_step_traces_to():
    """If JAX stops defining its primitives at module level, the sweep misses these: loudly."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))

    @jax.custom_vjp
    def clipped(x):
        return x

    clipped.defvjp(lambda x: (x, None), lambda _, g: (g,))

    @jax.custom_jvp
    def soft(x):
        return jnp.log1p(jnp.exp(x))

    soft.defjvp(lambda primals, tangents: (soft(primals[0]), tangents[0]))

    def per_device(x):
        return jax.lax.psum(x, "d")

    def step(w, x, key):
        h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(x)
        h = jnp.stack([h[:, ::2], h[:, 1::2]], -1).reshape(h.shape)
        h = jnp.tile(h, (1, 2))[:, : h.shape[1]] + jnp.flip(h, 1)
        h = soft(clipped(h)) + jax.random.normal(key, h.shape)
        h = jax.lax.cond(h.sum() > 0, lambda h: h * 2, lambda h: h, h)
        h, _ = jax.lax.scan(lambda c, r: (c + r, None), h, jnp.stack([h, h]))
        h = (
            h
            + jax.lax.while_loop(
                lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 0.5), (0, jax.lax.stop_gradient(h))
            )[1]
        )
        h = h + jax.pure_callback(
            np.asarray, jax.ShapeDtypeStruct(h.shape, h.dtype), jax.lax.stop_gradient(h)
        )
        h = jax.shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P())(h)
        h = jnp.sort(h, 1) + jnp.cumsum(h, 1) + jnp.abs(jnp.fft.fft(h, axis=1))
        values, _ = jax.lax.top_k(h, 2)
        return jnp.sum(jnp.linalg.cholesky(h.T @ h + jnp.eye(h.shape[1]))) + values.sum()

    args = (jnp.ones((8, 8)), jnp.ones((4, 8)), jax.random.key(0))
    traced = traced_primitives(jax.make_jaxpr(step)(*args))
    traced |= traced_primitives(jax.make_jaxpr(jax.value_and_grad(step))(*args))
    private = {"pure_callback", "shard_map", "psum_invariant"}
    assert {"stack", "tile", "scan", "remat2", "custom_vjp_call", *private} <= traced
    assert not private & set(public_primitives())  # found by the sweep only
    assert traced <= set(jax_primitives()), traced - set(jax_primitives())


# --- what the lists do -----------------------------------------------------------------------------------


def _mlp(middle):
    """A column / row pair with ``middle`` applied to the hidden activations, and its parameters."""

    def loss(p, x):
        return jnp.mean(middle(jax.nn.relu(x @ p["up"])) @ p["down"] ** 2)

    params = {"up": jnp.ones((8, 32)) * 0.1, "down": jnp.ones((32, 8)) * 0.1}
    return loss, params, jnp.ones((4, 8))


def _up(middle):
    loss, params, x = _mlp(middle)
    found = roles(loss, params, x, n_devices=8)
    return {row.path: row for row in found.leaves}["up"], found


@pytest.mark.parametrize(
    ("middle", "split"),
    [
        (lambda h: h, True),
        (lambda h: jnp.stack([h, -h], 1).sum(1), True),  # stack: a new axis, the hidden axis goes through
        (lambda h: jnp.stack([h, -h], -1).max(-1), True),  # a new last axis, reduced again
        (lambda h: jnp.stack([h, -h], 0)[1], True),
        (lambda h: jnp.tile(h, (2, 1)).reshape(2, *h.shape).sum(0), True),  # tiled along the batch only
        (lambda h: jnp.flip(h, 0), True),  # reversed along the batch only
        (lambda h: jnp.flip(h, 1), False),  # reversed along the hidden axis: a break
        (lambda h: jnp.tile(h, (1, 2))[:, : h.shape[1]], False),
        (lambda h: jax.lax.cumsum(h, 1), False),
    ],
    ids=[
        "plain",
        "stack",
        "stack-last",
        "stack-first",
        "tile-batch",
        "rev-batch",
        "rev-hidden",
        "tile-hidden",
        "cumsum-hidden",
    ],
)
def test_handled_primitives_keep_the_axes_they_do_not_touch(middle, split):
    up, _ = _up(middle)
    assert (up.role == "column") == split, up


@pytest.mark.parametrize(
    ("middle", "name", "reason"),
    [
        (
            lambda h: jax.pure_callback(lambda v: np.asarray(v), jax.ShapeDtypeStruct(h.shape, h.dtype), h),
            "pure_callback",
            "cannot see into",
        ),
        (lambda h: jax.lax.linalg.cholesky(h.T @ h)[: h.shape[0], :], "cholesky", "whole matrices"),
    ],
    ids=["pure_callback", "cholesky"],
)
def test_a_stop_is_named_with_its_reason_in_the_note_and_the_stops(middle, name, reason):
    up, found = _up(middle)
    assert up.axis is None
    assert name in up.note and reason in up.note, up.note
    assert name in found.stops


def test_a_primitive_jax_does_not_define_is_still_guessed_at():
    """Another library's primitive: elementwise when its shapes agree, else a stop."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    double = Primitive("einshard_test_double")
    double.def_impl(lambda x: x * 2)
    double.def_abstract_eval(lambda x: x)
    mlir.register_lowering(double, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    assert "einshard_test_double" not in READ and "einshard_test_double" not in STOPS
    up, found = _up(double.bind)
    assert up.role == "column" and not found.stops
