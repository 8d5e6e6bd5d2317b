"""A child process that places arrays by einshard expressions and runs them through one jit.

Run by ``tests/test_meet.py`` as ``python tests/meet_worker.py N_DEVICES PARTITIONER``
(``shardy`` or ``gspmd``). It reads one JSON case per line on stdin and answers one
JSON line on stdout. It lives in its own process because XLA aborts the whole
process on some layouts (see the known limits on the expressions page), and the
test must see that abort, not die of it.

A case: ``{"exprs": [...], "op": "add", "input": "array" | "struct",
"ambient": null | [[name, size], ...], "axis_types": "auto" | "explicit"}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import einshard
from einshard._sharding import _mesh

N_DEVICES = 0  # set by main(), before JAX starts its backend

# Each op takes the placed arrays and returns the inputs and the results, so every
# input's layout must also be expressible on the mesh JAX writes the outputs on.
OPS = {
    "add": lambda *xs: sum(xs[1:], xs[0]),
    "matmul": lambda a, b: a @ b.T,
    "einsum": lambda a, b: jnp.einsum("ij,kj->ik", a, b),
    "concat": lambda *xs: jnp.concatenate(xs, axis=0),
    "reduce": lambda a, b: ((a * b).sum(axis=0), a.sum(), b.max(axis=1)),
}


def _numpy(op: str, arrays: list[np.ndarray]) -> object:
    if op == "add":
        return sum(arrays[1:], arrays[0])
    if op == "matmul":
        return arrays[0] @ arrays[1].T
    if op == "einsum":
        return np.einsum("ij,kj->ik", arrays[0], arrays[1])
    if op == "concat":
        return np.concatenate(arrays, axis=0)
    a, b = arrays
    return ((a * b).sum(axis=0), a.sum(), b.max(axis=1))


def run(case: dict) -> dict:
    exprs, op = case["exprs"], case["op"]
    size = 2 * N_DEVICES  # every count divides the device count, so it divides this
    hosts = [
        (np.arange(size * size, dtype=np.float32).reshape(size, size) * (i + 1)) % 13
        for i in range(len(exprs))
    ]
    # Every case starts from a fresh einshard state, so its warnings are its own.
    _mesh._meshes_seen.clear()
    _mesh.layout_sharding.cache_clear()
    ambient = case.get("ambient")
    mesh = None
    if ambient:
        types = AxisType.Explicit if case.get("axis_types") == "explicit" else AxisType.Auto
        names = tuple(name for name, _ in ambient)
        mesh = jax.make_mesh(tuple(s for _, s in ambient), names, axis_types=(types,) * len(names))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                if case.get("input") == "struct":
                    placed = [
                        einshard.einshard(jax.ShapeDtypeStruct(h.shape, h.dtype), e)
                        for h, e in zip(hosts, exprs, strict=True)
                    ]
                else:
                    placed = [einshard.einshard(h, e) for h, e in zip(hosts, exprs, strict=True)]
        except einshard.EinshardError as error:
            return {"einshard_error": str(error).splitlines()[0]}
    einshard_warnings = [str(w.message) for w in caught if issubclass(w.category, einshard.EinshardWarning)]
    input_meshes = sorted({_mesh_text(p.sharding.mesh) for p in placed})
    result: dict = {"warnings": einshard_warnings, "input_meshes": input_meshes}
    fn = OPS[op]
    if case.get("axis_types") == "explicit":
        # Explicit axes: JAX asks for a layout where operands differ, so the step says it,
        # with einshard itself (a reshard inside the trace), as a user would.
        first = exprs[0]

        def fn(*xs, _op=OPS[op]):  # type: ignore[no-redef]
            return _op(xs[0], *(einshard.einshard(x, first) for x in xs[1:]))

    def step(*xs):
        return (*xs, fn(*xs))

    print(json.dumps({"compiling": True, **result}), flush=True)  # a crash after this line is XLA's
    try:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            if case.get("input") == "struct":
                compiled = jax.jit(step).lower(*placed).compile()
                shardings = jax.tree_util.tree_leaves(compiled.output_shardings)
                values_equal = None
            else:
                outputs = jax.jit(step)(*placed)
                shardings = [o.sharding for o in jax.tree_util.tree_leaves(outputs)]
                expected = jax.tree_util.tree_leaves((*hosts, _numpy(op, hosts)))
                got = jax.tree_util.tree_leaves(outputs)
                values_equal = all(
                    np.allclose(np.asarray(g), e, rtol=1e-5) for g, e in zip(got, expected, strict=True)
                )
    except Exception as error:  # JAX's own errors are results to report, not crashes
        return {**result, "jax_error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    result.update(
        values_equal=values_equal,
        outputs_named=all(isinstance(s, NamedSharding) for s in shardings),
        output_meshes=sorted({_mesh_text(s.mesh) for s in shardings if isinstance(s, NamedSharding)}),
    )
    return result


def _mesh_text(mesh: jax.sharding.Mesh) -> str:
    """A mesh's axes and flat device order, comparable across the process boundary."""
    return repr((mesh.shape_tuple, [d.id for d in mesh.devices.flat]))


def shared_mesh_text(n_devices: int) -> str:
    return _mesh_text(_mesh.device_mesh(tuple(jax.devices()), _mesh.shared_mesh_shape(n_devices)))


def main() -> None:
    global N_DEVICES
    N_DEVICES = int(sys.argv[1])
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    jax.config.update("jax_use_shardy_partitioner", sys.argv[2] == "shardy")
    print(json.dumps({"ready": jax.device_count(), "shared_mesh": shared_mesh_text(N_DEVICES)}), flush=True)
    for line in sys.stdin:
        try:
            answer = run(json.loads(line))
        except Exception:
            answer = {"worker_error": traceback.format_exc()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
