"""The planner end to end: plan a step, shard the parameters and the batch by the winner, train.

`einshard.plan` compiles the training step under each candidate strategy (data parallel, FSDP,
tensor parallel and hybrids, the last two read from the step's dataflow) and ranks them by
estimated step time. `plan.best` is the winning `einshard.strategies.Strategy`: an ordinary rule
table for the parameters (`shard_pytree(params, plan.best)`) that also carries the expression for
the batch (`einshard(batch, plan.best.batch)`). Then the step trains as any jitted step does: after
three steps its loss is the loss of the same three steps on one device to float32 rounding
(`np.allclose`, rtol 1e-5: the sharded program adds in another order), and the parameters keep the
plan's layouts.

Run it on 8 simulated CPU devices (no accelerator needed):

    python examples/plan_end_to_end.py

This is the block of docs/strategies.md's "Plan, shard, train" section, as a script.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # no accelerator? simulate 8 CPU devices, before JAX starts
import jax.numpy as jnp  # noqa: E402  (after the device count)
import numpy as np  # noqa: E402

import einshard  # noqa: E402


def loss(params, batch):
    hidden = jax.nn.relu(batch @ params["up"]["kernel"])
    return jnp.mean((hidden @ params["down"]["kernel"] - batch) ** 2)


def step(params, batch):
    grads = jax.grad(loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def main():
    key_up, key_down, key_batch = jax.random.split(jax.random.key(0), 3)
    params = {
        "up": {"kernel": jax.random.normal(key_up, (64, 512)) / 8},
        "down": {"kernel": jax.random.normal(key_down, (512, 64)) / 8},
    }
    batch = np.asarray(jax.random.normal(key_batch, (256, 64)))

    plan = einshard.plan(step, params, batch, bandwidth=10e9, flops_per_second=1e12)
    best = plan.best  # a Strategy: rules for the parameters, .batch for the batch
    print(best.name, "|", best.batch)

    sharded = einshard.shard_pytree(params, best)
    data = einshard.einshard(batch, best.batch)
    print(sharded["up"]["kernel"].sharding.shard_shape((64, 512)), data.sharding.shard_shape(data.shape))

    train = jax.jit(step, out_shardings=einshard.shardings_of(sharded))  # keep every layout
    reference = jax.jit(step)
    for _ in range(3):
        sharded, params = train(sharded, data), reference(params, batch)
    # The one-device values to float32 rounding: the sharded program adds in another order.
    print(np.allclose(loss(sharded, data), loss(params, batch), rtol=1e-5))
    print(sharded["up"]["kernel"].sharding == einshard.shard_pytree(params, best)["up"]["kernel"].sharding)


if __name__ == "__main__":
    main()
