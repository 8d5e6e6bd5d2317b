"""einshard 0.2.0's ``make_sharding`` layout algorithm, kept as the reference for its layouts.

A transcription of einshard 0.2.0 (PyPI, ``einshard/einshard.py``): one mesh
axis per RIGHT element (``...`` expanded to size-1 axes), sizes resolved with
its float root, devices from ``mesh_utils.create_device_mesh``. It takes its
elements from our parser, since for every expression 0.2.0 accepted both
parsers read the same elements.
"""

from math import prod

from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard import parse


def make_sharding_v020(expression: str, n_dims: int) -> NamedSharding:
    parsed = parse(expression)
    left = [e.name if not e.is_ellipsis else ... for e in parsed.left]
    right = [(e.name, e.number, e.star) if not e.is_ellipsis else ... for e in parsed.right]
    if ... in left:
        n_elided = n_dims - len(left) + 1
        extra = [f"?{i}" for i in range(n_elided)]
        i = left.index(...)
        left = [*left[:i], *extra, *left[i + 1 :]]
        j = right.index(...)
        right = [*right[:j], *[(name, 1, False) for name in extra], *right[j + 1 :]]
    import jax

    n_devices = jax.device_count()
    fixed = [n for _, n, star in right if not star]
    proportional = [n for _, n, star in right if star]
    ratio = 1
    if proportional:
        assert n_devices % prod(fixed) == 0
        available = n_devices // prod(fixed)
        assert available % prod(proportional) == 0
        full = available // prod(proportional)
        ratio = full ** (1 / len(proportional))
        assert ratio.is_integer()
        ratio = int(ratio)
    mesh_shape = [n * (ratio if star else 1) for _, n, star in right]
    axis_names = tuple(f"a{i}" for i in range(len(right)))
    index = {name: i for i, (name, _, _) in enumerate(right) if name is not None}
    spec = tuple(f"a{index[name]}" for name in left)
    devices = mesh_utils.create_device_mesh(mesh_shape)
    return NamedSharding(Mesh(devices, axis_names=axis_names), P(*spec))
