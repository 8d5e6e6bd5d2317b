"""What XLA's compilers print about a program, read: a rematerialization, a refusal for memory.

Pure text, no JAX: the message of an involuntary full rematerialization (:func:`parse_remat`,
for its finding) and a TPU compiler's refusal of a program that does not fit the chip's memory
(:func:`parse_out_of_memory`, for the verdict that says so).
"""

from __future__ import annotations

import dataclasses
import re

from ._collectives import split_counts
from ._hlo import Instruction, parse_instruction

__all__ = ["OutOfMemory", "Remat", "parse_out_of_memory", "parse_remat"]

_REMAT = re.compile(
    r"cannot go from sharding (?P<before>.*?) to (?P<after>.*?) efficiently for HLO operation "
    r"(?P<op>.*?)(?:\. As the last resort|$)"
)


# libtpu's refusal of a program that does not fit: the newer form, then the older.
_OUT_OF_MEMORY = (
    re.compile(
        r"required for HLO temporaries \((?P<needed>[\d.]+[KMGTPE]?i?B?)\) exceeds available "
        r"(?P<memory>\w+) \((?P<available>[\d.]+[KMGTPE]?i?B?)\)"
    ),
    re.compile(
        r"Ran out of memory in memory space (?P<memory>\w+)\. Used (?P<needed>[\d.]+[KMGTPE]?i?B?) "
        r"of (?P<available>[\d.]+[KMGTPE]?i?B?) "
    ),
)


_SIZE = re.compile(r"([\d.]+)([KMGTPE]?)")


@dataclasses.dataclass(frozen=True)
class Remat:
    """XLA's message that it fell back to an involuntary full rematerialization of an array.

    Attributes:
        before: The sharding it could not move the array from, as printed.
        after: The sharding it could not move it to, as printed.
        before_splits: How many ways ``before`` splits each dimension (:func:`split_counts`), or ``None``.
        after_splits: The same for ``after``.
        operation: The instruction the message prints (its shape per device), or ``None``.
    """

    before: str
    after: str
    before_splits: list[int] | None
    after_splits: list[int] | None
    operation: Instruction | None


def parse_remat(message: str) -> Remat | None:
    """The rematerialization a compiler message reports (``cannot go from sharding ...``), or ``None``."""
    match = _REMAT.search(message)
    if match is None:
        return None
    before, after = match.group("before"), match.group("after")
    operation = parse_instruction(match.group("op"))
    return Remat(before, after, split_counts(before), split_counts(after), operation)


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """A compiler's refusal of a program that does not fit a device's memory.

    Attributes:
        needed: The bytes per device the program needs, as the compiler counts them (rounded
            as it prints them: to 0.01 of its unit).
        available: The bytes per device the compiler has for a program (a TPU chip's HBM less
            what its runtime keeps).
        memory: The memory it ran out of, as printed (``'HBM'``).
    """

    needed: int
    available: int
    memory: str


def parse_out_of_memory(message: str) -> OutOfMemory | None:
    """The refusal in a compiler's error message, or ``None`` when it is not one.

    libtpu's two forms: ``RESOURCE_EXHAUSTED: ... CompileTimeHbmOom: Ran out of memory on HBM,
    the total memory required for HLO temporaries (47.68G) exceeds available HBM (31.24G)``
    (libtpu 0.0.50), and ``... Ran out of memory in memory space hbm. Used 21.95G of 15.48G hbm.``
    (older). Sizes are in binary units (``G``: 2**30 bytes).
    """
    for pattern in _OUT_OF_MEMORY:
        match = pattern.search(message)
        if match is not None:
            needed, available = _bytes(match.group("needed")), _bytes(match.group("available"))
            return OutOfMemory(needed, available, match.group("memory").upper())
    return None


def _bytes(size: str) -> int:
    """``'47.68G'`` in bytes (binary units, as XLA prints sizes)."""
    match = _SIZE.match(size)
    assert match is not None
    number, unit = match.groups()
    return round(float(number) * 1024 ** " KMGTPE".index(unit or " "))
