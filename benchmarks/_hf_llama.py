"""Hugging Face's Flax LLaMA (``transformers`` 4.57's ``FlaxLlamaForCausalLM``) as a user plans it.

A private module of ``bench_plan_at_size.py`` (nox runs ``bench_*.py`` only): the model people
download, built abstractly (``_do_init=False``, ``jax.eval_shape(model.init_weights, ...)``: nothing
allocated), float32 weights as the library gives them, its layers unrolled as the library writes
them, and AdamW (optax) state beside the weights in the step's first argument
(``state = {'params': ..., 'opt_state': ...}``); the batch ``int32[B, S]`` tokens.
``transformers`` 5 dropped Flax: these runs need ``transformers>=4.57,<4.58`` (the benchmark's nox
sessions install it).

The step is a module-level function with the size's name bound by ``functools.partial``, so that
the plan's child process imports it from here (this folder is on its ``sys.path``) instead of
running the benchmark script again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

OPTIMIZER = optax.adamw(1e-4)
REQUIREMENT = "transformers>=4.57,<4.58"


@dataclasses.dataclass(frozen=True)
class Size:
    """A LLaMA configuration and the batch and device count it is planned for (both models' sizes)."""

    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    devices: int
    vocab: int = 128256
    seq: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES = {
    "hf-1.5b": Size(2048, 8192, 16, 32, 8, batch=8, devices=8),
    "hf-8b": Size(4096, 14336, 32, 32, 8, batch=64, devices=64),  # LLaMA-3-8B's shape
    # What CI's bounded run plans: the same code at a size that compiles in seconds.
    "hf-tiny": Size(256, 1024, 2, 8, 4, batch=8, devices=8, vocab=4096, seq=256),
}


def available() -> str | None:
    """``None`` when ``transformers`` with its Flax LLaMA is installed, else why not."""
    try:
        from transformers import FlaxLlamaForCausalLM  # noqa: F401
    except ImportError as error:
        return f"needs {REQUIREMENT} (transformers 5 has no Flax models): {error}"
    return None


@functools.cache
def model(name: str) -> Any:
    """The size's ``FlaxLlamaForCausalLM``, without weights (``_do_init=False``)."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    size = SIZES[name]
    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.mlp,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.seq,
        tie_word_embeddings=False,
    )
    return FlaxLlamaForCausalLM(config, input_shape=(1, size.seq), _do_init=False)


def abstract_state(name: str) -> dict:
    """``{'params': ..., 'opt_state': ...}`` as ``ShapeDtypeStruct``s: the library's float32 weights."""
    size = SIZES[name]
    init = functools.partial(model(name).init_weights, input_shape=(1, size.seq))
    params = jax.eval_shape(init, jax.random.PRNGKey(0))
    return {"params": params, "opt_state": jax.eval_shape(OPTIMIZER.init, params)}


def abstract_batch(name: str) -> jax.ShapeDtypeStruct:
    size = SIZES[name]
    return jax.ShapeDtypeStruct((size.batch, size.seq), jnp.int32)


def _step(name: str, state: dict, batch: jax.Array) -> tuple[dict, jax.Array]:
    llama = model(name)

    def loss(params: Any) -> jax.Array:
        logits = llama(batch[:, :-1], params=params, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, value


def step(name: str) -> Any:
    """The AdamW step of the named size: ``step(state, batch)``, importable by the child."""
    return functools.partial(_step, name)


def parameter_count(name: str) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_state(name)["params"]))
