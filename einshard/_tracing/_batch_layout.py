"""The batch's layout inside a step: ``use_strategy`` and ``like_batch``.

Model code marks a batch-major activation once (``x = einshard.like_batch(x)``, in a scanned
layer's body); the layout comes from the strategy the step runs under: the candidate's while
:func:`~einshard.plan` compiles it, the one in a :func:`use_strategy` block when the user runs
the step. Outside any, ``like_batch`` returns its argument: the model still runs on one device.

``constrain_loops`` (in ``_cost/pipeline/_program.py``, beside the program it rewrites) does the same for
a step nobody marked: it finds the loops whose carry comes from the batch (``_loops``) and
constrains their carries, so the step the user runs is the program ``plan`` ranked.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers
from collections.abc import Callable, Iterator
from typing import Any

from .._arrays._arrays import einshard
from .._language._errors import EinshardError, short_repr
from .._language._expression import parse
from .._language._layout import carried_expression, compile_layout
from .._sharding._devices import call_devices
from .._trees._strategy import Strategy
from ._loops import MARK

__all__ = [
    "batch_expression_for",
    "batch_split",
    "current_batch",
    "like_batch",
    "traced_under",
    "use_strategy",
]

_BATCH: contextvars.ContextVar[str | None] = contextvars.ContextVar("einshard_batch", default=None)
_MARKED = 0  # how many times like_batch met a strategy in this process
_CALLED = 0  # how many times like_batch was called in this process, with a strategy or without


def marks() -> int:
    """How many times :func:`like_batch` has met a strategy in this process.

    A step traced under one strategy may be kept by ``jax.jit``'s caches (an inner jitted
    function of the model): the in-process planner clears them between candidates when this
    count moved, so that each candidate's trace is its own.
    """
    return _MARKED


def like_batch_calls() -> int:
    """How many times :func:`like_batch` has been called in this process, under a strategy or not.

    A trace in which this count did not move is every strategy's program: ``like_batch`` is how
    a strategy reaches into a step.
    """
    return _CALLED


def current_batch() -> str | None:
    """The batch expression of the innermost :func:`use_strategy` block, or ``None``."""
    return _BATCH.get()


def strategy_batch(strategy: Any, caller: str) -> str:
    """The batch expression of a strategy, or the expression given instead (checked)."""
    return _batch_of(strategy, caller)


def _batch_of(strategy: Any, caller: str) -> str:
    if isinstance(strategy, Strategy):
        return strategy.batch
    if isinstance(strategy, str):
        parse(strategy)  # an expression: its mistakes are the parser's
        return strategy
    raise EinshardError(
        f"{caller} takes a Strategy or a batch expression, not {short_repr(strategy)}",
        hint="Give plan(...).best, einshard.strategies.fsdp(), or the batch's expression "
        "('b ... -> b* ...').",
    )


@contextlib.contextmanager
def use_strategy(strategy: Strategy | str) -> Iterator[str]:
    """Runs a block of code under a strategy: :func:`like_batch` lays activations out as its batch.

    Blocks nest; the innermost wins. ``jax.jit`` traces a function once and keeps the program,
    so the block must be around the call that traces it (the first), or use
    :func:`constrain_loops`, which carries the strategy into every trace of the step.

    Args:
        strategy: A :class:`~einshard.strategies.Strategy` (its ``.batch``), or the batch's
            expression itself (``'b ... -> b* ...'``).

    Yields:
        The batch expression.

    Raises:
        EinshardError: For anything else, or an expression that does not parse.

    >>> import jax, jax.numpy as jnp, einshard
    >>> with einshard.use_strategy(einshard.strategies.fsdp()):
    ...     x = einshard.like_batch(jnp.zeros((16, 4)))
    >>> x.sharding.shard_shape(x.shape)
    (2, 4)
    """
    token = _BATCH.set(_batch_of(strategy, "use_strategy"))
    try:
        yield _BATCH.get() or ""
    finally:
        _BATCH.reset(token)


def like_batch(x: Any) -> Any:
    """Lays out a batch-major activation (its first axis the batch) as the strategy lays out the batch.

    Inside a step that is traced under a strategy (a :func:`use_strategy` block, the candidates
    of :func:`~einshard.plan`, :func:`~einshard.explain_step` with a strategy, a step wrapped by
    :func:`constrain_loops`), it is a sharding constraint: the batch axis is split as the
    strategy's ``.batch`` splits the batch, the other axes are not. Outside any, it returns
    ``x`` as it is, so model code that calls it still runs on one device.

    Its place is the body of a scanned model's layer (``jax.lax.scan``, Flax's ``nn.scan`` or
    ``nnx.scan``, Equinox's scan over stacked layers): inside a loop, XLA's partitioner may drop
    the activations' split, and then every layer reduces the whole batch's activations. The
    report's ``batch_loops`` says which loops it keeps so.

    It lays out the first axis: on a sequence-major ``(S, B, D)`` array, or inside a
    ``jax.vmap`` over the examples (whose arrays have no batch axis), it splits another axis
    than the batch's. The values stay right; :func:`~einshard.explain_step`, ``plan`` and
    :func:`constrain_loops` read the program and warn of it (an ``EinshardWarning``), a
    ``use_strategy`` block alone cannot tell.

    Args:
        x: One array (or traced value) whose first axis is the batch. For a pytree of them:
            ``jax.tree.map(einshard.like_batch, tree)``.

    Returns:
        ``x``, constrained (traced) or placed (concrete) under a strategy; else ``x`` itself.

    Raises:
        EinshardError: ``x`` is not an array (a tuple, a list, a dict, ``None``); under a
            strategy, ``x`` is a scalar, or its first axis does not divide by the batch's split.

    >>> import jax, jax.numpy as jnp, einshard
    >>> einshard.like_batch(jnp.ones(8)).sharding.num_devices  # no strategy: as it is
    1
    >>> @jax.jit
    ... def layer(x, w):
    ...     return einshard.like_batch(jnp.tanh(x @ w))
    >>> with einshard.use_strategy('b ... -> b* ...'):
    ...     y = layer(jnp.ones((16, 4)), jnp.ones((4, 4)))
    >>> y.sharding.shard_shape(y.shape)
    (2, 4)
    """
    if not hasattr(x, "shape") and not isinstance(x, numbers.Number):
        kind = "None" if x is None else f"a {type(x).__name__}"
        raise EinshardError(
            f"like_batch takes one array (its first axis the batch), not {kind} ({short_repr(x)})",
            hint="For a pytree of batch-major arrays, lay out each: jax.tree.map(einshard.like_batch, x).",
        )
    global _CALLED, _MARKED
    _CALLED += 1
    expression = _BATCH.get()
    if expression is None:
        return x
    _MARKED += 1
    rank = len(getattr(x, "shape", ()))
    if rank == 0:
        raise EinshardError(
            "like_batch takes a batch-major array (its first axis the batch), not a scalar "
            f"({short_repr(x)})",
            hint="Call it on the activations, e.g. x = einshard.like_batch(x) with x of shape (batch, ...).",
        )
    import jax

    # The name scope marks the constraint in the program, for the readers that judge it (_loops).
    with jax.named_scope(MARK):
        return einshard(x, batch_expression_for(expression, rank, call_devices(None).count))


@functools.lru_cache(maxsize=256)
def batch_expression_for(expression: str, rank: int, n_devices: int) -> str:
    """The batch expression's split of the batch axis, for an array of ``rank`` whose first axis is it.

    Only the batch axis's split is carried (an activation's other axes are its own), on the same
    device mesh: ``'b ... -> b* ...'`` gives ``'b ... -> b* ...'`` for rank 1 and
    ``'b a c -> b* a c'`` for rank 3; ``'b s -> b* s'`` gives the same.
    """
    parsed = parse(expression)
    named = len(parsed.left_names)
    source_rank = max(named, rank) if parsed.has_ellipsis else max(named, 1)
    layout = compile_layout(expression, source_rank, n_devices)
    return carried_expression(layout, (0, *([None] * (rank - 1))))


def batch_split(expression: str, n_devices: int) -> int:
    """Into how many parts the batch expression splits the batch axis (1: not split, as TP's copies)."""
    return compile_layout(batch_expression_for(expression, 1, n_devices), 1, n_devices).shards[0]


def traced_under(expression: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every call (and so every trace) inside ``use_strategy(expression)``."""
    if expression is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with use_strategy(expression):
            return fn(*args, **kwargs)

    return wrapped
