"""The numbers a user passes (device counts, ranks, shape sizes), and number theory for hints.

Pure Python, no JAX. A cache keyed by a value treats ``True`` as ``1`` and ``8.0`` as ``8``; so
whether a number is valid is decided here, outside every cache, and never depends on what was
called before.

Error messages suggest counts (``'x4 y2'`` for 8 devices, the divisors of an axis size and
the device count). Device counts and sizes may be any integers, so these never search without
end: small primes by trial division, a Miller–Rabin test, then Pollard's rho (Brent's variant)
with a fixed budget of steps. What is not split within the budget stays one factor, marked
as such, and the hints then say "for example" instead of listing everything.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

from ._errors import EinshardError, short_repr

__all__ = [
    "MAX_COUNT",
    "Factors",
    "balanced_factors",
    "checked_device_count",
    "checked_n_dims",
    "checked_shape",
    "divisors_preview",
    "prime_factors",
]

MAX_COUNT = 2**63
"""The largest device count or array size einshard takes (NumPy's sizes are 64-bit signed)."""


def checked_device_count(n_devices: Any) -> int:
    """``n_devices`` if it is an ``int`` (not a bool) from 1 to 2**63, else an :class:`EinshardError`."""
    if type(n_devices) is int and 1 <= n_devices <= MAX_COUNT:  # the common case, first
        return n_devices
    if isinstance(n_devices, int) and not isinstance(n_devices, bool) and 1 <= n_devices <= MAX_COUNT:
        return int(n_devices)
    if isinstance(n_devices, int) and not isinstance(n_devices, bool) and n_devices > MAX_COUNT:
        raise EinshardError(
            f"the device count must be a positive integer up to 2**63, not one of "
            f"{n_devices.bit_length()} bits",
            hint="Pass the number of devices to plan for, e.g. n_devices=256.",
        )
    raise EinshardError(f"the device count must be a positive integer, not {short_repr(n_devices)}")


def checked_n_dims(n_dims: Any) -> int | None:
    """``n_dims`` if it is ``None`` or a non-negative ``int`` (not a bool)."""
    if n_dims is None or (type(n_dims) is int and n_dims >= 0):
        return n_dims
    raise EinshardError(f"n_dims must be a non-negative integer, not {short_repr(n_dims)}")


def checked_shape(shape: Any) -> tuple[int, ...]:
    """The shape as a tuple of ints, each a whole number from 0 to 2**63.

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
        if index > MAX_COUNT:
            raise EinshardError(
                f"shape has a size of {index.bit_length()} bits; array sizes are at most 2**63"
            )
        result.append(index)
    return tuple(result)


_TRIAL_LIMIT = 1 << 10  # trial division by every number below this
_RHO_STEPS = 4_000  # Pollard-rho steps in all (about 2 ms in CPython): finds most factors below ~2**22
_RHO_ATTEMPTS = 3
_MAX_BITS = 128  # larger remainders are not tested or split (a modular power alone would be slow)
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)  # exact below 3.3e24


class Factors(list[int]):
    """Factors of a number, in ascending order; ``complete`` is False if some may not be prime."""

    complete: bool = True


def prime_factors(n: int) -> Factors:
    """The prime factors of ``n`` (with repeats, ascending), within a bounded time.

    >>> prime_factors(360), prime_factors(2**61 - 1), prime_factors(3 * 2**39)[:2]
    ([2, 2, 2, 3, 3, 5], [2305843009213693951], [2, 2])
    """
    cached = _prime_factors(n)
    factors = Factors(cached)
    factors.complete = cached.complete
    return factors


@functools.lru_cache(maxsize=256)  # one error's hints factor the same numbers more than once
def _prime_factors(n: int) -> Factors:
    factors = Factors()
    if n < 2:
        return factors
    for p in (2, 3):
        while n % p == 0:
            factors.append(p)
            n //= p
    p = 5
    while p < _TRIAL_LIMIT and p * p <= n:
        for q in (p, p + 2):  # 6k - 1 and 6k + 1
            while n % q == 0:
                factors.append(q)
                n //= q
        p += 6
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if m < _TRIAL_LIMIT * _TRIAL_LIMIT:
            factors.append(m)  # below the square of the trial limit, what is left is prime
            continue
        if m.bit_length() > _MAX_BITS:
            factors.append(m)
            factors.complete = False
            continue
        if _is_probable_prime(m):
            factors.append(m)
            continue
        divisor = _rho(m)
        if divisor is None:
            factors.append(m)
            factors.complete = False
        else:
            pending += [divisor, m // divisor]
    factors.sort()
    return factors


def _is_probable_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int | None:
    """A nontrivial divisor of the odd composite ``n`` by Brent's rho, or ``None`` within the budget."""
    budget = _RHO_STEPS
    for c in range(1, _RHO_ATTEMPTS + 1):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1 and budget > 0:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(64, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 64
            budget -= 2 * r
            r *= 2
        if g == n:  # the batch overshot: step one at a time from its start
            g = 1
            for _ in range(64):
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
                if g > 1:
                    break
        if 1 < g < n:
            return g
        if budget <= 0:
            break
    return None


def balanced_factors(n: int, k: int) -> list[int]:
    """Splits ``n`` into ``k`` factors, as even as possible, largest first (bounded time).

    >>> balanced_factors(8, 2), balanced_factors(2**61 - 1, 2)
    ([4, 2], [2305843009213693951, 1])
    """
    factors = [1] * k
    for prime in reversed(prime_factors(n)):
        factors[factors.index(min(factors))] *= prime
    return sorted(factors, reverse=True)


def divisors_preview(n: int, limit: int = 16) -> tuple[list[int], bool]:
    """The divisors of ``n`` in ascending order, at most ``limit`` of them, and whether that is all.

    With many divisors, the smallest ``limit - 1`` and ``n`` itself are given.

    >>> divisors_preview(12), divisors_preview(2**40, 4)
    (([1, 2, 3, 4, 6, 12], True), ([1, 2, 4, 1099511627776], False))
    """
    if n < 1:
        return [1], True
    factors = prime_factors(n)
    powers: dict[int, int] = {}
    for p in factors:
        powers[p] = powers.get(p, 0) + 1
    count = math.prod(e + 1 for e in powers.values())
    if count <= limit and factors.complete:
        divisors = [1]
        for p, e in powers.items():
            divisors = [d * p**i for d in divisors for i in range(e + 1)]
        return sorted(divisors), True
    # The smallest few: build from the primes, keeping only the smallest candidates.
    small = [1]
    for p, e in sorted(powers.items()):
        small = sorted({d * p**i for d in small for i in range(e + 1)})[: limit - 1]
    small = [d for d in small if d != n][: limit - 1]
    return [*small, n], False
