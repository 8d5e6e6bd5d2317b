"""Published training runs of 70 B LLaMA-shaped models under FSDP, simulated against their measured step.

    python benchmarks/published_runs.py [--only NAME ...] [--json PATH]

Each run is the plain-JAX LLaMA AdamW step of ``bench_plan_at_size.py`` (LLaMA-2-70B's shape:
hidden 8192, MLP 28672, 80 layers, 64 heads, 8 KV heads; bfloat16 weights, AdamW's moments in
float32; its layers a ``jax.lax.scan``, each under ``jax.checkpoint``; its attention a block of
1,024 queries at a time, ``step_scanned_blocked``, as a flash attention kernel skips the masked
blocks) with two sequences per device, explained under FSDP on its target::

    einshard.explain_step(step, state, batch, rules=einshard.strategies.fsdp(),
                          n_devices=N, target='h100')

- ``64xh100-4k``: 64 H100s (8 hosts), 128 sequences of 4,096 tokens; published step 7.0 s
  (52.6 % of the bf16 peak).
- ``128xh100-8k``: 128 H100s (16 hosts), 256 sequences of 8,192 tokens (whole, a layer's scores
  would not fit); published 15.6 s.
- ``256xh200-8k``: 256 H200s (32 hosts), 512 sequences of 8,192 tokens; published 15.5 s.

The published step times are those of issue 50's table (measured runs of that size under FSDP);
the goal is a simulated step within 1.5 times the measured one. Prints, per run, the simulated
step, its compute, its exposed and hidden communication, the bytes each device sends, the peak
memory, the links the report assumed, and simulated / published. Each explain compiles in a
child process (20-60 s each on 2 cores, under 1 GiB); not a ``bench_*.py``, so
``nox -s benchmarks`` does not run it.

Measured (2 cores, loaded; the cost page's "Across hosts" has the table): 9.04 s against 7.0
(1.29x; compute 8.73 s, 0.31 s exposed), 21.72 against 15.6 (1.39x; compute 21.57 s, 0.15 s
exposed), 18.78 against 15.5 (1.21x; compute 18.52 s, 0.26 s exposed). Before a collective
across hosts ran on all of its hosts' NICs (every one at one NIC's 50 GB/s): 13.95 s (5.21 s
exposed), 25.56 s (3.99 s) and 23.08 s (4.56 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import _common

if __name__ == "__main__":
    _common.start(re_exec=False, cpu_devices=1)

import bench_plan_at_size as models


@dataclasses.dataclass(frozen=True)
class Run:
    """A published run: the model's size and batch, its devices, its attention, its measured step."""

    size: models.Size
    target: str
    blocked: bool
    published_seconds: float


def _70b(devices: int, sequence: int) -> models.Size:
    # One token more than the sequence: the step predicts tokens[:, 1:] from tokens[:, :-1].
    return models.Size(8192, 28672, 80, 64, 8, batch=2 * devices, devices=devices, seq=sequence + 1)


RUNS = {
    "64xh100-4k": Run(_70b(64, 4096), "h100", blocked=True, published_seconds=7.0),
    "128xh100-8k": Run(_70b(128, 8192), "h100", blocked=True, published_seconds=15.6),
    "256xh200-8k": Run(_70b(256, 8192), "h200", blocked=True, published_seconds=15.5),
}
GOAL = 1.5


def explain(name: str) -> dict:
    """One run's FSDP report on its target, as numbers."""
    import einshard

    run = RUNS[name]
    step = models.step_scanned_blocked if run.blocked else models.step_scanned
    state, batch = models.abstract_state(run.size, scanned=True), models.abstract_batch(run.size)
    start = time.perf_counter()
    report = einshard.explain_step(
        step,
        state,
        batch,
        rules=einshard.strategies.fsdp(),
        n_devices=run.size.devices,
        target=run.target,
    )
    assert report.seconds is not None and report.hardware is not None
    links = report.figures.links if report.figures is not None else None
    return {
        "name": name,
        "devices": run.size.devices,
        "target": run.target,
        "batch": run.size.batch,
        "sequence": run.size.seq - 1,
        "blocked": run.blocked,
        "published_seconds": run.published_seconds,
        "seconds": report.seconds,
        "compute_seconds": report.compute_seconds,
        "exposed_seconds": report.exposed_seconds,
        "hidden_seconds": report.hidden_seconds,
        "sent_bytes": report.traffic,
        "peak_bytes": report.peak_bytes,
        "memory_bytes": report.hardware.memory_bytes,
        "model_flops_utilisation": report.model_flops_utilisation,
        "links": links.assumed() if links is not None else None,
        "ratio": report.seconds / run.published_seconds,
        "wall_seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures to PATH")
    args = parser.parse_args(argv)
    records = []
    for name in args.only or list(RUNS):
        record = explain(name)
        records.append(record)
        print(
            f"{name}: simulated {record['seconds']:.2f} s against {record['published_seconds']:.1f} s "
            f"published ({record['ratio']:.2f}x; goal within {GOAL}x): compute "
            f"{record['compute_seconds']:.2f} s, communication {record['exposed_seconds']:.2f} s exposed "
            f"and {record['hidden_seconds']:.2f} s hidden; sent {record['sent_bytes'] / 2**30:.0f} GiB, "
            f"peak {record['peak_bytes'] / 2**30:.1f} of {record['memory_bytes'] / 2**30:.1f} GiB per "
            f"device; MFU {record['model_flops_utilisation']:.1%}; links: {record['links']}; "
            f"{record['wall_seconds']:.0f} s to compile and read",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
