"""Several processes: 2 processes × 4 CPU devices on 127.0.0.1, collectives over gloo.

Each test cluster is two ``tests/multihost_worker.py`` subprocesses that join
with ``jax.distributed.initialize`` on a free loopback port and report, as
JSON, what their own devices hold; the checks here compare that with the pure
layout mapped through ``jax.devices()`` and with a one-process run.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from multihost_worker import (
    BATCH_EXPRESSION,
    LOCAL_DEVICES,
    N_PROCESSES,
    PLACEMENTS,
    SKIP,
    full_value,
    mlp_problem,
    train_step,
)

import einshard

WORKER = Path(__file__).with_name("multihost_worker.py")
ROOT = Path(__file__).parents[1]
TIMEOUT = 120  # seconds for a whole cluster; its processes are killed after


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cluster(scenario):
    """Runs both workers; returns [(returncode, stdout, stderr, seconds)] by process id."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)  # the workers set their own device count
    port = free_port()
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(N_PROCESSES)
    ]
    results = []
    try:
        for proc in procs:
            left = max(1.0, TIMEOUT - (time.monotonic() - started))
            out, err = proc.communicate(timeout=left)
            results.append((proc.returncode, out, err, time.monotonic() - started))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {scenario!r} cluster did not finish within {TIMEOUT} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    if any(code == SKIP for code, *_ in results):
        pytest.skip("gloo CPU collectives are not available in this JAX")
    return results


def parse(out):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


@pytest.fixture(scope="module")
def cluster():
    """Each process's report of the main scenario, by process id."""
    results = run_cluster("main")
    reports = []
    for i, (code, out, err, _) in enumerate(results):
        report = parse(out)
        assert code == 0 and report is not None, f"process {i} failed ({code}):\n{out}\n{err[-3000:]}"
        reports.append(report)
    return reports


def expected_shards(expression, shape, device_ids):
    """Device id -> its block, from the pure layout over the global device order."""
    layout = einshard.layout(expression, shape, n_devices=len(device_ids))
    return {
        str(device_ids[position]): [list(s.indices(size)[:2]) for s, size in zip(slices, shape, strict=True)]
        for position, slices in layout.indices(shape).items()
    }


def check_shards(report, got, expression, value, tolerance=1e-6):
    """The process holds exactly its devices' blocks, with the right values."""
    device_ids = [device_id for device_id, _ in report["devices"]]
    mine = {str(d) for d, process in report["devices"] if process == report["process_index"]}
    expected = {d: b for d, b in expected_shards(expression, value.shape, device_ids).items() if d in mine}
    assert {d: index for d, (index, _) in got.items()} == expected
    for index, data in got.values():
        block = value[tuple(slice(start, stop) for start, stop in index)]
        np.testing.assert_allclose(
            np.asarray(data, dtype=np.float32).reshape(block.shape), block, rtol=tolerance, atol=tolerance
        )


def test_device_order_is_global_and_identical(cluster):
    orders = [report["devices"] for report in cluster]
    assert orders[0] == orders[1]
    assert len(orders[0]) == N_PROCESSES * LOCAL_DEVICES
    processes = [process for _, process in orders[0]]
    assert processes == sorted(processes) == [p for p in range(N_PROCESSES) for _ in range(LOCAL_DEVICES)]
    assert [r["process_index"] for r in cluster] == list(range(N_PROCESSES))
    for report in cluster:
        assert report["make_sharding"] == {
            "fully_addressable": False,
            "device_ids": [device_id for device_id, _ in orders[0]],
        }


@pytest.mark.parametrize(("name", "expression", "shape"), PLACEMENTS)
def test_full_host_value_is_placed_by_layout(cluster, name, expression, shape):
    for report in cluster:
        check_shards(report, report["placements"][name], expression, full_value(shape))


def test_process_local_jax_array_and_reshard(cluster):
    value = full_value((8, 16))
    for report in cluster:
        check_shards(report, report["placements"]["committed_local"], "x y -> x* y", value)
        check_shards(report, report["placements"]["resharded"], "x y -> x2 y*", value)


def test_shard_pytree_and_init_sharded(cluster):
    value = full_value((8, 16))
    with jax.default_device(jax.devices("cpu")[0]):
        born = np.asarray(jax.random.normal(jax.random.key(0), (8, 16)))
    for report in cluster:
        check_shards(report, report["pytree"]["w1"], "x y -> x y*", value)
        check_shards(report, report["pytree"]["b"], "... -> * ...", np.ones(16, np.float32))
        assert report["pytree"]["step"] == 3
        check_shards(report, report["init"], "x y -> x y*", born)


# Arrays committed to one device of each process (as after a local computation): every process's
# devices must get their own blocks of the value, through shard_pytree, init_sharded and optax.
LOCAL_PARAMS = {"w1": full_value((8, 16)), "b": full_value((16,)) + 1, "w2": full_value((16, 8)) - 3}
LOCAL_EXPRESSIONS = {"w1": "x y -> x y*", "b": "... -> * ...", "w2": "y z -> y* z"}


def test_shard_pytree_of_process_local_arrays(cluster):
    for report in cluster:
        for name, value in LOCAL_PARAMS.items():
            check_shards(report, report["local_inputs"]["pytree"][name], LOCAL_EXPRESSIONS[name], value)


def test_init_sharded_blocks_on_every_process(cluster):
    with jax.default_device(jax.devices("cpu")[0]):
        key = jax.random.key(1)
        born = {
            "w1": np.asarray(jax.random.normal(key, (8, 16))),
            "w2": np.asarray(jax.random.uniform(key, (16, 8))),
        }
    for report in cluster:
        for name, value in born.items():
            check_shards(report, report["local_inputs"]["init"][name], LOCAL_EXPRESSIONS[name], value)


def test_optax_state_of_process_local_arrays(cluster):
    pytest.importorskip("optax")
    from multihost_worker import local_optax_state

    with jax.default_device(jax.devices("cpu")[0]):
        adam = jax.tree.map(np.asarray, local_optax_state(LOCAL_PARAMS))[0]
    assert adam.mu["w1"].any() and adam.nu["w2"].any()  # the check below could not miss zeros
    for report in cluster:
        state = report["local_inputs"]["optax"]
        check_shards(report, state["count"], "... -> * ...", np.asarray(adam.count, np.float32))
        for name, expression in LOCAL_EXPRESSIONS.items():
            check_shards(report, state[f"mu/{name}"], expression, adam.mu[name], 1e-6)
            check_shards(report, state[f"nu/{name}"], expression, adam.nu[name], 1e-6)
            zeros = np.zeros_like(LOCAL_PARAMS[name])
            check_shards(report, report["local_inputs"]["optax_init"][f"mu/{name}"], expression, zeros)


def test_batch_from_process_local_rows(cluster):
    _, x, _ = mlp_problem()
    for report in cluster:
        check_shards(report, report["batch"], BATCH_EXPRESSION, x)
        error = report["batch_error"]
        assert f"process {report['process_index']} should pass a local part of shape (8, 16)" in error
        assert "not (3, 16)" in error


def test_train_step_matches_one_process(cluster):
    params, x, y = mlp_problem()
    new_params, loss = jax.jit(train_step)(params, x, y)
    for report in cluster:
        np.testing.assert_allclose(report["loss"], float(loss), rtol=1e-5)
        check_shards(report, report["new_w1"], "x y -> x y*", np.asarray(new_params["w1"]), 1e-5)
        check_shards(report, report["new_w2"], "y z -> y* z", np.asarray(new_params["w2"]), 1e-5)


def test_a_dead_process_stops_the_other_with_a_clear_error():
    (code0, out0, err0, seconds0), (code1, _, _, _) = run_cluster("die")
    assert code1 == 3
    assert "first sum 128.0" in out0
    assert code0 != 0, "the survivor went on as if nothing happened"
    assert parse(out0) is None
    assert "detected fatal errors" in err0 and "another task died" in err0, err0[-3000:]
    assert seconds0 < 60


# In this one process (no cluster): the local part is the whole array.


def test_from_process_local_in_one_process():
    from conftest import N_DEVICES

    value = full_value((2 * N_DEVICES, 3))
    array = einshard.from_process_local(value, "b d -> b* d")
    assert array.sharding == einshard.make_sharding("b d -> b* d", shape=value.shape)
    np.testing.assert_array_equal(np.asarray(array), value)
    same = einshard.from_process_local(value, "b d -> b* d", global_shape=value.shape)
    np.testing.assert_array_equal(np.asarray(same), value)


def test_from_process_local_errors():
    from conftest import N_DEVICES

    value = full_value((2 * N_DEVICES, 3))
    with pytest.raises(einshard.EinshardError, match=r"should pass a local part of shape"):
        einshard.from_process_local(value[:-1], "b d -> b* d", global_shape=value.shape)
    with pytest.raises(einshard.EinshardError, match=r"global_shape \(4,\) has rank 1"):
        einshard.from_process_local(value, "b d -> b* d", global_shape=(4,))
    with pytest.raises(einshard.EinshardError):
        einshard.from_process_local(value, "b -> b*")


# Processes that disagree, fail or never arrive: an EinshardError on every process, never a hang.


@pytest.fixture(scope="module")
def agree_cluster():
    results = run_cluster("agree")
    for code, _, err, _ in results:
        assert code == 0, err[-3000:]
    return [parse(out) for _, out, _, _ in results]


def test_the_private_key_value_store_einshard_uses_is_there():
    """einshard reaches jax.distributed's key-value store through a private name: fail loudly."""
    from jax._src import distributed

    assert hasattr(distributed.global_state, "client")
    from jax._src import lib

    extension = getattr(lib, "_jax", None) or lib.xla_extension  # renamed in newer JAX
    for method in ("key_value_set", "blocking_key_value_get"):
        assert hasattr(extension.DistributedRuntimeClient, method), method


def test_agreeing_processes_build_the_array(agree_cluster):
    for report in agree_cluster:
        assert "ok" in report["agree"] and "ok" in report["values_equal"]


@pytest.mark.parametrize(
    ("case", "headline"),
    [
        ("dtype", "from_process_local: the processes disagree: [0] against [1]"),
        ("rows", "from_process_local: the processes disagree: [0] against [1]"),
        (
            "values",
            "from_process_local: the processes hold different values for block (0, 0): [0] against [1]",
        ),
    ],
)
def test_disagreement_is_an_error_on_every_process(agree_cluster, case, headline):
    for process, report in enumerate(agree_cluster):
        message = report[case]["error"]
        assert message.split("\n")[0] == headline
        assert message.split("\n")[-1] == f"  in process {process} of 2"
    if case == "dtype":
        lines = agree_cluster[0]["dtype"]["error"].split("\n")
        assert "  process 0: dtype=float32, expression=b d -> b* d, global shape=[8, 4]" in lines
        assert "  process 1: dtype=float64, expression=b d -> b* d, global shape=[8, 4]" in lines


def test_processes_that_lay_out_their_parts_differently_disagree(agree_cluster):
    for process, report in enumerate(agree_cluster):
        lines = report["expression"]["error"].split("\n")
        assert lines[0] == "from_process_local: the processes disagree: [0] against [1]"
        assert "  process 0: dtype=float32, expression=b d -> b* d, global shape=[8, 4]" in lines
        assert "  process 1: dtype=float32, expression=b d -> b4 d 2, global shape=[8, 4]" in lines
        assert lines[-1] == f"  in process {process} of 2"


@pytest.mark.parametrize("block", ["11", "01"])
def test_the_block_whose_values_differ_is_named(agree_cluster, block):
    for process, report in enumerate(agree_cluster):
        lines = report[f"values_{block}"]["error"].split("\n")
        assert lines[0] == (
            f"from_process_local: the processes hold different values for block ({block[0]}, {block[1]}): "
            "[0] against [1]"
        )
        assert lines[-1] == f"  in process {process} of 2"


def test_values_are_checked_only_when_asked(agree_cluster):
    for report in agree_cluster:
        assert "ok" in report["values_unchecked"]  # JAX takes each process's blocks as they are


def test_a_failing_process_tells_the_others(agree_cluster):
    own = agree_cluster[1]["one_fails"]["error"]
    assert own.startswith("axis 0 of the local part has size 3, which does not divide into the 4 blocks")
    told = agree_cluster[0]["one_fails"]["error"].split("\n")
    assert told[0] == (
        "from_process_local: process 1 failed: axis 0 of the local part has size 3, which does not "
        "divide into the 4 blocks this process holds"
    )


def test_a_process_that_never_arrives_times_out(agree_cluster):
    message = agree_cluster[0]["absent"]["error"]
    assert message.split("\n")[0] == "from_process_local: process 1 did not reach this call within 3 s"
    assert 3 <= agree_cluster[0]["absent_seconds"] < 30


def test_an_unreachable_coordinator_ends_the_process_after_its_timeout():
    """JAX's behaviour, which docs/multihost.md shows: initialize gives up after initialization_timeout."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(WORKER), "1", str(free_port()), "nocoordinator"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    seconds = time.monotonic() - started
    if result.returncode == SKIP:
        pytest.skip("gloo CPU collectives are not available in this JAX")
    assert result.returncode != 0 and parse(result.stdout) is None
    assert "DEADLINE_EXCEEDED" in result.stderr, result.stderr[-2000:]
    assert "Terminating process because the JAX distributed service detected fatal errors" in result.stderr
    assert 5 <= seconds < 60
