"""A simulated step time: the target's program walked in the order it runs.

The compiled program's text lists each computation's instructions in the order they run. The walk
goes through the entry computation (a ``while`` body its trip count times, a called computation
where it is called, every branch of a conditional: how many times each runs is
:func:`~einshard._cost.xla._hlo_loops.runs_per_call`'s one answer, which the program's flops follow
too) and gives each kernel (a fusion, an async fusion's start, a library gemm, a copy, a sort ...)
``max(matrix flops / the rate of its element type, bytes read and written / the memory's
bandwidth)`` plus a launch floor. A kernel moves what it touches: an in-place update its update, a
sliced read its slice (:func:`~einshard._cost.xla._hlo_kernels.kernel`), so a scanned layer's loop
costs its layer per trip, not its stack. A loop whose trip count XLA does not know is walked once,
and the report names it (:attr:`Loop.known`). A collective costs its ring formula at its link (the
report's rows, with a latency per hop); an async one (``-start`` ... ``-done``, or TPU's async
collective fusions) runs beside the kernels scheduled between its start and its done, and costs only
what they do not cover; one launched inside a fusion is on the schedule too. One link per device:
collectives in flight at once queue on it. Every row of the report is a collective of the schedule
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

from ..xla import _collectives, _hlo, _hlo_kernels, _hlo_loops

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
class _CollectiveEvent:
    """What the schedule says of one collective (``collective``: its instruction, as the rows name it).

    Its kinds are its subclasses, which compare unequal to each other (a dataclass's ``==``
    checks the class).
    """

    collective: str


class Start(_CollectiveEvent):
    """An async collective begins."""


class Done(_CollectiveEvent):
    """The program waits for an async collective."""


class Sync(_CollectiveEvent):
    """A collective the program waits for where it stands."""


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
    for collective in _collectives.collectives(module):
        key = _collectives.chain_key(collective.instruction)
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
    carried = _carried_starts(module, instructions)
    chains = _chains(module, instructions, heads)
    # A megascale transfer between TPU slices starts at its send and is waited for where its
    # recv's data is (the recv's done); the recv and the send's done move nothing more.
    received = _collectives.megascale_receiver(instructions)
    for instruction in instructions:
        opcode = instruction.opcode
        if opcode in _hlo_kernels.FREE_OPCODES:
            continue
        if opcode == "send" and _collectives.megascale(instruction) is not None:
            items.append(Start(instruction.name))
            continue
        if opcode == "send-done" or (opcode == "recv" and instruction.name in received):
            continue
        if opcode == "recv-done" and instruction.operands and instruction.operands[0] in received:
            items.append(Done(received[instruction.operands[0]]))
            continue
        collective = _hlo_kernels.async_collective(module, instruction)
        if collective is not None:
            starts[instruction.name] = collective.name
            items.append(Start(collective.name))
        elif _hlo_kernels.is_async_done(instruction):
            # The done of an async collective waits for it; an async fusion's or copy's done
            # waits for work its start was costed with.
            operand = instruction.operands[0] if instruction.operands else None
            started = starts.get(operand) or carried.get(operand) if operand is not None else None
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


def _carried_starts(module: _hlo.Module, instructions: Sequence[_hlo.Instruction]) -> dict[str, str]:
    """A loop body's values that are an async collective started on the trip before, by name.

    XLA's collective pipeliner starts a collective at the end of one trip and waits for it on
    the next: the body's result tuple carries the start, and the next trip reads it back from
    the body's parameter (``get-tuple-element(p), index=k``) to wait for it. Such a value stands
    for its collective (as the walk names it).
    """
    root = next((instruction for instruction in instructions if instruction.root), None)
    if root is None or root.opcode != "tuple":
        return {}
    by_name = {instruction.name: instruction for instruction in instructions}
    started: dict[int, str] = {}
    for position, operand in enumerate(root.operands):
        value = by_name.get(operand)
        collective = _hlo_kernels.async_collective(module, value) if value is not None else None
        if collective is not None:
            started[position] = collective.name
    if not started:
        return {}
    out: dict[str, str] = {}
    for instruction in instructions:
        if instruction.opcode != "get-tuple-element" or not instruction.operands:
            continue
        source = by_name.get(instruction.operands[0])
        if source is not None and source.opcode == "parameter" and instruction.index in started:
            out[instruction.name] = started[instruction.index]
    return out


def _kernel_run(module: _hlo.Module, instruction: _hlo.Instruction) -> KernelRun:
    kernel = _hlo_kernels.kernel(module, instruction)
    source = _source(module, instruction)
    return KernelRun(instruction.name, kernel.flops, kernel.matmul, kernel.bytes, source)


def _chains(
    module: _hlo.Module, instructions: Sequence[_hlo.Instruction], heads: Mapping[tuple[str, str, str], str]
) -> dict[str, tuple[Item, ...]]:
    """What each fusion that runs a collective inside it is on the schedule, by its name.

    A collective copied over TPU's async collective fusions
    (:func:`~einshard._cost.xla._collectives.chain_key`) starts at the fusion that starts it and
    is waited for at the one that ends it (their markers, else the first and last fusion of its
    chain here); the fusions between are kernels that run
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
        key = _collectives.chain_key(collective)
        if key is not None:
            members.setdefault(key, []).append(instruction.name)
    out: dict[str, tuple[Item, ...]] = {}
    for instruction, collective in fused:
        key = _collectives.chain_key(collective)
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

    ``collectives``: the seconds of one run of each collective, by its instruction's name. A
    collective still in flight when the program's last kernel ends is waited for: the step
    ends when its last collective does.
    """
    by_kernel: dict[str, list] = {}
    run = _run(schedule, collectives, rates, by_kernel, 1, {}, 0.0)
    end = max([run.clock, *run.finishes.values()])
    top = sorted(by_kernel.items(), key=lambda item: -item[1][1])[:_TOP]
    exposed = run.exposed + end - run.clock
    return StepTime(
        seconds=end,
        compute_seconds=run.compute,
        exposed_seconds=exposed,
        hidden_seconds=max(run.communication - exposed, 0.0),
        kernels=tuple((name, source, seconds) for name, (source, seconds) in top),
    )


def kernel_seconds(kernel: KernelRun, rates: Rates) -> float:
    """``max(matrix flops / its rate, bytes / memory bandwidth)`` plus the launch floor."""
    flops = kernel.flops / rates.matmul.get(kernel.matmul, rates.fallback) if kernel.flops else 0.0
    return max(flops, kernel.bytes / rates.memory) + rates.launch


@dataclasses.dataclass
class _Pass:
    """One pass over a list of items, its times from the pass's own start.

    ``finishes``: when each collective started and not yet waited for finishes (those of the
    pass before it that are still in flight included); ``link_free``: when the link has sent
    what was started.
    """

    clock: float = 0.0
    compute: float = 0.0
    exposed: float = 0.0
    communication: float = 0.0
    link_free: float = 0.0
    finishes: dict[str, float] = dataclasses.field(default_factory=dict)


def _run(
    items: Schedule,
    collectives: Mapping[str, float],
    rates: Rates,
    by_kernel: dict[str, list],
    times: int,
    finishes: Mapping[str, float],
    link_free: float,
) -> _Pass:
    """One pass over ``items``, with the collectives in flight when it starts (``finishes``, from its start).

    ``times``: how many times the pass runs per step (what each kernel adds to ``by_kernel``).
    """
    run = _Pass(link_free=max(link_free, 0.0), finishes=dict(finishes))
    for item in items:
        if isinstance(item, KernelRun):
            seconds = kernel_seconds(item, rates)
            run.clock += seconds
            run.compute += seconds
            entry = by_kernel.setdefault(item.name, [item.source, 0.0])
            entry[1] += seconds * times
        elif isinstance(item, Start):
            seconds = collectives.get(item.collective, 0.0)
            begin = max(run.clock, run.link_free)
            run.link_free = begin + seconds
            run.finishes[item.collective] = run.link_free
            run.communication += seconds
        elif isinstance(item, Done):
            finish = run.finishes.pop(item.collective, run.clock)
            if finish > run.clock:
                run.exposed += finish - run.clock
                run.clock = finish
        elif isinstance(item, Sync):
            seconds = collectives.get(item.collective, 0.0)
            begin = max(run.clock, run.link_free)
            run.link_free = begin + seconds
            run.exposed += run.link_free - run.clock
            run.clock = run.link_free
            run.communication += seconds
        else:
            _loop(run, item, collectives, rates, by_kernel, times)
    return run


_MAX_TRIPS_WALKED = 64
"""A loop whose trips still differ after this many is taken to run every later trip as the last walked."""


def _loop(
    run: _Pass,
    loop: Loop,
    collectives: Mapping[str, float],
    rates: Rates,
    by_kernel: dict[str, list],
    times: int,
) -> None:
    """A loop's trips added to ``run``, walked until a trip begins as the one before it did.

    A collective a trip starts and the next waits for (XLA's pipelined collectives,
    :func:`_carried_starts`) is in flight when the next trip begins, on the same link, and so
    is one queued behind collectives started before the loop: each trip begins with what the
    one before left in flight. Once a trip begins as the one before it, every later trip runs
    as it does. What the last trip leaves in flight goes on beside what follows the loop;
    collectives in flight before the loop go on beside it.
    """
    if loop.times <= 0:
        return  # a loop whose counter starts past its limit runs no trip
    now = run.clock
    before = {name: finish - now for name, finish in run.finishes.items()}
    own = collectives_of(loop.items)
    trips: list[tuple[_Pass, int]] = []
    state = (before, max(run.link_free - now, 0.0))
    left = loop.times
    while left > 0:
        in_flight, link = state
        # Every trip runs the same kernels: the first counts them for all of the loop's runs.
        counted, weight = (by_kernel, times * loop.times) if not trips else ({}, 0)
        trip = _run(loop.items, collectives, rates, counted, weight, in_flight, link)
        after = (
            {
                name: finish - trip.clock
                for name, finish in trip.finishes.items()
                if name in own and finish > trip.clock  # still in flight when the trip ends
            },
            max(trip.link_free - trip.clock, 0.0),
        )
        steady = _same_state(after, state) or len(trips) + 1 >= _MAX_TRIPS_WALKED
        count = left if steady else 1
        trips.append((trip, count))
        left -= count
        state = after
    for trip, count in trips:
        run.compute += trip.compute * count
        run.exposed += trip.exposed * count
        run.communication += trip.communication * count
    last = trips[-1][0]
    end = now + sum(trip.clock * count for trip, count in trips)
    offset = end - last.clock  # when the last trip began
    run.finishes = {name: now + finish for name, finish in before.items() if name not in own}
    run.finishes.update(
        {
            name: offset + finish
            for name, finish in last.finishes.items()
            if name in own and finish > last.clock
        }
    )
    if last.link_free > last.clock:  # the link is still sending when the loop ends
        run.link_free = max(run.link_free, offset + last.link_free)
    run.clock = end


def _same_state(a: tuple[dict[str, float], float], b: tuple[dict[str, float], float]) -> bool:
    """Whether two trips begin alike: the same collectives in flight, finishing at the same offsets."""
    (flight_a, link_a), (flight_b, link_b) = a, b
    close = lambda x, y: abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1e-9)  # noqa: E731
    return (
        flight_a.keys() == flight_b.keys()
        and all(close(flight_a[name], flight_b[name]) for name in flight_a)
        and close(link_a, link_b)
    )
