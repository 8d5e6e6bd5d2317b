"""Several processes: JAX's multi-controller runtime (``jax.distributed.initialize``).

With several processes, ``jax.devices()`` lists every device of every process,
in the same order in each, so einshard's default device order is global and
identical everywhere, and a sharding it makes spans all processes. Two ways of
building a global array follow from where the data is:

* every process holds the whole value (host data, or a ``jax.Array`` on its own
  devices): placing it (``einshard._arrays._place``) puts each process's shards of it
  on its devices;
* every process holds only its own part, as a data loader gives each process
  its own rows of a batch: :func:`from_process_local` assembles the global
  array from those parts, as the expression lays it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._language._errors import EinshardError, adding_context
from .._language._layout import Layout
from .._sharding._devices import Devices, call_devices
from .._sharding._expression_sharding import expression_sharding
from ._agreement import DEFAULT_TIMEOUT, announce_failure, block_hashes, check_agreement
from ._arrays import check_arguments, sharding_context
from ._leaves import is_concrete_array

__all__ = ["from_process_local"]


def from_process_local(
    local: Any,
    expression: str,
    *,
    global_shape: Sequence[int] | None = None,
    devices: Devices | None = None,
    check_values: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> jax.Array:
    """Builds a global array from each process's own part of it, laid out by an expression.

    Each process passes the part of the global array that its own devices
    hold under the expression's layout: for ``'b d -> b* d'`` over two
    processes of four devices each, process 0 passes rows ``0 … n/2`` of an
    ``n``-row batch and process 1 the rest. An axis whose blocks are all on
    this process's devices (not split across processes) is passed whole. In a
    single process the part is the whole array.

    Where a process's devices hold blocks that are not next to each other
    (a ``devices=`` order that interleaves processes), its part is its blocks
    concatenated in index order.

    Args:
        local: This process's part: a NumPy array, a ``jax.Array``, or
            anything ``numpy.asarray`` takes.
        expression: An einshard expression, e.g. ``'b d -> b* d'``.
        global_shape: The global array's shape. By default it is inferred
            from the local shape and the layout; given, the local shape is
            checked against it.
        devices: The devices, in order (see :func:`~einshard.make_sharding`).
        check_values: Also check that processes holding the same block (the
            replicated part of a layout) pass equal values for it, by a hash of
            each block gathered across processes (a pass over the local part).
        timeout: Seconds to wait for the other processes. With several
            processes, every process first checks that all agree on the
            expression, the dtype and the global shape (through the key-value
            store of ``jax.distributed``; no collective), so a mismatch, or a
            process that never makes this call, is an error on every process
            instead of a wrong array or a hang.

    Returns:
        The global ``jax.Array``, sharded as the expression says.

    Raises:
        EinshardError: If the expression does not fit, this process owns none
            of the devices, the local part has the wrong shape, the processes
            disagree (naming which), or another process does not arrive within
            ``timeout`` seconds.

    >>> import numpy as np, einshard
    >>> batch = einshard.from_process_local(np.ones((16, 4)), 'b d -> b* d')
    >>> batch.shape, batch.sharding.shard_shape(batch.shape)
    ((16, 4), (2, 4))
    """
    try:
        local, layout, sharding, shape, held = _checked_local_part(local, expression, global_shape, devices)
    except EinshardError as error:  # the other processes learn of it, instead of waiting
        announce_failure("from_process_local", error.headline, timeout=timeout)
        raise
    hashes = None
    if check_values:
        hashes = block_hashes(local, [sorted(h) or [0] for h in held], layout.shards, shape)
    check_agreement(
        what="from_process_local",
        description={
            "expression": layout.expression.text,
            "dtype": str(np.dtype(local.dtype)),
            "global shape": list(shape),
        },
        block_hashes=hashes,
        timeout=timeout,
    )
    return jax.make_array_from_process_local_data(sharding, local, shape)


def _checked_local_part(
    local: Any, expression: str, global_shape: Sequence[int] | None, devices: Devices | None
) -> tuple[Any, Any, NamedSharding, tuple[int, ...], list[set[int]]]:
    """This process's part, checked against the layout.

    Returns the part, the layout, the sharding, the global shape and the blocks of each axis
    this process holds.
    """
    if not is_concrete_array(local):
        local = np.asarray(local)
    local_shape = tuple(int(size) for size in local.shape)
    check_arguments(expression)
    given_shape = None if global_shape is None else _checked_global_shape(global_shape)
    with adding_context(sharding_context, None, devices):
        layout, sharding = expression_sharding(expression, len(local_shape), call_devices(devices))
    with adding_context(_process_context, local_shape):
        return _assemble(local, local_shape, given_shape, layout, sharding)


def _checked_global_shape(global_shape: object) -> tuple[int, ...]:
    try:
        return tuple(int(size) for size in global_shape)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise EinshardError(f"global_shape must be a sequence of integers, not {global_shape!r}") from None


def _process_context(error: EinshardError, local_shape: tuple[int, ...]) -> None:
    error.add_context(
        f"while building a global array from process {jax.process_index()}'s part of shape {local_shape}"
    )


def _assemble(
    local: Any,
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...] | None,
    layout: Layout,
    sharding: NamedSharding,
) -> tuple[Any, Layout, NamedSharding, tuple[int, ...], list[set[int]]]:
    """This process's part checked against the layout: (part, layout, sharding, global shape, blocks held)."""
    process = jax.process_index()
    # Which blocks of each axis this process's devices hold: the index map of an
    # array whose every axis has one element per block.
    blocks = sharding.devices_indices_map(layout.shards)
    held: list[set[int]] = [set() for _ in local_shape]
    for device, index in blocks.items():
        if device.process_index == process:
            for axis, part in enumerate(index):
                held[axis].add(part.indices(layout.shards[axis])[0])
    if not any(held) and local_shape:
        raise EinshardError(
            f"process {process} owns none of the {len(blocks)} devices the array is laid out over",
            hint="Call from_process_local in the processes whose devices are in devices=.",
        )
    own = tuple(len(h) if local_shape else 1 for h in held)
    if global_shape is None:
        bad = [axis for axis, (size, k) in enumerate(zip(local_shape, own, strict=True)) if size % k]
        if bad:
            axis = bad[0]
            raise EinshardError(
                f"axis {axis} of the local part has size {local_shape[axis]}, which does not divide "
                f"into the {own[axis]} blocks this process holds",
                expression=layout.expression.text,
                hint=f"Pass a local part whose axis {axis} is a multiple of {own[axis]}.",
            )
        shape = tuple(size // k * n for size, k, n in zip(local_shape, own, layout.shards, strict=True))
    else:
        shape = global_shape
        if len(shape) != len(local_shape):
            raise EinshardError(
                f"global_shape {shape} has rank {len(shape)}, the local part rank {len(local_shape)}",
                hint="The local part has the global array's rank; only the split axes are shorter.",
            )
        layout.check_shape(shape)
        expected = tuple(size // n * k for size, n, k in zip(shape, layout.shards, own, strict=True))
        if expected != local_shape:
            raise EinshardError(
                f"process {process} should pass a local part of shape {expected} for global shape "
                f"{shape}, not {local_shape}",
                expression=layout.expression.text,
                hint="Each process passes the blocks its devices hold: "
                + ", ".join(
                    f"axis {axis}: {k} of {n} blocks"
                    for axis, (k, n) in enumerate(zip(own, layout.shards, strict=True))
                    if n > 1
                )
                + ".",
            )
    layout.check_shape(shape)
    return local, layout, sharding, shape, held
