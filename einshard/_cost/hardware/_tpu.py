"""The TPU generations as Google publishes them, each figure with its source, and where a chip sits.

Two sources: Google's Cloud TPU page of each generation (docs.cloud.google.com/tpu/docs/v5e,
/v5p, /v6e: a chip's peaks, HBM, ICI and DCN), and "How to Scale Your Model"
(jax-ml.github.io/scaling-book, its TPU chapter, ``tpus.md`` at commit 54e2c43 of
github.com/jax-ml/scaling-book: the rate of one ICI link in one direction, which slices wrap
around, DCN per chip where Google's page gives none, and v5p's int8 rate). The per-link rates are
slightly below Google's per-chip totals over the links (400 GB/s over 4 links both ways is 50 GB/s
one way; the book takes 45, as links carry a little less than their spec).

What a compile-only TPU device carries (libtpu's ``topologies.get_topology_desc``): ``coords``,
the chip's place in its slice's torus (three integers; a 2D generation's third is 0),
``core_on_chip`` (0: v5p's two TensorCores are one device, megacore), and, for a topology of
several slices (``num_slices=2``), ``slice_index`` (absent with one slice); device ids are then
``100000 * (slice + 1) + index``. :func:`places` reads them; ``tests/test_tpu.py`` fails loudly
when libtpu stops giving them.

No TPU time was measured: the efficiencies, the launch floor and the ICI latency of a TPU target
are a GPU's, and the report says so (``_figures.TPU_ASSUMED``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["BOOK", "GENERATIONS", "Generation", "Place", "TpuDevice", "places", "slice_sizes", "wraps"]

BOOK = (
    '"How to Scale Your Model", part 2: TPUs (jax-ml.github.io/scaling-book/tpus; '
    "github.com/jax-ml/scaling-book tpus.md at 54e2c43)"
)


def _page(name: str) -> str:
    return f"Google's Cloud TPU {name} page (docs.cloud.google.com/tpu/docs/{name})"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation's published figures per chip, each with its source.

    Attributes:
        name: ``'v5e'``, ``'v5p'``, ``'v6e'``.
        device_kind: What its devices call themselves (``device.device_kind``).
        memory_bytes: HBM per chip, as the page lists it (v5p: 95 GiB of its 96, the rest kept by
            libtpu and the system).
        memory_bandwidth: HBM bytes per second per chip.
        matmul_peaks: The matrix units' peak per element type, in FLOP/s (OP/s for ``'s8'``):
            ``'bf16'``, ``'s8'``, and the float8 types where the chip has a rate for them.
        ici_bidirectional: ICI bytes per second per chip, both directions of every link.
        ici_ports: ICI links per chip (4 on a 2D torus, 6 on a 3D one).
        link_one_way: Bytes per second one ICI link carries in one direction.
        dcn_per_chip: Bytes per second a chip sends over the data-center network to other slices.
        torus_dims: The dimensions of its torus (2 or 3).
        sources: Where each figure comes from, by attribute name.
    """

    name: str
    device_kind: str
    memory_bytes: int
    memory_bandwidth: float
    matmul_peaks: Mapping[str, float]
    ici_bidirectional: float
    ici_ports: int
    link_one_way: float
    dcn_per_chip: float
    torus_dims: int
    sources: Mapping[str, str]

    @property
    def peak_flops_per_second(self) -> float:
        """The bf16 peak."""
        return self.matmul_peaks["bf16"]


def _generation(
    name: str,
    device_kind: str,
    memory: int,
    bandwidth: float,
    peaks: Mapping[str, float],
    ici: float,
    ports: int,
    link: float,
    dcn: float,
    dims: int,
    **sources: str,
) -> Generation:
    page = _page(name)
    known = {
        "memory_bytes": f"{page}: HBM capacity per chip",
        "memory_bandwidth": f"{page}: HBM bandwidth per chip",
        "matmul_peaks": f"{page}: peak compute per chip (bf16, int8)",
        "ici_bidirectional": f"{page}: bidirectional ICI bandwidth per chip",
        "ici_ports": f"{page}: ICI ports per chip ({dims}D torus)",
        "link_one_way": f"{BOOK}: ICI bandwidth per link, one way",
        "dcn_per_chip": f"{BOOK}: DCN bandwidth per TPU",
        "torus_dims": f"{page}: interconnect topology",
    }
    return Generation(
        name, device_kind, memory, bandwidth, peaks, ici, ports, link, dcn, dims, {**known, **sources}
    )


GENERATIONS = {
    "v5e": _generation(
        "v5e", "TPU v5 lite", 16 * 2**30, 819e9, {"bf16": 197e12, "s8": 393e12}, 400e9, 4, 45e9, 3.125e9, 2,
        dcn_per_chip=f"{_page('v5e')}: 2 x 100 Gbps NICs per host of 8 chips (3.125 GB/s per chip; "
        f"the book's figure too)",
    ),
    "v5p": _generation(
        "v5p", "TPU v5", 95 * 2**30, 2765e9,
        {"bf16": 459e12, "s8": 918e12, "f8e4m3fn": 459e12, "f8e5m2": 459e12}, 1200e9, 6, 90e9, 6.25e9, 3,
        matmul_peaks=f"{_page('v5p')}: peak compute per chip (bf16, fp8); int8: {BOOK}",
        dcn_per_chip=f"{_page('v5p')}: DCN bandwidth per chip, 50 Gbps",
    ),
    "v6e": _generation(
        "v6e", "TPU v6 lite", 32 * 2**30, 1638e9, {"bf16": 918e12, "s8": 1836e12}, 800e9, 4, 90e9, 12.5e9, 2,
    ),
}  # fmt: skip
"""The TPU generations a target may name, by name."""


def wraps(name: str, sizes: Sequence[int]) -> tuple[bool, ...]:
    """Which axes of a slice of these sizes wrap around (a ring), on generation ``name``.

    v5e and v6e: an axis of 16 chips, the whole pod's side (a 2D torus of 16 x 16; an 8 x 16
    slice wraps its long axis). v5p: every axis of a slice of whole 4 x 4 x 4 cubes (each size a
    multiple of 4), whose optical switches close the rings; a smaller slice (2 x 2 x 4) none.
    Source: the book (``BOOK``), and Google's v5p page ("all 4x4x4 and larger slices have full
    3D torus").
    """
    if name == "v5p":
        whole_cubes = len(sizes) == 3 and all(size % 4 == 0 for size in sizes)
        return tuple(whole_cubes for _ in sizes)
    return tuple(size == 16 for size in sizes)


class TpuDevice(Protocol):
    """What :func:`places` reads of a TPU device (compile-only or real): libtpu's attributes."""

    @property
    def id(self) -> int: ...

    @property
    def coords(self) -> Sequence[int]: ...

    @property
    def core_on_chip(self) -> int: ...


@dataclasses.dataclass(frozen=True, order=True)
class Place:
    """Where a TPU device is: its slice, its chip's coordinates in that slice's torus, its core.

    Attributes:
        slice: The slice (0 with one slice; slices are joined by the data-center network).
        coords: The chip's coordinates, one per torus dimension (``(x, y)`` on v5e and v6e,
            ``(x, y, z)`` on v5p).
        core: The core on its chip (0 but for chips whose cores are separate devices).
    """

    slice: int
    coords: tuple[int, ...]
    core: int


def places(devices: Sequence[TpuDevice], dims: int) -> list[Place]:
    """Each device's :class:`Place`, in the order given; ``dims``: its generation's torus dimensions.

    A device without ``slice_index`` (a topology of one slice) is in slice 0.
    """
    return [
        Place(
            int(getattr(device, "slice_index", 0)),
            tuple(int(c) for c in device.coords)[:dims],
            device.core_on_chip,
        )
        for device in devices
    ]


def slice_sizes(found: Sequence[Place]) -> tuple[int, ...]:
    """The sizes of the slices' torus (every slice of a topology has the same), from their places."""
    if not found:
        return ()
    dims = len(found[0].coords)
    return tuple(max(place.coords[axis] for place in found) + 1 for axis in range(dims))
