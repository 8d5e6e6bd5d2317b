"""Rule-table bars: resolving rules per leaf, ``shard_pytree`` against ``device_put``, born-sharded init.

    python benchmarks/bench_rules.py [--reps 15] [--seconds 3] [--warmup 3] [--no-fail] [--json PATH]

On 8 simulated CPU devices, with LLaMA-shaped parameter trees (nested dicts:
embedding, per layer attention q/k/v/o and MLP gate/up/down kernels and two
norm scales, final norm, lm_head) and a 13-rule table for hybrid data ×
tensor parallelism (the first matching regex wins; the last rule replicates):

1. **Resolving rules**: ``einshard.pytree_shardings(abstract_tree, rules)`` on
   ``ShapeDtypeStruct`` trees of 32 and 320 layers (291 and 2,883 leaves), in
   µs per leaf. *Cold* (held to the bar): a new ``einshard.Rules(pairs)``
   built inside the timed call, Python's regex cache purged before it (every
   regex compiles again), and a tree structure the process has not met (the
   leaf paths are built again); what the first ``shard_pytree(params, rules)``
   of a program pays, except for the few per-expression caches, which the
   *first call in the process* row includes. *New Rules, known tree*: what a
   repeated call with a list of pairs pays. *Warm*: the same ``Rules`` object
   and tree again (every memo filled). Bar: cold ≤ 2 µs per leaf, on both
   trees. For reference, an EasyLM ``match_partition_rules`` (key path to a
   ``'/'``-joined string, ``re.search`` rule by rule, a ``PartitionSpec`` per
   leaf), written here as EasyLM writes it, timed cold (after the same
   regex-cache purge) and warm (Python's regex cache filled); the ``÷ EasyLM``
   column divides cold rows by the cold EasyLM time and warm rows by the warm
   one, measured in the same run. Floors: ``tree_flatten_with_path`` alone, and
   the paths' strings (``tree_flatten_with_path`` and ``keystr``), which any
   rule table pays before it matches a rule.
2. **shard_pytree**: ``einshard.shard_pytree(tree, rules)`` (A) against
   ``jax.device_put(tree, shardings)`` with ``shardings =
   einshard.pytree_shardings(tree, rules)`` computed beforehand (B), on a
   32-layer tree with d_model 512 (424 MiB float32), from NumPy arrays and
   from ``jax.Array``\\ s on one device. Interleaved pairs (A B, B A, ...),
   each waits for its result and frees it. Bar: median per-pair ratio A/B ≤
   1.05. Also (no bar) the 320-layer tree with tiny leaves, where the fixed
   cost per leaf is all there is.
3. **Born-sharded init, peak host memory**: ``einshard.init_sharded(init_fn,
   rules, key)`` against init-then-shard (``shard_pytree(jax.jit(init_fn)(key),
   rules)``) for a 1.04 GiB float32 model (9 layers, d_model 1536) whose big
   leaves are all split over the 8 devices; ``init_fn`` draws every leaf with
   ``jax.random.normal``. Each runs in a fresh subprocess that imports JAX,
   starts the backend and compiles a tiny function, then records its resident
   set (``VmRSS``), resets the kernel's high-water mark (``echo 5 >
   /proc/self/clear_refs``), runs the init (compilation included) and reads
   the high-water mark ``VmHWM``: the peak is ``VmHWM - baseline``, as a
   multiple of the model's bytes. Where ``clear_refs`` is not available it
   falls back to ``getrusage(RUSAGE_SELF).ru_maxrss``, which is the same unless
   the process peaked higher before the baseline. Bar: init_sharded ≤ 1.2
   (init-then-shard needs about 2: the whole model on one device, then its
   shards). A third row makes AdamW's state (2.09 GiB) born sharded with the
   optax integration's ``init_opt_state(optax.adamw(1e-3), params)``, the
   params made before the baseline; bar: ≤ 1.2 x the state's bytes.

Memory for the timings: on Linux with glibc the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set (as
``bench_placement.py`` does), so that freed buffers are reused rather than
faulted in afresh on the next run; ``--default-malloc`` measures without it.
The memory subprocesses always run with the default allocator, as users do.

``--json PATH`` also writes every table row (the printed strings and the raw
numbers) and the set-up (versions, cores, devices, a 64 MiB memcpy for
reference) as JSON; the documentation's benchmark page is drawn from that file.

Exits with status 1 when a bar is missed, unless ``--no-fail``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, even where Python leaves it out (-P)
import _common

N_DEVICES = 8
# Tunes malloc (re-executing this script; see the docstring; never in a memory subprocess, which
# keeps the default allocator), then 8 CPU devices and this einshard.
_common.start(re_exec=__name__ == "__main__" and "--memory-child" not in sys.argv[1:], cpu_devices=N_DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import einshard  # noqa: E402

RESOLVE_BAR_US = 2.0  # µs per leaf, cold
SHARD_PYTREE_BAR = 1.05  # shard_pytree / device_put(tree, shardings): the median per-pair ratio
MEMORY_BAR = 1.2  # peak host memory of init_sharded / model bytes
EXTRA_RUNS_CAP = 10  # rows take more runs while they fit in --seconds, up to 10 x --reps

# Hybrid parallelism (`_common.LLAMA_RULES`): the devices form a 2 x 4 grid (data x tensor; on 256
# devices 64 x 4). Each weight splits its "tensor" axis (heads, ffn, vocab) into 4 over the
# fast-varying devices, and its d_model axis over what is left (FSDP-style data parallelism):
# `d*` takes N / 4 on N devices.
LLAMA_RULES = _common.LLAMA_RULES

# The same table as EasyLM writes it: PartitionSpecs over a ('dp', 'mp') = (2, 4) mesh.
EASYLM_RULES = [
    (r"embed/embedding$", PartitionSpec("mp", "dp")),
    (r"attn/(q|k|v)_proj/kernel$", PartitionSpec("dp", "mp")),
    (r"attn/(q|k|v)_proj/bias$", PartitionSpec("mp")),
    (r"attn/o_proj/kernel$", PartitionSpec("mp", "dp")),
    (r"mlp/(gate|up)_proj/kernel$", PartitionSpec("dp", "mp")),
    (r"mlp/(gate|up)_proj/bias$", PartitionSpec("mp")),
    (r"mlp/down_proj/kernel$", PartitionSpec("mp", "dp")),
    (r"(attention|ffn)_norm/scale$", PartitionSpec(None)),
    (r"final_norm/scale$", PartitionSpec(None)),
    (r"lm_head/kernel$", PartitionSpec("dp", "mp")),
    (r"rotary/(sin|cos)$", PartitionSpec()),
    (r"(^|/)(step|count)$", PartitionSpec()),
    (r".*", PartitionSpec()),
]


# --- LLaMA-shaped trees (`_common.llama_tree`) -----------------------------------------------------

llama_tree = _common.llama_tree


def abstract_llama(n_layers: int, d_model: int, ffn: int, vocab: int) -> Any:
    """The tree as ``jax.eval_shape`` gives it: ``ShapeDtypeStruct`` leaves, nothing allocated."""
    return llama_tree(n_layers, d_model, ffn, vocab, lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32))


def numpy_llama(n_layers: int, d_model: int, ffn: int, vocab: int, seed: int = 0) -> Any:
    """The tree with float32 NumPy leaves of random values."""
    rng = np.random.default_rng(seed)
    return llama_tree(
        n_layers, d_model, ffn, vocab, lambda shape: rng.standard_normal(shape, dtype=np.float32)
    )


def llama_init(n_layers: int, d_model: int, ffn: int, vocab: int) -> Callable[[jax.Array], Any]:
    """An ``init_fn(key)`` drawing every leaf with ``jax.random.normal``."""

    def init_fn(key: jax.Array) -> Any:
        counter = itertools.count()
        return llama_tree(
            n_layers,
            d_model,
            ffn,
            vocab,
            lambda shape: jax.random.normal(jax.random.fold_in(key, next(counter)), shape, jnp.float32),
        )

    return init_fn


RESOLVE_TREES = {  # small dims, so that even the concrete trees fit; all divisible by 8
    "32 layers": (32, 64, 128, 256),
    "320 layers": (320, 64, 128, 256),
}
TRANSFER_TREE = (32, 512, 1408, 8192)  # 424 MiB float32
MEMORY_MODEL = (9, 1536, 4096, 8192)  # 1.04 GiB float32; its largest leaf is 2.3 % of it


def tree_bytes(tree: Any) -> int:
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


# --- the EasyLM reference -------------------------------------------------------------------------


def tree_path_to_string(path: Any, sep: str) -> str:
    """EasyLM's ``tree_path_to_string`` (EasyLM/jax_utils.py)."""
    keys = []
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            keys.append(str(key.idx))
        elif isinstance(key, jax.tree_util.DictKey):
            keys.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            keys.append(str(key.name))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            keys.append(str(key.key))
        else:
            keys.append(str(key))
    return sep.join(keys)


def match_partition_rules(rules: list[tuple[str, PartitionSpec]], params: Any) -> Any:
    """EasyLM's ``match_partition_rules``: a ``PartitionSpec`` per leaf, first ``re.search`` wins."""

    def get_partition_spec(name: str, leaf: Any) -> PartitionSpec:
        if len(leaf.shape) == 0 or np.prod(leaf.shape) == 1:
            return PartitionSpec()  # don't partition scalar values
        for rule, ps in rules:
            if re.search(rule, name) is not None:
                return ps
        raise ValueError(f"Partition rule not found for param: {name}")

    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: get_partition_spec(tree_path_to_string(path, sep="/"), leaf), params
    )


def check_easylm_agrees(tree: Any) -> None:
    """The two tables give the same layouts (EasyLM's mesh: the devices as a 2 x 4 grid)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "mp"))
    ours = jax.tree.leaves(einshard.pytree_shardings(tree, LLAMA_RULES))
    theirs = jax.tree.leaves(match_partition_rules(EASYLM_RULES, tree))
    for leaf, sharding, spec in zip(jax.tree.leaves(tree), ours, theirs, strict=True):
        if not sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim):
            raise AssertionError(f"the einshard and EasyLM tables disagree: {sharding} vs {spec}")


def path_strings(tree: Any) -> list[str]:
    """Every leaf's path as a string, as a rule-table peer builds it before matching: the floor."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# --- timing ---------------------------------------------------------------------------------------


def median_runs(
    calls: dict[str, tuple[Callable[[], Any], Callable[[Any], object]]], reps: int, seconds: float
) -> dict[str, float]:
    """Median seconds per call of each ``(setup, call)``, in rotating order, one of each per round.

    ``call(setup())`` is timed; ``setup`` is not. At least ``reps`` rounds, and more (up to
    ``EXTRA_RUNS_CAP`` times as many) while they fit in ``seconds``.
    """
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for setup, call in calls.values():  # warm-up
        call(setup())
    start = time.perf_counter()
    rounds = 0
    while rounds < reps or (rounds < EXTRA_RUNS_CAP * reps and time.perf_counter() - start < seconds):
        for name in names[rounds % len(names) :] + names[: rounds % len(names)]:
            setup, call = calls[name]
            argument = setup()
            gc.collect()
            t0 = time.perf_counter()
            call(argument)
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(values) for name, values in samples.items()}


# --- 1. resolving rules ---------------------------------------------------------------------------


_structures = itertools.count()


def unseen_structure(tree: dict[str, Any]) -> dict[str, Any]:
    """The same leaves and paths in a tree structure this process has not met (a new empty node).

    einshard caches the leaf paths of each tree structure it has seen, so a cold call must bring a
    new one. Its cache is emptied too: ``PyTreeDef`` hashes ignore dict keys, so the structures
    made here would all collide in it, and a real program meets a handful, not hundreds.
    """
    einshard._trees._paths._PATHS.clear()
    return {**tree, "_": {str(next(_structures)): None}}


def fresh_regexes(tree: Any) -> Any:
    re.purge()  # Python's cache of compiled regexes: a new table compiles every regex again
    # einshard's cache of compiled tables (and of the rule each path resolved to).
    einshard._trees._rules._compile_table.cache_clear()
    return tree


def resolve_rows(reps: int, seconds: float) -> tuple[list[list[str]], list[dict[str, Any]], bool]:
    rows = []
    records = []
    failed = False
    for name, dims in RESOLVE_TREES.items():
        tree = abstract_llama(*dims)
        n = len(jax.tree.leaves(tree))
        first = None
        if name == next(iter(RESOLVE_TREES)):  # the very first call in this process: every cache cold
            re.purge()
            t0 = time.perf_counter()
            einshard.pytree_shardings(tree, einshard.Rules(LLAMA_RULES))
            first = time.perf_counter() - t0
        check_easylm_agrees(tree)
        warm_rules = einshard.Rules(LLAMA_RULES)

        def seen(t: Any = tree, r: einshard.Rules = warm_rules) -> Any:
            einshard.pytree_shardings(t, r)  # untimed: the tree's structure is known again after a cold run
            return t

        times = median_runs(
            {
                "cold": (
                    lambda t=tree: fresh_regexes(unseen_structure(t)),
                    lambda t: einshard.pytree_shardings(t, einshard.Rules(LLAMA_RULES)),
                ),
                "fresh": (seen, lambda t: einshard.pytree_shardings(t, einshard.Rules(LLAMA_RULES))),
                "warm": (seen, lambda t, r=warm_rules: einshard.pytree_shardings(t, r)),
                # EasyLM both ways: after the purge (to divide cold rows by) and with Python's regex
                # cache filled (to divide warm rows by).
                "easylm_cold": (
                    lambda t=tree: fresh_regexes(t),
                    lambda t: match_partition_rules(EASYLM_RULES, t),
                ),
                "easylm": (lambda t=tree: t, lambda t: match_partition_rules(EASYLM_RULES, t)),
                "flatten": (lambda t=tree: t, jax.tree_util.tree_flatten_with_path),
                "paths": (lambda t=tree: t, path_strings),
            },
            reps,
            seconds,
        )
        us = {key: value / n * 1e6 for key, value in times.items()}
        ok = us["cold"] <= RESOLVE_BAR_US
        failed |= not ok
        label = f"{name} ({n} leaves)"
        # Each row with the EasyLM reference measured the same way: cold rows after the regex-cache
        # purge, the others with every cache filled.
        measures = [
            (
                "cold",
                "cold: new Rules, unseen tree, regexes compiled",
                us["cold"],
                _common.verdict(ok),
                "cold",
            ),
            ("fresh", "new Rules from the same pairs, known tree", us["fresh"], "info", "warm"),
            ("warm", "warm: the same Rules and tree again", us["warm"], "info", "warm"),
        ]
        if first is not None:
            measures.append(("first", "the first call in the process", first / n * 1e6, "info", "cold"))
        measures.append(
            ("easylm_cold", "EasyLM match_partition_rules, cold", us["easylm_cold"], "reference", "cold")
        )
        measures.append(("easylm", "EasyLM match_partition_rules, warm", us["easylm"], "reference", "warm"))
        measures.append(("flatten", "tree_flatten_with_path alone", us["flatten"], "floor", "warm"))
        measures.append(("paths", "paths' strings: flatten_with_path + keystr", us["paths"], "floor", "warm"))
        reference = {"cold": us["easylm_cold"], "warm": us["easylm"]}
        rows += [
            [label, measure, f"{value:.2f}", f"{value / reference[against]:.2f}", against, verdict]
            for _, measure, value, verdict, against in measures
        ]
        records += [
            {
                "tree": name,
                "leaves": n,
                "key": key,
                "measure": measure,
                "us_per_leaf": value,
                "over_easylm": value / reference[against],
                "easylm_reference": against,
                "bar": RESOLVE_BAR_US if key == "cold" else None,
                "verdict": verdict,
            }
            for key, measure, value, verdict, against in measures
        ]
    return rows, records, failed


# --- 2. shard_pytree against device_put -----------------------------------------------------------


def transfer_rows(args: argparse.Namespace) -> tuple[list[list[str]], list[dict[str, Any]], bool]:
    rows = []
    records = []
    failed = False
    cases = [
        ("32 layers, d 512", TRANSFER_TREE, True),
        ("320 layers, d 64", RESOLVE_TREES["320 layers"], False),
    ]
    for name, dims, held in cases:
        host = numpy_llama(*dims)
        shardings = einshard.pytree_shardings(host, LLAMA_RULES)
        on_one_device = jax.block_until_ready(jax.device_put(host, jax.devices()[0]))
        size = f"{tree_bytes(host) / 2**20:.0f} MiB"
        for source, tree in (("numpy", host), ("jax, 1 device", on_one_device)):
            result = _common.compare(
                lambda t: einshard.shard_pytree(t, LLAMA_RULES),
                lambda t, s=shardings: jax.device_put(t, s),
                lambda t=tree: t,
                args.reps if held else max(5, args.reps // 3),
                args.warmup,
                args.seconds,
                cap=EXTRA_RUNS_CAP,
            )
            ok = result["ratio"] <= SHARD_PYTREE_BAR
            failed |= held and not ok
            rows.append(
                [
                    f"{name} ({size})",
                    source,
                    _common.ms(result["a"]),
                    _common.ms(result["b"]),
                    str(result["pairs"]),
                    f"{result['ratio']:.3f}",
                    _common.verdict(ok) if held else "info",
                ]
            )
            records.append(
                {
                    "tree": name,
                    "bytes": tree_bytes(host),
                    "input": source,
                    "shard_pytree_s": result["a"],
                    "device_put_s": result["b"],
                    "pairs": result["pairs"],
                    "ratio": result["ratio"],
                    "bar": SHARD_PYTREE_BAR if held else None,
                    "verdict": _common.verdict(ok) if held else "info",
                }
            )
        del host, on_one_device, tree
        gc.collect()
    return rows, records, failed


# --- 3. born-sharded init: peak host memory -------------------------------------------------------


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return values


def xla_temp_bytes(
    mode: str, init_fn: Callable[..., Any], rules: einshard.Rules, key: jax.Array, params: Any = None
) -> tuple[int, int]:
    """The scratch memory XLA's buffer assignment gives the init's programs, and how many there are.

    ``init_sharded`` compiles a model of this size in parts, one program each, run one after
    another: the scratch alive at once is the largest part's, times 8 (a sharded program runs
    once per device, each with its own scratch). The programs are the ones it really makes: it
    is called again with ``jax.jit`` wrapped, so that each function it compiles is lowered and
    compiled for its arguments and answered with shapes, not run (for the optax row: the state's
    init, ``params`` given). Init-then-shard compiles ``init_fn`` as one program, on one device.
    Returns ``(-1, programs)`` when XLA gives no memory analysis or no program was caught (an
    einshard that no longer calls ``jax.jit``).
    """
    compiled: list[Any] = []
    if mode in ("init_sharded", "optax_init_sharded"):
        real_jit = jax.jit

        def recording_jit(fun: Callable[..., Any], *jit_args: Any, **jit_kwargs: Any) -> Callable[..., Any]:
            jitted = real_jit(fun, *jit_args, **jit_kwargs)

            def compile_only(*args: Any, **kwargs: Any) -> Any:
                compiled.append(jitted.lower(*args, **kwargs).compile())
                return jax.eval_shape(jitted, *args, **kwargs)

            return compile_only

        jax.jit = recording_jit
        try:
            if mode == "init_sharded":
                einshard.init_sharded(init_fn, rules, key)
            else:
                optax_state(params)
        finally:
            jax.jit = real_jit
        devices = N_DEVICES
    else:
        compiled.append(jax.jit(init_fn).lower(key).compile())
        devices = 1
    analyses = [program.memory_analysis() for program in compiled]
    if not analyses or any(analysis is None for analysis in analyses):
        return -1, len(compiled)
    return max(analysis.temp_size_in_bytes for analysis in analyses) * devices, len(compiled)


def optax_state(params: Any) -> Any:
    """AdamW's state for ``params``, born sharded like them (the optax row; optax imported here only)."""
    import optax

    from einshard.integrations.optax import init_opt_state

    return init_opt_state(optax.adamw(1e-3), params)


def memory_child(mode: str) -> int:
    """Runs one init in this (fresh) process and prints its peak memory as JSON."""
    import resource

    init_fn = llama_init(*MEMORY_MODEL)
    rules = einshard.Rules(LLAMA_RULES)
    key = jax.random.key(0)
    jax.block_until_ready(jax.jit(lambda k: jax.random.normal(k, (8, 8)))(key))  # backend and compiler up
    params = None
    if mode == "optax_init_sharded":  # the params exist before the baseline: the state is measured
        params = jax.block_until_ready(einshard.init_sharded(init_fn, rules, key))
    gc.collect()
    baseline = _status()["VmRSS"]
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss"
    start = time.perf_counter()
    if mode == "init_sharded":
        params = made = einshard.init_sharded(init_fn, rules, key)
    elif mode == "init_then_shard":
        params = made = einshard.shard_pytree(jax.jit(init_fn)(key), rules)
    elif mode == "optax_init_sharded":
        made = optax_state(params)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    jax.block_until_ready(made)
    seconds = time.perf_counter() - start
    status = _status()
    peak = (
        status["VmHWM"]
        if method != "ru_maxrss"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    model = tree_bytes(made)
    temp, programs = xla_temp_bytes(mode, init_fn, rules, key, params)
    # Every leaf of 1 MiB or more must be split over all 8 devices, one eighth each.
    for leaf in jax.tree.leaves(made):
        if leaf.nbytes >= 2**20:
            shard = leaf.sharding.shard_shape(leaf.shape)
            devices = {s.device for s in leaf.addressable_shards}
            if math.prod(shard) * N_DEVICES != leaf.size or len(devices) != N_DEVICES:
                raise SystemExit(f"a leaf of shape {leaf.shape} is not split over {N_DEVICES} devices")
    print(
        json.dumps(
            {
                "peak": peak - baseline,
                "after": status["VmRSS"] - baseline,
                "model": model,
                "seconds": seconds,
                "method": method,
                "xla_temp": temp,
                "xla_programs": programs,
            }
        )
    )
    return 0


def memory_rows() -> tuple[list[list[str]], list[dict[str, Any]], bool, str]:
    env = {k: v for k, v in os.environ.items() if k not in _common.TUNED_MALLOC}  # the allocator users have
    rows = []
    records = []
    failed = False
    method = ""
    for mode, label, held in (
        ("init_sharded", "init_sharded(init_fn, rules, key)", True),
        ("init_then_shard", "shard_pytree(jit(init_fn)(key), rules)", False),
        ("optax_init_sharded", "optax init_opt_state(adamw, params): the state", True),
    ):
        result = _common.run_child(__file__, ["--memory-child", mode], env, timeout=600)
        method = result["method"]
        ratio = result["peak"] / result["model"]
        ok = ratio <= MEMORY_BAR
        failed |= held and not ok
        temp = result["xla_temp"]
        rows.append(
            [
                label,
                f"{result['model'] / 2**30:.2f}",
                f"{result['peak'] / 2**30:.2f}",
                f"{temp / 2**30:.2f}" if temp >= 0 else "?",
                str(result["xla_programs"]),
                f"{result['after'] / 2**30:.2f}",
                f"{result['seconds']:.1f}",
                f"{ratio:.2f}",
                _common.verdict(ok) if held else "~2 expected",
            ]
        )
        records.append(
            {
                "init": label,
                "model_bytes": result["model"],
                "peak_bytes": result["peak"],
                "xla_temp_bytes": temp if temp >= 0 else None,
                "xla_programs": result["xla_programs"],
                "after_bytes": result["after"],
                "seconds": result["seconds"],
                "peak_over_model": ratio,
                "method": method,
                "bar": MEMORY_BAR if held else None,
                "verdict": _common.verdict(ok) if held else "~2 expected",
            }
        )
    return rows, records, failed, method


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks and prints the tables; returns the exit status."""
    parser = _common.parser(__doc__, reps=15, seconds=3.0, warmup=3, runs="runs")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the memory subprocesses")
    parser.add_argument("--memory-child", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        return memory_child(args.memory_child)
    results = _common.Results(Path(__file__).name, args)

    if not _common.has_devices(N_DEVICES):
        return 2
    print(f"{_common.environment(N_DEVICES)}; {len(LLAMA_RULES)} rules, the first match wins")
    failed = False
    host = np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32)
    memcpy = _common.memcpy_seconds(host, 30)
    results.extra["memcpy"] = {
        "what": "np.copyto of a 4096x4096 float32 array into a preallocated one, median (reference)",
        "bytes": host.nbytes,
        "seconds": memcpy,
        "GB_per_s": host.nbytes / memcpy / 1e9,
    }
    results.extra["rules"] = len(LLAMA_RULES)
    del host

    rows, records, missed = resolve_rows(args.reps, args.seconds)
    failed |= missed
    results.table(
        "resolve",
        "Resolving rules: pytree_shardings(abstract tree, rules), µs per leaf; "
        f"bar: cold <= {RESOLVE_BAR_US:g}",
        ["tree", "measure", "µs per leaf", "÷ EasyLM", "EasyLM run", "bar"],
        rows,
        {"µs per leaf", "÷ EasyLM"},
        bar=RESOLVE_BAR_US,
        records=records,
    )

    rows, records, missed = transfer_rows(args)
    failed |= missed
    results.table(
        "shard_pytree",
        "shard_pytree(tree, rules) vs device_put(tree, precomputed shardings); "
        f"bar: ratio <= {SHARD_PYTREE_BAR}",
        ["tree", "input", "shard_pytree ms", "device_put ms", "pairs", "ratio", "bar"],
        rows,
        {"shard_pytree ms", "device_put ms", "pairs", "ratio"},
        bar=SHARD_PYTREE_BAR,
        records=records,
    )

    if not args.skip_memory:
        rows, records, missed, method = memory_rows()
        failed |= missed
        results.table(
            "memory",
            f"Peak host memory of an init, a fresh process each ({method} - RSS after starting JAX); "
            f"bar: init_sharded <= {MEMORY_BAR} x model",
            [
                "init",
                "model GiB",
                "peak GiB",
                "XLA temp GiB",
                "programs",
                "after GiB",
                "seconds",
                "peak / model",
                "bar",
            ],
            rows,
            {"model GiB", "peak GiB", "XLA temp GiB", "programs", "after GiB", "seconds", "peak / model"},
            bar=MEMORY_BAR,
            records=records,
        )

    status = _common.exit_status(failed, args.no_fail)
    results.write(N_DEVICES, failed)
    return status


if __name__ == "__main__":
    sys.exit(main())
