"""ESM2 (``esm2quinox==0.2.0``, Equinox), the protein masked language model, scaled down.

Its transformer layers are built by ``eqx.filter_vmap`` and run by ``lax.scan``, so every
layer weight has a leading layer axis (``layers/attn/query_proj/weight``: ``(2, 96, 96)``);
attention is ``eqx.nn.MultiheadAttention`` with rotary embeddings, the MLP ``linear1`` /
``linear2``, and the token embedding is the logit head's ``linear2`` weight (tied, as
shipped). The model takes one sequence; the step ``vmap``s it over the batch.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from esm2quinox import ESM2

from ._common import RealModel, batch_size, cross_entropy, sgd

SEQUENCE = 16
ALPHABET = 33  # ESM2's (fixed by the package)
MASK = 32  # its mask token '#'


def build() -> RealModel:
    model = ESM2(num_layers=2, embed_size=96, num_heads=8, token_dropout=True, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(0)
    targets = rng.integers(4, 24, size=(batch_size(), SEQUENCE), dtype=np.int32)  # amino acids
    masked = rng.random(targets.shape) < 0.15
    masked[:, 0] = True  # at least one mask token per sequence
    batch = {"tokens": np.where(masked, MASK, targets).astype(np.int32), "targets": targets}

    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        logits = jax.vmap(model)(batch["tokens"]).logits
        return cross_entropy(logits, batch["targets"])

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return sgd(params, grads), loss

    return RealModel("esm2", "esm2quinox==0.2.0", params, step, batch)
