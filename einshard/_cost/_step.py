"""``explain_step``: what a compiled step costs — collectives, bytes, memory, flops and time.

The step is compiled for its arguments' shardings with public JAX calls
(``jax.jit(fn).lower(...).compile()``, ``.as_text()``, ``.memory_analysis()``,
``.cost_analysis()``); ``_hlo`` reads the program text. With ``n_devices=N`` the same happens in
a child process with ``N`` simulated CPU devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import math
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._language._errors import EinshardError
from .._language._text import size_text as _size
from .._language._text import table_text
from .._trees._paths import path_string
from .._trees._rules import RulesLike
from . import _hlo

__all__ = ["StepReport", "StepRow", "explain_step"]

# Ring algorithms: bytes each device sends per run, as a multiple of the buffer, and the number
# of sequential steps (each paying the latency once), for a group of n devices.
_RING = {
    "all-reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all-gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "reduce-scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all-to-all": (lambda n: (n - 1) / n, lambda n: n - 1),
    "collective-permute": (lambda n: 1.0, lambda n: 1),
}
KINDS = tuple(_RING)


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One collective of a compiled step (one array of a combined collective).

    Attributes:
        kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
            ``collective-permute``.
        dtype: The element type, as XLA names it (``f32``, ``bf16``, ...).
        shape: The array's shape on each device: the result of an all-gather, the input of a
            reduce-scatter, the array of the others.
        bytes: The bytes of that array on each device, per run.
        group_size: How many devices take part in each group.
        axes: The mesh axes the groups run over (``None`` when they are not whole axes).
        times: How many times it runs per step (a loop body: its trip count).
        times_known: False when it is inside a loop whose trip count XLA does not know
            (counted once).
        traffic: The bytes each device sends per step, by the ring formula, over all runs.
        seconds: The estimated time over all runs at the report's bandwidth and latency, or
            ``None`` without a bandwidth.
        phase: ``forward``, ``backward``, ``optimizer`` or ``""``, from JAX's op name.
        op_name: JAX's name of the operation it serves.
        source: ``file:line`` of the user code, or ``None``.
        param: The path of the parameter it gathers or whose gradient it reduces, or ``None``.
        instruction: The HLO instruction (rows of one combined collective share it).
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    axes: tuple[str, ...] | None
    times: int
    times_known: bool
    traffic: int
    seconds: float | None
    phase: str
    op_name: str
    source: str | None
    param: str | None
    instruction: str

    @property
    def total_bytes(self) -> int:
        """``bytes * times``: the array's bytes over all runs of the step."""
        return self.bytes * self.times


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one compiled step costs on each device; ``str(report)`` is a table.

    The totals are sums over :attr:`rows` (``total_bytes`` of each row, ``traffic``,
    ``seconds``), so a row's share is its part of them.

    Attributes:
        rows: One :class:`StepRow` per collective (per array of a combined one), program order.
        n_devices: The device count the step was compiled for.
        mesh: The mesh the groups are read onto, as ``((axis, size), ...)``.
        collectives: How many collective instructions run (a combined one counts once).
        bytes: The bytes of all collectives' arrays per device per step (``sum(row.total_bytes)``).
        bytes_by_kind: ``bytes``, by kind.
        traffic: The bytes each device sends per step (ring formulas).
        flops: Floating-point operations per device per step (XLA's cost analysis), or ``None``.
        argument_bytes: Per device: the arguments' buffers.
        output_bytes: The outputs' buffers.
        alias_bytes: Output bytes that reuse (donated) argument buffers.
        temp_bytes: Temporaries at the peak.
        peak_bytes: ``argument + output - alias + temp``: memory per device at the peak.
        bandwidth: Bytes per second per device the estimate assumes, or ``None``.
        latency: Seconds per step of a ring algorithm the estimate assumes.
        flops_per_second: Peak FLOP/s per device for the compute estimate, or ``None``.
        communication_seconds: Estimated communication time per step (sum of the rows), or ``None``.
        compute_seconds: ``flops / flops_per_second``, or ``None``.
        compile_seconds: How long lowering and compiling took.
        analysis_seconds: How long reading the program and attributing the rows took.
    """

    rows: tuple[StepRow, ...]
    n_devices: int
    mesh: tuple[tuple[str, int], ...]
    collectives: int
    bytes: int
    bytes_by_kind: dict[str, int]
    traffic: int
    flops: float | None
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    peak_bytes: int | None
    bandwidth: float | None
    latency: float
    flops_per_second: float | None
    communication_seconds: float | None
    compute_seconds: float | None
    compile_seconds: float
    analysis_seconds: float

    @property
    def step_seconds(self) -> float | None:
        """Communication plus compute, without overlap (an upper bound), when both are estimated."""
        if self.communication_seconds is None or self.compute_seconds is None:
            return None
        return self.communication_seconds + self.compute_seconds

    @property
    def communication_bound(self) -> bool | None:
        """Whether communication is estimated to take longer than compute."""
        if self.communication_seconds is None or self.compute_seconds is None:
            return None
        return self.communication_seconds > self.compute_seconds

    def at(
        self,
        *,
        bandwidth: float | None = None,
        latency: float | None = None,
        flops_per_second: float | None = None,
    ) -> StepReport:
        """The same report, estimated at another bandwidth, latency or FLOP/s (no recompile)."""
        return _estimated(
            self,
            bandwidth if bandwidth is not None else self.bandwidth,
            latency if latency is not None else self.latency,
            flops_per_second if flops_per_second is not None else self.flops_per_second,
        )

    def __str__(self) -> str:
        return table_text(*_columns(self), empty="no collectives")


# --- the public entry -------------------------------------------------------------------------------


def explain_step(
    fn: Callable[..., Any] | str,
    *args: Any,
    n_devices: int | None = None,
    rules: RulesLike | None = None,
    bandwidth: float | None = None,
    latency: float = 0.0,
    flops_per_second: float | None = None,
    **kwargs: Any,
) -> StepReport:
    """Compiles ``fn(*args, **kwargs)`` for its arguments' shardings and reports what it costs.

    Every collective XLA's partitioner inserted becomes a row (kind, bytes per device, mesh
    axes, how often it runs, the source line, and the parameter it serves where the data flow
    says so), with memory per device and flops from the compiled program, and an estimated
    communication time at ``bandwidth`` with the ring formulas (see the "What does my table
    cost?" page).

    Args:
        fn: The step. A plain function is compiled with ``jax.jit`` (leaves that are not arrays
            are held static, as ``equinox.filter_jit`` does); a function with a ``lower``
            method (``jax.jit``, ``equinox.filter_jit`` ...) is lowered as it is, keeping its own
            shardings and donation. A ``'module:function'`` string is imported.
        *args: The arguments: arrays, or ``jax.ShapeDtypeStruct`` leaves carrying shardings
            (nothing is allocated for those), in any pytree.
        n_devices: Compile in a child process with this many simulated CPU devices instead
            (``fn`` and the arguments must pickle; shardings come from ``rules``, see the page).
        rules: A rule table giving the arguments their shardings, by the paths
            ``name/key/...`` of ``fn``'s parameter names (``params/layers/0/kernel``).
        bandwidth: Bytes per second each device sends, for the communication estimate.
        latency: Seconds per step of a ring algorithm.
        flops_per_second: Peak FLOP/s per device, for the compute estimate.
        **kwargs: Keyword arguments of ``fn``.

    Returns:
        A :class:`StepReport`.

    Raises:
        EinshardError: When ``fn`` or the arguments cannot cross into the child process, or
            ``n_devices`` is not a positive integer, or as ``rules`` would.

    >>> import jax, jax.numpy as jnp, einshard
    >>> w = einshard.einshard(jnp.ones((64, 32)), 'x y -> x* y')
    >>> report = einshard.explain_step(lambda w: w.sum(0), w)
    >>> [(row.kind, row.bytes, row.group_size) for row in report.rows]
    [('all-reduce', 128, 8)]
    """
    if n_devices is not None:
        if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
            raise EinshardError(
                f"n_devices must be a positive integer, not {n_devices!r}",
                hint="Give the device count to plan for, e.g. n_devices=64.",
            )
        report = _in_child(fn, args, kwargs, n_devices, rules)
        return report.at(bandwidth=bandwidth, latency=latency, flops_per_second=flops_per_second)
    report = _compile_and_read(_resolve(fn), args, kwargs, rules)
    return _estimated(report, bandwidth, latency, flops_per_second)


def _resolve(fn: Callable[..., Any] | str) -> Callable[..., Any]:
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as error:
        raise EinshardError(
            f"cannot import the step {fn!r}: {error}",
            hint="Name a module-level function as 'package.module:function', importable from sys.path.",
        ) from None
    return target


# --- compiling --------------------------------------------------------------------------------------


def _is_array(leaf: Any) -> bool:
    import jax
    import numpy as np

    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def _named(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[list[str], Any]:
    """Names for the top-level arguments (``fn``'s parameter names where it has them)."""
    names = [str(i) for i in range(len(args))]
    target = getattr(fn, "__wrapped__", fn)
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, parameter in enumerate(positional[: len(args)]):
        names[i] = parameter.name
    if parameters and parameters[0].kind == parameters[0].VAR_POSITIONAL:
        names = [f"{parameters[0].name}/{i}" for i in range(len(args))]
    return names + list(kwargs), list(args) + list(kwargs.values())


def _leaf_paths(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of the arguments, in ``jit``'s flattening order."""
    import jax

    names, _ = _named(fn, args, kwargs)
    out = []
    for name, value in zip(names[: len(args)], args, strict=True):
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            out.append((f"{name}/{path_string(path)}" if path else name, leaf))
    for name in sorted(kwargs):  # jit flattens the keyword dict in key order
        for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs[name])[0]:
            out.append((f"{name}/{path_string(path)}" if path else name, leaf))
    return out


def _jax_names(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[str]:
    """The names JAX gives the leaves in the program's metadata: ``params['w1']``."""
    import jax

    names, _ = _named(fn, args, kwargs)
    out = []
    for name, value in zip(names[: len(args)], args, strict=True):
        out += [
            f"{name}{jax.tree_util.keystr(path)}"
            for path, _ in jax.tree_util.tree_flatten_with_path(value)[0]
        ]
    for name in sorted(kwargs):
        out += [
            f"{name}{jax.tree_util.keystr(p)}"
            for p, _ in jax.tree_util.tree_flatten_with_path(kwargs[name])[0]
        ]
    return out


def _parameter_paths(module: _hlo.Module, paths: list[str], jax_names: list[str]) -> list[str | None]:
    """The path of each parameter of the program, by position.

    ``jax.jit`` drops unused arguments from the program (``keep_unused=False``); then the
    positions shift, and each parameter is found by the name JAX wrote in its metadata.
    """
    parameters = {
        int(i.operands[0]): i
        for i in module.computations[module.entry]
        if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()
    }
    if len(parameters) == len(paths):
        return list(paths)
    by_name = dict(zip(jax_names, paths, strict=True))
    count = max(parameters, default=-1) + 1
    return [by_name.get(module.source(parameters[k])[0]) if k in parameters else None for k in range(count)]


def _with_rules(fn: Callable[..., Any], args: tuple, kwargs: dict, rules: RulesLike) -> tuple[tuple, dict]:
    """The arguments as ``ShapeDtypeStruct`` leaves with the shardings the rules give them."""
    import jax

    from .._trees._pytrees import pytree_shardings

    names, values = _named(fn, args, kwargs)

    def abstract(leaf: Any) -> Any:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if _is_array(leaf) else leaf

    def nest(flat: dict[str, Any]) -> Any:
        # Paths 'name/...': a dict keyed by name. Names with '/' (varargs) are nested one level.
        tree: dict[str, Any] = {}
        for name, value in flat.items():
            head, _, tail = name.partition("/")
            if tail:
                tree.setdefault(head, {})[tail] = value
            else:
                tree[name] = value
        return tree

    abstract_values = [jax.tree_util.tree_map(abstract, v) for v in values]
    tree = nest(dict(zip(names, abstract_values, strict=True)))
    shardings = pytree_shardings(tree, rules)

    def placed(value: Any, sharding: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda leaf, s: (
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s) if _is_array(leaf) else leaf
            ),
            value,
            sharding,
            is_leaf=lambda x: x is None,
        )

    out = []
    for name, value in zip(names, abstract_values, strict=True):
        head, _, tail = name.partition("/")
        sharding = shardings[head][tail] if tail else shardings[name]
        out.append(placed(value, sharding))
    return tuple(out[: len(args)]), dict(zip(kwargs, out[len(args) :], strict=True))


def _compile(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, int]:
    """Compiles the step; returns the compiled program and the number of array leaves."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    if callable(getattr(fn, "lower", None)):
        compiled = fn.lower(*args, **kwargs).compile()
        # jax.jit and nnx.jit give JAX's Compiled; equinox.filter_jit wraps it without as_text,
        # so such a step is compiled below, inside a jit of our own, like any function.
        if callable(getattr(compiled, "as_text", None)):
            return compiled, len(dynamic)

    def flat(*arrays: Any) -> Any:
        full = list(leaves)
        for i, array in zip(dynamic, arrays, strict=True):
            full[i] = array
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        # Outputs that are not arrays (an Equinox module's functions) stay out of the program.
        return [
            leaf
            for leaf in jax.tree_util.tree_leaves(fn(*call_args, **call_kwargs))
            if isinstance(leaf, jax.Array)
        ]

    flat.__name__ = getattr(fn, "__name__", "step")
    return jax.jit(flat, keep_unused=True).lower(*[leaves[i] for i in dynamic]).compile(), len(dynamic)


def _mesh_of(compiled: Any, n: int) -> tuple[tuple[tuple[str, int], ...], list[int]]:
    """The mesh the arguments live on (axis names and sizes) and each partition's flat position."""
    import jax

    shardings = []
    for attribute in ("input_shardings", "output_shardings"):
        try:
            shardings += jax.tree_util.tree_leaves(getattr(compiled, attribute))
        except Exception:
            continue
    for sharding in shardings:
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "size", 0) == n and hasattr(mesh, "devices"):
            axes = tuple((str(name), int(size)) for name, size in mesh.shape.items())
            order = [d.id for d in mesh.devices.flat]
            assignment = _device_assignment(sharding, n)
            if assignment is not None and sorted(assignment) == sorted(order):
                position = {device: i for i, device in enumerate(order)}
                return axes, [position[device] for device in assignment]
            return axes, list(range(n))
    return (("devices", n),), list(range(n))


def _device_assignment(sharding: Any, n: int) -> list[int] | None:
    # The partition -> device order of a jit is that of its first sharding's device list.
    devices = getattr(sharding, "_device_assignment", None)
    if devices is None or len(devices) != n:
        return None
    return [d.id for d in devices]


def _axes(
    groups: Sequence[Sequence[int]], mesh: tuple[tuple[str, int], ...], positions: list[int]
) -> tuple[str, ...] | None:
    """The mesh axes a collective's groups run over, or ``None`` when they are not whole axes."""
    sizes = [size for _, size in mesh]

    def coords(partition: int) -> tuple[int, ...]:
        flat = positions[partition] if partition < len(positions) else partition
        out = []
        for size in reversed(sizes):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    varying: set[int] = set()
    for group in groups:
        points = [coords(p) for p in group]
        for axis in range(len(sizes)):
            if len({c[axis] for c in points}) > 1:
                varying.add(axis)
    span = math.prod(sizes[a] for a in varying)
    for group in groups:
        points = {coords(p) for p in group}
        if len(points) != span:
            return None
        fixed = {tuple(c[a] for a in range(len(sizes)) if a not in varying) for c in points}
        if len(fixed) != 1:
            return None
    return tuple(mesh[a][0] for a in sorted(varying))


def _compile_and_read(
    fn: Callable[..., Any], args: tuple, kwargs: dict, rules: RulesLike | None
) -> StepReport:
    if rules is not None:
        args, kwargs = _with_rules(fn, args, kwargs, rules)
    paths = _leaf_paths(fn, args, kwargs)
    array_paths = [path for path, leaf in paths if _is_array(leaf)]
    jax_names = [
        name
        for (path, leaf), name in zip(paths, _jax_names(fn, args, kwargs), strict=True)
        if _is_array(leaf)
    ]
    start = time.perf_counter()
    compiled, _ = _compile(fn, args, kwargs)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    text = compiled.as_text()
    module = _hlo.parse_module(text)
    n = module.num_partitions
    mesh, positions = _mesh_of(compiled, n)
    rows = _rows(module, mesh, positions, _parameter_paths(module, array_paths, jax_names))
    memory = _memory(compiled)
    flops = _flops(compiled)
    analysis_seconds = time.perf_counter() - start
    return _report(rows, n, mesh, memory, flops, compile_seconds, analysis_seconds)


def _memory(compiled: Any) -> dict[str, int | None]:
    """Per-device buffer sizes from ``memory_analysis()`` (``None`` where the backend has none)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:
        stats = None
    fields = {
        "argument_bytes": "argument_size_in_bytes",
        "output_bytes": "output_size_in_bytes",
        "alias_bytes": "alias_size_in_bytes",
        "temp_bytes": "temp_size_in_bytes",
    }
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    out: dict[str, int | None] = {
        k: None if stats is None else int(getattr(stats, v)) for k, v in fields.items()
    }
    if stats is not None:
        out["peak_bytes"] = (
            out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
        )  # type: ignore[operator]
    else:
        out["peak_bytes"] = None
    return out


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


# --- rows and attribution ---------------------------------------------------------------------------

# Ops a value passes through unchanged in meaning (a parameter stays that parameter).
_THROUGH = {
    "get-tuple-element",
    "bitcast",
    "copy",
    "reshape",
    "convert",
    "transpose",
    "dynamic-slice",
    "slice",
}
# Ops that combine a gradient with same-shaped state (an optimizer update), elementwise.
_ELEMENTWISE = _THROUGH | {
    "add", "subtract", "multiply", "divide", "negate", "select", "sqrt", "rsqrt", "maximum", "minimum",
    "clamp", "power", "abs", "sign", "exponential", "log", "tanh", "all-reduce", "dynamic-update-slice",
}  # fmt: skip
_MIXING = {
    "dot",
    "convolution",
    "reduce",
    "reduce-window",
    "scatter",
    "gather",
    "sort",
    "custom-call",
    "while",
}


def _phase(op_name: str, has_grad: bool) -> str:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name or not has_grad:
        return "forward"
    return "optimizer" if "/" in op_name else ""


class _Flow:
    """Data flow of the entry computation: where values come from, where they go."""

    def __init__(self, module: _hlo.Module) -> None:
        self.module = module
        self.entry = {i.name: i for i in module.computations[module.entry]}
        self.all = module.instructions()
        self.users: dict[str, list[_hlo.Instruction]] = {}
        for instruction in self.entry.values():
            for operand in instruction.operands:
                self.users.setdefault(operand, []).append(instruction)
        self.parameters = {
            int(i.operands[0]): i
            for i in self.entry.values()
            if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()
        }
        self.simple: dict[str, bool] = {}
        for name, instructions in module.computations.items():
            self.simple[name] = not any(i.opcode in _MIXING for i in instructions)

    def passes(self, instruction: _hlo.Instruction, allowed: set[str]) -> bool:
        if instruction.opcode == "fusion":
            return all(self.simple.get(callee, False) for _, callee in instruction.called)
        return instruction.opcode in allowed

    def parameter(self, name: str, depth: int = 8) -> int | None:
        """The entry parameter a value is (through copies, reshapes, slices, simple fusions)."""
        for _ in range(depth):
            instruction = self.entry.get(name)
            if instruction is None:
                return None
            if instruction.opcode == "parameter":
                return int(instruction.operands[0]) if instruction.operands else None
            if not self.passes(instruction, _THROUGH):
                return None
            big = [o for o in instruction.operands if self._size(o) > 1]
            if len(big) != 1:
                return None
            name = big[0]
        return None

    def parameter_size(self, index: int) -> int:
        instruction = self.parameters.get(index)
        return -1 if instruction is None else self._size(instruction.name)

    def _size(self, name: str) -> int:
        instruction = self.all.get(name)
        if instruction is None:
            return 0
        shapes = instruction.shapes
        return shapes[0].size if len(shapes) == 1 else 0

    def updated(self, start: list[_hlo.Instruction], forward_read: set[int]) -> int | None:
        """The parameter a gradient updates, or ``None``.

        That is a same-sized parameter met downstream, through elementwise work; one the
        forward or backward pass reads is preferred (not an optimizer moment).
        """
        seen = {i.name for i in start}
        frontier = list(start)
        candidates: list[tuple[int, int]] = []
        for depth in range(12):
            following = []
            for instruction in frontier:
                sizes = {s.size for s in instruction.shapes}
                for operand in instruction.operands:
                    if operand in seen:
                        continue
                    parameter = self.parameter(operand)
                    if parameter is not None and self._size(operand) in sizes:
                        candidates.append((depth, parameter))
                if depth == 0 or self.passes(instruction, _ELEMENTWISE):
                    for user in self.users.get(instruction.name, ()):
                        if user.name not in seen:
                            seen.add(user.name)
                            following.append(user)
            frontier = following
            if not frontier:
                break
        preferred = [c for c in candidates if c[1] in forward_read] or candidates
        return min(preferred)[1] if preferred else None

    def forward_read(self, has_grad: bool) -> set[int]:
        """The parameters the forward or backward pass reads (through copies and gathers)."""
        out = set()
        for instruction in self.entry.values():
            if instruction.opcode != "parameter" or not instruction.operands:
                continue
            frontier, depth = [instruction], 0
            while frontier and depth < 4:
                following = []
                for value in frontier:
                    for user in self.users.get(value.name, ()):
                        op_name = self.module.source(user)[0]
                        if "jvp(" in op_name:  # forward or backward: not the optimizer's state
                            out.add(int(instruction.operands[0]))
                        if self.passes(user, _THROUGH | {"all-gather"}):
                            following.append(user)
                frontier, depth = following, depth + 1
        return out


def _rows(
    module: _hlo.Module,
    mesh: tuple[tuple[str, int], ...],
    positions: list[int],
    paths: list[str | None] | None,
) -> list[StepRow]:
    flow = _Flow(module)
    found = _hlo.collectives(module)
    # A backward pass shows as op names 'transpose(jvp(...))'; the raw text is enough to tell.
    has_grad = any(
        "transpose(" in i.attributes and "transpose(" in module.source(i)[0]
        for instructions in module.computations.values()
        for i in instructions
    )
    forward_read = flow.forward_read(has_grad) if has_grad and paths is not None else set()
    rows = []
    for collective in found:
        instruction = collective.instruction
        op_name, file, line = module.source(instruction)
        group_size = len(collective.groups[0]) if collective.groups else 1
        axes = _axes(collective.groups, mesh, positions)
        inputs = [s for s in (_operand_shape(flow, o) for o in instruction.operands) if s is not None]
        outputs = list(instruction.shapes)
        if instruction.opcode.endswith("-start") or len(outputs) != len(inputs):
            outputs = [_output_of(collective.kind, s, instruction, group_size) for s in inputs]
        for index, (source_shape, result_shape) in enumerate(zip(inputs, outputs, strict=False)):
            shape = result_shape if collective.kind == "all-gather" else source_shape
            param = None
            if paths is not None and module.entry == instruction.computation:
                operand = instruction.operands[index] if index < len(instruction.operands) else None
                parameter = flow.parameter(operand) if operand is not None else None
                if parameter is not None and flow.parameter_size(parameter) != flow._size(operand or ""):
                    parameter = None  # a value computed from a parameter is not that parameter
                backward = _phase(op_name, has_grad) == "backward"
                if parameter is None and collective.kind in ("all-reduce", "reduce-scatter") and backward:
                    start = [instruction]
                    if len(instruction.shapes) > 1:
                        start = [
                            u for u in flow.users.get(instruction.name, ())
                            if u.opcode == "get-tuple-element" and u.attribute("index") == str(index)
                        ]  # fmt: skip
                    parameter = flow.updated(start, forward_read) if start else None
                if parameter is not None and parameter < len(paths):
                    param = paths[parameter]
            phase, source = _phase(op_name, has_grad), f"{file}:{line}" if file is not None else None
            if not phase:  # a resharding of an argument: it serves its first user
                phase, source = _user_phase(flow, instruction, has_grad, source)
            fraction, _ = _RING[collective.kind]
            rows.append(
                StepRow(
                    kind=collective.kind,
                    dtype=shape.dtype,
                    shape=shape.dims,
                    bytes=shape.bytes,
                    group_size=group_size,
                    axes=axes,
                    times=collective.times,
                    times_known=collective.times_known,
                    traffic=round(fraction(group_size) * shape.bytes) * collective.times
                    if group_size > 1
                    else 0,
                    seconds=None,
                    phase=phase,
                    op_name=op_name,
                    source=source,
                    param=param,
                    instruction=instruction.name,
                )
            )
    return rows


def _user_phase(
    flow: _Flow, instruction: _hlo.Instruction, has_grad: bool, source: str | None
) -> tuple[str, str | None]:
    frontier = [instruction]
    for _ in range(6):
        following = []
        for value in frontier:
            for user in flow.users.get(value.name, ()):
                op_name, file, line = flow.module.source(user)
                phase = _phase(op_name, has_grad)
                if phase:
                    return phase, source or (f"{file}:{line}" if file is not None else None)
                following.append(user)
        frontier = following
    return "", source


def _operand_shape(flow: _Flow, name: str) -> _hlo.Shape | None:
    instruction = flow.all.get(name)
    if instruction is None:
        return None
    shapes = instruction.shapes
    if len(shapes) == 1:
        return shapes[0]
    return None


def _output_of(kind: str, shape: _hlo.Shape, instruction: _hlo.Instruction, n: int) -> _hlo.Shape:
    dims = list(shape.dims)
    dimension = instruction.attribute("dimensions")
    axis = int(dimension.strip("{}").split(",")[0]) if dimension and dimension.strip("{}") else 0
    if kind == "all-gather" and dims:
        dims[axis] *= n
    elif kind == "reduce-scatter" and dims:
        dims[axis] //= n
    return _hlo.Shape(shape.dtype, tuple(dims))


def _report(
    rows: list[StepRow],
    n: int,
    mesh: tuple[tuple[str, int], ...],
    memory: dict[str, int | None],
    flops: float | None,
    compile_seconds: float,
    analysis_seconds: float,
) -> StepReport:
    by_kind: dict[str, int] = {}
    for row in rows:
        by_kind[row.kind] = by_kind.get(row.kind, 0) + row.total_bytes
    return StepReport(
        rows=tuple(rows),
        n_devices=n,
        mesh=mesh,
        collectives=len({row.instruction for row in rows}),
        bytes=sum(row.total_bytes for row in rows),
        bytes_by_kind=by_kind,
        traffic=sum(row.traffic for row in rows),
        flops=flops,
        argument_bytes=memory["argument_bytes"],
        output_bytes=memory["output_bytes"],
        alias_bytes=memory["alias_bytes"],
        temp_bytes=memory["temp_bytes"],
        peak_bytes=memory["peak_bytes"],
        bandwidth=None,
        latency=0.0,
        flops_per_second=None,
        communication_seconds=None,
        compute_seconds=None,
        compile_seconds=compile_seconds,
        analysis_seconds=analysis_seconds,
    )


def _estimated(
    report: StepReport, bandwidth: float | None, latency: float, flops_per_second: float | None
) -> StepReport:
    rows = []
    started: set[str] = set()
    for row in report.rows:
        seconds = None
        if bandwidth is not None:
            _, steps = _RING[row.kind]
            # The arrays of a combined collective travel together: its latency is paid once.
            hops = steps(row.group_size) if row.group_size > 1 and row.instruction not in started else 0
            started.add(row.instruction)
            seconds = row.traffic / bandwidth + row.times * hops * latency
        rows.append(dataclasses.replace(row, seconds=seconds))
    communication = sum(r.seconds for r in rows if r.seconds is not None) if bandwidth is not None else None
    compute = report.flops / flops_per_second if flops_per_second and report.flops is not None else None
    return dataclasses.replace(
        report,
        rows=tuple(rows),
        bandwidth=bandwidth,
        latency=latency,
        flops_per_second=flops_per_second,
        communication_seconds=communication,
        compute_seconds=compute,
    )


# --- a device count this machine does not have -----------------------------------------------------


def _portable(value: Any) -> Any:
    """Arrays become plain ``ShapeDtypeStruct``s: their shardings name devices of this process."""
    import jax

    return jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if _is_array(leaf) else leaf, value
    )


def _in_child(
    fn: Callable[..., Any] | str,
    args: tuple,
    kwargs: dict,
    n_devices: int,
    rules: RulesLike | None,
    tables: Sequence[RulesLike] | None = None,
) -> Any:
    """The report, compiled in a child process; with ``tables``, one answer per table (the planner).

    An answer is ``('ok', report)`` or ``('error', EinshardError or text)``, so one table that
    does not fit does not lose the others.
    """
    payload = {"fn": fn, "args": _portable(args), "kwargs": _portable(kwargs), "rules": rules}
    if tables is not None:
        payload["tables"] = list(tables)
    # A step defined in the script being run lives in __main__: the child runs that file as
    # __mp_main__ first, as multiprocessing's spawn does, so that pickle finds it there.
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    main_path = os.path.abspath(main_file) if main_file and main_file.endswith(".py") else None
    try:
        data = pickle.dumps(payload)
        if b"__main__" not in data:  # nothing from the running script: the child need not run it
            main_path = None
        data = pickle.dumps(main_path) + data
    except Exception as error:
        raise EinshardError(
            f"the step cannot cross into a child process with {n_devices} devices: {error}",
            hint="Give the step as an importable 'module:function' string (or a module-level function), "
            "and arguments that pickle: arrays or ShapeDtypeStructs in ordinary pytrees; "
            "give their shardings with rules=.",
        ) from None
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(n_devices),
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n_devices}".strip(),
        "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
    }
    result = subprocess.run(
        [sys.executable, "-c", "from einshard._cost._step import _child; _child()"],
        input=data,
        capture_output=True,
        env=env,
        check=False,
    )
    if result.returncode != 0 or not result.stdout:
        raise EinshardError(
            f"the child process with {n_devices} devices failed (exit code {result.returncode})",
            hint=result.stderr.decode(errors="replace").strip()[-2000:] or None,
        )
    status, value = pickle.loads(result.stdout)
    if status == "error":
        if isinstance(value, EinshardError):
            raise value.add_context(f"in a child process with {n_devices} simulated CPU devices")
        raise EinshardError(
            f"compiling the step in a child process with {n_devices} devices failed: {value}",
            hint="Run the step on this machine first (without n_devices=) to see the error.",
        )
    return value


def _child() -> None:
    """The child process: reads the payload from stdin, writes ``(status, report)`` to stdout."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints of the step must not corrupt the answer
    import jax

    count = int(os.environ["JAX_NUM_CPU_DEVICES"])
    with contextlib.suppress(AttributeError):  # older JAX: XLA_FLAGS does it
        jax.config.update("jax_num_cpu_devices", count)
    jax.devices()  # start the backend now: the parent's script may set XLA_FLAGS when it runs
    try:
        stream = io.BytesIO(sys.stdin.buffer.read())
        main_path = pickle.load(stream)
        if main_path is not None:
            import runpy
            import types

            main = types.ModuleType("__mp_main__")
            main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
            sys.modules["__main__"] = sys.modules["__mp_main__"] = main
        payload = pickle.load(stream)
        fn = _resolve(payload["fn"])
        if "tables" in payload:
            answer: tuple[str, Any] = (
                "ok",
                [_answer(fn, payload["args"], payload["kwargs"], t) for t in payload["tables"]],
            )
        else:
            answer = ("ok", _compile_and_read(fn, payload["args"], payload["kwargs"], payload["rules"]))
    except EinshardError as error:
        answer = ("error", error)
    except Exception as error:
        answer = ("error", f"{type(error).__name__}: {error}")
    out.write(pickle.dumps(answer))
    out.flush()


def _answer(fn: Callable[..., Any], args: tuple, kwargs: dict, rules: RulesLike) -> tuple[str, Any]:
    """``('ok', report)`` or ``('error', EinshardError or text)`` for one table."""
    try:
        return ("ok", _compile_and_read(fn, args, kwargs, rules))
    except EinshardError as error:
        return ("error", error)
    except Exception as error:
        return ("error", f"{type(error).__name__}: {error}")


# --- the table --------------------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if value >= scale or unit == "ns":
            return f"{value / scale:.3g} {unit}"
    raise AssertionError("unreachable")


def _columns(report: StepReport) -> tuple[list[str], list[list[str]], list[str]]:
    header = ["kind", "array", "per device", "group", "axes", "times", "phase", "parameter", "source"]
    estimate = report.bandwidth is not None
    if estimate:
        header.insert(6, "time")
    body = []
    for row in report.rows:
        source = row.source.rsplit("/", 1)[-1] if row.source else "-"
        line = [
            row.kind,
            f"{row.dtype}{list(row.shape)}",
            _size(row.bytes),
            str(row.group_size),
            ",".join(row.axes) if row.axes is not None else "?",
            f"{row.times}" + ("" if row.times_known else "?"),
            row.phase or "-",
            row.param or "-",
            source,
        ]
        if estimate:
            line.insert(6, _seconds(row.seconds))
        body.append(line)
    kinds = ", ".join(f"{kind} {_size(b)}" for kind, b in report.bytes_by_kind.items())
    mesh = " × ".join(f"{name}={size}" for name, size in report.mesh)
    footer = [
        f"{report.collectives} collective{'' if report.collectives == 1 else 's'} "
        f"on {report.n_devices} devices (mesh {mesh}): {_size(report.bytes)} per device per step"
        + (f" ({kinds})" if kinds else ""),
    ]
    if report.peak_bytes is not None:
        footer.append(
            f"memory per device: {_size(report.peak_bytes)} at the peak "
            f"(arguments {_size(report.argument_bytes or 0)}, outputs {_size(report.output_bytes or 0)}, "
            f"aliased {_size(report.alias_bytes or 0)}, "
            f"temporaries {_size(report.temp_bytes or 0)})"
        )
    if report.flops is not None:
        footer.append(f"flops per device: {report.flops:.3g}")
    if report.communication_seconds is not None:
        text = (
            f"estimate at {report.bandwidth / 1e9:g} GB/s, latency {_seconds(report.latency)}: "
            f"communication {_seconds(report.communication_seconds)}"
        )
        if report.compute_seconds is not None:
            bound = "communication" if report.communication_bound else "compute"
            text += (
                f", compute {_seconds(report.compute_seconds)} at {report.flops_per_second:.3g} FLOP/s: "
                f"{bound}-bound"
            )
        footer.append(text)
    return header, body, footer
