"""What a candidate needs before it is compiled: lower bounds of its memory and its step time.

Compiling a large step for many devices takes minutes. Before compiling, each candidate gets
bounds that no program XLA makes for it can beat, from the step's jaxpr (read once, for every
candidate: :func:`step_costs`) and the candidate's layouts (known before compiling):

- **memory**: the arguments' bytes per device as the table lays them out
  (:func:`argument_bytes_per_device`), plus the largest dot result the step goes on to use,
  spread over every device, plus (when nothing is donated) the outputs spread the same way.
  XLA's peak is the arguments, plus the outputs not aliased to a donated argument, plus its
  temporaries, of which that dot result is one while it lives; every device runs the same
  program on blocks of one shape, so no device holds less than its share of a whole array.
- **time**: the step's dots at the rate the step time is simulated at (the fastest of the
  matrix units' rates its element types run at), their flops spread over every device; and the
  gradients the layout must sum over devices, on the links (``Links.least_seconds``: the bytes
  that must cross hosts on the hosts' NICs, the others on NVLink; :class:`Bounds`).

A candidate whose memory bound is over the memory per device cannot fit; one whose time bound is
slower than a candidate already compiled cannot win (``plan`` leaves both uncompiled).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from ..._arrays._leaves import is_traced, itemsize
from ..._cost.hardware._figures import Figures
from ..._cost.hardware._links import Links
from ..._tracing._call import StepCall, trace
from ..._tracing._jaxprs import CALL, SCAN, inner_jaxpr, is_backward, runs, scan_counts, var_nbytes, var_shape
from ..._trees._rules import RulesLike

__all__ = ["Bounds", "StepCosts", "argument_bytes_per_device", "bounds", "step_costs"]


def argument_bytes_per_device(call: StepCall, table: RulesLike, n_devices: int) -> int | None:
    """The bytes one device holds of the step's arguments under ``table``, before any compile.

    Every array leaf counts its block (:meth:`~einshard._language._layout.Layout.shard_shape`:
    a split axis divided, a replicated leaf whole); every device holds a block of the same shape.
    The assignment is the compile's own (:meth:`StepCall.assigned`, made once per table), so
    asking costs no second assignment. ``None`` when the table does not fit the arguments (the
    compile then says why).
    """
    assignment = call.fitted(table, n_devices)
    if assignment is None:
        return None
    return sum(block_bytes(leaf) for _, leaf in assignment.leaves if leaf is not None)


def block_bytes(leaf: Any) -> int:
    """The bytes of the block each device holds of an assigned leaf (split axes divided)."""
    return math.prod(leaf.layout.shard_shape(leaf.shape)) * itemsize(leaf.dtype)


# --- what the step computes, read once ----------------------------------------------------------

# JAX's dtype names, as XLA's text names the element types a dot runs at (_hlo_kernels.matmul_type).
_XLA_TYPES = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    "int8": "s8",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}
# Dots smaller than this on a side are left out: XLA may rewrite them as elementwise work.
_SMALL = 16
# Operations that pass a value on as it is, for following a parameter to where it is used.
_VIEWS = frozenset(
    {"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"}
)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What the step computes, read once from its jaxpr: whole arrays, before any layout.

    Attributes:
        dot_flops: The flops of the dots XLA keeps (two per multiply-add; results the step does
            not use, dots in a ``while`` or ``cond`` of unknown path and dots under 16 on a side
            left out), by the element type they run at (``'bf16'``, ``'f32'`` ...).
        output_bytes: The bytes of the step's outputs.
        largest_dot_bytes: The bytes of the largest dot result a later operation uses.
        summed: The positions (in the call's leaves) of the parameters whose gradients the step
            sums over the batch: read by a dot or a lookup with the batch in the forward pass,
            with a gradient of their size in the backward pass.
        seconds: How long tracing and reading the step took.
    """

    dot_flops: Mapping[str, float]
    output_bytes: int
    largest_dot_bytes: int
    summed: frozenset[int]
    seconds: float = 0.0


def step_costs(call: StepCall, traced: Any = None) -> StepCosts:
    """Reads the step's jaxpr (``traced``, else traced here on its abstract arguments)."""
    start = time.perf_counter()
    if traced is None:
        traced = trace(call)
    jaxpr = inner_jaxpr(traced)
    positions = list(call.arrays)
    batch = set(_batch_leaves(call))
    walk = _Walk()
    views = [positions[k] if positions[k] not in batch else None for k in range(len(jaxpr.invars))]
    tainted = [positions[k] in batch for k in range(len(jaxpr.invars))]
    walk.run(jaxpr, [True] * len(jaxpr.outvars), views, tainted, 1.0)
    summed = frozenset(
        leaf for leaf, sizes in walk.forward.items() if any(walk.backward[size] for size in sizes)
    )
    return StepCosts(
        dot_flops=dict(walk.flops),
        output_bytes=sum(var_nbytes(v) for v in jaxpr.outvars if hasattr(v, "aval")),
        largest_dot_bytes=walk.largest,
        summed=summed,
        seconds=time.perf_counter() - start,
    )


def _batch_leaves(call: StepCall) -> range:
    """The positions of the batch argument's leaves (see :attr:`StepCall.batch_name`)."""
    name = call.batch_name
    return call.argument_leaves(call.names.index(name)) if name is not None else range(0)


class _Walk:
    """One pass over the live operations of a jaxpr, into its calls and scans."""

    def __init__(self) -> None:
        self.flops: dict[str, float] = collections.defaultdict(float)
        self.largest = 0
        self.forward: dict[int, set[int]] = collections.defaultdict(set)  # leaf -> elements met
        self.backward: collections.Counter[int] = collections.Counter()  # gradient sizes made
        self.memo: dict = {}

    def run(
        self, jaxpr: Any, live_out: list[bool], views: list, tainted: list[bool], times: float
    ) -> list[bool]:
        """Walks ``jaxpr``; returns which outputs derive from the batch."""
        jaxpr = inner_jaxpr(jaxpr)
        live = _live(jaxpr, tuple(live_out), self.memo)[0]
        view: dict[Any, int] = {}
        batch: set[Any] = set()
        for var, leaf, from_batch in zip(jaxpr.invars, views, tainted, strict=True):
            if leaf is not None:
                view[var] = leaf
            if from_batch:
                batch.add(var)
        # An output may be a literal (a constant the program returns): no value of the walk's.
        needed = {
            v for v, alive in zip(jaxpr.outvars, live_out, strict=True) if alive and not hasattr(v, "val")
        }
        consumed: set[Any] = set()
        for eqn, alive in zip(jaxpr.eqns, live, strict=True):
            if alive:
                consumed.update(v for v in eqn.invars if not hasattr(v, "val"))
        needed |= consumed
        for eqn, alive in zip(jaxpr.eqns, live, strict=True):
            ins = [v if not hasattr(v, "val") else None for v in eqn.invars]
            from_batch = any(v is not None and v in batch for v in ins)
            outs_batch = [from_batch] * len(eqn.outvars)
            name = eqn.primitive.name
            if name in _VIEWS and ins and ins[0] is not None and ins[0] in view:
                view[eqn.outvars[0]] = view[ins[0]]
            elif alive and name == "dot_general":
                self._dot(eqn, ins, view, batch, times, eqn.outvars[0] in consumed)
            elif name == "gather" and ins[0] is not None and ins[0] in view and ins[1] in batch:
                if not is_backward(eqn):
                    self.forward[view[ins[0]]].add(math.prod(var_shape(ins[0])))
            elif name in ("scatter-add", "scatter_add") and is_backward(eqn):
                self.backward[math.prod(var_shape(eqn.outvars[0]))] += 1
            elif alive:
                inner_live = [v in needed for v in eqn.outvars]
                outs_batch = self._inner(eqn, ins, view, batch, times, inner_live, outs_batch)
            for var, derived in zip(eqn.outvars, outs_batch, strict=True):
                if derived:
                    batch.add(var)
        return [not hasattr(v, "val") and v in batch for v in jaxpr.outvars]

    def _dot(self, eqn: Any, ins: list, view: dict, batch: set, times: float, used: bool) -> None:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = (var_shape(v) for v in eqn.invars)
        out = var_shape(eqn.outvars[0])
        contracted = math.prod(lhs[i] for i in lc)
        free_l = math.prod(lhs[i] for i in range(len(lhs)) if i not in lc and i not in lb)
        free_r = math.prod(rhs[i] for i in range(len(rhs)) if i not in rc and i not in rb)
        if min(contracted, free_l, free_r) >= _SMALL:
            dtype = str(getattr(eqn.invars[0].aval, "dtype", ""))
            self.flops[_XLA_TYPES.get(dtype, dtype)] += 2.0 * math.prod(out) * contracted * times
            if used:
                self.largest = max(self.largest, var_nbytes(eqn.outvars[0]))
        if is_backward(eqn):
            self.backward[math.prod(out)] += 1
            return
        for mine, other in ((ins[0], ins[1]), (ins[1], ins[0])):
            if mine is not None and mine in view and other is not None and other in batch:
                self.forward[view[mine]].add(math.prod(var_shape(mine)))

    def _inner(
        self,
        eqn: Any,
        ins: list,
        view: dict,
        batch: set,
        times: float,
        live_out: list[bool],
        outs: list[bool],
    ) -> list[bool]:
        """Into a call (``jit``, ``checkpoint``, custom derivatives) or a scan; others are not read."""
        views = [view.get(v) if v is not None else None for v in ins]
        tainted = [v is not None and v in batch for v in ins]
        inner = _inner_jaxpr(eqn, live_out)
        if inner is None:
            return outs
        body, inner_live, repeats = inner
        derived = self.run(body, inner_live, views, tainted, times * repeats)
        return [a or b for a, b in zip(derived, outs, strict=True)]


def _inner_jaxpr(eqn: Any, live_out: list[bool]) -> tuple[Any, list[bool], int] | None:
    """The jaxpr an operation runs with its inputs and outputs one for one, its needed results, its runs.

    ``None`` for a ``while`` or ``cond`` (unknown trips or path), a ``shard_map`` (per-device
    shapes) or an operation without one.
    """
    called = runs(eqn)
    if called is not None and called.how == SCAN:
        _, carries = scan_counts(eqn.params, len(eqn.invars))
        # A carry may feed the next step's needed results: every carry counts as needed.
        needed = [True] * carries + list(live_out[carries:])
        return called.programs[0], needed, called.times or 1
    if called is not None and called.how == CALL:
        return called.programs[0], list(live_out), 1
    return None


def _live(jaxpr: Any, live_out: tuple[bool, ...], memo: dict) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Which operations of ``jaxpr`` the needed results (or an effect) need, and which of its inputs.

    XLA drops the others. Into calls and scans, only the inputs their needed results read.
    ``memo`` keeps the answers of one walk (a jaxpr called from many places is read once).
    """
    key = (id(jaxpr), live_out)
    if key in memo:
        return memo[key][1]
    needed = {v for v, alive in zip(jaxpr.outvars, live_out, strict=True) if alive and not hasattr(v, "val")}
    live = [False] * len(jaxpr.eqns)
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[k]
        wanted = [v in needed for v in eqn.outvars]
        if not (getattr(eqn, "effects", None) or any(wanted)):
            continue
        live[k] = True
        inner = _inner_jaxpr(eqn, wanted)
        if inner is None:
            reads = [True] * len(eqn.invars)
        else:
            body, inner_live, _ = inner
            reads = list(_live(inner_jaxpr(body), tuple(inner_live), memo)[1])
        needed.update(v for v, read in zip(eqn.invars, reads, strict=True) if read and not hasattr(v, "val"))
    answer = (tuple(live), tuple(v in needed for v in jaxpr.invars))
    memo[key] = (jaxpr, answer)  # the jaxpr is held with its answer: its id is not reused
    return answer


# --- the bounds of one candidate ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a candidate needs at least, known before compiling it.

    Attributes:
        argument_bytes: The bytes per device of the step's arguments as its table lays them out.
        memory_bytes: At least its peak memory per device: the arguments, the outputs spread over
            every device, and the largest dot result the step uses, spread the same way.
        traffic: At least the bytes each device sends: the gradients the layout must sum over
            devices holding different blocks of the batch (each device holding one of ``g``
            partial sums of a block sends at least ``(g - 1) / g`` of it, whatever the algorithm).
        network_traffic: Of those, the bytes that must cross hosts, for a target with hosts.
        seconds: At least the step's time at the figures, or ``None`` without a time: the larger
            of its dots at the matrix units' rate (flops over every device) and its traffic on
            the links.
    """

    argument_bytes: int
    memory_bytes: int
    traffic: int
    network_traffic: int = 0
    seconds: float | None = None

    def measure(self, figures: Figures) -> float:
        """What ranks a plan, at least: the step time with a bandwidth, else the bytes sent."""
        if figures.bandwidth is not None and self.seconds is not None:
            return self.seconds
        return float(self.traffic)


def bounds(
    call: StepCall, table: RulesLike, n_devices: int, costs: StepCosts | None, figures: Figures
) -> Bounds | None:
    """The candidate's bounds under ``table``, or ``None`` when the table does not fit the arguments.

    Assumes, as XLA's partitioner does, that each device computes the gradient of the batch block
    it holds, so that blocks of a parameter held by devices with different batch blocks meet in a
    sum across them (rather than every device computing the whole batch).
    """
    assignment = call.fitted(table, n_devices)
    if assignment is None:
        return None
    arguments = sum(block_bytes(leaf) for _, leaf in assignment.leaves if leaf is not None)
    if costs is None:  # the step was not traced: its arguments alone
        return Bounds(arguments, arguments, 0)
    # A donated first argument's buffers may hold the outputs (einshard's compile donates it when
    # the step returns it updated; a jitted step keeps its own donation): no floor for them then.
    donated = call.donate or callable(getattr(call.fn, "lower", None))
    outputs = 0 if donated else costs.output_bytes
    memory = arguments + (outputs + costs.largest_dot_bytes) // n_devices
    links = figures.links
    traffic, network = _gradient_sums(call, assignment, n_devices, costs.summed, links)
    return Bounds(arguments, memory, traffic, network, _seconds(costs, traffic, network, n_devices, figures))


def _gradient_sums(
    call: StepCall, assignment: Any, n_devices: int, summed: frozenset[int], links: Links | None
) -> tuple[int, int]:
    """The bytes each device sends at least to sum the gradients, all links and across hosts.

    For each block of a summed parameter: the devices holding it hold ``g`` different batch
    blocks, so ``g`` partial sums, and at least ``g - 1`` of them must leave their device (one
    send per element, however they are combined): ``(g - 1) * block`` sent in all. Every device
    runs the same program, so each sends at least ``1 / n`` of the total. Across hosts likewise,
    with the hosts whose batch blocks differ in place of devices: which host a device is on is the
    links' answer (a target's device order is its devices by id, so a layout's position is an id).
    """
    batch_leaves = [i for i in _batch_leaves(call) if assignment.leaves[i][1] is not None]
    if not batch_leaves:
        return 0, 0
    data = [
        tuple(assignment.leaves[i][1].layout.block_index(device) for i in batch_leaves)
        for device in range(n_devices)
    ]
    total = across = 0
    for position in summed:
        leaf = assignment.leaves[position][1]
        if leaf is None or not is_traced(call.leaves[position]):
            continue
        block = block_bytes(leaf)
        holders: dict[Any, list[int]] = collections.defaultdict(list)
        for device in range(n_devices):
            holders[leaf.layout.block_index(device)].append(device)
        for devices in holders.values():
            partials = len({data[d] for d in devices})
            total += (partials - 1) * block
            if links is not None:
                hosts: dict[int, set] = collections.defaultdict(set)
                for d in devices:
                    hosts[links.host(d)].add(data[d])
                sets = list(hosts.values())
                # Hosts holding the same batch blocks hold the same partial sums: count those that differ.
                if all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :]):
                    across += (len(sets) - 1) * block
    return total // n_devices, across // n_devices


def _seconds(costs: StepCosts, traffic: int, network: int, n_devices: int, figures: Figures) -> float | None:
    """The time bound at the figures: dots at the fastest rate they may run at, traffic at the links."""
    links = figures.links
    communication = links.least_seconds(traffic, network) if links is not None else None
    flops = sum(costs.dot_flops.values()) / n_devices
    hardware = figures.hardware
    if hardware is None:  # CPU devices: flops at the given rate plus communication, no overlap
        compute = flops / figures.flops_per_second if figures.flops_per_second else None
        known = [part for part in (communication, compute) if part is not None]
        return sum(known) if known else None
    if figures.flops_given and figures.flops_per_second:
        rate = figures.flops_per_second
    else:
        rates = hardware.matmul_rates()
        # A fusion's dots run at its first dot's type: any dot may run at the fastest type present.
        found = [
            rates.get(kind)
            for kind in costs.dot_flops
            for kind in (("tf32", "f32") if kind == "f32" else (kind,))
        ]
        rate = max((r for r in found if r), default=hardware.flops_per_second)
    return max(flops / rate, communication or 0.0)
