"""The JAX primitives the jaxpr reader knows, by what they do to a parameter's axes.

Every primitive JAX defines is accounted for here or by a handler of its own in ``_jaxpr``
(``_jaxpr.HANDLED``): it is *read* (its outputs' axes are followed from its inputs') or it
*stops* the reading (:data:`STOPS`, each with its reason: the axes it reads cannot be split, the
values it makes are whole activations). ``tests/test_primitives.py`` goes through every
primitive of the installed JAX and fails on one that is in neither, so a primitive a new JAX adds
is placed here on purpose instead of guessed at.

A primitive of another library (none of these) is read as elementwise when every array in and
out has one shape and no parameter names an axis (:data:`AXIS_PARAMS`), through its sub-program
when it has exactly one, and stops the reading otherwise.
"""

from __future__ import annotations


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Primitives that act on each element alone (their outputs have their inputs' shape, or
# broadcast scalars). Names of older or newer JAX versions stay: a name JAX does not define is
# harmless.
ELEMENTWISE = _words(
    """
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil
    clamp clz complex conj convert_element_type copy copy_p cos cosh digamma div eq eq_to erf
    erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag integer_pow
    is_finite le le_to lgamma log log1p log2 logistic lt lt_to max min mul mulhi ne neg nextafter
    not one_minus_square or polygamma polynomial population_count pow random_gamma_grad real
    reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan
    tanh xor zeta
    """
)
# One output per operand, each the operand itself: placement, scheduling and type hints.
IDENTITY = _words(
    """
    optimization_barrier device_put sharding_constraint mesh_cast reshard pvary name stage
    layout_constraint relayout with_memory_space_constraint reduced_vary_cast reduced_vary_cast_p
    vary_unreduced_cast vary_unreduced_cast_p preduced dce_sink
    """
)
REDUCE = _words(
    "reduce reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin"
)
CUMULATIVE = _words("cumsum cumprod cummax cummin cumlogsumexp")
# Outputs that carry nothing of a parameter's axes: random bits, and values that depend on
# their operands' shapes only (iota, zeros, empty buffers, tokens, a device's index).
RANDOM = _words(
    """
    random_bits random_seed random_split random_fold_in random_wrap random_unwrap random_clone
    random_gamma threefry2x32 threefry4x32 philox2x32 philox4x32 iota_2x32_shape rng_bit_generator
    rng_uniform
    """
)
CONSTANT = _words(
    """
    iota empty empty2 zeros_like create_token after_all axis_index platform_index dim_as_value
    dimension_size shape_assertion
    """
)
# Calls whose one sub-program is the computation itself: read through it, inputs to inputs and
# outputs to outputs.
CALLS = _words(
    """
    jit pjit closed_call core_call call eval_jaxpr remat2 checkpoint custom_jvp_call
    custom_jvp_call_jaxpr custom_vjp_call custom_vjp_call_jaxpr custom_vmap_call shard_map
    composite
    """
)
# Parameter names that say a primitive acts along axes: an unknown primitive with one of them
# is not taken as elementwise even when its shapes agree.
AXIS_PARAMS = _words("axis axes dimension dimensions permutation fft_type fft_lengths window_dimensions")

_CALLBACK = "which einshard cannot see into"
_KERNEL = "a fused kernel, which einshard cannot see into"
_COLLECTIVE = (
    "a collective inside shard_map: a device's part, which the reading (of whole arrays) does not follow"
)
_LINALG = "a factorization or solve of whole matrices, which a split matrix axis would need gathered"
_STATE = "a mutable reference (Pallas or jax.ref state), whose reads and writes the reading does not follow"
_HIJAX = "a JAX-internal value of its own type, which the reading does not follow"

_COLLECTIVES = _words(
    """
    psum pmax pmin ppermute pbroadcast pbroadcast_dynamic all_gather all_gather_invariant
    all_gather_reduced all_to_all ragged_all_to_all reduce_scatter psum_invariant
    unreduced_psum unreduced_pmax unreduced_pmin unreduced_reduce_scatter psend precv
    all_gather_start all_gather_done all_gather_reduced_start all_to_all_start all_to_all_done
    ppermute_start ppermute_done psum_start psum_done psum_invariant_start reduce_scatter_start
    reduce_scatter_done pbroadcast_start pbroadcast_done unreduced_psum_start
    unreduced_reduce_scatter_start
    """
)
_LINALGS = _words(
    """
    cholesky cholesky_update lu lu_pivots_to_permutation qr geqrf geqp3 ormqr
    householder_product eig eigh svd schur hessenberg tridiagonal tridiagonal_solve
    triangular_solve symmetric_product
    """
)
_STATES = _words(
    """
    get swap addupdate new_ref empty_ref free_ref freeze accum_grad_in_ref create_linear
    broadcast_to pin unpin run_state
    """
)

# Primitives that stop the reading, each with its reason. The axes they read cannot be split
# (the leaves are replicated, the note says where) and what they make is a whole activation.
# The reason follows "read by <primitive>, " in a note.
STOPS: dict[str, str] = {
    # calls out of the traced program
    "pure_callback": _CALLBACK,
    "io_callback": _CALLBACK,
    "debug_callback": _CALLBACK,
    "debug_print": _CALLBACK,
    "inspect_sharding": _CALLBACK,
    "ffi_call": _CALLBACK,
    "custom_call": _CALLBACK,
    "call_exported": "a serialized (jax.export) program, which einshard cannot see into",
    "custom_partitioning": "a function with its own partitioning rule, which einshard cannot see into",
    "pallas_call": _KERNEL,
    "core_map": _KERNEL,
    "cudnn_fusion": _KERNEL,
    "dot_product_attention_fwd": _KERNEL,
    "dot_product_attention_bwd": _KERNEL,
    "dot_product_attention_fwd_wrapper": _KERNEL,
    "dot_product_attention_bwd_wrapper": _KERNEL,
    "dot_product_attention_fp8_fwd": _KERNEL,
    "dot_product_attention_fp8_bwd": _KERNEL,
    "dot_product_attention_fp8_fwd_wrapper": _KERNEL,
    "dot_product_attention_fp8_bwd_wrapper": _KERNEL,
    "scaled_matmul": _KERNEL,
    "scaled_matmul_wrapper": _KERNEL,
    "scaled_dot": "a block-scaled (low-precision) product, whose scales the reading does not follow",
    "ragged_dot_general": "a grouped (ragged) product, as in a mixture of experts, which the reading "
    "does not follow",
    # collectives: a step written per device (shard_map)
    **dict.fromkeys(_COLLECTIVES, _COLLECTIVE),
    # linear algebra on whole matrices
    **dict.fromkeys(_LINALGS, _LINALG),
    "custom_linear_solve": "a linear solve given as functions (jax.lax.custom_linear_solve), which the "
    "reading does not follow",
    # mutable state
    **dict.fromkeys(_STATES, _STATE),
    **dict.fromkeys(_words("new_box box_get box_set new_log log_extend log_read"), _HIJAX),
    "call_hi_primitive": _HIJAX,
    "call_hi_primitive_linearized": _HIJAX,
    "from_edtype": "a value of an extended dtype taken apart, which the reading does not follow",
    "to_edtype": "a value of an extended dtype made, which the reading does not follow",
    # differentiation's own machinery (the backward pass is not read)
    "custom_lin": "differentiation's linearized rule (the backward pass, which is not read)",
    "linear_call": "a function with its own transpose (jax.custom_derivatives.linear_call), which the "
    "reading does not follow",
    "remat_opt": "a rematerialization rule with its own forward program, which the reading does not follow",
    "unreachable": "a placeholder for a value that is never computed",
    "check": "a checkify check, whose error value the reading does not follow",
}
