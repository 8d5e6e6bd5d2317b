"""equimo's Vision Transformer (``equimo==1.1.0``, Equinox), ViT-Ti's layout scaled down.

A convolutional patch embedding (``patch_embed/proj``: a ``Conv2d`` whose stride is its
kernel), a class token and learned position embedding, pre-norm blocks with fused
``attn/qkv``, ``attn/proj``, ``mlp/fc1``, ``mlp/fc2`` (Equinox ``Linear`` weights, laid out
``(out, in)``), a final norm, average pooling and a classifier ``head``. The model takes one
image; the step ``vmap``s it over the batch.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from equimo.models.vit import VisionTransformer

from ._common import RealModel, batch_size, cross_entropy, sgd

IMAGE = 32
CLASSES = 10


def build() -> RealModel:
    model = VisionTransformer(
        img_size=IMAGE,
        in_channels=3,
        dim=96,
        patch_size=8,
        num_heads=8,
        depths=[2],
        num_classes=CLASSES,
        reg_tokens=0,  # as equimo's vit_* variants
        key=jax.random.key(0),
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(0)
    batch = {
        "images": rng.standard_normal((batch_size(), 3, IMAGE, IMAGE), dtype=np.float32),
        "labels": rng.integers(0, CLASSES, size=(batch_size(),), dtype=np.int32),
    }

    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        logits = jax.vmap(lambda image: model(image, inference=True))(batch["images"])
        return cross_entropy(logits, batch["labels"])

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return sgd(params, grads), loss

    return RealModel("equimo_vit", "equimo==1.1.0", params, step, batch)
