"""Deriving a tensor-parallel table from a step's dataflow, against compiling that step once.

    python benchmarks/bench_roles.py [--reps N] [--no-fail] [--json PATH]

The step is a 32-layer LLaMA-shaped training step (embedding, RMS norms, q/k/v/o attention
projections, a gated MLP, LM head, cross-entropy, plain SGD), with its layers unrolled (a
parameter tree of 291 leaves, the layers under ``layers/0`` to ``layers/31``) and with its
layers stacked and run by ``jax.lax.scan`` (12 leaves with a leading layer axis). For each:

* **derive**: ``einshard.strategies.tensor_parallel(step=step, params=params, batch=batch)``:
  tracing the step on abstract inputs (``jax.make_jaxpr``), reading every weight's role and
  building the table;
* **compile**: ``jax.jit(step).lower(params, batch).compile()`` for the parameters laid out by
  that table, as ``einshard.plan`` compiles each candidate (tracing included).

Each measurement runs in a fresh process (``_common.run_child``), so that neither pays for the
other's warm caches (JAX keeps the traced ``jnp.einsum`` and friends): the first call of a
process, as a user's first ``plan`` is. The bar: derive < compile (ratio < 1), by the median
of the per-repetition ratios, measured in the same run.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common

N_DEVICES = 8
LAYERS, D_MODEL, HEADS, FFN, VOCAB = 32, 256, 8, 688, 1024
BATCH, SEQUENCE = 8, 64
BAR = 1.0


def _model(stacked: bool) -> tuple[Any, Any, Any]:
    """The step, its abstract parameters and batch."""
    import jax
    import jax.numpy as jnp

    def f32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    def layer(lead: tuple[int, ...]) -> dict[str, Any]:
        attn = {f"{n}_proj": {"kernel": f32(*lead, D_MODEL, D_MODEL)} for n in "qkvo"}
        mlp = {
            "gate_proj": {"kernel": f32(*lead, D_MODEL, FFN)},
            "up_proj": {"kernel": f32(*lead, D_MODEL, FFN)},
            "down_proj": {"kernel": f32(*lead, FFN, D_MODEL)},
        }
        return {
            "attn": attn,
            "mlp": mlp,
            "attention_norm": {"scale": f32(*lead, D_MODEL)},
            "ffn_norm": {"scale": f32(*lead, D_MODEL)},
        }

    layers = layer((LAYERS,)) if stacked else {str(i): layer(()) for i in range(LAYERS)}
    params = {
        "embed": {"embedding": f32(VOCAB, D_MODEL)},
        "layers": layers,
        "final_norm": {"scale": f32(D_MODEL)},
        "lm_head": {"kernel": f32(D_MODEL, VOCAB)},
    }

    def norm(x: Any, scale: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

    def block(x: Any, p: Any) -> Any:
        b, s, _ = x.shape
        h = norm(x, p["attention_norm"]["scale"])
        q, k, v = ((h @ p["attn"][f"{n}_proj"]["kernel"]).reshape(b, s, HEADS, -1) for n in "qkv")
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D_MODEL // HEADS) ** 0.5, -1)
        x = (
            x
            + jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, D_MODEL) @ p["attn"]["o_proj"]["kernel"]
        )
        h = norm(x, p["ffn_norm"]["scale"])
        mlp = p["mlp"]
        gated = jax.nn.silu(h @ mlp["gate_proj"]["kernel"]) * (h @ mlp["up_proj"]["kernel"])
        return x + gated @ mlp["down_proj"]["kernel"]

    def loss(p: Any, tokens: Any) -> Any:
        x = p["embed"]["embedding"][tokens[:, :-1]]
        if stacked:
            x, _ = jax.lax.scan(lambda x, layer: (block(x, layer), None), x, p["layers"])
        else:
            for i in range(LAYERS):
                x = block(x, p["layers"][str(i)])
        logits = norm(x, p["final_norm"]["scale"]) @ p["lm_head"]["kernel"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    def step(p: Any, tokens: Any) -> Any:
        grads = jax.grad(loss)(p, tokens)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads)

    return step, params, jax.ShapeDtypeStruct((BATCH, SEQUENCE + 1), jnp.int32)


def _child(what: str, stacked: bool) -> dict[str, Any]:
    """One measurement in this (fresh) process: ``derive`` or ``compile``."""
    import jax

    import einshard

    step, params, batch = _model(stacked)
    if what == "derive":
        start = time.perf_counter()
        table = einshard.strategies.tensor_parallel(step=step, params=params, batch=batch)
        seconds = time.perf_counter() - start
        split = einshard.strategies.roles(step, params, batch).split_share
        return {
            "seconds": seconds,
            "rules": len(table),
            "leaves": len(jax.tree.leaves(params)),
            "split": split,
        }
    # The table the compile is for: derived in this process too, outside the clock.
    table = einshard.strategies.tensor_parallel(step=step, params=params, batch=batch)
    shardings = einshard.pytree_shardings(params, table)
    args = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), params, shardings)

    def fresh(p: Any, tokens: Any) -> Any:  # a new function: nothing of the derivation's jit caches
        return step(p, tokens)

    start = time.perf_counter()
    jax.jit(fresh).lower(args, batch).compile()
    return {"seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__, reps=3, seconds=0.0, warmup=0, runs="pairs")
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1] == "scanned")))
        return 0
    results = _common.Results(Path(__file__).name, args)
    if not _common.has_devices(N_DEVICES):
        return 2
    print(_common.environment(N_DEVICES))
    script = str(Path(__file__).resolve())
    rows, records = [], []
    failed = False
    for layout in ("unrolled", "scanned"):
        derive, compile_, ratios = [], [], []
        info: dict[str, Any] = {}
        for rep in range(args.warmup + args.reps):
            # Alternate which goes first, so that a machine busy at one moment weighs on both.
            order = ("derive", "compile") if rep % 2 == 0 else ("compile", "derive")
            got = {what: _common.run_child(script, ["--child", what, layout], None, 1800) for what in order}
            if rep < args.warmup:
                continue
            info = got["derive"]
            derive.append(got["derive"]["seconds"])
            compile_.append(got["compile"]["seconds"])
            ratios.append(got["derive"]["seconds"] / got["compile"]["seconds"])
        ratio = statistics.median(ratios)
        ok = ratio < BAR
        failed |= not ok
        rows.append(
            [
                layout,
                str(info["leaves"]),
                str(info["rules"]),
                f"{info['split']:.0%}",
                f"{statistics.median(derive):.2f}",
                f"{statistics.median(compile_):.2f}",
                f"{ratio:.2f}",
                _common.verdict(ok),
            ]
        )
        records.append(
            {
                "layout": layout,
                "leaves": info["leaves"],
                "rules": info["rules"],
                "split_share": info["split"],
                "derive_seconds": statistics.median(derive),
                "compile_seconds": statistics.median(compile_),
                "ratio": ratio,
                "ratios": ratios,
                "bar": BAR,
                "verdict": _common.verdict(ok),
            }
        )
    results.table(
        "derive",
        f"Deriving the tensor-parallel table of a {LAYERS}-layer LLaMA-shaped step vs compiling it once "
        f"({N_DEVICES} devices, fresh processes; bar: ratio < {BAR:g})",
        ["layers", "leaves", "rules", "split", "derive s", "compile s", "ratio", "bar"],
        rows,
        {"leaves", "rules", "split", "derive s", "compile s", "ratio"},
        bar=BAR,
        records=records,
    )
    status = _common.exit_status(failed, args.no_fail)
    results.write(N_DEVICES, failed)
    return status


if __name__ == "__main__":
    _common.start(re_exec=False, cpu_devices=N_DEVICES)
    sys.exit(main())
