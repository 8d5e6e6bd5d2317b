"""A TPU target's links: each slice a torus of ICI links, slices joined by the data-center network.

One more :class:`~einshard._cost.hardware._links.Links`, beside ``OneLink`` and ``GpuHosts``: every
collective of a TPU target is timed here (its figures: :mod:`._tpu`).

**Where a device is.** A target's device order is its devices by id, and libtpu numbers the
chips of a slice x fastest (``id = x + X * (y + Y * z)`` in an ``X x Y x Z`` slice; with several
slices, ``100000 * (slice + 1)`` plus that). So a device's position ``p`` is chip
``p % per_slice`` of slice ``p // per_slice`` (:meth:`TpuTorus.place`); ``tests/test_torus.py``
checks it against libtpu's own coordinates. A program compiled for several slices is one slice's
program: its groups name a slice's devices, and the traffic between slices is XLA's megascale
transfers (``_hlo.megascale_collectives``), whose groups are one chip of each slice.

**Inside a slice.** A ring over a group runs along the torus axes the group spans. On an axis the
group covers whole, where the axis wraps around (:func:`._tpu.wraps`), the ring closes and runs
both ways: two links. On a segment of an axis, or one that does not wrap, it goes out and back:
one link. A group whose chips lie ``s`` apart along an axis shares each of its links with the
``s - 1`` groups between them (a data-parallel group beside a model axis): ``1 / s`` of them. Its
bytes (:func:`~._links.sent_fraction`) go at the sum over the axes it spans, times one link one
way; each ring step pays the ICI latency. A collective on one axis is never faster than two
links.

**Across slices.** A group with ``g`` chips in each of its slices sends across them on ``g``
chips' DCN at once (each chip's share of its hosts' NICs), at most what its ICI ring carries
(``g / (g - 1)`` of it), as ``GpuHosts`` across hosts: the slower part decides. An all-to-all
sends ``(n - g) / n`` of its array on the chip's own DCN; a permute its array. Each ring step
between slices pays the DCN latency.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

from ..._language._text import seconds_text
from ._links import Groups, ring_steps, sent_fraction
from ._tpu import Place, wraps

__all__ = ["TpuTorus"]

# libtpu's device ids in a topology of several slices: 100000 * (slice + 1) + the chip's index.
_SLICE_IDS = 100_000


@dataclasses.dataclass(frozen=True)
class TpuTorus:
    """Slices of TPU chips, each a torus of ICI links, joined by DCN (see the module).

    Attributes:
        generation: ``'v5e'``, ``'v5p'`` or ``'v6e'`` (which axes wrap: :func:`._tpu.wraps`).
        sizes: One slice's torus, chips per axis (``(4, 4)``, ``(4, 4, 4)``).
        slices: How many slices.
        link: Bytes per second one ICI link carries one way.
        latency: Seconds per ring step on ICI.
        dcn: Bytes per second a chip sends to other slices.
        dcn_latency: Seconds per ring step between slices.
    """

    generation: str
    sizes: tuple[int, ...]
    slices: int
    link: float
    latency: float
    dcn: float
    dcn_latency: float

    @property
    def per_slice(self) -> int:
        """Chips per slice."""
        return math.prod(self.sizes)

    @property
    def wrapped(self) -> tuple[bool, ...]:
        """Which axes of a slice wrap around."""
        return wraps(self.generation, self.sizes)

    @property
    def ports(self) -> int:
        """ICI links per chip (4 on a 2D torus, 6 on a 3D one)."""
        return 2 * len(self.sizes)

    def place(self, device: int) -> Place:
        """Where a device is (a position, or libtpu's id of a chip of several slices): slice, coordinates."""
        local, coords = self._local(device), []
        for size in self.sizes:
            local, coordinate = divmod(local, size)
            coords.append(coordinate)
        return Place(self.host(device), tuple(coords), 0)

    def host(self, device: int) -> int:
        """The device's slice (the chips ICI joins)."""
        if device >= _SLICE_IDS:  # libtpu's id of a chip of a topology of several slices
            return device // _SLICE_IDS - 1
        return device // self.per_slice

    def _local(self, device: int) -> int:
        return device % _SLICE_IDS if device >= _SLICE_IDS else device % self.per_slice

    def links_of(self, group: Sequence[int]) -> float:
        """The ICI links one way a ring over ``group`` (in one slice) runs on at once (the module's rule)."""
        return _links_of(tuple(self._local(device) for device in group), self.sizes, self.wrapped)

    def _ici_seconds(self, kind: str, nbytes: float, group: Sequence[int]) -> float:
        n = len(group)
        return (
            sent_fraction(kind, n) * nbytes / (self.link * self.links_of(group))
            + ring_steps(kind, n) * self.latency
        )

    def _across_seconds(self, kind: str, nbytes: float, group: Sequence[int]) -> float:
        by_slice: dict[int, list[int]] = {}
        for device in group:
            by_slice.setdefault(self.host(device), []).append(device)
        n, h, g = len(group), len(by_slice), min(len(members) for members in by_slice.values())
        smallest = min(by_slice.values(), key=len)
        ici = self.link * self.links_of(smallest) if g > 1 else math.inf
        if kind == "collective-permute":
            rate = self.dcn
        elif kind == "all-to-all":
            rate = (n - 1) / max((n - g) / self.dcn, (g - 1) / ici if g > 1 else 0.0)
        else:
            rate = min(g * self.dcn, ici * g / (g - 1)) if g > 1 else self.dcn
        steps = ring_steps(kind, n)
        between = 1 if kind == "collective-permute" else (2 if kind == "all-reduce" else 1) * (h - 1)
        return (
            sent_fraction(kind, n) * nbytes / rate
            + between * self.dcn_latency
            + (steps - between) * self.latency
        )

    def seconds(self, kind: str, nbytes: float, groups: Groups) -> float:
        slowest = 0.0
        for group in groups:
            if len(group) < 2:
                continue
            spans = len({self.host(device) for device in group}) > 1
            seconds = (self._across_seconds if spans else self._ici_seconds)(kind, nbytes, group)
            slowest = max(slowest, seconds)
        return slowest

    def least_seconds(self, sent: float, across: float) -> float:
        """Every link of the chip at once for what stays in its slice, its DCN for what leaves it."""
        return (sent - across) / (self.ports * self.link) + across / self.dcn

    def assumed(self) -> str:
        shape = "x".join(map(str, self.sizes))
        wrapped = self.wrapped
        if all(wrapped):
            which = "every axis wraps"
        elif not any(wrapped):
            which = "no axis wraps"
        else:
            which = "axes " + ", ".join(str(a) for a, w in enumerate(wrapped) if w) + " wrap"
        text = (
            f"ICI {self.link / 1e9:g} GB/s per link one way, {self.generation} {shape} torus ({which}): "
            f"2 links per wrapped axis a collective spans, 1 per other; latency {seconds_text(self.latency)}"
        )
        if self.slices > 1:
            text += (
                f"; {self.slices} slices joined by DCN at {self.dcn / 1e9:g} GB/s per chip, latency "
                f"{seconds_text(self.dcn_latency)}"
            )
        return text


@functools.lru_cache(maxsize=4096)
def _links_of(group: tuple[int, ...], sizes: tuple[int, ...], wrapped: tuple[bool, ...]) -> float:
    """Links one way over the axes a group of chip indices (x fastest) spans: 2 / s or 1 / s per axis."""
    values: list[set[int]] = [set() for _ in sizes]
    for chip in group:
        for axis, size in enumerate(sizes):
            chip, coordinate = divmod(chip, size)
            values[axis].add(coordinate)
    total = 0.0
    for axis, size in enumerate(sizes):
        spanned = sorted(values[axis])
        k = len(spanned)
        if k < 2:
            continue
        steps = {b - a for a, b in itertools.pairwise(spanned)}
        even = len(steps) == 1
        stride = steps.pop() if even else (spanned[-1] - spanned[0]) / (k - 1)
        closed = wrapped[axis] and even and k * stride == size  # evenly round the whole ring
        total += (2 if closed else 1) / stride
    return total
