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
    "FUSIONS",
    "Kernel",
    "async_collective",
    "chain_role",
    "fused_collective",
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
        "get-dimension-size", "set-dimension-size", "async-update",
    }
)  # fmt: skip
# A fused computation launched as one kernel: a fusion, or the start of an async one (its done
# waits for it and moves nothing).
FUSIONS = frozenset({"fusion", "fusion-start"})
# Custom calls that are library matrix multiplications; their backend config has the dimension numbers.
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$matmul")
# A fused parameter read only through these reads only what they take.
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
# The same elements in another shape: an in-place update's target and result may pass through them.
_VIEWS = frozenset({"bitcast", "reshape"})
# Element for element: a fused slice of their result reads only those elements of their operand
# (a fusion computes only the elements it takes).
_ELEMENTWISE = _VIEWS | {"convert", "copy"}
# TPU's markers of an async collective fusion's start and done (the roots of those fusions);
# tests/test_targets.py fails loudly when a TPU program stops carrying them.
_CHAIN_MARKS = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}
_COLLECTIVE_OPCODES = frozenset(COLLECTIVES)


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
        return _convolution_flops(instruction, _operand_shapes(module, instruction))
    if instruction.opcode == "custom-call" and _gemm_target(instruction):
        numbers = _gemm_config(instruction).get("dot_dimension_numbers", {})
        lhs = _operand_shapes(module, instruction)[:1]
        if not lhs or not instruction.shapes:
            return 0.0
        contracted = math.prod(lhs[0].dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
        return 2.0 * instruction.shapes[0].size * contracted
    return 0.0


def _convolution_flops(instruction: Instruction, operands: list[Shape]) -> float:
    """A convolution's flops: two per multiply-add of an input element with a kernel element.

    Each output element sums ``input features / feature_group_count`` features over the kernel
    positions its window puts on input elements: not on padding, nor on the holes a base
    (``lhs_dilate``) dilation leaves. Per spatial dimension those pairs are counted
    (:func:`_window_pairs`), as XLA's own cost analysis counts them. TPU's compiler writes most
    dots as convolutions, a batch dimension as a spatial one whose window meets one input element
    per output (``dim_labels=0b1f_0o1i->01bf``, ``window={size=8x8 stride=7x7 lhs_dilate=8x8}``):
    the kernel's whole window per output element would count 64 times too many there.
    """
    labels = (instruction.attribute("dim_labels") or "").replace("->", "_").split("_")
    if len(operands) < 2 or not instruction.shapes or len(labels) != 3:
        return 0.0
    (lhs, rhs), out = operands[:2], instruction.shapes[0]
    lhs_labels, rhs_labels, out_labels = labels
    if (len(lhs_labels), len(rhs_labels), len(out_labels)) != (len(lhs.dims), len(rhs.dims), len(out.dims)):
        return 0.0
    spatial = [str(d) for d in range(len(lhs_labels)) if str(d) in lhs_labels]
    window = _window(instruction.attribute("window") or "", len(spatial))
    pairs = 1
    for d, (stride, low, base, dilation) in zip(spatial, window, strict=True):
        pairs *= _window_pairs(
            lhs.dims[lhs_labels.index(d)],
            rhs.dims[rhs_labels.index(d)],
            out.dims[out_labels.index(d)],
            stride=stride,
            low=low,
            base=base,
            dilation=dilation,
        )
    groups = _count(instruction.attribute("feature_group_count"))
    features = lhs.dims[lhs_labels.index("f")] // groups
    per_window = out.dims[out_labels.index("b")] * out.dims[out_labels.index("f")]
    return 2.0 * per_window * features * pairs


def _count(text: str | None) -> int:
    return int(text) if text and text.isdigit() and int(text) > 0 else 1


def _window(text: str, rank: int) -> list[tuple[int, int, int, int]]:
    """``(stride, padding low, base dilation, window dilation)`` per spatial dimension of a window.

    ``window={size=4x8 stride=3x7 pad=0_0x1_1 lhs_dilate=4x8 rhs_dilate=1x1}``: each field is
    one value per spatial dimension joined by ``x``; a field left out is 1 (padding 0).
    """
    fields: dict[str, list[str]] = {}
    for field in text.strip("{}").split():
        key, _, value = field.partition("=")
        fields[key] = value.split("x")

    def values(key: str, default: int, first: bool = False) -> list[int]:
        parts = fields.get(key, [])
        if len(parts) != rank:
            return [default] * rank
        return [int(part.partition("_")[0]) if first else int(part) for part in parts]

    strides, lows = values("stride", 1), values("pad", 0, first=True)  # pad=LOW_HIGH per dimension
    return list(zip(strides, lows, values("lhs_dilate", 1), values("rhs_dilate", 1), strict=True))


def _window_pairs(
    size: int, window: int, out: int, *, stride: int, low: int, base: int, dilation: int
) -> int:
    """How many (output position, window position) pairs of one spatial dimension meet an input element.

    Output position ``o`` and window position ``k`` meet position ``u = o * stride - low + k *
    dilation`` of the input dilated by ``base``, an element where ``u`` is a multiple of ``base``
    in ``[0, (size - 1) * base]``. Counted per window position in closed form: the outputs in
    range form an interval, and those on a multiple of ``base`` one residue modulo
    ``base / gcd(stride, base)``.
    """
    total = 0
    last = (size - 1) * base
    for k in range(window):
        c = k * dilation - low  # u = c + o * stride
        first = max(0, -(c // stride))  # ceil(-c / stride)
        final = min(out - 1, (last - c) // stride)
        if final < first:
            continue
        g = math.gcd(stride, base)
        if c % g:
            continue
        period = base // g
        if period == 1:
            total += final - first + 1
            continue
        start = (-c // g) * pow(stride // g, -1, period) % period  # o = start (mod period)
        total += (final - start) // period - (first - 1 - start) // period
    return total


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
    """What a fused computation reads and writes, per run.

    * An output that is, behind bitcasts and reshapes, a ``dynamic-update-slice`` of a parameter
      (behind the same) is written in place: it writes the update, and its target is not read.
    * A parameter read only through slices (``dynamic-slice``, ``slice``, ``gather``), behind
      bitcasts, reshapes, converts and copies, reads those elements only (at its own element type).
    * A parameter passed to the root tuple as it is (an async collective's buffers) or to a
      collective (whose bytes the link carries, as the report's rows) moves nothing.
    * Everything else: every parameter read whole, every output written whole.
    """
    instructions = module.computations.get(computation, [])
    by_name = {i.name: i for i in instructions}
    users: dict[str, list[Instruction]] = {}
    for instruction in instructions:
        for operand in dict.fromkeys(instruction.operands):
            users.setdefault(operand, []).append(instruction)
    root = next((i for i in instructions if i.root), None)
    if root is None:
        return 0

    def beneath_views(name: str) -> Instruction | None:
        value = by_name.get(name)
        while value is not None and value.opcode in _VIEWS and value.operands:
            value = by_name.get(value.operands[0])
        return value

    outputs = [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else [root]
    in_place: set[str] = set()
    written = 0
    for output in outputs:
        value = beneath_views(output.name)
        if value is not None and value.opcode == "dynamic-update-slice" and len(value.operands) > 1:
            target = beneath_views(value.operands[0])
            update = by_name.get(value.operands[1])
            if target is not None and target.opcode == "parameter" and update is not None:
                in_place.add(value.name)
                written += sum(s.bytes for s in update.shapes)
                continue
        if root.opcode == "tuple" and output.opcode == "parameter":
            continue  # passed through: the same buffer
        if output.opcode in COLLECTIVES:
            continue
        written += sum(s.bytes for s in output.shapes)

    def taken(name: str) -> int | None:
        """How many elements of ``name`` its users read, or ``None``: all of them."""
        if name == root.name:
            return None  # the fusion's result: every element of it is computed
        count = 0
        for user in users.get(name, ()):
            first = bool(user.operands) and user.operands[0] == name
            if first and user.opcode in _ELEMENTWISE:
                inner = taken(user.name)
                if inner is None:
                    return None
                count += inner
            elif first and user.opcode in _SLICING:
                count += sum(s.size for s in user.shapes)
            elif (first and user.name in in_place) or user.opcode in COLLECTIVES:
                continue  # written in place, or sent by the link
            elif user is root and root.opcode == "tuple" and by_name[name].opcode == "parameter":
                continue  # passed through
            else:
                return None
        return count

    reads = 0
    for instruction in instructions:
        if instruction.opcode != "parameter":
            continue
        whole = sum(s.bytes for s in instruction.shapes)
        elements = taken(instruction.name)
        if elements is None or len(instruction.shapes) != 1:
            reads += whole
        else:
            reads += min(Shape(instruction.shapes[0].dtype, (elements,)).bytes, whole)
    return reads + written


def kernel(module: Module, instruction: Instruction) -> Kernel:
    """What an instruction that launches work computes and moves (see :class:`Kernel`).

    A fusion (or the start of an async one) costs what its fused computation reads and writes
    (:func:`_fusion_bytes`: an in-place update its update, a sliced read its slice); the start
    of an async computation (``async-start``), what the instruction it runs costs; an unfused
    in-place update or slice, its update or slice read and written; a library gemm, its operands
    and its result (not its workspace); anything else, its operands and its results.
    """
    opcode = instruction.opcode
    if opcode in FUSIONS:
        body = _called(instruction)
        flops, kind = _matmuls(module, body) if body else (0.0, "")
        return Kernel(instruction, flops, kind, _fusion_bytes(module, body) if body else 0)
    if opcode == "async-start":
        body = _called(instruction)
        wrapped = next((i for i in module.computations.get(body, ()) if i.root), None) if body else None
        if wrapped is not None:
            inner = kernel(module, wrapped)
            return Kernel(instruction, inner.flops, inner.matmul, inner.bytes)
    flops = matmul_flops(module, instruction)
    kind = matmul_type(module, instruction) if flops else ""
    result = instruction.shapes
    if opcode == "custom-call" and _gemm_target(instruction):
        result = result[:1]  # the rest is the library's workspace
    if opcode == "dynamic-update-slice":
        update = _operand_shapes(module, instruction)[1:2]
        return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in update))
    if opcode in _SLICING:
        return Kernel(instruction, flops, kind, 2 * sum(s.bytes for s in result))
    operands = sum(s.bytes for s in _operand_shapes(module, instruction))
    if opcode == "copy-start":  # an async copy: its operand read and written once
        return Kernel(instruction, flops, kind, 2 * operands)
    moved = operands + sum(s.bytes for s in result)
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


def fused_collective(module: Module, instruction: Instruction) -> Instruction | None:
    """The collective a fusion runs inside its fused computation, or ``None``.

    TPU's async collective fusions; a reduce-scatter written as a fused all-reduce and slice.
    """
    if instruction.opcode not in FUSIONS:
        return None
    body = _called(instruction)
    if body is None or body not in module.computations or not module.has_opcode(body, _COLLECTIVE_OPCODES):
        return None
    return next((inner for inner in module.computations[body] if inner.opcode in COLLECTIVES), None)


def chain_role(module: Module, instruction: Instruction) -> str | None:
    """A TPU async collective fusion's part in its chain: ``'start'``, ``'done'``, or ``None``.

    ``None``: a fusion the collective runs beside, or one without TPU's markers.
    """
    body = _called(instruction)
    root = next((i for i in module.computations.get(body, ()) if i.root), None) if body else None
    if root is None or root.opcode != "custom-call":
        return None
    target = (root.attribute("custom_call_target") or "").strip('"')
    return _CHAIN_MARKS.get(target)
