"""Several processes: one einshard program on JAX's multi-controller runtime.

Every process runs this same file. Parameters are host values every process
holds in full (``einshard`` / ``shard_pytree`` put each process's shards on its
own devices); the batch is per process (each loads only its own rows, and
``einshard.from_process_local`` assembles the global batch). One jitted
tensor-parallel + data-parallel MLP step then runs across all processes.

On a cluster (SLURM, Cloud TPU, Kubernetes, …) where ``jax.distributed.initialize()``
finds its settings itself::

    python examples/multihost.py

With explicit settings, in every process::

    python examples/multihost.py --coordinator HOST:PORT --num-processes 2 --process-id 0

On one machine, 2 processes × 4 CPU devices over gloo, loopback only (also
what runs when no cluster is found)::

    python examples/multihost.py --local 2
"""

import argparse
import os
import socket
import subprocess
import sys
import threading

import numpy as np

RULES = [(r"w1$", "x y -> x y*"), (r"w2$", "y z -> y* z"), (r".*", "... -> * ...")]
BATCH = "b d -> b* d"  # rows split over every device of every process


def train_step(params, x, y):
    """One SGD step of a 2-layer MLP."""
    import jax
    import jax.numpy as jnp

    def loss_fn(p):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def run(args):
    """The program every process runs."""
    import jax

    if args.cpu_devices:  # the local demo: CPU devices, collectives over gloo
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.coordinator:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            coordinator_bind_address=args.bind,
            num_processes=args.num_processes,
            process_id=args.process_id,
            # Without a coordinator to reach, JAX ends this process after this many seconds
            # (DEADLINE_EXCEEDED in its log); a peer that dies ends it after the heartbeat timeout.
            initialization_timeout=60,
            heartbeat_timeout_seconds=10,
        )
    else:
        try:
            jax.distributed.initialize()  # the cluster's own settings (SLURM, Cloud TPU, …)
        except ValueError as error:  # not on a cluster
            print(f"no cluster found ({error}); running the local demo instead", flush=True)
            launch_local(2, 4)
            return

    import einshard

    me, n = jax.process_index(), jax.process_count()

    def say(text):
        sys.stdout.write(f"[process {me}] {text}\n")  # one write: lines of processes do not mix
        sys.stdout.flush()

    say(f"{n} processes, {jax.device_count()} devices, {jax.local_device_count()} mine")

    rng = np.random.default_rng(0)  # the same parameters in every process
    params = {
        "w1": rng.normal(size=(16, 64)).astype(np.float32) / 4,
        "b1": np.zeros(64, np.float32),
        "w2": rng.normal(size=(64, 8)).astype(np.float32) / 8,
    }
    params = einshard.shard_pytree(params, RULES)
    # The layout follows each device's position in jax.devices(); its id is the runtime's own
    # numbering (here process 1's CPU devices are numbered from 2048), printed for reference.
    position = {device: i for i, device in enumerate(jax.devices())}
    for shard in params["w1"].addressable_shards:
        block = ", ".join(
            f"{s.start or 0}:{s.stop or size}" for s, size in zip(shard.index, (16, 64), strict=True)
        )
        say(f"w1 (16, 64) on jax.devices()[{position[shard.device]}] (id {shard.device.id}): block [{block}]")

    # Each process loads only its own rows of the global batch.
    global_rows = 8 * jax.device_count()
    rows = global_rows // n
    data = np.random.default_rng(1)
    x_all = data.normal(size=(global_rows, 16)).astype(np.float32)  # stands in for a data loader
    y_all = data.normal(size=(global_rows, 8)).astype(np.float32)
    mine = slice(me * rows, (me + 1) * rows)
    x = einshard.from_process_local(x_all[mine], BATCH)
    y = einshard.from_process_local(y_all[mine], BATCH)
    say(f"batch {x.shape}: my rows {mine.start}:{mine.stop}, {len(x.addressable_shards)} shards")

    # out_shardings: the parameters keep their layouts from step to step (and it compiles once).
    step = jax.jit(train_step, out_shardings=(einshard.shardings_of(params), None))
    for i in range(3):
        params, loss = step(params, x, y)
        say(f"step {i}: loss {float(np.asarray(loss.addressable_data(0))):.6f}")


def free_port():
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relay(stream):
    """Prints a process's lines but gloo's own ('[Gloo] Rank 0 is connected to 1 peer ranks...')."""
    for line in stream:
        if not line.startswith("[Gloo] "):
            sys.stdout.write(line)
            sys.stdout.flush()


def launch_local(n_processes, cpu_devices):
    """Starts ``n_processes`` copies of this script on 127.0.0.1 and waits for them."""
    address = f"127.0.0.1:{free_port()}"
    common = ["--coordinator", address, "--bind", address, "--num-processes", str(n_processes)]
    common += ["--cpu-devices", str(cpu_devices)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *common, "--process-id", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n_processes)
    ]
    relays = [threading.Thread(target=relay, args=(proc.stdout,)) for proc in procs]
    for thread in relays:
        thread.start()
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
        for thread in relays:
            thread.join()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(codes):
        sys.exit(f"a process failed: exit codes {codes}")


def main():
    """Parses the command line: the local demo, or one process of a cluster."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--local", type=int, metavar="N", help="run N processes on this machine (loopback)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0")
    parser.add_argument("--bind", help="the address process 0 listens on (default: all interfaces)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--cpu-devices", type=int, default=0, help="simulate this many CPU devices each")
    args = parser.parse_args()
    if args.local:
        launch_local(args.local, args.cpu_devices or 4)
    else:
        run(args)


if __name__ == "__main__":
    main()
