"""Compiling the step, and what the compiled program says of itself: mesh, memory, flops.

Public JAX calls only: ``jax.jit(fn).lower(...).compile()``, ``.input_shardings``,
``.memory_analysis()``, ``.cost_analysis()``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ._call import StepCall

__all__ = ["Compiled", "compile_step"]

Mesh = tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compiled step: JAX's ``Compiled`` object and how long lowering and compiling took."""

    program: Any
    seconds: float

    def text(self) -> str:
        return self.program.as_text()

    def mesh(self, n: int) -> tuple[Mesh, list[int]]:
        """The mesh the arguments live on (axis names and sizes) and each partition's flat position."""
        import jax

        shardings = []
        for attribute in ("input_shardings", "output_shardings"):
            try:
                shardings += jax.tree_util.tree_leaves(getattr(self.program, attribute))
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

    def memory(self) -> dict[str, int | None]:
        """Per-device buffer sizes from ``memory_analysis()`` (``None`` where the backend has none)."""
        try:
            stats = self.program.memory_analysis()
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
        if stats is None:
            return dict.fromkeys((*fields, "peak_bytes"), None)
        sizes = {k: int(getattr(stats, v)) for k, v in fields.items()}
        peak = sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"]
        return {**sizes, "peak_bytes": peak}

    def flops(self) -> float | None:
        """Floating-point operations per device (XLA's cost analysis), or ``None``."""
        try:
            cost = self.program.cost_analysis()
        except Exception:
            return None
        if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
            cost = cost[0] if cost else None
        if not cost or "flops" not in cost:
            return None
        return float(cost["flops"])


def _device_assignment(sharding: Any, n: int) -> list[int] | None:
    # The partition -> device order of a jit is that of its first sharding's device list.
    devices = getattr(sharding, "_device_assignment", None)
    if devices is None or len(devices) != n:
        return None
    return [d.id for d in devices]


def compile_step(call: StepCall) -> Compiled:
    """Lowers and compiles the step for its arguments' shardings.

    A step with a ``lower`` method (``jax.jit``, ``nnx.jit``) is lowered as it is, keeping its
    own shardings and donation; any other function is compiled with ``jax.jit``, its leaves that
    are not arrays held static (as ``equinox.filter_jit`` does).
    """
    import jax

    start = time.perf_counter()
    fn = call.fn
    if callable(getattr(fn, "lower", None)):
        compiled = fn.lower(*call.args, **call.kwargs).compile()
        # jax.jit and nnx.jit give JAX's Compiled; equinox.filter_jit wraps it without as_text,
        # so such a step is compiled below, inside a jit of our own, like any function.
        if callable(getattr(compiled, "as_text", None)):
            return Compiled(compiled, time.perf_counter() - start)

    def flat(*arrays: Any) -> Any:
        call_args, call_kwargs = call.rebuilt(arrays)
        # Outputs that are not arrays (an Equinox module's functions) stay out of the program.
        return [
            leaf
            for leaf in jax.tree_util.tree_leaves(fn(*call_args, **call_kwargs))
            if isinstance(leaf, jax.Array)
        ]

    flat.__name__ = getattr(fn, "__name__", "step")
    arrays = [call.leaves[i] for i in call.arrays]
    compiled = jax.jit(flat, keep_unused=True).lower(*arrays).compile()
    return Compiled(compiled, time.perf_counter() - start)
