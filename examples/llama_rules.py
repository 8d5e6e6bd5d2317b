"""A LLaMA-shaped model under one rule table: planned for 8 and 256 devices, then born sharded on 8.

Hybrid parallelism from a rule table, without touching the model code: every
weight splits its "tensor" axis (attention heads, MLP hidden units,
vocabulary) 4 ways over neighbouring devices, and its ``d_model`` axis over
whatever devices are left (FSDP-style data parallelism): ``d*`` means "the
rest of the devices", so the same table gives a 2 x 4 grid on 8 devices and a
64 x 4 grid on 256. Norm scales are small and replicated.

1. ``einshard.explain`` plans a LLaMA-7B-sized tree for 8 and for 256 devices.
   The tree comes from ``jax.eval_shape``: 27 GB of parameters that are never
   allocated, so this runs on a laptop.
2. A small model with the same structure is created already sharded on 8
   simulated CPU devices (``einshard.init_sharded``: each device computes only
   its own blocks), and checked: the layouts are those ``make_sharding`` gives
   for each leaf's rule and those ``explain`` predicted, and the values equal
   an ordinary unsharded initialisation.

The layers are stacked (one array per kind of weight, with a leading layer
axis, as scanned models such as MaxText store them), so the tables stay short.
The rules start with ``...``, so they fit unstacked per-layer trees
(``layers/0/attn/q_proj/kernel``) just as well.

Run with ``python examples/llama_rules.py``.
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import einshard


class Config(NamedTuple):
    vocab: int
    d_model: int
    ffn: int
    n_layers: int


LLAMA_7B = Config(vocab=32000, d_model=4096, ffn=11008, n_layers=32)
SMALL = Config(vocab=512, d_model=128, ffn=352, n_layers=4)

# Parameter-path regex -> expression; the first match wins. 'heads4' splits an axis into 4 over
# neighbouring devices (tensor parallelism), 'd*' splits d_model over the remaining devices.
RULES = [
    (r"embed/embedding$", "vocab d -> d* vocab4"),
    (r"attn/(q|k|v)_proj/kernel$", "... d heads -> ... d* heads4"),
    (r"attn/o_proj/kernel$", "... heads d -> ... d* heads4"),
    (r"mlp/(gate|up)_proj/kernel$", "... d ffn -> ... d* ffn4"),
    (r"mlp/down_proj/kernel$", "... ffn d -> ... d* ffn4"),
    (r"lm_head/kernel$", "d vocab -> d* vocab4"),
    (r"norm/scale$", "... -> * ..."),  # small: every device keeps a copy
    (r".*", "... -> * ..."),  # anything else, e.g. leaves a newer model adds
]


def init_params(key: jax.Array, config: Config) -> dict[str, Any]:
    """LLaMA-shaped parameters as nested dicts, the layers stacked on a leading axis."""
    vocab, d, ffn, n_layers = config
    keys = iter(jax.random.split(key, 9))

    def dense(shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[-2])

    return {
        "embed": {"embedding": jax.random.normal(next(keys), (vocab, d), jnp.float32)},
        "layers": {
            "attn": {f"{name}_proj": {"kernel": dense((n_layers, d, d))} for name in "qkvo"},
            "mlp": {
                "gate_proj": {"kernel": dense((n_layers, d, ffn))},
                "up_proj": {"kernel": dense((n_layers, d, ffn))},
                "down_proj": {"kernel": dense((n_layers, ffn, d))},
            },
            "attention_norm": {"scale": jnp.ones((n_layers, d), jnp.float32)},
            "ffn_norm": {"scale": jnp.ones((n_layers, d), jnp.float32)},
        },
        "final_norm": {"scale": jnp.ones((d,), jnp.float32)},
        "lm_head": {"kernel": dense((d, vocab))},
    }


def plan_7b() -> None:
    abstract = jax.eval_shape(functools.partial(init_params, config=LLAMA_7B), jax.random.key(0))
    for n_devices in (8, 256):
        print(f"\nLLaMA-7B-sized parameters on {n_devices} devices (planned, nothing allocated):\n")
        print(einshard.explain(abstract, RULES, n_devices=n_devices))


def shard_small() -> None:
    key = jax.random.key(0)
    params = einshard.init_sharded(functools.partial(init_params, config=SMALL), RULES, key)
    expected = jax.jit(functools.partial(init_params, config=SMALL))(key)  # on one device

    print(f"\nA small model of the same shape, born sharded on {jax.device_count()} devices {SMALL}:\n")
    einshard.visualize("d heads -> d* heads4", (SMALL.d_model, SMALL.d_model), devices=jax.devices())
    print("(one layer's q_proj kernel: a 2 x 4 grid, 4-way tensor parallel within each row of devices)\n")

    # Check every leaf: its layout is what make_sharding gives for its rule's expression and what
    # explain planned, and its values are those of the unsharded init.
    rules = einshard.Rules(RULES)
    report = einshard.explain(params, rules)  # rows in tree order, one per array leaf
    print(f"{'path':30} {'shape':15} {'expression':30} {'shard shape':14} layout  values")
    for row, leaf, want in zip(report.rows, jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        rule = rules.match(row.path)
        assert rule is not None, row.path
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        same_layout = leaf.sharding.is_equivalent_to(
            einshard.make_sharding(rule.expression, shape=leaf.shape), leaf.ndim
        )
        same_layout &= shard_shape == row.shard_shape
        same_values = np.array_equal(np.asarray(leaf), np.asarray(want))
        print(
            f"{row.path:30} {leaf.shape!s:15} {rule.expression:30} {shard_shape!s:14} "
            f"{'ok' if same_layout else 'WRONG':7} {'equal' if same_values else 'DIFFERENT'}"
        )
        if not (same_layout and same_values):
            raise SystemExit(f"{row.path}: the born-sharded leaf differs from the plan or the unsharded init")
    print("(layout: == make_sharding(expression) and explain's plan; values: == the unsharded init)")
    per_device = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    per_device //= jax.device_count()
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    print(f"\n{total / 2**20:.2f} MiB of parameters, {per_device / 2**20:.2f} MiB on each device")


def main() -> None:
    plan_7b()
    shard_small()


if __name__ == "__main__":
    main()
