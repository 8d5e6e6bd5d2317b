"""The JAX-facing pipeline: the step's program as training runs it, compiled, read into one report.

In this process, on this machine's devices or a target's compile-only ones.
"""
