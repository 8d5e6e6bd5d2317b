"""What every real-model fixture provides, and the training loop the tests share.

Each fixture module builds one model from a package on PyPI that nobody here wrote, small,
offline, from random initialisation: its parameters (as the framework's users hold them), a
training step ``step(params, batch) -> (new_params, loss)`` (loss, gradient, SGD), and a
batch whose first axis is the batch axis, sized so that every device count divides it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

N_DEVICES = int(os.environ.get("EINSHARD_TEST_DEVICES", "8"))
LEARNING_RATE = 0.05


@dataclasses.dataclass(frozen=True)
class RealModel:
    """One real model, ready to train.

    Attributes:
        name: A short id (the test ids).
        package: ``name==version`` of the PyPI package it comes from.
        params: The parameters as concrete arrays on one device, in the framework's own
            container (a linen dict, an Equinox module, an NNX ``State``).
        step: ``step(params, batch) -> (new_params, loss)``: forward, loss, gradient, SGD.
        batch: A pytree of arrays whose first axis is the batch axis.
    """

    name: str
    package: str
    params: Any
    step: Callable[[Any, Any], tuple[Any, jax.Array]]
    batch: Any

    @property
    def abstract_params(self) -> Any:
        """The parameters as ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``)."""
        return jax.eval_shape(lambda p: p, self.params)

    @property
    def abstract_batch(self) -> Any:
        return jax.eval_shape(lambda b: b, self.batch)


def batch_size(per_device: int = 2) -> int:
    """A batch every device count of the suite (and the hybrids' data axes) divides."""
    return per_device * N_DEVICES


def sgd(params: Any, grads: Any) -> Any:
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def tokens(shape: tuple[int, ...], vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


def parameter_bytes(tree: Any) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
