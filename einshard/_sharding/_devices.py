"""The einshard device order: one flat order of devices per process.

Every sharding einshard makes lays its mesh out row-major over this order, so
arrays sharded by different expressions meet in one ``jit``. The order is, by
precedence: ``devices=`` on the call; the ambient ``jax.set_mesh`` mesh (its
flat device order); a :func:`use_devices` block; all devices of the default
backend in ``jax.devices()`` order.

:func:`call_devices` is the one place that precedence is decided: every
function that takes ``devices=`` asks it once per call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
from jax.sharding import AbstractMesh, Mesh

from .._language._errors import EinshardError
from .._language._numbers import checked_count

__all__ = [
    "CallDevices",
    "Device",
    "DeviceOrder",
    "Devices",
    "ambient_mesh",
    "call_devices",
    "count_to_plan",
    "device_order",
    "use_devices",
]

if TYPE_CHECKING:  # jax.Device is an alias that type checkers do not accept as a type
    from jaxlib._jax import Device
else:
    Device = jax.Device

DeviceOrder = tuple[Device, ...]
"""A flat device order: the devices an einshard mesh is laid out over, in order."""

Devices = Sequence[Device] | Mesh
"""What ``devices=`` takes: devices in order, or a mesh meaning its flat device order."""

_block_devices: contextvars.ContextVar[DeviceOrder | None] = contextvars.ContextVar(
    "einshard_devices", default=None
)


@contextlib.contextmanager
def use_devices(devices: Devices) -> Iterator[DeviceOrder]:
    """Sets the einshard device order for a block of code.

    Inside the block, calls without ``devices=`` lay their meshes out over
    these devices, in this order. Blocks nest; the innermost wins.

    Args:
        devices: A sequence of devices, or a :class:`jax.sharding.Mesh`
            (meaning its devices in flat, row-major order).

    Yields:
        The device order as a tuple.

    >>> import jax, einshard
    >>> with einshard.use_devices(jax.devices()[:2]):
    ...     einshard.make_sharding('x -> x*').num_devices
    2
    """
    order = device_order(devices)
    token = _block_devices.set(order)
    try:
        yield order
    finally:
        _block_devices.reset(token)


def device_order(devices: Devices | None) -> DeviceOrder:
    """The device order for a call: ``devices`` if given, else the block's or the default.

    Args:
        devices: ``None``, a sequence of devices, or a mesh.

    Returns:
        The devices as a tuple, in order.

    Raises:
        EinshardError: If ``devices`` is empty, repeats a device, or holds
            something that is not a device.
    """
    if devices is None:
        block = _block_devices.get()
        return block if block is not None else tuple(jax.devices())
    if isinstance(devices, Mesh):
        return tuple(devices.devices.flat)
    if (  # the fast path: an already valid order
        isinstance(devices, tuple)
        and devices
        and all(isinstance(d, Device) for d in devices)
        and len(set(devices)) == len(devices)
    ):
        return devices
    return _checked_order(devices)


def _checked_order(devices: object) -> DeviceOrder:
    try:
        order = tuple(devices)  # type: ignore[arg-type]
    except TypeError:
        raise EinshardError(
            f"devices= must be a sequence of devices or a jax.sharding.Mesh, not {type(devices).__name__}",
            hint="For example devices=jax.devices()[:4], or devices=mesh.",
        ) from None
    if not order:
        raise EinshardError("devices= is empty", hint="Pass at least one device, e.g. jax.devices().")
    for device in order:
        if not isinstance(device, Device):
            raise EinshardError(
                f"devices= holds {device!r}, which is not a jax.Device",
                hint="Pass devices themselves (jax.devices()[i]), not their ids.",
            )
    if len(set(order)) != len(order):
        repeated = next(d for d in order if order.count(d) > 1)
        raise EinshardError(
            f"devices= lists {repeated} more than once",
            hint="List every device once; the order of the list is the order of the mesh.",
        )
    return order


def ambient_mesh() -> tuple[AbstractMesh, Mesh | None] | None:
    """The ambient mesh set by ``jax.set_mesh``: abstract, and concrete when outside a trace.

    Returns ``None`` when no mesh is set.
    """
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    try:
        concrete = jax.sharding.get_mesh()
    except ValueError:  # inside a trace only the abstract mesh is known
        concrete = None
    if concrete is not None and concrete.empty:
        concrete = None
    return abstract, concrete


class CallDevices(NamedTuple):
    """Where a call lays arrays out: a device order of einshard's own, or the ambient mesh.

    Attributes:
        order: The device order (``None`` on an ambient mesh known only
            abstractly, inside a trace).
        mesh: The ambient ``jax.set_mesh`` mesh (abstract), or ``None``.
        concrete: The ambient mesh with its devices, when they are known.
    """

    order: DeviceOrder | None
    mesh: AbstractMesh | None = None
    concrete: Mesh | None = None

    @property
    def count(self) -> int:
        """The number of devices."""
        return self.mesh.size if self.mesh is not None else len(self.order or ())

    def describe(self) -> str:
        """Where, for an error's context: ``on 8 CPU devices``, ``on the ambient mesh data=2, model=4``."""
        if self.mesh is not None:
            return "on the ambient mesh " + ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        assert self.order is not None
        plural = "" if len(self.order) == 1 else "s"
        return f"on {len(self.order)} {self.order[0].platform.upper()} device{plural}"


def call_devices(devices: Devices | None) -> CallDevices:
    """The devices a call lays its arrays out over, decided once per call.

    ``devices`` if given; else the ambient ``jax.set_mesh`` mesh; else the
    :func:`use_devices` block's devices; else ``jax.devices()``.

    Raises:
        EinshardError: If ``devices`` is not a valid device order.
    """
    if devices is None:
        ambient = ambient_mesh()
        if ambient is not None:
            abstract, concrete = ambient
            order = tuple(concrete.devices.flat) if concrete is not None else None
            return CallDevices(order, abstract, concrete)
    order = device_order(devices)
    target = _targets.get(order)
    if target is None:  # one per device order: building the tuple costs a third of a cached call
        if len(_targets) >= 256:
            _targets.clear()
        target = _targets[order] = CallDevices(order)
    return target


_targets: dict[DeviceOrder, CallDevices] = {}


def count_to_plan(n_devices: object, hint: str) -> int:
    """The device count a report or a plan is for: ``n_devices`` (checked), else this process's.

    Args:
        n_devices: The count the user gave, or ``None``.
        hint: What the error for a bad count suggests.
    """
    if n_devices is None:
        return call_devices(None).count
    return checked_count(n_devices, "n_devices", hint=hint)
