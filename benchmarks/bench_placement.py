"""Placement bars: ``einshard`` against ``jax.device_put``, and the cached ``make_sharding``.

    python benchmarks/bench_placement.py [--reps 30] [--seconds 4] [--warmup 5] [--no-fail]

On 8 simulated CPU devices, for a 4096x4096 float32 array (64 MiB), times
``einshard.einshard(x, e)`` (A) against
``jax.device_put(x, einshard.make_sharding(e, shape=x.shape))`` (B) for sharded,
partially replicated and replicated layouts, from a NumPy array, from a
``jax.Array`` on one device and from a ``jax.Array`` with another sharding.
Runs are interleaved (A B, then B A, ...); each waits for its result
(``block_until_ready``) and drops it before the next. Each row takes at least
``--reps`` pairs, and more while they fit in ``--seconds`` (quick placements
scatter more). A row passes when the median of the per-pair ratios A/B is at
most 1.05.

Also: a repeated (cached) ``make_sharding`` call (bar: 10 µs); einshard's fixed
cost per call (A against ``device_put`` with a ready sharding, on a tiny
array; no bar); and the reference limit, one host memcpy of the array.

Memory: on Linux with glibc the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set, so that freed
shard buffers are reused rather than handed back to the kernel and faulted in
afresh (zero-filled) on the next run. Both sides get the same allocator; without
this, page faults dominate the times and scatter them by several percent on a
small machine, more than the bar. ``--default-malloc`` measures without it.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Keep freed memory for reuse (see the docstring); set before the process allocates, hence a re-exec.
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
MALLOC_TUNED = all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items())
_RE_EXEC = __name__ == "__main__" and "--default-malloc" not in sys.argv[1:]
if _RE_EXEC and not MALLOC_TUNED and platform.libc_ver()[0] == "glibc":
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})

import jax  # noqa: E402

# Before JAX starts its backend (nothing above touches devices).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout's einshard
import einshard  # noqa: E402

N_DEVICES = 8
SHAPE = (4096, 4096)  # float32: 64 MiB
PLACEMENT_BAR = 1.05  # einshard / device_put: the median of the per-pair ratios
MAKE_SHARDING_BAR_US = 10.0

LAYOUTS = [
    ("sharded", "x y -> x y*"),
    ("sharded", "x y -> x* y"),
    ("partly replicated", "x y -> x4 y 2"),
    ("replicated", "... -> * ..."),
]


Placement = Callable[[object], object]


def sources(host: np.ndarray, expression: str) -> list[tuple[str, Callable[[], object]]]:
    """The inputs: the NumPy array, a jax.Array on one device, a jax.Array with another sharding.

    The sharded one is made afresh for every run: resharding it on CPU can go through its host
    value, which the array then caches, so that later runs would start from that cache.
    """
    other = "x y -> x y*" if expression == "x y -> x* y" else "x y -> x* y"
    other_sharding = einshard.make_sharding(other, shape=host.shape)
    on_one_device = jax.device_put(host, jax.devices()[0])
    return [
        ("numpy", lambda: host),
        ("jax, 1 device", lambda: on_one_device),
        (f"jax, {other.split('-> ')[1]}", lambda: jax.device_put(host, other_sharding)),
    ]


def _timed(place: Placement, make_input: Callable[[], object]) -> float:
    x = jax.block_until_ready(make_input())
    start = time.perf_counter()
    out = place(x)
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    del out, x  # frees the buffers before the next run
    return elapsed


def compare(
    a: Placement,
    b: Placement,
    make_input: Callable[[], object],
    reps: int,
    warmup: int,
    seconds: float = 0.0,
) -> dict[str, float]:
    """Interleaved runs of ``a`` and ``b``: their median times and the median per-pair ratio a/b.

    At least ``reps`` pairs after ``warmup`` pairs; more (up to 20 times as many) while the
    pairs fit in ``seconds``, for quick calls, whose times scatter more.
    """
    times_a: list[float] = []
    times_b: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(warmup):
            _timed(a, make_input)
            _timed(b, make_input)
        start = time.perf_counter()
        while len(times_a) < reps or (len(times_a) < 20 * reps and time.perf_counter() - start < seconds):
            if len(times_a) % 2 == 0:
                times_a.append(_timed(a, make_input))
                times_b.append(_timed(b, make_input))
            else:
                times_b.append(_timed(b, make_input))
                times_a.append(_timed(a, make_input))
    finally:
        gc.enable()
    return {
        "a": statistics.median(times_a),
        "b": statistics.median(times_b),
        "ratio": statistics.median(ta / tb for ta, tb in zip(times_a, times_b, strict=True)),
        "pairs": len(times_a),
    }


def per_call_us(fn: Callable[[], object], calls: int = 20_000, repeats: int = 7) -> float:
    """The median over ``repeats`` of the mean time of ``calls`` back-to-back calls, in µs."""
    fn()  # fills the caches
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def memcpy_seconds(host: np.ndarray, reps: int) -> float:
    """The median time of one host copy of ``host`` into a preallocated array."""
    dst = np.empty_like(host)
    np.copyto(dst, host)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, host)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fixed_cost_us() -> tuple[float, float]:
    """einshard and device_put with a ready sharding on a tiny array: medians in µs, interleaved."""
    tiny = np.ones((8, 8), np.float32)
    sharding = einshard.make_sharding("x y -> x y*", shape=tiny.shape)
    result = compare(
        lambda x: einshard.einshard(x, "x y -> x y*"),
        lambda x: jax.device_put(x, sharding),
        lambda: tiny,
        reps=2000,
        warmup=50,
    )
    return result["a"] * 1e6, result["b"] * 1e6


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich table if rich is installed, else aligned plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(f"\n{title}")
        for row in [columns, ["-" * w for w in widths], *rows]:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        return
    table = Table(title=title, title_justify="left")
    for column in columns:
        numeric = column.endswith(("ms", "memcpy", "pairs", "ratio"))
        table.add_column(column, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*row, style="red" if row[-1] == "FAIL" else None)
    Console(width=max(120, len(title))).print(table)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks and prints the tables; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="at least this many timed pairs per row (30)")
    parser.add_argument("--seconds", type=float, default=4.0, help="more pairs while they fit in this (4)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed pairs first (default 5)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even when a bar is missed")
    parser.add_argument("--default-malloc", action="store_true", help="do not tune glibc malloc")
    args = parser.parse_args(argv)

    if len(jax.devices()) != N_DEVICES:
        print(f"expected {N_DEVICES} CPU devices, JAX has {len(jax.devices())}", file=sys.stderr)
        return 2
    print(
        f"einshard {einshard.__version__}, jax {jax.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}, {N_DEVICES} CPU devices, {os.cpu_count()} cores, "
        f"malloc {'tuned to reuse memory' if MALLOC_TUNED else 'default'}"
    )
    host = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    memcpy = memcpy_seconds(host, args.reps)
    print(
        f"array {SHAPE[0]}x{SHAPE[1]} float32 ({host.nbytes / 2**20:.0f} MiB); "
        f"per row, after {args.warmup} warm-up pairs, at least {args.reps} interleaved pairs "
        f"(more while they fit in {args.seconds:g} s)"
    )

    failed = False
    rows = []
    for kind, expression in LAYOUTS:
        for source, make_input in sources(host, expression):
            result = compare(
                lambda x, e=expression: einshard.einshard(x, e),
                lambda x, e=expression: jax.device_put(x, einshard.make_sharding(e, shape=np.shape(x))),
                make_input,
                args.reps,
                args.warmup,
                args.seconds,
            )
            ok = result["ratio"] <= PLACEMENT_BAR
            failed |= not ok
            rows.append(
                [
                    expression,
                    kind,
                    source,
                    _ms(result["a"]),
                    _ms(result["b"]),
                    f"{result['b'] / memcpy:.1f}",
                    str(result["pairs"]),
                    f"{result['ratio']:.3f}",
                    _verdict(ok),
                ]
            )
    print_table(
        f"Placement: einshard(x, e) vs device_put(x, make_sharding(e)); bar: ratio <= {PLACEMENT_BAR}",
        [
            "expression",
            "layout",
            "input",
            "einshard ms",
            "device_put ms",
            "÷ memcpy",
            "pairs",
            "ratio",
            "bar",
        ],
        rows,
    )

    rows = [
        [
            "host memcpy of the array (np.copyto)",
            f"{_ms(memcpy)} ms, {host.nbytes / memcpy / 1e9:.1f} GB/s",
            "limit",
        ]
    ]
    for name, call in [
        ("make_sharding('x y -> x y*')", lambda: einshard.make_sharding("x y -> x y*")),
        (
            "make_sharding('x y -> x y*', shape=(4096, 4096))",
            lambda: einshard.make_sharding("x y -> x y*", shape=SHAPE),
        ),
    ]:
        us = per_call_us(call)
        ok = us <= MAKE_SHARDING_BAR_US
        failed |= not ok
        rows.append([f"cached {name}", f"{us:.2f} µs per call", _verdict(ok)])
    a_us, b_us = fixed_cost_us()
    rows.append(
        [
            "fixed cost: einshard vs device_put(x, ready sharding), 8x8 NumPy",
            f"{a_us:.1f} µs vs {b_us:.1f} µs (+{a_us - b_us:.1f})",
            "info",
        ]
    )
    print_table(
        f"Reference and per-call costs; bar for make_sharding: <= {MAKE_SHARDING_BAR_US:g} µs",
        ["measure", "value", "bar"],
        rows,
    )

    if failed:
        print("\nA bar was missed." + (" (--no-fail: exit status 0)" if args.no_fail else ""))
        return 0 if args.no_fail else 1
    print("\nAll bars met.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
