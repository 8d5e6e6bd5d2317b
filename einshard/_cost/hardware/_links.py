"""The devices' links: how a target's devices are wired, and how long a collective takes on them.

Every time a collective is given (a report's rows, the step time's walk, a plan's bounds and
``.at()``) is this module's answer, from one model of the links, a :class:`Links`:

- :class:`OneLink`: every collective at one bandwidth, with a latency per ring step (simulated
  CPU devices; a TPU slice's ICI; any target given ``bandwidth=``, which is every collective's).
- :class:`GpuHosts`: hosts of ``devices_per_host`` GPUs joined by NVLink, each host with
  ``nics_per_host`` NICs to the others (a DGX / HGX cluster). A ring across hosts runs one
  channel per rail (NCCL): a group with ``g`` devices on each of its hosts sends through ``g``
  devices' shares of its hosts' NICs at once, so its bus bandwidth is ``min(g x share,
  NVLink x g / (g - 1))``, where ``share = nics_per_host x NIC / devices_per_host`` is what each
  device of a host sends to other hosts while all of them do (one NIC on a DGX). A group spread
  unevenly is as fast as its least-populated host. Latency follows NCCL's tuning model
  (``src/graph/tuning.cc``): the network's latency on the ``2(h - 1)`` steps of an all-reduce
  between ``h`` hosts (``h - 1`` for the other kinds), NVLink's on the steps inside a host.

  An all-to-all across hosts cannot use the rails: each device sends ``(n - g) / n`` of its
  array to devices of other hosts, on its own share of its host's NICs, while the rest goes over
  NVLink at once (the slower of the two); its latency is an all-gather's. A collective-permute
  whose pairs cross hosts sends its array once on the device's share, with one step of the
  network's latency (the pairs run at once: a crossing pair decides).

One more kind of wiring (a TPU's torus) is one more class with these four methods; the callers
ask a :class:`Links` and nothing else. Which host a device is on is the model's answer too
(:meth:`Links.host`): a GPU target's devices are laid out ``1xHx8``, ``devices_per_host`` ids
per host in id order (the compile-only devices' ``process_index``; ``tests/test_links.py``
checks it), and a target's device order is its devices by id, so a layout's device position is
a device id.

The ring formulas (bytes sent and steps per run, by kind: :func:`sent_fraction`,
:func:`ring_steps`) are here as well: the bytes a row sends (its ``traffic``) are theirs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..._language._text import seconds_text
from ..xla._hlo import KINDS

__all__ = [
    "GPUS_PER_HOST",
    "GpuHosts",
    "Groups",
    "Links",
    "OneLink",
    "gpu_wiring",
    "ring_steps",
    "sent_fraction",
    "spanned_hosts",
]

Groups = tuple[tuple[int, ...], ...]
"""A collective's device groups, as device ids (a permute: the devices each chain of pairs joins)."""

# Ring algorithms: bytes each device sends per run, as a multiple of its array, and the number of
# sequential steps (each paying a latency once), for a group of n devices.
_RING: dict[str, tuple[Callable[[int], float], Callable[[int], int]]] = {
    "all-reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all-gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "reduce-scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all-to-all": (lambda n: (n - 1) / n, lambda n: n - 1),
    "collective-permute": (lambda n: 1.0, lambda n: 1),
}
assert set(_RING) == set(KINDS)  # a ring formula for every kind the reader knows


def sent_fraction(kind: str, n: int) -> float:
    """The bytes each of ``n`` devices sends per run, as a multiple of its array (0 alone).

    ``2(n-1)/n`` for an all-reduce, ``(n-1)/n`` for an all-gather (of its result), a
    reduce-scatter (of its input) and an all-to-all, 1 for a collective-permute.
    """
    return _RING[kind][0](n) if n > 1 else 0.0


def ring_steps(kind: str, n: int) -> int:
    """How many sequential steps one run of the ring takes over ``n`` devices (0 alone)."""
    return _RING[kind][1](n) if n > 1 else 0


class Links(Protocol):
    """How a target's devices are wired: the one model every collective's time is asked of."""

    def seconds(self, kind: str, nbytes: float, groups: Groups) -> float:
        """Seconds of one run of a collective of ``kind`` over these device groups, latency included.

        ``nbytes``: each device's array (the result of an all-gather, the input of the others;
        a combined collective's arrays together). All groups run at once: the slowest decides.
        """
        ...

    def host(self, device: int) -> int:
        """The host a device (by id) is on: the devices the fast link joins."""
        ...

    def least_seconds(self, sent: float, across: float) -> float:
        """At least how long a device takes to send ``sent`` bytes, ``across`` of them to other hosts.

        Whatever the algorithm: what a plan's bounds price the gradients a layout must sum at.
        """
        ...

    def assumed(self) -> str:
        """What the model assumes, in a report's and a plan's words (``'450 GB/s per device, ...'``)."""
        ...


def spanned_hosts(links: Links, groups: Groups) -> int:
    """How many hosts the devices of the widest group are on (1 without groups)."""
    return max((len({links.host(device) for device in group}) for group in groups), default=1)


def _largest(groups: Groups) -> int:
    return max((len(group) for group in groups), default=1)


@dataclasses.dataclass(frozen=True)
class OneLink:
    """Every collective at one bandwidth, with a latency per ring step.

    Attributes:
        bandwidth: Bytes per second each device sends.
        latency: Seconds per ring step.
        devices_per_host: Where a GPU target's devices are (ids in hosts of this many), though
            every collective runs at ``bandwidth``; ``None``: all on one host.
    """

    bandwidth: float
    latency: float = 0.0
    devices_per_host: int | None = None

    def seconds(self, kind: str, nbytes: float, groups: Groups) -> float:
        n = _largest(groups)
        return sent_fraction(kind, n) * nbytes / self.bandwidth + ring_steps(kind, n) * self.latency

    def host(self, device: int) -> int:
        return device // self.devices_per_host if self.devices_per_host else 0

    def least_seconds(self, sent: float, across: float) -> float:
        return sent / self.bandwidth

    def assumed(self) -> str:
        every = " for every collective, within and across hosts" if self.devices_per_host else ""
        return f"{self.bandwidth / 1e9:g} GB/s per device{every}, latency {seconds_text(self.latency)}"


@dataclasses.dataclass(frozen=True)
class GpuHosts:
    """Hosts of GPUs joined by NVLink, and by their NICs to the other hosts (see the module).

    Attributes:
        devices_per_host: GPUs per host, ids ``h * devices_per_host ...`` on host ``h``.
        nvlink: Bytes per second each GPU sends to the GPUs of its host.
        latency: Seconds per ring step inside a host.
        nics_per_host: The NICs each host sends to the other hosts on.
        nic: Bytes per second one NIC sends, as NCCL reaches it.
        network_latency: Seconds per ring step between hosts.
    """

    devices_per_host: int
    nvlink: float
    latency: float
    nics_per_host: int
    nic: float
    network_latency: float

    @property
    def share(self) -> float:
        """Bytes per second each device sends to other hosts while every device of its host does."""
        return self.nics_per_host * self.nic / self.devices_per_host

    def host(self, device: int) -> int:
        return device // self.devices_per_host

    def spread(self, group: Sequence[int]) -> tuple[int, int]:
        """``(g, h)``: the group's devices on its least-populated host, and its hosts."""
        return _spread(tuple(group), self.devices_per_host)

    def bus_bandwidth(self, kind: str, group: Sequence[int]) -> float:
        """The bytes per second a run over ``group`` moves its ring formula's bytes at.

        Inside a host: NVLink. Across hosts: ``min(g x share, NVLink x g / (g - 1))``; an
        all-to-all its bytes to other hosts on the share (and the rest on NVLink, at once); a
        permute its array on the share.
        """
        n = len(group)
        g, h = self.spread(group)
        if h == 1:
            return self.nvlink
        if kind == "collective-permute":
            return self.share
        if kind == "all-to-all":
            # (n-1)/n of the array in the time of the slower part: (n-g)/n on the share, (g-1)/n on NVLink.
            return (n - 1) / max((n - g) / self.share, (g - 1) / self.nvlink)
        return min(g * self.share, self.nvlink * g / (g - 1)) if g > 1 else self.share

    def run_latency(self, kind: str, group: Sequence[int]) -> float:
        """One run's latency: the network's on the steps between hosts, NVLink's on the others."""
        n = len(group)
        steps = ring_steps(kind, n)
        _, h = self.spread(group)
        if h == 1:
            return steps * self.latency
        between = 1 if kind == "collective-permute" else (2 if kind == "all-reduce" else 1) * (h - 1)
        return between * self.network_latency + (steps - between) * self.latency

    def seconds(self, kind: str, nbytes: float, groups: Groups) -> float:
        return max(
            (
                sent_fraction(kind, len(group)) * nbytes / self.bus_bandwidth(kind, group)
                + self.run_latency(kind, group)
                for group in groups
                if len(group) > 1
            ),
            default=0.0,
        )

    def least_seconds(self, sent: float, across: float) -> float:
        return (sent - across) / self.nvlink + across / self.share

    def assumed(self) -> str:
        nics = f"{self.nics_per_host} NIC{'s' if self.nics_per_host > 1 else ''}"
        return (
            f"{self.nvlink / 1e9:g} GB/s per device within a host of {self.devices_per_host}, latency "
            f"{seconds_text(self.latency)}; across hosts: {nics} × {self.nic / 1e9:g} GB/s per host, "
            f"latency {seconds_text(self.network_latency)}"
        )


@functools.lru_cache(maxsize=4096)
def _spread(group: tuple[int, ...], per_host: int) -> tuple[int, int]:
    counts: dict[int, int] = {}
    for device in group:
        counts[device // per_host] = counts.get(device // per_host, 0) + 1
    return min(counts.values(), default=0), len(counts)


# --- GPU hosts as NVIDIA builds them (DGX / HGX) ------------------------------------------------------

GPUS_PER_HOST = 8  # an HGX / DGX board: NVLink joins the 8 GPUs of a host
# NVLink, per link and direction, by compute capability's major version (NVIDIA's datasheets:
# NVLink 3 (A100) and 4 (H100, H200) 25 GB/s, NVLink 5 (B200) 50 GB/s).
_NVLINK_PER_LINK = {8: 25e9, 9: 25e9, 10: 50e9}
_A100_LINKS = 12  # the A100 spec has no interconnect entry; the A100 SXM has 12 NVLink 3 links
# One NIC per GPU: 8 x ConnectX-7 at 400 Gb/s in a DGX H100, H200 and B200; 8 x ConnectX-6 at
# 200 Gb/s (HDR) in a DGX A100. Each at the rate NCCL reaches, not the line rate (50 / 25 GB/s).
_NICS = {8: (200, 24e9), 9: (400, 48e9), 10: (400, 48e9)}
_NIC_SOURCE = {
    400: "what NCCL reaches on a 400 Gb/s NIC (NDR): 46-48 GB/s per NIC (NCCL's maintainers, "
    "NVIDIA/nccl-tests#290, NVIDIA/nccl#812); all-reduce across 4 DGX H100s measured at 331-366 GB/s "
    "bus bandwidth over 8 NICs per host (NVIDIA/nccl-tests#309, #319)",
    200: "what NCCL reaches on a 200 Gb/s NIC (HDR): 24 GB/s per NIC (NCCL's maintainers, "
    "NVIDIA/nccl-tests#119); NVIDIA's all-reduce across DGX A100s: 192 GB/s bus bandwidth over 8 NICs",
}
NVLINK_LATENCY = 1e-6
NETWORK_LATENCY = 5e-6
# Latency per ring step: NCCL's tuning model (src/graph/tuning.cc) gives NVLink about 0.6 us of
# hardware latency per step and a few us of network latency per step; 1 us and 5 us are taken.
LATENCY_SOURCE = "NCCL's tuning model (src/graph/tuning.cc): about 1 us per ring step on NVLink"
NETWORK_LATENCY_SOURCE = (
    "NCCL's tuning model (src/graph/tuning.cc): about 5 us per ring step between hosts (2(h-1) steps of "
    "an all-reduce over h hosts, h-1 of the other kinds)"
)


def gpu_wiring(major: int, links: int | None, spec_source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A DGX-built host's links for a GPU of compute capability ``major``: figures and their sources.

    ``links``: the NVLink links XLA's spec gives (``None``: the A100's datasheet's 12);
    ``spec_source``: where the spec was read, for the sources.
    """
    per_link = _NVLINK_PER_LINK.get(major, 25e9)
    if links is None:
        links, links_source = _A100_LINKS, "NVIDIA's A100 datasheet (the spec has no interconnect entry)"
    else:
        links_source = f"{spec_source}: device_interconnect_info"
    line_rate, nic = _NICS.get(major, _NICS[9])
    nic_kind = "ConnectX-7" if line_rate == 400 else "ConnectX-6 (HDR)"
    figures = {
        "bandwidth": links * per_link,
        "devices_per_host": GPUS_PER_HOST,
        "nics_per_host": GPUS_PER_HOST,
        "network_bandwidth": nic,
        "latency": NVLINK_LATENCY,
        "network_latency": NETWORK_LATENCY,
    }
    sources = {
        "bandwidth": f"{links} NVLink links x {per_link / 1e9:g} GB/s per direction ({links_source})",
        "devices_per_host": f"an HGX / DGX board: {GPUS_PER_HOST} GPUs joined by NVLink (the topology the "
        "step is compiled for, 1xHx8)",
        "nics_per_host": f"one {line_rate} Gb/s {nic_kind} NIC per GPU, {GPUS_PER_HOST} per host "
        "(NVIDIA's DGX user guides)",
        "network_bandwidth": _NIC_SOURCE[line_rate],
        "latency": LATENCY_SOURCE,
        "network_latency": NETWORK_LATENCY_SOURCE,
    }
    return figures, sources
