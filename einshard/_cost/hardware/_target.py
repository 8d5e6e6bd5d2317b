"""Targets: what a step report is compiled for, by name and device count.

``target='cpu'`` (the default) compiles for simulated CPU devices, as before. A GPU name
(``'a100'``, ``'h100'``, ``'h200'``, ``'b200'``) compiles with XLA's GPU compiler for ``N``
compile-only devices described by XLA's own spec of that GPU; a TPU generation (``'v5e'``,
``'v5p'``, ``'v6e'``, or a slice such as ``'v5e:2x4'``) with TPU's compiler (``libtpu``), in one
slice or several (``slices=``). :mod:`._compilers` finds the compilers and makes the devices,
:mod:`._figures` gives the target's figures.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from ..._language._errors import EinshardError, short_repr
from ._links import GPUS_PER_HOST
from ._tpu import GENERATIONS

__all__ = ["FROM_SOURCE", "GPUS", "GPU_EXTRA", "TPUS", "TPU_EXTRA", "Target", "parse_target"]

GPUS = {
    "a100": "NVIDIA A100-SXM4-80GB",
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200 141GB HBM3e",
    "b200": "NVIDIA B200",
}
"""GPU target names and the ``device_description_str`` of XLA's spec each one compiles for."""

TPUS = {name: generation.torus_dims for name, generation in GENERATIONS.items()}
"""TPU generations and the dimensions of their slices' torus."""

# The extras install from the source at hand (the package index has only an older einshard), or
# as what they stand for.
FROM_SOURCE = "in einshard's source folder (the git clone or unpacked archive it was installed from)"
GPU_EXTRA = ".[gpu-target]"
TPU_EXTRA = ".[tpu-target]"


@dataclasses.dataclass(frozen=True)
class Target:
    """What a step is compiled for: a kind of hardware and a device count.

    Attributes:
        name: ``'cpu'``, a GPU name (``'h100'``) or a TPU generation (``'v5e'``).
        platform: ``'cpu'``, ``'gpu'`` or ``'tpu'``.
        n_devices: How many devices.
        topology: The topology ``jax.experimental.topologies`` is asked for (``'1x8x8'``:
            8 hosts of 8 GPUs; ``'v5e:2x4'``: one TPU slice), or ``None`` for CPU devices.
        slices: How many TPU slices of ``topology``, joined by the data-center network (1
            but for a TPU target given ``slices=``).
    """

    name: str
    platform: str
    n_devices: int
    topology: str | None
    slices: int = 1

    @property
    def label(self) -> str:
        """``'64 H100 (1x8x8)'``, ``'32 V5E (2 slices of v5e:4x4)'``, for headlines."""
        if self.platform == "cpu":
            return f"{self.n_devices} CPU devices"
        if self.slices > 1:
            return f"{self.n_devices} {self.name.upper()} ({self.slices} slices of {self.topology})"
        return f"{self.n_devices} {self.name.upper()} ({self.topology})"

    @property
    def slice_shape(self) -> tuple[int, ...] | None:
        """A TPU slice's torus, chips per axis (``(4, 4)``), or ``None`` (not a TPU)."""
        if self.platform != "tpu" or self.topology is None:
            return None
        return tuple(int(size) for size in self.topology.partition(":")[2].split("x"))


def parse_target(target: Any, n_devices: int | None, slices: Any = None) -> Target:
    """The target a user named, with its topology for ``n_devices`` (checked, no JAX needed).

    ``slices``: how many TPU slices the ``n_devices`` are, joined by the data-center network
    (MaxText's ``num_slices``); each slice gets ``n_devices / slices`` chips (a named slice
    ``'v5e:4x4'`` is each slice's shape). ``None``: one.

    Raises:
        EinshardError: For an unknown name, a device count the topology cannot have, a
            ``'v5e:AxB'`` slice whose chip count is not ``n_devices``, or ``slices`` that is not
            a whole number above 0, given for a target that is not a TPU, or that does not
            divide ``n_devices``.
    """
    if not isinstance(target, str):
        raise EinshardError(
            f"target must be a name such as 'h100' or 'v5e', not {type(target).__name__}",
            hint=_names_hint(),
        )
    name, _, shape = target.strip().lower().partition(":")
    if slices is not None:
        return _sliced(target, name, shape, n_devices, slices)
    if name == "cpu" and not shape:
        return Target("cpu", "cpu", n_devices or 0, None)
    if name in GPUS and not shape:
        count = _needs_count(target, n_devices)
        if count <= GPUS_PER_HOST:
            topology = f"1x1x{count}"
        elif count % GPUS_PER_HOST == 0:
            topology = f"1x{count // GPUS_PER_HOST}x{GPUS_PER_HOST}"
        else:
            raise EinshardError(
                f"{count} GPUs do not fill hosts of {GPUS_PER_HOST}",
                hint=f"Give n_devices up to {GPUS_PER_HOST}, or a multiple of {GPUS_PER_HOST} "
                f"(hosts of {GPUS_PER_HOST} GPUs joined by NVLink).",
            )
        return Target(name, "gpu", count, topology)
    if name in TPUS:
        dims = TPUS[name]
        if shape:
            sizes = _slice_shape(target, shape, dims)
            count = math.prod(sizes)
            if n_devices is not None and n_devices != count:
                raise EinshardError(
                    f"target={target!r} has {count} chips, not n_devices={n_devices}",
                    hint=f"Leave n_devices out, or give n_devices={count}.",
                )
        else:
            count = _needs_count(target, n_devices)
            sizes = _squarest(count, dims)
        return Target(name, "tpu", count, f"{name}:{'x'.join(map(str, sizes))}")
    raise EinshardError(f"unknown target {target!r}", hint=_names_hint())


def _sliced(target: str, name: str, shape: str, n_devices: int | None, slices: Any) -> Target:
    """A TPU target of ``slices`` slices (:func:`parse_target`'s ``slices=``)."""
    if isinstance(slices, bool) or not isinstance(slices, numbers.Integral) or slices < 1:
        raise EinshardError(
            f"slices={short_repr(slices)} must be a whole number above 0",
            hint="Give how many TPU slices the devices are, joined by the data-center network, e.g. "
            "target='v5e', n_devices=32, slices=2 (two slices of 16 chips).",
        )
    slices = int(slices)
    if name not in TPUS:
        raise EinshardError(
            f"slices={slices} needs a TPU target, not target={target!r}",
            hint="Slices joined by the data-center network are TPUs' (MaxText's multi-slice training): "
            "give target='v5e', 'v5p' or 'v6e'. A GPU target's hosts come from n_devices= (8 GPUs each).",
        )
    if shape:
        one = parse_target(target, None)
        if n_devices is not None and n_devices != one.n_devices * slices:
            raise EinshardError(
                f"target={target!r} with slices={slices} has {one.n_devices * slices} chips, not "
                f"n_devices={n_devices}",
                hint=f"Leave n_devices out, or give n_devices={one.n_devices * slices} ({slices} slices "
                f"of {one.n_devices}).",
            )
    else:
        count = _needs_count(target, n_devices)
        if count % slices:
            raise EinshardError(
                f"n_devices={count} cannot be cut into slices={slices} slices of the same size",
                hint=f"Give n_devices a multiple of {slices} (each slice gets n_devices / slices chips), "
                f"e.g. n_devices={slices * max(1, count // slices)}.",
            )
        one = parse_target(target, count // slices)
    return dataclasses.replace(one, n_devices=one.n_devices * slices, slices=slices)


def _names_hint() -> str:
    return (
        f"Name one of 'cpu' (the default), the GPUs {', '.join(map(repr, GPUS))}, or the TPUs "
        f"{', '.join(map(repr, TPUS))} (a slice as 'v5e:2x4', 'v5p:2x2x2')."
    )


def _needs_count(target: str, n_devices: int | None) -> int:
    if n_devices is None:
        raise EinshardError(
            f"target={target!r} needs n_devices=",
            hint="Give the device count to compile for, e.g. n_devices=8 (a TPU slice may be named "
            "instead: target='v5e:2x4').",
        )
    return n_devices


def _slice_shape(target: str, shape: str, dims: int) -> tuple[int, ...]:
    parts = shape.split("x")
    if len(parts) != dims or not all(part.isdigit() and int(part) > 0 for part in parts):
        example = "x".join(["2"] * dims)
        raise EinshardError(
            f"target={target!r}: a {target.partition(':')[0]} slice is {dims} sizes joined by 'x'",
            hint=f"Write it as '{target.partition(':')[0]}:{example}'.",
        )
    return tuple(int(part) for part in parts)


def _squarest(count: int, dims: int) -> tuple[int, ...]:
    """The most nearly cubic (square) slice of ``count`` chips, smallest side first."""
    sizes = []
    rest = count
    for left in range(dims, 0, -1):
        side = max(d for d in range(1, rest + 1) if rest % d == 0 and d**left <= rest)
        sizes.append(side)
        rest //= side
    return tuple(sorted(sizes))
