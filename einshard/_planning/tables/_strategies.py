"""Strategy tables: data parallel, FSDP, tensor parallel and their hybrids, as ordinary rule tables.

Each is a :class:`Strategy`: a :class:`~einshard.Rules` (print it, ``explain`` it, put your own
rules in front with ``+``) that also carries the expression for the batch that goes with it. FSDP
decides per leaf, from its shape, dtype and the device count, through a :class:`SplitLargest`
rule: the same resolution path as every other rule, so Flax, Equinox and optax state follow.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..._arrays._leaves import nbytes
from ..._language._errors import EinshardDeprecationWarning, EinshardError
from ..._language._expression import REPLICATE
from ..._language._numbers import checked_count
from ..._sharding._devices import count_to_plan
from ..._trees._rules import Rules
from ..._trees._strategy import DEFAULT_MIN_BYTES, SplitLargest, Strategy
from . import _roles
from ._derived import rule_patterns, tp_expression

__all__ = [
    "COLUMN",
    "ROW",
    "data_parallel",
    "fsdp",
    "hsdp",
    "hybrid",
    "roles",
    "tensor_parallel",
]

BATCH_SPLIT = "b ... -> b* ..."

COLUMN = ("q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "up", "gate")
"""Layer names the name-based :func:`tensor_parallel` table splits on the output axis by default."""
ROW = ("o", "out", "wo", "down")
"""Layer names the name-based :func:`tensor_parallel` table splits on the input axis by default."""


def data_parallel() -> Strategy:
    """Every parameter replicated, the batch split over all devices.

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'w': jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    >>> einshard.explain(tree, einshard.strategies.data_parallel(), n_devices=8).rows[0].shard_shape
    (64, 64)
    """
    return Strategy([(r".*", REPLICATE)], batch=BATCH_SPLIT, name="data parallel")


def fsdp(min_bytes: int = DEFAULT_MIN_BYTES, axis: str | int = "largest") -> Strategy:
    """FSDP (ZeRO-3): every leaf of at least ``min_bytes`` split on its largest divisible axis.

    Each leaf is split over all devices on its largest axis whose length the device count
    divides (the next largest when it does not); smaller leaves, and leaves no axis of which
    divides, are replicated, and :func:`~einshard.explain` says why. The batch is split over
    all devices, as with data parallelism.

    Args:
        min_bytes: Leaves smaller than this are replicated (default 1 MiB).
        axis: ``'largest'``, or an axis to try first (then the largest ones).

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'w': jax.ShapeDtypeStruct((512, 1024), jnp.float32),
    ...         'scale': jax.ShapeDtypeStruct((1024,), jnp.float32)}
    >>> for row in einshard.explain(tree, einshard.strategies.fsdp(), n_devices=8).rows:
    ...     print(row.path, row.expression, row.shard_shape, row.note)
    scale ... -> * ... (1024,) 4.0 KiB < min_bytes 1.0 MiB: replicated
    w a b -> a b8 (512, 128) None
    """
    return Strategy(
        [(r".*", SplitLargest(min_bytes=min_bytes, axis=axis))],
        batch=BATCH_SPLIT,
        name="fsdp",
    )


def hsdp(devices_per_host: int = 8, min_bytes: int = DEFAULT_MIN_BYTES) -> Strategy:
    """HSDP: FSDP within each host, data parallelism across hosts.

    Every leaf of at least ``min_bytes`` is split on its largest divisible axis over the
    ``devices_per_host`` neighbouring devices of a host, and copied on every host
    (``'a b -> 8 a b8'`` on 64 devices); the batch is split over all devices. The parameters'
    all-gathers stay inside a host (NVLink); the gradients are reduced within the host and
    across hosts (the network), once per step. With one host it is :func:`fsdp`.

    Args:
        devices_per_host: Devices per host (8 on an HGX / DGX board); it must divide the device
            count, else every leaf is replicated and :func:`~einshard.explain` says why.
        min_bytes: Leaves smaller than this are replicated (default 1 MiB).

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'w': jax.ShapeDtypeStruct((512, 1024), jnp.float32)}
    >>> row, = einshard.explain(tree, einshard.strategies.hsdp(), n_devices=16).rows
    >>> row.expression, row.shard_shape
    ('a b -> 2 a b8', (512, 128))
    """
    checked_count(
        devices_per_host,
        "devices_per_host",
        hint="Give how many devices share a host's fast links, e.g. devices_per_host=8.",
    )
    return Strategy(
        [(r".*", SplitLargest(min_bytes=min_bytes, group=devices_per_host))],
        batch=BATCH_SPLIT,
        name="hsdp",
    )


def _layer_regex(names: Sequence[str], leaf: str) -> str:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names) or not names:
        raise EinshardError(
            f"layer names must be a non-empty list of strings, not {names!r}",
            hint="Give the names of the layers as regexes for one path part, e.g. column=('q', 'k', 'v').",
        )
    return rf"(^|/)({'|'.join(names)})(_proj)?/{leaf}$"


def _tensor_rules(column: Sequence[str], row: Sequence[str], model: int | None) -> list[tuple[str, Any]]:
    """Megatron pairs. Flax kernels are (in, out); Equinox and PyTorch weights are (out, in).

    With ``model`` (a hybrid) the split axis takes ``model`` devices (the minor mesh axis) and
    the other axis of the matrix the rest (``*``, the data axis), FSDP-style.
    """
    split = "*" if model is None else str(model)
    rest = "" if model is None else "*"
    column_bias = "... o -> ... o*" if model is None else f"... o -> ... * o{model}"
    return [
        (_layer_regex(column, "kernel"), f"... i o -> ... i{rest} o{split}"),
        (_layer_regex(column, "weight"), f"... o i -> ... i{rest} o{split}"),
        (_layer_regex(column, "bias"), column_bias),
        (_layer_regex(row, "kernel"), f"... i o -> ... o{rest} i{split}"),
        (_layer_regex(row, "weight"), f"... o i -> ... o{rest} i{split}"),
    ]


_F = TypeVar("_F", bound=Callable[..., Any])


def _step_by_keyword(fn: _F) -> _F:
    """The earlier ``tensor_parallel(step, params, batch)`` still works, with a deprecation warning.

    The step is keyword-only in every strategy constructor (``step=, params=, batch=``, as in
    :func:`hybrid`); a callable or a ``'module:function'`` string given first is that earlier
    form. ``functools.wraps``: the signature shown is the function's own.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args and (callable(args[0]) or isinstance(args[0], str)) and len(args) <= 3:
            warnings.warn(
                f"{fn.__name__} takes the step by keyword now: call {fn.__name__}(step=step, "
                "params=params, batch=batch) (the positional step goes in a future release)",
                EinshardDeprecationWarning,
                stacklevel=2,
            )
            given = dict(zip(("step", "params", "batch"), args, strict=False))
            twice = sorted(set(given) & set(kwargs))
            if twice:
                raise EinshardError(
                    f"{fn.__name__} got {twice[0]} both by position and by keyword",
                    hint=f"Give the step's arguments by keyword only: {fn.__name__}(step=step, "
                    "params=params, batch=batch).",
                )
            return fn(**given, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@_step_by_keyword
def tensor_parallel(
    column: Sequence[str] = COLUMN,
    row: Sequence[str] = ROW,
    *,
    step: Callable[..., Any] | str | None = None,
    params: Any = None,
    batch: Any = None,
    n_devices: int | None = None,
) -> Strategy:
    """Tensor parallelism over all devices: Megatron column / row pairs, everything else replicated.

    Given the step, its parameters and a batch, the roles are read from the step's dataflow
    (see :func:`roles`), whatever the layers are called: a weight whose output axis reaches a
    later weight's contraction axis is split on that axis (*column*), the later weight on its
    contraction axis (*row*), so the pair costs one all-reduce; attention's q, k, v and output
    projections by head; an embedding on its vocabulary; biases with their layer. Every rule
    carries a note saying why; weights without a partner are replicated, and their note says
    why too. Leaves the step does not read (optimizer state) get no rule of their own: the
    rules match the end of a path, so state that mirrors a parameter follows its rule, and a
    leaf no rule matches is replicated (``unmatched='replicate'``). The table is derived for
    ``n_devices`` (default: this machine's device count).

    Without a step, the table goes by layer names: a column-parallel layer (``q``, ``k``,
    ``v``, ``up``, ``gate`` ...) splits its output axis, a row-parallel one (``o``, ``down``
    ...) its input axis. ``kernel`` leaves are read as Flax lays them out, ``(..., in, out)``;
    ``weight`` leaves as Equinox and PyTorch do, ``(..., out, in)``; a column layer's ``bias``
    is split with its output.

    The batch is replicated: every device sees all of it.

    The step comes by keyword, as in :func:`hybrid` and :func:`defaults`
    (``tensor_parallel(step=step, params=params, batch=batch)``); the earlier positional form,
    ``tensor_parallel(step, params, batch)``, still works with an ``EinshardDeprecationWarning``.

    Args:
        column: Without a step: column-parallel layer names, regexes for the path part before
            the leaf name (a ``_proj`` suffix is allowed, so ``'q'`` matches ``q_proj/kernel``).
        row: Without a step: row-parallel layer names, likewise.
        step: The training step, ``step(params, batch)``, or an importable
            ``'module:function'``; ``None`` for the table by layer names.
        params: The step's parameters (arrays or ``jax.ShapeDtypeStruct`` leaves).
        batch: A batch (arrays or ``jax.ShapeDtypeStruct`` leaves).
        n_devices: With a step: the device count to derive the table for.

    Raises:
        EinshardError: If the step cannot be traced on abstract inputs, or ``params`` or
            ``batch`` is missing.

    Warns:
        EinshardDeprecationWarning: The step given by position (the earlier form).

    >>> import jax, jax.numpy as jnp, einshard
    >>> def step(params, x):
    ...     return jnp.mean((jax.nn.relu(x @ params['w1']) @ params['w2']) ** 2)
    >>> params = {'w1': jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...           'w2': jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    >>> batch = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    >>> print(einshard.strategies.tensor_parallel(step=step, params=params, batch=batch))
    Strategy('tensor parallel', batch='... -> * ...', Rules([
        ('(^|/)w1$', 'i o -> i o*'),  # column: its output feeds w2's contraction axis
        ('(^|/)w2$', 'i o -> i* o'),  # row: contracts the output of w1 (one all-reduce)
    ]), unmatched='replicate')

    By names:

    >>> tree = {'up_proj': {'kernel': jax.ShapeDtypeStruct((64, 256), jnp.float32)},
    ...         'down_proj': {'kernel': jax.ShapeDtypeStruct((256, 64), jnp.float32)}}
    >>> [row.shard_shape for row in einshard.explain(tree, einshard.strategies.tensor_parallel()).rows]
    [(32, 64), (64, 32)]
    """
    if step is not None:
        count = _device_count(n_devices)
        return _derived_table(_read(step, params, batch), count, count, DEFAULT_MIN_BYTES)
    rules = [*_tensor_rules(column, row, None), (r".*", REPLICATE)]
    return Strategy(rules, batch=REPLICATE, name="tensor parallel", model=0)


def hybrid(
    model: int,
    column: Sequence[str] = COLUMN,
    row: Sequence[str] = ROW,
    min_bytes: int = DEFAULT_MIN_BYTES,
    *,
    n_devices: int | None = None,
    step: Callable[..., Any] | str | None = None,
    params: Any = None,
    batch: Any = None,
) -> Strategy:
    """FSDP × tensor parallelism on a (data, model) factorization of the devices.

    ``model`` neighbouring devices share each tensor-parallel weight as :func:`tensor_parallel`
    splits it; the weight's largest other axis is split over the rest of the devices (the
    data axis). The batch is split over the data axis and copied over the model axis.

    With ``step``, ``params`` and ``batch`` the tensor-parallel roles are read from the step's
    dataflow (see :func:`tensor_parallel`), for ``n_devices`` devices (default: this
    machine's), and every weight without a tensor-parallel split is split as :func:`fsdp`
    splits it over the data axis, and copied over the model axis (ZeRO within each
    data-parallel group). Without a step, the roles go by layer names, and every other leaf
    is split as :func:`fsdp` splits it, over all devices.

    Args:
        model: Devices on the model axis; it must divide the device count.
        column: Without a step: column-parallel layer names (see :func:`tensor_parallel`).
        row: Without a step: row-parallel layer names.
        min_bytes: The other leaves smaller than this are replicated.
        step: The training step ``step(params, batch)``, to read the roles from.
        params: The step's parameters.
        batch: A batch.
        n_devices: With a step: the device count to derive the table for.

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'up_proj': {'kernel': jax.ShapeDtypeStruct((64, 256), jnp.float32)}}
    >>> strategy = einshard.strategies.hybrid(model=4)
    >>> strategy.batch, einshard.explain(tree, strategy, n_devices=8).rows[0].shard_shape
    ('b ... -> b* ... 4', (32, 64))
    """
    _check_model(model)
    if step is not None:
        count = _device_count(n_devices)
        if count % model:
            raise EinshardError(
                f"model={model} does not divide the {count} devices",
                hint=f"Choose a model axis that divides {count}, e.g. "
                f"model={max(d for d in range(1, count + 1) if count % d == 0 and d < count) or 1}.",
            )
        return _derived_table(_read(step, params, batch), count, model, min_bytes)
    rules = [*_tensor_rules(column, row, model), (r".*", SplitLargest(min_bytes=min_bytes))]
    return Strategy(rules, batch=f"b ... -> b* ... {model}", name=f"hybrid model={model}", model=model)


def defaults(
    n_devices: int,
    min_bytes: int = DEFAULT_MIN_BYTES,
    *,
    devices_per_host: int | None = None,
    step: Callable[..., Any] | str | None = None,
    params: Any = None,
    batch: Any = None,
) -> list[Strategy]:
    """The planner's default candidates: data parallel, FSDP, (HSDP,) tensor parallel, every hybrid.

    With ``step``, ``params`` and ``batch``, the tensor-parallel and hybrid tables are derived
    from the step's dataflow (read once for all of them); without, they go by layer names.
    With ``devices_per_host`` (a GPU target's 8) and more devices than one host has, :func:`hsdp`
    comes after FSDP. The simpler strategy first: a tie in the plan goes to it. The hybrids go
    by model-axis size, so those whose model axis stays inside a host come first.
    """
    if step is None:
        models = _model_sizes(n_devices)
        out = [data_parallel(), fsdp(min_bytes=min_bytes)]
        out += _host_candidates(n_devices, devices_per_host, min_bytes)
        return out + [tensor_parallel()] + [hybrid(m, min_bytes=min_bytes) for m in models]
    return derived_defaults(_read(step, params, batch), n_devices, min_bytes, devices_per_host)


def derived_defaults(
    reading: _roles.Reading, n_devices: int, min_bytes: int, devices_per_host: int | None = None
) -> list[Strategy]:
    """:func:`defaults` from a step already read: data parallel, FSDP, (HSDP,) the derived tables."""
    out = [data_parallel(), fsdp(min_bytes=min_bytes)]
    out += _host_candidates(n_devices, devices_per_host, min_bytes)
    out.append(_derived_table(reading, n_devices, n_devices, min_bytes))
    return out + [_derived_table(reading, n_devices, m, min_bytes) for m in _model_sizes(n_devices)]


def _host_candidates(n_devices: int, devices_per_host: int | None, min_bytes: int) -> list[Strategy]:
    """HSDP, when the devices span several hosts of ``devices_per_host`` (none otherwise)."""
    if devices_per_host is None or n_devices <= devices_per_host or n_devices % devices_per_host:
        return []
    return [hsdp(devices_per_host, min_bytes=min_bytes)]


def _model_sizes(n_devices: int) -> list[int]:
    """A hybrid's model-axis sizes: the divisors of the device count other than 1 and itself."""
    return [m for m in range(2, n_devices) if n_devices % m == 0]


def roles(
    step: Callable[..., Any] | str, params: Any, batch: Any, *, n_devices: int | None = None
) -> _roles.Roles:
    return _roles.roles(step, params, batch, n_devices=n_devices)


roles.__doc__ = _roles.roles.__doc__


def _check_model(model: Any) -> None:
    checked_count(
        model,
        "model",
        hint="Give how many devices the model axis has, e.g. model=4 (the data axis takes the rest).",
    )


def _device_count(n_devices: int | None) -> int:
    return count_to_plan(n_devices, hint="Give the model axis's size, e.g. n_devices=8.")


def _read(step: Callable[..., Any] | str, params: Any, batch: Any) -> _roles.Reading:
    if params is None or batch is None:
        raise EinshardError(
            "a table read from the step needs the step's params and a batch",
            hint="Call it as tensor_parallel(step=step, params=params, batch=batch) (ShapeDtypeStructs "
            "will do), or "
            "give layer names instead: tensor_parallel(column=['q', 'k', 'v'], row=['o']).",
        )
    return _roles.read(step, params, batch)


def _derived_table(reading: _roles.Reading, n_devices: int, model: int, min_bytes: int) -> Strategy:
    """The tensor-parallel (``model == n_devices``) or hybrid table for the roles read."""
    data = n_devices // model
    paths: list[str] = []
    choices: list[tuple[Any, str]] = []
    for row in _roles.choose_splits(reading, model):
        if row.role == "unread":  # optimizer state and the like: its parameter's rule matches it
            continue
        paths.append(row.path)
        if row.axis is not None:
            choices.append((tp_expression(row, model, data, _fsdp_axis(row, data, min_bytes)), row.note))
        elif data > 1:  # over the data axis only, copied over the model axis (ZeRO within a data group)
            choices.append(
                (SplitLargest(min_bytes=min_bytes, parts=data), f"fsdp over the data axis: {row.note}")
            )
        else:
            choices.append((REPLICATE, f"replicated: {row.note}"))
    rules: list[tuple[str, Any, str | None]] = list(
        rule_patterns(paths, choices, _roles.prefix_parts(reading))
    )
    # Leaves without a rule of their own (integer leaves, state the forward pass does not read
    # that mirrors no parameter): the rest, when there are any; in any other tree (optimizer
    # state) a leaf no rule matches is replicated.
    table = Rules(rules)
    rest = any(
        shape and table.match(path) is None for path, shape in zip(reading.paths, reading.shapes, strict=True)
    )
    if data > 1:
        if rest:
            rules.append(
                (r".*", SplitLargest(min_bytes=min_bytes, parts=data), "the rest: fsdp over the data axis")
            )
        batch = f"b ... -> b* ... {model}"
        return Strategy(rules, batch=batch, name=f"hybrid model={model}", model=model, unmatched="replicate")
    if rest:
        rules.append(
            (r".*", REPLICATE, "the rest (integer leaves, state the step does not read): replicated")
        )
    return Strategy(rules, batch=REPLICATE, name="tensor parallel", model=model, unmatched="replicate")


def _fsdp_axis(row: _roles.LeafRole, data: int, min_bytes: int) -> int | None:
    """The hybrid's data-axis split of a tensor-parallel weight: its largest other axis that divides.

    Not for a vocabulary (an embedding, logits): a lookup or a loss over a table split on both
    axes makes XLA move the activations instead of gathering the table (on a LLaMA-shaped step,
    twice the bytes); copied over the data axis, it costs one all-reduce as in tensor parallelism.
    """
    if data == 1 or row.role == "vocabulary" or nbytes(row.shape, row.dtype) < min_bytes:
        return None
    others = sorted((i for i in range(len(row.shape)) if i != row.axis), key=lambda i: (-row.shape[i], i))
    return next((i for i in others if row.shape[i] % data == 0), None)
