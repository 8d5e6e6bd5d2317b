"""A target's figures, each with where it comes from, and the one check of every figure a user gives.

The figures the estimate uses (memory, memory bandwidth, peak FLOP/s, the links each device
sends on) come from the GPU's spec (:mod:`._compilers`) or, for TPUs, from Google's published
table (:mod:`._tpu`); each says where it comes from, and each can be given instead
(``hardware={...}``, a keyword, ``.at()``). :class:`Figures` is what an estimate is made at.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any

from ..._language._errors import EinshardError, short_repr
from ._compilers import check_compiler, gpu_spec_text, spec_figures
from ._links import NETWORK_LATENCY, NVLINK_LATENCY, GpuHosts, Links, OneLink, gpu_wiring
from ._target import GPUS, Target
from ._torus import TpuTorus
from ._tpu import BOOK, GENERATIONS

__all__ = [
    "DCN_LATENCY",
    "ICI_LATENCY",
    "TPU_ASSUMED",
    "Figures",
    "Hardware",
    "checked_figure",
    "checked_figures",
    "checked_keywords",
    "hardware_of",
    "resolve_figures",
]

# The figures a simulated step time assumes (_timing), each stated with where it comes from.
# The fraction of the matrix units' peak a large gemm reaches: cuBLAS's large bf16 gemms on
# H100 / H200 SXM run at about 700-780 of the 989 TFLOP/s (NVIDIA's published cuBLAS figures).
DEFAULT_EFFICIENCY = 0.75


EFFICIENCY_SOURCE = (
    "assumed: what cuBLAS reaches on large bf16 gemms on an H100 / H200 (about 0.7-0.8 of the spec's "
    "peak); give yours as hardware={'efficiency': ...}"
)


# The fraction of the memory's bandwidth a streaming kernel reaches (about 4.1 of 4.8 TB/s on an
# H200: copy kernels reach 0.8-0.9 of the HBM's spec).
MEMORY_EFFICIENCY = 0.85


MEMORY_EFFICIENCY_SOURCE = "assumed: what a streaming copy reaches of the HBM's spec (0.8-0.9)"


# What each kernel costs at least: its launch and tail (XLA's GPU runtime launches through CUDA
# graphs; a kernel's own start and drain take a few microseconds).
LAUNCH_SECONDS = 2e-6


LAUNCH_SOURCE = "assumed: a kernel's launch and tail on a GPU, about 2 us"


# A GPU host's links (NVLink, its NICs, their latencies) are _links.gpu_wiring's, with their sources.
# A TPU's figures are Google's and the scaling book's (_tpu.GENERATIONS, each with its source).
# libtpu keeps part of the HBM for itself: 15.75 of v5e's 16 GiB, 31.24 of v6e's 32 GiB are
# available to a program (its refusal of one that does not fit says so).
ICI_LATENCY = 1e-6


DCN_LATENCY = NETWORK_LATENCY  # between TPU slices: a GPU network's, assumed (TPU_ASSUMED)


TPU_ASSUMED = "assumed, as for a GPU: no TPU time was measured"


_FIGURES = (
    "memory_bytes",
    "memory_bandwidth",
    "peak_flops_per_second",
    "efficiency",
    "memory_efficiency",
    "launch_seconds",
    "bandwidth",
    "network_bandwidth",
    "nics_per_host",
    "latency",
    "network_latency",
)


# Every figure a user gives, in hardware= (a Hardware's names) or as a keyword of explain_step,
# plan, plan_batches and .at(): what it is, what it means, and an example of it. What it is
# decides its check: a rate is finite and above 0 (an estimate divides by it), a time finite and
# not negative, a fraction above 0 and at most 1, a size a whole number of bytes above 0, a count
# a whole number above 0.
_FIGURE_KINDS: dict[str, tuple[str, str, str]] = {
    "memory_bytes": ("bytes", "the memory of each device, in bytes", "80e9"),
    "memory_bandwidth": ("rate", "the bytes per second between a device and its memory", "3.35e12"),
    "peak_flops_per_second": ("rate", "the device's peak bf16 FLOP/s", "989e12"),
    "efficiency": ("fraction", "the share of the peak FLOP/s a large gemm reaches", "0.75"),
    "memory_efficiency": (
        "fraction",
        "the share of the memory's bandwidth a streaming kernel reaches",
        "0.85",
    ),
    "launch_seconds": ("time", "what each kernel costs at least, in seconds", "2e-6"),
    "bandwidth": ("rate", "the bytes per second each device sends", "450e9"),
    "network_bandwidth": ("rate", "the bytes per second one NIC sends to other hosts", "48e9"),
    "nics_per_host": ("count", "how many NICs each host sends to the other hosts on", "8"),
    "latency": ("time", "the seconds each step of a ring algorithm takes", "1e-6"),
    "network_latency": ("time", "the seconds each ring step across hosts takes", "5e-6"),
    "flops_per_second": ("rate", "the FLOP/s each device computes at", "700e12"),
    "memory_per_device": ("bytes", "the memory of each device, in bytes", "80e9"),
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The figures of a target's device, each with where it comes from.

    Attributes:
        device: The device's name (``'NVIDIA H100 80GB HBM3'``, ``'TPU v5 lite'``).
        memory_bytes: Memory per device (a GPU spec's ``device_memory_size``; a TPU's HBM).
        memory_bandwidth: Bytes per second between a device and its memory.
        peak_flops_per_second: Dense bf16 FLOP/s per device at the peak.
        efficiency: The fraction of the matrix units' peak a large gemm reaches (every element
            type's rate is its peak times this).
        memory_efficiency: The fraction of ``memory_bandwidth`` a streaming kernel reaches.
        launch_seconds: What each kernel costs at least (its launch and tail).
        bandwidth: Bytes per second each device sends to the devices of its host (NVLink); on a
            TPU, what one ICI link carries one way (a collective runs on 1 or 2 links per torus
            axis it spans: :mod:`~einshard._cost.hardware._torus`).
        network_bandwidth: Bytes per second one NIC sends to other hosts, as NCCL reaches it
            (GPUs); on a TPU, what a chip sends to other slices over the data-center network.
        devices_per_host: How many devices share a host's NVLink, or ``None``.
        nics_per_host: How many NICs each host sends to the other hosts on (GPUs: one per GPU on
            a DGX), or ``None``.
        sources: Where each figure comes from, by its name.
        latency: Seconds per ring step on the ``bandwidth`` link.
        network_latency: Seconds per ring step across hosts (or TPU slices), or ``None``.
        matmul_peaks: Peak FLOP/s of the matrix units per element type they run (``'bf16'``,
            ``'f16'``, ``'tf32'`` for f32 through TF32, ``'f32'`` at full precision,
            ``'f8e4m3fn'`` ...).
    """

    device: str
    memory_bytes: int
    memory_bandwidth: float
    peak_flops_per_second: float
    efficiency: float
    bandwidth: float
    network_bandwidth: float | None
    devices_per_host: int | None
    sources: Mapping[str, str]
    memory_efficiency: float = MEMORY_EFFICIENCY
    launch_seconds: float = LAUNCH_SECONDS
    latency: float = NVLINK_LATENCY
    network_latency: float | None = NETWORK_LATENCY
    matmul_peaks: Mapping[str, float] = dataclasses.field(default_factory=dict)
    nics_per_host: int | None = None

    @property
    def flops_per_second(self) -> float:
        """The bf16 FLOP/s a large gemm reaches: ``peak_flops_per_second * efficiency``."""
        return self.peak_flops_per_second * self.efficiency

    def matmul_rates(self) -> dict[str, float]:
        """The FLOP/s a gemm reaches per element type: each peak times the efficiency."""
        peaks = {**self.matmul_peaks, "bf16": self.peak_flops_per_second}
        return {kind: peak * self.efficiency for kind, peak in peaks.items()}

    def replace(self, figures: Mapping[str, Any]) -> Hardware:
        """These figures with some given instead (their source: ``'given'``).

        Raises:
            EinshardError: For a name that is not a figure, or a value that is not one
                (:func:`checked_figure`).
        """
        checked = checked_figures(figures)
        sources = {**self.sources, **dict.fromkeys(checked, "given")}
        return dataclasses.replace(self, **checked, sources=sources)


def checked_figures(figures: Any) -> dict[str, Any]:
    """Figures given as ``hardware=``, checked: a mapping of known names, each by :func:`checked_figure`.

    Raises:
        EinshardError: For something not a mapping, a name that is not a figure, or a value that
            is not one.
    """
    if not isinstance(figures, Mapping):
        raise EinshardError(
            f"hardware= must be a mapping of figures by name, not {type(figures).__name__}",
            hint=f"Give a dict such as hardware={{'efficiency': 0.6}}; the figures: {', '.join(_FIGURES)}.",
        )
    checked: dict[str, Any] = {}
    for name, value in figures.items():
        if name not in _FIGURES:
            raise EinshardError(
                f"hardware={{{short_repr(name)}: ...}} is not a figure of a target",
                hint=f"Give any of {', '.join(_FIGURES)}.",
            )
        checked[name] = checked_figure(name, value, in_hardware=True)
    return checked


def checked_figure(name: str, value: Any, *, in_hardware: bool = False) -> Any:
    """One figure a user gives, checked by what it is: the one check of every figure.

    A rate (a bandwidth, FLOP/s) is a finite number above 0; a time (a latency, the launch
    floor) a finite number of seconds, 0 or more; a fraction (an efficiency) above 0 and at most
    1; a size in bytes (``memory_per_device``, ``memory_bytes``) a whole number above 0, an
    integer or a float that is a whole number (``80e9``, not ``2.5``); a count (``nics_per_host``)
    a whole number above 0 the same way. A bool is not a number. Rates, times and fractions come
    back as floats, sizes and counts as ints.

    Args:
        name: The figure's name: a keyword of ``explain_step``, ``plan``, ``plan_batches`` or
            ``.at()``, or a name of ``hardware=``.
        value: What the user gave.
        in_hardware: Given in ``hardware=`` (the message shows it so), else as a keyword.

    Raises:
        EinshardError: Naming the figure, the value and what it must be, with an example.

    >>> checked_figure('memory_per_device', 80e9)
    80000000000
    >>> checked_figure('bandwidth', 0)
    Traceback (most recent call last):
        ...
    einshard.EinshardError: bandwidth=0 must be a finite number above 0
    Give the bytes per second each device sends, e.g. bandwidth=450e9.
    """
    kind, meaning, example = _FIGURE_KINDS[name]
    shown = f"hardware={{{name!r}: {short_repr(value)}}}" if in_hardware else f"{name}={short_repr(value)}"
    written = f"hardware={{{name!r}: {example}}}" if in_hardware else f"{name}={example}"
    number = _real(value)
    not_bool = "A bool is not a number. " if isinstance(value, bool) else ""
    if kind in ("bytes", "count"):
        whole = isinstance(value, numbers.Integral) or (number is not None and number.is_integer())
        if number is None or not whole or not number > 0:
            if kind == "count":
                raise EinshardError(
                    f"{shown} must be a whole number above 0",
                    hint=f"{not_bool}Give {meaning}, e.g. {written}.",
                )
            raise EinshardError(
                f"{shown} must be a whole number of bytes above 0",
                hint=f"{not_bool}Give {meaning}, e.g. {written} or 80 << 30 (a float is taken when it is "
                f"a whole number: 80e9, not 2.5).",
            )
        return int(value) if isinstance(value, numbers.Integral) else int(number)
    if kind == "fraction":
        if number is None or not 0 < number <= 1:
            raise EinshardError(
                f"{shown} must be a fraction above 0 and at most 1",
                hint=f"{not_bool}Give {meaning}, e.g. {written} (1 is the whole peak).",
            )
        return number
    if kind == "time":
        if number is None or not (math.isfinite(number) and number >= 0):
            raise EinshardError(
                f"{shown} must be a finite number of seconds, 0 or more",
                hint=f"{not_bool}Give {meaning}, e.g. {written}.",
            )
        return number
    if number is None or not (math.isfinite(number) and number > 0):
        raise EinshardError(
            f"{shown} must be a finite number above 0", hint=f"{not_bool}Give {meaning}, e.g. {written}."
        )
    return number


def _real(value: Any) -> float | None:
    """A real number as a float (infinite beyond a float's range), or ``None``: bools are not numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond a float's range
        big: Any = value
        return math.inf if big > 0 else -math.inf


def hardware_of(target: Target, given: Mapping[str, Any] | None = None) -> Hardware | None:
    """The target's figures, with the ``given`` ones instead; ``None`` for CPU devices.

    Raises:
        EinshardError: The GPU's compiler is not installed (its spec is read from there), or
            ``given`` is not a mapping, or a figure of it is unknown or not one
            (:func:`checked_figure`).
    """
    if given is not None and not isinstance(given, Mapping):
        checked_figures(given)  # the error saying what hardware= is, before any other
    if target.platform == "cpu":
        if given:
            raise EinshardError(
                "hardware= needs a target: simulated CPU devices have no figures to replace",
                hint="Give target='h100' (or another target) with n_devices=, or bandwidth= and "
                "flops_per_second= for the estimate on CPU devices.",
            )
        return None
    if given:
        checked_figures(given)  # the user's mistake first: it needs no compiler to be seen
    check_compiler(target)  # before the figures, which are cached: a compiler removed since says so
    hardware = _gpu_hardware(target.name) if target.platform == "gpu" else _tpu_hardware(target.name)
    return hardware.replace(given) if given else hardware


@dataclasses.dataclass(frozen=True)
class Figures:
    """The figures an estimate is made at, resolved once: the target's, with the caller's instead.

    Made by :func:`resolve_figures` (``explain_step``, ``plan``) and :meth:`at` (``.at(...)``);
    the estimate, a report and a plan take this object, and nothing else fills in a figure.

    Attributes:
        target: What the step is compiled for (``'cpu'``, ``'h100'`` ...).
        hardware: The target's figures with the ``hardware=`` given instead, or ``None`` (CPU).
        bandwidth: Bytes per second each device sends (a collective within a host or slice),
            or ``None``: no communication estimate.
        network_bandwidth: Bytes per second one NIC sends to other hosts, or ``None``: every
            collective at ``bandwidth``.
        latency: Seconds per ring step at ``bandwidth``.
        network_latency: Seconds per ring step between hosts.
        flops_per_second: On CPU devices: the FLOP/s of the compute estimate, or ``None``. On a
            target: given, the rate every dot runs at instead of the matrix units' per type;
            else the bf16 rate a large gemm reaches (shown).
        flops_given: Whether ``flops_per_second`` was given.
        memory_per_device: Bytes each device has (a plan rejects candidates above it), or ``None``.
        slice_shape: A TPU target's slice, chips per torus axis (``(4, 4)``): its collectives
            run on the torus (:class:`~einshard._cost.hardware._torus.TpuTorus`); ``None`` otherwise,
            and once a bandwidth is given (every collective's).
        slices: How many TPU slices, joined by the data-center network at
            ``network_bandwidth`` per chip.
    """

    target: str = "cpu"
    hardware: Hardware | None = None
    bandwidth: float | None = None
    network_bandwidth: float | None = None
    latency: float = 0.0
    network_latency: float = 0.0
    flops_per_second: float | None = None
    flops_given: bool = False
    memory_per_device: int | None = None
    slice_shape: tuple[int, ...] | None = None
    slices: int = 1

    @property
    def simulated(self) -> bool:
        """Whether a step time is simulated from the program (a GPU or TPU target)."""
        return self.hardware is not None

    @property
    def links(self) -> Links | None:
        """The devices' links every collective's time is asked of, or ``None`` without a bandwidth.

        See :mod:`~einshard._cost.hardware._links`: GPU hosts with their NICs where the target has them;
        a TPU's slices, each a torus (:class:`~einshard._cost.hardware._torus.TpuTorus`); else (CPU
        devices, a bandwidth given, which is every collective's) one link.
        """
        if self.bandwidth is None:
            return None
        if self.slice_shape is not None and self.target in GENERATIONS:
            dcn = self.network_bandwidth or GENERATIONS[self.target].dcn_per_chip
            return TpuTorus(
                self.target,
                self.slice_shape,
                self.slices,
                self.bandwidth,
                self.latency,
                dcn,
                self.network_latency,
            )
        hardware = self.hardware
        per_host = hardware.devices_per_host if hardware is not None else None
        nics = hardware.nics_per_host if hardware is not None else None
        if per_host is None or nics is None or self.network_bandwidth is None:
            return OneLink(self.bandwidth, self.latency, per_host)
        return GpuHosts(
            per_host, self.bandwidth, self.latency, nics, self.network_bandwidth, self.network_latency
        )

    def at(
        self,
        *,
        bandwidth: float | None = None,
        latency: float | None = None,
        flops_per_second: float | None = None,
        memory_per_device: int | None = None,
    ) -> Figures:
        """These figures with those given instead; a bandwidth given is every collective's.

        The figures given are checked here (:func:`checked_figure`), for every path that takes
        them: ``explain_step``, ``plan`` and ``plan_batches`` (through :func:`resolve_figures`),
        ``StepReport.at`` and ``Plan.at``.

        Raises:
            EinshardError: For a figure that is not one.
        """
        given = checked_keywords(
            bandwidth=bandwidth,
            latency=latency,
            flops_per_second=flops_per_second,
            memory_per_device=memory_per_device,
        )
        changed: dict[str, Any] = {}
        if "bandwidth" in given:
            changed.update(bandwidth=given["bandwidth"], network_bandwidth=None, slice_shape=None)
        if "latency" in given:
            changed.update(latency=given["latency"], network_latency=given["latency"])
        if "flops_per_second" in given:
            changed.update(flops_per_second=given["flops_per_second"], flops_given=True)
        if "memory_per_device" in given:
            changed.update(memory_per_device=given["memory_per_device"])
        return dataclasses.replace(self, **changed)


def checked_keywords(**figures: Any) -> dict[str, Any]:
    """The figure keywords given (not ``None``), each checked by :func:`checked_figure`.

    Raises:
        EinshardError: For a figure that is not one.
    """
    return {name: checked_figure(name, value) for name, value in figures.items() if value is not None}


def resolve_figures(
    target: Target,
    hardware: Mapping[str, Any] | None = None,
    *,
    bandwidth: float | None = None,
    latency: float | None = None,
    flops_per_second: float | None = None,
    memory_per_device: int | None = None,
) -> Figures:
    """The figures of a report or plan: the target's, each one the caller gave instead.

    The keywords are checked first, then ``hardware=``: a mistake in either is an error before
    the target's compiler is looked for, and before any compile.

    Raises:
        EinshardError: For a figure that is not one (:func:`checked_figure`), and as
            :func:`hardware_of`.
    """
    checked_keywords(
        bandwidth=bandwidth,
        latency=latency,
        flops_per_second=flops_per_second,
        memory_per_device=memory_per_device,
    )
    device = hardware_of(target, hardware)
    if device is None:
        base = Figures(target=target.name)
    else:
        base = Figures(
            target=target.name,
            hardware=device,
            bandwidth=device.bandwidth,
            network_bandwidth=device.network_bandwidth,
            latency=device.latency,
            # A given 0 is a figure: only a device without a network (a TPU slice) takes its link's.
            network_latency=device.latency if device.network_latency is None else device.network_latency,
            flops_per_second=device.flops_per_second,
            memory_per_device=device.memory_bytes,
            slice_shape=target.slice_shape,
            slices=target.slices,
        )
    return base.at(
        bandwidth=bandwidth,
        latency=latency,
        flops_per_second=flops_per_second,
        memory_per_device=memory_per_device,
    )


@functools.cache
def _gpu_hardware(name: str) -> Hardware:
    spec = gpu_spec_text(name)
    figures = spec_figures(spec)
    source = f"XLA's spec of the {GPUS[name]} (in jax-cuda13-plugin)"
    major = int(figures.get("compute_capability", 9))
    links = int(figures["active_links"]) if "active_links" in figures else None
    wiring, wiring_sources = gpu_wiring(major, links, source)
    return Hardware(
        device=GPUS[name],
        memory_bytes=int(figures["device_memory_size"]),
        memory_bandwidth=figures["memory_bandwidth"],
        peak_flops_per_second=figures["peak_flops_per_second"],
        efficiency=DEFAULT_EFFICIENCY,
        matmul_peaks={k.removeprefix("matrix_"): v for k, v in figures.items() if k.startswith("matrix_")},
        **wiring,
        sources={
            "memory_bytes": f"{source}: device_memory_size",
            "memory_bandwidth": f"{source}: memory_bandwidth",
            "peak_flops_per_second": f"{source}: matrix units' bf16 rate x cores",
            "efficiency": EFFICIENCY_SOURCE,
            "memory_efficiency": MEMORY_EFFICIENCY_SOURCE,
            "launch_seconds": LAUNCH_SOURCE,
            "matmul_peaks": f"{source}: the matrix units' rate per element type x cores",
            **wiring_sources,
        },
    )


def _tpu_hardware(name: str) -> Hardware:
    chip = GENERATIONS[name]
    peak = chip.peak_flops_per_second
    # An f32 dot at the default precision is one bf16 pass on a TPU; at 'highest', six.
    passes = "jax.lax.Precision's documentation: f32 at DEFAULT in bfloat16, at HIGHEST in 6 bfloat16 passes"
    return Hardware(
        device=f"TPU {name}",
        memory_bytes=chip.memory_bytes,
        memory_bandwidth=chip.memory_bandwidth,
        peak_flops_per_second=peak,
        efficiency=DEFAULT_EFFICIENCY,
        bandwidth=chip.link_one_way,
        network_bandwidth=chip.dcn_per_chip,
        devices_per_host=None,
        latency=ICI_LATENCY,
        network_latency=DCN_LATENCY,
        matmul_peaks={
            **{k: v for k, v in chip.matmul_peaks.items() if k != "bf16"},
            "tf32": peak,
            "f32": peak / 6,
        },
        sources={
            "memory_bytes": chip.sources["memory_bytes"],
            "memory_bandwidth": chip.sources["memory_bandwidth"],
            "peak_flops_per_second": chip.sources["matmul_peaks"],
            "efficiency": f"{TPU_ASSUMED} (what cuBLAS reaches on an H100)",
            "memory_efficiency": f"{TPU_ASSUMED} (a GPU's figure)",
            "launch_seconds": f"{TPU_ASSUMED} (a GPU's figure)",
            "latency": f"{TPU_ASSUMED}: 1 us per ring step on ICI (the scaling book's worked example takes "
            f"0.5 us per hop on a v5e, as an example, not a measurement: {BOOK})",
            "matmul_peaks": f"{chip.sources['matmul_peaks']}; {passes}",
            "bandwidth": f"{chip.sources['link_one_way']}: a collective runs on 2 links per torus axis it "
            "spans where the axis wraps around, 1 where not (_torus)",
            "network_bandwidth": f"{chip.sources['dcn_per_chip']}: what a chip sends to other slices",
            "network_latency": f"{TPU_ASSUMED}: 5 us per ring step between slices (a GPU network's)",
        },
    )
