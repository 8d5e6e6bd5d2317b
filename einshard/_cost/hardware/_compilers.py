"""The targets' compilers: whether one is installed, XLA's GPU specs it bundles, a target's devices.

No accelerator needs to be present: ``jax.experimental.topologies`` gives devices to compile for
(:func:`target_devices`). A GPU's spec (a ``GpuTargetConfigProto`` text bundled in the
``jax-cuda13-plugin`` package) is read from the plugin's files, and its figures from the spec
(:func:`spec_figures`); a missing compiler is the error naming the extra (:func:`missing_compiler`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import mmap
import re
from pathlib import Path
from typing import Any

from ..._language._errors import EinshardError
from ._target import FROM_SOURCE, GPU_EXTRA, GPUS, TPU_EXTRA, Target

__all__ = ["check_compiler", "gpu_spec_text", "missing_compiler", "spec_figures", "target_devices"]


def _gpu_plugin() -> Path:
    """The directory of XLA's CUDA plugin, or an ``EinshardError`` naming the extra."""
    for module in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.origin is not None:
            return Path(found.origin).parent
    raise missing_compiler("gpu")


def missing_compiler(platform: str) -> EinshardError:
    """The error for a target whose compiler is not installed."""
    if platform == "gpu":
        return EinshardError(
            "a GPU target needs XLA's GPU compiler, which is not installed",
            hint=f"pip install '{GPU_EXTRA}' {FROM_SOURCE}, or pip install 'jax[cuda13-local]', the same: "
            "jax-cuda13-plugin and jax-cuda13-pjrt at the installed JAX's version, about 140 MB; no GPU or "
            "NVIDIA library is needed.",
        )
    return EinshardError(
        "a TPU target needs TPU's compiler (libtpu), which is not installed",
        hint=f"pip install '{TPU_EXTRA}' {FROM_SOURCE}, or pip install 'jax[tpu]', the same: libtpu at the "
        "version the installed JAX names, about 200 MB.",
    )


def check_compiler(target: Target) -> None:
    """Raises the error naming the extra when the target's compiler is not installed.

    Raises:
        EinshardError: The compiler is missing, or its version is not the installed JAX's.
    """
    if target.platform == "gpu":
        _gpu_plugin()
        try:
            plugin = importlib.metadata.version("jax-cuda13-plugin")
            jaxlib = importlib.metadata.version("jaxlib")
        except importlib.metadata.PackageNotFoundError:
            return
        if plugin != jaxlib:
            raise EinshardError(
                f"XLA's GPU compiler is at version {plugin}, the installed JAX at {jaxlib}",
                hint=f"pip install 'jax-cuda13-plugin=={jaxlib}' 'jax-cuda13-pjrt=={jaxlib}' "
                f"(or pip install '{GPU_EXTRA}' {FROM_SOURCE}): JAX loads only its own version's plugin.",
            )
    elif target.platform == "tpu":
        try:
            found = importlib.util.find_spec("libtpu")
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise missing_compiler("tpu")


@functools.cache
def _bundled_specs(plugin: Path) -> dict[str, str]:
    """Every ``GpuTargetConfigProto`` text in the plugin's library, by its device description."""
    specs: dict[str, str] = {}
    for library in sorted(plugin.glob("*.so")):
        with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for match in re.finditer(rb"gpu_device_info \{", data):
                end = data.find(b"\x00", match.start())
                text = data[match.start() : end].decode(errors="replace")
                name = re.search(r'device_description_str: "([^"]*)"', text)
                if name is not None:
                    specs.setdefault(name.group(1), text)
    return specs


def gpu_spec_text(name: str) -> str:
    """XLA's spec (a ``GpuTargetConfigProto`` text) of a GPU target, read from the installed plugin.

    Raises:
        EinshardError: The plugin is not installed, or does not carry that GPU's spec.
    """
    plugin = _gpu_plugin()
    description = GPUS[name]
    specs = _bundled_specs(plugin)
    if description not in specs:
        raise EinshardError(
            f"XLA's GPU compiler at {plugin} carries no spec of {description!r} (target={name!r})",
            hint=f"Reinstall it: pip install '{GPU_EXTRA}' {FROM_SOURCE}; its specs: "
            f"{', '.join(sorted(specs)) or 'none'}.",
        )
    return specs[description]


def _number(text: str, key: str) -> float | None:
    match = re.search(rf"^\s*{key}:\s*([\d.e+-]+)\s*$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


# XLA's PrimitiveType numbers of the types a spec's matrix units have rates for; f32 on the
# matrix units is TF32.
_BF16 = 16  # XLA's PrimitiveType number of bf16, the key of a spec's rate_infos
_MATRIX_TYPES = {2: "s8", 10: "f16", 11: "tf32", 12: "f64", 16: "bf16", 19: "f8e5m2", 20: "f8e4m3fn"}


_RATE = re.compile(
    r"key:\s*(\d+)\s*value\s*\{\s*clock_rate_ghz:\s*([\d.]+)\s*units_per_core:\s*(\d+)\s*ops_per_clock:\s*(\d+)"
)


def spec_figures(text: str) -> dict[str, float]:
    """The figures a GPU spec gives: memory, memory bandwidth, peak FLOP/s, NVLink links.

    ``matrix_<type>`` is the matrix units' peak per element type (``matrix_tf32``: f32 through
    TF32; ``matrix_f32``: f32 at full precision, on the CUDA cores). The peak is
    ``2 x clock x units per core x ops per clock x cores`` of the matrix units'
    bf16 rate (a multiply-add is two FLOPs): 989 TFLOP/s for an H100 or H200.
    """
    figures: dict[str, float] = {}
    for key in ("device_memory_size", "memory_bandwidth", "core_count"):
        value = _number(text, key)
        if value is not None:
            figures[key] = value
    matrix = text[text.find("matrix_unit_description") :] if "matrix_unit_description" in text else ""
    rate = re.search(
        rf"key:\s*{_BF16}\s*value\s*\{{\s*clock_rate_ghz:\s*([\d.]+)\s*units_per_core:\s*(\d+)\s*"
        r"ops_per_clock:\s*(\d+)",
        matrix,
    )
    if rate is not None and "core_count" in figures:
        clock, units, ops = float(rate.group(1)), int(rate.group(2)), int(rate.group(3))
        figures["peak_flops_per_second"] = 2 * clock * 1e9 * units * ops * figures["core_count"]
    if "core_count" in figures:
        cores = figures["core_count"]
        scalar = text[text.find("scalar_unit_description") : text.find("matrix_unit_description")]
        for key, clock, units, ops in _RATE.findall(matrix):
            if int(key) in _MATRIX_TYPES:
                peak = 2 * float(clock) * 1e9 * int(units) * int(ops) * cores
                figures[f"matrix_{_MATRIX_TYPES[int(key)]}"] = peak
        for key, clock, units, ops in _RATE.findall(scalar):
            if int(key) == 11:  # f32 at full precision runs on the CUDA cores
                figures["matrix_f32"] = 2 * float(clock) * 1e9 * int(units) * int(ops) * cores
    links = re.search(r"device_interconnect_info\s*\{\s*active_links:\s*(\d+)", text)
    if links is not None:
        figures["active_links"] = int(links.group(1))
    major = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)", text)
    if major is not None:
        figures["compute_capability"] = int(major.group(1))
    return figures


def target_devices(target: Target) -> list[Any]:
    """The compile-only devices of the target (``jax.experimental.topologies``), in id order.

    GPU targets need ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` in the environment before JAX starts
    (the child process sets it).

    Raises:
        EinshardError: The compiler is missing, or refuses the topology.
    """
    from jax.experimental import topologies

    check_compiler(target)
    try:
        if target.platform == "gpu":
            description = topologies.get_topology_desc(
                "", "cuda", topology=target.topology, target_config=gpu_spec_text(target.name)
            )
        else:
            description = topologies.get_topology_desc(target.topology or "", "tpu", num_slices=target.slices)
    except EinshardError:
        raise
    except Exception as error:
        text = str(error).strip()
        hint = "Give another device count, or name the TPU slice yourself ('v5e:2x4')."
        if "libtpu" in text and "lockfile" in text:
            # libtpu lets one process per machine load it: another has (a second plan, a test worker).
            hint = (
                "Another process on this machine has loaded libtpu. Where no TPU is attached (compiling "
                "only), set ALLOW_MULTIPLE_LIBTPU_LOAD=1 in the environment before JAX starts, or give "
                "n_devices= to compile in a child process, which sets it."
            )
        raise EinshardError(
            f"XLA cannot make {target.label} to compile for: {text[:300]}", hint=hint
        ) from None
    devices = sorted(description.devices, key=lambda device: device.id)
    if len(devices) != target.n_devices:
        raise EinshardError(
            f"XLA made {len(devices)} devices for {target.label}, not {target.n_devices}",
            hint="Name the TPU slice yourself ('v5e:2x4'), with as many chips as n_devices.",
        )
    return devices
