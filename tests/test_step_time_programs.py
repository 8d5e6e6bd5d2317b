"""The step time's walk on programs XLA made: every collective on the schedule, loops counted.

* The seven programs XLA's GPU compiler made for 8 real H200s (``../shared/accelerators/``):
  every row of the report is a collective of the schedule, and the walk's flops are the
  program's (one answer to how many times each part runs).
* A small scanned step compiled here for 8 compile-only TPU v5e chips, under FSDP: TPU's
  compiler prints no ``known_trip_count``, so each loop's count is read from its counter; its
  gathers run in async collective fusions, whose start and done markers the walk reads (this
  test fails loudly when the compiler stops printing them); every row is on the schedule.
* The same step for 8 compile-only H100s under data parallel: its stacked activations are
  written and its stacked weights read by async fusions (``fusion-start``), each costed at its
  layer, not its stack.

The compiled ones need XLA's GPU or TPU compiler and skip without it (``nox -s targets``
installs both); the real programs need ``../shared`` beside the clone.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._cost.hardware import _compilers, _target, _timing
from einshard._cost.pipeline._analysis import report_of_text
from einshard._cost.xla import _hlo, _hlo_kernels
from tests.test_step_time_rules import _flops_walked
from tests.test_targets import H200, STEPS, needs_gpu, needs_shared, needs_tpu

LAYERS, HIDDEN, MLP, BATCH, SEQ = 4, 256, 1024, 16, 128


def _loops(schedule) -> list[_timing.Loop]:
    found = []
    for item in schedule:
        if isinstance(item, _timing.Loop):
            found += [item, *_loops(item.items)]
    return found


def _check_walk(text: str) -> tuple[_hlo.Module, _timing.Schedule]:
    """The schedule has every row of the report, and the program's flops."""
    module = _hlo.parse_module(text)
    schedule = _timing.schedule_of(module)
    rows = {row.instruction for row in report_of_text(text).rows}
    assert rows <= _timing.collectives_of(schedule)
    assert _flops_walked(schedule) == _hlo_kernels.program_matmul_flops(module)
    return module, schedule


@needs_shared
@pytest.mark.parametrize("name", STEPS)
def test_every_collective_of_a_real_h200_program_is_on_its_schedule(name):
    _, schedule = _check_walk((H200 / f"hlo_{name}.txt").read_text())
    assert _timing.collectives_of(schedule)  # each of them has some
    assert _timing.unknown_loops(schedule) == ()


def _layer(x, p):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def _scanned_step(params, x):
    def loss(params):
        h, _ = jax.lax.scan(lambda h, p: (jax.checkpoint(_layer)(h, p), None), x, params)
        return jnp.mean(h * h)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _scanned_program(target: str, split: bool) -> str:
    """The scanned step's program for 8 compile-only devices: its weights split on their rows
    (FSDP) or replicated, the batch split."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    devices = _compilers.target_devices(_target.parse_target(target, 8))
    mesh = Mesh(np.array(devices), ("d",))
    weights = NamedSharding(mesh, P(None, "d") if split else P())
    params = {
        "w1": jax.ShapeDtypeStruct((LAYERS, HIDDEN, MLP), jnp.bfloat16, sharding=weights),
        "w2": jax.ShapeDtypeStruct((LAYERS, MLP, HIDDEN), jnp.bfloat16, sharding=weights),
    }
    x = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    return jax.jit(_scanned_step).lower(params, x).compile().as_text()


@needs_tpu
def test_a_tpu_scanned_step_s_loops_and_async_collective_fusions_are_read():
    text = _scanned_program("v5e", split=True)
    assert "known_trip_count" not in text  # what makes reading the counter needed
    module, schedule = _check_walk(text)
    loops = _loops(schedule)
    assert [(loop.times, loop.known) for loop in loops] == [(LAYERS, True), (LAYERS, True)]
    roles = [
        _hlo_kernels.chain_role(module, instruction)
        for computation in module.computations
        for instruction in module.computations[computation]
        if _hlo_kernels.fused_collective(module, instruction) is not None
    ]
    assert "start" in roles and "done" in roles, "TPU's async collective fusions lost their markers"
    starts = {item.collective for loop in loops for item in loop.items if isinstance(item, _timing.Start)}
    dones = {item.collective for loop in loops for item in loop.items if isinstance(item, _timing.Done)}
    assert starts and starts == dones
    assert _layers_checked(module, loops, "fusion") >= 3


def _layers_checked(module: _hlo.Module, loops: list[_timing.Loop], opcode: str) -> int:
    """Checks each kernel of the loops that slices a layer out of a stack, or writes one into it
    (behind bitcasts, as a fusion's root), moves at most twice the layer and its index; how many."""
    checked = 0
    for loop in loops:
        for item in loop.items:
            instruction = module.instruction(item.name) if isinstance(item, _timing.KernelRun) else None
            if instruction is None or instruction.opcode != opcode:
                continue
            body = next(name for role, name in instruction.called if role == "calls")
            fused = {i.name: i for i in module.computations[body]}
            root = next(i for i in fused.values() if i.root)
            while root.opcode == "bitcast" and root.operands[0] in fused:
                root = fused[root.operands[0]]
            if root.opcode == "dynamic-update-slice":
                stack, layer = root.shapes[0], fused[root.operands[1]].shapes[0]
            elif root.opcode == "dynamic-slice":
                stack, layer = fused[root.operands[0]].shapes[0], root.shapes[0]
            else:
                continue
            assert stack.size == LAYERS * layer.size
            assert item.bytes <= 2 * layer.bytes + 64, (item, stack, layer)
            checked += 1
    return checked


@needs_gpu
def test_a_gpu_scanned_step_s_async_fusions_cost_their_layer_not_their_stack():
    """Each ``fusion-start`` that slices a layer out of a stacked array or writes one into it
    moves at most twice the layer's bytes (and its index), never the stack's."""
    text = _scanned_program("h100", split=False)
    module, schedule = _check_walk(text)
    loops = _loops(schedule)
    assert [(loop.times, loop.known) for loop in loops] == [(LAYERS, True), (LAYERS, True)]
    assert _layers_checked(module, loops, "fusion-start") >= 3
