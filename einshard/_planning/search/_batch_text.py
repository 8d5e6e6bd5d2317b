"""How a :class:`~einshard._planning.search._batches.BatchPlan` is printed: its table and footer.

Its data module imports it to print; it imports nothing back, not even for types (that would be
an import circle), so it takes the BatchPlan and its parts as ``Any``.
"""

from __future__ import annotations

from typing import Any

from ..._language._text import seconds_text, size_text, table_text

__all__ = ["batch_plan_text"]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _columns(plan: Any) -> tuple[list[str], list[list[str]]]:
    tokens = any(row.tokens_per_second is not None for row in plan.rows)
    header = ["#", "strategy", "largest batch", "per split", "time", "examples/s"]
    header += ["tokens/s"] if tokens else []
    header += ["peak", "compiles", "verdict"]
    body = []
    rank = 0
    for row in plan.rows:
        if row.rejected is None:
            rank += 1
        fits = row.batch_size is not None
        cells = [
            str(rank) if row.rejected is None else "-",
            row.name,
            str(row.batch_size) if fits else "-",
            f"{row.granularity} × {row.batch_size // row.granularity}" if row.batch_size else "-",
            seconds_text(row.seconds) if row.seconds is not None else "-",
            _rate(row.examples_per_second),
        ]
        cells += [_rate(row.tokens_per_second)] if tokens else []
        cells += [
            size_text(row.peak_bytes) if row.peak_bytes is not None else "-",
            str(row.compiles),
            _verdict(row, rank),
        ]
        body.append(cells)
    return header, body


def _verdict(row: Any, rank: int) -> str:
    if row.rejected is not None:
        return "rejected (memory)" if row.rejected_for == "memory" else "rejected"
    if not row.proven:
        return "best, larger untried" if rank == 1 else "fits, larger untried"
    return "best" if rank == 1 else "fits"


def _footer(plan: Any) -> list[str]:
    lines = [f"rejected {row.name}: {row.rejected}" for row in plan.rows if row.rejected is not None]
    for row in plan.usable:
        if row.proven:
            continue
        if row.next_size is None:
            lines.append(f"{row.name}: {row.batch_size} is the largest of the batch_sizes given")
            continue
        miss = row.miss
        if miss is not None and miss.batch_size == row.next_size and miss.reason is not None:
            lines.append(f"{row.name}: batch {row.next_size} has no memory verdict: {miss.reason}")
            continue
        lines.append(
            f"{row.name}: batch {row.next_size} not compiled, the search stopped at "
            f"max_compiles={plan.max_compiles}: a larger batch may fit"
        )
    if plan.batch_sizes is None:
        how = (
            f"from the batch given ({plan.given_batch}): doubled once (halved when it does not fit), then "
            "each next size where a line through the peaks of the two compiles nearest the limit meets it "
            "(bisecting when a guess gains little), until a size fits and the next one up does not"
        )
    else:
        how = f"among the batch sizes given ({', '.join(map(str, plan.batch_sizes))}), by bisection"
    splits = "; ".join(sorted({f"{row.name} {row.granularity}" for row in plan.rows}))
    if plan.bandwidth is not None:
        ranked = (
            "ranked by examples per second (the batch over the step time; tokens per second, for a "
            "batch of integer tokens, rank the same)"
        )
    else:
        ranked = "no bandwidth given: no step time, ranked by the largest batch"
    return [
        *lines,
        f"{len(plan.rows)} candidates on {plan.n_devices} devices, {size_text(plan.memory_per_device)} "
        f"per device; {ranked}; within {plan.tie:.0%} count as equal (then the candidate given first "
        "ranks first).",
        f"Each largest batch fits by its own compile (peak per device from XLA's memory analysis), "
        f"found {how}; at most {plan.max_compiles} compiles per candidate, {plan.compiles} in all. "
        f"Batch sizes are multiples of each candidate's batch split (per split: parts × rows each): "
        f"{splits}.",
    ]


def batch_plan_text(plan: Any) -> str:
    """``print(batch_plan)``: the table of candidates and the footer."""
    text = table_text(*_columns(plan), _footer(plan), width=150)
    if plan.usable:
        return text
    memory = size_text(plan.memory_per_device)
    return f"No candidate fits a batch in {memory} per device (the reasons below).\n{text}"
