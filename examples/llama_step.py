"""What a LLaMA-shaped training step costs under four rule tables, on 8 devices and planned for 64.

The model is a small LLaMA-shaped transformer (the tree of ``examples/llama_rules.py``: embedding,
stacked attention and MLP kernels, norm scales, LM head) with a plain SGD step. Four rule tables,
all ordinary ``einshard`` rules, shard it:

* ``data parallel``: weights replicated, the batch split over all devices;
* ``FSDP``: every weight split on its largest axis over all devices, the batch too;
* ``tensor parallel``: Megatron-style column / row splits over all devices, the batch replicated;
* ``hybrid``: the table of ``examples/llama_rules.py`` (tensor axis 4 ways, ``d_model`` over the
  rest), the batch over all devices.

``einshard.explain_step`` compiles the step for each (``n_devices=64`` in a child process with 64
simulated CPU devices) and prints what each costs. Run with ``python examples/llama_step.py``;
``benchmarks/bench_step.py`` writes the same numbers for the documentation's plot.
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from typing import Any

import jax
import jax.numpy as jnp

import einshard

VOCAB, D_MODEL, HEADS, FFN, LAYERS = 1024, 256, 8, 768, 4  # every split axis divides by 64
BATCH, SEQ = 64, 64

STRATEGIES: dict[str, list[tuple[str, str]]] = {
    "data parallel": [(r"^batch", "b s -> b* s"), (r".*", "... -> * ...")],
    "FSDP": [
        (r"^batch", "b s -> b* s"),
        (r"embed/embedding$", "v d -> v* d"),
        (r"attn/(q|k|v|o)_proj/kernel$", "... a b -> ... a* b"),
        (r"mlp/(gate|up)_proj/kernel$", "... d f -> ... d f*"),
        (r"mlp/down_proj/kernel$", "... f d -> ... f* d"),
        (r"lm_head/kernel$", "d v -> d v*"),
        (r".*", "... -> * ..."),
    ],
    "tensor parallel": [
        (r"^batch", "... -> * ..."),
        (r"embed/embedding$", "v d -> v d*"),
        (r"attn/(q|k|v)_proj/kernel$", "... d h -> ... d h*"),
        (r"attn/o_proj/kernel$", "... h d -> ... h* d"),
        (r"mlp/(gate|up)_proj/kernel$", "... d f -> ... d f*"),
        (r"mlp/down_proj/kernel$", "... f d -> ... f* d"),
        (r"lm_head/kernel$", "d v -> d v*"),
        (r".*", "... -> * ..."),
    ],
    "hybrid": [
        (r"^batch", "b s -> b* s 4"),  # the batch over the d* devices, like the weights' d_model
        (r"embed/embedding$", "vocab d -> d* vocab4"),
        (r"attn/(q|k|v)_proj/kernel$", "... d heads -> ... d* heads4"),
        (r"attn/o_proj/kernel$", "... heads d -> ... d* heads4"),
        (r"mlp/(gate|up)_proj/kernel$", "... d ffn -> ... d* ffn4"),
        (r"mlp/down_proj/kernel$", "... ffn d -> ... d* ffn4"),
        (r"lm_head/kernel$", "d vocab -> d* vocab4"),
        (r".*", "... -> * ..."),
    ],
}


def abstract_params() -> dict[str, Any]:
    """The parameters as ``ShapeDtypeStruct``s: nothing is allocated."""

    def f32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    d, L = D_MODEL, LAYERS
    return {
        "embed": {"embedding": f32(VOCAB, d)},
        "layers": {
            "attn": {f"{n}_proj": {"kernel": f32(L, d, d)} for n in "qkvo"},
            "mlp": {
                "gate_proj": {"kernel": f32(L, d, FFN)},
                "up_proj": {"kernel": f32(L, d, FFN)},
                "down_proj": {"kernel": f32(L, FFN, d)},
            },
            "attention_norm": {"scale": f32(L, d)},
            "mlp_norm": {"scale": f32(L, d)},
        },
        "norm": {"scale": f32(d)},
        "lm_head": {"kernel": f32(d, VOCAB)},
    }


def abstract_batch() -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def forward(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    x = params["embed"]["embedding"][tokens]
    layers = params["layers"]
    for i in range(LAYERS):
        attn, mlp = layers["attn"], layers["mlp"]
        h = _norm(x, layers["attention_norm"]["scale"][i])
        q, k, v = (h @ attn[f"{n}_proj"]["kernel"][i] for n in "qkv")
        split = lambda t: t.reshape(*t.shape[:-1], HEADS, D_MODEL // HEADS)  # noqa: E731
        scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (D_MODEL // HEADS) ** 0.5
        mask = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, split(v)).reshape(x.shape)
        x = x + out @ attn["o_proj"]["kernel"][i]
        h = _norm(x, layers["mlp_norm"]["scale"][i])
        gated = jax.nn.silu(h @ mlp["gate_proj"]["kernel"][i]) * (h @ mlp["up_proj"]["kernel"][i])
        x = x + gated @ mlp["down_proj"]["kernel"][i]
    return _norm(x, params["norm"]["scale"]) @ params["lm_head"]["kernel"]


def loss(params: dict[str, Any], batch: jax.Array) -> jax.Array:
    logits = forward(params, batch[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], axis=-1))


def train_step(params: dict[str, Any], batch: jax.Array) -> dict[str, Any]:
    grads = jax.grad(loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def report(strategy: str, n_devices: int | None = None, **estimate: float) -> einshard.StepReport:
    """The step report of one strategy; ``n_devices``: planned in a child process."""
    return einshard.explain_step(
        train_step,
        abstract_params(),
        abstract_batch(),
        rules=STRATEGIES[strategy],
        n_devices=n_devices,
        **estimate,
    )


if __name__ == "__main__":
    for devices in (None, 64):
        for name in STRATEGIES:
            print(f"\n== {name}, {devices or jax.device_count()} devices ==")
            print(report(name, devices, bandwidth=100e9, latency=5e-6, flops_per_second=100e12))
