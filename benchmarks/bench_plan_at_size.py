"""Plans at size: LLaMA-shaped AdamW steps of 1.5 B, 8 B and 70 B parameters planned for H100s.

    python benchmarks/bench_plan_at_size.py [--quick] [--only NAME ...] [--no-fail] [--json PATH]

The steps are written here in plain JAX (no ``transformers``): RMSNorm, rotary embeddings,
grouped-query attention, a SwiGLU MLP, an untied embedding and head, and AdamW (optax) with its
moments in float32 beside bfloat16 parameters, the train state in the step's first argument
(``state = {'params': ..., 'opt_state': ...}``) and the batch ``int32[B, S]`` tokens. Everything is
abstract (``jax.ShapeDtypeStruct``): nothing is allocated. Each model comes in two forms, each
layer rematerialised with ``jax.checkpoint`` in both (as serious JAX LLM code writes it): its
layers **unrolled** (a Python loop over a list of layers) and **scanned** (``jax.lax.scan`` over
weights stacked on a leading layer axis).

Sizes (hidden, MLP, layers, heads, KV heads, vocabulary 128,256, sequences of 2,048 tokens):

- ``1.5b``: 2048, 8192, 16, 32, 8; batch 8; on 8 H100s.
- ``8b``: LLaMA-3-8B's shape, 4096, 14336, 32, 32, 8; batch 64; on 64 H100s.
- ``70b``: 8192, 28672, 80, 64, 8; batch 256; on 256 H100s; scanned only.
- ``70b64``: the same 70 B model, batch 64, on 64 H100s; scanned only.
- ``70b64-4k``: the same 70 B model on 64 H100s (8 hosts) as published runs train it: batch 128 of
  4,096 tokens, scanned, its attention a block of 1,024 queries at a time (``blocked``, as a flash
  attention kernel skips the masked blocks); each candidate's exposed communication recorded.

For each: ``einshard.plan(step, state, batch, n_devices=N, target='h100')`` with the default
candidates, its wall time, the sum of its candidates' compiles (``report.compile_seconds``), their
ratio, the peak memory of the child process that compiled them (``RUSAGE_CHILDREN``), and the
plan's answer: the winner, and the rejected candidates with why (a candidate whose arguments alone
exceed the H100's 80 GB is rejected without a compile). Each plan runs in a fresh process of this
script (``--one NAME``), so that its child's peak is its own.

Bars, on the 2-core machine the figures are measured on: the 1.5 B plan for 8 H100s (scanned) in
at most 60 s, the 8 B plan for 64 (scanned) in at most 300 s. ``--quick`` (what
``nox -s benchmarks_quick`` runs): the 1.5 B scanned plan only. ``--only NAME`` plans the named
ones (``1.5b-scan``, ``1.5b-loop``, ``8b-scan``, ``8b-loop``, ``70b-scan``, ``70b64-scan``,
``70b64-4k-blocked``);
``--candidates K`` plans the first K default candidates only (a bound for the 70 B one on a
small machine).

What a scanned plan must show (``checks`` in the results; each reported, a miss fails the run
like a bar): the batch kept split inside the loop, so that the scanned form is the program its
unrolled twin is:

- 1.5 B on 8: scanned FSDP within 1.2 times unrolled FSDP in simulated time and in bytes sent;
- 8 B on 64: scanned FSDP fits, and sends at most 1.1 x 3 x the weights' bytes x (N - 1) / N per
  device per step (FSDP's own traffic: the weights gathered twice, their gradients
  reduce-scattered once);
- 70 B on 256: FSDP and at least one hybrid fit, and the plan's first candidate fits;
- 70 B on 64: FSDP fits.
- 70 B on 64 at 4 k tokens: FSDP first, or within the tie band of the first (its collectives
  across the 8 hosts run on all of their NICs: ``_cost/hardware/_links.py``).

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import _common
import _hf_llama

if __name__ == "__main__":
    _common.start(re_exec=False, cpu_devices=1)

import jax
import jax.numpy as jnp
import optax

BARS = {"1.5b-scan": 60.0, "8b-scan": 300.0, "hf-1.5b": 60.0, "hf-8b": 300.0}
TARGET = "h100"
OPTIMIZER = optax.adamw(1e-4)


Size = _hf_llama.Size  # one LLaMA shape for both models


SIZES = {
    "1.5b": Size(2048, 8192, 16, 32, 8, batch=8, devices=8),
    "8b": Size(4096, 14336, 32, 32, 8, batch=64, devices=64),
    "70b": Size(8192, 28672, 80, 64, 8, batch=256, devices=256),
    "70b64": Size(8192, 28672, 80, 64, 8, batch=64, devices=64),  # 70 B on 64 H100s, one sequence each
    # As published runs train it: two sequences of 4,096 tokens per device (and one to predict from).
    "70b64-4k": Size(8192, 28672, 80, 64, 8, batch=128, devices=64, seq=4097),
}
RUNS = (
    "1.5b-scan",
    "1.5b-loop",
    "8b-scan",
    "8b-loop",
    "70b-scan",
    "70b64-scan",
    "70b64-4k-blocked",
    *_hf_llama.SIZES,
)
# The runs whose checks (scanned_checks) read given candidates' figures: every candidate compiled.
EXHAUSTIVE = {"1.5b-scan", "1.5b-loop", "8b-scan", "70b-scan", "70b64-scan", "70b64-4k-blocked"}
STEPS = {"scan": "step_scanned", "loop": "step_unrolled", "blocked": "step_scanned_blocked"}


# --- the model, in plain JAX ------------------------------------------------------------------------


def _layer_shapes(size: Size) -> dict[str, tuple[int, ...]]:
    h, d = size.hidden, size.head_dim
    return {
        "attention_norm": (h,),
        "wq": (h, size.heads, d),
        "wk": (h, size.kv_heads, d),
        "wv": (h, size.kv_heads, d),
        "wo": (size.heads, d, h),
        "mlp_norm": (h,),
        "w_gate": (h, size.mlp),
        "w_up": (h, size.mlp),
        "w_down": (size.mlp, h),
    }


def abstract_state(size: Size, scanned: bool) -> dict:
    """``{'params': ..., 'opt_state': ...}``: bfloat16 parameters, AdamW's moments in float32."""

    def leaf(shape: tuple[int, ...], dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    shapes = _layer_shapes(size)
    if scanned:
        layers: object = {name: leaf((size.layers, *shape)) for name, shape in shapes.items()}
    else:
        layers = [{name: leaf(shape) for name, shape in shapes.items()} for _ in range(size.layers)]
    params = {
        "embed": leaf((size.vocab, size.hidden)),
        "layers": layers,
        "final_norm": leaf((size.hidden,)),
        "lm_head": leaf((size.hidden, size.vocab)),
    }
    # The moments of float32 copies: AdamW's state in float32 beside bfloat16 weights.
    float32 = jax.tree.map(lambda p: leaf(p.shape, jnp.float32), params)
    return {"params": params, "opt_state": jax.eval_shape(OPTIMIZER.init, float32)}


def abstract_batch(size: Size) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((size.batch, size.seq), jnp.int32)


def _rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def _rotary(x):
    """Rotary position embedding of ``x[B, S, heads, d]`` (angles from the positions, not parameters)."""
    s, d = x.shape[1], x.shape[-1]
    frequencies = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * frequencies[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _attention(q, k, v, offset: int = 0):
    """Causal attention of the queries ``q[b, s, kv, g, d]`` (positions ``offset ...``) over ``k``, ``v``."""
    s, t, d = q.shape[1], k.shape[1], q.shape[-1]
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    causal = (offset + jnp.arange(s))[:, None] >= jnp.arange(t)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", weights, v)


def _blocked_attention(q, k, v, block: int):
    """The same, a block of ``block`` queries at a time over the keys up to its last one.

    Each block's scores are a temporary of its own (``block`` by the keys before it), so no
    ``s`` by ``s`` array of scores is ever whole, and the keys after a block are not read (as
    a flash attention kernel skips the masked blocks).
    """
    s = q.shape[1]
    blocks = []
    for start in range(0, s, block):
        end = min(start + block, s)
        blocks.append(_attention(q[:, start:end], k[:, :end], v[:, :end], offset=start))
    return jnp.concatenate(blocks, axis=1)


def _layer(x, p, block: int | None = None):
    b, s, _ = x.shape
    kv_heads, d = p["wk"].shape[1], p["wk"].shape[2]
    group = p["wq"].shape[1] // kv_heads
    y = _rms_norm(x, p["attention_norm"])
    q = _rotary(jnp.einsum("bsh,hnd->bsnd", y, p["wq"])).reshape(b, s, kv_heads, group, d)
    k = _rotary(jnp.einsum("bsh,hnd->bsnd", y, p["wk"]))
    v = jnp.einsum("bsh,hnd->bsnd", y, p["wv"])
    whole = block is None or block >= s
    attended = _attention(q, k, v) if whole else _blocked_attention(q, k, v, block)
    attended = attended.reshape(b, s, kv_heads * group, d)
    x = x + jnp.einsum("bsnd,ndh->bsh", attended, p["wo"])
    y = _rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


def _loss(params, tokens, scanned: bool, block: int | None = None):
    x = params["embed"][tokens[:, :-1]]
    # Each layer rematerialised in the backward pass, as LLM code does at these sizes, in both
    # forms: the two are the same program but for the loop. (Without it, XLA keeps every layer's
    # activations: the scanned 1.5 B step's FSDP peak on 8 H100s is 170 GiB, 3.7 GiB with.)
    layer = jax.checkpoint(_layer if block is None else functools.partial(_layer, block=block))
    if scanned:
        x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = layer(x, p)
    logits = (_rms_norm(x, params["final_norm"]) @ params["lm_head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _adamw_step(state, tokens, scanned: bool, block: int | None = None):
    loss, grads = jax.value_and_grad(_loss)(state["params"], tokens, scanned, block)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss


def step_scanned(state, batch):
    """One AdamW step, the layers a ``jax.lax.scan`` over stacked weights."""
    return _adamw_step(state, batch, scanned=True)


def step_unrolled(state, batch):
    """One AdamW step, the layers a Python loop."""
    return _adamw_step(state, batch, scanned=False)


ATTENTION_BLOCK = 1024  # queries per block of step_scanned_blocked's attention


def step_scanned_blocked(state, batch):
    """One AdamW step, the layers scanned, attention a block of 1,024 queries at a time.

    What long sequences need: at 8 k tokens, a whole layer's scores are 34 GB per sequence in
    float32; a block's are an eighth of that, and the keys after a block are not read.
    """
    return _adamw_step(state, batch, scanned=True, block=ATTENTION_BLOCK)


def parameter_count(size: Size) -> int:
    per_layer = sum(math.prod(s) for s in _layer_shapes(size).values())
    return per_layer * size.layers + 2 * size.vocab * size.hidden + size.hidden


# --- one plan, in a fresh process -------------------------------------------------------------------


def one(name: str, n_candidates: int | None, exhaustive: bool = False, sample: bool = False) -> dict:
    """Plans one model in this process; its figures as a dict (the last line printed, as JSON)."""
    import einshard

    if name in _hf_llama.SIZES:  # Hugging Face's Flax LLaMA: its own module
        step, devices, parameters = _hf_llama.step(name), _hf_llama.SIZES[name].devices, None
        state, batch = _hf_llama.abstract_state(name), _hf_llama.abstract_batch(name)
    else:
        model, form = name.rsplit("-", 1)
        size = SIZES[model]
        step = globals()[STEPS[form]]
        state, batch = abstract_state(size, form != "loop"), abstract_batch(size)
        devices, parameters = size.devices, parameter_count(size)
    candidates = None
    start = time.perf_counter()
    if n_candidates is not None:
        candidates = einshard.strategies.defaults(devices, step=step, params=state, batch=batch)
        candidates = candidates[:n_candidates]
    exhaustive = exhaustive or name in EXHAUSTIVE
    plan = einshard.plan(
        step,
        state,
        batch,
        n_devices=devices,
        target=TARGET,
        candidates=candidates,
        exhaustive=exhaustive,
        sample=sample,
    )
    wall = time.perf_counter() - start
    timings = plan.timings
    compiles = sum(row.report.compile_seconds for row in plan.rows if row.report is not None)
    analysis = sum(row.report.analysis_seconds for row in plan.rows if row.report is not None)
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    usable = plan.usable
    rank = {row.name: position for position, row in enumerate(usable, 1)}
    if parameters is None:
        parameters = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state["params"]))
    return {
        "name": name,
        "parameters": parameters,
        "devices": devices,
        "exhaustive": exhaustive,
        "candidates": len(plan.rows),
        "compiled": sum(row.report is not None for row in plan.rows),
        # A plan from a few layers: its compiles at small depths, and its footer's line.
        "samples": timings.samples,
        "sampling": plan.sampling,
        "breakdown": {
            "child_start": timings.child_start,
            "tracing": timings.tracing,
            "roles": timings.roles,
            "bounds": timings.bounds,
            "compiles": timings.compiles,
            "reading": timings.reading,
            "other": timings.other,
        },
        "child_peak_bytes_reported": timings.child_peak_bytes,
        "children": timings.children,
        "seconds": wall,
        "compile_seconds": compiles,
        "analysis_seconds": analysis,
        "plan_over_compiles": wall / compiles if compiles else None,
        "child_peak_bytes": child_peak,
        "parent_peak_bytes": own_peak,
        "winner": usable[0].name if usable else None,
        "weight_bytes": sum(
            math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves(state["params"])
        ),
        "rows": [
            {
                "strategy": row.name,
                "rejected": row.rejected,
                "rejected_for": row.rejected_for,
                "compile_seconds": row.report.compile_seconds if row.report is not None else None,
                "analysis_seconds": row.report.analysis_seconds if row.report is not None else None,
                "bound_seconds": row.bounds.seconds if row.bounds is not None else None,
                "bound_memory_bytes": row.bounds.memory_bytes if row.bounds is not None else None,
                "peak_bytes": row.peak_bytes,
                "step_seconds": row.seconds,
                "compute_seconds": row.report.compute_seconds if row.report is not None else None,
                "exposed_seconds": row.report.exposed_seconds if row.report is not None else None,
                "rank": rank.get(row.name),
                "sent_bytes": row.traffic,
                # Extrapolated from the samples; against the whole compile where there is one.
                "extrapolated_seconds": None if row.extrapolated is None else row.extrapolated.measure,
                "extrapolated_least_seconds": None if row.extrapolated is None else row.extrapolated.least,
                "extrapolated_peak_bytes": None if row.extrapolated is None else row.extrapolated.peak_bytes,
                "loops_kept": sum(bool(loop.constrained) for loop in row.report.batch_loops)
                if row.report is not None
                else None,
            }
            for row in plan.rows
        ],
        "plan_text": str(plan),
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__, reps=1, seconds=0.0, warmup=0, runs="runs")
    parser.add_argument("--quick", action="store_true", help="the 1.5 B scanned plan only (for CI)")
    parser.add_argument("--only", nargs="+", choices=RUNS, help="plan these only")
    parser.add_argument("--candidates", type=int, help="the first K default candidates only")
    parser.add_argument("--exhaustive", action="store_true", help="compile every candidate (no pruning)")
    parser.add_argument(
        "--sample", action="store_true", help="plan(sample=True): each candidate at 2 and 3 layers first"
    )
    parser.add_argument("--one", choices=RUNS, help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.candidates, args.exhaustive, args.sample)))
        return 0
    results = _common.Results(Path(__file__).name, args)
    print(_common.environment(1))
    names = ["1.5b-scan", "hf-tiny"] if args.quick else list(args.only or [r for r in RUNS if r != "hf-tiny"])
    missing = _hf_llama.available()
    if missing is not None and any(name in _hf_llama.SIZES for name in names):
        print(f"Hugging Face's Flax LLaMA left out: {missing}")
        names = [name for name in names if name not in _hf_llama.SIZES]
    failed = False
    rows, records = [], []
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for name in names:
        extra = ["--candidates", str(args.candidates)] if args.candidates else []
        extra += ["--exhaustive"] if args.exhaustive else []
        extra += ["--sample"] if args.sample else []
        figures = _common.run_child(__file__, ["--one", name, *extra], env, timeout=4 * 3600)
        bar = BARS.get(name) if not (args.candidates or args.exhaustive) else None
        ok = bar is None or figures["seconds"] <= bar
        failed |= not ok
        rejected = [f"{row['strategy']}: {row['rejected']}" for row in figures["rows"] if row["rejected"]]
        print(f"\n{name}:\n{figures['plan_text']}")
        rows.append(
            [
                name,
                f"{figures['parameters'] / 1e9:.2f}",
                str(figures["devices"]),
                f"{figures['compiled']}/{figures['candidates']}",
                f"{figures['seconds']:.1f}",
                f"{figures['compile_seconds']:.1f}",
                f"{figures['plan_over_compiles']:.2f}" if figures["plan_over_compiles"] else "-",
                f"{figures['breakdown']['child_start']:.1f}",
                f"{sum(figures['breakdown'][part] for part in ('tracing', 'roles', 'bounds')):.1f}",
                f"{figures['breakdown']['reading']:.1f}",
                f"{figures['child_peak_bytes'] / 2**30:.1f}",
                figures["winner"] or "-",
                str(len(rejected)),
                "-" if bar is None else _common.verdict(ok),
            ]
        )
        records.append(
            {
                **{k: v for k, v in figures.items() if k != "plan_text"},
                "bar": bar,
                "rejected": rejected,
                "verdict": "info" if bar is None else _common.verdict(ok),
            }
        )
        results.extra.setdefault("plan_text", {})[name] = figures["plan_text"]
    results.table(
        "plans",
        f"Plans at size for {TARGET.upper()}s (wall seconds; compiled/candidates; child peak GiB); bars: "
        + ", ".join(f"{k} <= {v:g} s" for k, v in BARS.items()),
        [
            "model",
            "params B",
            "devices",
            "compiled",
            "plan s",
            "compiles s",
            "plan / compiles",
            "child start s",
            "trace, roles, bounds s",
            "reading s",
            "child peak GiB",
            "winner",
            "rejected",
            "bar",
        ],
        rows,
        {
            "params B",
            "devices",
            "plan s",
            "compiles s",
            "plan / compiles",
            "child start s",
            "trace, roles, bounds s",
            "reading s",
            "child peak GiB",
            "rejected",
        },
        bar=None,
        records=records,
    )
    checks = scanned_checks({record["name"]: record for record in records})
    for check in checks:
        print(f"{'ok  ' if check['ok'] else 'MISS'} {check['check']}: {check['measured']}")
    failed |= not all(check["ok"] for check in checks)
    results.extra["checks"] = checks
    status = _common.exit_status(failed, args.no_fail)
    results.write(1, failed)
    return status


def _row(record: dict, strategy: str) -> dict | None:
    return next((row for row in record["rows"] if row["strategy"] == strategy), None)


def scanned_checks(records: dict[str, dict]) -> list[dict]:
    """What the scanned plans must show (the module's docstring), for the runs there are."""
    checks = []

    def add(check: str, ok: bool, measured: str) -> None:
        checks.append({"check": check, "ok": bool(ok), "measured": measured})

    scan, loop = records.get("1.5b-scan"), records.get("1.5b-loop")
    if scan and loop:
        a, b = _row(scan, "fsdp"), _row(loop, "fsdp")
        if a and b and a["step_seconds"] and b["step_seconds"]:
            time, sent = a["step_seconds"] / b["step_seconds"], a["sent_bytes"] / b["sent_bytes"]
            add(
                "1.5b on 8: scanned fsdp within 1.2x of unrolled fsdp (time, sent)",
                time <= 1.2 and sent <= 1.2,
                f"time {time:.2f}x, sent {sent:.2f}x",
            )
    record = records.get("8b-scan")
    if record:
        fsdp = _row(record, "fsdp")
        n = SIZES["8b"].devices
        bound = 1.1 * 3 * record["weight_bytes"] * (n - 1) / n
        fits = fsdp is not None and fsdp["rejected"] is None
        sent = fsdp["sent_bytes"] if fsdp and fsdp["sent_bytes"] is not None else float("inf")
        add(
            "8b on 64: scanned fsdp fits and sends <= 1.1 x 3 x weights x (N-1)/N",
            fits and sent <= bound,
            f"{'fits' if fits else 'rejected'}, sent {sent / 2**30:.1f} GiB <= {bound / 2**30:.1f} GiB",
        )
    record = records.get("70b-scan")
    if record:
        fitting = [row["strategy"] for row in record["rows"] if row["rejected"] is None]
        first = record["rows"][0]
        add(
            "70b on 256: fsdp and a hybrid fit, the first candidate fits",
            "fsdp" in fitting
            and any(name.startswith("hybrid") for name in fitting)
            and first["rejected"] is None,
            f"fitting: {', '.join(fitting) or 'none'}; first: {first['strategy']}",
        )
    record = records.get("70b64-scan")
    if record:
        fsdp = _row(record, "fsdp")
        add(
            "70b on 64: fsdp fits",
            fsdp is not None and fsdp["rejected"] is None,
            f"fsdp: {fsdp['rejected'] or 'fits'}" if fsdp else "fsdp: not planned",
        )
    record = records.get("70b64-4k-blocked")
    if record:
        fsdp, first = _row(record, "fsdp"), record["rows"][0]
        tie = 1.02  # the plan's tie band (Plan.tie)
        ties = (
            fsdp is not None
            and fsdp["step_seconds"] is not None
            and first["step_seconds"] is not None
            and fsdp["step_seconds"] <= first["step_seconds"] * tie
        )
        add(
            "70b on 64 at 4k: fsdp first, or within the tie band of the first",
            ties,
            f"fsdp ranked {fsdp['rank'] if fsdp else '-'} at "
            f"{fsdp['step_seconds'] if fsdp else float('nan'):.2f} s; first: {first['strategy']} at "
            f"{first['step_seconds'] or float('nan'):.2f} s",
        )
    return checks


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
