"""Putting values where their shardings say: one leaf, or a whole tree, in one or several processes.

:func:`place_tree` is the one placing service of the package; the array
functions, the rule-table functions and the integrations all call it (or
:func:`place_leaf` for a single value). Each kind of leaf is placed its own way:

* a traced value (inside ``jit``, ``grad``, ``vmap``): a sharding constraint,
  or a reshard when the sharding's mesh has Explicit axes (``jax.set_mesh``
  with ``AxisType.Explicit``);
* a ``jax.ShapeDtypeStruct``: the same struct, carrying the sharding;
* a concrete value (``jax.Array``, NumPy, Python scalar): ``jax.device_put``,
  all of a tree's in one call; except, on CPU devices in one process, a large
  NumPy array or ``jax.Array``, which is put block by block (see below);
* with several processes, a ``jax.Array`` held whole on this process's devices
  and a sharding spanning other processes' devices: each process puts its own
  shards of it on its own devices (``jax.device_put`` would reject it).

Block by block, on CPU devices: each device's block is copied from the
input (NumPy slices, or the input's own shards, read in place) into a new
64-byte aligned host buffer of its own, which the CPU client then takes as the
device buffer without a further copy; the blocks are assembled with
``jax.make_array_from_single_device_arrays``. ``jax.device_put`` makes the
same copies, but into memory it allocates itself, which is much slower to
fault in for large buffers, and once per device where a block is replicated;
``benchmarks/bench_placement.py`` measures both against the memcpy floor.
The result is ``jax.device_put``'s bit for bit, with the same sharding, and no
device shares a buffer with another or with the input where
``jax.device_put``'s would not (a one-device input's buffer is reused on its
own device, as ``jax.device_put`` does). Everything else goes to
``jax.device_put``: other platforms (one host transfer plus device-to-device
copies is not measured there), several processes, arrays and blocks below
the sizes where block by block was measured faster (``BLOCKWISE_MIN_*``), dtypes it would convert,
and a 64-byte aligned NumPy input, which ``jax.device_put`` may take without
copying (on CPU it then aliases the caller's buffer; einshard keeps that
behaviour rather than change it).

Signatures, for the integrations:

* ``place_tree(tree, shardings) -> tree``: ``shardings`` has the structure of
  ``tree`` (as ``jax.tree_util`` flattens it), with a ``jax.sharding.Sharding``
  at each leaf to place and ``None`` at each leaf to pass through untouched;
  or it is a flat list with one entry per leaf of ``tree``.
* ``place_leaves(leaves, shardings) -> list``: the same over flat lists.
* ``place_leaf(x, sharding) -> value``: one leaf, of any kind above.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Sharding

__all__ = ["place_leaf", "place_leaves", "place_tree"]


def place_leaf(x: Any, sharding: Sharding) -> Any:
    """One value placed by ``sharding``, as its kind wants (see the module docstring)."""
    if isinstance(x, Tracer):
        if _has_explicit_axes(sharding):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    if _needs_callback(x, sharding):
        return _from_whole(x, sharding)
    plan = _blockwise_plan(x, sharding)
    if plan is not None:
        return _run_plans([plan])[0]
    return jax.device_put(x, sharding)


def place_tree(tree: Any, shardings: Any) -> Any:
    """Every leaf of ``tree`` placed by its sharding; leaves whose sharding is ``None`` kept.

    Concrete leaves are put in one ``jax.device_put`` call where they can be,
    as ``jax.device_put(tree, shardings)`` would.

    Args:
        tree: Any pytree.
        shardings: A tree of the same structure with a sharding or ``None``
            at every leaf, or a list with one entry per leaf.

    Returns:
        The tree, same structure, each leaf placed.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not isinstance(shardings, list):
        shardings = treedef.flatten_up_to(shardings)
    return jax.tree_util.tree_unflatten(treedef, place_leaves(leaves, shardings))


def place_leaves(leaves: Sequence[Any], shardings: Sequence[Sharding | None]) -> list[Any]:
    """Each leaf placed by its sharding (``None``: kept); concrete ones in one ``jax.device_put``."""
    out = list(leaves)
    batch_at: list[int] = []
    plan_at: list[int] = []
    plans: list[_Plan] = []
    for i, (leaf, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        if sharding is None:
            continue
        if isinstance(leaf, (Tracer, jax.ShapeDtypeStruct)) or _needs_callback(leaf, sharding):
            out[i] = place_leaf(leaf, sharding)
        elif (plan := _blockwise_plan(leaf, sharding)) is not None:
            plan_at.append(i)
            plans.append(plan)
        else:
            batch_at.append(i)
    if batch_at:  # one call places them all (asynchronously: the copies below overlap it)
        placed = jax.device_put([leaves[i] for i in batch_at], [shardings[i] for i in batch_at])
        for i, value in zip(batch_at, placed, strict=True):
            out[i] = value
    if plans:  # the large CPU leaves, block by block, all their copies together
        for i, value in zip(plan_at, _run_plans(plans), strict=True):
            out[i] = value
    return out


def _has_explicit_axes(sharding: Sharding) -> bool:
    mesh = getattr(sharding, "mesh", None)
    return any(kind == AxisType.Explicit for kind in getattr(mesh, "axis_types", ()))


def _needs_callback(x: Any, sharding: Sharding) -> bool:
    """A process-local ``jax.Array`` bound for a sharding over other processes' devices too."""
    return (
        isinstance(x, jax.Array)
        and not sharding.is_fully_addressable
        and x.is_fully_addressable
        and jax.process_count() > 1
    )


def _from_whole(x: jax.Array, sharding: Sharding) -> jax.Array:
    """Each process puts its own shards of a value it holds whole."""
    return jax.make_array_from_callback(tuple(x.shape), sharding, lambda index: x[index])


# --- block by block, on CPU devices (see the module docstring) ----------------------------------------

# When block by block is faster, as measured by benchmarks/bench_placement.py: from a jax.Array of at
# least BLOCKWISE_MIN_BYTES_FROM_JAX to a layout that splits it (device_put goes through the host
# value, or copies device to device); and, from NumPy or to a layout that replicates blocks, when a
# block has BLOCKWISE_MIN_BLOCK_BYTES (device_put's own buffers that large are fresh memory, slow to
# fault in; below it, its parallel copies into reused memory are as fast or faster).
BLOCKWISE_MIN_BYTES_FROM_JAX = 4 << 20
BLOCKWISE_MIN_BLOCK_BYTES = 32 << 20
_PARALLEL_MIN_BYTES = 8 << 20  # copies of fewer bytes in all stay on the calling thread
_ALIGN = 64  # the CPU client takes a host buffer as the device buffer, uncopied, from this alignment
_copy_pool: ThreadPoolExecutor | None = None


class _Target(NamedTuple):
    """One device's block: where it goes, its shape, and what is copied into it."""

    device: Any
    shape: tuple[int, ...]
    pieces: list[tuple[tuple[slice, ...], Any]]  # (where in the block, a NumPy view of the source)
    reuse: jax.Array | None  # the input's own one-device buffer, kept as device_put keeps it


class _Plan(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    targets: list[_Target]


def _blockwise_plan(x: Any, sharding: Sharding) -> _Plan | None:
    """How to place ``x`` block by block, or ``None`` where ``jax.device_put`` is to place it."""
    if type(x) is np.ndarray:
        if x.nbytes < BLOCKWISE_MIN_BLOCK_BYTES or x.ctypes.data % _ALIGN == 0:
            return None
        if not _plain_dtype(x.dtype):
            return None
        held: dict[Any, Any] = {}
        sources = [(tuple((0, size) for size in x.shape), x)]
    elif isinstance(x, jax.Array):
        if (
            x.nbytes < BLOCKWISE_MIN_BYTES_FROM_JAX
            or getattr(x, "weak_type", False)
            or not _plain_dtype(x.dtype)
            or not x.is_fully_addressable
            or x.is_deleted()
            or x.sharding == sharding
            or not _cpu_blocks(x.sharding, x.shape)
        ):
            return None
        # Each block the input holds, by device, and each distinct block once, to copy from
        shards = x.addressable_shards
        held = {(shard.device, _bounds(shard.index, x.shape)): shard for shard in shards}
        distinct = {bounds: shard for (_, bounds), shard in reversed(held.items())}
        sources = [(bounds, np.asarray(shard.data)) for bounds, shard in distinct.items()]
    else:
        return None
    blocks = _cpu_blocks(sharding, x.shape)
    if not blocks or jax.process_count() > 1:
        return None
    if (not held or _replicates(blocks)) and _largest_block_bytes(
        blocks, x.dtype.itemsize
    ) < BLOCKWISE_MIN_BLOCK_BYTES:
        return None
    one_device = len(held) == 1
    targets = []
    for device, bounds in blocks:
        block_shape = tuple(b - a for a, b in bounds)
        own = held.get((device, bounds))
        if own is not None:
            if not one_device:  # device_put's sharing here is not established: leave it to device_put
                return None
            targets.append(_Target(device, block_shape, [], own.data))  # as device_put reuses it
            continue
        pieces = []
        for source_bounds, view in sources:
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(bounds, source_bounds, strict=True)]
            if all(lo < hi for lo, hi in overlap):
                into = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, bounds, strict=True))
                take = tuple(
                    slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, source_bounds, strict=True)
                )
                pieces.append((into, view[take]))
        targets.append(_Target(device, block_shape, pieces, None))
    return _Plan(tuple(x.shape), np.dtype(x.dtype), sharding, targets)


def _run_plans(plans: list[_Plan]) -> list[jax.Array]:
    """Copies every block of every plan into a buffer of its own; one ``device_put`` takes them all."""
    jobs = [(plan.dtype, target) for plan in plans for target in plan.targets if target.reuse is None]
    total = sum(math.prod(target.shape) * dtype.itemsize for dtype, target in jobs)
    if total >= _PARALLEL_MIN_BYTES and len(jobs) > 1 and (os.cpu_count() or 1) > 1:
        buffers = list(_pool().map(_filled_block, jobs))
    else:
        buffers = [_filled_block(job) for job in jobs]
    placed = iter(jax.device_put(buffers, [target.device for _, target in jobs], may_alias=True))
    out = []
    for plan in plans:
        arrays = [target.reuse if target.reuse is not None else next(placed) for target in plan.targets]
        out.append(jax.make_array_from_single_device_arrays(plan.shape, plan.sharding, arrays))
    return out


def _filled_block(job: tuple[np.dtype, _Target]) -> np.ndarray:
    """A new aligned host buffer holding one block (read-only: it is the device buffer from now on)."""
    dtype, target = job
    nbytes = math.prod(target.shape) * dtype.itemsize
    # NumPy's allocator: it advises huge pages for large buffers, which fault in far faster than the
    # CPU client's own allocations (measured against MAP_POPULATE and plain mappings too).
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    block = raw[start : start + nbytes].view(dtype).reshape(target.shape)
    for into, view in target.pieces:
        np.copyto(block[into] if into else block, view)  # a 0-d block indexed by () is a scalar
    block.flags.writeable = False
    return block


def _pool() -> ThreadPoolExecutor:
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="einshard-place")
    return _copy_pool


def _plain_dtype(dtype: Any) -> bool:
    """A dtype whose bytes ``jax.device_put`` takes as they are: no conversion, whole bytes per element."""
    try:
        dtype = np.dtype(dtype)
        return (
            dtype.isnative
            and dtype.kind in "biufcV"
            and jax.dtypes.canonicalize_dtype(dtype) == dtype
            and jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize
        )
    except (TypeError, ValueError):
        return False


def _replicates(blocks: Sequence[tuple[Any, tuple[tuple[int, int], ...]]]) -> bool:
    """Whether some block is on more than one device."""
    return len({bounds for _, bounds in blocks}) < len(blocks)


def _largest_block_bytes(blocks: Sequence[tuple[Any, tuple[tuple[int, int], ...]]], itemsize: int) -> int:
    return itemsize * max(math.prod(b - a for a, b in bounds) for _, bounds in blocks)


def _bounds(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A block's ``(start, stop)`` on each axis, from its index in ``devices_indices_map``."""
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=1024)
def _cpu_blocks(
    sharding: Sharding, shape: tuple[int, ...]
) -> tuple[tuple[Any, tuple[tuple[int, int], ...]], ...]:
    """Each device's block bounds, for a sharding over local CPU devices (default memory); else ()."""
    if not sharding.is_fully_addressable or not all(d.platform == "cpu" for d in sharding.device_set):
        return ()
    memory_kind = sharding.memory_kind
    if memory_kind is not None and any(d.default_memory().kind != memory_kind for d in sharding.device_set):
        return ()
    return tuple(
        (device, _bounds(index, shape)) for device, index in sharding.devices_indices_map(shape).items()
    )
