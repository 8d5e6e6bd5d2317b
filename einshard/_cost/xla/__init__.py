"""Reading XLA's text: a compiled program's computations, instructions, collectives and kernels.

No JAX: the text alone, as a compiler printed it.
"""
