"""For the day a GPU is lent: ``report.seconds`` against the measured step time, on one real GPU.

Extends ``../shared/accelerators/gpu_time_mem.py`` (the three bf16 GPT steps) with more shapes:
bf16 and f32, MLP-heavy and attention-heavy, a scan over layers, a step with ``jax.checkpoint``.
For each: the report of the step compiled for one compile-only device of the GPU's kind
(``target=``), and the median of 10 timed runs on the real device after a warm-up. Writes
``gpu_step_time.json`` to the directory given. Not run in CI: it needs a GPU.

    python benchmarks/gpu_step_time.py OUT [h200]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import einshard


def params_of(layers, hidden, mlp, vocabulary, dtype):
    keys = jax.random.split(jax.random.key(0), 4 * layers + 1)

    def normal(key, shape):
        return (jax.random.normal(key, shape) * 0.02).astype(dtype)

    return {
        "embed": normal(keys[0], (vocabulary, hidden)),
        "layers": [
            {
                "qkv": normal(keys[4 * i + 1], (hidden, 3 * hidden)),
                "out": normal(keys[4 * i + 2], (hidden, hidden)),
                "up": normal(keys[4 * i + 3], (hidden, mlp)),
                "down": normal(keys[4 * i + 4], (mlp, hidden)),
            }
            for i in range(layers)
        ],
    }


def block(x, lp, heads, remat):
    def body(x, lp):
        b, s, h = x.shape
        q, k, v = jnp.split(x @ lp["qkv"], 3, -1)
        q, k, v = (t.reshape(b, s, heads, h // heads) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(h // heads)
        w = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(x.dtype)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, h) @ lp["out"]
        return x + jax.nn.gelu(x @ lp["up"]) @ lp["down"]

    return (jax.checkpoint(body) if remat else body)(x, lp)


def loss(p, tok, heads, scan, remat):
    x = p["embed"][tok]
    if scan:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *p["layers"])
        x, _ = jax.lax.scan(lambda x, lp: (block(x, lp, heads, remat), None), x, stacked)
    else:
        for lp in p["layers"]:
            x = block(x, lp, heads, remat)
    logits = (x @ p["embed"].T).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tok[:, 1:, None], -1))


def sgd_step(p, tok, heads, scan=False, remat=False):
    g = jax.grad(loss)(p, tok, heads, scan, remat)
    return jax.tree.map(lambda a, b: a - (1e-3 * b).astype(a.dtype), p, g)


# (name, layers, hidden, MLP, vocabulary, batch, sequence, heads, dtype, scan, remat)
SHAPES = [
    ("gpt 4x1024 bf16", 4, 1024, 4096, 32000, 8, 1024, 16, jnp.bfloat16, False, False),
    ("gpt 8x2048 bf16", 8, 2048, 8192, 32000, 8, 2048, 16, jnp.bfloat16, False, False),
    ("gpt 8x4096 bf16", 8, 4096, 16384, 32000, 4, 2048, 32, jnp.bfloat16, False, False),
    ("mlp-heavy bf16", 4, 2048, 16384, 32000, 8, 512, 16, jnp.bfloat16, False, False),
    ("attention-heavy bf16", 4, 1024, 2048, 32000, 2, 8192, 16, jnp.bfloat16, False, False),
    ("gpt 4x1024 f32", 4, 1024, 4096, 32000, 8, 1024, 16, jnp.float32, False, False),
    ("mlp-heavy f32", 4, 2048, 16384, 32000, 4, 512, 16, jnp.float32, False, False),
    ("scan over 12 layers bf16", 12, 1024, 4096, 32000, 8, 1024, 16, jnp.bfloat16, True, False),
    ("checkpointed layers bf16", 8, 2048, 8192, 32000, 8, 2048, 16, jnp.bfloat16, False, True),
    ("scan + checkpoint bf16", 12, 2048, 8192, 32000, 4, 2048, 16, jnp.bfloat16, True, True),
]


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    target = sys.argv[2] if len(sys.argv) > 2 else "h200"
    results = []
    for name, layers, hidden, mlp, vocabulary, batch, sequence, heads, dtype, scan, remat in SHAPES:
        params = params_of(layers, hidden, mlp, vocabulary, dtype)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocabulary, (batch, sequence)), jnp.int32)
        step = functools.partial(sgd_step, heads=heads, scan=scan, remat=remat)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, tokens))
        report = einshard.explain_step(step, *abstract, target=target, n_devices=1)
        compiled = jax.jit(step)
        jax.block_until_ready(compiled(params, tokens))
        times = []
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, tokens))
            times.append(time.perf_counter() - start)
        stats = jax.devices()[0].memory_stats() or {}
        row = {
            "name": name,
            "report_seconds": report.seconds,
            "measured_s": float(np.median(times)),
            "flops": report.flops,
            "report_peak_bytes": report.peak_bytes,
            "device_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        }
        row["simulated_over_measured"] = row["report_seconds"] / row["measured_s"]
        results.append(row)
        print(json.dumps(row), flush=True)
        del params, compiled
    with open(os.path.join(out, "gpu_step_time.json"), "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
