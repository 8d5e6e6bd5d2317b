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
