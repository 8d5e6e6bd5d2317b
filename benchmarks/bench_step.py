"""Step reports: what a LLaMA-shaped training step costs under four rule tables, and what the report costs.

    python benchmarks/bench_step.py [--no-fail] [--json PATH]

The step is ``examples/llama_step.py``'s: a 4-layer LLaMA-shaped transformer (vocab 1024,
d_model 256, 8 heads, MLP 768; 15 MiB of float32 parameters), a batch of 64 sequences of 64
tokens, cross-entropy and a plain SGD update. Four rule tables shard it (data parallel, FSDP,
tensor parallel, hybrid: see that file). For each, ``einshard.explain_step`` compiles the step
on 8 simulated CPU devices in this process and plans it for 64 in a child process
(``n_devices=64``), from ``ShapeDtypeStruct`` arguments (nothing is allocated).

1. **strategies**: collectives, bytes per device per step by kind, peak memory per device and
   the estimated step time (communication by the ring formulas plus compute, no overlap) at
   25 and 200 GB/s per device, 5 µs latency per ring step and 100 TFLOP/s. No bar: these are
   the numbers the documentation's "What does my table cost?" page plots.
2. **overhead**: reading the compiled program, attributing its collectives and finding its
   waste (``report.analysis_seconds``) against lowering and compiling it (``compile_seconds``),
   in the same call. Bar: analysis ≤ 10% of the compile. Re-estimating the report at other
   figures (``report.at(bandwidth=..., latency=...)``, the median of 20
   calls) against the same compile. Bar: ≤ 1% of the compile (no recompile). And the wall time
   of planning for 64 devices in a child process (start, import JAX, compile, read, answer).
   Bar: ≤ 60 s.
3. **findings**: the waste each table's report names, and what it costs.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import _common

N_DEVICES = 8
_common.start(re_exec=False, cpu_devices=N_DEVICES)
sys.path.insert(0, str(_common.CHECKOUT / "examples"))

import llama_step  # noqa: E402

import einshard  # noqa: E402

ANALYSIS_BAR = 0.10  # analysis / compile
AT_BAR = 0.01  # report.at(...) / compile: a recompile would be about 1
CHILD_BAR_SECONDS = 60.0
BANDWIDTHS = (25e9, 200e9)
LATENCY = 5e-6
FLOPS_PER_SECOND = 100e12
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__, reps=1, seconds=0.0, warmup=0, runs="runs")
    args = parser.parse_args(argv)
    results = _common.Results(Path(__file__).name, args)
    if not _common.has_devices(N_DEVICES):
        return 2
    print(_common.environment(N_DEVICES))
    failed = False
    rows, records, overhead_rows, overhead_records = [], [], [], []
    finding_rows, finding_records = [], []
    for devices in (N_DEVICES, 64):
        for name in llama_step.STRATEGIES:
            start = time.perf_counter()
            report = llama_step.report(
                name,
                None if devices == N_DEVICES else devices,
                latency=LATENCY,
                flops_per_second=FLOPS_PER_SECOND,
                bandwidth=BANDWIDTHS[0],
            )
            wall = time.perf_counter() - start
            steps = [report.at(bandwidth=b).step_seconds for b in BANDWIDTHS]
            kinds = {kind: report.bytes_by_kind.get(kind, 0) for kind in KINDS}
            rows.append(
                [
                    name,
                    str(devices),
                    str(report.collectives),
                    *(f"{kinds[k] / 2**20:.1f}" for k in KINDS),
                    f"{report.bytes / 2**20:.1f}",
                    f"{(report.peak_bytes or 0) / 2**20:.1f}",
                    *(f"{s * 1e3:.2f}" for s in steps),
                ]
            )
            records.append(
                {
                    "strategy": name,
                    "devices": devices,
                    "collectives": report.collectives,
                    "bytes_by_kind": kinds,
                    "bytes": report.bytes,
                    "traffic": report.traffic,
                    "peak_bytes": report.peak_bytes,
                    "flops": report.flops,
                    "step_seconds": dict(zip([f"{b / 1e9:g}" for b in BANDWIDTHS], steps, strict=True)),
                    "bar": None,
                    "verdict": "info",
                }
            )
            ratio = report.analysis_seconds / report.compile_seconds
            at_seconds = _at_seconds(report)
            at_ratio = at_seconds / report.compile_seconds
            ok = ratio <= ANALYSIS_BAR and at_ratio <= AT_BAR
            failed |= not ok
            child_ok = devices == N_DEVICES or wall <= CHILD_BAR_SECONDS
            failed |= not child_ok
            overhead_rows.append(
                [
                    name,
                    str(devices),
                    f"{report.compile_seconds:.2f}",
                    f"{report.analysis_seconds * 1e3:.1f}",
                    f"{ratio:.3f}",
                    f"{at_seconds * 1e3:.2f}",
                    f"{at_ratio:.4f}",
                    f"{wall:.1f}" if devices != N_DEVICES else "-",
                    _common.verdict(ok and child_ok),
                ]
            )
            overhead_records.append(
                {
                    "strategy": name,
                    "devices": devices,
                    "compile_seconds": report.compile_seconds,
                    "analysis_seconds": report.analysis_seconds,
                    "ratio": ratio,
                    "at_seconds": at_seconds,
                    "at_ratio": at_ratio,
                    "child_seconds": wall if devices != N_DEVICES else None,
                    "bar": ANALYSIS_BAR,
                    "at_bar": AT_BAR,
                    "verdict": _common.verdict(ok and child_ok),
                }
            )
            for finding in report.findings:
                finding_rows.append(
                    [
                        name,
                        str(devices),
                        finding.kind,
                        f"{finding.bytes / 2**20:.2f}",
                        f"{finding.memory_bytes / 2**20:.2f}",
                        _short(finding),
                    ]
                )
                finding_records.append(
                    {
                        "strategy": name,
                        "devices": devices,
                        "kind": finding.kind,
                        "bytes": finding.bytes,
                        "memory_bytes": finding.memory_bytes,
                        "params": list(finding.params),
                        "sources": list(finding.sources),
                        "cause": finding.cause,
                        "fix": finding.fix,
                        "traffic": report.traffic,
                        "bar": None,
                        "verdict": "info",
                    }
                )
    gbs = [f"{b / 1e9:g}" for b in BANDWIDTHS]
    results.table(
        "strategies",
        "What the LLaMA-shaped step costs per device, by rule table (MiB per device per step; "
        f"step time: communication + compute, ms, at {LATENCY * 1e6:g} µs latency, "
        f"{FLOPS_PER_SECOND / 1e12:g} TFLOP/s)",
        [
            "table",
            "devices",
            "collectives",
            *KINDS,
            "total MiB",
            "peak memory MiB",
            *(f"ms at {g} GB/s" for g in gbs),
        ],
        rows,
        {"devices", "collectives", *KINDS, "total MiB", "peak memory MiB", *(f"ms at {g} GB/s" for g in gbs)},
        bar=None,
        records=records,
    )
    overhead_figures = [
        "devices",
        "compile s",
        "analysis ms",
        "analysis / compile",
        ".at ms",
        ".at / compile",
        "child wall s",
    ]
    results.table(
        "overhead",
        f"What the report costs: analysis / compile, bar <= {ANALYSIS_BAR:g}; .at(...) / compile, "
        f"bar <= {AT_BAR:g} (no recompile); planning 64 devices in a child, bar <= {CHILD_BAR_SECONDS:g} s",
        ["table", *overhead_figures, "bar"],
        overhead_rows,
        set(overhead_figures),
        bar=ANALYSIS_BAR,
        records=overhead_records,
    )
    results.table(
        "findings",
        "The waste each table's report names (MiB per device per step sent, or held, beyond the "
        "better program, as compiled for CPU devices)",
        ["table", "devices", "kind", "sent MiB", "held MiB", "where"],
        finding_rows,
        {"devices", "sent MiB", "held MiB"},
        bar=None,
        records=finding_records,
    )
    status = _common.exit_status(failed, args.no_fail)
    results.write(N_DEVICES, failed)
    return status


def _at_seconds(report: einshard.StepReport) -> float:
    """The median time of re-estimating the report at other figures."""
    times = []
    for i in range(20):
        start = time.perf_counter()
        report.at(bandwidth=BANDWIDTHS[i % 2], latency=LATENCY * (i % 2))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _short(finding: einshard.Finding) -> str:
    where = ", ".join(finding.params[:2]) + (" ..." if len(finding.params) > 2 else "")
    at = ", ".join(source.rsplit("/", 1)[-1] for source in finding.sources[:2])
    return " at ".join(part for part in (where, at) if part) or "-"


if __name__ == "__main__":
    sys.exit(main())
