"""For the day a GPU is lent: a scanned model's step and its unrolled twin, measured on one GPU.

``bench_plan_at_size.py``'s LLaMA-shaped AdamW step at the 1.5 B shape (16 layers, hidden 2048,
MLP 8192, 32 heads, 8 KV heads, vocabulary 128,256) on one sequence of 2,048 tokens (the
per-device share of the 8-way data-parallel step ``scan_step_time.py`` simulates), in both
forms: a ``jax.lax.scan`` over stacked layers under ``jax.checkpoint``, and a Python loop. For
each: the program XLA compiled on the device (``hlo_<form>.txt``, to simulate here) and the
median of 10 timed steps after a warm-up. Writes ``gpu_scan_time.json`` and the two programs to
the directory given. Needs only JAX and optax on the device (no einshard). Not run in CI: it
needs a GPU.

    python benchmarks/gpu_scan_time.py OUT [LAYERS]

On one H200 (JAX 0.11.2, 2026-11-28): 112.6 ms scanned, 85.5 ms unrolled (1.32x; 8 layers:
61.3 and 47.1 ms, 1.30x). Their programs, read here at the H200's figures, are simulated at
86.4 and 62.7 ms (1.38x; 8 layers 47.9 and 36.0 ms, 1.33x); before loops were costed at what they
touch, at 126.6 and 62.9 ms (2.01x; 8 layers 1.60x). The unrolled form then had no
rematerialisation; both forms now rematerialise each layer (the twins differ only in the loop):
on the same H200, 112.4 ms scanned and 103.6 ms unrolled (1.08x), their programs simulated at
86.4 and 75.1 ms (1.15x).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_plan_at_size as models

LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else models.SIZES["1.5b"].layers
SIZE = dataclasses.replace(models.SIZES["1.5b"], layers=LAYERS, batch=1, devices=1)


def concrete(tree, key):
    """Random values for an abstract tree (small normal floats, zero integers)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    values = [
        (jax.random.normal(k, leaf.shape, jnp.float32) * 0.02).astype(leaf.dtype)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
        else jnp.zeros(leaf.shape, leaf.dtype)
        for k, leaf in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, values)


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    rows = []
    for form, scanned in (("scan", True), ("loop", False)):
        step = models.step_scanned if scanned else models.step_unrolled
        state = concrete(models.abstract_state(SIZE, scanned), jax.random.key(0))
        ids = np.random.default_rng(0).integers(0, SIZE.vocab, (SIZE.batch, SIZE.seq))
        tokens = jnp.asarray(ids, jnp.int32)
        start = time.perf_counter()
        compiled = jax.jit(step).lower(state, tokens).compile()
        compile_seconds = time.perf_counter() - start
        with open(os.path.join(out, f"hlo_{form}.txt"), "w") as file:
            file.write(compiled.as_text())
        jax.block_until_ready(compiled(state, tokens))
        times = []
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(compiled(state, tokens))
            times.append(time.perf_counter() - start)
        row = {
            "form": form,
            "layers": SIZE.layers,
            "measured_s": float(np.median(times)),
            "runs_s": times,
            "compile_s": compile_seconds,
            "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del state, compiled
    with open(os.path.join(out, "gpu_scan_time.json"), "w") as file:
        json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
