"""What a candidate needs before it is compiled: its arguments' bytes per device, a lower bound.

Compiling a large step for many devices takes minutes; a candidate whose arguments alone (the
parameters, optimizer state and batch, each device's block as the candidate's table lays it out)
exceed a device's memory cannot fit whatever the program does: XLA's peak is the arguments plus
the outputs not aliased to them plus its temporaries. The layouts are known before compiling, so
the planner rejects such a candidate without compiling it.
"""

from __future__ import annotations

import math

from .._arrays._leaves import itemsize
from .._cost._call import StepCall
from .._language._text import size_text
from .._trees._rules import RulesLike

__all__ = ["NOT_COMPILED", "argument_bytes_per_device", "bound_reason"]

NOT_COMPILED = "(not compiled)"
"""How a rejection decided by the bound ends: the step was not compiled under that table."""


def argument_bytes_per_device(call: StepCall, table: RulesLike, n_devices: int) -> int | None:
    """The bytes one device holds of the step's arguments under ``table``, before any compile.

    Every array leaf counts its block (:meth:`~einshard._language._layout.Layout.shard_shape`:
    a split axis divided, a replicated leaf whole); every device holds a block of the same shape.
    The assignment is the compile's own (:meth:`StepCall.assigned`, made once per table), so
    asking costs no second assignment. ``None`` when the table does not fit the arguments (the
    compile then says why).
    """
    assignment = call.fitted(table, n_devices)
    if assignment is None:
        return None
    total = 0
    for _, leaf in assignment.leaves:
        if leaf is None:
            continue
        total += math.prod(leaf.layout.shard_shape(leaf.shape)) * itemsize(leaf.dtype)
    return total


def bound_reason(needed: int, memory_per_device: int) -> str:
    """The rejection of a candidate whose arguments alone need ``needed`` bytes per device."""
    return (
        f"does not fit memory: its arguments alone need {size_text(needed)} > "
        f"{size_text(memory_per_device)} per device {NOT_COMPILED}"
    )
