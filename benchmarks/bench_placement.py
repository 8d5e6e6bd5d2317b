"""Placement bars: ``einshard`` against ``jax.device_put``, and the cached ``make_sharding``.

    python benchmarks/bench_placement.py [--reps 30] [--seconds 4] [--warmup 5] [--no-fail] [--json PATH]

On 8 simulated CPU devices, for a 4096x4096 float32 array (64 MiB), times
``einshard.einshard(x, e)`` (A) against ``jax.device_put(x, sharding)`` (B),
``sharding = einshard.make_sharding(e, shape=x.shape)`` built before the timed
calls, for sharded,
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

``--json PATH`` also writes every table row (the printed strings and the raw
numbers) and the set-up (versions, cores, devices, the memcpy reference) as JSON;
the documentation's benchmark page is drawn from that file.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, even where Python leaves it out (-P)
import _common

N_DEVICES = 8
# Tunes malloc (re-executing this script; see the docstring), then 8 CPU devices and this einshard.
_common.start(re_exec=__name__ == "__main__", cpu_devices=N_DEVICES)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import einshard  # noqa: E402

SHAPE = (4096, 4096)  # float32: 64 MiB
PLACEMENT_BAR = 1.05  # einshard / device_put: the median of the per-pair ratios
MAKE_SHARDING_BAR_US = 10.0
EXTRA_PAIRS_CAP = 20  # quick rows take more pairs while they fit in --seconds, up to 20 x --reps

LAYOUTS = [
    ("sharded", "x y -> x y*"),
    ("sharded", "x y -> x* y"),
    ("partly replicated", "x y -> x4 y 2"),
    ("replicated", "... -> * ..."),
]


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


def fixed_cost_us() -> tuple[float, float]:
    """einshard and device_put with a ready sharding on a tiny array: medians in µs, interleaved."""
    tiny = np.ones((8, 8), np.float32)
    sharding = einshard.make_sharding("x y -> x y*", shape=tiny.shape)
    result = _common.compare(
        lambda x: einshard.einshard(x, "x y -> x y*"),
        lambda x: jax.device_put(x, sharding),
        lambda: tiny,
        reps=2000,
        warmup=50,
        cap=EXTRA_PAIRS_CAP,
    )
    return result["a"] * 1e6, result["b"] * 1e6


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks and prints the tables; returns the exit status."""
    parser = _common.parser(__doc__, reps=30, seconds=4.0, warmup=5, runs="pairs")
    args = parser.parse_args(argv)
    results = _common.Results(Path(__file__).name, args)

    if not _common.has_devices(N_DEVICES):
        return 2
    print(_common.environment(N_DEVICES))
    host = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    memcpy = _common.memcpy_seconds(host, args.reps)
    results.extra["memcpy"] = {
        "what": "np.copyto of the 4096x4096 float32 array into a preallocated one, median",
        "bytes": host.nbytes,
        "seconds": memcpy,
        "GB_per_s": host.nbytes / memcpy / 1e9,
    }
    print(
        f"array {SHAPE[0]}x{SHAPE[1]} float32 ({host.nbytes / 2**20:.0f} MiB); "
        f"per row, after {args.warmup} warm-up pairs, at least {args.reps} interleaved pairs "
        f"(more while they fit in {args.seconds:g} s)"
    )

    failed = False
    rows = []
    records = []
    for kind, expression in LAYOUTS:
        sharding = einshard.make_sharding(expression, shape=SHAPE)  # built beforehand: B is device_put alone
        for source, make_input in sources(host, expression):
            result = _common.compare(
                lambda x, e=expression: einshard.einshard(x, e),
                lambda x, s=sharding: jax.device_put(x, s),
                make_input,
                args.reps,
                args.warmup,
                args.seconds,
                cap=EXTRA_PAIRS_CAP,
            )
            ok = result["ratio"] <= PLACEMENT_BAR
            failed |= not ok
            rows.append(
                [
                    expression,
                    kind,
                    source,
                    _common.ms(result["a"]),
                    _common.ms(result["b"]),
                    f"{result['b'] / memcpy:.1f}",
                    str(result["pairs"]),
                    f"{result['ratio']:.3f}",
                    _common.verdict(ok),
                ]
            )
            records.append(
                {
                    "expression": expression,
                    "layout": kind,
                    "input": source,
                    "einshard_s": result["a"],
                    "device_put_s": result["b"],
                    "device_put_over_memcpy": result["b"] / memcpy,
                    "pairs": result["pairs"],
                    "ratio": result["ratio"],
                    "bar": PLACEMENT_BAR,
                    "verdict": _common.verdict(ok),
                }
            )
    results.table(
        "placement",
        f"Placement: einshard(x, e) vs device_put(x, ready sharding); bar: ratio <= {PLACEMENT_BAR}",
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
        numeric={"einshard ms", "device_put ms", "÷ memcpy", "pairs", "ratio"},
        bar=PLACEMENT_BAR,
        records=records,
    )

    rows = [
        [
            "host memcpy of the array (np.copyto)",
            f"{_common.ms(memcpy)} ms, {host.nbytes / memcpy / 1e9:.1f} GB/s",
            "limit",
        ]
    ]
    records = [{"measure": "memcpy", "seconds": memcpy, "bar": None, "verdict": "limit"}]
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
        rows.append([f"cached {name}", f"{us:.2f} µs per call", _common.verdict(ok)])
        records.append(
            {
                "measure": f"cached {name}",
                "us": us,
                "bar": MAKE_SHARDING_BAR_US,
                "verdict": _common.verdict(ok),
            }
        )
    a_us, b_us = fixed_cost_us()
    rows.append(
        [
            "fixed cost: einshard vs device_put(x, ready sharding), 8x8 NumPy",
            f"{a_us:.1f} µs vs {b_us:.1f} µs (+{a_us - b_us:.1f})",
            "info",
        ]
    )
    records.append(
        {
            "measure": "fixed cost per call, 8x8 NumPy array",
            "einshard_us": a_us,
            "device_put_us": b_us,
            "bar": None,
            "verdict": "info",
        }
    )
    results.table(
        "per_call",
        f"Reference and per-call costs; bar for make_sharding: <= {MAKE_SHARDING_BAR_US:g} µs",
        ["measure", "value", "bar"],
        rows,
        bar=MAKE_SHARDING_BAR_US,
        records=records,
    )

    status = _common.exit_status(failed, args.no_fail)
    results.write(N_DEVICES, failed)
    return status


if __name__ == "__main__":
    sys.exit(main())
