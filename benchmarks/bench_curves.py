"""Cost curves: how einshard's costs grow with the work (devices, leaves, model size).

    python benchmarks/bench_curves.py [--quick] [--reps 5] [--json PATH]

Four curves, each point measured in the same run:

1. **Placement vs device count**: ``einshard.einshard(x, 'x y -> x* y')`` of a fixed 4096x4096
   float32 array (64 MiB; ``--quick``: 1024x1024) from NumPy and from a ``jax.Array`` on one device,
   and ``jax.device_put`` of the same, on 8, 16 and 64 simulated CPU devices (one child process per
   count, as JAX fixes the count when it starts). The bytes written do not change with the count,
   so the time should stay flat; the per-device blocks get smaller, and each costs a fixed amount.
2. **Rule resolution vs leaves**: ``einshard.pytree_shardings(abstract_tree, rules)`` on
   LLaMA-shaped trees of 32, 320 and 3,200 layers (291 to 28,803 leaves), cold (a new ``Rules``,
   Python's regex cache purged, a tree structure not seen before) and repeated (a list of pairs
   on a known tree), against ``jax.tree_util.tree_flatten_with_path`` of the same tree. Linear in
   the leaves: µs per leaf should stay flat.
3. **explain vs device count**: ``einshard.explain(tree, rules, n_devices=N)`` for an abstract
   LLaMA-shaped tree (32 layers, d_model 16384) at N = 8 to 65,536 devices (no devices needed:
   ``n_devices`` plans for a count the machine lacks). Planning depends on the count only through
   factoring it: flat or logarithmic.
4. **Born-sharded init, peak host memory vs model size**: ``einshard.init_sharded`` of LLaMA-shaped
   models of about 0.2, 0.5, 1 and 2 GiB, each in a fresh process with the default allocator
   (``bench_rules.py``'s memory child: ``VmHWM`` after ``clear_refs``, less the baseline). The
   peak should stay a fixed multiple of the model.

Each curve's table ends with its growth: the last point over the first, against the work's
growth. No bars: the curves are for reading (the bars are in the other scripts).

``--quick`` measures fewer, smaller points (about a minute; for CI); ``nox -s benchmarks`` runs
the full version. ``--json PATH`` writes the tables as JSON; the documentation's benchmark page
draws the curves from that file.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, even where Python leaves it out (-P)
import _common


def _child_devices(argv: list[str]) -> int:
    """The device count a child process is started for (``--placement-child N``), else 8."""
    if "--placement-child" in argv:
        return int(argv[argv.index("--placement-child") + 1])
    return 8


N_DEVICES = _child_devices(sys.argv)
IS_CHILD = any(flag in sys.argv for flag in ("--placement-child", "--memory-child"))
_common.start(re_exec=__name__ == "__main__" and not IS_CHILD, cpu_devices=N_DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import einshard  # noqa: E402

PLACEMENT_DEVICES = {"full": (8, 16, 64), "quick": (8, 16)}
PLACEMENT_SHAPE = {"full": (4096, 4096), "quick": (1024, 1024)}
RESOLVE_LAYERS = {"full": (32, 320, 3200), "quick": (32, 320)}
EXPLAIN_DEVICES = {"full": (8, 64, 512, 4096, 65536), "quick": (8, 512, 65536)}
EXPLAIN_TREE = (32, 16384, 53248, 128000)  # layers, d_model, ffn, vocab: d divides by 65,536 / 4
MEMORY_LAYERS = {"full": (1, 4, 9, 18), "quick": (1,)}  # d_model 1536: 0.2, 0.5, 1.04, 2.0 GiB
MEMORY_DIMS = (1536, 4096, 8192)


# --- 1. placement vs device count (a child process per count) --------------------------------------


def placement_child(shape: tuple[int, int], reps: int) -> int:
    """In a process with ``N_DEVICES`` devices: median seconds of each placement, as JSON."""
    host = _common.unaligned(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    memcpy = _common.memcpy_seconds(host, max(reps, 5))
    expression = "x y -> x* y"
    sharding = einshard.make_sharding(expression, shape=shape)
    on_one_device = jax.block_until_ready(jax.device_put(host, jax.devices()[0]))
    out: dict[str, Any] = {"devices": N_DEVICES, "bytes": host.nbytes, "memcpy_s": memcpy}
    for source, value in (("numpy", host), ("jax, 1 device", on_one_device)):
        result = _common.compare(
            lambda x: einshard.einshard(x, expression),
            lambda x: jax.device_put(x, sharding),
            lambda v=value: v,
            reps,
            2,
            cap=1,
        )
        out[source] = {"einshard_s": result["a"], "device_put_s": result["b"]}
    print(json.dumps(out))
    return 0


def placement_curve(mode: str, reps: int) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, records = [], []
    shape = PLACEMENT_SHAPE[mode]
    for count in PLACEMENT_DEVICES[mode]:
        point = _run_child(
            ["--placement-child", str(count), "--shape", *map(str, shape), "--reps", str(reps)]
        )
        for source in ("numpy", "jax, 1 device"):
            a, b = point[source]["einshard_s"], point[source]["device_put_s"]
            records.append(
                {
                    "devices": count,
                    "input": source,
                    "bytes": point["bytes"],
                    "einshard_s": a,
                    "device_put_s": b,
                    "memcpy_s": point["memcpy_s"],
                    "bar": None,
                    "verdict": "info",
                }
            )
            rows.append(
                [str(count), source, _common.ms(a), _common.ms(b), f"{a / point['memcpy_s']:.2f}", "info"]
            )
    more_rows, growth = _growth(records, "devices", "einshard_s", work=lambda _: 1.0, by="input")
    return rows + more_rows, records + growth


# --- 2. rule resolution vs leaves -------------------------------------------------------------------

_structures = itertools.count()


def _unseen(tree: dict[str, Any]) -> dict[str, Any]:
    """The same leaves in a structure not met before, every cache of paths and regexes emptied."""
    einshard._trees._paths._PATHS.clear()
    einshard._trees._rules._compile_table.cache_clear()
    re.purge()
    return {**tree, "_": {str(next(_structures)): None}}


def _median_seconds(setup: Any, call: Any, reps: int) -> float:
    samples = []
    call(setup())
    for _ in range(reps):
        argument = setup()
        gc.collect()
        start = time.perf_counter()
        call(argument)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def resolve_curve(mode: str, reps: int) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, records = [], []
    for layers in RESOLVE_LAYERS[mode]:
        tree = _common.llama_tree(layers, 64, 128, 256, lambda s: jax.ShapeDtypeStruct(s, jnp.float32))
        leaves = len(jax.tree.leaves(tree))
        runs = max(3, reps if leaves < 10_000 else reps // 2)
        times = {
            "cold": _median_seconds(
                lambda t=tree: _unseen(t),
                lambda t: einshard.pytree_shardings(t, einshard.Rules(_common.LLAMA_RULES)),
                runs,
            ),
            "repeated": _median_seconds(
                lambda t=tree: t, lambda t: einshard.pytree_shardings(t, _common.LLAMA_RULES), runs
            ),
            "flatten": _median_seconds(lambda t=tree: _unseen(t), jax.tree_util.tree_flatten_with_path, runs),
        }
        for measure, seconds in times.items():
            us = seconds / leaves * 1e6
            records.append(
                {
                    "leaves": leaves,
                    "measure": measure,
                    "seconds": seconds,
                    "us_per_leaf": us,
                    "over_flatten": seconds / times["flatten"],
                    "bar": None,
                    "verdict": "info",
                }
            )
            rows.append(
                [
                    f"{leaves:,}",
                    measure,
                    _common.ms(seconds),
                    f"{us:.2f}",
                    f"{seconds / times['flatten']:.2f}",
                    "info",
                ]
            )
    more_rows, growth = _growth(records, "leaves", "seconds", work=float, by="measure")
    return rows + more_rows, records + growth


# --- 3. explain vs device count ---------------------------------------------------------------------


def explain_curve(mode: str, reps: int) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, records = [], []
    tree = _common.llama_tree(*EXPLAIN_TREE, lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16))
    leaves = len(jax.tree.leaves(tree))
    rules = einshard.Rules(_common.LLAMA_RULES)
    for count in EXPLAIN_DEVICES[mode]:
        seconds = _median_seconds(
            lambda: tree, lambda t, n=count: einshard.explain(t, rules, n_devices=n), reps
        )
        report = einshard.explain(tree, rules, n_devices=count)
        per_device = report.max_bytes_per_device
        records.append(
            {
                "devices": count,
                "leaves": leaves,
                "seconds": seconds,
                "max_bytes_per_device": per_device,
                "bar": None,
                "verdict": "info",
            }
        )
        rows.append([f"{count:,}", str(leaves), _common.ms(seconds), f"{per_device / 2**20:.1f}", "info"])
    more_rows, growth = _growth(records, "devices", "seconds", work=lambda _: 1.0)
    return rows + more_rows, records + growth


# --- 4. born-sharded init: peak memory vs model size --------------------------------------------------


def memory_child(layers: int) -> int:
    """In a fresh process: ``bench_rules.py``'s memory child, for a model of ``layers`` layers."""
    import bench_rules

    bench_rules.MEMORY_MODEL = (layers, *MEMORY_DIMS)
    return bench_rules.memory_child("init_sharded")


def memory_curve(mode: str) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, records = [], []
    env = {k: v for k, v in os.environ.items() if k not in _common.TUNED_MALLOC}  # the allocator users have
    for layers in MEMORY_LAYERS[mode]:
        result = _run_child(["--memory-child", str(layers)], env=env)
        ratio = result["peak"] / result["model"]
        records.append(
            {
                "layers": layers,
                "model_bytes": result["model"],
                "peak_bytes": result["peak"],
                "peak_over_model": ratio,
                "seconds": result["seconds"],
                "method": result["method"],
                "bar": None,
                "verdict": "info",
            }
        )
        rows.append(
            [
                f"{result['model'] / 2**30:.2f}",
                f"{result['peak'] / 2**30:.2f}",
                f"{ratio:.2f}",
                f"{result['seconds']:.1f}",
                "info",
            ]
        )
    more_rows, growth = _growth(
        records, "model_bytes", "peak_bytes", work=float, show=lambda b: f"{b / 2**30:.2f} GiB"
    )
    return rows + more_rows, records + growth


# --- shared -------------------------------------------------------------------------------------------


def _run_child(arguments: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    return _common.run_child(__file__, arguments, env, timeout=900)


GROWTH_SLACK = 1.5  # a curve grows "with its work" while cost growth / work growth stays below this


def _growth(
    records: list[dict[str, Any]],
    x: str,
    y: str,
    *,
    work: Any,
    by: str | None = None,
    show: Any = "{:,}".format,
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Per series: how much the cost grew from the first point to the last, against the work."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(str(record[by]) if by else "", []).append(record)
    rows, growth = [], []
    for name, points in groups.items():
        first, last = points[0], points[-1]
        grew = last[y] / first[y]
        expected = work(last[x]) / work(first[x])
        within = grew <= GROWTH_SLACK * expected
        verdict = "with the work" if within else "faster than the work"
        rows.append(
            [
                f"growth {show(first[x])} → {show(last[x])}",
                name,
                f"cost × {grew:.2f}",
                f"work × {expected:.3g}",
                verdict,
            ]
        )
        growth.append(
            {
                "growth": name,
                "from": first[x],
                "to": last[x],
                "cost": grew,
                "work": expected,
                "bar": None,
                "verdict": verdict,
            }
        )
    return rows, growth


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__, reps=5, seconds=0.0, warmup=1, runs="runs")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller points (about a minute; for CI)")
    parser.add_argument("--placement-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.placement_child:
        return placement_child(tuple(args.shape), args.reps)
    if args.memory_child:
        return memory_child(args.memory_child)
    mode = "quick" if args.quick else "full"
    results = _common.Results(Path(__file__).name, args)
    print(_common.environment(N_DEVICES) + f"; {mode} curves")
    tables = [
        (
            "placement_devices",
            f"Placement vs device count: einshard(x, 'x y -> x* y'), {PLACEMENT_SHAPE[mode]} float32",
            ["devices", "input", "einshard ms", "device_put ms", "÷ memcpy", "note"],
            lambda: placement_curve(mode, args.reps),
        ),
        (
            "resolve_leaves",
            "Rule resolution vs leaves: pytree_shardings(abstract LLaMA tree, 13 rules)",
            ["leaves", "measure", "ms", "µs per leaf", "÷ flatten", "note"],
            lambda: resolve_curve(mode, args.reps),
        ),
        (
            "explain_devices",
            f"explain(tree, rules, n_devices=N) vs N: LLaMA-shaped, {EXPLAIN_TREE[0]} layers, "
            f"d_model {EXPLAIN_TREE[1]}",
            ["devices", "leaves", "ms", "MiB per device", "note"],
            lambda: explain_curve(mode, args.reps),
        ),
        (
            "init_memory",
            "init_sharded peak host memory vs model size (fresh process each, default malloc)",
            ["model GiB", "peak GiB", "peak ÷ model", "seconds", "note"],
            lambda: memory_curve(mode),
        ),
    ]
    for key, title, columns, measure in tables:
        rows, records = measure()
        rows = [row[:-1] + [""] * (len(columns) - len(row)) + row[-1:] for row in rows]
        results.table(
            key, title, columns, rows, numeric=set(columns[2:-1]) - {"measure"}, bar=None, records=records
        )
    results.extra["mode"] = mode
    results.write(N_DEVICES, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
