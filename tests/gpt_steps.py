"""The seven steps of ``../shared/accelerators/gpu_check.py``, copied: a 2-layer GPT (batch 16,
sequence 64, hidden 256, MLP 1024, vocabulary 512, float32, one SGD step) under seven tables.

The programs that XLA's GPU compiler made of them for 8 real H200s are in
``../shared/accelerators/h200x8-jax0.11.2/``; ``tests/test_targets.py`` compiles the same steps
for compile-only devices and compares. Importable (the child process imports the step by name).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import einshard

B, S, H, F, V, L, HEADS = 16, 64, 256, 1024, 512, 2, 8


def gpt_params(fused: bool = False, tied: bool = False) -> dict:
    f32 = jnp.float32
    p: dict = {
        "embed": jax.ShapeDtypeStruct((V, H), f32),
        "ln_f": jax.ShapeDtypeStruct((H,), f32),
        "layers": [],
    }
    if not tied:
        p["head"] = jax.ShapeDtypeStruct((H, V), f32)
    for _ in range(L):
        attn: dict = (
            {"qkv": {"kernel": jax.ShapeDtypeStruct((H, 3, HEADS, H // HEADS), f32)}}
            if fused
            else {n: {"kernel": jax.ShapeDtypeStruct((H, H), f32)} for n in ("query", "key", "value")}
        )
        attn["out"] = {"kernel": jax.ShapeDtypeStruct((H, H), f32)}
        p["layers"].append(
            {
                "ln1": jax.ShapeDtypeStruct((H,), f32),
                "ln2": jax.ShapeDtypeStruct((H,), f32),
                "attn": attn,
                "mlp": {
                    "up": {"kernel": jax.ShapeDtypeStruct((H, F), f32)},
                    "down": {"kernel": jax.ShapeDtypeStruct((F, H), f32)},
                },
            }
        )
    return p


def norm(x, s):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s


def loss(p, tokens):
    x = p["embed"][tokens]
    b, s, h = x.shape
    for lp in p["layers"]:
        y = norm(x, lp["ln1"])
        a = lp["attn"]
        if "qkv" in a:
            q, k, v = jnp.moveaxis(jnp.einsum("bsh,htnd->bstnd", y, a["qkv"]["kernel"]), 2, 0)
        else:
            q, k, v = (
                (y @ a[n]["kernel"]).reshape(b, s, HEADS, h // HEADS) for n in ("query", "key", "value")
            )
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(h // HEADS), -1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, h) @ a["out"]["kernel"]
        y = norm(x, lp["ln2"])
        x = x + jax.nn.gelu(y @ lp["mlp"]["up"]["kernel"]) @ lp["mlp"]["down"]["kernel"]
    head = p["head"] if "head" in p else p["embed"].T
    logits = norm(x, p["ln_f"]) @ head
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))


def step(params, tokens):
    g = jax.grad(loss)(params, tokens)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, params, g)


TOKENS = jax.ShapeDtypeStruct((B, S), jnp.int32)
REPLICATED = einshard.Rules([(".*", "... -> * ...")])
FSDP = einshard.Rules(
    [
        (r"kernel$|embed$|head$", "a b -> a* b"),
        (r"qkv/kernel$", "a t n d -> a* t n d"),
        (".*", "... -> * ..."),
    ]
)
TP = einshard.Rules(
    [
        (r"attn/(query|key|value)/kernel$", "i o -> i o*"),
        (r"attn/qkv/kernel$", "i t n d -> i t n* d"),
        (r"attn/out/kernel$", "i o -> i* o"),
        (r"mlp/up/kernel$", "i o -> i o*"),
        (r"mlp/down/kernel$", "i o -> i* o"),
        (".*", "... -> * ..."),
    ]
)


def adamw_train(tx):
    """An optax step of the GPT on its training state ``(params, opt_state)``, and that state (abstract)."""
    import optax

    params = gpt_params()

    def adamw_step(train, tokens):
        params, opt = train
        grads = jax.grad(loss)(params, tokens)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    return adamw_step, (params, jax.eval_shape(tx.init, params))


def cases(n_devices: int = 8) -> dict[str, tuple[dict, einshard.Rules, str]]:
    """Each step's ``(params, table, batch expression)``; the derived ones for ``n_devices``."""
    derived_tp = einshard.strategies.tensor_parallel(
        step=step, params=gpt_params(), batch=TOKENS, n_devices=n_devices
    )
    derived_hy = einshard.strategies.hybrid(
        4, step=step, params=gpt_params(), batch=TOKENS, n_devices=n_devices
    )
    return {
        "derived_tp": (gpt_params(), derived_tp, derived_tp.batch),
        "derived_hybrid4": (gpt_params(), derived_hy, derived_hy.batch),
        "dp": (gpt_params(), REPLICATED, "b s -> b* s"),
        "dp_tied": (gpt_params(tied=True), REPLICATED, "b s -> b* s"),
        "fsdp": (gpt_params(), FSDP, "b s -> b* s"),
        "tp_unfused": (gpt_params(), TP, "b s -> b s 8"),
        "tp_fused": (gpt_params(fused=True), TP, "b s -> b s 8"),
    }


def table(rules: einshard.Rules, batch: str) -> einshard.Rules:
    """The table with the batch's rule in front, for ``explain_step(step, params, tokens, rules=...)``."""
    return einshard.Rules([(r"^tokens$", batch), *rules.pairs()])
