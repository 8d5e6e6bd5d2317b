"""Mamba2 (``mamba2-jax==1.1.2``, Flax NNX), a state-space language model, scaled down.

Not a transformer: each block's fused ``mixer/in_proj`` is split (``jnp.split``) into the
gate, the convolved ``x``/``B``/``C`` and the time steps; a depthwise ``mixer/conv1d``, the
chunked SSD scan with per-head ``A_log``, ``D``, ``dt_bias``, a gated RMS norm and
``mixer/out_proj``; the output head is the tied ``backbone/embedder/embedding``. The
parameters are the model's ``nnx.State`` (``nnx.split``), merged back inside the step.
"""

from __future__ import annotations

import jax
from flax import nnx
from mamba2_jax import Mamba2Config, Mamba2ForCausalLM

from ._common import RealModel, batch_size, cross_entropy, sgd, tokens

VOCAB = 384
SEQUENCE = 16

CONFIG = Mamba2Config(
    vocab_size=VOCAB,
    hidden_size=96,
    state_size=16,
    head_dim=16,
    chunk_size=8,
    num_hidden_layers=2,
)


def build() -> RealModel:
    model = Mamba2ForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch = {"tokens": tokens((batch_size(), SEQUENCE + 1), VOCAB)}

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["tokens"][:, :-1])["logits"]
        return cross_entropy(logits, batch["tokens"][:, 1:])

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return sgd(params, grads), loss

    return RealModel("mamba2", "mamba2-jax==1.1.2", params, step, batch)
