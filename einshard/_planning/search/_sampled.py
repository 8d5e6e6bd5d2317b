"""Plans from a few layers: each candidate compiled at two small depths, those that could win whole.

A step of ``N`` repeated layers (:mod:`einshard._tracing._blocks`: an unrolled model's forward
pass, its backward pass in reverse, each layer's optimizer update) is compiled under each
candidate at :data:`DEPTHS` of its layers. Each layer adds the same equations, so the flops, each
kind of collective's bytes and the arguments are a line in the depth, exactly, and so is a step
time on CPU devices (communication plus compute, from those). What a target's compiler makes of
them is not: its kernels' time (fusion at a layer's edges: on a v5e, 79 % above the whole
compile's at 6 layers), the simulated step time, which overlaps collectives with compute more
the deeper the step (the 8 B ``model=2`` hybrid on 64 H100s: 576 ms extrapolated, 476 ms whole),
and the peak, which XLA's scheduler keeps under the memory (HSDP there: 92.1 GiB extrapolated,
under 79.1 GiB whole).

So a candidate is ranked only from a whole compile. The samples order the whole compiles (the
best extrapolated time first), and leave out a candidate only when what it needs at least, a line
in the depth, is slower than a whole compile's beyond the tie band (less :data:`SLACK`): on CPU
devices its time, without a bandwidth its bytes; on a target nothing is proven, and every
candidate is compiled whole. Memory is decided by whole compiles, as without samples.
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
    "DEPTHS",
    "FROM_LAYERS",
    "SLACK",
    "Extrapolated",
    "cannot_win_sampled",
    "compile_sampled",
    "layers_to_sample",
]

DEPTHS = (2, 3)
"""The depths each candidate is compiled at."""

SLACK = 0.005
"""How far below its extrapolation what a candidate needs at least is taken to be (rounding: a CPU
step's time was within 0.1 % of its whole compile's)."""


@dataclasses.dataclass(frozen=True)
class Extrapolated:
    """A candidate's figures at the step's depth, extrapolated from its compiles at two smaller ones.

    Attributes:
        measure: What would rank it: the step time with a bandwidth, else the bytes each device
            sends. On a target the simulated time is not linear in the depth (see the module):
            it only orders the whole compiles.
        least: What it needs at least, a line in the depth: the measure itself on CPU devices
            (communication plus compute) or without a bandwidth (bytes); 0 on a target.
        peak_bytes: The peak memory per device, as a line through the samples' (XLA's scheduler
            may keep the whole step's lower): shown, never decided on.
        depths: The two depths compiled.
        layers: The step's repeated layers (``N``).
        least_is: What :attr:`least` is, in words (``'its kernels alone'``).
    """

    measure: float
    least: float
    peak_bytes: int | None
    depths: tuple[int, int]
    layers: int
    least_is: str = "its step time"

    def least_text(self) -> str:
        """:attr:`least` as a time, or as bytes sent (ranked by bytes, without a bandwidth)."""
        return f"{size_text(self.least)} sent" if "bytes" in self.least_is else seconds_text(self.least)

    @property
    def source(self) -> str:
        """``'extrapolated from 2 and 3 of its 32 layers'``."""
        first, second = self.depths
        return f"extrapolated from {first} and {second} of its {self.layers} layers"


def layers_to_sample(call: Any, sample: bool, exhaustive: bool) -> tuple[int | None, str | None]:
    """How many repeated layers the plan samples, and the footer's line when it does not.

    ``None`` layers: each candidate is compiled whole; ``None`` line: nothing to say.
    """
    if not sample:
        return None, None
    if exhaustive:
        return (
            None,
            "Each candidate compiled whole: exhaustive=True compiles every one (sample=True skips none).",
        )
    found = repeated_layers(call)
    if isinstance(found, str):
        return None, f"Each candidate compiled whole: the step's layers cannot be sampled: {found}."
    return found.count, None


def _line(a: float | None, b: float | None, depths: tuple[int, int], layers: int) -> float | None:
    if a is None or b is None:
        return None
    k1, k2 = depths
    return a + (b - a) * (layers - k1) / (k2 - k1)


FiguresOf = Callable[[Any], "tuple[float, float, int | None, str] | None"]
"""A report's (measure, least, peak, what least is) at the plan's figures (see :class:`Extrapolated`)."""


def compile_sampled(
    call: Any,
    tables: Sequence[RulesLike],
    bounded: Sequence[Bounds | None],
    skip: Mapping[int, Rejection],
    where: Where,
    progress: Progress,
    figures_of: FiguresOf,
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
        (ma, la, pa, what), (mb, lb, pb, _) = figures  # type: ignore[misc]
        measure, least = _line(ma, mb, DEPTHS, layers), _line(la, lb, DEPTHS, layers)
        assert measure is not None and least is not None
        peak = _line(pa, pb, DEPTHS, layers)
        return Extrapolated(measure, least, None if peak is None else round(peak), DEPTHS, layers, what)

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
        # The most promising first: by the extrapolated time (or the bound, without samples).
        contenders = sorted(
            (extrapolated[i].measure if i in extrapolated else measures[i] or 0.0, i)
            for i in order
            if i not in answers and i not in compiling and i not in left
        )
        for _, i in contenders:
            sampled = extrapolated.get(i)
            least = sampled.least * (1 - SLACK) if sampled is not None else measures[i]
            if best is not None and least is not None and least > best * (1 + TIE):
                continue  # it cannot win: the caller's row says so
            if spent():
                for _, rest in contenders:
                    if rest not in answers and rest not in compiling:  # not proven: out of time
                        left[rest] = out_of_time(max_seconds or 0.0, bounded[rest])
                return None
            return i
        return None

    answers = reports(call, all_tables, where.child, where.compiled_for, choose, progress)
    whole = {i: answer for i, answer in answers.items() if i < count}
    samples = sum(1 for i in answers if i >= count)
    return whole, extrapolated, left, samples


def _usable(answer: Answer, figures_of: FiguresOf, memory: int | None) -> float | None:
    """A whole compile's measure, or ``None`` when it has none or is over the memory."""
    found = figures_of(answer.report) if answer.report is not None else None
    if found is None:
        return None
    measure, _, peak, _ = found
    return None if memory is not None and peak is not None and peak > memory else measure


def cannot_win_sampled(extrapolated: Extrapolated, winner: str | None) -> Rejection:
    """``cannot beat <winner>: at least X (its kernels alone, extrapolated from ...; not compiled whole)``."""
    who = winner if winner is not None else "the candidates compiled whole"
    return Rejection(
        FROM_LAYERS,
        f"cannot beat {who}: at least {extrapolated.least_text()} ({extrapolated.least_is}, "
        f"{extrapolated.source}; not compiled whole)",
    )
