"""Error bar: every answer or error comes back fast, whatever the numbers.

    python benchmarks/bench_errors.py [--reps 5] [--seconds 3] [--warmup 1] [--no-fail] [--json PATH]

Errors carry hints that suggest counts (a fitting expression, the divisors of a size and the
device count), so building a hint factors numbers. Device counts go up to einshard's bound,
2**24 (beyond it, the count itself is the error), with the hard ones below it: large primes,
products of two large primes, powers of two times a prime; sizes go up to 2**63. Each row is
one kind of call over a set of such cases, cold (einshard's layout and factoring caches
cleared before every call):

1. ``einshard.layout(expression, shape, n_devices=N)``;
2. ``einshard.explain(tree, rules, n_devices=N)`` on a two-leaf abstract tree;
3. the command line, in process: ``einshard.__main__.main([expression, '--shape', ...,
   '--devices', N])`` with its output captured (interpreter start-up not included; a
   picture is drawn only up to 4096 devices, else the summary and the bound's error).

For each case the time is the fastest of ``--reps`` calls (the call's own cost, without the
machine's noise); the row gives the worst case over all cases, and the median. Bar: the worst
case of every row ≤ 100 ms.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, even where Python leaves it out (-P)
import _common

N_DEVICES = 8
_common.start(re_exec=False, cpu_devices=N_DEVICES)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import einshard  # noqa: E402
from einshard.__main__ import main  # noqa: E402
from einshard._language import _layout, _numbers  # noqa: E402

BAR_MS = 100.0

HARD_COUNTS = [
    2**24,  # the bound
    2**24 - 3,  # the largest prime below it
    2**24 - 1,  # 3 * 5 * 17 * 257
    3 * 2**22,
    4093 * 4099,  # two primes near 2**12
    2**12 * 4093,
    15_485_863,  # the millionth prime
    2**24 + 1,  # beyond the bound: refused
    2**61 - 1,
    2**63,
]
EXPRESSIONS = [
    "x y -> x2 y4",
    "x -> x*",
    "a b c -> a* b* c*",
    "x y -> x7 y",
    "a b -> 2 a2* b*",
    "x y -> x y*",
]


def _cases() -> list[tuple[str, tuple[int, ...], int]]:
    cases = [
        ("x y -> x2 y4", (8, 8), 2**24 - 3),
        ("x -> x*", (3 * 2**22,), 2**24),
        ("x -> x*", (3 * 2**21,), 2**23),
    ]
    for expression in EXPRESSIONS:
        rank = len(einshard.parse(expression).left)
        for n in HARD_COUNTS:
            for size in (n, 1649267441664, 2**62 - 57, 8):
                cases.append((expression, (size,) * rank, n))
    return cases


def _clear_caches() -> None:
    _layout._compile_layout.cache_clear()
    _numbers.prime_factors.cache_clear()


def _fastest(call, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        _clear_caches()
        start = time.perf_counter()
        with contextlib.suppress(einshard.EinshardError):
            call()
        best = min(best, time.perf_counter() - start)
    return best


def _layout_call(expression: str, shape: tuple[int, ...], n: int):
    return lambda: einshard.layout(expression, shape, n_devices=n)


def _explain_call(expression: str, shape: tuple[int, ...], n: int):
    tree = {"w": jax.ShapeDtypeStruct(shape, np.float32), "b": jax.ShapeDtypeStruct((8,), np.float32)}
    rules = [("w", expression), (".*", "... -> * ...")]
    return lambda: einshard.explain(tree, rules, n_devices=n)


def _cli_call(expression: str, shape: tuple[int, ...], n: int):
    argv = [expression, "--shape", ",".join(map(str, shape)), "--devices", str(n)]

    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)

    return run


def main_() -> int:
    parser = _common.parser(__doc__, reps=5, seconds=3.0, warmup=1, runs="calls")
    args = parser.parse_args()
    if not _common.has_devices(N_DEVICES):
        return 1
    results = _common.Results("bench_errors.py", args)
    print(_common.environment(N_DEVICES))
    cases = _cases()
    rows, records, failed = [], [], False
    for name, make in [
        ("layout(expression, shape, n_devices=N)", _layout_call),
        ("explain(tree, rules, n_devices=N)", _explain_call),
        ("python -m einshard (in process)", _cli_call),
    ]:
        calls = [make(*case) for case in cases]
        for call in calls[: args.warmup]:
            with contextlib.suppress(einshard.EinshardError):
                call()
        times = [_fastest(call, args.reps) for call in calls]
        worst = max(times)
        worst_case = cases[times.index(worst)]
        ok = worst * 1e3 <= BAR_MS
        failed |= not ok
        rows.append(
            [
                name,
                str(len(cases)),
                f"{statistics.median(times) * 1e3:.2f}",
                f"{worst * 1e3:.2f}",
                f"{worst_case[0]!r} {worst_case[1]} on {worst_case[2]}",
                _common.verdict(ok),
            ]
        )
        records.append(
            {
                "call": name,
                "cases": len(cases),
                "median_seconds": statistics.median(times),
                "worst_seconds": worst,
                "worst_case": [worst_case[0], list(worst_case[1]), worst_case[2]],
                "bar": BAR_MS / 1e3,
                "verdict": _common.verdict(ok),
            }
        )
    results.table(
        "errors",
        f"Answer or error, cold, device counts to 2**24 and beyond, sizes to 2**63; "
        f"bar: worst <= {BAR_MS:g} ms",
        ["call", "cases", "median ms", "worst ms", "worst case", "bar"],
        rows,
        numeric={"cases", "median ms", "worst ms"},
        bar=BAR_MS / 1e3,
        records=records,
    )
    results.write(N_DEVICES, failed)
    return _common.exit_status(failed, args.no_fail)


if __name__ == "__main__":
    sys.exit(main_())
