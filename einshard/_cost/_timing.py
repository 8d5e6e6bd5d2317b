"""A simulated step time: the target's program walked in the order it runs.

The compiled program's text lists each computation's instructions in the order they run. The
walk goes through the entry computation (a ``while`` body its trip count times, a called
computation where it is called) and gives each kernel (a fusion, a library gemm, a copy, a sort
...) ``max(matrix flops / the rate of its element type, bytes read and written / the memory's
bandwidth)`` plus a launch floor. A collective costs its ring formula at its link (the report's
rows, with a latency per hop); an async one (``-start`` ... ``-done``) runs beside the kernels
scheduled between its start and its done, and costs only what they do not cover. One link per
device: collectives in flight at once queue on it.

What is assumed (``Hardware``'s figures, each with its source): the fraction of the matrix
units' peak a large gemm reaches, the fraction of the memory bandwidth a streaming kernel
reaches, the launch floor and the per-hop latencies. Checked on a GPU against three bf16 GPT
steps measured on one H200 (``tests/test_step_time.py``); no TPU time was measured.

CPU targets keep the estimate of flops at a given FLOP/s plus the collectives without overlap:
simulated CPU devices share one host's cores, and a schedule of them describes no hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from . import _hlo, _hlo_kernels

__all__ = [
    "Done",
    "KernelRun",
    "Loop",
    "Rates",
    "Schedule",
    "Start",
    "StepTime",
    "Sync",
    "schedule_of",
    "simulate",
]


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """One kernel of the schedule: its name, matrix flops and their type, bytes, source line."""

    name: str
    flops: float
    matmul: str
    bytes: int
    source: str | None


@dataclasses.dataclass(frozen=True)
class Start:
    """An async collective begins (``collective``: its instruction, as the report's rows name it)."""

    collective: str


@dataclasses.dataclass(frozen=True)
class Done:
    """The program waits for an async collective."""

    collective: str


@dataclasses.dataclass(frozen=True)
class Sync:
    """A collective the program waits for where it stands."""

    collective: str


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop body (``items``) run ``times`` times."""

    times: int
    items: tuple[Item, ...]


Item = KernelRun | Start | Done | Sync | Loop
Schedule = tuple[Item, ...]


def schedule_of(module: _hlo.Module) -> Schedule:
    """The program's kernels and collectives in the order they run."""
    return _walk(module, module.entry, frozenset())


def _walk(module: _hlo.Module, computation: str, seen: frozenset[str]) -> Schedule:
    if computation in seen:
        return ()
    seen = seen | {computation}
    items: list[Item] = []
    starts: dict[str, str] = {}  # an async start's name -> its collective's
    for instruction in module.computations.get(computation, ()):
        opcode = instruction.opcode
        if opcode in _hlo_kernels.FREE_OPCODES:
            continue
        collective = _hlo_kernels.async_collective(module, instruction)
        if collective is not None:
            starts[instruction.name] = collective.name
            items.append(Start(collective.name))
        elif _hlo_kernels.is_async_done(instruction):
            started = starts.get(instruction.operands[0]) if instruction.operands else None
            if started is not None:
                items.append(Done(started))
        elif opcode in _hlo.COLLECTIVES:
            items.append(Sync(instruction.name))
        elif opcode == "while":
            body = next((name for role, name in instruction.called if role == "body"), None)
            if body is not None:
                items.append(Loop(instruction.trip_count() or 1, _walk(module, body, seen)))
        elif opcode in ("call", "conditional"):
            # A conditional runs one branch: the longest is taken (by its kernels' count).
            branches = [_walk(module, name, seen) for _, name in instruction.called]
            if branches:
                items += max(branches, key=len)
        else:
            kernel = _hlo_kernels.kernel(module, instruction)
            _, file, line = module.source(instruction)
            source = f"{file}:{line}" if file is not None else None
            items.append(KernelRun(instruction.name, kernel.flops, kernel.matmul, kernel.bytes, source))
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the walk prices kernels at (from a target's figures).

    Attributes:
        matmul: Achieved FLOP/s of the matrix units per element type (``'bf16'``, ``'tf32'``, ...).
        fallback: The FLOP/s of a type the table does not have.
        memory: Achieved bytes per second between a device and its memory.
        launch: Seconds each kernel costs at least.
    """

    matmul: Mapping[str, float]
    fallback: float
    memory: float
    launch: float


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A simulated step.

    Attributes:
        seconds: The step's time.
        compute_seconds: The kernels' time.
        exposed_seconds: Communication the kernels do not cover (the step waits for it).
        hidden_seconds: Communication that runs while kernels do.
        kernels: The kernels that take the most time: ``(name, source, seconds over all runs)``.
    """

    seconds: float
    compute_seconds: float
    exposed_seconds: float
    hidden_seconds: float
    kernels: tuple[tuple[str, str | None, float], ...]


_TOP = 5


def simulate(schedule: Schedule, collectives: Mapping[str, float], rates: Rates) -> StepTime:
    """The step's time: the kernels in order, the collectives on one link beside them.

    ``collectives``: the seconds of one run of each collective, by its instruction's name.
    """
    by_kernel: dict[str, list] = {}
    clock, compute, exposed, communication = _run(schedule, collectives, rates, by_kernel, 1)
    top = sorted(by_kernel.items(), key=lambda item: -item[1][1])[:_TOP]
    return StepTime(
        seconds=clock,
        compute_seconds=compute,
        exposed_seconds=exposed,
        hidden_seconds=max(communication - exposed, 0.0),
        kernels=tuple((name, source, seconds) for name, (source, seconds) in top),
    )


def kernel_seconds(kernel: KernelRun, rates: Rates) -> float:
    """``max(matrix flops / its rate, bytes / memory bandwidth)`` plus the launch floor."""
    flops = kernel.flops / rates.matmul.get(kernel.matmul, rates.fallback) if kernel.flops else 0.0
    return max(flops, kernel.bytes / rates.memory) + rates.launch


def _run(
    items: Schedule,
    collectives: Mapping[str, float],
    rates: Rates,
    by_kernel: dict[str, list],
    times: int,
) -> tuple[float, float, float, float]:
    """One pass over ``items``: (its time, the kernels', the exposed communication, all of it)."""
    clock = compute = exposed = communication = 0.0
    link_free = 0.0  # when the link has sent what was started before
    finishes: dict[str, float] = {}
    for item in items:
        if isinstance(item, KernelRun):
            seconds = kernel_seconds(item, rates)
            clock += seconds
            compute += seconds
            entry = by_kernel.setdefault(item.name, [item.source, 0.0])
            entry[1] += seconds * times
        elif isinstance(item, Start):
            seconds = collectives.get(item.collective, 0.0)
            begin = max(clock, link_free)
            link_free = begin + seconds
            finishes[item.collective] = link_free
            communication += seconds
        elif isinstance(item, Done):
            finish = finishes.pop(item.collective, clock)
            if finish > clock:
                exposed += finish - clock
                clock = finish
        elif isinstance(item, Sync):
            seconds = collectives.get(item.collective, 0.0)
            begin = max(clock, link_free)
            link_free = begin + seconds
            exposed += link_free - clock
            clock = link_free
            communication += seconds
        else:
            inner = _run(item.items, collectives, rates, by_kernel, times * item.times)
            clock += inner[0] * item.times
            compute += inner[1] * item.times
            exposed += inner[2] * item.times
            communication += inner[3] * item.times
            link_free = max(link_free, clock)
    return clock, compute, exposed, communication
