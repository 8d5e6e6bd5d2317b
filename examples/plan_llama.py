"""Which strategy for a LLaMA-shaped model on 8 devices, and on 64: ``einshard.plan`` chooses.

The step is ``examples/llama_step.py``'s (a small LLaMA-shaped transformer, stacked layers, plain
SGD). ``einshard.plan`` compiles it under each default candidate (data parallel, FSDP, tensor
parallel, and a hybrid for every (data, model) factorization of the device count), reads what
each compiled program moves, computes and holds per device, and ranks them at the given link
bandwidth, FLOP/s and memory per device. 64 devices are planned in one child process with 64
simulated CPU devices. The winner is then used: its rules shard the parameters, its batch
expression the batch, and one training step runs on the 8 devices.

Run with ``python examples/plan_llama.py``. The figures are estimates from the compiled program
and the figures given, not measurements.
"""

import os

# Simulate 8 devices on the CPU; delete these lines to run on real accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_step

import einshard

FIGURES = {
    "bandwidth": 100e9,  # bytes per second each device sends
    "latency": 5e-6,  # seconds per ring step
    "flops_per_second": 100e12,
    "memory_per_device": 96 << 20,  # a small budget, so that some candidates do not fit
}


def plan(n_devices: int) -> einshard.Plan:
    return einshard.plan(
        llama_step.train_step,
        llama_step.abstract_params(),
        llama_step.abstract_batch(),
        n_devices=n_devices,
        **FIGURES,
    )


def main() -> None:
    plans = {n_devices: plan(n_devices) for n_devices in (8, 64)}
    for n_devices, result in plans.items():
        print(f"\n== {n_devices} devices ==")
        print(result)
    best = plans[8].best
    print(f"\nOn 8 devices: {best.name}, batch {best.batch!r}")
    print(einshard.explain(llama_step.abstract_params(), best))
    # Use it: real parameters and a real batch, one step.
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), llama_step.abstract_params())
    params = einshard.shard_pytree(params, best)
    tokens = einshard.einshard(jnp.ones(llama_step.abstract_batch().shape, jnp.int32), best.batch)
    # out_shardings: the updated parameters keep the plan's layouts (the docs' advice), so the
    # next step compiles for the same shardings.
    train = jax.jit(llama_step.train_step, out_shardings=einshard.shardings_of(params))
    params = train(params, tokens)
    print("one step done; loss", float(llama_step.loss(params, tokens)))


if __name__ == "__main__":
    main()
