"""Reductions a better program would not send: ``repeated``, ``unsummed``, ``sliced all-reduce``."""

from __future__ import annotations

from fractions import Fraction

from ..._language._text import size_text
from ..hardware._links import sent_fraction
from ..report._report import Finding
from ._detect import (
    REDUCTIONS,
    REPEATED,
    SLICED,
    UNSUMMED,
    Context,
    array_text,
    capital,
    only_sliced,
    rows_params,
    rows_sources,
    rows_traffic,
)


def find_repeated(context: Context, extra: set[int]) -> list[Finding]:
    """A parameter's gradient reduced piece by piece, or its value gathered more than once.

    Piece by piece: several collectives whose results are added (its contributions reduced one
    by one).
    Reductions of disjoint parts (a stacked layer weight, one slice per layer) are not repeated:
    they are put together, not added; gathers are repeated when they move more than the whole.
    """
    rows = context.rows
    by_param: dict[tuple[str, str, int], list[int]] = {}
    for position, row in enumerate(rows):
        if row.param is None or row.kind not in (*REDUCTIONS, "all-gather"):
            continue
        family = "gather" if row.kind == "all-gather" else "reduce"
        by_param.setdefault((row.param, family, row.group_size), []).append(position)
    out = []
    gathered: dict[tuple[str, tuple[str, ...]], list[tuple[str, list[int], int]]] = {}  # (why, sources)
    for (param, family, _), candidates in by_param.items():
        if len(candidates) < 2:
            continue
        fed: list[int] = []
        if family == "reduce":
            values = [context.values[p] for p in candidates]
            if any(v is None for v in values):
                continue
            groups = context.uses.summed(values)  # type: ignore[arg-type]
            if groups:
                summed, _ = max(groups, key=lambda g: len(g[0]))
                positions = [candidates[i] for i in summed]
                keep = max(positions, key=lambda p: rows[p].traffic)
                wasted = rows_traffic(rows, [p for p in positions if p != keep])
            else:
                # One reduced contribution goes into the operand of another reduction of the
                # same gradient (XLA's GPU compiler adds it there, on one device): sent twice.
                fed = _fed(context, candidates)
                if not fed:
                    continue
                positions = sorted(set(candidates))
                wasted = rows_traffic(rows, fed)
        else:
            # A gather whose result is only sliced moves a layout (a reshard's), not the weight.
            positions = [p for p in candidates if not only_sliced(context, p)]
            moved = sum(rows[p].total_bytes for p in positions)
            whole = context.sizes.get(param, 0)
            if not whole or moved <= whole or len(positions) < 2:
                continue
            traffic = rows_traffic(rows, positions)
            one = round(traffic * whole / moved)  # what one gather of the whole weight sends
            forward = [p for p in positions if rows[p].phase == "forward"]
            later = [p for p in positions if p not in forward]
            if len(forward) >= 2:
                waste = rows_traffic(rows, forward) - one
                place = (_FORWARD, rows_sources(rows, forward))
                gathered.setdefault(place, []).append((param, forward, waste))
            if later:
                waste = rows_traffic(rows, later) - (one if not forward else 0)
                why = _REMAT if any(_recomputed(rows[p].op_name) for p in later) else _BACKWARD
                gathered.setdefault((why, rows_sources(rows, positions)), []).append((param, later, waste))
            extra.update(positions)
            continue
        others = [p for p in positions if p != max(positions, key=lambda q: rows[q].traffic)]
        extra.update(others)
        count, row = len(positions), rows[positions[0]]
        array, each = array_text(row), size_text(row.bytes)
        how = "then added" if not fed else "one's result put into the other's input"
        cause = (
            f"The gradient of {param} is reduced {count} times per step ({count} {row.kind}s of "
            f"{array}, {each} each, {how}): the parameter is used in {count} places (as tied "
            "embeddings are) and each contribution is reduced on its own."
        )
        fix = (
            "Add the contributions before reducing them: compute that gradient in jax.shard_map and "
            "psum the total once."
        )
        out.append(
            Finding(
                REPEATED, wasted, 0, (param,), rows_sources(rows, positions), cause, fix, tuple(positions)
            )
        )
    # Gathered again: one finding per cause and place in the code (a norm scale in every layer: one).
    for (why, sources), items in gathered.items():
        out.append(_gathered_finding(context, why, sources, items))
    return out


def find_unsummed(context: Context, extra: set[int]) -> list[Finding]:
    rows = context.rows
    keys: dict[tuple, list[int]] = {}
    for position, row in enumerate(rows):
        value = context.values[position]
        if row.kind != "all-reduce" or position in extra or value is None:
            continue
        keys.setdefault((row.dtype, row.shape, row.group_size, row.axes, row.times), []).append(position)
    raw: list[list[int]] = []  # rows summed right after
    for positions in keys.values():
        if len(positions) < 2:
            continue
        values = [context.values[p] for p in positions]
        for group, _ in context.uses.summed(values):  # type: ignore[arg-type]
            raw.append([positions[i] for i in group])
    # One finding per place in the code (a layer written once and run many times: one finding).
    by_place: dict[tuple[str, ...], list[list[int]]] = {}
    for members in raw:
        by_place.setdefault(rows_sources(rows, members), []).append(members)
    out = []
    for sources, groups in by_place.items():
        members = [p for group in groups for p in group]
        wasted = [p for group in groups for p in sorted(group, key=lambda q: rows[q].traffic)[:-1]]
        extra.update(wasted)
        k, n = len(groups[0]), len(groups)
        row = rows[members[0]]
        times = f"{n} times, " if n > 1 else ""
        weights = tuple(dict.fromkeys(w for p in members for w in context.producers(p)))
        made = f", made by the matmuls with {', '.join(weights[:k])}" if weights else ""
        cause = (
            f"{k} partial sums of {array_text(row)} ({size_text(row.bytes)} each, {times}"
            f"{row.phase or 'in the step'}{made}) are all-reduced one by one and added right after: "
            f"{k} reductions where one of their sum would do."
        )
        fix = (
            "Add them before reducing: fuse the layers that read the same input into one matmul "
            "(q, k and v into one QKV projection), so their input gradient is one partial sum."
        )
        out.append(
            Finding(
                UNSUMMED,
                rows_traffic(rows, wasted),
                0,
                rows_params(rows, members) or weights,
                sources,
                cause,
                fix,
                tuple(members),
            )
        )
    return out


def find_sliced(context: Context, extra: set[int]) -> list[Finding]:
    rows = context.rows
    positions = []
    for position, row in enumerate(rows):
        value = context.values[position]
        if row.kind != "all-reduce" or position in extra or value is None or row.group_size < 2:
            continue
        if context.uses.slice_fraction(value) == Fraction(1, row.group_size):
            positions.append(position)
    if not positions:
        return []
    saved = 0
    for p in positions:
        scattered = round(sent_fraction("reduce-scatter", rows[p].group_size) * rows[p].bytes) * rows[p].times
        saved += rows[p].traffic - scattered
    params = rows_params(rows, positions)
    what = f"the gradients of {len(params)} parameters" if len(params) > 1 else (params[0] if params else "")
    what = what or f"{len(positions)} arrays"
    n = rows[positions[0]].group_size
    cause = (
        f"{capital(what)} {'is' if len(positions) == 1 else 'are'} all-reduced whole "
        f"({len(positions)} all-reduce{'s' if len(positions) > 1 else ''}, "
        f"{size_text(sum(rows[p].total_bytes for p in positions))} per device), and each device then keeps "
        f"only its 1/{n} slice: a reduce-scatter sends half the bytes."
    )
    if context.platform == "tpu":
        # This is already the TPU's own program: another target= would not show what a TPU runs.
        fix = (
            "In your own code, jax.lax.psum_scatter (in shard_map) does it. This is the program XLA's TPU "
            "compiler makes for the target: it kept these all-reduces (and on a slice whose torus wraps "
            "around it writes gathers as all-reduces too: report.padded_gathers); no TPU time was measured "
            "to say whether a reduce-scatter runs faster there."
        )
    else:
        fix = (
            "In your own code, jax.lax.psum_scatter does it. XLA's GPU compiler makes this a reduce-scatter "
            "itself, its CPU compiler does not: a report with target= (target='h100') shows the program the "
            "hardware you run on gets."
        )
    return [Finding(SLICED, saved, 0, params, rows_sources(rows, positions), cause, fix, tuple(positions))]


def _fed(context: Context, candidates: list[int]) -> list[int]:
    """The rows (of one parameter's reductions) whose reduced value goes into another's input."""
    out = []
    for a in candidates:
        value = context.values[a]
        if value is None:
            continue
        for b in candidates:
            operand = context.operands[b]
            if b != a and operand is not None and context.uses.reaches(value, operand):
                out.append(a)
                break
    return out


_FORWARD, _BACKWARD, _REMAT = "forward", "backward", "recomputed"


def _recomputed(op_name: str) -> bool:
    """Whether JAX's op name says the op runs again in the backward pass (``jax.checkpoint``)."""
    return any(word in op_name for word in ("remat", "checkpoint"))


def _expression(path: str) -> str:
    """A parameter's path as the Python that reads it: ``params/layers/0/w``, ``params['layers'][0]['w']``."""
    name, *keys = path.split("/")
    return name + "".join(f"[{key}]" if key.isdigit() else f"[{key!r}]" for key in keys)


def _gathered_finding(
    context: Context, why: str, sources: tuple[str, ...], items: list[tuple[str, list[int], int]]
) -> Finding:
    """One ``repeated`` gather finding: its cause read off the rows' phases and op names."""
    rows = context.rows
    params = tuple(param for param, _, _ in items)
    positions = [p for _, group, _ in items for p in group]
    row = rows[positions[0]]
    what = params[0] if len(params) == 1 else f"{len(params)} parameters ({params[0]}, ...)"
    what = what if len(params) == 1 else capital(what)
    verb = "is" if len(params) == 1 else "are"
    weight = _expression(params[0])
    gather = f"einshard.einshard({weight}, '... -> * ...')"
    lines = ", ".join(s.rsplit("/", 1)[-1] for s in rows_sources(rows, positions)) or "the same line"
    if why == _FORWARD:
        cause = (
            f"{what} {verb} gathered {len(positions)} times in the forward pass "
            f"({len(positions)} all-gathers of {array_text(row)} and the like, at {lines}): the weight is "
            "used in more than one place (as a tied embedding is, by the lookup and the logits) and each "
            "use gathers it."
        )
        fix = (
            f"Gather it once and use that in every place: w = {gather} before its first use "
            "(jax.lax.with_sharding_constraint to a replicated sharding does the same); the backward pass "
            "then reads that too. Each device holds the whole weight from there on."
        )
    elif why == _REMAT:
        cause = (
            f"{what} {verb} gathered in the forward pass and again in the backward pass "
            f"({len(positions)} all-gathers of {array_text(row)} and the like in the backward pass): "
            "jax.checkpoint recomputes the forward pass there, gather included."
        )
        fix = (
            "Save the gathered weight: inside the checkpointed function write "
            f"w = checkpoint_name({gather}, 'gathered') (checkpoint_name from jax.ad_checkpoint) and "
            "checkpoint with policy=jax.checkpoint_policies.save_only_these_names('gathered'). A policy "
            "that saves everything does not keep it (the gather is the partitioner's, not the step's). "
            "Each device then holds the whole weight until the backward pass, if the memory allows."
        )
    else:
        cause = (
            f"{what} {verb} gathered in the forward pass and again in the backward pass "
            f"({len(positions)} all-gathers of {array_text(row)} and the like in the backward pass): the "
            "backward pass reads the parameter as it is split, not the gathered value."
        )
        fix = (
            f"Gather it once in the forward pass and use that: w = {gather}; the backward pass then "
            "reads the gathered value. Each device holds the whole weight until the backward pass, if the "
            "memory allows."
        )
    wasted = sum(w for _, _, w in items)
    return Finding(REPEATED, wasted, 0, params, sources, cause, fix, tuple(positions))
