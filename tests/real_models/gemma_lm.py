"""Gemma 2 (``gemma==2.0.8``, Flax linen), Gemma 2 2B's architecture scaled down.

Grouped-query attention (8 query heads, 4 key/value heads: ``attn/q_einsum/w`` and the fused
``attn/kv_einsum/w``), a gated GELU MLP (``mlp/gating_einsum``, ``mlp/linear``), sliding-window
and global layers in turn, soft-capped logits, RMS norms before and after each sublayer, and
the input embedding tied to the output projection (``embedder/input_embedding``), as shipped.
Only ``gemma.transformer`` is used: it needs Flax and orbax, not the package's other
dependencies (see the ``real_models`` nox session).
"""

from __future__ import annotations

import jax
from gemma import modules
from gemma import transformer as gemma_transformer

from ._common import RealModel, batch_size, cross_entropy, sgd, tokens

VOCAB = 384
SEQUENCE = 16

CONFIG = gemma_transformer.TransformerConfig(
    num_layers=2,
    num_embed=VOCAB,
    embed_dim=96,
    hidden_dim=384,
    num_heads=8,
    head_dim=16,
    num_kv_heads=4,
    final_logit_softcap=30.0,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    attention_types=(modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL),
    max_cache_length=None,
    query_pre_attn_norm=gemma_transformer.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
    attn_logits_soft_cap=50.0,
    sliding_window_size=8,
)


def build() -> RealModel:
    module = gemma_transformer.Transformer(CONFIG)
    batch = {"tokens": tokens((batch_size(), SEQUENCE + 1), VOCAB)}

    def loss_fn(params, batch):
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        mask = inputs >= 0  # no padding
        positions = gemma_transformer.build_positions_from_mask(mask)
        attention_mask = gemma_transformer.make_causal_attn_mask(mask)
        logits, _ = module.apply({"params": params}, inputs, positions, None, attention_mask)
        return cross_entropy(logits, targets)

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return sgd(params, grads), loss

    example = batch["tokens"][:2, :-1]
    mask = example >= 0
    variables = module.init(
        jax.random.key(0),
        example,
        gemma_transformer.build_positions_from_mask(mask),
        None,
        gemma_transformer.make_causal_attn_mask(mask),
    )
    return RealModel("gemma", "gemma==2.0.8", variables["params"], step, batch)
