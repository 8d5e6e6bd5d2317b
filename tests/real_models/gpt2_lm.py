"""GPT-2 (``transformers==4.57.6``'s ``FlaxGPT2LMHeadModel``, Flax linen), scaled down.

Hugging Face's Flax port keeps PyTorch's ``Conv1D`` layout: every ``kernel`` is ``(out, in)``
(``attn/c_attn/kernel``: the fused q, k, v, ``(288, 96)``), unlike ``nn.Dense``'s ``(in, out)``;
learned position embeddings ``wpe``, LayerNorms with biases, and the output head tied to
``wte/embedding``. Built from a config with random weights (no hub). 4.57 is the last
Transformers line with Flax models.
"""

from __future__ import annotations

import jax
from transformers import FlaxGPT2LMHeadModel, GPT2Config
from transformers.utils import logging as hf_logging

from ._common import RealModel, batch_size, cross_entropy, sgd, tokens

VOCAB = 384
SEQUENCE = 16


def build() -> RealModel:
    hf_logging.set_verbosity_error()  # its deprecation notice for the Flax classes
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=96, n_layer=2, n_head=8)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    module = model.module
    batch = {"tokens": tokens((batch_size(), SEQUENCE + 1), VOCAB)}

    def loss_fn(params, batch):
        inputs = batch["tokens"][:, :-1]
        positions = jax.numpy.broadcast_to(jax.numpy.arange(inputs.shape[1]), inputs.shape)
        mask = jax.numpy.ones_like(inputs)
        logits = module.apply({"params": params}, inputs, mask, positions, deterministic=True).logits
        return cross_entropy(logits, batch["tokens"][:, 1:])

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return sgd(params, grads), loss

    return RealModel("gpt2", "transformers==4.57.6", model.params, step, batch)
