"""The JAX primitives the jaxpr reader knows, by what they do to a parameter's axes.

A primitive in none of these sets and without a handler of its own in ``_jaxpr`` stops the reading
of the values it touches (a *break*).
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    return text.split()


# Primitives that act on each element alone (their outputs have their inputs' shape). Others of
# the same shape are taken as elementwise unless a parameter names an axis (see _same_shape).
ELEMENTWISE = frozenset(
    _words(
        """
        abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil
        clamp clz conj convert_element_type copy copy_p cos cosh digamma div erf erf_inv erfc exp
        exp2 expm1 floor igamma igammac imag integer_pow is_finite lgamma log log1p logistic max min
        mul ne eq ge gt le lt neg nextafter not or polygamma population_count pow real
        reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
        shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan
        tanh xor zeta one_minus_square random_gamma_grad
        """
    )
)
# One output per operand, each the operand itself (placement and scheduling hints).
IDENTITY = frozenset(
    _words("optimization_barrier device_put sharding_constraint mesh_cast reshard pvary name")
)
REDUCE = frozenset(
    _words("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin")
)
CUMULATIVE = frozenset(_words("cumsum cumprod cummax cummin cumlogsumexp"))
RANDOM = frozenset(
    _words(
        """
        random_bits random_seed random_split random_fold_in random_wrap random_unwrap threefry2x32
        rng_bit_generator rng_uniform iota
        """
    )
)
CALLBACKS = frozenset(
    _words("pure_callback io_callback ffi_call custom_call debug_callback pallas_call custom_partitioning")
)
AXIS_PARAMS = frozenset(
    _words("axis axes dimension dimensions permutation fft_type fft_lengths window_dimensions")
)
MIXING = frozenset(
    _words(
        """
        cholesky lu qr eig eigh svd triangular_solve tridiagonal tridiagonal_solve schur hessenberg
        householder_product lu_pivots_to_permutation fft rev
        """
    )
)
