"""Repeated layers in a step's program, and the same step at a smaller depth.

An unrolled model (a Python loop over its layers: Hugging Face's Flax models, most Equinox and
NNX models) traces to a program in which each layer's forward pass is the same run of equations
on arrays of the same shapes, each run reading its own parameters and the previous run's output,
and the backward pass repeats each layer's transpose, in reverse order. :func:`repeated_blocks`
finds both runs in the step's top-level equations; an equation that holds a jaxpr (``jit``,
``checkpoint``, custom derivatives, ``cond``) is one equation, compared by its jaxpr's structure.

:meth:`Blocks.at_depth` cuts the program to ``k`` of its ``N`` layers: layers ``1 … N − k`` go
from both runs, the layer after them reads what layer 0 gave (the forward pass) and what the
layer before them gave (the backward pass), and what only the removed layers led to is dropped:
their gradients, their optimizer update, their results and their parameters and optimizer state.
A scanned model's layers are a loop, one equation: it has no repeated blocks here, and compiles
fast as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

from ._jaxprs import closed_jaxpr, inner_jaxpr, is_jaxpr

__all__ = ["MIN_BLOCKS", "Blocks", "Depth", "NotLayers", "repeated_blocks"]

MIN_BLOCKS = 4
"""The fewest repeated layers a step needs to be planned from smaller depths (two of them, and
the whole)."""


class NotLayers(Exception):
    """The blocks found do not cut as layers (einshard's own signal: the plan compiles the step whole)."""


_MOST_PAIRS = 16  # pairs of runs tried as the forward and backward passes, the largest first
_MOST_ALIGNMENTS = 1024  # ways to cut one pair into blocks

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclasses.dataclass(frozen=True)
class Run:
    """``count`` consecutive blocks of ``period`` top-level equations each, from equation ``start``."""

    start: int
    period: int
    count: int

    def block(self, i: int) -> range:
        return range(self.start + i * self.period, self.start + (i + 1) * self.period)

    @property
    def end(self) -> int:
        return self.start + self.count * self.period


@dataclasses.dataclass(frozen=True)
class Depth:
    """The step at a smaller depth: its program, and which of the step's inputs and outputs it keeps.

    Attributes:
        jaxpr: The program (a ``ClosedJaxpr``) over the kept inputs, giving the kept outputs.
        inputs: The indices of the step's program inputs it takes, in order.
        outputs: The indices of the step's program outputs it gives, in order.
        depth: How many of the repeated layers it has.
    """

    jaxpr: Any
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    depth: int


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The repeated layers of a step's program (:func:`repeated_blocks`).

    Attributes:
        jaxpr: The step's program (a ``ClosedJaxpr``).
        forward: The forward pass's run of blocks, layer 0 first.
        backward: The backward pass's run, the last layer first.
        backward_first: The layer of the backward run's first block: the last layer's, or the
            one before it when the last layer's transpose differs (its cotangent comes from the
            loss); ``-1``: the last layer's. The run may also end before layer 0's transpose
            (when the layers' input is not differentiated).
    """

    jaxpr: Any
    forward: Run
    backward: Run
    backward_first: int = -1

    @property
    def count(self) -> int:
        """How many layers repeat (``N``)."""
        return self.forward.count

    def cuts_whole_layers(self) -> bool:
        """Whether the step cut to 2 layers keeps the parameters the kept layers read, and no other's.

        Each forward block reads its layer's own parameters; blocks that straddle layers fail this.
        """
        jaxpr = inner_jaxpr(self.jaxpr)
        place = {id(v): i for i, v in enumerate(jaxpr.invars)}
        own = [
            {
                place[id(v)]
                for e in self.forward.block(i)
                for v in jaxpr.eqns[e].invars
                if _is_var(v) and id(v) in place
            }
            for i in range(self.count)
        ]
        if not all(own[1:-1]):  # each removed layer reads its own parameters
            return False
        try:
            inputs = set(self.at_depth(2).inputs)
        except NotLayers:
            return False
        kept = (0, self.count - 1)
        return all(own[i] <= inputs for i in kept) and not any(
            own[i] & inputs for i in range(1, self.count - 1)
        )

    def _transposed(self, layer: int) -> int:
        """The backward run's block of a layer (the last layer's first: see ``backward_first``)."""
        first = self.count - 1 if self.backward_first < 0 else self.backward_first
        return first - layer

    @property
    def equations(self) -> int:
        """Top-level equations per layer, forward and backward."""
        return self.forward.period + self.backward.period

    def at_depth(self, depth: int) -> Depth:
        """The step with ``depth`` of its layers (2 ≤ ``depth`` ≤ ``N``): see the module.

        Raises:
            NotLayers: When the cut leaves a dangling input, or drops an output that the
                layers kept led to (the blocks did not chain as found).
        """
        n = self.count
        if not 2 <= depth <= n:
            raise NotLayers(f"a depth of 2 to {n} layers, not {depth}")
        closed = self.jaxpr
        jaxpr = inner_jaxpr(closed)
        if depth == n:
            return Depth(closed, tuple(range(len(jaxpr.invars))), tuple(range(len(jaxpr.outvars))), n)
        eqns = list(jaxpr.eqns)
        removed_layers = range(1, n - depth + 1)
        # The backward run has the last layer first: layer i is its block n - 1 - i.
        removed = {e for i in removed_layers for e in self.forward.block(i)}
        removed |= {e for i in removed_layers for e in self.backward.block(self._transposed(i))}
        renamed: dict[Any, Any] = {}
        # The forward pass: layer n - depth + 1 reads layer 0's output.
        renamed.update(_rewired(eqns, self.forward, first=1, last=n - depth))
        # The backward pass: layer 0's transpose reads what layer n - depth's read.
        renamed.update(
            _rewired(eqns, self.backward, first=self._transposed(n - depth), last=self._transposed(1))
        )
        gone = {id(v) for e in removed for v in eqns[e].outvars}
        kept_eqns = _cut([eqn for index, eqn in enumerate(eqns) if index not in removed], gone, renamed)
        outvars = [renamed.get(id(v), v) if _is_var(v) else v for v in jaxpr.outvars]
        outputs = tuple(i for i, v in enumerate(outvars) if not (_is_var(v) and id(v) in gone))
        kept_out = [outvars[i] for i in outputs]
        body = _needed(kept_eqns, kept_out)
        used_before = _used(eqns, jaxpr.outvars)
        used_now = _used(body, kept_out)
        inputs = tuple(i for i, v in enumerate(jaxpr.invars) if id(v) in used_now or id(v) not in used_before)
        new = jaxpr.replace(
            invars=[jaxpr.invars[i] for i in inputs],
            outvars=kept_out,
            eqns=body,
            debug_info=_debug_info(jaxpr.debug_info, inputs, outputs),
        )
        return Depth(closed_jaxpr(new, closed.consts), inputs, outputs, depth)


def _is_var(v: Any) -> bool:
    return not hasattr(v, "val")  # a Literal holds its value


def _rewired(eqns: Sequence[Any], run: Run, *, first: int, last: int) -> dict[int, Any]:
    """Blocks ``first`` … ``last`` of a run removed: what is read of block ``last``, renamed.

    The blocks are the same equations in the same order, so a value is named by its place in its
    block. Where the run has a block before the removed ones, each value of block ``last`` becomes
    that block's value in the same place (what the removed ones would have passed on is what it
    passes on); else the block after them reads, in each place it read block ``last``, what block
    ``first`` read there.

    Raises:
        NotLayers: When the blocks do not chain that way.
    """
    block = run.block(last)
    renamed: dict[int, Any] = {}
    if first > 0:  # only what a block passes on to the next: a layer's gradients are its own
        before = run.block(first - 1)
        for offset, k in _chain_places(eqns, run):
            renamed[id(eqns[block.start + offset].outvars[k])] = eqns[before.start + offset].outvars[k]
        return renamed
    if last + 1 >= run.count:
        raise NotLayers("the layers do not chain: no block before or after the removed ones")
    made = {id(v) for e in block for v in eqns[e].outvars}
    removed = {id(v) for i in range(first, last + 1) for e in run.block(i) for v in eqns[e].outvars}
    source = run.block(first)
    for e in run.block(last + 1):
        for slot, v in enumerate(eqns[e].invars):
            if _is_var(v) and id(v) in made:
                read = eqns[source.start + (e - block.stop)].invars[slot]
                if _is_var(read) and id(read) in removed:
                    raise NotLayers("the layers do not chain: the first one removed reads a removed one")
                renamed[id(v)] = read
    return renamed


def _chain_places(eqns: Sequence[Any], run: Run) -> set[tuple[int, int]]:
    """The places (equation in the block, output) of the values each block of a run passes on to the next."""
    places = set()
    for i in range(run.count - 1):
        block = run.block(i)
        place = {id(v): (e - block.start, k) for e in block for k, v in enumerate(eqns[e].outvars)}
        places.update(
            place[id(v)] for e in run.block(i + 1) for v in eqns[e].invars if _is_var(v) and id(v) in place
        )
    return places


def _cut(eqns: Sequence[Any], gone: set[int], renamed: dict[int, Any]) -> list[Any]:
    """``eqns`` without what reads a value in ``gone`` (whose outputs join it), each read renamed.

    A call (``jit``) that reads some gone values keeps the outputs that do not depend on them:
    its program is cut the same way (optax's jitted tree functions take every leaf at once).
    """
    kept = []
    for eqn in eqns:
        invars = [renamed.get(id(v), v) if _is_var(v) else v for v in eqn.invars]
        tainted = [i for i, v in enumerate(invars) if _is_var(v) and id(v) in gone]
        if not tainted:
            kept.append(
                eqn.replace(invars=invars)
                if any(a is not b for a, b in zip(invars, eqn.invars, strict=True))
                else eqn
            )
            continue
        cut = _cut_call(eqn, invars, set(tainted))
        if cut is None:
            gone.update(id(v) for v in eqn.outvars)
            continue
        new_eqn, lost = cut
        gone.update(id(eqn.outvars[k]) for k in lost)
        if new_eqn is not None:
            kept.append(new_eqn)
    return kept


def _cut_call(eqn: Any, invars: list[Any], tainted: set[int]) -> tuple[Any, list[int]] | None:
    """A ``jit`` equation without its ``tainted`` inputs and the outputs they lead to, and those outputs.

    ``None`` for any other equation (all its outputs are then gone).
    """
    program = eqn.params.get("jaxpr")
    if eqn.primitive.name not in ("pjit", "jit") or program is None or not hasattr(program, "consts"):
        return None
    inner = inner_jaxpr(program)
    if len(inner.invars) != len(invars) or len(inner.outvars) != len(eqn.outvars):
        return None
    gone = {id(inner.invars[i]) for i in tainted}
    body = _cut(inner.eqns, gone, {})
    lost = [k for k, v in enumerate(inner.outvars) if _is_var(v) and id(v) in gone]
    outputs = [k for k in range(len(inner.outvars)) if k not in set(lost)]
    if not outputs:
        return None, lost
    inputs = [i for i in range(len(invars)) if i not in tainted]
    kept_out = [inner.outvars[k] for k in outputs]
    new_inner = inner.replace(
        invars=[inner.invars[i] for i in inputs],
        outvars=kept_out,
        eqns=_needed(body, kept_out),
        debug_info=_debug_info(inner.debug_info, inputs, outputs),
    )
    params = dict(eqn.params)
    params["jaxpr"] = closed_jaxpr(new_inner, program.consts)
    for key, value in eqn.params.items():
        if isinstance(value, tuple) and key != "jaxpr":
            if (key.startswith("in_") or key == "donated_invars") and len(value) == len(invars):
                params[key] = tuple(value[i] for i in inputs)
            elif key.startswith("out_") and len(value) == len(eqn.outvars):
                params[key] = tuple(value[k] for k in outputs)
    new_eqn = eqn.replace(
        invars=[invars[i] for i in inputs], outvars=[eqn.outvars[k] for k in outputs], params=params
    )
    return new_eqn, lost


def _needed(eqns: Sequence[Any], outvars: Sequence[Any]) -> list[Any]:
    """The equations ``outvars`` need, and those with effects (a dead-code pass)."""
    live = {id(v) for v in outvars if _is_var(v)}
    needed = []
    for eqn in reversed(eqns):
        if any(id(v) in live for v in eqn.outvars) or eqn.effects:
            live.update(id(v) for v in eqn.invars if _is_var(v))
            needed.append(eqn)
    return needed[::-1]


def _used(eqns: Sequence[Any], outvars: Sequence[Any]) -> set[int]:
    used = {id(v) for v in outvars if _is_var(v)}
    for eqn in eqns:
        used.update(id(v) for v in eqn.invars if _is_var(v))
    return used


def _debug_info(info: Any, inputs: Sequence[int], outputs: Sequence[int]) -> Any:
    """The program's debug info for the kept inputs and outputs (JAX checks their counts)."""
    if info is None:
        return None
    changes = {}
    names = getattr(info, "arg_names", None)
    if names is not None:
        changes["arg_names"] = tuple(names[i] for i in inputs)
    paths = getattr(info, "result_paths", None)
    if isinstance(paths, (tuple, list)):
        changes["result_paths"] = tuple(paths[i] for i in outputs)
    return info._replace(**changes) if changes and hasattr(info, "_replace") else info


def _structure(value: Any, seen: dict[int, Any]) -> Any:
    """A hashable stand-in for an equation's parameter: a jaxpr by its structure, no addresses."""
    if is_jaxpr(value):
        key = id(value)
        if key not in seen:
            inner = inner_jaxpr(value)
            seen[key] = (
                tuple(str(v.aval) for v in inner.invars),
                tuple(str(v.aval) for v in inner.outvars),
                tuple(_signature(eqn, seen) for eqn in inner.eqns),
            )
        return seen[key]
    if isinstance(value, (tuple, list)):
        return tuple(_structure(item, seen) for item in value)
    if callable(value) and hasattr(value, "__qualname__"):
        return getattr(value, "__module__", ""), value.__qualname__
    return _ADDRESS.sub("", repr(value))


def _signature(eqn: Any, seen: dict[int, Any]) -> tuple:
    """An equation by its primitive, parameters and the types of its inputs and outputs."""
    params = tuple(sorted((key, _structure(value, seen)) for key, value in eqn.params.items()))
    return (
        eqn.primitive.name,
        params,
        tuple(str(v.aval) if _is_var(v) else ("literal", str(v.aval), repr(v.val)) for v in eqn.invars),
        tuple(str(v.aval) for v in eqn.outvars),
    )


def _alignments(begin: int, length: int, period: int, count: int) -> list[Run]:
    """The ways to cut ``count`` blocks from a periodic stretch (its spare equations before or after)."""
    return [Run(begin + offset, period, count) for offset in range(length - count * period + 1)]


def _crossing(eqns: Sequence[Any], run: Run) -> int:
    """How many values cross from a run's first block to its second.

    A layer's boundary passes its output on (the hidden state, or its cotangent); a cut inside a
    layer passes its intermediates too.
    """
    defined = {id(v) for e in run.block(0) for v in eqns[e].outvars}
    return len({id(v) for e in run.block(1) for v in eqns[e].invars if _is_var(v) and id(v) in defined})


def _chains(eqns: Sequence[Any], run: Run) -> bool:
    """Whether each block reads the block before it (a layer reads the previous layer's output)."""
    for i in range(run.count - 1):
        defined = {id(v) for e in run.block(i) for v in eqns[e].outvars}
        if not any(_is_var(v) and id(v) in defined for e in run.block(i + 1) for v in eqns[e].invars):
            return False
    return True


def repeated_blocks(closed: Any) -> Blocks | str:
    """The step's repeated layers (see the module), or why it has none that can be cut (a sentence).

    Args:
        closed: The step's program (a ``ClosedJaxpr``, as :func:`jax.make_jaxpr` gives it).
    """
    jaxpr = inner_jaxpr(closed)
    eqns = list(jaxpr.eqns)
    seen: dict[int, Any] = {}
    codes: dict[tuple, int] = {}
    sequence = [codes.setdefault(_signature(eqn, seen), len(codes)) for eqn in eqns]
    stretches = _stretches(sequence)
    if not stretches:
        return f"no run of {MIN_BLOCKS} or more identical layers among its {len(eqns)} top-level equations"
    # Pairs of runs of the same count, the forward pass first: the largest pair first.
    pairs = sorted(
        (
            (first, second)
            for first in stretches
            for second in stretches
            if first[3] - second[3] in (0, 1) and second[0] >= first[0] + first[2] * first[3]
        ),
        key=lambda pair: (-(pair[0][2] * pair[0][3] + pair[1][2] * pair[1][3]), pair[0][0], pair[1][0]),
    )
    chains = functools.lru_cache(maxsize=None)(lambda run: _chains(eqns, run))
    layers = functools.lru_cache(maxsize=None)(lambda run: _forward_layers(eqns, run))
    for first, second in pairs[:_MOST_PAIRS]:
        if len(_alignments(*first)) * len(_alignments(*second)) > _MOST_ALIGNMENTS:
            continue  # layers are cut where their runs begin, give or take a few equations
        cuts = [
            (
                _crossing(eqns, forward) + _crossing(eqns, backward),
                forward.start,
                backward.start,
                forward,
                backward,
                last,
            )
            for forward in _alignments(*first)
            if chains(forward)
            for backward in _alignments(*second)
            if chains(backward)
            for last in _last_layers(forward, backward)
            if _pairs_reversed(eqns, layers(forward), backward, last)
        ]
        for *_, forward, backward, last in sorted(cuts, key=lambda cut: cut[:3]):
            blocks = Blocks(closed, forward, backward, last)
            if blocks.cuts_whole_layers():
                return blocks
    return (
        f"its repeated runs of equations do not pair as layers (a forward pass and its backward pass, "
        f"in reverse, reading each layer's own values) among its {len(eqns)} top-level equations"
    )


def _stretches(sequence: Sequence[int]) -> list[tuple[int, int, int, int]]:
    import numpy as np

    s = np.asarray(sequence)
    found = []
    for period in range(1, len(s) // MIN_BLOCKS + 1):
        same = np.concatenate([[False], s[:-period] == s[period:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for begin, end in zip(edges[::2], edges[1::2], strict=True):
            length = int(end - begin + period)
            count = length // period
            if count >= MIN_BLOCKS:
                found.append((int(begin), length, period, count))
    # A stretch of period p is one of period 2p, 3p ... too: only the shortest period is a layer.
    return [
        (begin, length, period, count)
        for begin, length, period, count in found
        if not any(b == begin and n == length and q < period and period % q == 0 for b, n, q, _ in found)
    ]


def _last_layers(forward: Run, backward: Run) -> tuple[int, ...]:
    """The layers the backward run's first block may be the transpose of.

    The last layer's; or, one block short, the one before it (the last one's transpose differs)
    or the last (layer 0's differs).
    """
    n = forward.count
    return (n - 1,) if backward.count == n else (n - 1, n - 2)


def _forward_layers(eqns: Sequence[Any], forward: Run) -> tuple[dict[int, int], set[int]]:
    """Each value of a forward run's blocks by its layer, and the values each block passes on."""
    layer_of = {id(v): i for i in range(forward.count) for e in forward.block(i) for v in eqns[e].outvars}
    return layer_of, _passed_on(eqns, forward)


def _pairs_reversed(
    eqns: Sequence[Any], forward: tuple[dict[int, int], set[int]], backward: Run, last: int
) -> bool:
    """Whether backward block ``j`` reads forward layer ``last − j``'s values, and no other layer's.

    Of the layer before it, only what that one passed on (a layer's derivative needs its input).
    ``forward``: :func:`_forward_layers` of the forward run.
    """
    layer_of, passed = forward
    for j in range(backward.count):
        own = last - j
        read = {id(v) for e in backward.block(j) for v in eqns[e].invars if _is_var(v) and id(v) in layer_of}
        layers = {layer_of[v] for v in read}
        if own not in layers or not all(
            layer_of[v] == own or (layer_of[v] == own - 1 and v in passed) for v in read
        ):
            return False
    return True


def _passed_on(eqns: Sequence[Any], run: Run) -> set[int]:
    """The values each block of a run reads from the block before it."""
    passed: set[int] = set()
    for i in range(run.count - 1):
        defined = {id(v) for e in run.block(i) for v in eqns[e].outvars}
        passed.update(
            id(v) for e in run.block(i + 1) for v in eqns[e].invars if _is_var(v) and id(v) in defined
        )
    return passed
