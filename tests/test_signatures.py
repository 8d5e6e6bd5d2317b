"""One way to call each verb: the born-sharded builders take the factory, the rules, then its arguments.

Flax's and Equinox's ``create_sharded``, Flax's ``init_sharded`` and
``create_train_state`` take the rule table positionally, right after what they
build from. The other ways a user may try (the table by keyword after the
factory's arguments, the factory's first argument in the table's place) are
``EinshardError``s whose hint is the call to write, and that call gives the same
model. Policies (``unmatched``, ``indivisible``, ``strict``) live on ``Rules``
only: no integration function takes them.
"""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

from layouts import REPLICATE, assert_layout, assert_trees_close  # noqa: E402

import einshard  # noqa: E402
from conftest import N_DEVICES  # noqa: E402
from einshard.integrations import equinox as einshard_equinox  # noqa: E402
from einshard.integrations import flax as einshard_flax  # noqa: E402
from einshard.integrations import optax as einshard_optax  # noqa: E402
from einshard.integrations import orbax as einshard_orbax  # noqa: E402

D_IN, HIDDEN = 4, 2 * N_DEVICES
EQX_RULES = [(r"weight$", "o i -> o* i"), (r".*", REPLICATE)]
NNX_RULES = [(r"kernel$", "x y -> x y*"), (r".*", REPLICATE)]
LINEN_RULES = [(r"kernel$", "x y -> x y*"), (r".*", REPLICATE)]
POLICIES = {"unmatched", "indivisible", "strict"}

P = inspect.Parameter


def _shape(function):
    """The kinds of a signature's parameters, in order, with the names of the fixed ones."""
    return [
        (p.name if p.kind in (P.POSITIONAL_ONLY, P.KEYWORD_ONLY) else "", p.kind)
        for p in inspect.signature(function).parameters.values()
    ]


def test_create_sharded_has_one_argument_order_in_flax_and_equinox():
    expected = [
        ("factory", P.POSITIONAL_ONLY),
        ("rules", P.POSITIONAL_ONLY),
        ("", P.VAR_POSITIONAL),
        ("", P.VAR_KEYWORD),
    ]
    assert _shape(einshard_flax.create_sharded) == expected
    assert _shape(einshard_equinox.create_sharded) == expected
    # The builders of the same family: what they build from, the rules, then its arguments.
    assert [name for name, _ in _shape(einshard_flax.init_sharded)][:2] == ["module", "rules"]
    assert [name for name, _ in _shape(einshard_flax.create_train_state)][:3] == ["module", "rules", "tx"]


def _functions(module):
    return [getattr(module, name) for name in module.__all__ if inspect.isfunction(getattr(module, name))]


@pytest.mark.parametrize(
    "module",
    [einshard, einshard_flax, einshard_equinox, einshard_optax, einshard_orbax],
    ids=lambda module: module.__name__,
)
def test_policies_live_on_rules_only(module):
    functions = [f for f in map(module.__dict__.get, dir(module)) if inspect.isfunction(f)]
    if module is not einshard:
        functions = _functions(module)
    assert functions
    for function in functions:
        taken = POLICIES & set(inspect.signature(function).parameters)
        assert not taken, f"{module.__name__}.{function.__name__} takes {sorted(taken)}"


def test_equinox_shard_module_applies_the_tables_policies():
    layer = eqx.nn.Linear(D_IN, HIDDEN, key=jax.random.key(0))
    only_weight = [(r"weight$", "o i -> o* i")]
    with pytest.raises(einshard.EinshardError, match="no rule matches 'bias'"):
        einshard_equinox.shard_module(layer, only_weight)
    placed = einshard_equinox.shard_module(layer, einshard.Rules(only_weight, unmatched="replicate"))
    assert_layout(placed.weight, "o i -> o* i")
    assert placed.bias.sharding.is_fully_replicated and len(placed.bias.sharding.device_set) == N_DEVICES
    with pytest.raises(TypeError, match="unmatched"):
        einshard_equinox.shard_module(layer, only_weight, unmatched="replicate")


# --- the old Equinox form, and other orders ---------------------------------------------------


def test_equinox_rules_by_keyword_show_the_call_to_write():
    key = jax.random.key(0)
    with pytest.raises(einshard.EinshardError) as info:
        einshard_equinox.create_sharded(eqx.nn.Linear, D_IN, HIDDEN, key=key, rules=EQX_RULES)
    error = info.value
    assert error.headline == (
        "create_sharded takes the rule table right after the factory, not as rules= after its arguments"
    )
    assert error.hint == f"Call create_sharded(Linear, rules, {D_IN}, {HIDDEN}, key=…)."
    # The call the hint shows builds the layer, born sharded, with the unsharded values.
    layer = einshard_equinox.create_sharded(eqx.nn.Linear, EQX_RULES, D_IN, HIDDEN, key=key)
    assert_layout(layer.weight, "o i -> o* i")
    assert_trees_close(layer, eqx.nn.Linear(D_IN, HIDDEN, key=key), rtol=0, atol=0)
    # With no positional argument for the factory at all.
    with pytest.raises(einshard.EinshardError) as info:
        einshard_equinox.create_sharded(
            eqx.nn.Linear, in_features=D_IN, out_features=HIDDEN, key=key, rules=EQX_RULES
        )
    assert (
        info.value.hint
        == f"Call create_sharded(Linear, rules, in_features={D_IN}, out_features={HIDDEN}, key=…)."
    )


def test_a_factory_argument_in_the_tables_place_says_where_the_table_goes():
    key = jax.random.key(0)
    with pytest.raises(einshard.EinshardError) as info:
        einshard_equinox.create_sharded(eqx.nn.Linear, D_IN, HIDDEN, key=key)
    assert info.value.headline == "the argument after the factory is the rule table, not an int 4"
    assert info.value.hint == (
        "Put the table first, then the arguments for Linear: "
        f"create_sharded(Linear, rules, {D_IN}, {HIDDEN}, key=…); or, for the table its @sharded layers "
        f"compose into, create_sharded(Linear, None, {D_IN}, {HIDDEN}, key=…)."
    )
    # A PRNG key where the table goes (the old form for a model of @sharded layers).
    with pytest.raises(
        einshard.EinshardError,
        match=r"^the argument after the factory is the rule table, "
        r"not a key<fry> array of shape \(\)\n",
    ):
        einshard_equinox.create_sharded(eqx.nn.Linear, key)
    with pytest.raises(einshard.EinshardError) as info:
        einshard_flax.create_sharded(nnx.Linear, D_IN, HIDDEN, rngs=nnx.Rngs(0))
    assert info.value.hint == (
        f"Put the table first, then the arguments for Linear: create_sharded(Linear, rules, {D_IN}, "
        f"{HIDDEN}, rngs=…)."
    )


def test_a_table_with_a_mistake_keeps_its_own_message():
    with pytest.raises(einshard.EinshardError) as info:
        einshard_equinox.create_sharded(
            eqx.nn.Linear, [("weight", "o i -> o* i", 3)], D_IN, HIDDEN, key=jax.random.key(0)
        )
    assert info.value.headline.startswith("rule 0 is ")
    assert info.value.context == ["in the rule table of create_sharded"]


def test_flax_builders_refuse_rules_by_keyword():
    with pytest.raises(einshard.EinshardError) as info:
        einshard_flax.create_sharded(nnx.Linear, D_IN, HIDDEN, rngs=nnx.Rngs(0), rules=NNX_RULES)
    assert info.value.hint == f"Call create_sharded(Linear, rules, {D_IN}, {HIDDEN}, rngs=…)."
    key, x = jax.random.key(0), jnp.ones((1, D_IN))
    with pytest.raises(einshard.EinshardError) as info:
        einshard_flax.init_sharded(nn.Dense(HIDDEN), key, x, rules=LINEN_RULES)
    assert info.value.headline == (
        "init_sharded takes the rule table right after the module, not as rules= after its arguments"
    )
    assert info.value.hint == "Call init_sharded(Dense(...), rules, …, …)."
    with pytest.raises(einshard.EinshardError) as info:
        einshard_flax.create_train_state(nn.Dense(HIDDEN), optax.adam(1e-3), key, x, rules=LINEN_RULES)
    assert info.value.hint == "Call create_train_state(Dense(...), rules, tx, …, …)."
    # The calls the hints show.
    variables = einshard_flax.init_sharded(nn.Dense(HIDDEN), LINEN_RULES, key, x)
    assert_layout(variables["params"]["kernel"], "x y -> x y*")
    state = einshard_flax.create_train_state(nn.Dense(HIDDEN), LINEN_RULES, optax.adam(1e-3), key, x)
    assert_layout(state.opt_state[0].mu["kernel"], "x y -> x y*")


# --- a factory with a `rules` parameter of its own ----------------------------------------------


class EqxWithRules(eqx.Module):
    weight: jax.Array
    rules: str = eqx.field(static=True)

    def __init__(self, key, rules="default"):
        self.weight = jax.random.normal(key, (HIDDEN, D_IN))
        self.rules = rules


class NnxWithRules(nnx.Module):
    def __init__(self, rngs, *, rules="default"):
        self.linear = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.rules = rules


def test_a_factorys_own_rules_keyword_reaches_it():
    key = jax.random.key(0)
    model = einshard_equinox.create_sharded(EqxWithRules, EQX_RULES, key, rules="mine")
    assert model.rules == "mine"
    assert_layout(model.weight, "o i -> o* i")
    # The values of an eager build (compiled sharded, the normal draws may differ in the last bit).
    np.testing.assert_allclose(np.asarray(model.weight), np.asarray(EqxWithRules(key).weight), rtol=1e-6)
    nnx_model = einshard_flax.create_sharded(NnxWithRules, NNX_RULES, nnx.Rngs(0), rules="mine")
    assert nnx_model.rules == "mine"
    assert_layout(nnx_model.linear.kernel[...], "x y -> x y*")


# --- every misplaced table: the error's suggested call, run ------------------------------------


def _suggested_call(hint):
    """The first call a hint writes (``create_sharded(Linear, rules, 4, key=…)``), as text."""
    match = re.search(r"\b(create_sharded|create_train_state|init_sharded|shard_module)\(", hint)
    assert match, hint
    depth = 0
    for end in range(match.end() - 1, len(hint)):
        depth += {"(": 1, ")": -1}.get(hint[end], 0)
        if depth == 0:
            return hint[match.start() : end + 1]
    raise AssertionError(f"unbalanced call in {hint!r}")


def run_hint(error, namespace, instance=None, hidden=()):
    """Runs the call an error's hint suggests.

    ``Name(...)`` in the hint (a module instance, shown by its class) becomes ``instance``;
    each ``…`` (an argument too long to show) becomes the next of ``hidden``, in order.
    """
    call = _suggested_call(error.hint)
    call = re.sub(r"\b\w+\(\.\.\.\)", "_instance", call)
    parts = call.split("…")
    assert len(parts) - 1 == len(hidden), (call, hidden)
    call = "".join(part + (f"_hidden{i}" if i < len(hidden) else "") for i, part in enumerate(parts))
    scope = {**namespace, "_instance": instance, **{f"_hidden{i}": value for i, value in enumerate(hidden)}}
    return eval(call, scope)  # the hint's own text, with the values it could not show


def test_run_hint_runs_exactly_the_suggested_call():
    class Error:
        hint = "Put the table first, then the arguments for f: create_sharded(f, rules, 2, key=…)."

    seen = run_hint(Error, {"create_sharded": lambda *a, **k: (a, k), "f": "F", "rules": "R"}, hidden=[7])
    assert seen == (("F", "R", 2), {"key": 7})


def _nnx_call(function, *args, **kwargs):
    with pytest.raises(einshard.EinshardError) as info:
        function(*args, **kwargs)
    return info.value


def test_flax_create_sharded_every_misplaced_table():
    rngs = lambda: nnx.Rngs(0)  # noqa: E731  (each call consumes its own)
    namespace = {"create_sharded": einshard_flax.create_sharded, "Linear": nnx.Linear, "rules": NNX_RULES}
    reference = nnx.Linear(D_IN, HIDDEN, rngs=rngs())
    cases = {
        "swapped": (
            (NNX_RULES, nnx.Linear, D_IN, HIDDEN),
            "create_sharded takes the factory first, then the rule table: here the table comes first",
            f"Call create_sharded(Linear, rules, {D_IN}, {HIDDEN}, rngs=…).",
        ),
        "among the arguments": (
            (nnx.Linear, D_IN, HIDDEN, NNX_RULES),
            f"the argument after the factory is the rule table, not an int {D_IN}",
            f"Move the table there: create_sharded(Linear, rules, {D_IN}, {HIDDEN}, rngs=…).",
        ),
    }
    for name, (args, headline, hint) in cases.items():
        error = _nnx_call(einshard_flax.create_sharded, *args, rngs=rngs())
        assert (error.headline, error.hint) == (headline, hint), name
        model = run_hint(error, namespace, hidden=[rngs()])
        assert_layout(model.kernel[...], "x y -> x y*")
        np.testing.assert_array_equal(np.asarray(model.kernel[...]), np.asarray(reference.kernel[...]))
    # By keyword with no positional argument for the factory: an error, not Python's TypeError.
    error = _nnx_call(
        einshard_flax.create_sharded,
        nnx.Linear,
        in_features=D_IN,
        out_features=HIDDEN,
        rngs=rngs(),
        rules=NNX_RULES,
    )
    assert (
        error.hint
        == f"Call create_sharded(Linear, rules, in_features={D_IN}, out_features={HIDDEN}, rngs=…)."
    )
    assert_layout(run_hint(error, namespace, hidden=[rngs()]).kernel[...], "x y -> x y*")
    # No table at all.
    error = _nnx_call(einshard_flax.create_sharded, nnx.Linear)
    assert error.headline == "create_sharded needs the rule table, right after the factory"
    assert error.hint == "Call create_sharded(Linear, rules)."


def test_equinox_create_sharded_every_misplaced_table():
    key = jax.random.key(0)
    namespace = {
        "create_sharded": einshard_equinox.create_sharded,
        "Linear": eqx.nn.Linear,
        "rules": EQX_RULES,
    }
    reference = eqx.nn.Linear(D_IN, HIDDEN, key=key)
    for args, hint in [
        (
            (EQX_RULES, eqx.nn.Linear, D_IN, HIDDEN),
            f"Call create_sharded(Linear, rules, {D_IN}, {HIDDEN}, key=…).",
        ),
        (
            (eqx.nn.Linear, D_IN, HIDDEN, EQX_RULES),
            f"Move the table there: create_sharded(Linear, rules, {D_IN}, {HIDDEN}, key=…).",
        ),
    ]:
        error = _nnx_call(einshard_equinox.create_sharded, *args, key=key)
        assert error.hint == hint
        layer = run_hint(error, namespace, hidden=[key])
        assert_layout(layer.weight, "o i -> o* i")
        assert_trees_close(layer, reference, rtol=0, atol=0)


def test_create_train_state_takes_the_rules_second_and_says_so_for_the_old_order():
    key, x, tx = jax.random.key(0), jnp.ones((1, D_IN)), optax.adam(1e-3)
    namespace = {"create_train_state": einshard_flax.create_train_state, "rules": LINEN_RULES, "tx": tx}
    cases = [
        (  # the order of the first 0.3 (tx, then the rules)
            (nn.Dense(HIDDEN), tx, LINEN_RULES, key, x),
            "create_train_state takes the rule table right after the module, then tx",
        ),
        (
            (LINEN_RULES, nn.Dense(HIDDEN), tx, key, x),
            "create_train_state takes the module first, then the rule table: here the table comes first",
        ),
        (  # no optimizer
            (nn.Dense(HIDDEN), LINEN_RULES, key, x),
            "the argument after the rule table of create_train_state is tx, not a key<fry> array of shape ()",
        ),
    ]
    for args, headline in cases:
        error = _nnx_call(einshard_flax.create_train_state, *args)
        assert error.headline == headline
        assert error.hint == "Call create_train_state(Dense(...), rules, tx, …, …)."
        state = run_hint(error, namespace, instance=nn.Dense(HIDDEN), hidden=[key, x])
        assert_layout(state.params["kernel"], "x y -> x y*")
        assert_layout(state.opt_state[0].mu["kernel"], "x y -> x y*")


def test_linen_and_core_init_sharded_refuse_the_table_first():
    key, x = jax.random.key(0), jnp.ones((1, D_IN))
    error = _nnx_call(einshard_flax.init_sharded, LINEN_RULES, nn.Dense(HIDDEN), key, x)
    assert (
        error.headline
        == "init_sharded takes the module first, then the rule table: here the table comes first"
    )
    assert error.hint == "Call init_sharded(Dense(...), rules, …, …)."
    namespace = {"init_sharded": einshard_flax.init_sharded, "rules": LINEN_RULES}
    variables = run_hint(error, namespace, instance=nn.Dense(HIDDEN), hidden=[key, x])
    assert_layout(variables["params"]["kernel"], "x y -> x y*")

    def init(key):
        return {"w": jax.random.normal(key, (D_IN, HIDDEN))}

    table = [("w", "x y -> x y*")]
    error = _nnx_call(einshard.init_sharded, table, init, key)
    assert error.hint == "Call init_sharded(init, rules, …)."
    params = run_hint(
        error, {"init_sharded": einshard.init_sharded, "init": init, "rules": table}, hidden=[key]
    )
    assert_layout(params["w"], "x y -> x y*")
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(init(key)["w"]))


def test_shard_module_refuses_the_table_first_in_both_integrations():
    model = nnx.Linear(D_IN, HIDDEN, rngs=nnx.Rngs(0))
    error = _nnx_call(einshard_flax.shard_module, NNX_RULES, model)
    assert error.hint == "Call shard_module(Linear(...), rules)."
    placed = run_hint(error, {"shard_module": einshard_flax.shard_module, "rules": NNX_RULES}, instance=model)
    assert_layout(placed.kernel[...], "x y -> x y*")
    layer = eqx.nn.Linear(D_IN, HIDDEN, key=jax.random.key(0))
    error = _nnx_call(einshard_equinox.shard_module, EQX_RULES, layer)
    assert error.hint == "Call shard_module(Linear(...), rules)."
    placed = run_hint(
        error, {"shard_module": einshard_equinox.shard_module, "rules": EQX_RULES}, instance=layer
    )
    assert_layout(placed.weight, "o i -> o* i")


def test_optax_init_sharded_is_init_opt_state_under_a_deprecation_warning():
    params = einshard.shard_pytree({"w": jnp.ones((D_IN, HIDDEN))}, [("w", "x y -> x y*")])
    with pytest.warns(einshard.EinshardDeprecationWarning, match=r"call init_opt_state\(tx, params\)"):
        old = einshard_optax.init_sharded(optax.adam(1e-3), params)
    new = einshard_optax.init_opt_state(optax.adam(1e-3), params)
    assert old[0].mu["w"].sharding == new[0].mu["w"].sharding == params["w"].sharding
    assert issubclass(einshard.EinshardDeprecationWarning, DeprecationWarning)
    assert issubclass(einshard.EinshardDeprecationWarning, einshard.EinshardWarning)
