"""Every einshard example of the original README and tutorial, run as written.

Each runs in its own process, because each sets up its own simulated devices
(16 for the README, 8 for the tutorial) before JAX starts.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_picture import README_PICTURES

ROOT = Path(__file__).resolve().parents[1]

README_SETUP = """
n_devices = 16
import os
os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={n_devices}'

from einshard import einshard 
import jax
import jax.numpy as jnp
"""

TUTORIAL = """
# simulate an environment with 8 devices
# delete these if you want to test on TPU
n_devices = 8
import os
os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={n_devices}'

from typing import NamedTuple

from einshard import einshard
import jax
from jax import Array
import jax.nn as nn
import jax.random as jrand

class Params(NamedTuple):
    W1: Array
    W2: Array

def init_params(key: Array) -> Params:
    key, subkey = jrand.split(key)
    W1 = jrand.normal(subkey, (128, 256))

    key, subkey = jrand.split(key)
    W2 = jrand.normal(subkey, (256, 64))

    return Params(W1, W2)

def shard_params(params: Params) -> Params:
    W1, W2 = params
    W1 = einshard(W1, 'x y -> x y*')
    W2 = einshard(W2, 'y z -> y* z')
    return Params(W1, W2)

@jax.jit
def forward(params: Params, X: Array) -> Array:
    W1, W2 = params
    Y = X @ W1
    Y = nn.relu(Y)
    Z = Y @ W2
    return Z

def main() -> None:
    key = jrand.key(42)

    # initialize params
    key, subkey = jrand.split(key)
    params = init_params(key)

    # generate random inputs
    key, subkey = jrand.split(key)
    X = jrand.normal(subkey, (8, 128))

    # shard the model params
    params = shard_params(params)

    # replicate the inputs
    X = einshard(X, '... -> * ...')

    out = forward(params, X)
    print(out.shape)  # (8, 64)

if __name__ == '__main__':
    main()
"""


def run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def lines(picture: str) -> list[str]:
    return [line.strip() for line in picture.strip("\n").split("\n")]


def test_readme_numbers():
    out = run(
        README_SETUP
        + textwrap.dedent("""
        X = jnp.zeros((4, 8))
        X = einshard(X, 'a b -> 2 a2 b4')
        print(X.sharding.shard_shape(X.shape), len(X.sharding.device_set))
        print(sorted({d.id for d, i in X.sharding.devices_indices_map(X.shape).items() if i[0].start == 0 and i[1].start == 0}))
        """)
    )
    shard_shape, devices = out.split("\n")[:2]
    assert shard_shape == "(2, 2) 16"
    # Replicated twice: the block at the origin lives on the devices of both replicas.
    assert devices == "[0, 8]"


def test_readme_ellipsis_is_the_same_as_naming():
    out = run(
        README_SETUP
        + textwrap.dedent("""
        X = jnp.zeros((4, 8, 20, 10))
        X = einshard(X, 'a ... d -> 4 a2 ... d2')
        first = X.sharding.devices_indices_map(X.shape)
        X = einshard(X, 'a b c d -> 4 a2 b c d2')  # the same
        second = X.sharding.devices_indices_map(X.shape)
        print(first == second, X.sharding.shard_shape(X.shape))
        """)
    )
    assert out.strip() == "True (2, 8, 20, 5)"


@pytest.mark.parametrize(("expression", "picture"), README_PICTURES)
def test_readme_pictures(expression, picture):
    pytest.importorskip("rich")
    out = run(
        README_SETUP
        + textwrap.dedent(f"""
        X = jnp.zeros((4, 8))
        X = einshard(X, {expression!r})
        jax.debug.visualize_array_sharding(X)
        """)
    )
    assert lines(out) == lines(picture)


def test_readme_mlp_lines():
    out = run(
        README_SETUP
        + textwrap.dedent("""
        w1_proj = jnp.zeros((128, 256))
        w2_proj = jnp.zeros((256, 64))
        w1_proj = einshard(w1_proj, 'x y -> x y*')
        w2_proj = einshard(w2_proj, 'y z -> y* z')
        print(w1_proj.sharding.shard_shape(w1_proj.shape), w2_proj.sharding.shard_shape(w2_proj.shape))
        """)
    )
    assert out.strip() == "(128, 16) (16, 64)"


def test_tutorial_as_written():
    assert run(TUTORIAL).strip() == "(8, 64)"
