"""Hosts: on 16 H100s (2 hosts of 8), where each candidate's collectives run, read from the program.

* A hybrid with ``model=8``: every model-axis collective's groups are the 8 devices of one host;
  its data-axis groups are one device of each host.
* HSDP: the parameters' all-gathers stay inside a host; the gradients' reduction crosses hosts.
* A plan's footer says, per candidate, which collectives cross hosts, and the defaults of a plan
  over several hosts include HSDP.

The replica groups are read here from the program text by regular expressions (both of XLA's
forms: listed, and ``[a,b]<=[dims]T(perm)``), and each partition's host from the compiled
program's device assignment, independently of einshard's reader. The tests that compile need
XLA's GPU compiler and skip without it, as in ``tests/test_targets.py``.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import einshard
from einshard._cost.hardware import _compilers, _target
from einshard._tracing._call import StepCall
from tests import gpt_steps as gpt
from tests.test_targets import needs_gpu

TOKENS16 = jax.ShapeDtypeStruct((32, gpt.S), jnp.int32)

_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")
_GROUPS = re.compile(
    r"replica_groups=(mesh\[[^\]]*\](?:,?\s*device_ids=\([^)]*\))?\s*\{[^}]*\}|\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(text: str) -> list[list[int]]:
    """Replica groups in XLA's three forms: ``{{0,1},{2,3}}``, ``[2,8]<=[16]`` (``T(1,0)``: transposed),
    and the named mesh ``mesh['axis_0'=2,'axis_1'=8] {'axis_1'}`` (the devices varying over the
    listed axes, the others fixed; its device order after it, when not in order)."""
    if text.startswith("{"):
        return [[int(x) for x in group.split(",") if x] for group in re.findall(r"\{([\d,]*)\}", text)]
    if text.startswith("mesh["):
        axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", text.split("]")[0])]
        chosen = re.findall(r"'(\w+)'", text[text.rindex("{") :])
        assert all(":" not in name for name in chosen), text  # no sub-axes in these programs
        order = re.search(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text[text.index("]") + 1 :])
        total = math.prod(size for _, size in axes)
        ids = _iota(*order.groups()).reshape(-1) if order else np.arange(total)
        grid = ids.reshape([size for _, size in axes])
        names = [name for name, _ in axes]
        varying = [names.index(name) for name in chosen]
        fixed = [i for i in range(len(names)) if i not in varying]
        size = math.prod(axes[i][1] for i in varying)
        return grid.transpose(fixed + varying).reshape(-1, size).tolist()
    match = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    assert match, text
    rows, size, dims, perm = match.groups()
    return _iota(dims, perm).reshape(int(rows), int(size)).tolist()


def collectives(text: str) -> list[tuple[str, list[list[int]]]]:
    """Every collective of the program with its replica groups (partition numbers)."""
    out = []
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match and " = " in line:
            groups = _GROUPS.search(line)
            assert groups, line[:300]
            out.append((match.group(1), _groups(groups.group(1))))
    return out


def _program(strategy: einshard.strategies.Strategy) -> tuple[str, list[int]]:
    """The program XLA's GPU compiler makes for 16 H100s, and each partition's host."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    devices = _compilers.target_devices(_target.parse_target("h100", 16))
    call = StepCall.of(gpt.step, (gpt.gpt_params(), TOKENS16), {})
    with einshard.use_devices(devices):
        placed = call.with_rules(gpt.table(strategy, strategy.batch))
        compiled = jax.jit(gpt.step).lower(*placed.args).compile()
    sharding = jax.tree.leaves(compiled.input_shardings)[0]  # the partitions' devices, in order
    hosts = [device.process_index for device in sharding._device_assignment]
    return compiled.as_text(), hosts


def _hosts_of(group: list[int], hosts: list[int]) -> set[int]:
    return {hosts[p] for p in group}


@needs_gpu
def test_a_hybrid_s_model_axis_stays_inside_a_host():
    strategy = einshard.strategies.hybrid(
        8, step=gpt.step, params=gpt.gpt_params(), batch=TOKENS16, n_devices=16
    )
    text, hosts = _program(strategy)
    assert hosts == [0] * 8 + [1] * 8  # 2 hosts of 8, in the device order
    found = collectives(text)
    model = [groups for _, groups in found if len(groups[0]) == 8]
    data = [groups for _, groups in found if len(groups[0]) == 2]
    assert model, "no model-axis collective in the program"
    for groups in model:  # neighbours: {0..7} and {8..15}
        assert sorted(map(sorted, groups)) == [list(range(8)), list(range(8, 16))]
    for groups in data:  # one device of each host
        assert all(_hosts_of(group, hosts) == {0, 1} for group in groups)


@needs_gpu
def test_hsdp_gathers_inside_a_host_and_reduces_the_gradients_across_hosts():
    strategy = einshard.strategies.hsdp()
    assert strategy.batch == "b ... -> b* ..."
    text, hosts = _program(strategy)
    found = collectives(text)
    gathers = [groups for kind, groups in found if kind == "all-gather"]
    assert gathers, "no parameter all-gather in the program"
    for groups in gathers:
        assert all(len(_hosts_of(group, hosts)) == 1 for group in groups)
    reductions = [groups for kind, groups in found if kind in ("all-reduce", "reduce-scatter")]
    assert any(len(_hosts_of(group, hosts)) == 2 for groups in reductions for group in groups)
    # The report reads the same: its all-gathers on one host, some reduction on two.
    report = einshard.explain_step(
        gpt.step,
        gpt.gpt_params(),
        TOKENS16,
        rules=gpt.table(strategy, strategy.batch),
        target="h100",
        n_devices=16,
    )
    assert {row.hosts for row in report.rows if row.kind == "all-gather"} == {1}
    assert any(row.hosts == 2 for row in report.rows if row.kind in ("all-reduce", "reduce-scatter"))


@needs_gpu
def test_a_plan_over_two_hosts_says_what_crosses_them():
    hybrid8 = einshard.strategies.hybrid(
        8, step=gpt.step, params=gpt.gpt_params(), batch=TOKENS16, n_devices=16
    )
    tp = einshard.strategies.tensor_parallel(
        step=gpt.step, params=gpt.gpt_params(), batch=TOKENS16, n_devices=16
    )
    plan = einshard.plan(
        gpt.step,
        gpt.gpt_params(),
        TOKENS16,
        n_devices=16,
        target="h100",
        candidates=[einshard.strategies.hsdp(), hybrid8, tp],
        quiet=True,
        exhaustive=True,
    )
    lines = {line.split(":")[0]: line for line in str(plan).splitlines() if "hosts" in line and ": " in line}
    by_name = {row.name: row for row in plan.rows}
    for name in ("hsdp", "hybrid model=8", "tensor parallel"):
        crossing = [row for row in by_name[name].report.rows if row.hosts > 1]
        assert crossing, name
        kinds = {row.kind for row in crossing}
        assert all(kind in lines[name] for kind in kinds), lines[name]
    assert "its model axis stays inside a host; crosses hosts:" in lines["hybrid model=8"]
    assert "(data axis)" in lines["hybrid model=8"] and "(model axis)" not in lines["hybrid model=8"]
    assert "its model axis of 16 spans 2 hosts" in lines["tensor parallel"]
    assert "all-gather" not in lines["hsdp"]
    table = str(plan).split("estimated step time")[0].splitlines()
    assert max(len(line) for line in table) <= 150  # the table; the footer's lines wrap where shown


def test_the_defaults_over_several_hosts_include_hsdp_after_fsdp():
    names = [s.name for s in einshard.strategies.defaults(16, devices_per_host=8)]
    assert names[:4] == ["data parallel", "fsdp", "hsdp", "tensor parallel"]
    assert "hsdp" not in [s.name for s in einshard.strategies.defaults(16)]
    assert "hsdp" not in [s.name for s in einshard.strategies.defaults(8, devices_per_host=8)]
    # Its table: each leaf split over the 8 devices of a host, copied across the hosts.
    tree = {"w": jax.ShapeDtypeStruct((1024, 512), jnp.float32)}
    (row,) = einshard.explain(tree, einshard.strategies.hsdp(), n_devices=64).rows
    assert row.expression == "a b -> 8 a8 b" and row.shard_shape == (128, 512)
    layout = einshard.layout(row.expression, (1024, 512), n_devices=64)
    blocks = layout.indices((1024, 512))
    for device in range(64):  # the same block on the same position of every host
        assert blocks[device] == blocks[device % 8]
    # The 8 devices of a host hold 8 different blocks (slices as tuples: Python 3.11's are unhashable).
    assert len({tuple((i.start, i.stop) for i in blocks[device]) for device in range(8)}) == 8
