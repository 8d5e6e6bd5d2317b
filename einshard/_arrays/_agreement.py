"""Checking that processes agree, without collectives and without waiting for ever.

``from_process_local`` assembles one global array from every process's part. Processes that
disagree (a part of another shape or dtype, another expression, or other values for a block
two processes both hold) would otherwise build an array that is silently wrong, or hang in
the first collective. Each process writes what it holds to the key-value store of JAX's
distributed runtime (the one ``jax.distributed.initialize`` starts) and reads the others'
with a timeout, so a mismatch is an :class:`EinshardError` on every process, naming the
processes that disagree, and a process that never arrives is an :class:`EinshardError`
after the timeout.

The store is reached through ``jax._src.distributed.global_state.client`` (JAX has no public
handle on it); tests/test_multihost.py fails loudly if that changes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._language._errors import EinshardError

__all__ = ["DEFAULT_TIMEOUT", "announce_failure", "block_hashes", "check_agreement"]

DEFAULT_TIMEOUT = 60.0
"""Seconds a process waits for the others' descriptions before it gives up."""

_calls = itertools.count()  # every process calls in the same order (SPMD), so the n-th calls pair up


def _client() -> Any:
    """The distributed runtime's client, or ``None`` (one process, or no runtime)."""
    from jax._src import distributed  # private; see the module docstring

    return getattr(distributed.global_state, "client", None)


def announce_failure(what: str, headline: str, *, timeout: float) -> None:
    """Tells the other processes that this process's call failed (they raise at once too)."""
    client = _client()
    if jax.process_count() == 1 or client is None:
        return
    key = f"einshard/{what}/{next(_calls)}/{jax.process_index()}"
    client.key_value_set(key, json.dumps({"error": headline}))


def check_agreement(
    *,
    what: str,
    description: dict[str, Any],
    block_hashes: dict[str, str] | None,
    timeout: float,
) -> None:
    """Compares ``description`` (and the hashes of the blocks held) across all processes.

    Args:
        what: The call, for messages (``'from_process_local'``).
        description: What must be equal in every process (shapes, dtype, expression, ...).
        block_hashes: Block index (as text) -> hash of its values, or ``None`` for no value check.
        timeout: Seconds to wait for the other processes.

    Raises:
        EinshardError: If processes disagree, or another process does not arrive in time.
    """
    n_processes = jax.process_count()
    client = _client()
    if n_processes == 1 or client is None:
        return
    me = jax.process_index()
    key = f"einshard/{what}/{next(_calls)}"
    client.key_value_set(f"{key}/{me}", json.dumps({"description": description, "blocks": block_hashes}))
    views: dict[int, dict[str, Any]] = {}
    missing = []
    for process in range(n_processes):
        try:
            text = client.blocking_key_value_get(f"{key}/{process}", max(1, int(timeout * 1000)))
        except Exception:  # the runtime's timeout error (its type is not public)
            missing.append(process)
            continue
        views[process] = json.loads(text)
    if missing:
        raise EinshardError(
            f"{what}: process{'es' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} did not reach this call within {timeout:g} s",
            hint=f"Every process must call {what} the same number of times, in the same order; "
            "a process that crashed or took another branch never arrives. Pass timeout= to wait "
            "longer.",
            context=[f"in process {me} of {n_processes}"],
        )
    failed = {process: view["error"] for process, view in views.items() if "error" in view}
    if failed:
        process, headline = min(failed.items())
        raise EinshardError(
            f"{what}: process {process} failed: {headline}",
            hint=f"Process {process} raised this error; fix it there (its own message has the details).",
            context=[f"in process {me} of {n_processes}"],
        )
    _compare_descriptions(what, views, me)
    if block_hashes is not None:
        _compare_blocks(what, views, me)


def _compare_descriptions(what: str, views: dict[int, dict[str, Any]], me: int) -> None:
    groups: dict[str, list[int]] = {}
    for process, view in sorted(views.items()):
        groups.setdefault(json.dumps(view["description"], sort_keys=True), []).append(process)
    if len(groups) == 1:
        return
    error = EinshardError(
        f"{what}: the processes disagree: {_disagreeing(groups.values())}",
        hint="Every process passes a part of the same dtype, with the same expression and "
        "global_shape, and the shape its devices hold.",
    )
    for text, processes in groups.items():
        plural = "es" if len(processes) > 1 else ""
        described = ", ".join(f"{k}={v}" for k, v in json.loads(text).items())
        error.add_context(f"process{plural} {', '.join(map(str, processes))}: {described}")
    raise error.add_context(f"in process {me} of {len(views)}")


def _compare_blocks(what: str, views: dict[int, dict[str, Any]], me: int) -> None:
    holders: dict[str, dict[str, list[int]]] = {}
    for process, view in sorted(views.items()):
        for block, digest in view["blocks"].items():
            holders.setdefault(block, {}).setdefault(digest, []).append(process)
    for block, by_digest in sorted(holders.items()):
        if len(by_digest) > 1:
            raise EinshardError(
                f"{what}: the processes hold different values for block {block}: "
                f"{_disagreeing(by_digest.values())}",
                hint="Processes whose devices hold the same block (the replicated part of the "
                "layout) must pass equal values for it.",
                context=[f"in process {me} of {len(views)}"],
            )


def _disagreeing(groups: Any) -> str:
    return " against ".join(f"[{', '.join(map(str, processes))}]" for processes in groups)


def block_hashes(
    local: Any, held: Sequence[Sequence[int]], shards: Sequence[int], global_shape: Sequence[int]
) -> dict[str, str]:
    """Hash of each block this process holds, read from its local part.

    ``held[axis]`` lists the block indices of the axis this process holds, ascending; the local
    part is those blocks concatenated in that order along each axis.
    """
    data = np.asarray(local)
    sizes = [size // count for size, count in zip(global_shape, shards, strict=True)]
    hashes = {}
    for blocks in itertools.product(*held):
        index = tuple(
            slice(position * size, (position + 1) * size)
            for position, size in zip(
                (list(axis_held).index(b) for axis_held, b in zip(held, blocks, strict=True)),
                sizes,
                strict=True,
            )
        )
        block = np.ascontiguousarray(data[index])
        digest = hashlib.blake2b(block.tobytes(), digest_size=16)
        digest.update(str((block.dtype.str, block.shape)).encode())
        hashes[str(tuple(blocks))] = digest.hexdigest()
    return hashes
