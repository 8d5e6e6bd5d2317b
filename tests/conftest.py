"""Simulated CPU devices for the whole suite.

The device count comes from ``EINSHARD_TEST_DEVICES`` (default 8); the nox
``tests`` session runs the suite with 8, 16 and 6 devices. It must be set
before JAX starts its backend, hence here, at import time.
"""

import os

import jax

N_DEVICES = int(os.environ.get("EINSHARD_TEST_DEVICES", "8"))

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", N_DEVICES)
