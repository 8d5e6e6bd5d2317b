"""One process of the multi-process tests (tests/test_multihost.py runs two of these).

``python multihost_worker.py PROCESS_ID PORT SCENARIO``: joins a 2-process JAX
cluster on 127.0.0.1:PORT (4 CPU devices each, collectives over gloo), runs the
scenario and prints one line ``RESULT <json>``. Exit code 77: gloo collectives
are not available here (the test skips). Importing this module does nothing
but define the MLP problem, which the test also runs in one process as the
reference.
"""

import json
import os
import sys
import time

import numpy as np

N_PROCESSES = 2
LOCAL_DEVICES = 4
SKIP = 77

# Each case: (name, expression, shape); every process holds the same full value.
PLACEMENTS = [
    ("columns", "x y -> x y*", (8, 16)),
    ("blocks", "x y -> x2 y*", (8, 16)),
    ("replicated_rows", "a b -> * a2 b", (8, 16)),
    ("replicated", "... -> * ...", (3, 5)),
]
BATCH_EXPRESSION = "b d -> b* d"  # the data-parallel axis, split over both processes
RULES = [(r"w1$", "x y -> x y*"), (r"w2$", "y z -> y* z"), (r".*", "... -> * ...")]


def full_value(shape):
    """The host value every process holds for a placement case."""
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) / 7


def mlp_problem():
    """Parameters and a batch (NumPy), the same in every process."""
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(16, 32)).astype(np.float32) / 4,
        "b1": np.zeros(32, np.float32),
        "w2": rng.normal(size=(32, 8)).astype(np.float32) / 4,
    }
    x = rng.normal(size=(16, 16)).astype(np.float32)
    y = rng.normal(size=(16, 8)).astype(np.float32)
    return params, x, y


def train_step(params, x, y):
    """One SGD step of a 2-layer MLP: the new parameters and the loss."""
    import jax
    import jax.numpy as jnp

    def loss_fn(p):
        hidden = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((hidden @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def shards(array):
    """This process's shards: device id -> ((start, stop) per axis, values)."""
    out = {}
    for shard in array.addressable_shards:
        index = [list(s.indices(size)[:2]) for s, size in zip(shard.index, array.shape, strict=True)]
        out[str(shard.device.id)] = [index, np.asarray(shard.data).tolist()]
    return out


def start(process_id, port, heartbeat, initialization_timeout=60):
    """Configures JAX for 4 CPU devices over gloo and joins the cluster (loopback only)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as error:  # an option this JAX does not know
        print(f"SKIP gloo collectives unavailable: {error}", flush=True)
        sys.exit(SKIP)
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    address = f"127.0.0.1:{port}"
    jax.distributed.initialize(
        coordinator_address=address,
        coordinator_bind_address=address,  # never listen beyond loopback
        num_processes=N_PROCESSES,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=30,
    )
    return jax


def main_scenario(jax):
    """Everything einshard does, from every process; the result is this process's view."""
    import einshard

    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [[d.id, d.process_index] for d in jax.devices()],
        "placements": {},
    }
    for name, expression, shape in PLACEMENTS:
        result["placements"][name] = shards(einshard.einshard(full_value(shape), expression))
    value = full_value((8, 16))
    committed = jax.device_put(value, jax.local_devices()[1])  # a process-local jax.Array
    result["placements"]["committed_local"] = shards(einshard.einshard(committed, "x y -> x* y"))
    resharded = einshard.einshard(einshard.einshard(value, "x y -> x y*"), "x y -> x2 y*")
    result["placements"]["resharded"] = shards(resharded)
    sharding = einshard.make_sharding("x y -> x y*", shape=(8, 16))
    result["make_sharding"] = {
        "fully_addressable": sharding.is_fully_addressable,
        "device_ids": [d.id for d in sharding.mesh.devices.flat],
    }

    tree = einshard.shard_pytree({"w1": value, "b": np.ones(16, np.float32), "step": 3}, RULES)
    result["pytree"] = {"w1": shards(tree["w1"]), "b": shards(tree["b"]), "step": tree["step"]}
    born = einshard.init_sharded(
        lambda key: {"w1": jax.random.normal(key, (8, 16))}, RULES, jax.random.key(0)
    )
    result["init"] = shards(born["w1"])

    # The data-parallel batch: this process holds its own rows only.
    params, x, y = mlp_problem()
    rows = len(x) // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    x_global = einshard.from_process_local(x[mine], BATCH_EXPRESSION)
    y_global = einshard.from_process_local(y[mine], BATCH_EXPRESSION, global_shape=y.shape)
    result["batch"] = shards(x_global)
    try:
        einshard.from_process_local(x[mine][:3], BATCH_EXPRESSION, global_shape=x.shape)
    except einshard.EinshardError as error:
        result["batch_error"] = str(error)

    sharded_params = einshard.shard_pytree(params, RULES)
    new_params, loss = jax.jit(train_step)(sharded_params, x_global, y_global)
    result["loss"] = float(np.asarray(loss.addressable_data(0)))
    result["new_w1"] = shards(new_params["w1"])
    result["new_w2"] = shards(new_params["w2"])
    result["local_inputs"] = local_inputs_scenario(jax)
    return result


def local_optax_state(params):
    """Adam's state after one step with the parameters as gradients: moments that are not zeros."""
    import optax

    tx = optax.adam(1e-3)
    _, state = tx.update(params, tx.init(params), params)
    return state


def local_inputs_scenario(jax):
    """shard_pytree, init_sharded and optax state from arrays committed to this process's devices.

    Each process holds the whole value on one of its own devices (as after a
    local computation); einshard must give every process's devices their own
    blocks of it.
    """
    import einshard

    local = jax.local_devices()
    params = {
        "w1": jax.device_put(full_value((8, 16)), local[0]),
        "b": jax.device_put(full_value((16,)) + 1, local[2]),
        "w2": jax.device_put(full_value((16, 8)) - 3, local[3]),
    }
    tree = einshard.shard_pytree(params, RULES)
    out = {"pytree": {name: shards(leaf) for name, leaf in tree.items()}}
    born = einshard.init_sharded(
        lambda key: {"w1": jax.random.normal(key, (8, 16)), "w2": jax.random.uniform(key, (16, 8))},
        RULES,
        jax.random.key(1),
    )
    out["init"] = {name: shards(leaf) for name, leaf in born.items()}
    try:
        from einshard.integrations.optax import init_opt_state, shard_opt_state
    except ImportError:
        return out
    import optax

    state = shard_opt_state(local_optax_state(jax.device_put(params, local[1])), tree)
    adam = state[0]
    out["optax"] = {
        "count": shards(adam.count),
        **{f"mu/{name}": shards(leaf) for name, leaf in adam.mu.items()},
        **{f"nu/{name}": shards(leaf) for name, leaf in adam.nu.items()},
    }
    born_state = init_opt_state(optax.adam(1e-3), tree)[0]
    out["optax_init"] = {f"mu/{name}": shards(leaf) for name, leaf in born_state.mu.items()}
    return out


def die_scenario(jax, process_id):
    """Process 1 dies after the first collective; process 0 keeps computing."""
    import einshard

    x = einshard.einshard(np.ones((8, 16), np.float32), "x y -> x* y")
    total = jax.jit(lambda a: a.sum(), out_shardings=einshard.make_sharding("-> *"))
    print(f"first sum {float(np.asarray(total(x).addressable_data(0)))}", flush=True)
    if process_id == 1:
        os._exit(3)  # no clean shutdown: a crash
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the runtime must end this process long before
        x = x + 1
        total(x).block_until_ready()
        time.sleep(0.2)
    return {"survived": True}


def agree_scenario(jax, process_id):
    """from_process_local when the processes disagree, fail, or one never calls it.

    The result maps each case to what this process got: "ok" with the array's shards, or the
    EinshardError's message.
    """
    import einshard

    def attempt(make):
        try:
            return {"ok": shards(make())}
        except einshard.EinshardError as error:
            return {"error": str(error)}

    rows = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    mine = rows[4 * process_id : 4 * process_id + 4]
    result = {}
    result["agree"] = attempt(lambda: einshard.from_process_local(mine, BATCH_EXPRESSION))
    other_dtype = mine.astype(np.float64 if process_id == 1 else np.float32)
    result["dtype"] = attempt(lambda: einshard.from_process_local(other_dtype, BATCH_EXPRESSION))
    other_rows = rows[: 4 + 4 * process_id]  # process 1 passes 8 rows: a global shape of 16
    result["rows"] = attempt(lambda: einshard.from_process_local(other_rows, BATCH_EXPRESSION))
    # Process 1 lays its rows out as 'b d -> b4 d 2': the same local shape, another layout.
    other_expression = "b d -> b4 d 2" if process_id == 1 else BATCH_EXPRESSION
    result["expression"] = attempt(lambda: einshard.from_process_local(mine, other_expression))
    # 'b d -> * b2 d': every process holds both row blocks (replication across processes).
    whole = rows + (100 * process_id if process_id == 1 else 0)
    result["values_unchecked"] = attempt(lambda: einshard.from_process_local(whole, "b d -> * b2 d"))
    result["values"] = attempt(lambda: einshard.from_process_local(whole, "b d -> * b2 d", check_values=True))
    result["values_equal"] = attempt(
        lambda: einshard.from_process_local(rows, "b d -> * b2 d", check_values=True)
    )
    # 'b d -> * b2 d2': both processes hold all four blocks; process 1 changes one of them.
    for block in ((1, 1), (0, 1)):
        changed = rows.copy()
        if process_id == 1:
            changed[4 * block[0] : 4 * block[0] + 4, 2 * block[1] : 2 * block[1] + 2] += 1
        result[f"values_{block[0]}{block[1]}"] = attempt(
            lambda changed=changed: einshard.from_process_local(changed, "b d -> * b2 d2", check_values=True)
        )
    bad_local = mine[:3] if process_id == 1 else mine  # 3 rows do not split into 4 blocks
    result["one_fails"] = attempt(lambda: einshard.from_process_local(bad_local, "b d -> b* d"))
    # Last: process 1 never calls; process 0 gives up after the timeout.
    started = time.monotonic()
    if process_id == 0:
        result["absent"] = attempt(lambda: einshard.from_process_local(mine, BATCH_EXPRESSION, timeout=3))
    else:
        time.sleep(6)
        result["absent"] = {"skipped": True}
    result["absent_seconds"] = time.monotonic() - started
    return result


def main():
    """Runs one scenario and prints its result."""
    process_id, port, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if scenario == "nocoordinator":  # nobody listens at the port: JAX aborts after the timeout
        start(process_id, port, heartbeat=10, initialization_timeout=5)
        print("RESULT " + json.dumps({"initialized": True}), flush=True)
        return
    jax = start(process_id, port, heartbeat=3 if scenario == "die" else 10)
    if scenario == "main":
        result = main_scenario(jax)
    elif scenario == "agree":
        result = agree_scenario(jax, process_id)
    else:
        result = die_scenario(jax, process_id)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
