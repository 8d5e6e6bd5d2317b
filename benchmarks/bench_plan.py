"""The planner: which strategy for the LLaMA-shaped step at 8 and 64 devices, and what planning costs.

    python benchmarks/bench_plan.py [--no-fail] [--json PATH]

The step is ``examples/llama_step.py``'s (a 4-layer LLaMA-shaped transformer, 15 MiB of float32
parameters, a batch of 64 sequences of 64 tokens, plain SGD), planned with ``einshard.plan`` and
its default candidates (data parallel, FSDP, tensor parallel, and a hybrid for every (data,
model) factorization of the device count, the last two read from the step's dataflow) at
100 GB/s per device, 5 µs latency per ring step, 100 TFLOP/s and 96 MiB per device
(``examples/plan_llama.py``'s figures).

1. **plans**: the ranked candidates at 8 devices (compiled in this process) and at 64 (one
   child process with 64 simulated CPU devices), as ``print(plan)`` shows them: the
   documentation's "Choosing a strategy" page shows these at build time.
2. **scaling**: the wall time of ``einshard.plan`` by device count and number of candidates.
   Each candidate is one compile of the step, so the time grows linearly with the candidates;
   with the devices it grows through the compile (the partitioned program has more collectives
   and larger groups), through the number of default candidates (3 plus one hybrid per divisor
   of the device count), and by the start of a child process (importing JAX) when the machine
   does not have that many devices. Bar: the default candidates at 8 devices ≤ 60 s.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import _common

N_DEVICES = 8
_common.start(re_exec=False, cpu_devices=N_DEVICES)
sys.path.insert(0, str(_common.CHECKOUT / "examples"))

import llama_step  # noqa: E402
import plan_llama  # noqa: E402

import einshard  # noqa: E402

BAR_SECONDS = 60.0
COMPILE_BAR = 1.2  # plan wall time / the sum of its candidates' compile times
SCALING = ((8, 1), (8, 3), (8, None), (16, None), (32, None), (64, None))  # (devices, candidates)


def _plan(n_devices: int, count: int | None) -> tuple[einshard.Plan, float]:
    start = time.perf_counter()
    # The defaults plan makes: the tensor-parallel tables read from the step (timed: part of planning).
    candidates = einshard.strategies.defaults(
        n_devices,
        step=llama_step.train_step,
        params=llama_step.abstract_params(),
        batch=llama_step.abstract_batch(),
    )
    plan = einshard.plan(
        llama_step.train_step,
        llama_step.abstract_params(),
        llama_step.abstract_batch(),
        n_devices=n_devices,
        candidates=candidates if count is None else candidates[:count],
        **plan_llama.FIGURES,
    )
    return plan, time.perf_counter() - start


def _findings(report: einshard.StepReport | None) -> str:
    """How many findings, and the largest's kind and bytes."""
    if report is None or not report.findings:
        return "-" if report is None else "0"
    largest = report.findings[0]
    return f"{len(report.findings)}, largest {largest.kind} {largest.cost / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__, reps=1, seconds=0.0, warmup=0, runs="runs")
    args = parser.parse_args(argv)
    results = _common.Results(Path(__file__).name, args)
    if not _common.has_devices(N_DEVICES):
        return 2
    print(_common.environment(N_DEVICES))
    failed = False
    plan_rows, plan_records, scaling_rows, scaling_records, texts = [], [], [], [], {}
    for n_devices, count in SCALING:
        plan, wall = _plan(n_devices, count)
        n_candidates = len(plan.rows)
        in_child = n_devices != N_DEVICES
        is_bar = n_devices == N_DEVICES and count is None
        compiles = sum(row.report.compile_seconds for row in plan.rows if row.report is not None)
        over = wall / compiles if compiles else float("inf")
        ok = (not is_bar or wall <= BAR_SECONDS) and (in_child or over <= COMPILE_BAR)
        failed |= not ok
        scaling_rows.append(
            [
                str(n_devices),
                str(n_candidates),
                "child" if in_child else "this process",
                f"{wall:.1f}",
                f"{wall / n_candidates:.2f}",
                f"{compiles:.1f}",
                f"{over:.3f}",
                "-" if in_child and not is_bar else _common.verdict(ok),
            ]
        )
        scaling_records.append(
            {
                "devices": n_devices,
                "candidates": n_candidates,
                "child_process": in_child,
                "seconds": wall,
                "seconds_per_candidate": wall / n_candidates,
                "compile_seconds": compiles,
                "plan_over_compiles": over,
                "compile_bar": None if in_child else COMPILE_BAR,
                "bar": BAR_SECONDS if is_bar else None,
                "verdict": "info" if in_child and not is_bar else _common.verdict(ok),
            }
        )
        if count is None and n_devices in (8, 64):
            texts[str(n_devices)] = str(plan)
            for rank, row in enumerate(plan.rows, 1):
                report = row.report
                plan_rows.append(
                    [
                        str(n_devices),
                        str(rank) if row.rejected is None else "-",
                        row.name,
                        f"{row.seconds * 1e3:.2f}" if row.seconds is not None else "-",
                        f"{(row.peak_bytes or 0) / 2**20:.1f}",
                        f"{(row.traffic or 0) / 2**20:.1f}",
                        _findings(report),
                        row.rejected or "fits",
                    ]
                )
                plan_records.append(
                    {
                        "devices": n_devices,
                        "strategy": row.name,
                        "rejected": row.rejected,
                        "step_seconds": row.seconds,
                        "communication_seconds": report.communication_seconds if report else None,
                        "compute_seconds": report.compute_seconds if report else None,
                        "peak_bytes": row.peak_bytes,
                        "traffic": row.traffic,
                        "bytes_by_kind": row.bytes_by_kind,
                        "findings": [f.headline() for f in report.findings] if report else [],
                        "bar": None,
                        "verdict": "info",
                    }
                )
    results.table(
        "plans",
        "The LLaMA-shaped step's candidates, ranked (estimates: ms per step, MiB per device)",
        ["devices", "rank", "strategy", "step ms", "peak MiB", "sent MiB", "findings", "verdict"],
        plan_rows,
        {"devices", "rank", "step ms", "peak MiB", "sent MiB"},
        bar=None,
        records=plan_records,
    )
    results.table(
        "scaling",
        f"What planning costs (wall seconds); bars: default candidates at {N_DEVICES} devices "
        f"<= {BAR_SECONDS:g} s, and planning in this process <= {COMPILE_BAR:g} x its compiles",
        [
            "devices",
            "candidates",
            "compiled in",
            "seconds",
            "s per candidate",
            "compiles s",
            "plan / compiles",
            "bar",
        ],
        scaling_rows,
        {"devices", "candidates", "seconds", "s per candidate", "compiles s", "plan / compiles"},
        bar=BAR_SECONDS,
        records=scaling_records,
    )
    results.extra["plan_text"] = texts
    status = _common.exit_status(failed, args.no_fail)
    results.write(N_DEVICES, failed)
    return status


if __name__ == "__main__":
    sys.exit(main())
