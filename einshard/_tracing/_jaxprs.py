"""The small questions every reader of a jaxpr asks of it.

Shapes, bytes, inner jaxprs, scan counts, reshape groups, whether an operation belongs to the
backward pass, the user's line behind it, and the one walk's question: which sub-programs an
equation runs, and how often (:func:`runs`).

JAX's jaxpr types change between versions (a scan's constants and carries are counted by
``num_consts`` / ``num_carry`` in older JAX and by the flat tree ``ft_in`` in newer JAX; a
sub-program is a ``ClosedJaxpr`` or an open ``Jaxpr``): what differs is answered here, once, and
``tests/test_jaxprs.py`` fails loudly where a JAX version answers none of the known ways.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._arrays._leaves import nbytes
from .._language._errors import EinshardError
from .._language._sources import user_frame
from ._primitives import AXIS_PARAMS

__all__ = [
    "CALL",
    "COND",
    "OTHER",
    "PER_DEVICE",
    "SCAN",
    "WHILE",
    "Runs",
    "closed_jaxpr",
    "evaluate",
    "inner_jaxpr",
    "is_backward",
    "is_jaxpr",
    "keeps_shape",
    "reshape_groups",
    "runs",
    "scan_counts",
    "user_line",
    "var_nbytes",
    "var_rank",
    "var_shape",
]


def var_rank(var: Any) -> int:
    return len(getattr(var.aval, "shape", ()))


def var_shape(var: Any) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def var_nbytes(var: Any) -> int:
    aval = var.aval
    try:
        return nbytes(aval.shape, aval.dtype)
    except Exception:  # extended dtypes (keys): no meaningful size
        return 0


def inner_jaxpr(jaxpr: Any) -> Any:
    """The open jaxpr of a ``ClosedJaxpr`` (older JAX) or of a ``Jaxpr`` (newer JAX: itself)."""
    inner = getattr(jaxpr, "jaxpr", None)
    return inner if inner is not None and hasattr(inner, "eqns") else jaxpr


def is_jaxpr(value: Any) -> bool:
    return hasattr(inner_jaxpr(value), "eqns")


# How an equation runs its sub-programs (Runs.how).
CALL = "call"  # one program, once, on the equation's inputs, making its outputs, one for one
SCAN = "scan"  # the body, a known number of times
WHILE = "while"  # the condition and the body, a number of times known only at run time
COND = "cond"  # one of the branches, once, on the operands (the inputs after the index)
PER_DEVICE = "per_device"  # a shard_map's body, on each device's block of the inputs
OTHER = "other"  # sub-programs run in none of these ways (another library's primitive)


@dataclasses.dataclass(frozen=True)
class Runs:
    """The sub-programs one equation runs, how, and how often: every walk of a jaxpr asks this.

    Attributes:
        how: :data:`CALL`, :data:`SCAN`, :data:`WHILE`, :data:`COND`, :data:`PER_DEVICE` or
            :data:`OTHER`.
        programs: The sub-programs as the equation holds them (closed or open): a call's or a
            scan's one, a while's condition and body, a cond's branches.
        keys: The parameter holding each (a cond's branches all ``'branches'``).
        times: How often each runs per run of the equation: a scan's length, 1, or ``None``
            (a while's trips, unknown before it runs).
    """

    how: str
    programs: tuple[Any, ...]
    keys: tuple[str, ...]
    times: int | None = 1

    @property
    def bodies(self) -> tuple[Any, ...]:
        """The open jaxprs of :attr:`programs`."""
        return tuple(inner_jaxpr(program) for program in self.programs)


def runs(eqn: Any) -> Runs | None:
    """Which sub-programs ``eqn`` runs, how and how often; ``None`` for an equation with none.

    A call (``jit``, ``checkpoint``, ``custom_jvp`` / ``custom_vjp``, ``composite``, another
    library's) runs the first sub-program whose inputs and outputs are the equation's one for one:
    any others are its rules for derivatives (``linear_call``'s transpose). A ``shard_map``'s body
    has them one for one too, but sees each device's block, not the arrays: :data:`PER_DEVICE`.
    """
    name = eqn.primitive.name
    params = eqn.params
    if name == "scan":
        return Runs(SCAN, (params["jaxpr"],), ("jaxpr",), int(params.get("length", 1)))
    if name == "while":
        return Runs(WHILE, (params["cond_jaxpr"], params["body_jaxpr"]), ("cond_jaxpr", "body_jaxpr"), None)
    if name == "cond":
        branches = tuple(params["branches"])
        return Runs(COND, branches, ("branches",) * len(branches))
    held = [
        (key, item)
        for key, value in params.items()
        for item in (value if isinstance(value, (tuple, list)) else (value,))
        if is_jaxpr(item)
    ]
    if not held:
        return None
    if name == "shard_map":
        return Runs(PER_DEVICE, (params["jaxpr"],), ("jaxpr",))
    for key, program in held:
        body = inner_jaxpr(program)
        if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
            return Runs(CALL, (program,), (key,))
    return Runs(OTHER, tuple(program for _, program in held), tuple(key for key, _ in held), None)


def scan_counts(params: dict, n_inputs: int) -> tuple[int, int]:
    """How many of a scan's inputs are constants and carries (the rest are scanned over)."""
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    tree = params.get("ft_in")  # newer JAX: the inputs' structure, (consts, carries, xs)
    if tree is not None:
        try:
            consts, carries, _ = tree.unpack()
            return len(consts), len(carries)
        except Exception:
            pass
    raise EinshardError(
        "cannot read a scan of this JAX version: its parameters name no constants or carries",
        hint="Report this with your JAX version; meanwhile give the table by names: "
        "einshard.strategies.tensor_parallel(column=..., row=...).",
    )


def keeps_shape(eqn: Any) -> bool:
    """Whether an unknown primitive looks elementwise: every array in and out has one shape."""
    if AXIS_PARAMS & set(eqn.params):
        return False
    shapes = {var_shape(v) for v in (*eqn.invars, *eqn.outvars) if var_rank(v)}
    return len(shapes) <= 1


def reshape_groups(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[tuple[list[int], list[int]]]:
    """Runs of input and output axes with equal products: each run is merged, then split."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        ins: list[int] = []
        outs: list[int] = []
        a = b = 1
        while not (ins and outs and a == b):
            if (a <= b or j >= m) and i < n:
                a *= in_shape[i]
                ins.append(i)
                i += 1
            elif j < m:
                b *= out_shape[j]
                outs.append(j)
                j += 1
            else:
                break
        while i < n and in_shape[i] == 1:  # trailing size-1 axes join the run
            ins.append(i)
            i += 1
        while j < m and out_shape[j] == 1:
            outs.append(j)
            j += 1
        groups.append((ins, outs))
    return groups


def is_backward(eqn: Any) -> bool:
    """Whether JAX's name stack marks the operation as part of a transposed (backward) pass."""
    try:
        return "transpose(" in str(eqn.source_info.name_stack)
    except AttributeError:
        return False


def user_line(eqn: Any) -> str:
    """``file:line`` of the user's code behind an operation, or ``''`` where JAX kept no traceback.

    The innermost frame outside every library (:func:`~einshard._language._sources.user_frame`):
    for an operation inside Flax's ``nn.Dense``, the model's line that calls it. The frames are
    JAX's traceback of the equation (``eqn.source_info.traceback.frames``, innermost first), which
    ``tests/test_tracing.py`` checks on every JAX version.
    """
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = [
        (
            str(getattr(frame, "file_name", "")),
            getattr(frame, "line_num", None) or getattr(frame, "start_line", 0),
        )
        for frame in getattr(traceback, "frames", None) or ()
    ]
    found = user_frame(frames)
    if found is None:
        return ""
    name, line = found
    return f"{name.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line}"


def evaluate(jaxpr: Any, consts: Any, *args: Any) -> list[Any]:
    """``jaxpr``'s outputs for ``args``: ``jax.core.eval_jaxpr``.

    Each equation is bound again with its source line and name stack, so a program traced from
    it reads as the step's own.
    """
    import jax.core

    return jax.core.eval_jaxpr(jaxpr, list(consts), *args)


def closed_jaxpr(jaxpr: Any, consts: Any) -> Any:
    """``jax.extend.core.ClosedJaxpr(jaxpr, consts)``."""
    from jax.extend import core

    return core.ClosedJaxpr(jaxpr, list(consts))  # pyright: ignore[reportPrivateImportUsage]
