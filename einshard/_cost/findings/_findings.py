"""Waste in a compiled step: what a better program would not send or hold, why, and what to change.

Each kind is read off the compiled program's data flow (and, for the last, what the compiler
printed while compiling it); its bytes are measured against the program without that waste:

* ``repeated``: one parameter's gradient reduced (or its value gathered) by several collectives;
  a better program sums the contributions first and reduces once.
* ``unsummed``: several all-reduces of the same shape and group whose results are added right
  after; a better program adds the partial sums first and reduces once.
* ``sliced all-reduce``: an all-reduce whose result each device only slices its own part of; a
  reduce-scatter sends half the bytes.
* ``copied``: a large parameter held whole on every device while the table splits the others.
* ``reshard``: an array moved between two layouts by the partitioner (all-to-all,
  collective-permute, or all-gather then slice); a better program keeps one layout.
* ``rematerialization``: XLA's "involuntary full rematerialization": it could not change an
  array's layout efficiently, so it gathered the whole array on every device and sliced it.
* ``activations gathered over the batch``: the batch replicated (left to the catch-all) while
  the parameters are split and gathered (FSDP): the partitioner moves activations with
  collectives that serve no parameter; a split batch moves none.
* ``activations reduced in a loop``: inside a loop (a scanned model) whose carry nobody keeps in
  the batch's layout, the partitioner dropped the split batch's layout and all-reduces the whole
  batch's activations in every iteration; the carry kept in the batch's layout
  (``einshard.like_batch``, ``einshard.constrain_loops``) reduces none.
* ``activations gathered in place of weights``: inside a loop whose carry is kept, the partitioner
  still moves the whole batch's activations where they meet a larger weight (it keeps the
  weight's split), and reduces the next matmul's partial sums with all-reduces each device then
  slices: a reduce-scatter (XLA's GPU compiler makes it) sends half.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..reading._flow import Flow, Origin
from ..reading._uses import Uses
from ..report._report import Finding, StepRow
from ._detect import FINDING_KINDS, Context
from ._detect_batch import find_batch_gathers
from ._detect_layouts import find_copied, find_reshards
from ._detect_loops import find_loop_reductions, find_moved_activations
from ._detect_reductions import find_repeated, find_sliced, find_unsummed
from ._detect_remat import find_remats


def find_waste(
    rows: list[StepRow],
    origins: list[Origin],
    flow: Flow,
    n_devices: int,
    messages: Sequence[str] = (),
    layouts: Sequence[Any] | None = None,
    paths: Sequence[str] = (),
    parameter_paths: Sequence[str | None] = (),
    sizes: Mapping[str, int] | None = None,
    table: Any = None,
    loops: Sequence[Any] = (),
    platform: str = "cpu",
) -> list[Finding]:
    """Every finding of a compiled step, the costliest first; ``platform``: what it was compiled for."""
    values = [origin.value for origin in origins]
    operands = [origin.operand for origin in origins]
    uses = Uses(flow)
    context = Context(
        rows,
        values,
        uses,
        n_devices,
        messages,
        layouts,
        paths,
        parameter_paths,
        operands,
        dict(sizes or {}),
        table,
        loops,
        platform,
    )
    extra: set[int] = set()  # rows whose whole traffic a finding counts already
    found: list[Finding] = []
    found += find_batch_gathers(context, extra)  # first: the rows it claims are no other's waste
    found += find_loop_reductions(context, extra)
    found += find_moved_activations(context, extra)
    found += find_repeated(context, extra)
    found += find_unsummed(context, extra)
    found += find_sliced(context, extra)
    remats, claimed = find_remats(context, extra)
    found += remats
    found += find_reshards(context, extra | claimed)
    found += find_copied(context)
    found = [finding for finding in found if finding.cost > 0]
    found.sort(key=lambda f: (-f.cost, FINDING_KINDS.index(f.kind)))
    return found
