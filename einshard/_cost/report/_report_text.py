"""How a :class:`~einshard._cost.report._report.StepReport` is printed: its table, footer and findings.

Its data module imports it to print; it imports nothing back, not even for types (that would be
an import circle), so it takes the StepReport and its parts as ``Any``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from ..._language._text import seconds_text, size_text, table_text
from ..xla._hlo import KINDS

__all__ = [
    "collectives_text",
    "finding_headline",
    "findings_text",
    "links_text",
    "loops_lines",
    "memory_note",
    "report_text",
]


def report_text(report: Any) -> str:
    """``print(report)``: one row per collective, then the totals, estimate and findings."""
    return table_text(*_columns(report), empty="no collectives")


def findings_text(report: Any) -> str:
    """The findings, one paragraph each: kind, bytes, where, cause and fix."""
    return "\n".join(_findings_lines(report))


def finding_headline(finding: Any) -> str:
    """``kind: +X sent per device per step (params) at sources``."""
    parts = []
    if finding.bytes:
        parts.append(f"+{size_text(finding.bytes)} sent per device per step")
    if finding.memory_bytes:
        parts.append(f"+{size_text(finding.memory_bytes)} held per device")
    where = ", ".join(finding.params[:4]) + (" ..." if len(finding.params) > 4 else "")
    if finding.sources:
        at = ", ".join(_short(s) for s in finding.sources[:3]) + (" ..." if len(finding.sources) > 3 else "")
        where = f"{where} at {at}" if where else f"at {at}"
    return f"{finding.kind}: {', '.join(parts) or 'no bytes'}" + (f" ({where})" if where else "")


def _short(source: str) -> str:
    return source.rsplit("/", 1)[-1]


def _columns(report: Any) -> tuple[list[str], list[list[str]], list[str]]:
    header = ["kind", "array", "per device", "group", "axes", "times", "phase", "parameter", "source"]
    estimate = report.bandwidth is not None
    if estimate:
        header.insert(6, "time")
    body = []
    for row in report.rows:
        source = row.source.rsplit("/", 1)[-1] if row.source else "-"
        line = [
            row.kind,
            f"{row.dtype}{list(row.shape)}",
            size_text(row.bytes),
            str(row.group_size),
            ",".join(row.axes) if row.axes is not None else "?",
            f"{row.times}" + ("" if row.times_known else "?"),
            row.phase or "-",
            row.param or "-",
            source,
        ]
        if estimate:
            line.insert(6, seconds_text(row.seconds))
        body.append(line)
    kinds = ", ".join(f"{kind} {size_text(b)}" for kind, b in report.bytes_by_kind.items())
    mesh = " × ".join(f"{name}={size}" for name, size in report.mesh)
    devices = f"{report.n_devices} devices"
    if report.target != "cpu":
        devices = (
            f"{report.n_devices} {report.target.upper()} ({report.topology}), "
            "as XLA's compiler for them makes it"
        )
    headline = (
        f"{collectives_text(report.rows)} on {devices} (mesh {mesh}): "
        f"{size_text(report.bytes)} per device per step" + (f" ({kinds})" if kinds else "")
    )
    footer = textwrap.wrap(headline, _HEADLINE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    if report.peak_bytes is not None:
        footer.append(
            f"memory per device: {size_text(report.peak_bytes)} at the peak "
            f"(arguments {size_text(report.argument_bytes or 0)}, "
            f"outputs {size_text(report.output_bytes or 0)}, "
            f"aliased {size_text(report.alias_bytes or 0)}, "
            f"temporaries {size_text(report.temp_bytes or 0)})"
        )
        if report.donated is not None:
            footer += _wrapped(
                f"  the step returns its first argument, {report.donated!r}, updated: compiled with it "
                "donated, as a training loop runs it (its buffers hold the result: 'aliased'; "
                "donate=False compiles it without)",
                "  ",
            )
        if report.hardware is not None:
            footer += _wrapped(f"  {memory_note(report)}", "  ")
    if report.flops is not None:
        footer.append(
            f"flops per device: {report.flops:.3g}"
            + (f" ({report.flops_source})" if report.flops_source else "")
        )
    if report.communication_seconds is not None and report.bandwidth is not None:
        text = f"estimate at {links_text(report)}: communication {seconds_text(report.communication_seconds)}"
        if report.compute_seconds is not None:
            bound = "communication" if report.communication_bound else "compute"
            text += (
                f", compute {seconds_text(report.compute_seconds)} at {report.flops_per_second:.3g} FLOP/s: "
                f"{bound}-bound"
            )
        if report.simulated_seconds is None:
            footer += _wrapped(text, "  ")
    if report.simulated_seconds is not None:
        footer += _simulated_lines(report)
    if report.unmatched_rules:
        count = len(report.unmatched_rules)
        why = (
            "(a step's paths begin with its argument's name, 'params/...': anchor with (^|/), not ^)"
            if report.relative_rules
            else "(a layer name the step's arguments do not have?)"
        )
        footer += _wrapped(
            f"{count} rule{' matches' if count == 1 else 's match'} no path of the step's arguments {why}: "
            + ", ".join(repr(pattern) for pattern in report.unmatched_rules),
            "  ",
        )
    footer += loops_lines(report.batch_loops)
    footer += padded_lines(report)
    footer += _findings_lines(report)
    return header, body, footer


def padded_lines(report: Any) -> list[str]:
    """The all-reduces that gather (each device's part written into zeros), with their bytes."""
    positions = report.padded_gathers
    if not positions:
        return []
    rows = [report.rows[p] for p in positions]
    sent = sum(row.traffic for row in rows)
    sources = list(dict.fromkeys(_short(row.source) for row in rows if row.source))
    at = f" (at {', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''})" if sources else ""
    return _wrapped(
        f"{len(rows)} all-reduce{'s' if len(rows) > 1 else ''} gather{'' if len(rows) > 1 else 's'}"
        f"{at}: each device adds zeros but for its own part, {size_text(sent)} sent per device per "
        "step. That is the compiler's program (XLA's TPU compiler gathers so on a slice whose torus "
        "wraps around), costed as the all-reduces it has; an all-gather of the same arrays would send "
        "half on a ring, and no TPU time was measured to say which a chip runs faster",
        "  ",
    )


def loops_lines(loops: Sequence[Any]) -> list[str]:
    """The loops whose carry comes from the batch: where and by whom each is kept split, or why not."""
    if not loops:
        return []
    kept = [loop for loop in loops if loop.constrained]
    lines = []
    if kept:
        by_model = [loop for loop in kept if loop.constrained_by == "model"]
        whose = (
            "the model's own constraint (einshard.like_batch in the body)"
            if len(by_model) == len(kept)
            else "einshard's constraint (as einshard.constrain_loops compiles the step)"
            if not by_model
            else "the model's own constraint or einshard's, as each says"
        )
        mixed = 0 < len(by_model) < len(kept)
        lines += _wrapped(
            f"loops kept in the batch's layout (their carry constrained to it by {whose}): "
            + ", ".join(_loop_text(loop, mixed) for loop in kept),
            "  ",
        )
    for loop in loops:
        if not loop.constrained:
            lines += _wrapped(f"loop not kept in the batch's layout: {_loop_text(loop)}: {loop.reason}", "  ")
    return lines


def _loop_text(loop: Any, by: bool = False) -> str:
    where = _short(loop.source) if loop.source else "a loop without a source line"
    who = ", by the model" if loop.constrained_by == "model" else ", by einshard"
    return f"{where} ({loop.primitive}{', backward' if loop.backward else ''}{who if by else ''})"


def _simulated_lines(report: Any) -> list[str]:
    """The simulated step time, its parts, the slowest kernels and what the figures assume."""
    hardware = report.hardware
    assert hardware is not None
    mfu = report.model_flops_utilisation
    lines = _wrapped(
        f"step time {seconds_text(report.simulated_seconds)}, simulated from the program "
        f"(its kernels in order; async collectives beside the kernels between their start and done): "
        f"compute {seconds_text(report.compute_seconds)}, communication "
        f"{seconds_text(report.exposed_seconds)} exposed and {seconds_text(report.hidden_seconds)} hidden"
        + (
            f"; model FLOP utilisation {mfu:.0%} of the {hardware.device}'s bf16 peak "
            f"{hardware.peak_flops_per_second / 1e12:.4g} TFLOP/s"
            if mfu is not None
            else ""
        ),
        "  ",
    )
    if report.kernels:
        slowest = ", ".join(
            f"{name} {seconds_text(seconds)}" + (f" ({_short(source)})" if source else "")
            for name, source, seconds in report.kernels[:3]
        )
        lines += _wrapped(f"  slowest kernels: {slowest}", "    ")
    if report.unknown_loops:
        count = len(report.unknown_loops)
        lines += _wrapped(
            f"  {count} loop{'s' if count > 1 else ''} of a trip count XLA does not know, each counted "
            f"as running once: {', '.join(report.unknown_loops)}",
            "    ",
        )
    figures = report.figures
    rates = (
        f"every dot at the given {report.flops_per_second:.3g} FLOP/s"
        if figures is not None and figures.flops_given
        else f"gemms at {hardware.efficiency:g} of the matrix units' peak per element type "
        f"({hardware.sources.get('efficiency', 'given')})"
    )
    lines += _wrapped(
        f"  assumed: {rates}; memory at {hardware.memory_efficiency:g} of "
        f"{hardware.memory_bandwidth / 1e12:.3g} TB/s; {seconds_text(hardware.launch_seconds)} per kernel at "
        f"least; links: {links_text(report)}"
        + (" (no TPU time was measured)" if "TPU" in hardware.device else ""),
        "  ",
    )
    return lines


def links_text(report: Any) -> str:
    """What the report's collectives were timed on, in its links' words (``'450 GB/s per device, ...'``)."""
    links = report.figures.links if report.figures is not None else None
    if links is None:
        return f"{report.bandwidth / 1e9:g} GB/s per device, latency {seconds_text(report.latency)}"
    return links.assumed()


def memory_note(report: Any) -> str:
    """What the memory of a target's report is, against the device's own memory."""
    hardware = report.hardware
    assert hardware is not None and report.peak_bytes is not None
    share = report.peak_bytes / hardware.memory_bytes
    fits = "fits in" if share <= 1 else "does NOT fit in"
    return (
        f"{fits} the {hardware.device}'s {size_text(hardware.memory_bytes)} ({share:.1%}); the "
        f"buffers as XLA's compiler for it assigns them (on an H200 that peak equalled the device's "
        f"measured peak to 0.1 %)"
    )


def collectives_text(rows: Sequence[Any]) -> str:
    """``'1 combined all-reduce of 25 arrays, 2 all-gathers'``: instructions and arrays, by kind."""
    parts = []
    for kind in KINDS:
        instructions = {row.instruction for row in rows if row.kind == kind}
        arrays = sum(1 for row in rows if row.kind == kind)
        if not arrays:
            continue
        count = len(instructions)
        if count == arrays:
            parts.append(f"{count} {kind}{'s' if count > 1 else ''}")
        elif count == 1:
            parts.append(f"1 combined {kind} of {arrays} arrays")
        else:
            parts.append(f"{count} {kind}s of {arrays} arrays")
    return ", ".join(parts) or "0 collectives"


def _findings_lines(report: Any) -> list[str]:
    if not report.findings:
        return ["no waste found"]
    sent = report.waste_bytes
    held = sum(finding.memory_bytes for finding in report.findings)
    costs = [f"{size_text(sent)} more sent per device per step" if sent else ""]
    costs.append(f"{size_text(held)} more held per device" if held else "")
    count = len(report.findings)
    lines = [
        f"waste found ({count} finding{'s' if count > 1 else ''}): "
        f"{', '.join(c for c in costs if c)} than the better program"
    ]
    for number, finding in enumerate(report.findings, 1):
        lines += _wrapped(f"{number}. {finding.headline()}", "   ")
        lines += _wrapped(f"   cause: {finding.cause}", "          ")
        lines += _wrapped(f"   fix: {finding.fix}", "        ")
    return lines


_WIDTH = 110  # findings read as paragraphs: a terminal's or a page's width, not the table's
_HEADLINE_WIDTH = 130


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text, _WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
    )
