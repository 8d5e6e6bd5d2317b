"""The jaxpr forms ``einshard._tracing._jaxprs`` reads, checked on the installed JAX.

A scan's constants and carries are named by ``num_consts`` / ``num_carry`` in older JAX and by
the flat tree ``ft_in`` in newer JAX; a sub-program is a ``ClosedJaxpr`` or an open ``Jaxpr``. A
JAX version that answers none of the known ways fails here, loudly, before a plan misreads a loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from einshard import EinshardError
from einshard._tracing import _jaxprs


def _scan_equation() -> tuple:
    scale = jnp.float32(2.0)

    def body(carry, x):
        total, count = carry
        return (total + scale * x, count + 1), x * total

    def f(xs):
        return jax.lax.scan(body, (jnp.zeros(3), jnp.int32(0)), xs)

    closed = jax.make_jaxpr(f)(jnp.ones((5, 3)))
    (scan,) = [eqn for eqn in closed.jaxpr.eqns if eqn.primitive.name == "scan"]
    return scan, closed


def test_a_scan_s_constants_carries_and_scanned_inputs_are_counted():
    scan, _ = _scan_equation()
    consts, carries = _jaxprs.scan_counts(scan.params, len(scan.invars))
    assert carries == 2  # (total, count)
    assert len(scan.invars) - consts - carries == 1  # xs, scanned over
    assert consts == len(scan.invars) - 3  # the closed-over scale, however JAX passes it


def test_a_scan_of_no_known_form_is_an_error_naming_the_jax_version():
    with pytest.raises(EinshardError, match="cannot read a scan of this JAX version"):
        _jaxprs.scan_counts({"jaxpr": None}, 3)


def test_a_sub_program_is_read_closed_or_open():
    scan, closed = _scan_equation()
    body = scan.params["jaxpr"]
    assert _jaxprs.is_jaxpr(body) and _jaxprs.is_jaxpr(closed)
    assert _jaxprs.inner_jaxpr(closed) is closed.jaxpr
    assert _jaxprs.inner_jaxpr(closed.jaxpr) is closed.jaxpr
    assert not _jaxprs.is_jaxpr(scan.params["length"])
    assert [_jaxprs.var_shape(v) for v in _jaxprs.inner_jaxpr(body).outvars] == [(3,), (), (3,)]


# --- the one walk: which sub-programs an equation runs ---------------------------------------------


def _every_construct(x: jax.Array) -> jax.Array:
    """One use of each JAX construct that runs a sub-program."""
    from jax.sharding import PartitionSpec as P

    @jax.custom_jvp
    def soft(v):
        return jnp.tanh(v)

    soft.defjvp(lambda primals, tangents: (soft(primals[0]), tangents[0] * (1 - jnp.tanh(primals[0]) ** 2)))

    @jax.custom_vjp
    def clipped(v):
        return v * 2

    clipped.defvjp(lambda v: (v * 2, None), lambda _, g: (g * 2,))

    mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
    y = jax.jit(lambda v: v + 1)(x)
    y = jax.checkpoint(lambda v: jnp.sin(v) * v)(y)
    y = soft(y) + clipped(y)
    y = jax.lax.cond(y.sum() > 0, lambda v: v * 2, lambda v: v - 1, y)
    # No gradient through a while: its input is held constant, so grad traces it forward only.
    y = (
        y
        + jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, jax.lax.stop_gradient(y))
        )[1]
    )
    y, _ = jax.lax.scan(lambda c, row: (c + row, c), y, jnp.ones((4, *y.shape)))
    y = jax.shard_map(lambda block: block * 3, mesh=mesh, in_specs=P(), out_specs=P())(y)
    return y.sum()


EXPECTED_HOW = {
    "pjit": _jaxprs.CALL,
    "jit": _jaxprs.CALL,
    "checkpoint": _jaxprs.CALL,
    "remat2": _jaxprs.CALL,
    "custom_jvp_call": _jaxprs.CALL,
    "custom_vjp_call": _jaxprs.CALL,
    "custom_vjp_call_jaxpr": _jaxprs.CALL,
    "cond": _jaxprs.COND,
    "while": _jaxprs.WHILE,
    "scan": _jaxprs.SCAN,
    "shard_map": _jaxprs.PER_DEVICE,
}


def _held_programs(eqn) -> list:
    values = [
        v for value in eqn.params.values() for v in (value if isinstance(value, (tuple, list)) else (value,))
    ]
    return [v for v in values if _jaxprs.is_jaxpr(v)]


def _equations(jaxpr):
    for eqn in _jaxprs.inner_jaxpr(jaxpr).eqns:
        yield eqn
        for program in _held_programs(eqn):
            yield from _equations(program)


@pytest.mark.parametrize("pass_", ["forward", "gradient"])
def test_every_construct_with_a_sub_program_is_walked_one_known_way(pass_):
    """The sweep: every equation holding a sub-program, in the forward pass and its gradient's."""
    f = _every_construct if pass_ == "forward" else jax.grad(_every_construct)
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    seen = set()
    for eqn in _equations(closed):
        held = _held_programs(eqn)
        called = _jaxprs.runs(eqn)
        if not held:
            assert called is None, eqn.primitive.name
            continue
        name = eqn.primitive.name
        seen.add(name)
        assert called is not None, name
        assert name in EXPECTED_HOW, f"JAX's {name} runs a sub-program no walk has placed: add it"
        assert called.how == EXPECTED_HOW[name], name
        assert set(map(id, called.programs)) <= set(map(id, held))  # only what it holds
        if called.how == _jaxprs.CALL:  # one for one: the walks read through it
            (body,) = called.bodies
            assert (len(body.invars), len(body.outvars)) == (len(eqn.invars), len(eqn.outvars)), name
        else:  # every program of a loop, a branch or a per-device body is walked
            assert len(called.programs) == len(held), name
    assert {"scan", "while", "cond", "shard_map"} <= seen
    assert {"custom_jvp_call", "checkpoint"} & seen and {"jit", "pjit"} & seen


def test_a_scan_runs_its_body_its_length_times_and_a_while_an_unknown_number():
    scan, _ = _scan_equation()
    called = _jaxprs.runs(scan)
    assert called is not None and (called.how, called.times, called.keys) == (_jaxprs.SCAN, 5, ("jaxpr",))
    closed = jax.make_jaxpr(lambda v: jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, v))(0)
    (loop,) = closed.jaxpr.eqns
    called = _jaxprs.runs(loop)
    assert called is not None and (called.how, called.times) == (_jaxprs.WHILE, None)
    assert called.keys == ("cond_jaxpr", "body_jaxpr")
