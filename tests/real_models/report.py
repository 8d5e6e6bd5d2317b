"""Prints, for each real model, its parameters and what a data-parallel step costs.

``EINSHARD_TEST_DEVICES=8 python -m tests.real_models.report [gemma_lm ...]`` (with the
``real_models`` session's packages installed): the parameter table (path, shape, bytes), then
the step report's headline under data parallelism: collectives, bytes by kind, the bytes each
device sends against the textbook 2(N-1)/N x parameter bytes, and every parameter whose
gradient is reduced more than once; then the derived tensor-parallel table (each rule with its
reason) and where it puts every leaf.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", int(os.environ.get("EINSHARD_TEST_DEVICES", "8")))

import einshard  # noqa: E402
from einshard import strategies  # noqa: E402

from ._common import N_DEVICES, parameter_bytes  # noqa: E402

MODELS = ["gemma_lm", "equimo_vit", "esm2_lm", "gpt2_lm", "mamba2_lm"]


def kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def parameters(real) -> None:
    print("| path | shape | bytes |\n|---|---|---|")
    for row in einshard.explain(real.abstract_params, strategies.data_parallel()).rows:
        print(f"| `{row.path}` | {row.shape} | {row.bytes} |")
    print(
        f"\n{parameter_bytes(real.abstract_params)} parameter bytes in "
        f"{len(jax.tree.leaves(real.abstract_params))} arrays\n"
    )


def data_parallel(real) -> None:
    strategy = strategies.data_parallel()
    params = einshard.shard_pytree(real.params, strategy)
    batch = jax.tree.map(lambda x: einshard.einshard(x, strategy.batch), real.batch)
    report = einshard.explain_step(real.step, params, batch)
    size = parameter_bytes(real.abstract_params)
    textbook = 2 * (N_DEVICES - 1) / N_DEVICES * size
    print(
        f"data parallel, {N_DEVICES} devices: {report.collectives} collective instruction(s), "
        f"{len(report.rows)} rows; bytes by kind {dict(report.bytes_by_kind)}; "
        f"traffic {kib(report.traffic)} per device vs textbook 2(N-1)/N x P = {kib(textbook)} "
        f"(ratio {report.traffic / textbook:.3f})"
    )
    counts = collections.Counter(row.param for row in report.rows if row.kind == "all-reduce")
    twice = {param: n for param, n in counts.items() if param is not None and n > 1}
    unattributed = [row for row in report.rows if row.param is None]
    print(f"  gradients reduced more than once: {twice or 'none'}")
    if unattributed:
        print(f"  rows without a parameter: {[(r.kind, r.shape, r.op_name) for r in unattributed]}")
    print()
    print(report)
    print()


def derived(real) -> None:
    table = strategies.tensor_parallel(step=real.step, params=real.abstract_params, batch=real.abstract_batch)
    print(table)
    print(einshard.explain(real.abstract_params, table))
    print()


def main(names: list[str]) -> None:
    for name in names or MODELS:
        real = importlib.import_module(f"{__package__}.{name}").build()
        print(f"## {name} ({real.package})\n")
        parameters(real)
        data_parallel(real)
        derived(real)


if __name__ == "__main__":
    main(sys.argv[1:])
