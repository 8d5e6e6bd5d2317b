"""Checks of the numbers a user passes (shape sizes, device counts), before any cache sees them.

A cache keyed by a value treats ``True`` as ``1`` and ``8.0`` as ``8``; so whether an input is
valid is decided here, outside every cache, and never depends on what was called before.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from ._errors import EinshardError

__all__ = [
    "MAX_COUNT",
    "check_array_value",
    "checked_device_count",
    "checked_n_dims",
    "checked_shape",
    "flatten_or_explain",
]

T = TypeVar("T")

MAX_COUNT = 2**63
"""The largest device count or array size einshard takes (NumPy's sizes are 64-bit signed)."""


def checked_device_count(n_devices: Any) -> int:
    """``n_devices`` if it is an ``int`` (not a bool) from 1 to 2**63, else an :class:`EinshardError`."""
    if type(n_devices) is int and 1 <= n_devices <= MAX_COUNT:  # the common case, first
        return n_devices
    if isinstance(n_devices, int) and not isinstance(n_devices, bool) and 1 <= n_devices <= MAX_COUNT:
        return int(n_devices)
    if isinstance(n_devices, int) and not isinstance(n_devices, bool) and n_devices > MAX_COUNT:
        raise EinshardError(
            f"the device count must be a positive integer up to 2**63, not one of "
            f"{n_devices.bit_length()} bits",
            hint="Pass the number of devices to plan for, e.g. n_devices=256.",
        )
    raise EinshardError(f"the device count must be a positive integer, not {_short_repr(n_devices)}")


def checked_n_dims(n_dims: Any) -> int | None:
    """``n_dims`` if it is ``None`` or a non-negative ``int`` (not a bool)."""
    if n_dims is None or (type(n_dims) is int and n_dims >= 0):
        return n_dims
    raise EinshardError(f"n_dims must be a non-negative integer, not {_short_repr(n_dims)}")


def checked_shape(shape: Any) -> tuple[int, ...]:
    """The shape as a tuple of ints, each a whole number from 0 to 2**63.

    Refuses what ``int()`` would silently change: ``8.5`` (truncated), ``True``, ``'8'``.
    """
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        sizes = tuple(shape)
    except TypeError:
        raise EinshardError(f"shape must be a sequence of integers, not {_short_repr(shape)}") from None
    result = []
    for size in sizes:
        if isinstance(size, bool):
            index = None
        else:
            try:
                index = operator.index(size)  # ints and NumPy integers; not floats or strings
            except TypeError:
                index = None
        if index is None:
            hint = None
            if isinstance(size, float) and size.is_integer():
                hint = f"Write the size as an integer: {int(size)}."
            raise EinshardError(
                f"shape must be a sequence of integers, not {_short_repr(shape)}: "
                f"{_short_repr(size)} is not an integer",
                hint=hint,
            )
        if index < 0:
            raise EinshardError(f"shape {_short_repr(tuple(sizes))} has a negative size")
        if index > MAX_COUNT:
            raise EinshardError(
                f"shape has a size of {index.bit_length()} bits; array sizes are at most 2**63"
            )
        result.append(index)
    return tuple(result)


def _short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (and safe for ints of any size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except ValueError:  # e.g. an int beyond the string conversion limit inside a container
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def flatten_or_explain(flatten: Callable[[Any], T], tree: Any) -> T:
    """``flatten(tree)``, with JAX's failures on a malformed tree turned into an :class:`EinshardError`.

    JAX sorts a dict's keys to flatten it (keys of mixed types fail to sort), and its C++
    flattening has a depth limit of its own.
    """
    try:
        return flatten(tree)
    except (ValueError, TypeError) as error:
        if "sorting pytree dictionary keys" not in str(error):
            raise
        keys = _unsortable_keys(tree)
        raise EinshardError(
            "a dict in the tree has keys that cannot be sorted together (e.g. ints and strings)",
            hint="JAX sorts a dict's keys to flatten it: give each dict keys of one type, e.g. all strings.",
            context=[f"in a dict with the keys {_short_repr(keys)}"] if keys is not None else [],
        ) from None
    except (RecursionError, SystemError) as error:
        if isinstance(error, SystemError) and "exception set" not in str(error):
            raise
    # Deep trees meet the interpreter's recursion budget, part of which the caller's own stack
    # has used: try once more on a fresh thread (a fresh budget, a large stack).
    try:
        return _on_fresh_thread(flatten, tree)
    except (RecursionError, SystemError):
        raise EinshardError(
            "the tree is nested too deeply to flatten",
            hint="JAX's tree functions (and so einshard's) take trees a few thousand levels deep "
            "at most; flatten the structure, e.g. a dict from path strings to arrays.",
        ) from None


def _on_fresh_thread(function: Callable[[Any], T], argument: Any) -> T:
    """``function(argument)`` on a new thread with a 256 MiB stack; its exception re-raised here."""
    import threading

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, function(argument)))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))

    previous = threading.stack_size(256 * 2**20)
    try:
        thread = threading.Thread(target=run, name="einshard-deep-tree")
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _unsortable_keys(tree: Any, limit: int = 10_000) -> list[Any] | None:
    """The keys of the first dict (breadth first, bounded) whose keys do not sort, or ``None``."""
    queue = [tree]
    for node in queue:
        if len(queue) > limit:
            break
        if isinstance(node, dict):
            try:
                sorted(node)
            except TypeError:
                return list(node)[:10]
            queue.extend(node.values())
        elif isinstance(node, (list, tuple)):
            queue.extend(node)
    return None


def check_array_value(x: Any) -> None:
    """Refuses, as an :class:`EinshardError`, values JAX cannot hold as an array.

    NumPy arrays of strings, bytes, objects, records or dates (JAX's ``TypeError``), and Python
    ints beyond JAX's default integer type (JAX's ``OverflowError``).
    """
    dtype = getattr(x, "dtype", None)
    if isinstance(x, (np.ndarray, np.generic)) and dtype is not None and dtype.kind in "OUSVMm":
        what = "Python objects" if dtype.kind == "O" else f"dtype {dtype}"
        raise EinshardError(
            f"cannot shard an array of {what}",
            hint="Pass numbers: a jax.Array, a NumPy array, a scalar or a nested list of numbers.",
        )
    if isinstance(x, int) and not isinstance(x, bool):
        int_type = np.iinfo(jax.dtypes.canonicalize_dtype(np.int64))
        if not int_type.min <= x <= int_type.max:
            raise EinshardError(
                f"the integer {_short_repr(x)} does not fit JAX's {int_type.dtype} "
                f"({int_type.min} to {int_type.max})",
                hint="Pass a float (e.g. float(x)), or enable 64-bit integers with "
                "jax.config.update('jax_enable_x64', True) if it fits int64.",
            )


def check_params_for_state(opt_state: Any, params: Any) -> None:
    """Refuses ``params`` that cannot be the parameters ``opt_state`` belongs to.

    They must be a tree of arrays (``jax.Array``, NumPy arrays or ``jax.ShapeDtypeStruct``;
    ``None`` allowed), at least one; and when the state holds arrays of more than one element,
    at least one of them must have the shape of a parameter (moments mirror their parameter)
    or be made of some of a parameter's sizes (factored statistics, as Adafactor keeps), or a
    part of the state must have the params' structure.
    """
    leaves = flatten_or_explain(jax.tree_util.tree_leaves, params)
    not_arrays = [leaf for leaf in leaves if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))]
    if not leaves or not_arrays:
        what = f"{type(params).__name__}" if not leaves else f"a tree holding {_short_repr(not_arrays[0])}"
        raise EinshardError(
            f"params must be the tree of arrays the optimizer state belongs to, not {what}",
            hint="Pass the parameters, e.g. shard_opt_state(opt_state, params) with params placed "
            "by shard_pytree (or abstract, with shardings).",
        )
    param_shapes = {tuple(leaf.shape) for leaf in leaves}
    state_shapes = {
        tuple(leaf.shape)
        for leaf in jax.tree_util.tree_leaves(opt_state)
        if hasattr(leaf, "shape") and math.prod(leaf.shape) > 1
    }
    if (
        state_shapes
        and not any(_sizes_within(state, param) for state in state_shapes for param in param_shapes)
        and not _has_subtree_like(opt_state, params)
    ):
        raise EinshardError(
            "the optimizer state does not belong to these params: none of its arrays has the "
            "shape of a parameter, or sizes of one",
            hint="Pass the params the state was made from (tx.init(params)).",
            context=[
                f"state shapes {_short_repr(sorted(state_shapes))}, "
                f"param shapes {_short_repr(sorted(param_shapes))}"
            ],
        )


def _sizes_within(state: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Whether ``state``'s sizes are some of ``param``'s (each used at most once)."""
    left = list(param)
    for size in state:
        if size not in left:
            return False
        left.remove(size)
    return True


def _has_subtree_like(tree: Any, like: Any) -> bool:
    """Whether a node of ``tree`` has the tree structure of ``like``."""
    structure = jax.tree_util.tree_structure(like)
    kind = type(like)
    found = []

    def is_like(node: Any) -> bool:
        if type(node) is kind and jax.tree_util.tree_structure(node) == structure:
            found.append(node)
            return True
        return False

    jax.tree_util.tree_leaves(tree, is_leaf=is_like)
    return bool(found)
