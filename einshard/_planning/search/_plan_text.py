"""How a :class:`~einshard._planning.search._planner.Plan` is printed: its table, chart and footer.

Its data module imports it to print; it imports nothing back, not even for types (that would be
an import circle), so it takes the Plan and its parts as ``Any``.
"""

from __future__ import annotations

from typing import Any

from ..._cost.hardware._links import Links, spanned_hosts
from ..._cost.report._report import KINDS, StepReport, StepRow
from ..._language._text import seconds_text, size_text, table_text

__all__ = ["plan_text"]

_BAR_WIDTH = 40


def _columns(plan: Any) -> tuple[list[str], list[list[str]]]:
    kinds = [k for k in KINDS if any(row.bytes_by_kind.get(k) for row in plan.rows)]
    # Communication is time less compute: the chart under the table shows the two apart.
    header = ["#", "strategy", "split", "time", "compute", "peak", "sent"]
    header += [_SHORT_KIND.get(kind, kind) for kind in kinds]
    header += ["findings", "verdict"]
    body = []
    rank = 0
    for row in plan.rows:
        report = row.report
        if row.rejected is None:
            rank += 1
        body.append(
            [
                str(rank) if row.rejected is None else "-",
                row.name,
                f"{row.split_share:.0%}" if row.split_share is not None else "-",
                seconds_text(row.seconds) if report is not None else "-",
                seconds_text(report.compute_seconds) if report is not None else "-",
                size_text(row.peak_bytes) if row.peak_bytes is not None else "-",
                size_text(row.traffic) if row.traffic is not None else "-",
                *[size_text(row.bytes_by_kind.get(kind, 0)) for kind in kinds],
                _findings_cell(report),
                _verdict(row, rank),  # a rejection's reason in full below
            ]
        )
    return header, body


def _findings_cell(report: StepReport | None) -> str:
    """How many findings, and the largest one's bytes: ``'2 (112.0 KiB)'`` (the footer names it)."""
    if report is None:
        return "-"
    if not report.findings:
        return "0"
    return f"{len(report.findings)} ({size_text(report.findings[0].cost)})"


def _findings_lines(plan: Any) -> list[str]:
    """One line per candidate with findings: how many, and the largest."""
    lines = []
    for row in plan.rows:
        if row.report is not None and row.report.findings:
            count = len(row.report.findings)
            lines.append(
                f"{row.name}: {count} finding{'s' if count > 1 else ''}, the largest "
                f"{row.report.findings[0].headline()}"
            )
    return lines


def _chart(plan: Any) -> list[str]:
    """Bars of the estimated step time: ``█`` communication, ``░`` compute."""
    usable = [row for row in plan.usable if row.seconds is not None]
    if not usable:
        return []
    longest = max(row.seconds or 0.0 for row in usable) or 1.0
    width = max(len(row.name) for row in usable)
    lines = []
    for row in usable:
        report = row.report
        assert report is not None
        compute = report.compute_seconds or 0.0
        # The time less compute: a simulated step overlaps some of its collectives with compute
        # (their sum would draw past the time); on CPU devices the two are the same.
        communication = max(0.0, (row.seconds or 0.0) - compute)
        bar_comm = round(_BAR_WIDTH * communication / longest)
        bar_compute = round(_BAR_WIDTH * (communication + compute) / longest) - bar_comm
        bar = "█" * bar_comm + "░" * bar_compute
        lines.append(f"{row.name.ljust(width)}  {bar.ljust(_BAR_WIDTH)}  {seconds_text(row.seconds)}")
    return ["estimated step time (█ communication, ░ compute):", *lines]


def _verdict(row: Any, rank: int) -> str:
    if row.rejected is not None:
        return f"rejected ({row.rejected_for})"
    if row.splits_little:
        little = f"splits only {row.split_share:.0%}"
        return f"best, {little}" if rank == 1 else little
    return "best" if rank == 1 else "fits"


def _hosts_lines(plan: Any) -> list[str]:
    """On several hosts, one line per compiled candidate: which of its collectives cross hosts.

    Read from the report's rows (a row's groups over more than one host run on the hosts' NICs;
    which host a device is on is the links' answer), by kind and the axis their groups run over,
    with the bytes per device per step; a model axis wider than a host says so.
    """
    links = plan.figures.links
    if links is None or spanned_hosts(links, (tuple(range(plan.n_devices)),)) < 2:
        return []
    lines = []
    for row in plan.rows:
        if row.report is None:
            continue
        model = row.strategy.model
        model = plan.n_devices if model == 0 else model
        crossing: dict[tuple[str, str], int] = {}
        for step_row in row.report.rows:
            if step_row.hosts > 1:
                key = (step_row.kind, _group_axis(step_row, model, plan.n_devices, links))
                crossing[key] = crossing.get(key, 0) + step_row.total_bytes
        parts = [f"{kind} {size_text(size)} ({axis})" for (kind, axis), size in crossing.items()]
        head = f"{row.name}: "
        model_hosts = spanned_hosts(links, (tuple(range(model)),)) if model is not None else 0
        if model_hosts > 1:
            head += f"its model axis of {model} spans {model_hosts} hosts; "
        elif model is not None:
            head += "its model axis stays inside a host; "
        lines.append(head + ("crosses hosts: " + ", ".join(parts) if parts else "nothing crosses hosts"))
    return lines


def _group_axis(row: StepRow, model: int | None, n_devices: int, links: Links) -> str:
    """The axis a collective's groups run over, in a strategy's words, read from its groups.

    In einshard's device order a model axis is ``model`` neighbouring devices, a data axis one
    device of each model group (every ``model``-th device); a group with one device on each of
    its hosts is ``one device per host``.
    """
    size = row.group_size
    if size == n_devices:
        return "all devices"
    group = sorted(max(row.groups, key=len)) if row.groups else []  # the widest, as group_size
    if model and group:
        if size == model and group == list(range(group[0], group[0] + model)):
            return "model axis"
        if size == n_devices // model and group == list(range(group[0], n_devices, model)):
            return "data axis"
    if group and spanned_hosts(links, (tuple(group),)) == size:
        return "one device per host"
    return f"groups of {size} on {row.hosts} hosts"


_SHORT_KIND = {"collective-permute": "permute", "reduce-scatter": "reduce-scatter"}


def _footer(plan: Any) -> list[str]:
    rejected = [f"rejected {row.name}: {row.rejected}" for row in plan.rows if row.rejected is not None]
    for row in plan.rows:
        if row.splits_little and not row.model_parallel:
            rejected.append(
                f"{row.name} splits only {row.split_share:.0%} of the parameter bytes over all "
                f"{plan.n_devices} devices: the leaves under its min_bytes are replicated "
                "(fsdp(min_bytes=...) splits more)"
            )
        elif row.splits_little:
            rejected.append(
                f"{row.name} splits only {row.split_share:.0%} of the parameter bytes over its model axis "
                f"of {row.strategy.model or plan.n_devices}: the rest is replicated or split as FSDP"
            )
        if row.unmatched_rules:
            listed = ", ".join(repr(rule.pattern) for rule in row.unmatched_rules[:5])
            more = f" and {len(row.unmatched_rules) - 5} more" if len(row.unmatched_rules) > 5 else ""
            count = len(row.unmatched_rules)
            rejected.append(
                f"{row.name}: {count} unmatched rule{'' if count == 1 else 's'} "
                f"(matching no parameter's path): {listed}{more}"
            )
    rejected += _left_lines(plan)
    figures = []
    links = plan.figures.links
    if links is not None:
        figures.append(links.assumed())
    if plan.flops_per_second is not None:
        figures.append(f"{plan.flops_per_second:.3g} FLOP/s per device")
    if plan.memory_per_device is not None:
        figures.append(f"{size_text(plan.memory_per_device)} per device")
    if plan.bandwidth is None:
        figures.append("no bandwidth given: ranked by bytes sent")
    given = "; ".join(figures)
    devices = f"{plan.n_devices} devices"
    compiled_for = "the program compiled for CPU devices"
    if plan.hardware is not None:
        devices = f"{plan.n_devices} {plan.target.upper()}"
        compiled_for = f"the program XLA's compiler makes for the {plan.hardware.device}"
    return [
        *rejected,
        *([plan.sampling] if plan.sampling else []),
        *_findings_lines(plan),
        *_hosts_lines(plan),
        f"{len(plan.rows)} candidates on {devices} ({given}); "
        f"times within {plan.tie:.0%} count as equal (the simpler strategy first); split: the share of the "
        "parameter bytes split over the model axis (over all devices for data parallel and FSDP); "
        "time: the step's (simulated on a target; communication plus compute on CPU devices); "
        "sent: what each device sends by the ring formulas (an "
        "all-reduce of b bytes sends 2(n-1)/n b); each kind's column: the bytes its collectives move; "
        "peak, sent and bytes: per device per step.",
        _estimate_text(plan)
        + f" Peak memory from XLA's memory analysis of {compiled_for}. Findings: the waste "
        "each candidate's step report names (print row.report for all of them).",
    ]


# Why candidates were left uncompiled, by their rejection's kind.
_LEFT = {
    "memory": "the bounds known before compiling (the arguments as the table lays them out, the outputs "
    "and the largest dot result spread over the devices) exceed the memory per device",
    "cannot win": "the lower bound of each one's step time (its dots at the matrix units' rate, the "
    "gradients its layout must sum) is slower than the winner's beyond the tie; exhaustive=True compiles "
    "them",
    "budget": "max_seconds was spent before their turn (what each needs at least is in its row)",
    "sampled": "what each needs at least (its time on CPU devices, its bytes without a bandwidth), "
    "extrapolated from its compiles at two small depths, is slower than the winner's whole compile "
    "beyond the tie; sample=False compiles them whole",
    "not compiled": "they were not compiled at the figures planned with; plan again at these",
}


def _left_lines(plan: Any) -> list[str]:
    """One line per reason candidates were not compiled: how many, which, and why."""
    lines = []
    for kind, why in _LEFT.items():
        names = [row.name for row in plan.rows if row.report is None and row.rejected_for == kind]
        if names:
            count = len(names)
            lines.append(
                f"{count} candidate{'' if count == 1 else 's'} not compiled ({', '.join(names)}): {why}; "
                "no time, peak or bytes for them"
            )
    return lines


def _estimate_text(plan: Any) -> str:
    """What the times are: simulated from each program on a target, added up on CPU devices."""
    hardware = plan.hardware
    if hardware is None:
        return (
            "Estimates, not measurements: collectives of the compiled program by ring formulas at the "
            "given bandwidth, plus XLA's flop count at the given FLOP/s, without overlap."
        )
    tpu = " No TPU time was measured: the fractions are a GPU's." if "TPU" in hardware.device else ""
    return (
        "Simulated, not measured: each candidate's program, its kernels in order at its element "
        "types' gemm rates or the memory's bandwidth, its async collectives beside the kernels "
        "between their start and done (ring formulas on the links named above). "
        f"Assumed: gemms at {hardware.efficiency:g} of the matrix units' peak, memory at "
        f"{hardware.memory_efficiency:g} of its bandwidth, {seconds_text(hardware.launch_seconds)} per "
        f"kernel at least.{tpu}"
    )


def plan_text(plan: Any) -> str:
    """``print(plan)``: the table of candidates, the chart of their times, the footer."""
    # 150 columns: what the documentation's code blocks show without wrapping a table's lines.
    text = table_text(*_columns(plan), [*_chart(plan), *_footer(plan)], width=150)
    return text if plan.headline is None else f"{plan.headline}\n{text}"
