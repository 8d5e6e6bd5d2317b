"""The numbers a user passes (device counts, ranks, shape sizes), and the number theory of hints.

Pure Python, no JAX. A cache keyed by a value treats ``True`` as ``1`` and ``8.0`` as ``8``; so
whether a number is valid is decided here, outside every cache, and never depends on what was
called before.

Device counts are bounded by :data:`MAX_DEVICES` (2**24, about 16.8 million devices; the
largest machines have about a million), and so are the counts an expression writes. Error
messages suggest counts (``'x4 y2'`` for 8 devices, the divisors of an axis size and the
device count), so building a hint factors numbers no larger than a device count: trial division
is quick there, and every answer or error comes back in far less than 100 ms
(``benchmarks/bench_errors.py``).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

from ._errors import EinshardError, short_repr

__all__ = [
    "MAX_DEVICES",
    "MAX_SIZE",
    "balanced_factors",
    "checked_count",
    "checked_device_count",
    "checked_n_dims",
    "checked_shape",
    "divisors_preview",
    "prime_factors",
]

MAX_DEVICES = 2**24
"""The largest device count einshard lays arrays out for, and the largest count an expression
may write (a count of shards or replicas is at most the device count)."""

MAX_SIZE = 2**63
"""The largest size of an array axis einshard takes (NumPy's sizes are 64-bit signed)."""


def checked_device_count(n_devices: Any) -> int:
    """``n_devices`` if it is an ``int`` (not a bool) from 1 to 2**24, else an :class:`EinshardError`."""
    if type(n_devices) is int and 1 <= n_devices <= MAX_DEVICES:  # the common case, first
        return n_devices
    return checked_count(n_devices, "the device count")


def checked_count(
    value: Any, name: str, hint: str | None = None, *, minimum: int = 1, kind: str = "a positive integer"
) -> int:
    """``value`` if it is an ``int`` (not a bool) from 1 to 2**24, else an :class:`EinshardError` naming it.

    Every count of devices a user passes (``n_devices=``, a hybrid's ``model``) is checked here,
    so each is bounded by :data:`MAX_DEVICES` before it reaches a child process or XLA.
    ``minimum=0`` admits 0 (a strategy's ``model``: all devices); ``kind`` says what is expected.

    >>> checked_count(8, 'n_devices')
    8
    >>> checked_count(2**30, 'n_devices')
    Traceback (most recent call last):
    einshard.EinshardError: n_devices must be a positive integer up to 2**24, not 1073741824
    ...
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if minimum <= value <= MAX_DEVICES:
            return int(value)
        if value > MAX_DEVICES:
            raise EinshardError(
                f"{name} must be {kind} up to 2**24, not {short_repr(value)}",
                hint="einshard lays arrays out over at most 2**24 (16,777,216) devices. Pass the number "
                "of devices to plan for, e.g. n_devices=256.",
            )
    raise EinshardError(f"{name} must be {kind}, not {short_repr(value)}", hint=hint)


def checked_n_dims(n_dims: Any) -> int | None:
    """``n_dims`` if it is ``None`` or a non-negative ``int`` (not a bool)."""
    if n_dims is None or (type(n_dims) is int and n_dims >= 0):
        return n_dims
    raise EinshardError(f"n_dims must be a non-negative integer, not {short_repr(n_dims)}")


def checked_shape(shape: Any) -> tuple[int, ...]:
    """The shape as a tuple of ints, each a whole number from 0 to 2**63 (:data:`MAX_SIZE`).

    Refuses what ``int()`` would silently change: ``8.5`` (truncated), ``True``, ``'8'``.
    """
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        sizes = tuple(shape)
    except TypeError:
        raise EinshardError(f"shape must be a sequence of integers, not {short_repr(shape)}") from None
    result = []
    for size in sizes:
        if isinstance(size, bool):
            index = None
        else:
            try:
                index = operator.index(size)  # ints and NumPy integers; not floats or strings
            except TypeError:
                index = None
        if index is None:
            hint = None
            if isinstance(size, float) and size.is_integer():
                hint = f"Write the size as an integer: {int(size)}."
            raise EinshardError(
                f"shape must be a sequence of integers, not {short_repr(shape)}: "
                f"{short_repr(size)} is not an integer",
                hint=hint,
            )
        if index < 0:
            raise EinshardError(f"shape {short_repr(tuple(sizes))} has a negative size")
        if index > MAX_SIZE:
            raise EinshardError(
                f"shape has a size of {index.bit_length()} bits; array sizes are at most 2**63"
            )
        result.append(index)
    return tuple(result)


@functools.lru_cache(maxsize=256)  # one error's hints factor the same numbers more than once
def prime_factors(n: int) -> tuple[int, ...]:
    """The prime factors of ``n`` (with repeats, ascending), by trial division.

    ``n`` is a device count or a divisor of one, so at most 2**24: at most about 1,400
    divisions.

    >>> prime_factors(360), prime_factors(2**24 - 3), prime_factors(1)
    ((2, 2, 2, 3, 3, 5), (16777213,), ())
    """
    factors = []
    for p in (2, 3):
        while n % p == 0:
            factors.append(p)
            n //= p
    p = 5
    while p * p <= n:
        for q in (p, p + 2):  # 6k - 1 and 6k + 1
            while n % q == 0:
                factors.append(q)
                n //= q
        p += 6
    if n > 1:
        factors.append(n)
    return tuple(factors)


def balanced_factors(n: int, k: int) -> list[int]:
    """Splits ``n`` into ``k`` factors, as even as possible, largest first.

    >>> balanced_factors(8, 2), balanced_factors(12, 3), balanced_factors(7, 2)
    ([4, 2], [3, 2, 2], [7, 1])
    """
    factors = [1] * k
    for prime in reversed(prime_factors(n)):
        factors[factors.index(min(factors))] *= prime
    return sorted(factors, reverse=True)


def divisors_preview(n: int, limit: int = 16) -> tuple[list[int], bool]:
    """The divisors of ``n`` in ascending order, at most ``limit`` of them, and whether that is all.

    With more, the smallest ``limit - 1`` and ``n`` itself are given.

    >>> divisors_preview(12), divisors_preview(2**20, 4)
    (([1, 2, 3, 4, 6, 12], True), ([1, 2, 4, 1048576], False))
    """
    if n < 1:
        return [1], True
    divisors = [1]
    for p, e in _powers(prime_factors(n)).items():
        divisors = [d * p**i for d in divisors for i in range(e + 1)]
    divisors.sort()
    if len(divisors) <= limit:
        return divisors, True
    return [*divisors[: limit - 1], n], False


def _powers(factors: tuple[int, ...]) -> dict[int, int]:
    powers: dict[int, int] = {}
    for p in factors:
        powers[p] = powers.get(p, 0) + 1
    return powers
