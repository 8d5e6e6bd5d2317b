"""Planted bugs: each one line of the package changed, and the tests run on it. Are they caught?

Every mutant below is a one-line bug in code added since einshard 0.2.0 (the step report, the
planner, the strategies, the shared mesh, ``shardings_of``, multi-process agreement, the optax
derivations, the tensor-parallel roles read from the step's dataflow and the tables derived from
them, the planner's split share, the simulated step time, the kernels' costs and the plan's
memory bound). For each, this script copies the repository to a temporary
directory once, writes the mutated module there, runs that mutant's test files at 8 simulated
devices (the whole suite with ``--full``) and restores the module. A mutant is **caught** when
at least 3 tests, in at least 2 test functions (parametrizations of one function count as one
function), fail on it and passed unmutated.

Each mutant is located by an anchor: its module's path and an exact snippet of source text,
which must occur exactly once there. Code moves (other branches rename and split modules): a
snippet that is not found exactly once is an error naming every file of the package where it
does occur, so the entry can be fixed by hand; ``--check`` checks every anchor without running
anything.

A run stops as soon as the mutant is caught (3 failed tests in 2 functions: the count is exact,
not "stopped at the third failure"); ``--all-failures`` runs the files to the end. At the end,
every test function that failed on some mutant runs once more, unmutated: a test that fails
there too is not counted (``--baseline`` instead runs every selected file unmutated first), and
a mutant whose run such a test stopped short is run again with the tests that fail unmutated
left out. The
mutants of the shared mesh are also run through ``tests/test_meet.py`` at 6 and 12 devices, to
the end, and every failing test is listed (``--no-meet`` skips that).

Usage (``nox -s mutants -- ARGS`` does the same in its own environment)::

    python tools/mutants.py                 # every mutant, its own test files, 8 devices
    python tools/mutants.py --full          # every mutant, the whole suite (and the doctests)
    python tools/mutants.py --only fsdp-smallest-axis planner-sort-negated
    python tools/mutants.py --list | --check
    python tools/mutants.py --markdown mutants.md   # the table, for a note

Exit status: 0 when every mutant selected is caught, 1 when one is not, 2 when an anchor fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "einshard"
CAUGHT_TESTS, CAUGHT_FUNCTIONS = 3, 2
TIMEOUT = 1800  # seconds for one run of pytest


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One planted bug.

    Attributes:
        name: A short name, for ``--only`` and the table.
        module: The file it changes, from the repository root.
        before: Source text found exactly once in ``module`` (part of a line, or lines).
        after: What replaces it: the bug.
        tests: The test files (or node ids) run on it; the whole suite with ``--full``.
        what: The bug in words.
        meet: Also list what fails in tests/test_meet.py at 6 and 12 devices.
    """

    name: str
    module: str
    before: str
    after: str
    tests: tuple[str, ...]
    what: str
    meet: bool = False


REPORT = "einshard/_cost/report/_report.py"
ATTRIBUTION = "einshard/_cost/reading/_attribution.py"
LINKS = "einshard/_cost/hardware/_links.py"
PLANNER = "einshard/_planning/search/_planner.py"
CANDIDATES = "einshard/_planning/search/_candidates.py"
STRATEGIES = "einshard/_planning/tables/_strategies.py"
STRATEGY = "einshard/_trees/_strategy.py"
MESH = "einshard/_sharding/_mesh.py"
VOLUMES = ("tests/test_volumes.py", "tests/test_step.py")
LINK_TESTS = "tests/test_links.py"
PLANNING = ("tests/test_planner.py",)
MEET = ("tests/test_meet.py", "tests/test_arrays.py")
OPTAX = ("tests/test_optax.py", "tests/test_optax_layouts.py", "tests/test_report_bytes.py")

MUTANTS = [
    # --- the step report's ring volumes and estimate ---
    Mutant(
        "ring-all-gather-doubled",
        LINKS,
        '    "all-gather": (lambda n: (n - 1) / n, lambda n: n - 1),',
        '    "all-gather": (lambda n: 2 * (n - 1) / n, lambda n: n - 1),',
        VOLUMES,
        "all-gather ring volume 2(N-1)/N instead of (N-1)/N",
    ),
    Mutant(
        "ring-all-reduce-halved",
        LINKS,
        '    "all-reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),',
        '    "all-reduce": (lambda n: (n - 1) / n, lambda n: 2 * (n - 1)),',
        VOLUMES,
        "all-reduce ring volume (N-1)/N instead of 2(N-1)/N",
    ),
    Mutant(
        "ring-reduce-scatter-doubled",
        LINKS,
        '    "reduce-scatter": (lambda n: (n - 1) / n, lambda n: n - 1),',
        '    "reduce-scatter": (lambda n: 2 * (n - 1) / n, lambda n: n - 1),',
        VOLUMES,
        "reduce-scatter ring volume 2(N-1)/N instead of (N-1)/N",
    ),
    Mutant(
        "ring-all-to-all-whole",
        LINKS,
        '    "all-to-all": (lambda n: (n - 1) / n, lambda n: n - 1),',
        '    "all-to-all": (lambda n: 1.0, lambda n: n - 1),',
        VOLUMES,
        "all-to-all sends its whole buffer instead of (N-1)/N of it",
    ),
    Mutant(
        "ring-permute-fraction",
        LINKS,
        '    "collective-permute": (lambda n: 1.0, lambda n: 1),',
        '    "collective-permute": (lambda n: (n - 1) / n, lambda n: 1),',
        VOLUMES,
        "collective-permute sends (N-1)/N of its buffer instead of all of it",
    ),
    Mutant(
        "loop-trip-count-ignored",
        ATTRIBUTION,
        "                    traffic=round(fraction * shape.bytes) * collective.times,",
        "                    traffic=round(fraction * shape.bytes),",
        VOLUMES,
        "a collective in a loop sends its bytes once, not once per trip",
    ),
    Mutant(
        "combined-run-per-array",
        REPORT,
        "            seconds = per_run[row.instruction] * share * row.times",
        "            seconds = per_run[row.instruction] * row.times",
        (*VOLUMES, LINK_TESTS),
        "each array of a combined collective costs the whole run, not its share by bytes",
    ),
    # --- the links: a collective across GPU hosts ---
    Mutant(
        "links-one-nic-per-group",
        LINKS,
        "        return min(g * self.share, self.nvlink * g / (g - 1)) if g > 1 else self.share",
        "        return min(self.share, self.nvlink * g / (g - 1)) if g > 1 else self.share",
        (LINK_TESTS,),
        "a group across hosts runs at one NIC, not at its g devices' NICs",
    ),
    Mutant(
        "links-most-populated-host",
        LINKS,
        "    return min(counts.values(), default=0), len(counts)",
        "    return max(counts.values(), default=0), len(counts)",
        (LINK_TESTS,),
        "a group spread unevenly runs at its most-populated host, not its least",
    ),
    Mutant(
        "links-latency-all-between",
        LINKS,
        "        return between * self.network_latency + (steps - between) * self.latency",
        "        return steps * self.network_latency",
        (LINK_TESTS,),
        "every ring step of a collective across hosts pays the network's latency",
    ),
    Mutant(
        "links-all-to-all-on-rails",
        LINKS,
        '        if kind == "all-to-all":',
        '        if kind == "all-to-all" and g == 1:',
        (LINK_TESTS,),
        "an all-to-all across hosts uses the rails as a ring does",
    ),
    # --- the planner's ranking ---
    Mutant(
        "planner-sort-negated",
        PLANNER,
        "        return (measure(row), row.traffic or 0, row.peak_bytes or 0, row.index)",
        "        return (-measure(row), row.traffic or 0, row.peak_bytes or 0, row.index)",
        PLANNING,
        "the planner ranks the slowest candidate first (sort key negated)",
    ),
    Mutant(
        "planner-tie-to-the-later",
        CANDIDATES,
        "        pick = min(near, key=index)",
        "        pick = max(near, key=index)",
        PLANNING,
        "estimates within the margin go to the candidate given later",
    ),
    Mutant(
        "planner-no-tie-margin",
        CANDIDATES,
        "            near = [row for row in left if measure(row) <= best * (1 + TIE)]",
        "            near = [row for row in left if measure(row) <= best]",
        PLANNING,
        "no tie margin: the fastest by any amount wins",
    ),
    Mutant(
        "planner-memory-at-the-limit",
        PLANNER,
        "            and report.peak_bytes > memory_per_device",
        "            and report.peak_bytes >= memory_per_device",
        PLANNING,
        "a candidate whose peak equals the memory limit is rejected",
    ),
    Mutant(
        "planner-time-without-compute",
        "einshard/_cost/report/_report.py",
        "        known = [p for p in (self.communication_seconds, self.compute_seconds) if p is not None]",
        "        known = [p for p in (self.communication_seconds,) if p is not None]",
        PLANNING,
        "a candidate's estimated time leaves out its compute",
    ),
    # --- strategies ---
    Mutant(
        "fsdp-smallest-axis",
        STRATEGY,
        "        order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))",
        "        order = sorted(range(len(shape)), key=lambda i: (shape[i], i))",
        ("tests/test_strategies.py",),
        "FSDP splits the smallest divisible axis instead of the largest",
    ),
    Mutant(
        "fsdp-min-bytes-inverted",
        STRATEGY,
        "        if size < self.min_bytes:",
        "        if size > self.min_bytes:",
        ("tests/test_strategies.py",),
        "FSDP's min_bytes comparison inverted",
    ),
    Mutant(
        "fsdp-ties-to-the-last",
        STRATEGY,
        "        order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))",
        "        order = sorted(range(len(shape)), key=lambda i: (-shape[i], -i))",
        ("tests/test_strategies.py",),
        "FSDP splits the last of equally long axes, not the first",
    ),
    Mutant(
        "tensor-parallel-column-splits-input",
        STRATEGIES,
        '        (_layer_regex(column, "kernel"), f"... i o -> ... i{rest} o{split}"),',
        '        (_layer_regex(column, "kernel"), f"... i o -> ... i{split} o{rest}"),',
        ("tests/test_strategies.py", "tests/test_planner.py"),
        "a column-parallel kernel is split on its input axis",
    ),
    # --- the shared mesh ---
    Mutant(
        "mesh-largest-prime-first",
        MESH,
        "    return prime_factors(n_devices) or (1,)",
        "    return tuple(reversed(prime_factors(n_devices))) or (1,)",
        MEET,
        "the shared mesh's prime factors largest first",
        meet=True,
    ),
    Mutant(
        "mesh-runs-reversed",
        MESH,
        "        runs.append(tuple(run))",
        "        runs.append(tuple(reversed(run)))",
        MEET,
        "run matching: a count's run of mesh axes taken in reverse order",
        meet=True,
    ),
    Mutant(
        "ambient-run-truncated",
        MESH,
        "            run = runs[axis]\n            spec.append(run[0] if len(run) == 1 else run)",
        "            run = runs[axis]\n            spec.append(run[0])",
        MEET,
        "under an ambient mesh, a count spanning several axes gets only the first",
        meet=True,
    ),
    # --- shardings_of ---
    Mutant(
        "shardings-of-none",
        "einshard/_arrays/_leaves.py",
        "    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):\n        return leaf.sharding",
        "    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):\n        return None",
        ("tests/test_training_steps.py",),
        "the sharding a placed array carries is read as None (shardings_of, optax state)",
    ),
    # --- multi-process agreement ---
    Mutant(
        "agreement-descriptions-unchecked",
        "einshard/_arrays/_agreement.py",
        "    _compare_descriptions(what, views, me)",
        "    pass  # the descriptions are never compared",
        ("tests/test_multihost.py",),
        "multi-process agreement: the descriptions are never compared",
    ),
    Mutant(
        "agreement-blocks-unchecked",
        "einshard/_arrays/_agreement.py",
        "        _compare_blocks(what, views, me)",
        "        pass  # the blocks' values are never compared",
        ("tests/test_multihost.py",),
        "multi-process agreement: check_values=True compares nothing",
    ),
    # --- the optax derivations ---
    Mutant(
        "optax-subtree-copy-unrecognised",
        "einshard/integrations/_optax_state.py",
        "or self._by_prefix(node) or self._as_part(treedef, leaves, path)",
        "or self._by_prefix(node)",
        OPTAX,
        "optax: a copy of a subtree of the params (lookahead's fast state) never recognised",
    ),
    Mutant(
        "optax-adafactor-rows-and-columns-swapped",
        "einshard/integrations/_optax_state.py",
        '        exact = int(order[-1] if field == "v_row" else order[-2])',
        '        exact = int(order[-2] if field == "v_row" else order[-1])',
        OPTAX,
        "optax: Adafactor's v_row taken as reducing v_col's axis and the other way round",
    ),
    Mutant(
        "optax-stacked-history-unrecognised",
        "einshard/integrations/_optax_state.py",
        "    if n > rank and shape[n - rank :] == target:  # extra leading axes, such as a history",
        "    if n > rank and shape[: rank] == target:  # extra leading axes, such as a history",
        OPTAX,
        "optax: leading axes (L-BFGS's history) matched at the wrong end",
    ),
]

# --- the tensor-parallel roles read from the step's dataflow, the tables derived from them, and the
# planner's split share ---
JAXPR = "einshard/_tracing/_parameter_axes.py"
ROLES = "einshard/_planning/tables/_roles.py"
DERIVED = "einshard/_planning/tables/_derived.py"
READING = ("tests/test_roles.py", "tests/test_strategies.py")
DATAFLOW_ROLES = [
    Mutant(
        "roles-contraction-read-as-free",
        JAXPR,
        '            self.mark(mine, "contraction")',
        '            self.mark(mine, "free")',
        READING,
        "dot_general: a weight's contraction axes taken for free (output) axes",
    ),
    Mutant(
        "roles-transpose-not-followed",
        JAXPR,
        'tuple(value.axes[i] for i in eqn.params["permutation"])',
        "value.axes",
        READING,
        "transpose: the axes' tags stay in place instead of following the permutation",
    ),
    Mutant(
        "roles-scan-stacked-axis-offset",
        JAXPR,
        "            slices.append(Value(value.kind, value.axes[1:], value.leaves))",
        "            slices.append(Value(value.kind, value.axes[:-1], value.leaves))",
        READING,
        "scan: a stacked weight's slice loses its last axis's tags, not its (stacked) first",
    ),
    Mutant(
        "roles-column-row-pair-unrecorded",
        JAXPR,
        "            for row, _, _ in rows:\n"
        "                if self.node_leaf[column] != self.node_leaf[row]:\n"
        "                    self.feeds.add((column, row))",
        "            for row, _, _ in rows:\n"
        "                if self.node_leaf[column] != self.node_leaf[row]:\n"
        "                    pass",
        READING,
        "dot_general: a column's output reaching a row's contraction is not recorded as a pair",
    ),
    Mutant(
        "roles-split-not-a-divisor",
        ROLES,
        "    return math.gcd(model, limit) if limit > 0 else 1",
        "    return min(model, limit) if limit > 0 else 1",
        READING,
        "split what divides, copy the rest: min(model, heads) ways instead of the largest divisor",
    ),
    Mutant(
        "rules-regex-start-anchor-dropped",
        DERIVED,
        '    return "(^|/)" + "/".join(pieces) + "$"',
        '    return "/".join(pieces) + "$"',
        READING,
        "a derived rule's regex without (^|/): 'a$' also matches the leaf 'ba'",
    ),
    Mutant(
        "rules-regex-end-anchor-dropped",
        DERIVED,
        '    return "(^|/)" + "/".join(pieces) + "$"',
        '    return "(^|/)" + "/".join(pieces)',
        READING,
        "a derived rule's regex without $: '(^|/)a' also matches the leaf 'ab'",
    ),
    Mutant(
        "hybrid-model-axis-major",
        DERIVED,
        "    return f\"{left} -> {' '.join([*rest, first, split, *copies])}\"",
        "    return f\"{left} -> {' '.join([*rest, split, first, *copies])}\"",
        READING + PLANNING,
        "a derived hybrid puts the model axis before the data axis: a model group is not neighbours",
    ),
    Mutant(
        "split-share-threshold-inverted",
        PLANNER,
        "            and self.split_share < SPLIT_ENOUGH",
        "            and self.split_share >= SPLIT_ENOUGH",
        PLANNING,
        "the planner says 'splits only N%' of the candidates that split enough, not of those that do not",
    ),
    Mutant(
        "split-share-counts-the-data-axis",
        PLANNER,
        "                and (strategy.model is None or len({block[axis] for block in across}) == 1)",
        "",
        PLANNING,
        "the split share counts a weight split over every device (the data axis too) as model-split",
    ),
]

PRIMITIVES = ("tests/test_reading.py", "tests/test_primitives.py")
DATAFLOW_ROLES += [
    Mutant(
        "roles-stack-axis-misplaced",
        JAXPR,
        "grown = [Value(v.kind, (*v.axes[:axis], EMPTY, *v.axes[axis:]), v.leaves) for v in ins]",
        "grown = [Value(v.kind, (EMPTY, *v.axes), v.leaves) for v in ins]",
        PRIMITIVES,
        "stack: the new axis put first, not where stack puts it (GPT-J's rotary stacks along the last)",
    ),
    Mutant(
        "roles-first-break-blamed",
        JAXPR,
        "            if node not in self.why or bound < self.bound[node]:",
        "            if node not in self.why:",
        PRIMITIVES,
        "a weight's note names the first break met, not the one that stopped its split",
    ),
    Mutant(
        "roles-stops-guessed-at",
        JAXPR,
        "        if name in STOPS:",
        "        if name in ():",
        PRIMITIVES,
        "the listed stops are not honoured: a callback or a factorization of one shape read as elementwise",
    ),
]

# --- the findings and the loop reading: what would make a finding's bytes wrong ---
DETECT_REDUCTIONS = "einshard/_cost/findings/_detect_reductions.py"
DETECT_LAYOUTS = "einshard/_cost/findings/_detect_layouts.py"
HLO = "einshard/_cost/xla/_hlo.py"
FINDINGS = ("tests/test_findings.py", "tests/test_finding_fixes.py", "tests/test_finding_properties.py")
FINDING_MUTANTS = [
    Mutant(
        "repeated-counts-the-kept-reduction",
        DETECT_REDUCTIONS,
        "wasted = rows_traffic(rows, [p for p in positions if p != keep])",
        "wasted = rows_traffic(rows, positions)",
        FINDINGS,
        "a repeated finding's waste also counts the reduction that is kept",
    ),
    Mutant(
        "unsummed-keeps-none",
        DETECT_REDUCTIONS,
        "for p in sorted(group, key=lambda q: rows[q].traffic)[:-1]]",
        "for p in sorted(group, key=lambda q: rows[q].traffic)]",
        FINDINGS,
        "unsummed counts every partial sum, with none kept",
    ),
    Mutant(
        "copied-memory-is-the-shard",
        DETECT_LAYOUTS,
        "held = sum(_assignment_bytes(leaf) - _assignment_bytes(leaf) // ways for leaf in chosen)",
        "held = sum(_assignment_bytes(leaf) // ways for leaf in chosen)",
        FINDINGS,
        "copied memory is the shard, not the excess held",
    ),
    Mutant(
        "loop-users-read-in-the-entry",
        "einshard/_cost/reading/_flow.py",
        "            body = start[0].computation\n            users = self.users_in(body)",
        "            body = start[0].computation\n            users = self.users_in(self.module.entry)",
        (*FINDINGS, "tests/test_step.py"),
        "a loop body's users are looked up in the entry computation",
    ),
    Mutant(
        "nested-trip-count-not-multiplied",
        HLO,
        "                total += n * factor",
        "                total += factor",
        (*FINDINGS, "tests/test_step.py"),
        "a nested loop's trip count is not multiplied by its caller's",
    ),
]

# --- the simulated step time, the kernels' costs and the plan's memory bound ---
TIMING = "einshard/_cost/hardware/_timing.py"
KERNELS = "einshard/_cost/xla/_hlo_kernels.py"
BOUNDS = "einshard/_planning/search/_bounds.py"
STEP_TIME = (
    "tests/test_step_time_rules.py",
    "tests/test_step_time_properties.py",
    "tests/test_step_time.py::test_a_gather_hidden_behind_a_gemm_ranks_first_only_when_overlap_is_simulated",
    "tests/test_step_time_programs.py",
)
BOUND_TESTS = ("tests/test_bounds_rules.py", "tests/test_plan_bounds.py")
TIMING_MUTANTS = [
    Mutant(
        "kernel-flops-plus-bytes",
        TIMING,
        "    return max(flops, kernel.bytes / rates.memory) + rates.launch",
        "    return flops + kernel.bytes / rates.memory + rates.launch",
        STEP_TIME,
        "a kernel costs its flops time plus its bytes time, not the larger of the two",
    ),
    Mutant(
        "kernel-no-launch-floor",
        TIMING,
        "    return max(flops, kernel.bytes / rates.memory) + rates.launch",
        "    return max(flops, kernel.bytes / rates.memory)",
        STEP_TIME,
        "a kernel costs no launch floor",
    ),
    Mutant(
        "kernel-every-dot-at-the-fallback",
        TIMING,
        "rates.matmul.get(kernel.matmul, rates.fallback)",
        "rates.fallback",
        STEP_TIME,
        "every dot at the fallback rate, whatever its element type",
    ),
    Mutant(
        "async-done-never-waits",
        TIMING,
        "            finish = run.finishes.pop(item.collective, run.clock)",
        "            finish = min(run.finishes.pop(item.collective, run.clock), run.clock)",
        STEP_TIME,
        "an async collective never makes the step wait at its -done",
    ),
    Mutant(
        "loop-body-once",
        TIMING,
        "    end = now + sum(trip.clock * count for trip, count in trips)",
        "    end = now + sum(trip.clock for trip, count in trips)",
        STEP_TIME,
        "a loop body's time counted once instead of its trip count",
    ),
    Mutant(
        "slowest-kernels-per-trip",
        TIMING,
        "            entry[1] += seconds * times",
        "            entry[1] += seconds",
        STEP_TIME,
        "the slowest kernels' seconds counted for one trip of their loops, not every run",
    ),
    Mutant(
        "start-does-not-queue",
        TIMING,
        "            begin = max(run.clock, run.link_free)\n            run.link_free = begin + seconds\n"
        "            run.finishes[item.collective] = run.link_free",
        "            begin = run.clock\n            run.link_free = begin + seconds\n"
        "            run.finishes[item.collective] = run.link_free",
        STEP_TIME,
        "an async collective does not queue behind those in flight on the link",
    ),
    Mutant(
        "sync-does-not-queue",
        TIMING,
        "            begin = max(run.clock, run.link_free)\n            run.link_free = begin + seconds\n"
        "            run.exposed += run.link_free - run.clock",
        "            begin = run.clock\n            run.link_free = begin + seconds\n"
        "            run.exposed += run.link_free - run.clock",
        STEP_TIME,
        "a sync collective does not queue behind those in flight on the link",
    ),
    Mutant(
        "sync-not-waited-for",
        TIMING,
        "            run.exposed += run.link_free - run.clock\n            run.clock = run.link_free",
        "            run.exposed += run.link_free - run.clock",
        STEP_TIME,
        "the step does not wait for a sync collective (its time exposed, the clock unmoved)",
    ),
    Mutant(
        "hidden-is-all-communication",
        TIMING,
        "hidden_seconds=max(run.communication - exposed, 0.0)",
        "hidden_seconds=run.communication",
        STEP_TIME,
        "hidden communication counts the exposed too",
    ),
    Mutant(
        "conditional-first-branch-only",
        TIMING,
        "            for role, name in instruction.called:\n"
        "                times, known = _hlo_loops.runs_per_call(role, None)",
        "            for role, name in instruction.called[:1]:\n"
        "                times, known = _hlo_loops.runs_per_call(role, None)",
        STEP_TIME,
        "the walk runs a conditional's first branch only (the flops count them all)",
    ),
    Mutant(
        "unknown-trip-count-said-known",
        "einshard/_cost/xla/_hlo_loops.py",
        "        if trip_count is None:\n            return 1, False",
        "        if trip_count is None:\n            return 1, True",
        STEP_TIME,
        "a loop of unknown trip count counted once and said known",
    ),
    Mutant(
        "counter-not-read",
        HLO,
        "        return known if known is not None else _hlo_loops.counted_trips(self, loop)",
        "        return known",
        STEP_TIME,
        "a loop without XLA's known_trip_count (a TPU program's) is not counted from its counter",
    ),
    Mutant(
        "unknown-loops-not-named",
        TIMING,
        "            if not item.known:",
        "            if False:",
        STEP_TIME,
        "the report names no loop of unknown trip count",
    ),
    Mutant(
        "fused-collective-missed",
        KERNELS,
        "    return next((inner for inner in module.computations[body] "
        "if inner.opcode in COLLECTIVES), None)",
        "    return None",
        STEP_TIME,
        "a collective inside a fusion (TPU's async collective fusions) is not on the schedule",
    ),
    Mutant(
        "chain-named-by-its-copy",
        TIMING,
        "        head = heads.get(key, collective.name)",
        "        head = collective.name",
        STEP_TIME,
        "a TPU chain's start and done name their own copies, not the report row's",
    ),
    Mutant(
        "dot-flops-halved",
        KERNELS,
        'instruction.numbers("lhs_contracting_dims"))\n'
        "        return 2.0 * instruction.shapes[0].size * contracted",
        'instruction.numbers("lhs_contracting_dims"))\n'
        "        return instruction.shapes[0].size * contracted",
        STEP_TIME,
        "a dot's flops one per multiply-add instead of two",
    ),
    Mutant(
        "f32-default-at-full-precision",
        KERNELS,
        '        return "f32"\n    return "tf32"',
        '        return "f32"\n    return "f32"',
        STEP_TIME,
        "an f32 dot at the default precision runs at full f32, not through TF32",
    ),
    Mutant(
        "update-writes-the-whole-target",
        KERNELS,
        "                written += sum(s.bytes for s in update.shapes)",
        "                written += sum(s.bytes for s in output.shapes)",
        STEP_TIME,
        "a fused in-place update writes its whole target, not the update",
    ),
    Mutant(
        "unfused-update-whole",
        KERNELS,
        "return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in update))",
        "return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in instruction.shapes))",
        STEP_TIME,
        "an unfused in-place update moves its whole result",
    ),
    Mutant(
        "sliced-read-whole",
        KERNELS,
        "                count += sum(s.size for s in user.shapes)",
        "                return None",
        STEP_TIME,
        "a fused operand read only through a slice costs the whole operand",
    ),
    Mutant(
        "update-behind-views-not-seen",
        KERNELS,
        "        value = beneath_views(output.name)",
        "        value = output",
        STEP_TIME,
        "an in-place update behind a bitcast or reshape (the fusion's root) writes its whole target",
    ),
    Mutant(
        "slice-through-convert-reads-whole",
        KERNELS,
        '_ELEMENTWISE = _VIEWS | {"convert", "copy"}',
        "_ELEMENTWISE = _VIEWS",
        STEP_TIME,
        "a fused slice read through a convert or copy costs its whole operand",
    ),
    Mutant(
        "async-fusion-not-a-fusion",
        KERNELS,
        'FUSIONS = frozenset({"fusion", "fusion-start"})',
        'FUSIONS = frozenset({"fusion"})',
        STEP_TIME,
        "an async fusion's start costs its operands and results (a stack), not its fused computation",
    ),
    Mutant(
        "async-computation-not-read",
        KERNELS,
        '    if opcode == "async-start":\n        body = _called(instruction)\n        wrapped',
        '    if opcode == "async-start-never":\n        body = _called(instruction)\n        wrapped',
        STEP_TIME,
        "an async computation's start costs its operands and results, not what it runs",
    ),
    Mutant(
        "program-flops-once-per-computation",
        KERNELS,
        "                total += times * matmul_flops(module, instruction)",
        "                total += matmul_flops(module, instruction)",
        STEP_TIME,
        "a program's flops count a loop body's dots once, not per trip",
    ),
    Mutant(
        "bound-leaf-whole",
        BOUNDS,
        "math.prod(leaf.layout.shard_shape(leaf.shape))",
        "math.prod(leaf.shape)",
        BOUND_TESTS,
        "the bound counts every argument whole on each device, not its block",
    ),
    Mutant(
        "bound-four-bytes-each",
        BOUNDS,
        "* itemsize(leaf.dtype)",
        "* 4",
        BOUND_TESTS,
        "the bound counts 4 bytes per element, whatever the element type",
    ),
    Mutant(
        "bound-at-the-memory-rejects",
        PLANNER,
        "        if bound is not None and memory is not None and bound.memory_bytes > memory",
        "        if bound is not None and memory is not None and bound.memory_bytes >= memory",
        BOUND_TESTS,
        "a candidate whose arguments fill the memory exactly is not compiled",
    ),
]

ALL = MUTANTS + DATAFLOW_ROLES + FINDING_MUTANTS + TIMING_MUTANTS


# --- anchors ----------------------------------------------------------------------------------------


class AnchorError(Exception):
    pass


def where_else(snippet: str, root: Path) -> list[str]:
    """Every file of the package holding ``snippet``, with its count: where a moved anchor went."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        count = path.read_text().count(snippet)
        if count:
            found.append(f"{path.relative_to(root)} ({count}x)")
    return found


def check_anchor(mutant: Mutant, root: Path) -> str:
    """The module's text, after checking the snippet occurs in it exactly once."""
    path = root / mutant.module
    text = path.read_text() if path.is_file() else None
    count = 0 if text is None else text.count(mutant.before)
    if text is None or count != 1:
        where = "is missing" if text is None else f"holds the snippet {count} times"
        others = where_else(mutant.before, root)
        raise AnchorError(
            f"mutant {mutant.name!r}: {mutant.module} {where}, not once:\n    {mutant.before!r}\n"
            + (f"  it is in: {', '.join(others)}" if others else "  it is nowhere in the package")
        )
    return text


# --- running the tests --------------------------------------------------------------------------------


def copy_repository(destination: Path) -> Path:
    """A copy of what the tests need: the package, the tests, the docs they read, the configuration."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", ".nox", "__pycache__", ".pytest_cache", ".hypothesis", "site", "*.pyc", "results"
    )
    copy = destination / "repo"
    shutil.copytree(ROOT, copy, ignore=ignore)
    return copy


def run_pytest(
    copy: Path, targets: list[str], devices: int, stop: bool, ignore: frozenset[str] = frozenset()
) -> dict:
    """Runs pytest in the copy; returns the failed test ids, whether it stopped early, and its time.

    Failures of the tests in ``ignore`` (known to fail unmutated) are not recorded: they neither
    count nor stop the run.
    """
    result_file = copy / ".mutants-result.json"
    result_file.unlink(missing_ok=True)
    env = {
        **os.environ,
        "EINSHARD_TEST_DEVICES": str(devices),
        "JAX_PLATFORMS": "cpu",
        # The copy first, so that this process's tests and every child they start import it.
        "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "tools")]),
        "PYTHONDONTWRITEBYTECODE": "1",  # a mutant of the same size and second must not reuse a .pyc
        "MUTANTS_RESULT": str(result_file),
        "MUTANTS_STOP": "1" if stop else "",
        "MUTANTS_IGNORE": "\n".join(sorted(ignore)),
    }
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutants"]
    command += ["--continue-on-collection-errors"]
    started = time.monotonic()
    try:
        process = subprocess.run(
            [*command, *targets], cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return {"failed": [], "collection": [], "stopped": False, "timeout": True, "seconds": TIMEOUT}
    seconds = time.monotonic() - started
    if not result_file.is_file():
        output = f"{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
        raise RuntimeError(f"pytest did not run in the copy:\n{output}")
    result = json.loads(result_file.read_text())
    result.update(seconds=seconds, timeout=False, tail=process.stdout[-2000:])
    return result


def function_of(test: str) -> str:
    """``tests/test_x.py::test_f[8]`` -> ``tests/test_x.py::test_f``: parametrizations are one function."""
    return test.split("[", 1)[0]


def check_imports_the_copy(copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy), "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    found = subprocess.run(
        [sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy.resolve()):
        raise RuntimeError(f"the tests would import {found}, not the copy in {copy}")


# --- the pytest plugin (``-p mutants`` in the copy): records failures, stops once caught -------------

_failed: dict[str, None] = {}
_collection: list[str] = []
_session = None


def pytest_sessionstart(session):
    global _session
    _session = session


def pytest_collectreport(report):
    if os.environ.get("MUTANTS_RESULT") and report.failed:
        _collection.append(str(report.nodeid))


def pytest_runtest_logreport(report):
    if not os.environ.get("MUTANTS_RESULT") or not report.failed:
        return
    if report.nodeid in os.environ.get("MUTANTS_IGNORE", "").split("\n"):
        return
    _failed[report.nodeid] = None
    functions = {function_of(test) for test in _failed}
    caught = len(_failed) >= CAUGHT_TESTS and len(functions) >= CAUGHT_FUNCTIONS
    if os.environ.get("MUTANTS_STOP") and caught and _session is not None:
        _session.shouldstop = "the mutant is caught"


def pytest_sessionfinish(session):
    path = os.environ.get("MUTANTS_RESULT")
    if path:
        stopped = bool(session.shouldstop)
        result = {"failed": list(_failed), "collection": _collection, "stopped": stopped}
        Path(path).write_text(json.dumps(result))


# --- the table ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    failed: list[str]
    stopped: bool
    seconds: float
    timeout: bool = False
    collection: list[str] = dataclasses.field(default_factory=list)
    unmutated: list[str] = dataclasses.field(default_factory=list)  # failed unmutated too: not counted
    meet: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def functions(self) -> list[str]:
        return sorted({function_of(test) for test in self.failed})

    @property
    def caught(self) -> bool:
        return len(self.failed) >= CAUGHT_TESTS and len(self.functions) >= CAUGHT_FUNCTIONS


def table(outcomes: list[Outcome], markdown: bool) -> str:
    header = ["mutant", "module", "tests failed", "functions failed", "caught", "seconds", "bug"]
    rows = []
    for o in outcomes:
        more = "+" if o.stopped else ""
        caught = "yes" if o.caught else ("TIMEOUT" if o.timeout else "NO")
        if o.collection:
            caught += " (collection errors)"
        module = o.mutant.module.removeprefix(f"{PACKAGE}/")
        tests, functions = f"{len(o.failed)}{more}", f"{len(o.functions)}{more}"
        rows.append([o.mutant.name, module, tests, functions, caught, f"{o.seconds:.0f}", o.mutant.what])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def details(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        lines.append(f"{o.mutant.name}: {o.mutant.what}")
        lines += [f"    {test}" for test in o.failed]
        lines += [f"    collection error: {c}" for c in o.collection]
        lines += [f"    (not counted, fails unmutated too: {t})" for t in o.unmutated]
        for count, failed in o.meet.items():
            lines.append(f"  tests/test_meet.py at {count} devices: {len(failed)} failed")
            lines += [f"    {test}" for test in failed]
    return "\n".join(lines)


MEET_COUNTS = (6, 12)


def confirm(copy: Path, outcomes: list[Outcome], devices: int) -> set[str]:
    """Runs the test functions that failed on some mutant, unmutated; what fails there too is not
    counted (a test that fails anyway catches nothing). Returns the tests that failed at
    ``devices``."""
    known: set[str] = set()
    runs = {devices: {t for o in outcomes for t in o.failed}}
    for count in MEET_COUNTS:
        runs.setdefault(count, set()).update(t for o in outcomes for t in o.meet.get(count, []))
    for count, tests in runs.items():
        if not tests:
            continue
        functions = sorted({function_of(test) for test in tests})
        print(
            f"confirming {len(functions)} test functions unmutated at {count} devices ...",
            end=" ",
            flush=True,
        )
        failing = set(run_pytest(copy, functions, count, stop=False)["failed"])
        print(f"{len(failing & tests)} fail unmutated too" if failing & tests else "they pass", flush=True)
        if count == devices:
            known |= failing
        for outcome in outcomes:
            if count == devices:
                outcome.unmutated += [t for t in outcome.failed if t in failing]
                outcome.failed = [t for t in outcome.failed if t not in failing]
            if count in outcome.meet:
                outcome.meet[count] = [t for t in outcome.meet[count] if t not in failing]
    return known


def run_mutant(copy: Path, mutant: Mutant, args: argparse.Namespace, ignore: frozenset[str]) -> Outcome:
    """Plants the mutant in the copy, runs its tests (and test_meet.py), restores the module."""
    path = copy / mutant.module
    original = check_anchor(mutant, copy)
    path.write_text(original.replace(mutant.before, mutant.after, 1))
    try:
        print(f"{mutant.name} ...", end=" ", flush=True)
        targets = [] if args.full else list(mutant.tests)
        result = run_pytest(copy, targets, args.devices, stop=not args.all_failures, ignore=ignore)
        outcome = Outcome(mutant, result["failed"], result["stopped"], result["seconds"], result["timeout"])
        outcome.collection = result["collection"]
        if mutant.meet and not args.no_meet:
            for count in MEET_COUNTS:
                meet = run_pytest(copy, ["tests/test_meet.py"], count, stop=False)
                outcome.meet[count] = meet["failed"]
                outcome.seconds += meet["seconds"]
    finally:
        path.write_text(original)
    print(f"{'caught' if outcome.caught else 'NOT CAUGHT'} ({len(outcome.failed)} tests)", flush=True)
    return outcome


# --- main -------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--full", action="store_true", help="run the whole suite on each mutant")
    parser.add_argument("--all-failures", action="store_true", help="do not stop once a mutant is caught")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="run every selected file unmutated first (default: only what failed on a mutant, at the end)",
    )
    parser.add_argument("--no-meet", action="store_true", help="skip test_meet.py at 6 and 12 devices")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="check every anchor and exit")
    parser.add_argument("--markdown", type=Path, help="also write the table and details to this file")
    args = parser.parse_args(argv)

    selected = ALL
    if args.only:
        unknown = set(args.only) - {m.name for m in ALL}
        if unknown:
            parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
        selected = [m for m in ALL if m.name in args.only]
    if args.list:
        for m in ALL:
            print(f"{m.name:42} {m.module:38} {m.what}")
        return 0
    errors = []
    for mutant in selected:
        try:
            check_anchor(mutant, ROOT)
        except AnchorError as error:
            errors.append(str(error))
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 2
    if args.check:
        print(f"all {len(selected)} anchors found exactly once")
        return 0

    with tempfile.TemporaryDirectory(prefix="einshard-mutants-") as tmp:
        copy = copy_repository(Path(tmp))
        check_imports_the_copy(copy)
        baseline: set[str] = set()
        if args.baseline:
            targets = [] if args.full else sorted({t for m in selected for t in m.tests})
            print(f"baseline: {' '.join(targets) or 'the whole suite'}", flush=True)
            baseline = set(run_pytest(copy, targets, args.devices, stop=False)["failed"])
        outcomes = [run_mutant(copy, mutant, args, frozenset(baseline)) for mutant in selected]
        if not args.baseline:
            # A run stopped by failures of tests that fail unmutated too may have stopped short of
            # catching its mutant: run it again, those tests ignored (and confirm what is new).
            known = confirm(copy, outcomes, args.devices)
            for _ in range(3):
                again = [i for i, o in enumerate(outcomes) if o.stopped and not o.caught]
                if not again:
                    break
                print(f"again, without the {len(known)} tests that fail unmutated:", flush=True)
                for i in again:
                    outcomes[i] = run_mutant(copy, outcomes[i].mutant, args, frozenset(known))
                known |= confirm(copy, [outcomes[i] for i in again], args.devices)

    text = table(outcomes, markdown=False)
    print()
    print(text)
    print()
    print(details(outcomes))
    if args.markdown:
        args.markdown.write_text(table(outcomes, markdown=True) + "\n\n```\n" + details(outcomes) + "\n```\n")
    return 0 if all(o.caught for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
