"""Strategy tables: data parallel, FSDP, tensor parallel and their hybrids, as ordinary rule tables.

Each is a :class:`Strategy`: a :class:`~einshard.Rules` (print it, ``explain`` it, put your own
rules in front with ``+``) that also carries the expression for the batch that goes with it. FSDP
decides per leaf, from its shape, dtype and the device count, through a :class:`SplitLargest`
rule: the same resolution path as every other rule, so Flax, Equinox and optax state follow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from .._arrays._build import itemsize
from .._language._errors import EinshardError
from .._language._expression import REPLICATE, parse
from .._language._text import size_text
from .._trees._rules import ByShape, Indivisible, Rules, RulesLike, Unmatched

__all__ = [
    "COLUMN",
    "ROW",
    "SplitLargest",
    "Strategy",
    "data_parallel",
    "fsdp",
    "hybrid",
    "tensor_parallel",
]

BATCH_SPLIT = "b ... -> b* ..."

COLUMN = ("q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "up", "gate")
"""Layer names that are column-parallel by default (their output axis is split)."""
ROW = ("o", "out", "wo", "down")
"""Layer names that are row-parallel by default (their input axis is split)."""

_NAMES = "abcdefghijklmnopqrstuvwxyz"
DEFAULT_MIN_BYTES = 1 << 20


class Strategy(Rules):
    """A rule table for one parallelism strategy, with the expression for its batch.

    An ordinary :class:`~einshard.Rules` in every other way: ``shard_pytree``, ``explain``,
    ``init_sharded`` and the integrations take it as they take any table. Rules added in front
    (``my_rules + strategy``) or behind keep the strategy's name and batch expression.

    Attributes:
        name: What the strategy is, e.g. ``'fsdp'`` or ``'hybrid model=4'``.
        batch: The expression to shard each batch array with (its first axis is the batch
            axis), so that the batch is laid out consistently with the parameters.

    >>> import einshard
    >>> strategy = einshard.strategies.data_parallel()
    >>> strategy.name, strategy.batch
    ('data parallel', 'b ... -> b* ...')
    >>> (einshard.Rules([('embed', 'v d -> v d*')]) + strategy).batch
    'b ... -> b* ...'
    """

    __slots__ = ("batch", "name")

    def __init__(
        self,
        rules: RulesLike = (),
        *,
        batch: str,
        name: str,
        unmatched: Unmatched | None = None,
        indivisible: Indivisible | None = None,
        strict: bool | None = None,
    ) -> None:
        super().__init__(rules, unmatched=unmatched, indivisible=indivisible, strict=strict)
        parse(batch)
        self.batch = batch
        self.name = name

    def _like(self, rules: Rules) -> Strategy:
        return Strategy(rules, batch=self.batch, name=self.name)

    def __add__(self, other: RulesLike) -> Strategy:
        return self._like(Rules.__add__(self, other))

    def __radd__(self, other: RulesLike) -> Strategy:
        return self._like(Rules.__radd__(self, other))

    def replace(
        self,
        *,
        unmatched: Unmatched | None = None,
        indivisible: Indivisible | None = None,
        strict: bool | None = None,
    ) -> Strategy:
        """The same strategy with other policies (those not given are kept)."""
        return self._like(Rules.replace(self, unmatched=unmatched, indivisible=indivisible, strict=strict))

    def __eq__(self, other: object) -> bool:
        same_extra = not isinstance(other, Strategy) or (other.batch, other.name) == (self.batch, self.name)
        return Rules.__eq__(self, other) and same_extra

    def __hash__(self) -> int:
        return Rules.__hash__(self)

    def __repr__(self) -> str:
        return f"Strategy({self.name!r}, batch={self.batch!r}, {Rules.__repr__(self)})"


@dataclasses.dataclass(frozen=True)
class SplitLargest(ByShape):
    """FSDP's per-leaf decision, as a rule's expression: split the largest axis that divides.

    A leaf of at least ``min_bytes`` is split over ``parts`` devices (all of them when ``None``;
    the other devices hold copies) on its largest axis whose length ``parts`` divides, the next
    largest when it does not (ties: the first such axis). A smaller leaf, or one no axis of which
    divides, is replicated; the reason is the leaf's note in :func:`~einshard.explain`.

    Attributes:
        min_bytes: Leaves smaller than this are replicated.
        axis: ``'largest'``, or an axis (``0``, ``-1``) to try first, then the largest ones.
        parts: How many devices each leaf is split over, or ``None`` for all.

    >>> import einshard
    >>> einshard.strategies.SplitLargest(min_bytes=1024).expression_for((16, 4096), 'float32', 8)
    ('a b -> a b8', None)
    >>> einshard.strategies.SplitLargest(min_bytes=1024).expression_for((16, 4100), 'float32', 8)
    ('a b -> a8 b', 'axis 1 (4100) does not divide by 8: axis 0 split')
    """

    min_bytes: int = DEFAULT_MIN_BYTES
    axis: str | int = "largest"
    parts: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise EinshardError(
                f"min_bytes must be a non-negative integer, not {self.min_bytes!r}",
                hint="Give a size in bytes, e.g. min_bytes=1 << 20 (leaves below it are replicated).",
            )
        if self.axis != "largest" and (isinstance(self.axis, bool) or not isinstance(self.axis, int)):
            raise EinshardError(
                f"axis must be 'largest' or an axis number, not {self.axis!r}",
                hint="Use axis='largest' (the default), or e.g. axis=0 to try the first axis first.",
            )
        if self.parts is not None and (
            isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1
        ):
            raise EinshardError(
                f"parts must be a positive integer or None, not {self.parts!r}",
                hint="Give how many devices each leaf is split over, or None for all of them.",
            )

    def expression_for(self, shape: tuple[int, ...], dtype: Any, n_devices: int) -> tuple[str, str | None]:
        parts = n_devices if self.parts is None else self.parts
        if n_devices % parts:
            return REPLICATE, f"parts={parts} does not divide the {n_devices} devices: replicated"
        size = math.prod(shape) * itemsize(dtype)
        if parts == 1 or not shape:
            return REPLICATE, None
        if size < self.min_bytes:
            return REPLICATE, f"{size_text(size)} < min_bytes {size_text(self.min_bytes)}: replicated"
        if len(shape) > len(_NAMES):
            return REPLICATE, f"rank {len(shape)} > {len(_NAMES)}: replicated"
        order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
        if self.axis != "largest":
            first = int(self.axis) % len(shape) if -len(shape) <= int(self.axis) < len(shape) else None
            if first is not None:
                order.remove(first)
                order.insert(0, first)
        split = next((i for i in order if shape[i] % parts == 0), None)
        if split is None:
            return REPLICATE, f"no axis of {shape} divides by {parts}: replicated"
        names = list(_NAMES[: len(shape)])
        right = [f"{name}{parts}" if i == split else name for i, name in enumerate(names)]
        copies = n_devices // parts
        expression = f"{' '.join(names)} -> {' '.join(right)}" + (f" {copies}" if copies > 1 else "")
        if split == order[0]:
            return expression, None
        largest = order[0]
        return expression, f"axis {largest} ({shape[largest]}) does not divide by {parts}: axis {split} split"

    def __repr__(self) -> str:
        fields = [f"min_bytes={self.min_bytes}"]
        if self.axis != "largest":
            fields.append(f"axis={self.axis!r}")
        if self.parts is not None:
            fields.append(f"parts={self.parts}")
        return f"SplitLargest({', '.join(fields)})"


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


def tensor_parallel(column: Sequence[str] = COLUMN, row: Sequence[str] = ROW) -> Strategy:
    """Tensor parallelism over all devices: Megatron column/row pairs, everything else replicated.

    A column-parallel layer (``q``, ``k``, ``v``, ``up``, ``gate`` ...) splits its output axis,
    a row-parallel one (``o``, ``down`` ...) its input axis, so the pair needs one all-reduce.
    ``kernel`` leaves are read as Flax lays them out, ``(..., in, out)``; ``weight`` leaves as
    Equinox and PyTorch do, ``(..., out, in)``; a column layer's ``bias`` is split with its
    output. The batch is replicated: every device sees all of it.

    Args:
        column: Column-parallel layer names: regexes for the path part before the leaf name
            (a ``_proj`` suffix is allowed, so ``'q'`` matches ``q_proj/kernel``).
        row: Row-parallel layer names, likewise.

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'up_proj': {'kernel': jax.ShapeDtypeStruct((64, 256), jnp.float32)},
    ...         'down_proj': {'kernel': jax.ShapeDtypeStruct((256, 64), jnp.float32)}}
    >>> [row.shard_shape for row in einshard.explain(tree, einshard.strategies.tensor_parallel()).rows]
    [(32, 64), (64, 32)]
    """
    rules = [*_tensor_rules(column, row, None), (r".*", REPLICATE)]
    return Strategy(rules, batch=REPLICATE, name="tensor parallel")


def hybrid(
    model: int,
    column: Sequence[str] = COLUMN,
    row: Sequence[str] = ROW,
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> Strategy:
    """FSDP × tensor parallelism on a (data, model) factorization of the devices.

    ``model`` neighbouring devices share each column/row-parallel matrix as
    :func:`tensor_parallel` splits it; the other axis of the matrix is split over the rest of
    the devices (the data axis), and every other leaf is split as :func:`fsdp` splits it. The
    batch is split over the data axis and copied over the model axis.

    Args:
        model: Devices on the model axis; it must divide the device count.
        column: Column-parallel layer names (see :func:`tensor_parallel`).
        row: Row-parallel layer names.
        min_bytes: The other leaves smaller than this are replicated.

    >>> import jax, jax.numpy as jnp, einshard
    >>> tree = {'up_proj': {'kernel': jax.ShapeDtypeStruct((64, 256), jnp.float32)}}
    >>> strategy = einshard.strategies.hybrid(model=4)
    >>> strategy.batch, einshard.explain(tree, strategy, n_devices=8).rows[0].shard_shape
    ('b ... -> b* ... 4', (32, 64))
    """
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise EinshardError(
            f"model must be a positive integer, not {model!r}",
            hint="Give how many devices the model axis has, e.g. model=4 (the data axis takes the rest).",
        )
    rules = [*_tensor_rules(column, row, model), (r".*", SplitLargest(min_bytes=min_bytes))]
    return Strategy(rules, batch=f"b ... -> b* ... {model}", name=f"hybrid model={model}")


def defaults(n_devices: int, min_bytes: int = DEFAULT_MIN_BYTES) -> list[Strategy]:
    """The planner's default candidates: data parallel, FSDP, tensor parallel, every hybrid."""
    out = [data_parallel(), fsdp(min_bytes=min_bytes), tensor_parallel()]
    out += [hybrid(m, min_bytes=min_bytes) for m in range(2, n_devices) if n_devices % m == 0]
    return out
