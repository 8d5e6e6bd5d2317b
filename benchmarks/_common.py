"""What the ``bench_*.py`` scripts share; a private module, not a benchmark (nox runs ``bench_*.py``).

A script imports it first and calls :func:`start` before it imports JAX, NumPy or einshard:
nothing here imports them at module level, so that :func:`start` can still re-execute the
process with a tuned allocator before anything big is loaded.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

# Keep freed memory for reuse (see the scripts' docstrings); set before the process allocates,
# hence a re-exec.
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
MALLOC_TUNED = all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items())
CHECKOUT = Path(__file__).resolve().parents[1]


def start(*, re_exec: bool, cpu_devices: int) -> None:
    """Readies the process for a benchmark; call it before JAX, NumPy or einshard is imported.

    1. On Linux with glibc, when ``re_exec`` (the script runs as ``__main__`` and is not a
       subprocess that must keep its allocator) and ``--default-malloc`` is not among the
       arguments, re-executes the script with ``TUNED_MALLOC`` in the environment, unless it is
       there already. Then this call does not return: the new process runs the script afresh.
    2. Sets JAX to ``cpu_devices`` simulated CPU devices, before its backend starts.
    3. Puts this checkout first on ``sys.path``, so that the benchmark measures its einshard.
    """
    re_exec = re_exec and "--default-malloc" not in sys.argv[1:]
    if re_exec and not MALLOC_TUNED and platform.libc_ver()[0] == "glibc":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})

    import jax

    # Before JAX starts its backend (nothing above touches devices).
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cpu_devices)

    sys.path.insert(0, str(CHECKOUT))  # measure this checkout's einshard


# --- command line and environment -----------------------------------------------------------------


def parser(doc: str | None, *, reps: int, seconds: float, warmup: int, runs: str) -> argparse.ArgumentParser:
    """The options every script takes; ``runs`` names what ``--reps`` counts ("pairs", "runs")."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument(
        "--reps", type=int, default=reps, help=f"at least this many timed {runs} per row ({reps})"
    )
    parser.add_argument(
        "--seconds", type=float, default=seconds, help=f"more {runs} while they fit in this ({seconds:g})"
    )
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed pairs first (default {warmup})")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even when a bar is missed")
    parser.add_argument(
        "--json", metavar="PATH", type=Path, help="also write every table row and the set-up to PATH, as JSON"
    )
    parser.add_argument("--default-malloc", action="store_true", help="do not tune glibc malloc")
    return parser


def has_devices(n: int) -> bool:
    """Whether JAX has ``n`` devices; says so on stderr when not."""
    import jax

    if len(jax.devices()) != n:
        print(f"expected {n} CPU devices, JAX has {len(jax.devices())}", file=sys.stderr)
        return False
    return True


def environment(n_devices: int) -> str:
    """The versions, devices, cores and allocator the figures were measured with."""
    import jax
    import numpy as np

    import einshard

    return (
        f"einshard {einshard.__version__}, jax {jax.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}, {n_devices} CPU devices, {os.cpu_count()} cores, "
        f"malloc {'tuned to reuse memory' if MALLOC_TUNED else 'default'}"
    )


def memcpy_seconds(host: Any, reps: int) -> float:
    """The median time of one host copy of the NumPy array ``host`` into a preallocated array."""
    import numpy as np

    dst = np.empty_like(host)
    np.copyto(dst, host)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, host)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def exit_status(failed: bool, no_fail: bool) -> int:
    """Says whether every bar was met; the exit status (0 when one was missed but ``no_fail``)."""
    if failed:
        print("\nA bar was missed." + (" (--no-fail: exit status 0)" if no_fail else ""))
        return 0 if no_fail else 1
    print("\nAll bars met.")
    return 0


# --- timing ---------------------------------------------------------------------------------------


def _timed(
    place: Callable[[Any], object], make_input: Callable[[], Any], ready: Callable[[Any], Any]
) -> float:
    x = ready(make_input())  # untimed: an input made asynchronously is complete before the clock starts
    start = time.perf_counter()
    out = place(x)
    ready(out)
    elapsed = time.perf_counter() - start
    del out, x  # frees the buffers before the next run
    return elapsed


def compare(
    a: Callable[[Any], object],
    b: Callable[[Any], object],
    make_input: Callable[[], Any],
    reps: int,
    warmup: int,
    seconds: float = 0.0,
    *,
    cap: int,
) -> dict[str, float]:
    """Interleaved runs of ``a`` and ``b`` (A B, B A, ...): median times and median per-pair ratio a/b.

    Each run places a new ``make_input()`` and waits for its result (``block_until_ready``); the
    garbage collector is off meanwhile. At least ``reps`` pairs after ``warmup`` pairs; more (up
    to ``cap`` times as many) while the pairs fit in ``seconds``, for quick calls, whose times
    scatter more.
    """
    import jax

    ready = jax.block_until_ready
    times_a: list[float] = []
    times_b: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(warmup):
            _timed(a, make_input, ready)
            _timed(b, make_input, ready)
        start = time.perf_counter()
        while len(times_a) < reps or (len(times_a) < cap * reps and time.perf_counter() - start < seconds):
            if len(times_a) % 2 == 0:
                times_a.append(_timed(a, make_input, ready))
                times_b.append(_timed(b, make_input, ready))
            else:
                times_b.append(_timed(b, make_input, ready))
                times_a.append(_timed(a, make_input, ready))
    finally:
        gc.enable()
    return {
        "a": statistics.median(times_a),
        "b": statistics.median(times_b),
        "ratio": statistics.median(ta / tb for ta, tb in zip(times_a, times_b, strict=True)),
        "pairs": len(times_a),
    }


# --- LLaMA-shaped trees (bench_placement, bench_curves) -------------------------------------------

# Hybrid data x tensor parallelism: 4-way tensor parallel over the fast-varying devices, d_model over
# what is left; the norms replicated; the first match wins.
LLAMA_RULES = [
    (r"embed/embedding$", "vocab d -> d* vocab4"),
    (r"attn/(q|k|v)_proj/kernel$", "d heads -> d* heads4"),
    (r"attn/(q|k|v)_proj/bias$", "heads -> * heads4"),
    (r"attn/o_proj/kernel$", "heads d -> d* heads4"),
    (r"mlp/(gate|up)_proj/kernel$", "d ffn -> d* ffn4"),
    (r"mlp/(gate|up)_proj/bias$", "ffn -> * ffn4"),
    (r"mlp/down_proj/kernel$", "ffn d -> d* ffn4"),
    (r"(attention|ffn)_norm/scale$", "d -> * d"),
    (r"final_norm/scale$", "d -> * d"),
    (r"lm_head/kernel$", "d vocab -> d* vocab4"),
    (r"rotary/(sin|cos)$", "... -> * ..."),
    (r"(^|/)(step|count)$", "... -> * ..."),
    (r".*", "... -> * ..."),
]


def llama_tree(
    n_layers: int, d_model: int, ffn: int, vocab: int, leaf: Callable[[tuple[int, ...]], Any]
) -> Any:
    """A LLaMA-shaped parameter tree of nested dicts; ``leaf(shape)`` makes each leaf, in order.

    Paths look like ``layers/7/attn/q_proj/kernel`` and ``layers/7/attention_norm/scale``.
    """

    def layer() -> dict[str, Any]:
        return {
            "attn": {f"{name}_proj": {"kernel": leaf((d_model, d_model))} for name in "qkvo"},
            "mlp": {
                "gate_proj": {"kernel": leaf((d_model, ffn))},
                "up_proj": {"kernel": leaf((d_model, ffn))},
                "down_proj": {"kernel": leaf((ffn, d_model))},
            },
            "attention_norm": {"scale": leaf((d_model,))},
            "ffn_norm": {"scale": leaf((d_model,))},
        }

    return {
        "embed": {"embedding": leaf((vocab, d_model))},
        "layers": {str(i): layer() for i in range(n_layers)},
        "final_norm": {"scale": leaf((d_model,))},
        "lm_head": {"kernel": leaf((d_model, vocab))},
    }


def unaligned(array: Any) -> Any:
    """A copy of the NumPy ``array`` whose data does not start on a 64-byte boundary.

    On CPU, ``jax.device_put`` takes a 64-byte aligned NumPy array as the device buffer without
    copying it (it aliases the caller's memory), and einshard then leaves it to ``device_put``;
    the benchmarks measure the copying case, which is what NumPy's large allocations give
    (glibc's ``mmap`` chunks start 16 bytes into a page).
    """
    import numpy as np

    raw = np.empty(array.nbytes + 64, np.uint8)
    start = (16 - raw.ctypes.data) % 64
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


# --- output ---------------------------------------------------------------------------------------


def print_table(title: str, columns: list[str], rows: list[list[str]], numeric: Collection[str] = ()) -> None:
    """A rich table if rich is installed, else aligned plain text; ``numeric`` columns align right."""
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
        table.add_column(column, justify="right" if column in numeric else "left")
    for row in rows:
        table.add_row(*row, style="red" if row[-1] == "FAIL" else None)
    Console(width=max(120, len(title))).print(table)


class Results:
    """The tables a script prints, kept to be written as JSON with ``--json PATH``.

    :meth:`table` prints a table (:func:`print_table`) and keeps it: its title, columns and rows
    as printed, and ``records``, one dict of raw numbers (seconds, ratios, the bar, the verdict)
    per row. :meth:`write` writes them with the set-up they were measured with.
    """

    def __init__(self, script: str, args: argparse.Namespace) -> None:
        self.script = script
        self.args = args
        self.tables: dict[str, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.load_before = _load_average()

    def table(
        self,
        key: str,
        title: str,
        columns: list[str],
        rows: list[list[str]],
        numeric: Collection[str] = (),
        *,
        bar: float | None,
        records: list[dict[str, Any]],
    ) -> None:
        """Prints the table and keeps it under ``key``; ``records`` has one dict per row."""
        if len(records) != len(rows):
            raise ValueError(f"table {key!r}: {len(rows)} rows but {len(records)} records")
        print_table(title, columns, rows, numeric)
        self.tables[key] = {
            "title": title,
            "bar": bar,
            "columns": columns,
            "numeric": [column for column in columns if column in numeric],
            "rows": rows,
            "records": records,
        }

    def write(self, n_devices: int, failed: bool) -> None:
        """Writes the tables and the set-up to ``--json PATH``, if given."""
        path = getattr(self.args, "json", None)
        if path is None:
            return
        import jax
        import jaxlib
        import numpy as np

        import einshard

        metadata = {
            "script": f"benchmarks/{self.script}",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "einshard": einshard.__version__,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "devices": n_devices,
            "device_kind": "simulated CPU devices (jax_num_cpu_devices)",
            "malloc": "tuned to reuse memory" if MALLOC_TUNED else "default",
            "load_average_before": self.load_before,
            "load_average_after": _load_average(),
            "options": {
                k: v
                for k, v in vars(self.args).items()
                if k not in ("json", "memory_child") and v is not None
            },
            **self.extra,
        }
        document = {"metadata": metadata, "all_bars_met": not failed, "tables": self.tables}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {path}")


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, where the system has them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def ms(seconds: float) -> str:
    """Seconds as milliseconds, two decimals."""
    return f"{seconds * 1e3:.2f}"


def verdict(ok: bool) -> str:
    """PASS or FAIL."""
    return "PASS" if ok else "FAIL"


def run_child(
    script: str, arguments: list[str], env: dict[str, str] | None, timeout: float
) -> dict[str, Any]:
    """Runs ``script`` again with ``arguments`` in a fresh process; its answer is the last line, JSON.

    On failure, prints the child's output and exits.
    """
    done = subprocess.run(
        [sys.executable, str(Path(script).resolve()), *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        print(done.stdout, done.stderr, file=sys.stderr)
        raise SystemExit(f"the child {Path(script).name} {' '.join(arguments)} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])
