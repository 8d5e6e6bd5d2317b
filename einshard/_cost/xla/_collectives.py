"""A compiled program's collectives: their device groups, how often they run; shardings as printed.

Device groups in every form XLA prints them: explicit lists ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]``
and ``[4,2]<=[2,4]T(1,0)``, the named-mesh form ``mesh['a'=2,'b'=4] {'b'}`` of newer XLA, and a
permute's pairs; a TPU collective's copies in async collective fusions (one run, by
:func:`chain_key`); a megascale transfer between TPU slices (:func:`megascale`). On
:mod:`._hlo`'s parsed instructions; pure text, no JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Iterable, Sequence

from ..._language._union import UnionFind
from ._hlo import COLLECTIVES, Instruction, Module, opcode_line

__all__ = [
    "Collective",
    "chain_key",
    "collectives",
    "device_groups",
    "megascale",
    "megascale_receiver",
    "parse_replica_groups",
    "split_counts",
]

# A program compiled for several TPU slices is one slice's program; what crosses between slices
# is a megascale transfer: a host-transfer send (and its recv) whose frontend attributes name
# the collective it is (``_xla_megascale_transfer_type``) and the slices it joins
# (``_xla_megascale_target="{1,2}x{0:7}"``: slices 1 and 2, every device 0-7 of each).
_MEGASCALE_KINDS = {
    "ALL_GATHER": "all-gather", "ALL_REDUCE": "all-reduce", "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}  # fmt: skip


_COLLECTIVE_LINE = opcode_line(frozenset(COLLECTIVES))
_MEGASCALE_LINE = re.compile(r"\ssend\(.*_xla_megascale_transfer_type")
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="?(\w+)')
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="?\{([\d,\s]*)\}')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="?([^",}]+)')
_MESH_AXIS = re.compile(r"'?([^'=,\s\]]+)'?\s*=\s*(\d+)")
_SUB_AXIS = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")
_CHAIN = re.compile(r'chain_id="?(\d+)')
_NAMED_SHARDING = re.compile(r"mesh\[(?P<mesh>[^\]]*)\][^\[]*\[(?P<dims>.*)\]")


def _iota_groups(text: str) -> list[list[int]]:
    """``[G,S]<=[d1,d2,...]T(perm)``: iota over the dims, transposed, reshaped into G groups of S."""
    match = re.fullmatch(r"\[([\d,]+)\]\s*<=\s*\[([\d,]+)\]\s*(?:T\(([\d,]+)\))?", text.strip())
    if match is None:
        raise AssertionError(
            f"einshard cannot read this XLA text (please report it): unknown iota replica groups {text!r}"
        )
    shape = [int(n) for n in match.group(1).split(",")]
    dims = [int(n) for n in match.group(2).split(",")]
    perm = [int(n) for n in match.group(3).split(",")] if match.group(3) else list(range(len(dims)))
    ids = _transposed_iota(dims, perm)
    size = shape[-1] if len(shape) > 1 else shape[0]
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _transposed_iota(dims: Sequence[int], perm: Sequence[int]) -> list[int]:
    """The flat ids of ``iota(prod(dims)).reshape(dims).transpose(perm)``, row-major."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    return [
        sum(index[k] * strides[perm[k]] for k in range(len(perm)))
        for index in itertools.product(*(range(d) for d in out_dims))
    ]


def _named_groups(text: str) -> list[list[int]]:
    """The groups of the named-mesh form ``mesh['a'=2,'b'=4] {'b'}``.

    The mesh may carry device ids after its axes, and the groups name sub-axes ``'b':(1)2``:
    each group holds the devices that vary over the listed (sub-)axes, the others fixed.
    """
    match = re.match(r"mesh\[(.*?)\],?\s*(.*?)\s*\{([^{}]*)\}\s*$", text.strip(), re.DOTALL)
    if match is None:
        raise AssertionError(
            "einshard cannot read this XLA text (please report it): "
            f"unknown named-mesh replica groups {text!r}"
        )
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(match.group(1))]
    devices_text = match.group(2).strip()
    total = math.prod(size for _, size in axes)
    if devices_text:
        iota = re.search(r"(?:<=|device_ids=\()\s*\[([\d,]+)\]\s*(?:T\(([\d,]+)\))?", devices_text)
        listed = re.search(r"\[([\d,\s]+)\]", devices_text)
        if iota:
            dims = [int(n) for n in iota.group(1).split(",")]
            perm = [int(n) for n in iota.group(2).split(",")] if iota.group(2) else list(range(len(dims)))
            ids = _transposed_iota(dims, perm)
        elif listed:
            ids = [int(n) for n in listed.group(1).split(",") if n.strip()]
        else:
            raise AssertionError(
                "einshard cannot read this XLA text (please report it): "
                f"unknown device ids in named-mesh replica groups {text!r}"
            )
    else:
        ids = list(range(total))
    # Split each axis into its sub-axes as named (pre-size, size), finest first within an axis.
    factors: list[tuple[str, int, int]] = []  # (axis, pre, size) for every piece, in mesh order
    chosen = []
    for item in _SUB_AXIS.findall(match.group(3)):
        chosen.append((item[0], int(item[1]) if item[1] else None, int(item[2]) if item[2] else None))
    for name, size in axes:
        cuts = sorted(
            {1, size}
            | {p for n, p, s in chosen if n == name and p}
            | {p * s for n, p, s in chosen if n == name and p and s}
        )
        for pre, nxt in itertools.pairwise(cuts):
            factors.append((name, pre, nxt // pre))
    varying = set()
    for name, pre, size in chosen:
        for index, (axis, p, s) in enumerate(factors):
            if axis == name and (pre is None or (p >= pre and p * s <= pre * size)):
                varying.add(index)
    # Within an axis, a smaller pre-size is the more major piece.
    ordered = []
    for name, _ in axes:
        ordered += sorted((i for i, f in enumerate(factors) if f[0] == name), key=lambda i: factors[i][1])
    sizes = [factors[i][2] for i in ordered]
    groups: dict[tuple[int, ...], list[int]] = {}
    for position, coords in enumerate(itertools.product(*(range(s) for s in sizes))):
        key = tuple(c for c, i in zip(coords, ordered, strict=True) if i not in varying)
        groups.setdefault(key, []).append(ids[position])
    return list(groups.values())


def parse_replica_groups(text: str | None, num_devices: int) -> list[list[int]]:
    """Device groups from a ``replica_groups=`` value, in any of the forms XLA prints.

    >>> parse_replica_groups('{{0,1},{2,3}}', 4)
    [[0, 1], [2, 3]]
    >>> parse_replica_groups('[2,2]<=[2,2]T(1,0)', 4)
    [[0, 2], [1, 3]]
    >>> parse_replica_groups("mesh['a'=2,'b'=2] {'a'}", 4)
    [[0, 2], [1, 3]]
    """
    if text is None or text.strip() in ("", "{}"):
        return [list(range(num_devices))]
    text = text.strip()
    if text.startswith("{"):
        groups = [
            [int(n) for n in group.split(",") if n.strip()]
            for group in re.findall(r"\{([\d,\s]*)\}", text[1:-1])
        ]
        return groups or [list(range(num_devices))]
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("mesh"):
        return _named_groups(text)
    raise AssertionError(
        f"einshard cannot read this XLA text (please report it): unknown replica groups {text!r}"
    )


def device_groups(instruction: Instruction, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups a collective runs over (a permute: the devices of each cycle)."""
    pairs = instruction.attribute("source_target_pairs")
    if instruction.opcode.startswith("collective-permute") and pairs is not None:
        return _permute_groups(pairs)
    return _groups(instruction.attribute("replica_groups"), num_devices)


@functools.lru_cache(maxsize=1024)
def _groups(text: str | None, num_devices: int) -> tuple[tuple[int, ...], ...]:
    # Most collectives of a program share a few group texts: each is read once.
    return tuple(tuple(group) for group in parse_replica_groups(text, num_devices))


@functools.lru_cache(maxsize=1024)
def _permute_groups(pairs: str) -> tuple[tuple[int, ...], ...]:
    edges = [tuple(int(n) for n in pair.split(",")) for pair in re.findall(r"\{(\d+,\d+)\}", pairs)]
    return tuple(tuple(group) for group in _connected(edges))


def _connected(edges: Iterable[tuple[int, ...]]) -> list[list[int]]:
    sets = UnionFind()
    for edge in edges:
        sets.join(edge)
    return sets.groups()


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction, as read from the text (before mapping onto a mesh)."""

    instruction: Instruction
    kind: str
    groups: tuple[tuple[int, ...], ...]
    times: int
    times_known: bool


def chain_key(instruction: Instruction) -> tuple[str, str, str] | None:
    """``(kind, channel_id, chain_id)`` of a copy of a collective in TPU's async collective fusions.

    ``None`` for any other instruction.
    """
    kind = COLLECTIVES.get(instruction.opcode)
    if kind is None:
        return None
    channel = instruction.attribute("channel_id")
    chain = _CHAIN.search(instruction.attribute("frontend_attributes") or "")
    if channel is None or chain is None:
        return None
    return kind, channel, chain.group(1)


def megascale(instruction: Instruction) -> tuple[str, int] | None:
    """``(kind, slices)`` of a send of a megascale transfer between TPU slices, else ``None``.

    A transfer type the reader does not know is costed as a permute (its array sent once).
    """
    if instruction.opcode != "send":
        return None
    attributes = instruction.attribute("frontend_attributes") or ""
    kind = _MEGASCALE_TYPE.search(attributes)
    if kind is None:
        return None
    target = _MEGASCALE_SLICES.search(attributes)
    slices = len([s for s in target.group(1).split(",") if s.strip()]) if target is not None else 2
    return _MEGASCALE_KINDS.get(kind.group(1), "collective-permute"), max(slices, 2)


def megascale_receiver(instructions: Sequence[Instruction]) -> dict[str, str]:
    """Each megascale recv's name -> its send's (the same rendezvous), in one computation."""
    sends: dict[str, str] = {}
    recvs: dict[str, str] = {}
    for instruction in instructions:
        if instruction.opcode not in ("send", "recv"):
            continue
        key = _RENDEZVOUS.search(instruction.attribute("frontend_attributes") or "")
        if key is not None:
            (sends if instruction.opcode == "send" else recvs)[key.group(1)] = instruction.name
    return {recv: sends[key] for key, recv in recvs.items() if key in sends}


def collectives(module: Module) -> list[Collective]:
    """Every collective of the program that runs, with its groups and how often it runs.

    TPU's compiler splits one collective over several async collective fusions (each fusion
    carries a copy of the instruction, with the same ``channel_id`` and a ``chain_id``): such a
    run is counted once, at its first copy in the text (:func:`chain_key`). A megascale
    transfer between TPU slices (:func:`megascale`) is one too, at its send, over groups of a
    device and its copies on the other slices (``d + k * num_partitions``: the program is one
    slice's).
    """
    runs = module.times()
    out = []
    chained: set[tuple[str, str, str]] = set()
    found = set(module.containing(_COLLECTIVE_LINE)) | set(module.containing(_MEGASCALE_LINE))
    for computation in (name for name in module.computations.lines if name in found):
        times, known = runs.get(computation, (0, True))
        if times == 0:
            continue
        for instruction in module.computations[computation]:
            kind = COLLECTIVES.get(instruction.opcode)
            between = megascale(instruction) if kind is None else None
            if between is not None:
                n = module.num_partitions
                kind, slices = between
                groups = tuple(tuple(d + k * n for k in range(slices)) for d in range(n))
                out.append(Collective(instruction, kind, groups, times, known))
                continue
            if kind is None:
                continue
            key = chain_key(instruction)
            if key is not None:
                if key in chained:
                    continue
                chained.add(key)
            groups = device_groups(instruction, module.num_partitions)
            out.append(Collective(instruction, kind, groups, times, known))
    return out


def split_counts(sharding: str) -> list[int] | None:
    """How many ways each dimension is split, from a sharding as XLA prints it, or ``None``."""
    text = sharding.strip()
    named = _NAMED_SHARDING.search(text)
    if named:
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(named.group("mesh"))}
        counts = []
        for dim in re.findall(r"\{([^{}]*)\}", named.group("dims")):
            count = 1
            for axis, _, sub in _SUB_AXIS.findall(dim):
                count *= int(sub) if sub else sizes.get(axis, 1)
            counts.append(count)
        return counts
    tiled = re.search(r"devices=\[([\d,]+)\]", text)
    if tiled:
        counts = [int(n) for n in tiled.group(1).split(",")]
        if "last_tile_dim_replicate" in text or "last_tile_dims" in text:
            counts = counts[:-1]
        return counts
    return None
