"""Nothing silently wrong, nothing that hangs: classes of bad or huge inputs, many members each.

Every member of a class gets an EinshardError (never another exception, never a truncated
value), or, for huge but valid numbers, its answer; hints stay true however large the numbers
(their suggested counts fit, their divisors divide). How fast is measured by
benchmarks/bench_errors.py, not here.
"""

import math
import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard
from conftest import N_DEVICES
from einshard import EinshardError
from einshard.__main__ import main
from einshard._language import _numbers
from einshard._language._layout import compile_layout

EXPRESSIONS = [
    "x -> x*",
    "x y -> x2 y4",
    "x y -> x y*",
    "a b c -> a* b* c*",
    "x y -> x7 y",
    "a b -> 2 a2* b*",
    "x y -> * x3 y",
    "... x -> ... x5*",
    "x -> x 3",
]
# Sizes up to 2**63, with many hard ones: large primes, products of two large primes, powers of
# two times a prime.
HUGE = st.one_of(
    st.integers(1, 2**63),
    st.sampled_from(
        [2**61 - 1, 2**63, 2**63 - 25, 2**40, 3 * 2**39, (2**31 - 1) * (2**31 - 19), (2**31 - 1) ** 2]
    ),
    st.builds(lambda a, b: a * b, st.integers(2**20, 2**31), st.integers(2**20, 2**31)),
)
# Device counts up to the bound (2**24), with the hard ones below it, and beyond it.
BOUND = 2**24
DEVICE_COUNTS = st.one_of(
    st.integers(1, BOUND),
    st.sampled_from([BOUND, BOUND - 3, 3 * 2**22, 4093 * 4099, 4099**2 - 4099, 2**12 * 4093]),
    HUGE,
)


def suggested_expressions(message):
    return re.findall(r"for example '([^']*)'", message)


@settings(max_examples=300, deadline=None)
@given(
    expression=st.sampled_from(EXPRESSIONS),
    n_devices=DEVICE_COUNTS,
    sizes=st.lists(HUGE, min_size=1, max_size=3),
)
def test_huge_numbers_answer_or_raise_a_true_hint(expression, n_devices, sizes):
    shape = tuple(sizes)
    try:
        layout = einshard.layout(expression, shape, n_devices=n_devices)
    except EinshardError as error:
        message = str(error)
        if n_devices > BOUND:  # beyond the documented bound: said so, whatever else is wrong
            assert message.startswith("the device count must be a positive integer up to 2**24")
        for suggestion in suggested_expressions(message):  # the fitting hint's counts fit
            if "*" not in suggestion:
                assert compile_layout(suggestion, len(shape), n_devices).n_devices == n_devices
        listed = re.search(r"divides (\d+) and the device count \(([^)]*)\)", message)
        if listed:
            size = int(listed.group(1))
            for divisor in re.findall(r"\d+", listed.group(2)):
                assert size % int(divisor) == 0 and n_devices % int(divisor) == 0
        return
    assert n_devices <= BOUND
    assert math.prod(layout.shards) * layout.replication == n_devices
    assert all(size % count == 0 for size, count in zip(shape, layout.shards, strict=True))


def is_prime(p):
    return p > 1 and all(p % q for q in range(2, math.isqrt(p) + 1))


@settings(max_examples=200, deadline=None)
@given(n=st.one_of(st.integers(1, BOUND), st.sampled_from([BOUND, BOUND - 3, 4093 * 4099, 1])))
def test_factors_multiply_back_and_divisors_divide(n):
    factors = _numbers.prime_factors(n)
    assert math.prod(factors) == n
    assert list(factors) == sorted(factors)
    assert all(is_prime(p) for p in factors)
    divisors, complete = _numbers.divisors_preview(n)
    if n < 5000:  # against every divisor, found one by one
        every = [d for d in range(1, n + 1) if n % d == 0]
        assert complete == (len(every) <= 16)
        assert divisors == (every if complete else [*every[:15], n])
    assert all(n % d == 0 for d in divisors) and divisors == sorted(set(divisors))
    assert divisors[-1] == n
    assert math.prod(_numbers.balanced_factors(n, 3)) == n


def test_counts_at_the_bound_answer_and_beyond_it_are_refused():
    for expression, shape, n in [
        ("x y -> x2 y4", (8, 8), BOUND - 3),  # a prime
        ("x -> x*", (3 * 2**22,), BOUND),
        ("x -> x*", (3 * 2**21,), 2**23),
    ]:
        with pytest.raises(EinshardError) as info:
            einshard.layout(expression, shape, n_devices=n)
        assert str(info.value).count("\n") >= 3  # headline, expression, caret, hint
    tree = {"w": jax.ShapeDtypeStruct((8, 8), np.float32)}
    with pytest.raises(EinshardError, match="needs exactly 8 devices, but there are 16777213"):
        einshard.explain(tree, [("w", "x y -> x2 y4")], n_devices=BOUND - 3)
    for n in (BOUND + 1, 2**61 - 1):
        with pytest.raises(
            EinshardError, match=r"^the device count must be a positive integer up to 2\*\*24"
        ):
            einshard.explain(tree, [("w", "x y -> x2 y4")], n_devices=n)
    assert einshard.layout("x -> x*", (BOUND,), n_devices=BOUND).shards == (BOUND,)


def test_cli_with_huge_counts_exits_2(capsys):
    assert main(["x -> x*", "--shape", "25165824", "--devices", "16777216"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("einshard: error: axis 'x' (axis 0 of shape (25165824,))")
    assert "for example 1, 2, 4" in captured.err
    # A valid layout too large to draw: the summary, then the picture's bound.
    assert main(["x -> x*", "--shape", "16777216", "--devices", "16777216"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("'x -> x*': shape (16777216,) on 16777216 devices")
    assert "a picture draws at most 4096 devices" in captured.err
    # Beyond the bound on device counts.
    assert main(["x -> x*", "--shape", "1099511627776", "--devices", "1099511627776"]) == 2
    assert "up to 2**24" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--scale", "1e6"],
        ["--scale", "0"],
        ["--scale", "-0.5"],
        ["--scale", "nan"],
        ["--width", "0"],
        ["--width", "5000"],
        ["--devices", "1" * 5000],
        ["--shape", "1" * 5000],
        ["--shape", ",".join(["8"] * 60_000)],
    ],
)
def test_cli_out_of_bounds_arguments_exit_2(capsys, args):
    base = {"--shape": "8", "--devices": "2"}
    flags = dict(zip(args[::2], args[1::2], strict=True))
    argv = ["x -> x*", *[part for key, value in {**base, **flags}.items() for part in (key, value)]]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and len(err) < 1000  # no 5000-digit echo


@settings(max_examples=100, deadline=None)
@given(scale=st.one_of(st.floats(max_value=0), st.floats(min_value=10.001), st.just(float("nan"))))
def test_picture_refuses_scales_out_of_bounds(scale):
    with pytest.raises(EinshardError, match="is not a number above 0 and at most 10"):
        einshard.picture("x -> x*", (8,), n_devices=2, scale=scale)


@settings(max_examples=100, deadline=None)
@given(width=st.one_of(st.integers(max_value=0), st.integers(min_value=1001), st.floats(1, 100)))
def test_picture_refuses_widths_out_of_bounds(width):
    with pytest.raises(EinshardError, match="is not a whole number of characters from 1 to 1000"):
        einshard.picture("x -> x*", (8,), n_devices=2, max_width=width)


def test_picture_at_its_bounds_is_bounded():
    text = einshard.picture("x y -> x* y", (4096, 2), n_devices=4096, scale=10, max_width=1000)
    lines = text.split("\n")
    assert max(map(len, lines)) <= 1000 and len(lines) <= 3 * 4096
    with pytest.raises(EinshardError, match="a picture draws at most 4096 devices, and this layout has 4097"):
        einshard.picture("x -> x*", (4097,), n_devices=4097)


# --- class 3: bad input gets an EinshardError --------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(digits=st.integers(20, 6000), where=st.sampled_from(["x -> x{}", "x -> x{}*", "x -> x {}"]))
def test_counts_with_many_digits(digits, where):
    count = "9" + "1" * (digits - 1)
    with pytest.raises(EinshardError, match="is larger than any device count"):
        einshard.parse(where.format(count))
    with pytest.raises(EinshardError, match="is larger than any device count"):
        einshard.make_sharding(where.format(count))


def test_count_of_2_to_24_is_a_count():
    expression = einshard.parse(f"x -> x{2**24}")
    assert expression.right[0].number == 2**24
    for count in (2**24 + 1, 2**63):
        with pytest.raises(EinshardError, match=r"is larger than any device count \(2\*\*24\)"):
            einshard.parse(f"x -> x{count}")


NOT_SIZES = st.one_of(
    st.floats(allow_nan=True).filter(lambda v: True),
    st.booleans(),
    st.text(max_size=3),
    st.integers(2**63 + 1, 2**200),
    st.integers(max_value=-1),
    st.just(np.float32(8.0)),
)


@settings(max_examples=300, deadline=None)
@given(bad=NOT_SIZES, position=st.integers(0, 1))
def test_sizes_that_are_not_whole_are_refused_everywhere(bad, position):
    shape = [8, 8]
    shape[position] = bad
    for call in (
        lambda: einshard.make_sharding("x y -> x y*", shape=tuple(shape)),
        lambda: einshard.layout("x y -> x y*", tuple(shape), n_devices=8),
        lambda: einshard.picture("x y -> x y*", tuple(shape), n_devices=8),
    ):
        with pytest.raises(EinshardError):
            call()


NOT_DEVICE_COUNTS = st.one_of(
    st.booleans(),
    st.floats(),
    st.integers(max_value=0),
    st.integers(2**24 + 1, 2**4000),
    st.text(max_size=3),
    st.just(np.int64(8)),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(bad=NOT_DEVICE_COUNTS)
def test_device_counts_are_checked_before_any_cache(bad):
    # A call with an equal value first (True == 1, 8.0 == 8) must not make the bad one valid.
    for good in (1, 8):
        einshard.layout("x -> x*", (8,), n_devices=good)
        compile_layout("x -> x*", 1, good)
    with pytest.raises(EinshardError, match="device count must be a positive integer"):
        einshard.layout("x -> x*", (8,), n_devices=bad)
    with pytest.raises(EinshardError, match="device count must be a positive integer"):
        compile_layout("x -> x*", 1, bad)


@settings(max_examples=100, deadline=None)
@given(bad=st.one_of(st.booleans(), st.floats(), st.integers(max_value=-1), st.text(max_size=2)))
def test_ranks_are_checked_before_any_cache(bad):
    compile_layout("x -> x*", 1, 8)
    with pytest.raises(EinshardError, match="n_dims must be a non-negative integer"):
        compile_layout("x -> x*", bad, 8)


@settings(max_examples=100, deadline=None)
@given(path=st.one_of(st.none(), st.integers(), st.binary(), st.lists(st.text(), max_size=2)))
def test_rule_paths_must_be_strings(path):
    rules = einshard.Rules([("a", "x -> x*"), (".*", "... -> * ...")])
    with pytest.raises(EinshardError, match="a leaf path is a string"):
        rules.match(path)
    with pytest.raises(EinshardError, match="a leaf path is a string"):
        list(rules.matches(path))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["U3", "S2", "O", "datetime64[s]", "timedelta64[ms]", [("a", "i4")]]),
    as_scalar=st.booleans(),
)
def test_arrays_jax_cannot_hold(dtype, as_scalar):
    array = np.zeros(N_DEVICES, dtype=dtype)
    value = array[0] if as_scalar else array
    expression = " -> *" if as_scalar else "x -> x*"
    if dtype == "O" and as_scalar:
        value = np.array(None, dtype=object)[()]  # a Python object; einshard makes an array of it
    with pytest.raises(EinshardError, match="cannot shard an array of"):
        einshard.einshard(value, expression)


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(st.integers(min_value=2**31), st.integers(max_value=-(2**31) - 1)))
def test_python_ints_beyond_jax_s(value):
    int_type = np.iinfo(jax.dtypes.canonicalize_dtype(np.int64))
    if int_type.min <= value <= int_type.max:
        assert int(einshard.einshard(value, " -> *")) == value  # with jax_enable_x64
        return
    with pytest.raises(EinshardError, match="does not fit JAX's"):
        einshard.einshard(value, " -> *")


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(
        st.one_of(st.integers(0, 5), st.sampled_from(["a", "b"]), st.floats(0, 1)),
        min_size=2,
        max_size=4,
        unique=True,
    ).filter(
        lambda keys: len({type(k) for k in keys}) > 1 and not all(isinstance(k, (int, float)) for k in keys)
    ),
    depth=st.integers(0, 3),
)
def test_dicts_whose_keys_do_not_sort(keys, depth):
    # On a fresh thread: JAX's C++ flattening, failing to sort a nested dict's keys, does not give
    # back the recursion budget it took on the way down (jaxlib 0.10 and 0.12 alike; about a
    # hundred frames per failure at depth 3). Three hundred such failures on one thread leave it
    # too little for the next test's tracing (a RecursionError in Flax's or Equinox's init).
    on_fresh_thread(lambda: check_unsortable_keys(keys, depth))


def check_unsortable_keys(keys, depth):
    tree = {key: np.ones(N_DEVICES, np.float32) for key in keys}
    for _ in range(depth):
        tree = {"outer": [tree]}
    for call in (
        lambda: einshard.shard_pytree(tree, [(".*", "... -> * ...")]),
        lambda: einshard.pytree_shardings(tree, [(".*", "... -> * ...")]),
        lambda: einshard.explain(tree, [(".*", "... -> * ...")], n_devices=8),
    ):
        with pytest.raises(EinshardError, match="keys that cannot be sorted together") as info:
            call()
        assert "in a dict with the keys" in str(info.value)


def on_fresh_thread(function):
    """Runs a deep-tree check on its own thread. A RecursionError inside JAX's C++ flattening
    leaves the thread's recursion budget smaller for good (CPython 3.12's accounting), so such
    checks must neither inherit a spent budget nor spend the main thread's."""
    from einshard._trees._paths import _on_fresh_thread

    return _on_fresh_thread(lambda _: function(), None)


@pytest.mark.parametrize("depth", [300, 800])
@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_deep_trees_work_as_in_jax(kind, depth):
    on_fresh_thread(lambda: check_deep_tree(kind, depth))


def check_deep_tree(kind, depth):
    leaf = np.arange(2 * N_DEVICES, dtype=np.float32)
    tree = leaf
    for _ in range(depth):
        tree = [tree] if kind == "list" else {"a": tree} if kind == "dict" else (tree,)
    key = "0" if kind != "dict" else "a"
    try:  # JAX's own limit depends on the interpreter's state (its C recursion budget)
        jax.tree_util.tree_flatten_with_path(tree)
    except (RecursionError, SystemError):
        with pytest.raises(EinshardError, match="nested too deeply"):
            einshard.shard_pytree(tree, [(f"^({key}/)*{key}$", "x -> x*")])
        return
    sharded = einshard.shard_pytree(tree, [(f"^({key}/)*{key}$", "x -> x*")])
    (only,) = jax.tree_util.tree_leaves(sharded)
    np.testing.assert_array_equal(np.asarray(only), leaf)
    blocks = sorted(
        s[0].indices(2 * N_DEVICES)[:2] for s in only.sharding.devices_indices_map(leaf.shape).values()
    )
    assert blocks == [(2 * i, 2 * i + 2) for i in range(N_DEVICES)]
    paths = einshard.pytree_shardings(tree, [(".*", "... -> * ...")])
    assert len(jax.tree_util.tree_leaves(paths)) == 1


def test_trees_deeper_than_jax_flattens():
    def check():
        tree = np.ones(8)
        for _ in range(100_000):  # JAX flattens 5,000 levels on Python 3.13 (3.12: not 5,000)
            tree = {"a": tree}
        with pytest.raises(EinshardError, match="nested too deeply"):
            einshard.shard_pytree(tree, [(".*", "... -> * ...")])

    on_fresh_thread(check)


# --- integrations -------------------------------------------------------------------------------

NOT_PARAMS = st.one_of(
    st.text(max_size=5),
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.lists(st.integers(), min_size=1, max_size=3),
    st.dictionaries(st.sampled_from(["w", "b"]), st.text(max_size=2), min_size=1),
)


@settings(max_examples=60, deadline=None)
@given(bad=NOT_PARAMS)
def test_shard_opt_state_refuses_what_is_not_params(bad):
    optax = pytest.importorskip("optax")
    from einshard.integrations.optax import shard_opt_state

    state = optax.adam(1e-3).init({"w": np.ones((N_DEVICES, 4), np.float32)})
    with pytest.raises(EinshardError, match="params must be the tree of arrays"):
        shard_opt_state(state, bad)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
def test_shard_opt_state_refuses_params_of_other_shapes(shape):
    optax = pytest.importorskip("optax")
    from einshard.integrations.optax import shard_opt_state

    params = {"w": np.ones((N_DEVICES, 6), np.float32)}
    state = optax.adam(1e-3).init(params)
    with pytest.raises(EinshardError, match="does not belong to these params"):
        shard_opt_state(state, {"other": np.ones(shape, np.float32)})
    with pytest.raises(EinshardError, match="does not belong to these params"):
        shard_opt_state(state, [np.ones(shape, np.float32)] * 2)
    # The params' structure with other shapes: each such leaf is replicated, with a note
    # (explain_opt_state says so); the structure shows whose state it is.
    # Its own params, and factored statistics (Adafactor's row and column), are accepted.
    placed = einshard.shard_pytree(params, {"w": "x y -> x* y"})
    assert shard_opt_state(state, placed)[0].mu["w"].sharding.is_equivalent_to(placed["w"].sharding, 2)
    big = {"w": np.ones((256, 128 * N_DEVICES), np.float32)}
    factored = optax.adafactor(1e-3).init(big)
    shard_opt_state(factored, einshard.shard_pytree(big, {"w": "x y -> x y*"}))


@pytest.mark.parametrize("kind", ["missing", "file", "empty directory"])
def test_abstract_checkpoint_refuses_a_path_without_a_checkpoint(tmp_path, kind):
    pytest.importorskip("orbax.checkpoint")
    from einshard.integrations import orbax as checkpoints

    path = tmp_path / "ckpt"
    if kind == "file":
        path.write_text("not a checkpoint")
    elif kind == "empty directory":
        path.mkdir()
    with pytest.raises(EinshardError, match="there is no checkpoint at") as info:
        checkpoints.abstract_checkpoint(path)
    assert str(path) in str(info.value)
    with pytest.raises(EinshardError, match="there is no checkpoint at"):
        checkpoints.restore(path, [(".*", "... -> * ...")])


# --- inside shard_map ---------------------------------------------------------------------------


@pytest.mark.parametrize("manual", [("data",), ("model",), ("data", "model")])
def test_einshard_inside_shard_map_lays_out_over_the_axes_left(manual):
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    if N_DEVICES % 2:
        pytest.skip("a 2 x N/2 mesh")
    mesh = jax.make_mesh((2, N_DEVICES // 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    value = np.arange(4 * N_DEVICES * N_DEVICES, dtype=np.float32).reshape(4 * N_DEVICES, N_DEVICES)
    spec = P(*manual) if len(manual) == 1 else P(manual)

    def step(x):
        return einshard.einshard(x, "a b -> a b*") * 2

    with jax.set_mesh(mesh):
        mapped = jax.jit(jax.shard_map(step, in_specs=spec, out_specs=spec, axis_names=set(manual)))
        if len(manual) == 2:
            with pytest.raises(EinshardError, match="inside shard_map every mesh axis is manual"):
                mapped(value)
            return
        out = mapped(value)
    np.testing.assert_array_equal(np.asarray(out), value * 2)
    (left,) = {"data", "model"} - set(manual)
    # b is split over the axis left (the constraint inside), a over the manual one.
    assert out.sharding.spec == P(manual[0], left)
    blocks = {s[1].indices(N_DEVICES)[:2] for s in out.sharding.devices_indices_map(value.shape).values()}
    assert len(blocks) == mesh.shape[left]


# --- the function for the input: one array, or a tree --------------------------------------------


@pytest.mark.parametrize(
    "tree",
    [{"w": np.ones((8, 16))}, [{"w": np.ones((8, 16))}], ({"a": 1.0}, np.ones(8))],
    ids=["dict", "list of dicts", "tuple with a dict"],
)
def test_einshard_given_a_tree_names_shard_pytree(tree):
    with pytest.raises(EinshardError) as info:
        einshard.einshard(tree, "... -> * ...")
    assert info.value.headline.startswith("einshard places one array, and was given a ")
    assert "einshard.shard_pytree(tree, rules)" in info.value.hint
    # What the hint says to call places the tree.
    placed = einshard.shard_pytree(tree, [(r".*", "... -> * ...")])
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(placed) if isinstance(leaf, jax.Array)]
    assert leaves and all(leaf.sharding.is_fully_replicated for leaf in leaves)


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "abstract"])
def test_shard_pytree_given_one_array_names_einshard(abstract):
    x = np.arange(8 * 16 * N_DEVICES, dtype=np.float32).reshape(8, 16 * N_DEVICES)
    leaf = jax.ShapeDtypeStruct(x.shape, x.dtype) if abstract else x
    function = einshard.pytree_shardings if abstract else einshard.shard_pytree
    with pytest.raises(EinshardError) as info:
        function(leaf, [(r"kernel$", "x y -> x y*")])
    assert (
        info.value.headline
        == f"one array (shape (8, {16 * N_DEVICES})) where a tree goes: its path is '' and no rule matches it"
    )
    assert "einshard.einshard(x, '... -> * ...')" in info.value.hint
    placed = einshard.einshard(x, "... -> * ...")  # the hint's call
    assert placed.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(placed), x)
    # A table whose rule matches the empty path places one array as before.
    assert einshard.shard_pytree(x, [(r".*", "x y -> x y*")]).sharding.shard_shape(x.shape) == (8, 16)


def test_optax_state_from_unplaced_params_warns_and_says_how_to_place_them():
    optax = pytest.importorskip("optax")
    from einshard.integrations.optax import init_opt_state

    params = {"w": np.ones((8, 16 * N_DEVICES), np.float32)}
    if N_DEVICES < 2:
        pytest.skip("one device: nothing is replicated")
    with pytest.warns(einshard.EinshardWarning, match=r"not placed \(NumPy arrays\)") as record:
        state = init_opt_state(optax.adam(1e-3), params)
    assert "params = einshard.shard_pytree(params, rules)" in str(record[0].message)
    assert state[0].mu["w"].sharding.is_fully_replicated  # what the warning says happened
    # The fix it names: placed params, and the state follows them, with no warning.
    placed = einshard.shard_pytree(params, [("w", "x y -> x y*")])
    assert init_opt_state(optax.adam(1e-3), placed)[0].mu["w"].sharding == placed["w"].sharding
