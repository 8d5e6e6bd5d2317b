"""A step's constant work done once: equal constants, and equal equations on them, shared.

A model written with its layers unrolled computes the same constant tables in every layer:
Hugging Face's Flax LLaMA gathers its rotary table (a constant of each layer's own, equal in
value) at the positions (an ``iota``) in every attention, forward and backward. XLA folds each
of those gathers into a literal after partitioning, one by one, with its evaluator: at 8 B on
64 devices (batch 64 x 2,048) that took 123 of a compile's 148 s of passes and grew the compiler
to 16 GiB, for tables that its common-subexpression pass then merged into two. Shared before
lowering, the work is done once: the same values, and the same program once XLA has merged
them (the plan's tests compare the figures).

Only the top level of the step is read; an equation is shared when it has no effects, its inputs
are constants (or literals, or results of shared-eligible equations), and its primitive, its
parameters and its inputs are those of an earlier one. Constants are equal when their shapes,
dtypes and bytes are.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ._jaxprs import closed_jaxpr

__all__ = ["shared_constants"]

UNSHARED = frozenset({"rng_uniform"})
"""Primitives whose equal calls may give different values (XLA's stateful generator)."""

LARGEST_HASHED = 1 << 28
"""Bytes of the largest constant compared by value (256 MiB): a larger one is kept as it is."""


def shared_constants(closed: Any) -> Any:
    """``closed`` with its equal constants, and its equal equations on constants, kept once.

    Returns ``closed`` itself when nothing is shared. The result computes the same values.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> def f(x):
    ...     first, second = jnp.asarray(np.arange(8.0)), jnp.asarray(np.arange(8.0))
    ...     return x * first.sum() + x * second.sum()
    >>> closed = jax.make_jaxpr(f)(1.0)
    >>> shared = shared_constants(closed)
    >>> len(shared.consts), len(shared.jaxpr.eqns) < len(closed.jaxpr.eqns)
    (1, True)
    """
    from jax.extend import core

    jaxpr, consts = closed.jaxpr, list(closed.consts)
    renamed: dict[Any, Any] = {}
    constant: set[Any] = set()
    by_value: dict[tuple, Any] = {}
    constvars, kept = [], []
    for var, value in zip(jaxpr.constvars, consts, strict=True):
        key = _value_key(value)
        if key is not None and key in by_value:
            renamed[var] = by_value[key]
            continue
        if key is not None:
            by_value[key] = var
        constvars.append(var)
        kept.append(value)
        constant.add(var)

    def atom(x: Any) -> Any:
        return renamed.get(x, x) if isinstance(x, core.Var) else x

    earlier: dict[tuple, list[Any]] = {}
    eqns = []
    for eqn in jaxpr.eqns:
        invars = [atom(x) for x in eqn.invars]
        if any(new is not old for new, old in zip(invars, eqn.invars, strict=True)):
            eqn = eqn.replace(invars=invars)
        if (
            not eqn.effects
            and eqn.primitive.name not in UNSHARED
            and all(isinstance(x, core.Literal) or x in constant for x in invars)
        ):
            key = _equation_key(eqn, invars)
            if key is not None and key in earlier:
                renamed.update(zip(eqn.outvars, earlier[key], strict=True))
                continue
            if key is not None:
                earlier[key] = list(eqn.outvars)
                constant.update(eqn.outvars)
        eqns.append(eqn)
    if not renamed:
        return closed
    shared = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[atom(x) for x in jaxpr.outvars])
    return closed_jaxpr(shared, kept)


def _value_key(value: Any) -> tuple | None:
    """A constant's shape, dtype and bytes' digest, or ``None`` (not an array, or too large)."""
    import numpy as np

    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or getattr(value, "nbytes", LARGEST_HASHED + 1) > LARGEST_HASHED:
        return None
    try:
        data = np.ascontiguousarray(np.asarray(value))
    except Exception:  # a value with no host copy (a tracer): kept as it is
        return None
    return (tuple(shape), str(dtype), hashlib.sha256(data.view(np.uint8).reshape(-1)).digest())


def _equation_key(eqn: Any, invars: list[Any]) -> tuple | None:
    """What makes two equations on constants the same, or ``None`` where a parameter cannot say."""
    from jax.extend import core

    params = []
    for name, value in sorted(eqn.params.items()):
        try:
            hash(value)
        except TypeError:
            value = ("id", id(value))  # an unhashable parameter: the same object only
        params.append((name, value))
    inputs = tuple(
        ("literal", type(x.val).__name__, str(x.aval), _literal_value(x.val))
        if isinstance(x, core.Literal)
        else x
        for x in invars
    )
    key = (eqn.primitive, tuple(params), inputs, tuple(str(v.aval) for v in eqn.outvars))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _literal_value(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        import numpy as np

        return np.asarray(value).tobytes()
    return value
