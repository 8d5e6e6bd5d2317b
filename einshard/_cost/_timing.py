"""A simulated step time: the target's program walked in the order it runs.

The compiled program's text lists each computation's instructions in the order they run. The
walk goes through the entry computation (a ``while`` body its trip count times, a called
computation where it is called, every branch of a conditional: how many times each runs is
:func:`~._hlo_loops.runs_per_call`'s one answer, which the program's flops follow too) and gives each
kernel (a fusion, an async fusion's start, a library gemm, a copy, a sort ...) ``max(matrix
flops / the rate of its element type, bytes read and written / the memory's bandwidth)`` plus a
launch floor. A kernel moves what it touches: an in-place update its update, a sliced read its
slice (:func:`~._hlo_kernels.kernel`), so a scanned layer's loop costs its layer per trip, not
its stack. A loop whose trip count XLA does not know is walked once, and the report names it
(:attr:`Loop.known`). A collective costs its ring formula at its link (the report's rows, with a
latency per hop); an async one (``-start`` ... ``-done``, or TPU's async collective fusions) runs
beside the kernels scheduled between its start and its done, and costs only what they do not
cover; one launched inside a fusion is on the schedule too. One link per device: collectives in
flight at once queue on it. Every row of the report is a collective of the schedule
(:func:`collectives_of`).

What is assumed (``Hardware``'s figures, each with its source): the fraction of the matrix
units' peak a large gemm reaches, the fraction of the memory bandwidth a streaming kernel
reaches, the launch floor and the per-hop latencies. Checked on a GPU against three bf16 GPT
steps measured on one H200 (``tests/test_step_time.py``); no TPU time was measured.

CPU targets keep the estimate of flops at a given FLOP/s plus the collectives without overlap:
simulated CPU devices share one host's cores, and a schedule of them describes no hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from . import _hlo, _hlo_kernels, _hlo_loops

__all__ = [
    "Done",
    "KernelRun",
    "Loop",
    "Rates",
    "Schedule",
    "Start",
    "StepTime",
    "Sync",
    "collectives_of",
    "schedule_of",
    "simulate",
    "unknown_loops",
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
    """A loop body (``items``) run ``times`` times.

    ``known``: whether XLA knows the trip count (when it does not, ``times`` is 1 and the report
    says so); ``name`` and ``source``: the ``while`` instruction and its source line.
    """

    times: int
    items: tuple[Item, ...]
    known: bool = True
    name: str = ""
    source: str | None = None


Item = KernelRun | Start | Done | Sync | Loop
Schedule = tuple[Item, ...]


def schedule_of(module: _hlo.Module) -> Schedule:
    """The program's kernels and collectives in the order they run."""
    heads: dict[tuple[str, str, str], str] = {}  # a chain of TPU copies -> the copy the rows name
    for collective in _hlo.collectives(module):
        key = _hlo.chain_key(collective.instruction)
        if key is not None:
            heads[key] = collective.instruction.name
    return _walk(module, module.entry, frozenset(), heads)


def _source(module: _hlo.Module, instruction: _hlo.Instruction) -> str | None:
    _, file, line = module.source(instruction)
    return f"{file}:{line}" if file is not None else None


def _walk(
    module: _hlo.Module, computation: str, seen: frozenset[str], heads: Mapping[tuple[str, str, str], str]
) -> Schedule:
    if computation in seen:
        return ()
    seen = seen | {computation}
    instructions = module.computations.get(computation, ())
    items: list[Item] = []
    starts: dict[str, str] = {}  # an async start's name -> its collective's
    chains = _chains(module, instructions, heads)
    for instruction in instructions:
        opcode = instruction.opcode
        if opcode in _hlo_kernels.FREE_OPCODES:
            continue
        collective = _hlo_kernels.async_collective(module, instruction)
        if collective is not None:
            starts[instruction.name] = collective.name
            items.append(Start(collective.name))
        elif _hlo_kernels.is_async_done(instruction):
            # The done of an async collective waits for it; an async fusion's or copy's done
            # waits for work its start was costed with.
            started = starts.get(instruction.operands[0]) if instruction.operands else None
            if started is not None:
                items.append(Done(started))
        elif opcode in _hlo.COLLECTIVES:
            items.append(Sync(instruction.name))
        elif opcode == "while":
            body = next((name for role, name in instruction.called if role == "body"), None)
            if body is not None:
                times, known = _hlo_loops.runs_per_call("body", module.trip_count(instruction))
                inner = _walk(module, body, seen, heads)
                items.append(Loop(times, inner, known, instruction.name, _source(module, instruction)))
        elif opcode in ("call", "conditional"):
            for role, name in instruction.called:
                times, known = _hlo_loops.runs_per_call(role, None)
                inner = _walk(module, name, seen, heads)
                items += inner if times == 1 else (Loop(times, inner, known, instruction.name),)
        elif instruction.name in chains:
            items += chains[instruction.name]
        else:
            items.append(_kernel_run(module, instruction))
    return tuple(items)


def _kernel_run(module: _hlo.Module, instruction: _hlo.Instruction) -> KernelRun:
    kernel = _hlo_kernels.kernel(module, instruction)
    source = _source(module, instruction)
    return KernelRun(instruction.name, kernel.flops, kernel.matmul, kernel.bytes, source)


def _chains(
    module: _hlo.Module, instructions: Sequence[_hlo.Instruction], heads: Mapping[tuple[str, str, str], str]
) -> dict[str, tuple[Item, ...]]:
    """What each fusion that runs a collective inside it is on the schedule, by its name.

    A collective copied over TPU's async collective fusions (:func:`~._hlo.chain_key`) starts
    at the fusion that starts it and is waited for at the one that ends it (their markers, else
    the first and last fusion of its chain here); the fusions between are kernels that run
    beside it. Named as the report's row names it (``heads``: its first copy in the text). A
    collective fused with other work and no chain (an all-reduce and its slice) is waited for
    where it stands, beside the fusion's matrix work if it has any.
    """
    fused: list[tuple[_hlo.Instruction, _hlo.Instruction]] = []
    for instruction in instructions:
        collective = _hlo_kernels.fused_collective(module, instruction)
        if collective is not None:
            fused.append((instruction, collective))
    if not fused:
        return {}
    members: dict[tuple[str, str, str], list[str]] = {}
    for instruction, collective in fused:
        key = _hlo.chain_key(collective)
        if key is not None:
            members.setdefault(key, []).append(instruction.name)
    out: dict[str, tuple[Item, ...]] = {}
    for instruction, collective in fused:
        key = _hlo.chain_key(collective)
        run = _kernel_run(module, instruction)
        work: tuple[Item, ...] = (run,) if run.flops else ()
        if key is None:
            out[instruction.name] = (*work, Sync(collective.name))
            continue
        head = heads.get(key, collective.name)
        chain = members[key]
        role = _hlo_kernels.chain_role(module, instruction)
        if role is None and len(chain) > 1:  # no markers: the chain's first and last fusion here
            role = {chain[0]: "start", chain[-1]: "done"}.get(instruction.name)
        if len(chain) == 1 and role is None:
            out[instruction.name] = (*work, Sync(head))
        elif role == "start":
            out[instruction.name] = (Start(head), *work)
        elif role == "done":
            out[instruction.name] = (*work, Done(head))
        else:
            out[instruction.name] = (run,)
    return out


def collectives_of(schedule: Schedule) -> set[str]:
    """The collectives a schedule runs (started or waited for where they stand), by name."""
    names: set[str] = set()
    for item in schedule:
        if isinstance(item, (Start, Sync)):
            names.add(item.collective)
        elif isinstance(item, Loop):
            names |= collectives_of(item.items)
    return names


def unknown_loops(schedule: Schedule) -> tuple[str, ...]:
    """The loops whose trip count XLA does not know, each walked once: ``'while.3 (model.py:12)'``."""
    found: list[str] = []
    for item in schedule:
        if isinstance(item, Loop):
            if not item.known:
                found.append(item.name + (f" ({item.source})" if item.source else ""))
            found += unknown_loops(item.items)
    return tuple(dict.fromkeys(found))


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
