"""Properties of the simulated step time over random schedules (``_timing.simulate``).

Each schedule is a random sequence of kernels, async collectives' starts and dones (paired or
not), sync collectives and loops (nested), at random rates. What must hold for every one:

* more link bandwidth, memory bandwidth or a faster matrix rate never makes the step slower;
* the step takes at least its kernels' time and at most its kernels' time plus every
  collective's;
* a loop runs as its body written out its trip count times (what one trip leaves in flight is
  in flight when the next begins); doubling a loop's trip count doubles the loop's time when no
  collective crosses from one trip to the next;
* exposed + hidden communication = all of it, each collective once per run.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from einshard._cost.hardware._timing import (
    Done,
    KernelRun,
    Loop,
    Rates,
    Start,
    Sync,
    kernel_seconds,
    simulate,
)

COLLECTIVES = ("c0", "c1", "c2", "c3")
TYPES = ("bf16", "f32", "tf32", "f8e4m3fn", "s8", "")

kernels = st.builds(
    KernelRun,
    name=st.sampled_from(("k0", "k1", "k2", "k3")),
    flops=st.one_of(st.just(0.0), st.floats(1e3, 1e13)),
    matmul=st.sampled_from(TYPES),
    bytes=st.integers(0, 10**10),
    source=st.none(),
)
collective_items = st.one_of(
    st.builds(Start, st.sampled_from(COLLECTIVES)),
    st.builds(Done, st.sampled_from(COLLECTIVES)),
    st.builds(Sync, st.sampled_from(COLLECTIVES)),
)


def _loops(children):
    return st.builds(Loop, times=st.integers(1, 6), items=st.lists(children, max_size=6).map(tuple))


items = st.recursive(st.one_of(kernels, collective_items), _loops, max_leaves=20)
schedules = st.lists(items, max_size=12).map(tuple)
durations = st.fixed_dictionaries({name: st.floats(0.0, 1e-2) for name in COLLECTIVES})
rates = st.builds(
    Rates,
    matmul=st.fixed_dictionaries(
        {kind: st.floats(1e12, 1e15) for kind in ("bf16", "f32", "tf32", "f8e4m3fn")}
    ),
    fallback=st.floats(1e12, 1e15),
    memory=st.floats(1e11, 1e13),
    launch=st.floats(0.0, 1e-5),
)
faster = st.floats(1.0, 10.0)

# One ulp here and there: the clock is a sum of many floats.
REL = 1e-9


def _kernels_and_communication(schedule, collectives, rates, times=1):
    """By hand: every kernel's seconds and every collective's, each times its loops' trips."""
    compute = communication = 0.0
    for item in schedule:
        if isinstance(item, KernelRun):
            compute += times * kernel_seconds(item, rates)
        elif isinstance(item, (Start, Sync)):
            communication += times * collectives[item.collective]
        elif isinstance(item, Loop):
            inner = _kernels_and_communication(item.items, collectives, rates, times * item.times)
            compute += inner[0]
            communication += inner[1]
    return compute, communication


@given(schedules, durations, rates, faster, faster, faster)
def test_more_bandwidth_or_a_faster_matrix_rate_never_makes_a_step_slower(
    schedule, collectives, base, link, memory, matmul
):
    before = simulate(schedule, collectives, base).seconds
    quicker = {name: seconds / link for name, seconds in collectives.items()}
    assert simulate(schedule, quicker, base).seconds <= before * (1 + REL)
    more_memory = dataclasses.replace(base, memory=base.memory * memory)
    assert simulate(schedule, collectives, more_memory).seconds <= before * (1 + REL)
    more_flops = dataclasses.replace(
        base,
        matmul={kind: rate * matmul for kind, rate in base.matmul.items()},
        fallback=base.fallback * matmul,
    )
    assert simulate(schedule, collectives, more_flops).seconds <= before * (1 + REL)


@given(schedules, durations, rates)
def test_a_step_takes_its_kernels_time_and_at_most_every_collective_s_more(schedule, collectives, at):
    time = simulate(schedule, collectives, at)
    compute, communication = _kernels_and_communication(schedule, collectives, at)
    assert time.compute_seconds == pytest.approx(compute, rel=REL, abs=1e-18)
    assert compute * (1 - REL) <= time.seconds <= (compute + communication) * (1 + REL) + 1e-18
    assert time.seconds == pytest.approx(time.compute_seconds + time.exposed_seconds, rel=REL, abs=1e-18)


@given(st.lists(items, max_size=8).map(tuple), st.integers(1, 50), durations, rates)
def test_doubling_a_loop_s_trip_count_doubles_its_time(body, trips, collectives, at):
    """Each trip waits at its end for what it started: no collective crosses into the next trip."""
    body = (*body, *(Done(name) for name in COLLECTIVES))
    once = simulate((Loop(trips, body),), collectives, at)
    twice = simulate((Loop(2 * trips, body),), collectives, at)
    assert twice.seconds == pytest.approx(2 * once.seconds, rel=REL, abs=1e-18)
    assert twice.compute_seconds == pytest.approx(2 * once.compute_seconds, rel=REL, abs=1e-18)
    assert twice.exposed_seconds == pytest.approx(2 * once.exposed_seconds, rel=REL, abs=1e-18)
    assert twice.hidden_seconds == pytest.approx(2 * once.hidden_seconds, rel=REL, abs=1e-18)


PIPELINED = (Done("c0"), Start("c0"), KernelRun("k0", 1e9, "bf16", 0, None))  # 1 ms of dots a trip
ROUND = Rates(matmul={"bf16": 1e12}, fallback=1e12, memory=1e12, launch=0.0)


@given(st.lists(items, max_size=8).map(tuple), st.integers(1, 8), schedules, durations, rates)
@example(PIPELINED, 4, (), {"c0": 3e-3, "c1": 0.0, "c2": 0.0, "c3": 0.0}, ROUND)  # 3 ms gathers
def test_a_loop_runs_as_its_body_written_out_its_trip_count_times(body, trips, after, collectives, at):
    """Collectives a trip leaves in flight (a pipelined loop's, or one queued on the link) are in
    flight when the next trip begins: the loop is its trips one after the other, then what follows."""
    looped = simulate((Loop(trips, body), *after), collectives, at)
    written = simulate(body * trips + after, collectives, at)
    for part in ("seconds", "compute_seconds", "exposed_seconds", "hidden_seconds"):
        # A picosecond: hidden is all of it less the exposed, each a sum of many floats.
        assert getattr(looped, part) == pytest.approx(getattr(written, part), rel=REL, abs=1e-12), part


@given(schedules, durations, rates)
def test_exposed_and_hidden_communication_add_up_to_all_of_it(schedule, collectives, at):
    time = simulate(schedule, collectives, at)
    _, communication = _kernels_and_communication(schedule, collectives, at)
    assert time.exposed_seconds >= 0 and time.hidden_seconds >= 0
    assert time.exposed_seconds + time.hidden_seconds == pytest.approx(communication, rel=REL, abs=1e-18)
