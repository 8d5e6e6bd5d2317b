"""Plans from a few layers: candidates ranked from compiles at two small depths, the winner compiled whole.

A step of ``N`` repeated layers (:mod:`einshard._tracing._blocks`: an unrolled model's forward
pass, its backward pass in reverse, each layer's optimizer update) is compiled under each
candidate at :data:`DEPTHS` of its layers, a fraction of the whole program's compile. Each
candidate's step time and peak memory are extrapolated linearly to ``N``: the flops, the bytes of
each kind of collective and the arguments are exactly linear in the depth (measured on Hugging
Face's Flax LLaMA, 1.5 B, 8 H100s: 0.00 % off at 16 layers from 2 and 3); the simulated time and
the peak are within :data:`BAND`. Then the candidate with the best extrapolated time is compiled
whole, and so is each next one whose extrapolated time, less the band, could beat the best
whole compile beyond the tie: the winner, and every figure a plan prints as compiled, is from a
compile of the whole step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..._cost._step import reports
from ..._cost.child._progress import Progress
from ..._cost.pipeline._analysis import Answer
from ..._language._text import seconds_text, size_text
from ..._tracing._depth import AtDepth, repeated_layers
from ..._trees._rules import RulesLike
from ._bounds import Bounds
from ._candidates import FROM_LAYERS, TIE, Rejection, Where, out_of_time

__all__ = [
    "BAND",
    "DEPTHS",
    "FROM_LAYERS",
    "SAMPLE_FROM",
    "Extrapolated",
    "cannot_win_sampled",
    "compile_sampled",
    "layers_to_sample",
    "sampled_rejection",
]

SAMPLE_FROM = 24
"""Repeated layers from which a plan samples by default (``sample=None``). Below it, the two small
compiles cost about what one whole compile does (1.5 B LLaMA, 16 layers, 8 H100s: 5–9 s at 2 and 3
layers against 12–21 s whole), and the plan would take longer."""

DEPTHS = (2, 3)
"""The depths each candidate is compiled at."""

BAND = 0.06
"""How far an extrapolated time or peak may be from the whole compile's (measured: at most 5.6 %
for the peak, 3 % for the time, 1.5 B LLaMA from 2 and 3 of 16 layers)."""


@dataclasses.dataclass(frozen=True)
class Extrapolated:
    """A candidate's figures at the step's depth, extrapolated from its compiles at two smaller ones.

    Attributes:
        measure: What ranks it: the step time with a bandwidth, else the bytes each device sends.
        seconds: The step time, or ``None`` without a bandwidth.
        peak_bytes: The peak memory per device, or ``None``.
        depths: The two depths compiled.
        layers: The step's repeated layers (``N``).
    """

    measure: float
    seconds: float | None
    peak_bytes: int | None
    depths: tuple[int, int]
    layers: int

    @property
    def source(self) -> str:
        """``'extrapolated from 2 and 3 of its 32 layers (±6%)'``."""
        first, second = self.depths
        return f"extrapolated from {first} and {second} of its {self.layers} layers (±{BAND:.0%})"

    def text(self) -> str:
        """``'about 512 ms'`` (or the bytes sent), with the peak when known."""
        what = seconds_text(self.seconds) if self.seconds is not None else f"{size_text(self.measure)} sent"
        peak = f", peak {size_text(self.peak_bytes)}" if self.peak_bytes is not None else ""
        return f"about {what}{peak}"


def layers_to_sample(call: Any, sample: bool | None, exhaustive: bool) -> tuple[int | None, str | None]:
    """How many repeated layers the plan samples, and the footer's line when it does not.

    ``None`` layers: each candidate is compiled whole; ``None`` line: nothing to say.
    """
    if sample is False or (sample is None and exhaustive):
        return None, None
    found = repeated_layers(call)
    if isinstance(found, str):
        return (
            None,
            f"Each candidate compiled whole: the step's layers cannot be sampled: {found}."
            if sample
            else None,
        )
    if sample is None and found.count < SAMPLE_FROM:
        return None, None
    return found.count, None


def _line(a: float | None, b: float | None, depths: tuple[int, int], layers: int) -> float | None:
    if a is None or b is None:
        return None
    k1, k2 = depths
    return a + (b - a) * (layers - k1) / (k2 - k1)


Figures = Callable[[Any], "tuple[float, float | None, int | None] | None"]
"""A report's (measure, seconds, peak) at the plan's figures, or ``None`` when it has none."""


def compile_sampled(
    call: Any,
    tables: Sequence[RulesLike],
    bounded: Sequence[Bounds | None],
    skip: Mapping[int, Rejection],
    where: Where,
    progress: Progress,
    figures_of: Figures,
    layers: int,
    *,
    max_seconds: float | None = None,
) -> tuple[dict[int, Answer], dict[int, Extrapolated], dict[int, Rejection], int]:
    """Samples every candidate at :data:`DEPTHS`, then compiles whole until the winner is confirmed.

    Returns:
        The whole compiles' answers by candidate, the extrapolations by candidate, why each
        candidate left uncompiled whole was (``'budget'``; the others are ranked from their
        extrapolation by the caller), and how many samples were compiled.
    """
    count = len(tables)
    all_tables: list[Any] = list(tables)
    for depth in DEPTHS:
        all_tables += [AtDepth(table, depth) for table in tables]
    measures = [bound.measure(where.figures) if bound is not None else None for bound in bounded]
    order = sorted(
        (i for i in range(count) if i not in skip),
        key=lambda i: (-1.0 if measures[i] is None else measures[i], i),
    )
    memory = where.figures.memory_per_device
    extrapolated: dict[int, Extrapolated] = {}
    left: dict[int, Rejection] = {}
    start = time.perf_counter()

    def sample(i: int, j: int) -> int:
        return count * (j + 1) + i

    def spent() -> bool:
        return max_seconds is not None and time.perf_counter() - start >= max_seconds

    def extrapolate(i: int, answers: Mapping[int, Answer]) -> Extrapolated | None:
        found = [answers.get(sample(i, j)) for j in range(len(DEPTHS))]
        figures = [
            figures_of(answer.report) if answer is not None and answer.report is not None else None
            for answer in found
        ]
        if any(f is None for f in figures):
            return None
        (ma, sa, pa), (mb, sb, pb) = figures  # type: ignore[misc]
        measure = _line(ma, mb, DEPTHS, layers)
        assert measure is not None
        peak = _line(pa, pb, DEPTHS, layers)
        return Extrapolated(
            measure, _line(sa, sb, DEPTHS, layers), None if peak is None else round(peak), DEPTHS, layers
        )

    def choose(answers: dict[int, Answer], compiling: frozenset[int]) -> int | None:
        for i in order:  # first every candidate's samples, the most promising first
            for j in range(len(DEPTHS)):
                index = sample(i, j)
                if index in answers or index in compiling:
                    continue
                if j and (first := answers.get(sample(i, 0))) is not None and first.report is None:
                    continue  # its first sample failed: the whole compile says why
                if spent():
                    break
                return index
        if any(index >= count for index in compiling):
            return None  # another child's sample is compiling: its answer comes first
        for i in order:
            if i not in extrapolated and (found := extrapolate(i, answers)) is not None:
                extrapolated[i] = found
        best = min(
            (
                measure
                for i, a in answers.items()
                if i < count and (measure := _usable(a, figures_of, memory)) is not None
            ),
            default=None,
        )
        contenders = sorted(
            (
                (extrapolated[i].measure if i in extrapolated else measures[i] or 0.0, i)
                for i in order
                if i not in answers
                and i not in compiling
                and i not in left
                and not _over(extrapolated.get(i), memory)
            ),
        )
        for measure, i in contenders:
            if best is not None and measure * (1 - (BAND if i in extrapolated else 0.0)) > best * (1 + TIE):
                return None  # sorted: none after it can win either
            if spent():
                for _, rest in contenders:
                    if rest not in answers and rest not in compiling:
                        left[rest] = out_of_time_rejection(max_seconds, bounded[rest])
                return None
            return i
        return None

    answers = reports(call, all_tables, where.child, where.compiled_for, choose, progress)
    whole = {i: answer for i, answer in answers.items() if i < count}
    samples = sum(1 for i in answers if i >= count)
    return whole, extrapolated, left, samples


def out_of_time_rejection(max_seconds: float | None, bound: Bounds | None) -> Rejection:
    assert max_seconds is not None
    return out_of_time(max_seconds, bound)


def _usable(answer: Answer, figures_of: Figures, memory: int | None) -> float | None:
    if answer.report is None:
        return None
    found = figures_of(answer.report)
    if found is None:
        return None
    measure, _, peak = found
    if memory is not None and peak is not None and peak > memory:
        return None
    return measure


def _over(extrapolated: Extrapolated | None, memory: int | None) -> bool:
    """Over the memory beyond the band: rejected without a whole compile."""
    return (
        extrapolated is not None
        and memory is not None
        and extrapolated.peak_bytes is not None
        and extrapolated.peak_bytes > memory * (1 + BAND)
    )


def sampled_rejection(extrapolated: Extrapolated, winner: str | None, memory: int | None) -> Rejection:
    """Why a candidate ranked from its samples was not compiled whole: over the memory, or it cannot win."""
    if _over(extrapolated, memory):
        assert memory is not None and extrapolated.peak_bytes is not None
        return Rejection(
            "memory",
            f"needs about {size_text(extrapolated.peak_bytes)} > {size_text(memory)} per device, "
            f"{extrapolated.source}",
            compiled=False,
        )
    return cannot_win_sampled(extrapolated, winner)


def cannot_win_sampled(extrapolated: Extrapolated, winner: str | None) -> Rejection:
    who = winner if winner is not None else "the candidates compiled whole"
    return Rejection(
        FROM_LAYERS, f"cannot beat {who}: {extrapolated.text()}, {extrapolated.source} (not compiled whole)"
    )
