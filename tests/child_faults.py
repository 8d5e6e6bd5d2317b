"""A step whose reading fails in einshard's child process, for ``tests/test_own_errors.py``.

Imported in the child (the step crosses as ``'tests.child_faults:step'``), it makes einshard's
reading of the compiled program fail there with its own "please report it" assertion, as a
program einshard cannot read would; only where ``EINSHARD_TEST_FAULT=read`` and only in a child
process (``python -c``), so the parent that imports it is unchanged.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp

from einshard._cost.pipeline import _analysis


def step(params, batch):
    return params - 0.1 * jnp.mean(batch @ params.T)


def _unreadable(*args, **kwargs):
    raise AssertionError("einshard cannot read this XLA text (please report it): a test's fault")


if os.environ.get("EINSHARD_TEST_FAULT") == "read" and sys.argv[:1] == ["-c"]:
    _analysis._reported = _unreadable
