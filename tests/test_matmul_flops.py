"""A program's matrix flops, in every form XLA's compilers write a dot: the TPU's convolutions above all.

TPU's compiler writes every dot as a ``convolution``: a contracted dimension is the input
feature ``f`` (against the kernel's ``i``), the free ones are the batch ``b`` and the output
feature ``o``, and a batch dimension of the dot becomes a spatial one (a digit) whose window
meets one input element per output position (``lhs_dilate`` as large as the window, a stride one
less: ``window={size=8 stride=7 lhs_dilate=8}``). Counting the kernel's whole window per output
element made the issue's attention scores 64 times too many flops (2.83e11 for 1.29e10).

* The forms, each as the TPU compiler printed it for an einsum (its lines copied): flops worked
  out by hand, as the einsum's ``2 x`` the product of every dimension's size.
* A convolution's flops equal XLA's own cost analysis, for random windows (strides, padding,
  both dilations, feature and batch groups): :func:`_window_pairs` counts what XLA's loop counts.
* Compiled here (XLA's GPU and TPU compilers; ``nox -s targets``): for random einsums of batch,
  contracted and free dimensions, the flops of the v5e, v5p and v6e programs equal the H100's
  and the formula; the issue's data-parallel attention step has its flops on 8 v5p chips.
"""

from __future__ import annotations

import math
import string
import textwrap

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from jax import lax

from einshard._cost.xla import _hlo, _hlo_kernels

# ruff: noqa: E501  (the programs below are XLA's lines, as it prints them)


def _program(lhs: str, rhs: str, line: str) -> str:
    """A TPU module whose entry convolves a parameter of type ``lhs`` with one of ``rhs``."""
    return textwrap.dedent(f"""\
        HloModule m, num_partitions=1

        ENTRY %main (a: {lhs}, b: {rhs}) -> f32[] {{
          %a = {lhs} parameter(0)
          %b = {rhs} parameter(1)
          %conv = {line}
          ROOT %out = f32[] constant(0)
        }}
        """)


# (einsum, its sizes, the convolution's operand types, the convolution TPU's compiler wrote for
# it, flops by hand)
FORMS = [
    pytest.param(
        "ij,jk->ik",
        dict(i=256, j=512, k=128),
        "bf16[256,512]",
        "bf16[512,128]",
        "bf16[256,128]{1,0:T(8,128)(2,1)} convolution(%a, %b), dim_labels=bf_io->bf",
        2 * 256 * 512 * 128,
        id="a plain matmul, no window",
    ),
    pytest.param(
        "bij,jk->bik",
        dict(b=16, i=128, j=256, k=64),
        "bf16[16,128,256]",
        "bf16[256,64,1]",
        "bf16[16,128,64]{2,1,0:T(8,128)(2,1)} convolution(%a, %b), window={size=1}, dim_labels=0bf_io0->0bf",
        2 * 16 * 128 * 256 * 64,
        id="a weight with a spatial dimension of 1",
    ),
    pytest.param(
        "bij,bjk->bik",
        dict(b=16, i=128, j=256, k=64),
        "bf16[16,128,256]",
        "bf16[16,256,64]",
        "bf16[16,128,64]{2,1,0:T(8,128)(2,1)} convolution(%a, %b), window={size=16 stride=15 lhs_dilate=16}, dim_labels=0bf_0io->0bf",
        2 * 16 * 128 * 256 * 64,
        id="a batch dimension as a dilated window",
    ),
    pytest.param(
        "bqhd,bkhd->bhqk",
        dict(b=8, q=512, h=8, d=128, k=512),
        "bf16[8,512,8,128]",
        "bf16[8,512,8,128]",
        "bf16[8,8,512,512]{3,2,1,0:T(8,128)(2,1)} convolution(%a, %b), window={size=8x8 stride=7x7 lhs_dilate=8x8}, dim_labels=0b1f_0o1i->01bf",
        2 * 8 * 8 * 512 * 512 * 128,
        id="the issue's attention scores: two batch dimensions",
    ),
    pytest.param(
        "bhqk,bkhd->bqhd",
        dict(b=4, h=8, q=64, k=64, d=128),
        "bf16[4,8,64,64]",
        "bf16[4,64,8,128]",
        "bf16[4,8,128,64]{3,2,1,0:T(8,128)(2,1)} convolution(%a, %b), window={size=4x8 stride=4x8 pad=3_3x7_7 lhs_dilate=3x7 rhs_reversal=1x1}, dim_labels=01bf_0i1o->01fb",
        2 * 4 * 8 * 64 * 64 * 128,
        id="attention's values: padded and reversed windows",
    ),
    pytest.param(
        "abc,abd->cd",
        dict(a=8, b=16, c=128, d=256),
        "bf16[8,16,128]",
        "bf16[8,16,256]",
        "bf16[128,256,1]{1,0,2:T(8,128)(2,1)} convolution(%a, %b), window={size=8}, dim_labels=0fb_0io->bf0",
        2 * 8 * 16 * 128 * 256,
        id="a contracted dimension as the window",
    ),
    pytest.param(
        "bsk,bsnh->bnkh",
        dict(b=4, s=128, k=16, n=8, h=64),
        "bf16[4,128,8,64]",
        "bf16[4,128,16,1]",
        "bf16[4,8,64,16]{3,2,1,0:T(8,128)(2,1)} convolution(%a, %b), window={size=4x1 stride=3x1 lhs_dilate=4x1}, dim_labels=0f1b_0io1->01bf",
        2 * 4 * 128 * 16 * 8 * 64,
        id="a batch window beside a spatial dimension of 1",
    ),
]


@pytest.mark.parametrize(("einsum", "sizes", "lhs", "rhs", "line", "flops"), FORMS)
def test_each_form_of_a_tpu_dot_counts_the_einsum_s_flops(einsum, sizes, lhs, rhs, line, flops):
    assert set(sizes) == set(einsum) - set(",->")
    assert flops == 2 * math.prod(sizes.values())  # the worked figure is the einsum's
    module = _hlo.parse_module(_program(lhs, rhs, line))
    assert _hlo_kernels.program_matmul_flops(module) == flops


def test_a_same_padded_convolution_leaves_out_the_window_s_positions_on_padding():
    # A 3x3 window over a 6x6 image, padded by 1: per dimension 3 x 6 pairs, less the two that
    # fall on the padding, 16; 8 input and 4 output features, 2 images.
    line = (
        "f32[2,6,6,4]{3,2,1,0} convolution(%a, %b), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f"
    )
    module = _hlo.parse_module(_program("f32[2,6,6,8]", "f32[3,3,8,4]", line))
    assert _hlo_kernels.program_matmul_flops(module) == 2 * (2 * 4) * 8 * 16 * 16


def test_a_depthwise_convolution_sums_one_feature_per_group():
    line = "f32[2,6,6,8]{3,2,1,0} convolution(%a, %b), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, feature_group_count=8"
    module = _hlo.parse_module(_program("f32[2,6,6,8]", "f32[3,3,1,8]", line))
    assert _hlo_kernels.program_matmul_flops(module) == 2 * (2 * 8) * 1 * 16 * 16


# The issue's step as the v5p compiler made it: the projection in one fusion, the scores fused
# with their cast and sum (convert_reduce_fusion), the reshape a fusion inside that fusion.
FUSED = """\
HloModule jit_step, num_partitions=8

%fused_computation.4 (param_0.8: bf16[1024,1024]) -> bf16[1024,1024,1] {
  %param_0.8 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %bitcast.7 = bf16[1024,1024,1]{1,0,2:T(8,128)(2,1)} bitcast(%param_0.8)
}

%fused_computation.3 (param_0.7: bf16[8,512,1024], param_1.6: bf16[1024,1024]) -> bf16[8,64,8,8,128] {
  %param_0.7 = bf16[8,512,1024]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.6 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %fusion.2 = bf16[1024,1024,1]{1,0,2:T(8,128)(2,1)} fusion(%param_1.6), kind=kLoop, calls=%fused_computation.4
  %convolution.1 = bf16[8,512,1024]{2,1,0:T(8,128)(2,1)} convolution(%param_0.7, %fusion.2), window={size=1}, dim_labels=0bf_io0->0bf
  ROOT %bitcast.5 = bf16[8,64,8,8,128]{4,3,2,1,0:T(8,128)(2,1)} bitcast(%convolution.1)
}

%fused_computation.1 (param_0.5: bf16[8,64,8,8,128]) -> bf16[8,512,8,128] {
  %param_0.5 = bf16[8,64,8,8,128]{4,3,2,1,0:T(8,128)(2,1)} parameter(0)
  %copy.7 = bf16[8,64,8,8,128]{4,3,1,2,0:T(8,128)(2,1)} copy(%param_0.5)
  ROOT %bitcast.4 = bf16[8,512,8,128]{3,1,2,0:T(8,128)(2,1)} bitcast(%copy.7)
}

%region_0.0 (reduce_sum.0: f32[], reduce_sum.1: f32[]) -> f32[] {
  %reduce_sum.1 = f32[]{:T(128)} parameter(1)
  %reduce_sum.0 = f32[]{:T(128)} parameter(0)
  ROOT %reduce_sum.2 = f32[]{:T(128)} add(%reduce_sum.0, %reduce_sum.1)
}

%fused_computation (param_0.9: bf16[8,64,8,8,128]) -> f32[] {
  %param_0.9 = bf16[8,64,8,8,128]{4,3,2,1,0:T(8,128)(2,1)} parameter(0)
  %fusion = bf16[8,512,8,128]{3,1,2,0:T(8,128)(2,1)} fusion(%param_0.9), kind=kLoop, calls=%fused_computation.1
  %convolution-base-dilated.1 = bf16[8,8,512,512]{3,2,1,0:T(8,128)(2,1)} convolution(%fusion, %fusion), window={size=8x8 stride=7x7 lhs_dilate=8x8}, dim_labels=0b1f_0o1i->01bf
  %convert_element_type.3 = f32[8,8,512,512]{3,2,1,0:T(8,128)} convert(%convolution-base-dilated.1)
  %constant.0.clone.1 = f32[]{:T(128)} constant(0)
  ROOT %reduce.1 = f32[]{:T(128)} reduce(%convert_element_type.3, %constant.0.clone.1), dimensions={0,1,2,3}, to_apply=%region_0.0
}

ENTRY %main.0_spmd (param.1: bf16[1024,1024], param: bf16[8,512,1024]) -> f32[] {
  %param = bf16[8,512,1024]{2,1,0:T(8,128)(2,1)} parameter(1)
  %param.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %convolution_bitcast_fusion = bf16[8,64,8,8,128]{4,3,2,1,0:T(8,128)(2,1)} fusion(%param, %param.1), kind=kOutput, calls=%fused_computation.3
  ROOT %convert_reduce_fusion = f32[]{:T(128)} fusion(%convolution_bitcast_fusion), kind=kOutput, calls=%fused_computation
}
"""
PROJECTION = 2 * 8 * 512 * 1024 * 1024
SCORES = 2 * 8 * 8 * 512 * 512 * 128


def test_the_issue_s_fused_tpu_step_counts_each_dot_once_in_its_kernel():
    module = _hlo.parse_module(FUSED)
    assert _hlo_kernels.program_matmul_flops(module) == PROJECTION + SCORES == 12884901888
    entry = {i.name: i for i in module.computations[module.entry]}
    projection = _hlo_kernels.kernel(module, entry["convolution_bitcast_fusion"])
    scores = _hlo_kernels.kernel(module, entry["convert_reduce_fusion"])
    assert (projection.flops, projection.matmul) == (PROJECTION, "bf16")
    assert (scores.flops, scores.matmul) == (SCORES, "bf16")  # through the fusion inside it, once


# --- a convolution's flops are XLA's own cost analysis's -------------------------------------------


@st.composite
def convolutions(draw):
    """A random ``lax.conv_general_dilated``: 1 or 2 spatial dimensions, any window."""
    rank = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 3]))
    grouped_batch = draw(st.booleans()) and groups > 1
    batch = draw(st.integers(1, 3)) * (groups if grouped_batch else 1)
    features = draw(st.integers(1, 3)) * (1 if grouped_batch else groups)
    outputs = draw(st.integers(1, 3)) * groups
    image = [draw(st.integers(1, 9)) for _ in range(rank)]
    window = [draw(st.integers(1, 4)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    padding = [(draw(st.integers(-1, 3)), draw(st.integers(-1, 3))) for _ in range(rank)]
    lhs_dilation = [draw(st.integers(1, 3)) for _ in range(rank)]
    rhs_dilation = [draw(st.integers(1, 3)) for _ in range(rank)]
    for d in range(rank):  # a window that fits the dilated, padded image
        dilated = (image[d] - 1) * lhs_dilation[d] + 1 + sum(padding[d])
        reach = (window[d] - 1) * rhs_dilation[d] + 1
        if reach > dilated:
            padding[d] = (padding[d][0], padding[d][1] + reach - dilated)
    lhs = jax.ShapeDtypeStruct((batch, features, *image), jnp.float32)
    kernel_features = features if grouped_batch else features // groups
    rhs = jax.ShapeDtypeStruct((outputs, kernel_features, *window), jnp.float32)

    def conv(x, w):
        return lax.conv_general_dilated(
            x,
            w,
            strides,
            padding,
            lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation,
            feature_group_count=1 if grouped_batch else groups,
            batch_group_count=groups if grouped_batch else 1,
        )

    return conv, lhs, rhs


@settings(max_examples=150)
@given(convolutions())
def test_a_convolution_s_flops_are_xla_s_cost_analysis_s(case):
    conv, lhs, rhs = case
    lowered = jax.jit(conv).lower(lhs, rhs)
    text = lowered.as_text(dialect="hlo")
    assert " convolution(" in text
    # XLA's HloCostAnalysis of the program as lowered: the convolution is all it computes.
    assert _hlo_kernels.program_matmul_flops(_hlo.parse_module(text)) == lowered.cost_analysis().get(
        "flops", 0.0
    )


# --- compiled by XLA's GPU and TPU compilers ------------------------------------------------------

TPUS = ("v5e", "v5p", "v6e")


@pytest.fixture(scope="module")
def one_device_each():
    """One compile-only device of each TPU generation and of an H100, by target name."""
    from tests.test_targets import HAS_GPU_COMPILER, HAS_TPU_COMPILER, REQUIRED

    if not (HAS_GPU_COMPILER and HAS_TPU_COMPILER) and not REQUIRED:
        pytest.skip("XLA's GPU and TPU compilers are not installed: nox -s targets installs them")
    import os

    from einshard._cost.hardware import _compilers, _target

    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return {name: _compilers.target_devices(_target.parse_target(name, 1))[0] for name in (*TPUS, "h100")}


@st.composite
def einsums(draw):
    """A random einsum that is a matrix product: batch, contracted and free dimensions.

    At least one contracted dimension and one free dimension on each side: without them XLA's
    compilers (GPU and TPU alike) write the product as elementwise multiplies and sums. The
    contracted and free sizes are multiples of 8: XLA's GPU compiler pads a bf16 gemm's other
    sizes to one (a 2 x 2 by 2 x 2 product runs as 8 x 8 by 8 x 8), and then does those flops.
    """
    letters = iter(string.ascii_lowercase)
    sizes = st.sampled_from([8, 16, 24, 40, 64, 128])
    batch_sizes = st.sampled_from([2, 3, 5, 8, 12])
    batch = [next(letters) for _ in range(draw(st.integers(0, 2)))]
    contracted = [next(letters) for _ in range(draw(st.integers(1, 2)))]
    left = [next(letters) for _ in range(draw(st.integers(1, 2)))]
    right = [next(letters) for _ in range(draw(st.integers(1, 2)))]
    size = {
        letter: draw(batch_sizes if letter in batch else sizes)
        for letter in batch + contracted + left + right
    }
    a = "".join(draw(st.permutations(batch + contracted + left)))
    b = "".join(draw(st.permutations(batch + contracted + right)))
    out = "".join(draw(st.permutations(batch + left + right)))
    return f"{a},{b}->{out}", tuple(size[c] for c in a), tuple(size[c] for c in b), size


def _compiled_flops(device, equation: str, a: tuple[int, ...], b: tuple[int, ...]) -> float:
    placed = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed) for shape in (a, b)]
    compiled = jax.jit(lambda x, y: jnp.einsum(equation, x, y)).lower(*args).compile()
    return _hlo_kernels.program_matmul_flops(_hlo.parse_module(compiled.as_text()))


@settings(max_examples=8)
@given(einsums())
def test_a_random_einsum_s_flops_on_each_tpu_are_the_h100_s_and_the_formula(one_device_each, case):
    equation, a, b, size = case
    formula = 2 * math.prod(size.values())
    flops = {name: _compiled_flops(device, equation, a, b) for name, device in one_device_each.items()}
    assert flops == dict.fromkeys(flops, formula), (equation, a, b)


def _attention_step(w, q):
    x = (q @ w).reshape(64, 512, 8, 128)
    return jnp.einsum("bqhd,bkhd->bhqk", x, x).astype(jnp.float32).sum()


def test_the_issue_s_data_parallel_attention_has_its_flops_on_8_v5p(one_device_each):
    import einshard

    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((64, 512, 1024), jnp.bfloat16)
    rules = einshard.strategies.data_parallel()
    report = einshard.explain_step(_attention_step, w, q, rules=rules, target="v5p", n_devices=8, quiet=True)
    # Per device, a batch of 8: 2 x 8 x 512 x 1024 x 1024 for the projection, 2 x 8 x 8 x 512 x
    # 512 x 128 for the scores (an H100's report has the same: the test above). It was 2.83e11.
    assert report.flops == PROJECTION + SCORES == 12884901888
