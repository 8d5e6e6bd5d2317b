"""Checks shared by the integration tests: layouts by rule, values, and collectives in HLO."""

import re

import jax
import numpy as np

import einshard
from einshard._trees._paths import path_string

REPLICATE = "... -> * ..."


def leaves(tree, *, numbers=False):
    """``(path, array)`` for every array leaf (and Python number, if asked), in tree order."""
    kinds = (jax.Array, np.ndarray, int, float) if numbers else (jax.Array, np.ndarray)
    return [
        (path_string(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, kinds)
    ]


def expression_for(rules, path, shape):
    """The expression a leaf gets: scalars are replicated, the rest follow their first rule."""
    return REPLICATE if not shape else einshard.Rules(rules).match(path).expression


def assert_layout(array, expression, path=""):
    expected = einshard.make_sharding(expression, shape=array.shape)
    got = array.sharding.devices_indices_map(array.shape)
    assert got == expected.devices_indices_map(array.shape), f"{path}: not laid out as {expression!r}"


def assert_follows(tree, rules):
    """Every array leaf of ``tree`` is laid out as its rule says; returns the paths checked."""
    paths = []
    for path, leaf in leaves(tree):
        assert "value" not in path.split("/"), path
        assert_layout(leaf, expression_for(rules, path, leaf.shape), path)
        paths.append(path)
    assert paths
    return paths


def assert_never_whole(tree, rules):
    """No leaf a rule shards is whole on any device."""
    checked = 0
    for path, leaf in leaves(tree):
        if expression_for(rules, path, leaf.shape) == REPLICATE:
            continue
        shapes = {shard.data.shape for shard in leaf.addressable_shards}
        assert leaf.shape not in shapes, f"{path} is whole on a device"
        checked += 1
    assert checked


def assert_trees_close(actual, expected, rtol=1e-4, atol=1e-5):
    actual_leaves, expected_leaves = leaves(actual, numbers=True), leaves(expected, numbers=True)
    assert [p for p, _ in actual_leaves] == [p for p, _ in expected_leaves]
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=path)


def all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of every all-gather in compiled HLO text."""
    shapes = []
    for line in hlo.splitlines():
        found = re.search(r"=\s*(.*?)\s+all-gather(?:-start)?\(", line)
        if found:
            for dims in re.findall(r"\[([\d,]*)\]", found.group(1)):
                shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes
