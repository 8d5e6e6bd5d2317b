"""What each kernel of a compiled program computes and moves: XLA's text, read for a step's time.

The second half of the reader of XLA's text (``_hlo`` holds the first; the two are one reader,
cut for length): each kernel's matrix flops (its dots, convolutions and library gemms, with their
dimension numbers), the element type and precision its matrix units run at, and the bytes it
reads and writes. XLA's own cost analysis is not used for a GPU program: for a bf16 GPT step on
one H200 it reported 1.05e12 flops where the step's dots come to 4.52e12 (it leaves out the dots
inside Triton gemm fusions), and a compile-only TPU program has none at all.
"""

from __future__ import annotations

import dataclasses
import json
import math

from ._hlo import COLLECTIVES, Instruction, Module, Shape

__all__ = [
    "FREE_OPCODES",
    "Kernel",
    "async_collective",
    "is_async_done",
    "kernel",
    "matmul_flops",
    "matmul_type",
    "program_matmul_flops",
]
FREE_OPCODES = frozenset(
    {
        "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "token",
        "get-dimension-size", "set-dimension-size",
    }
)  # fmt: skip
# Custom calls that are library matrix multiplications; their backend config has the dimension numbers.
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$matmul")
# A fused parameter read only through these reads only what they take.
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_VIEWS = frozenset({"bitcast", "reshape"})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What one instruction that launches work computes and moves, per run.

    Attributes:
        instruction: The instruction (a fusion, a library call, a copy ...).
        flops: Its matrix flops (dots, convolutions, gemms: two per multiply-add).
        matmul: The element type its matrix flops run at (``'bf16'``, ``'f8e4m3fn'``, ``'tf32'``
            for f32 through TF32, ``'f32'`` at full precision), or ``''`` without any.
        bytes: The bytes it reads and writes (an in-place update: the update; a sliced operand:
            the slice).
    """

    instruction: Instruction
    flops: float
    matmul: str
    bytes: int


def _operand_shapes(module: Module, instruction: Instruction) -> list[Shape]:
    shapes = []
    for name in instruction.operands:
        operand = module.instruction(name)
        if operand is not None:
            shapes += operand.shapes
    return shapes


def _gemm_config(instruction: Instruction) -> dict:
    return instruction.backend_config().get("gemm_backend_config", {})


def matmul_flops(module: Module, instruction: Instruction) -> float:
    """The matrix flops of one dot, convolution or library gemm (0 for anything else)."""
    if instruction.opcode == "dot":
        lhs = _operand_shapes(module, instruction)[:1]
        if not lhs or not instruction.shapes:
            return 0.0
        contracted = math.prod(lhs[0].dims[d] for d in instruction.numbers("lhs_contracting_dims"))
        return 2.0 * instruction.shapes[0].size * contracted
    if instruction.opcode == "convolution":
        shapes = _operand_shapes(module, instruction)
        labels = instruction.attribute("dim_labels") or ""
        kernel_labels = labels.partition("_")[2].partition("->")[0]
        if len(shapes) < 2 or "o" not in kernel_labels or not instruction.shapes:
            return 0.0
        kernel = shapes[1]
        outputs = kernel.dims[kernel_labels.index("o")] if len(kernel.dims) == len(kernel_labels) else 1
        return 2.0 * instruction.shapes[0].size * kernel.size / max(outputs, 1)
    if instruction.opcode == "custom-call" and _gemm_target(instruction):
        numbers = _gemm_config(instruction).get("dot_dimension_numbers", {})
        lhs = _operand_shapes(module, instruction)[:1]
        if not lhs or not instruction.shapes:
            return 0.0
        contracted = math.prod(lhs[0].dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
        return 2.0 * instruction.shapes[0].size * contracted
    return 0.0


def _gemm_target(instruction: Instruction) -> bool:
    target = (instruction.attribute("custom_call_target") or "").strip('"')
    return target in _GEMM_TARGETS


def matmul_type(module: Module, instruction: Instruction) -> str:
    """The element type a dot's matrix units run at: its operands', f32 split by precision.

    An f32 dot at the default precision runs through TF32 on a GPU (JAX's default); at
    ``highest`` (or XLA's ``dot_f32_f32_f32`` algorithm) it does not.
    """
    shapes = _operand_shapes(module, instruction)
    dtype = shapes[0].dtype if shapes else (instruction.shapes[0].dtype if instruction.shapes else "")
    if dtype != "f32":
        return dtype
    precision = instruction.attribute("operand_precision") or ""
    precision += instruction.attribute("algorithm") or ""
    if instruction.opcode == "custom-call":
        config = _gemm_config(instruction).get("precision_config", {})
        precision = json.dumps(config)
    precision = precision.lower()
    if "tf32" in precision:
        return "tf32"
    if "highest" in precision or "f32_f32_f32" in precision:
        return "f32"
    return "tf32"


def _called(instruction: Instruction, role: str = "calls") -> str | None:
    return next((name for r, name in instruction.called if r == role), None)


def _matmuls(module: Module, computation: str) -> tuple[float, str]:
    """The matrix flops of a computation and those it calls (a fusion's body), and their type."""
    flops, kind = 0.0, ""
    for instruction in module.computations.get(computation, ()):
        f = matmul_flops(module, instruction)
        if f:
            flops += f
            kind = kind or matmul_type(module, instruction)
        for role, callee in instruction.called:
            if role == "calls":
                inner, inner_kind = _matmuls(module, callee)
                flops += inner
                kind = kind or inner_kind
    return flops, kind


def _fusion_bytes(module: Module, computation: str) -> int:
    """What a fusion reads and writes: a parameter only sliced, its slices; an updated one, the update."""
    instructions = module.computations.get(computation, [])
    users: dict[str, list[Instruction]] = {}
    for instruction in instructions:
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)
    root = next((i for i in instructions if i.root), None)
    if root is None:
        return 0
    by_name = {i.name: i for i in instructions}
    outputs = [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else [root]
    in_place: set[str] = set()
    written = 0
    for output in outputs:
        if output.opcode == "dynamic-update-slice" and len(output.operands) > 1:
            target = output.operands[0]
            while target in by_name and by_name[target].opcode in _VIEWS:
                target = by_name[target].operands[0]
            in_place.add(target)
            update = by_name.get(output.operands[1])
            written += sum(s.bytes for s in update.shapes) if update is not None else 0
        else:
            written += sum(s.bytes for s in output.shapes)

    def read(name: str, whole: int) -> int:
        taken = 0
        for user in users.get(name, ()):
            if user.opcode in _VIEWS:
                taken += read(user.name, whole)
            elif user.opcode in _SLICING and user.operands and user.operands[0] == name:
                taken += sum(s.bytes for s in user.shapes)
            elif user.opcode == "dynamic-update-slice" and user.operands and user.operands[0] == name:
                continue
            else:
                return whole
        return min(taken, whole)

    reads = 0
    for instruction in instructions:
        if instruction.opcode == "parameter" and instruction.name not in in_place:
            reads += read(instruction.name, sum(s.bytes for s in instruction.shapes))
    return reads + written


def kernel(module: Module, instruction: Instruction) -> Kernel:
    """What an instruction that launches work computes and moves (see :class:`Kernel`)."""
    opcode = instruction.opcode
    if opcode == "fusion":
        body = _called(instruction)
        flops, kind = _matmuls(module, body) if body else (0.0, "")
        return Kernel(instruction, flops, kind, _fusion_bytes(module, body) if body else 0)
    flops = matmul_flops(module, instruction)
    kind = matmul_type(module, instruction) if flops else ""
    result = instruction.shapes
    if opcode == "custom-call" and _gemm_target(instruction):
        result = result[:1]  # the rest is the library's workspace
    if opcode == "dynamic-update-slice":
        update = _operand_shapes(module, instruction)[1:2]
        return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in update))
    if opcode in ("dynamic-slice", "slice", "gather"):
        return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in result))
    moved = sum(s.bytes for s in _operand_shapes(module, instruction)) + sum(s.bytes for s in result)
    return Kernel(instruction, flops, kind, moved)


def program_matmul_flops(module: Module) -> float:
    """The matrix flops of one run of the program.

    Every dot, convolution and library gemm, in whatever computation it is (fusion bodies
    included), times how often that computation runs.
    """
    runs = module.times()
    total = 0.0
    for name in module.computations:
        times = runs.get(name, (0, True))[0]
        if not times:
            continue
        for instruction in module.computations[name]:
            if instruction.opcode in ("dot", "convolution", "custom-call"):
                total += times * matmul_flops(module, instruction)
    return total


def async_collective(module: Module, instruction: Instruction) -> Instruction | None:
    """The collective an async ``-start`` (or a generic ``async-start``) begins, or ``None``."""
    if instruction.opcode in COLLECTIVES and instruction.opcode.endswith("-start"):
        return instruction
    if instruction.opcode == "async-start":
        body = _called(instruction)
        for inner in module.computations.get(body, ()) if body else ():
            if inner.opcode in COLLECTIVES:
                return inner
    return None


def is_async_done(instruction: Instruction) -> bool:
    """Whether the instruction waits for an async ``-start`` (its first operand)."""
    return instruction.opcode.endswith("-done") or instruction.opcode == "async-done"
