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


def blocks_v020(
    expression: str, n_dims: int, n_devices: int
) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """0.2.0's layout without devices: the shards per array axis, and device position -> block index.

    The same algorithm as :func:`make_sharding_v020` (one mesh axis per RIGHT
    element, row-major over the device order, which is what
    ``create_device_mesh`` gives on CPU), for any device count, with the star
    root taken exactly as the spec asks (0.2.0's float root failed on ``a* b*
    c*`` with 64 devices). Raises ``ValueError`` where the counts do not fit;
    it does not check names (the caller's parser has).
    """
    mesh_shape, axes, _ = _mesh_v020(expression, n_dims, n_devices)
    blocks = {}
    for position in range(n_devices):
        coordinates, rest = [], position
        for size in reversed(mesh_shape):  # row-major: the last element varies fastest
            rest, c = divmod(rest, size)
            coordinates.append(c)
        coordinates.reverse()
        blocks[position] = tuple(coordinates[axis] for axis in axes)
    return tuple(mesh_shape[axis] for axis in axes), blocks


def elements_v020(expression: str, n_dims: int, n_devices: int) -> list[tuple[str | None, int]]:
    """``(name, count)`` of every RIGHT element in order (``...`` as size-1 elements named ``?0``,
    ``?1``, ...; a standalone count has the name ``None``): 0.2.0's mesh, one axis per element."""
    return _mesh_v020(expression, n_dims, n_devices)[2]


def _mesh_v020(
    expression: str, n_dims: int, n_devices: int
) -> tuple[list[int], list[int], list[tuple[str | None, int]]]:
    """0.2.0's mesh shape, the mesh axis of each array axis, and the elements with their counts."""
    parsed = parse(expression)
    left = [e.name if not e.is_ellipsis else ... for e in parsed.left]
    right = [(e.name, e.number, e.star) if not e.is_ellipsis else ... for e in parsed.right]
    if ... in left:
        extra = [f"?{i}" for i in range(n_dims - len(left) + 1)]
        i = left.index(...)
        left = [*left[:i], *extra, *left[i + 1 :]]
        j = right.index(...)
        right = [*right[:j], *[(name, 1, False) for name in extra], *right[j + 1 :]]
    fixed = prod(n for _, n, star in right if not star)
    starred = [n for _, n, star in right if star]
    ratio = 1
    if starred:
        if n_devices % (fixed * prod(starred)):
            raise ValueError("counts do not divide the device count")
        full = n_devices // (fixed * prod(starred))
        ratio = round(full ** (1 / len(starred)))
        ratio = next((r for r in (ratio - 1, ratio, ratio + 1) if r > 0 and r ** len(starred) == full), 0)
        if not ratio:
            raise ValueError("no exact root")
    mesh_shape = [n * (ratio if star else 1) for _, n, star in right]
    if prod(mesh_shape) != n_devices:
        raise ValueError("counts do not multiply to the device count")
    index = {name: i for i, (name, _, _) in enumerate(right) if name is not None}
    elements = [(name, size) for (name, _, _), size in zip(right, mesh_shape, strict=True)]
    return mesh_shape, [index[name] for name in left], elements


def index_blocks(sharding, shape, shards) -> dict[int, tuple[int, ...]]:
    """Device id -> which block of each axis a sharding gives it, checking the blocks are whole.

    ``shards`` is the expected number of blocks per axis; an axis whose
    slice is not exactly one of those blocks fails here.
    """
    out = {}
    for device, slices in sharding.devices_indices_map(tuple(shape)).items():
        block = []
        for s, size, count in zip(slices, shape, shards, strict=True):
            start, stop, _ = s.indices(size)
            step = size // count
            assert size % count == 0 and stop - start == step, (slices, shape, shards)
            block.append(start // step if step else 0)
        out[device.id] = tuple(block)
    return out


def expected_blocks(expression, shape, devices) -> dict[int, tuple[int, ...]]:
    """Device id -> block index by the 0.2.0 reference over the given device order."""
    _, blocks = blocks_v020(expression, len(shape), len(devices))
    return {devices[position].id: block for position, block in blocks.items()}
