"""Compiling the step; what the compiled program and the compiler say of it.

The mesh, memory and flops, and what the compiler printed while compiling it.

Public JAX calls only: ``jax.jit(fn).lower(...).compile()``, ``.input_shardings``,
``.memory_analysis()``, ``.cost_analysis()``. XLA's C++ code prints its warnings to the
process's standard error (file descriptor 2), not through Python: the compile is run with fd 2
sent to a temporary file, which is then passed on unchanged and read.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..._tracing._call import StepCall
from ..._tracing._loops import LoopNote
from ._program import Program, step_program

__all__ = ["Compiled", "compile_step", "compiler_messages", "forget_traces"]

# What XLA prints when its partitioner replicates an array to change its layout.
REMAT_MARKER = "Involuntary full rematerialization"

Mesh = tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compiled step: JAX's ``Compiled`` object and how long lowering and compiling took."""

    program: Any
    seconds: float
    printed: tuple[str, ...] = ()
    """The rematerialization messages the compiler printed while compiling it."""
    loops: tuple[LoopNote, ...] = ()
    """The step's loops whose carry comes from the batch, and what the compile did to each."""
    donated: str | None = None
    """The argument einshard's compile donated (the step returns it updated), or ``None``."""

    def text(self) -> str:
        """The compiled program's HLO text."""
        return self.program.as_text()

    def messages(self, text: str) -> tuple[str, ...]:
        """The rematerialization messages of this program (``text``: its HLO text).

        A program JAX had compiled before comes from its cache without a compile, so without
        messages: those seen for the same program text in this process are given instead.
        """
        return _remembered(text, self.printed)

    def mesh(self, n: int) -> tuple[Mesh, list[int]]:
        """The mesh the arguments live on (axis names and sizes) and each partition's flat position."""
        for sharding in self._shardings():
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

    def device_ids(self, n: int) -> list[int] | None:
        """The id of each partition's device, or ``None`` when unknown.

        Which host each is on is the links' answer (:mod:`~einshard._cost.hardware._links`).
        """
        devices = self.partition_devices(n)
        return None if devices is None else [int(device.id) for device in devices]

    def partition_devices(self, n: int | None = None) -> list[Any] | None:
        """The device of each partition, in partition order (a list of ``n``, if given), or ``None``.

        Read from JAX's ``_device_assignment`` of the program's shardings, which has no public
        name (``device_set`` has no order): ``tests/test_step.py`` fails loudly when it goes.
        """
        for sharding in self._shardings():
            devices = getattr(sharding, "_device_assignment", None)
            if devices and (n is None or len(devices) == n):
                return list(devices)
        return None

    def _shardings(self) -> list[Any]:
        """The program's argument and result shardings: what it says of its devices."""
        import jax

        shardings: list[Any] = []
        for attribute in ("input_shardings", "output_shardings"):
            try:
                shardings += jax.tree_util.tree_leaves(getattr(self.program, attribute))
            except Exception:
                continue
        return shardings

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

    def platform(self) -> str | None:
        """The platform of the devices the program was compiled for (``'cpu'``, ``'gpu'``, ``'tpu'``)."""
        devices = self.partition_devices()
        return None if devices is None else str(devices[0].platform)

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


_CAPTURE = threading.Lock()  # fd 2 is one per process: one capture at a time


@contextlib.contextmanager
def compiler_messages() -> Iterator[list[str]]:
    """Collects the lines written to file descriptor 2 in the block; they are passed on as well.

    Python's own ``sys.stderr`` writes of the block land there too, and are passed on in order.
    Where fd 2 cannot be duplicated (a closed stderr), nothing is collected.
    """
    lines: list[str] = []
    with _CAPTURE:
        _flush_stderr()
        try:
            saved = os.dup(2)
        except OSError:
            yield lines
            return
        try:
            with tempfile.TemporaryFile() as sink:
                os.dup2(sink.fileno(), 2)
                try:
                    yield lines
                finally:
                    _flush_stderr()
                    os.dup2(saved, 2)
                    sink.seek(0)
                    data = sink.read()
                    _write_all(2, data)
                    lines += data.decode(errors="replace").splitlines()
        finally:
            os.close(saved)


def _flush_stderr() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:
            return  # the stream is gone: nothing to pass on to
        view = view[written:]


# The messages seen for each program text (the most recent programs only).
_SEEN: collections.OrderedDict[int, tuple[str, ...]] = collections.OrderedDict()
_SEEN_LIMIT = 256


def _remembered(text: str, messages: tuple[str, ...]) -> tuple[str, ...]:
    key = hash(text)
    if messages:
        _SEEN[key] = messages
        _SEEN.move_to_end(key)
        while len(_SEEN) > _SEEN_LIMIT:
            _SEEN.popitem(last=False)
        return messages
    return _SEEN.get(key, ())


def forget_traces() -> None:
    """Drops JAX's caches of traces and programs (``jax.clear_caches``), in this process."""
    import jax

    jax.clear_caches()


def compile_step(call: StepCall) -> Compiled:
    """Lowers and compiles the step for its arguments' shardings (``_program``: as training runs it).

    A step with ``lower`` and ``trace`` methods (``jax.jit``, ``nnx.jit``) is lowered as it is,
    keeping its own shardings and donation; any other function (``equinox.filter_jit`` too) is
    compiled with ``jax.jit``, its leaves that are not arrays held static (as
    ``equinox.filter_jit`` does), its first argument donated when it comes back updated, and its
    loops' batch-major carries kept in a strategy's batch layout.
    """
    start = time.perf_counter()
    with compiler_messages() as lines:
        program = step_program(call)
        compiled = _compiled(program)
        if not callable(getattr(compiled, "as_text", None)):
            # A wrapper whose compiled program has no text: compiled inside a jit of einshard's
            # own, like any function.
            program = step_program(call, own=False)
            compiled = _compiled(program)
    seconds = time.perf_counter() - start
    printed = tuple(line for line in lines if REMAT_MARKER in line)
    return Compiled(compiled, seconds, printed, program.loops, program.donated)


_RECOMPILE_OPTION = "xla_embed_ir_in_executable"


def _compiled(program: Program) -> Any:
    lowered = program.lower()
    try:
        # An option at its default value: a program JAX compiled before (the user's own call) is
        # compiled again rather than taken from the cache, so XLA speaks again.
        return lowered.compile(compiler_options={_RECOMPILE_OPTION: False})
    except Exception as error:
        if _RECOMPILE_OPTION not in str(error):
            raise  # the program's own failure (it does not fit, XLA refuses it): the first is the one
    # A backend that takes no such option: compiled as it is (from JAX's cache, if it has it).
    return lowered.compile()
