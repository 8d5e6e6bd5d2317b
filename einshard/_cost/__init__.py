"""The cost wing: what a training step costs on a mesh, compiled by XLA for CPU devices or a target.

Its rooms, from the text XLA prints up to ``explain_step``: ``xla``, ``hardware``, ``report``,
``reading``, ``findings``, ``pipeline``, ``child`` (einshard/README.md draws them).
"""
