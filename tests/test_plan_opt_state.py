"""Optimizer state in a plan: AdamW's moments are split like the parameters they mirror.

For every default candidate of a plan of ``step(state, batch)`` with ``state = (params,
optax.adamw(...).init(params))`` or ``{'params': ..., 'opt_state': ...}``, the layout the
candidate's table gives each ``mu`` and ``nu`` leaf (the table as ``plan`` uses it: the strategy
with its batch rule, over the step's paths) holds the same block of the array on every device
as the one it gives the parameter; and the memory a compiled row shows includes the state: its
arguments' bytes per device are at least the parameters' and both moments' blocks. The 16-device
defaults over two hosts of 8 (HSDP among them) are checked on the tables alone (no compile).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import optax
import pytest

import einshard
from einshard._tracing._call import StepCall
from einshard._trees._strategy import with_batch
from tests import gpt_steps as gpt

TX = optax.adamw(1e-3)


def tuple_step(state, tokens):
    params, opt_state = state
    grads = jax.grad(gpt.loss)(params, tokens)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def dict_step(state, tokens):
    grads = jax.grad(gpt.loss)(state["params"], tokens)
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


def _state(kind: str):
    params = gpt.gpt_params()
    opt_state = jax.eval_shape(TX.init, params)
    return (params, opt_state) if kind == "tuple" else {"params": params, "opt_state": opt_state}


# The parameter a moment mirrors: state/1/0/mu/embed -> state/0/embed (a tuple state),
# state/opt_state/0/nu/embed -> state/params/embed (a dict state).
MOMENT = {
    "tuple": (re.compile(r"^state/1/0/(mu|nu)/(.+)$"), "state/0/{}"),
    "dict": (re.compile(r"^state/opt_state/0/(mu|nu)/(.+)$"), "state/params/{}"),
}


def _moments_and_params(call: StepCall, table, n_devices: int, kind: str):
    """Each moment's assignment with its parameter's, from the table ``plan`` compiles with."""
    by_path = {a.path: a for _, a in call.assigned(table, n_devices).leaves if a is not None}
    pattern, param = MOMENT[kind]
    pairs = []
    for path, assignment in by_path.items():
        match = pattern.match(path)
        if match:
            pairs.append((assignment, by_path[param.format(match.group(2))]))
    return by_path, pairs


def _check_moments_follow(call: StepCall, strategies, n_devices: int, kind: str) -> None:
    n_params = len(jax.tree.leaves(gpt.gpt_params()))
    for strategy in strategies:
        table = with_batch(strategy, call.batch_name)
        _, pairs = _moments_and_params(call, table, n_devices, kind)
        assert len(pairs) == 2 * n_params, strategy.name
        for moment, param in pairs:
            assert moment.shape == param.shape
            # The same block of the array on every device (as devices_indices_map would say).
            assert moment.layout.indices(moment.shape) == param.layout.indices(param.shape), (
                strategy.name,
                moment.path,
                moment.expression,
                param.expression,
            )


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_every_default_candidate_over_two_hosts_splits_the_moments_like_the_parameters(kind):
    step = tuple_step if kind == "tuple" else dict_step
    state = _state(kind)
    call = StepCall.of(step, (state, gpt.TOKENS), {})
    strategies = einshard.strategies.defaults(
        16, step=step, params=state, batch=gpt.TOKENS, devices_per_host=8
    )
    names = [s.name for s in strategies]
    assert "hsdp" in names and "hybrid model=8" in names and "tensor parallel" in names
    _check_moments_follow(call, strategies, 16, kind)


def test_a_plan_s_candidates_split_the_moments_and_count_them_in_memory():
    n = 8
    state = _state("tuple")
    plan = einshard.plan(tuple_step, state, gpt.TOKENS, n_devices=n, quiet=True)
    call = StepCall.of(tuple_step, (state, gpt.TOKENS), {})
    assert {row.name for row in plan.rows} >= {"data parallel", "fsdp", "tensor parallel", "hybrid model=4"}
    _check_moments_follow(call, [row.strategy for row in plan.rows], n, "tuple")
    laid_out = {}
    for row in plan.rows:
        assert row.report is not None, (row.name, row.rejected)
        by_path, pairs = _moments_and_params(call, with_batch(row.strategy, call.batch_name), n, "tuple")
        params = [a for path, a in by_path.items() if path.startswith("state/0/")]
        moments = [moment for moment, _ in pairs]
        laid_out[row.name] = sum(_block_bytes(a) for a in params + moments)
        assert row.report.argument_bytes is not None and row.report.argument_bytes >= laid_out[row.name], (
            row.name
        )
        assert row.peak_bytes is not None and row.peak_bytes >= row.report.argument_bytes
    # The arguments FSDP saves are exactly the blocks of the weights and both moments it splits:
    # the batch and the step count are laid out alike under the two.
    rows = {row.name: row.report for row in plan.rows}
    saved = rows["data parallel"].argument_bytes - rows["fsdp"].argument_bytes
    assert saved == laid_out["data parallel"] - laid_out["fsdp"] > 0


def _block_bytes(assignment) -> int:
    return math.prod(assignment.layout.shard_shape(assignment.shape)) * np.dtype(assignment.dtype).itemsize
