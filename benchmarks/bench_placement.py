"""Placement: ``einshard`` against ``jax.device_put`` and against the memory-bandwidth floor.

    python benchmarks/bench_placement.py [--reps 30] [--seconds 4] [--warmup 5] [--no-fail] [--json PATH]

On 8 simulated CPU devices, for a 4096x4096 float32 array (64 MiB), times
``einshard.einshard(x, e)`` (A) against ``jax.device_put(x, sharding)`` (B),
``sharding = einshard.make_sharding(e, shape=x.shape)`` built before the timed
calls, for split, partially replicated and replicated layouts, from a NumPy
array (not 64-byte aligned, so that ``device_put`` copies it; see
``_common.unaligned``), from a ``jax.Array`` on one device and from a
``jax.Array`` with another sharding. Runs are interleaved (A B, then B A, ...);
each waits for its result (``block_until_ready``) and drops it before the next.
Each row takes at least ``--reps`` pairs, and more while they fit in
``--seconds``.

Each row also shows its **floor**, for information: the bytes written to all
devices (every device's block, less a block the input already holds on that
device, which both keep) divided by the memcpy rate measured in the same run
(one ``np.copyto`` of the array into a preallocated one, median, measured again
just before each row). einshard places concrete values with ``jax.device_put``
itself, so the ratio is what einshard adds to it.

Bar: every row no slower than ``device_put`` (median per-pair ratio A/B <= 1.05).

Also: ``einshard.shard_pytree`` of a 32-layer LLaMA-shaped tree (424 MiB
float32, d_model 512) against ``jax.device_put(tree, shardings)``, from NumPy
and from one device (the same bar, and its floor); a repeated (cached)
``make_sharding`` call (bar: 10 µs); einshard's fixed cost per call (no bar).

Memory: on Linux with glibc the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set, so that freed
shard buffers are reused rather than handed back to the kernel and faulted in
afresh (zero-filled) on the next run. glibc caps the first at 32 MiB, so
buffers of 32 MiB and more are still fresh memory on every run (the replicated
rows). Both sides get the same allocator; ``--default-malloc`` measures
without it.

``--json PATH`` also writes every table row (the printed strings and the raw
numbers) and the set-up (versions, cores, devices, the memcpy reference) as JSON;
the documentation's benchmark page is drawn from that file.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import argparse
import math
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
TREE = (32, 512, 1408, 8192)  # layers, d_model, ffn, vocab: 424 MiB float32

LAYOUTS = [
    ("split", "x y -> x y*"),
    ("split", "x y -> x* y"),
    ("partly replicated", "x y -> x4 y 2"),
    ("replicated", "... -> * ..."),
]


def written_bytes(x: object, sharding: jax.sharding.Sharding) -> int:
    """Bytes the placement writes: each device's block, less one the input holds there already.

    A ``jax.Array`` on one device keeps its buffer where the target puts the whole array on that
    device (``jax.device_put`` and einshard both reuse it).
    """
    shape = tuple(x.shape)  # type: ignore[attr-defined]
    itemsize = np.dtype(x.dtype).itemsize  # type: ignore[attr-defined]
    held = set()
    if isinstance(x, jax.Array) and len(x.sharding.device_set) == 1:
        held = x.sharding.device_set
    total = 0
    for device, index in sharding.devices_indices_map(shape).items():
        block = math.prod(len(range(*part.indices(size))) for part, size in zip(index, shape, strict=True))
        if not (device in held and block == math.prod(shape)):
            total += block * itemsize
    return total


_MEMCPY_HOST: list[np.ndarray] = []


def row_rate(reps: int) -> float:
    """The memcpy rate (bytes/s) measured again just before a row, so that its floor sees the same
    load as its timings (on a shared machine the rate drifts during the run)."""
    host = _MEMCPY_HOST[0]
    return host.nbytes / _common.memcpy_seconds(host, max(5, reps // 3))


def sources(host: np.ndarray, expression: str) -> list[tuple[str, Callable[[], object]]]:
    """The inputs: the NumPy array, a jax.Array on one device, a jax.Array with another sharding.

    The sharded one is made afresh for every run: resharding it on CPU can go through its host
    value, which the array then caches, so that later runs would start from that cache.
    """
    other = "x y -> x y*" if expression == "x y -> x* y" else "x y -> x* y"
    other_sharding = einshard.make_sharding(other, shape=host.shape)
    on_one_device = jax.device_put(host, jax.devices()[0])
    host = _common.unaligned(host)
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


PLACEMENT_COLUMNS = [
    "expression",
    "layout",
    "input",
    "einshard ms",
    "device_put ms",
    "floor ms",
    "÷ floor",
    "device_put ÷ floor",
    "pairs",
    "ratio",
    "bar",
]
NUMERIC_COLUMNS = {
    "einshard ms",
    "device_put ms",
    "floor ms",
    "÷ floor",
    "device_put ÷ floor",
    "pairs",
    "ratio",
}


def _placement_row(
    kind: str, expression: str, source: str, result: dict[str, float], floor: float
) -> dict[str, object]:
    """One row's record; it passes no slower than device_put."""
    ok = result["ratio"] <= PLACEMENT_BAR
    return {
        "expression": expression,
        "layout": kind,
        "input": source,
        "einshard_s": result["a"],
        "device_put_s": result["b"],
        "floor_s": floor,
        "einshard_over_floor": result["a"] / floor,
        "device_put_over_floor": result["b"] / floor,
        "pairs": result["pairs"],
        "ratio": result["ratio"],
        "bar": PLACEMENT_BAR,
        "verdict": _common.verdict(ok),
    }


def _placement_strings(record: dict[str, object]) -> list[str]:
    return [
        str(record["expression"]),
        str(record["layout"]),
        str(record["input"]),
        _common.ms(record["einshard_s"]),  # type: ignore[arg-type]
        _common.ms(record["device_put_s"]),  # type: ignore[arg-type]
        _common.ms(record["floor_s"]),  # type: ignore[arg-type]
        f"{record['einshard_over_floor']:.2f}",
        f"{record['device_put_over_floor']:.2f}",
        str(record["pairs"]),
        f"{record['ratio']:.3f}",
        str(record["verdict"]),
    ]


def tree_rows(args: argparse.Namespace, rate: float) -> tuple[list[list[str]], list[dict[str, object]], bool]:
    """shard_pytree of the 424 MiB LLaMA-shaped tree against device_put(tree, shardings), with its floor."""
    rng = np.random.default_rng(0)
    host = _common.llama_tree(
        *TREE, lambda shape: _common.unaligned(rng.standard_normal(shape, dtype=np.float32))
    )
    shardings = einshard.pytree_shardings(host, _common.LLAMA_RULES)
    on_one_device = jax.block_until_ready(jax.device_put(host, jax.devices()[0]))
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(host))
    rows = []
    records: list[dict[str, object]] = []
    failed = False
    for source, tree in (("numpy", host), ("jax, 1 device", on_one_device)):
        rate = row_rate(args.reps)
        floor = sum(map(written_bytes, jax.tree.leaves(tree), jax.tree.leaves(shardings))) / rate
        result = _common.compare(
            lambda t: einshard.shard_pytree(t, _common.LLAMA_RULES),
            lambda t, s=shardings: jax.device_put(t, s),
            lambda t=tree: t,
            max(5, args.reps // 2),
            args.warmup,
            args.seconds,
            cap=EXTRA_PAIRS_CAP,
        )
        ok = result["ratio"] <= PLACEMENT_BAR
        failed |= not ok
        record = {
            "tree": f"32 layers, d 512 ({nbytes / 2**20:.0f} MiB)",
            "bytes": nbytes,
            "input": source,
            "shard_pytree_s": result["a"],
            "device_put_s": result["b"],
            "floor_s": floor,
            "shard_pytree_over_floor": result["a"] / floor,
            "device_put_over_floor": result["b"] / floor,
            "pairs": result["pairs"],
            "ratio": result["ratio"],
            "bar": PLACEMENT_BAR,
            "verdict": _common.verdict(ok),
        }
        records.append(record)
        rows.append(
            [
                str(record["tree"]),
                source,
                _common.ms(result["a"]),
                _common.ms(result["b"]),
                _common.ms(floor),
                f"{result['a'] / floor:.2f}",
                f"{result['b'] / floor:.2f}",
                str(result["pairs"]),
                f"{result['ratio']:.3f}",
                _common.verdict(ok),
            ]
        )
    return rows, records, failed


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks and prints the tables; returns the exit status."""
    parser = _common.parser(__doc__, reps=30, seconds=4.0, warmup=5, runs="pairs")
    args = parser.parse_args(argv)
    results = _common.Results(Path(__file__).name, args)

    if not _common.has_devices(N_DEVICES):
        return 2
    print(_common.environment(N_DEVICES))
    host = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    _MEMCPY_HOST.append(host)
    memcpy = _common.memcpy_seconds(host, args.reps)
    rate = host.nbytes / memcpy
    results.extra["memcpy"] = {
        "what": "np.copyto of the 4096x4096 float32 array into a preallocated one, median",
        "bytes": host.nbytes,
        "seconds": memcpy,
        "GB_per_s": rate / 1e9,
    }
    print(
        f"array {SHAPE[0]}x{SHAPE[1]} float32 ({host.nbytes / 2**20:.0f} MiB); memcpy {rate / 1e9:.1f} GB/s; "
        f"per row, after {args.warmup} warm-up pairs, at least {args.reps} interleaved pairs "
        f"(more while they fit in {args.seconds:g} s)"
    )

    failed = False
    rows = []
    records = []
    for kind, expression in LAYOUTS:
        sharding = einshard.make_sharding(expression, shape=SHAPE)  # built beforehand: B is device_put alone
        for source, make_input in sources(host, expression):
            sample = make_input()
            floor = written_bytes(sample, sharding) / row_rate(args.reps)
            del sample
            result = _common.compare(
                lambda x, e=expression: einshard.einshard(x, e),
                lambda x, s=sharding: jax.device_put(x, s),
                make_input,
                args.reps,
                args.warmup,
                args.seconds,
                cap=EXTRA_PAIRS_CAP,
            )
            rows_record = _placement_row(kind, expression, source, result, floor)
            failed |= rows_record["verdict"] == "FAIL"
            rows.append(_placement_strings(rows_record))
            records.append(rows_record)
    results.table(
        "placement",
        f"Placement: einshard(x, e) vs device_put(x, ready sharding), and the floor; bar: ratio <= "
        f"{PLACEMENT_BAR}",
        PLACEMENT_COLUMNS,
        rows,
        numeric=NUMERIC_COLUMNS,
        bar=PLACEMENT_BAR,
        records=records,
    )

    rows, records, tree_failed = tree_rows(args, rate)
    failed |= tree_failed
    results.table(
        "shard_pytree",
        f"shard_pytree(tree, rules) vs device_put(tree, shardings), and the floor; bar: ratio <= "
        f"{PLACEMENT_BAR}",
        [
            "tree",
            "input",
            "shard_pytree ms",
            "device_put ms",
            "floor ms",
            "÷ floor",
            "device_put ÷ floor",
            "pairs",
            "ratio",
            "bar",
        ],
        rows,
        numeric={
            "shard_pytree ms",
            "device_put ms",
            "floor ms",
            "÷ floor",
            "device_put ÷ floor",
            "pairs",
            "ratio",
        },
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
