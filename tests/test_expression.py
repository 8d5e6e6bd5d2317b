"""The expression language: grammar, resolution of counts, and error messages."""

import string

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from oracles import assert_catalogued

import einshard
from einshard import EinshardError
from einshard._language._layout import compile_layout, integer_root


class TestGrammar:
    def test_canonical_spelling(self):
        assert str(einshard.parse("  a   b->2 a2*  b*  ")) == "a b -> 2 a2* b*"

    def test_name_count_star(self):
        (element,) = einshard.parse("x -> x12*").right
        assert (element.name, element.count, element.star) == ("x", 12, True)

    def test_standalone_count_and_star(self):
        right = einshard.parse("x -> 2 x *").right
        assert [(e.name, e.number, e.star) for e in right] == [
            (None, 2, False),
            ("x", 1, False),
            (None, 1, True),
        ]

    def test_spans_point_at_source_text(self):
        text = "a  ...  d ->  4 a2  ... d2"
        expression = einshard.parse(text)
        assert [text[slice(*e.span)] for e in expression.left] == ["a", "...", "d"]
        assert [text[slice(*e.span)] for e in expression.right] == ["4", "a2", "...", "d2"]

    def test_unicode_names_and_underscores(self):
        expression = einshard.parse("模型 _b -> 模型* _b")
        assert expression.left_names == ("模型", "_b")

    def test_case_sensitive(self):
        assert einshard.parse("x X -> X x*").left_names == ("x", "X")

    def test_any_whitespace_separates(self):
        assert str(einshard.parse("x\ty\n->\tx y*")) == "x y -> x y*"

    def test_parse_is_cached(self):
        assert einshard.parse("x y -> x y*") is einshard.parse("x y -> x y*")


class TestResolution:
    @pytest.mark.parametrize(
        ("text", "n_devices", "sizes"),
        [
            ("a b -> 2 a2* b*", 16, (2, 4, 2)),
            ("a b -> * a2 b", 16, (8, 2, 1)),
            ("a b c -> a* b* c*", 64, (4, 4, 4)),  # 0.2.0's float root failed here
            ("a b c -> a* b* c*", 1, (1, 1, 1)),
            ("x y -> x y*", 6, (1, 6)),
            ("x y -> 2 x y*", 6, (2, 1, 3)),
            ("a b -> 2 a2 b4", 16, (2, 2, 4)),
            ("a ... d -> 4 a2 ... d2", 16, (4, 2, 2)),
            ("x -> x3* 2*", 6 * 4, (6, 4)),
        ],
    )
    def test_counts(self, text, n_devices, sizes):
        assert compile_layout(text, None if "..." not in text else 4, n_devices).element_sizes == sizes

    @pytest.mark.parametrize("value", [1, 2, 8, 27, 64, 2**60, 3**40])
    @pytest.mark.parametrize("k", [1, 2, 3, 5])
    def test_integer_root(self, value, k):
        root = integer_root(value, k)
        if root is None:
            assert all(r**k != value for r in range(1, 70))
        else:
            assert root**k == value

    def test_big_exact_root(self):
        assert integer_root((10**20 + 1) ** 3, 3) == 10**20 + 1
        assert integer_root((10**20 + 1) ** 3 - 1, 3) is None

    def test_canonical_mesh_drops_size_one_and_merges_replication(self):
        layout = compile_layout("a b -> 2 b 4 a2", 2, 16)
        assert layout.mesh_shape == (8, 2)
        assert layout.spec == (1, None)

    def test_equal_layouts_equal_meshes(self):
        one = compile_layout("x y -> x y*", 2, 8)
        other = compile_layout("p q -> p1 q* 1", 2, 8)
        assert (one.mesh_shape, one.spec) == (other.mesh_shape, other.spec)


def message_lines(error: EinshardError) -> list[str]:
    return str(error).split("\n")


class TestErrorMessages:
    """Each message, line by line: headline, expression, caret, hint, context."""

    def check(self, call, lines):
        with pytest.raises(EinshardError) as info:
            call()
        assert message_lines(info.value) == lines
        assert isinstance(info.value, ValueError)

    def test_unknown_right_name(self):
        self.check(
            lambda: einshard.parse("x y -> x z*"),
            [
                "axis 'z' is on the right-hand side but not on the left",
                "    'x y -> x z*'",
                "              ^^",
                "The left-hand side names the array's axes: x, y.",
            ],
        )

    def test_typo_suggests_the_name(self):
        self.check(
            lambda: einshard.parse("batch embed -> batch embd*"),
            [
                "axis 'embd' is on the right-hand side but not on the left",
                "    'batch embed -> batch embd*'",
                "                          ^^^^^",
                "The left-hand side names the array's axes: batch, embed. Did you mean 'embed'? "
                "'batch embed -> batch embed*'",
            ],
        )

    def test_missing_left_name(self):
        self.check(
            lambda: einshard.parse("x y -> x*"),
            [
                "axis 'y' is on the left-hand side but not on the right",
                "    'x y -> x*'",
                "       ^",
                "Every axis must appear on the right; write it alone to leave it unsharded: 'x y -> x* y'",
            ],
        )

    def test_duplicate_left(self):
        self.check(
            lambda: einshard.parse("x x -> x*"),
            [
                "axis 'x' is named twice on the left-hand side",
                "    'x x -> x*'",
                "       ^",
                "Give every axis of the array its own name.",
            ],
        )

    def test_duplicate_right(self):
        self.check(
            lambda: einshard.parse("x y -> x2 y x4"),
            [
                "axis 'x' appears twice on the right-hand side",
                "    'x y -> x2 y x4'",
                "                 ^^",
                "An axis is split over one element; to split it further, multiply the counts "
                "(e.g. 'x8' rather than 'x2 x4').",
            ],
        )

    def test_no_arrow(self):
        self.check(
            lambda: einshard.parse("x y"),
            [
                "the expression has no '->'",
                "    'x y'",
                "        ^",
                "An expression is 'LEFT -> RIGHT': LEFT names the array's axes (letters or '_'), "
                "RIGHT lists them with optional shard counts and stars, e.g. 'x y -> x y*'.",
            ],
        )

    def test_unicode_arrow(self):
        self.check(
            lambda: einshard.parse("x y → x y*"),
            [
                "expected '->', found '→'",
                "    'x y → x y*'",
                "         ^",
                "Write the arrow as two characters, '-' and '>': 'x y -> x y*'",
            ],
        )

    def test_leading_zero(self):
        self.check(
            lambda: einshard.parse("x y -> x04 y"),
            [
                "count '04' is not a positive integer without leading zeros",
                "    'x y -> x04 y'",
                "             ^^",
                "Counts are whole numbers from 1: write 'x4'.",
            ],
        )

    def test_digit_in_left_name(self):
        self.check(
            lambda: einshard.parse("layer12 y -> layer y"),
            [
                "axis names cannot contain digits",
                "    'layer12 y -> layer y'",
                "          ^^",
                "Digits are shard counts, and counts go on the right-hand side ('layer12*' there means "
                "axis 'layer', count 12, star). Rename the axis with letters only.",
            ],
        )

    def test_wide_characters_keep_the_caret_aligned(self):
        with pytest.raises(EinshardError) as info:
            einshard.parse("模型 y -> 模型* z")
        _, shown, caret, _ = message_lines(info.value)
        # Each CJK character takes two columns.
        assert shown == "    '模型 y -> 模型* z'"
        assert caret == "    " + " " * (1 + 2 * 2 + 6 + 2 * 2 + 2) + "^"

    def test_a_count_in_another_script_names_its_ascii_digit(self):
        self.check(
            lambda: einshard.parse("x y -> x y٢"),
            [
                "count digit '٢' is not an ASCII digit",
                "    'x y -> x y٢'",
                "               ^",
                "Counts are written with the digits 0-9: for '٢', write '2'.",
            ],
        )

    def test_counts_do_not_fit(self):
        self.check(
            lambda: compile_layout("x y -> x4 y", 2, 8),
            [
                "the expression needs exactly 4 devices, but there are 8",
                "    'x y -> x4 y'",
                "            ^^^^",
                "Add a '*' to replicate over the other 2, or make a count proportional: 'x y -> x4 y *'",
            ],
        )

    def test_no_exact_root(self):
        self.check(
            lambda: compile_layout("x y -> x* y*", 2, 8),
            [
                "8 devices leave a factor of 8 for 2 starred elements, which is not a whole square",
                "    'x y -> x* y*'",
                "            ^^^^^",
                "Starred elements grow by the same factor. With 8 devices the counts must multiply to 8; "
                "for example 'x y -> x4 y2', or use '*' to let einshard fit any device count.",
            ],
        )

    def test_rank_mismatch_with_context(self):
        import jax.numpy as jnp

        with pytest.raises(EinshardError) as info:
            einshard.einshard(jnp.zeros((2, 4, 8)), "x y -> x y*")
        lines = message_lines(info.value)
        assert lines[:4] == [
            "the expression names 2 axes, but the array has 3",
            "    'x y -> x y*'",
            "     ^^^",
            "Name every axis of the array, or let '...' stand for the unsharded rest: 'x y ... -> x y* ...'",
        ]
        assert lines[4].startswith("  while sharding an array of shape (2, 4, 8) on ")

    def test_indivisible_axis(self):
        with pytest.raises(EinshardError) as info:
            einshard.layout("x y -> x y4", (8, 10), n_devices=4)
        assert message_lines(info.value) == [
            "axis 'y' (axis 1 of shape (8, 10)) has size 10, which does not split into 4 shards",
            "    'x y -> x y4'",
            "              ^^",
            "Use a count that divides 10 and the device count (1, 2), or pad the array to a multiple of 4.",
            "  for an array of shape (8, 10) on 4 devices",
        ]

    def test_not_a_string(self):
        with pytest.raises(EinshardError, match="must be a string, not list"):
            einshard.parse(["x -> x*"])  # type: ignore[arg-type]

    def test_pickles(self):
        import pickle

        with pytest.raises(EinshardError) as info:
            einshard.parse("x y -> x z*")
        again = pickle.loads(pickle.dumps(info.value))
        assert str(again) == str(info.value)


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("x y -> x y2z", "z"),
        ("x y -> x y**", "*"),
        ("x y -> x y*2", "*2"),
        ("x .. -> x ..", ".."),
        ("x ... ... -> x ...", "..."),
        ("x ... -> x", "..."),
        ("x -> x ...", "..."),
        ("x* -> x", "*"),
        ("x y -> x -> y", "->"),
        ("x y -> x 0", "0"),
        ("x y -> x y, ", ","),
        ("x y -> x y...", "y..."),
        ("x -> x²", "²"),
    ],
)
def test_caret_marks_the_fault(text, fault):
    with pytest.raises(EinshardError) as info:
        compile_layout(text, None if "..." not in text else 3, 8)
    start, end = info.value.span
    assert text[start:end] == fault


# --- Properties -------------------------------------------------------------------------------

ALPHABET = "xyzab_模 .*->0123456789\t"


@settings(max_examples=1500, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=24), n_devices=st.integers(1, 64), n_dims=st.integers(0, 5))
@example(text="a b c -> a* b* c*", n_devices=64, n_dims=3)
def test_any_string_gives_a_layout_or_an_einshard_error(text, n_devices, n_dims):
    try:
        layout = compile_layout(text, n_dims, n_devices)
    except EinshardError as error:
        message = str(error)
        assert message.startswith(error.headline)
        if error.span is not None:
            assert 0 <= error.span[0] <= error.span[1] <= len(text)
            assert "^" in message
        return
    assert layout.n_dims == n_dims
    import math

    assert math.prod(layout.mesh_shape) == n_devices


@settings(max_examples=500, deadline=None)
@given(text=st.text(max_size=20))
@example(text="a b->b a")
@example(text="x y -> x y* z")
def test_arbitrary_unicode_parses_to_its_tokens_or_a_catalogued_error(text):
    try:
        expression = einshard.parse(text)
    except EinshardError as error:
        assert_catalogued(error)
        if error.span is not None:
            assert 0 <= error.span[0] <= error.span[1] <= len(text)
        return
    # Parsed: one arrow, and the canonical spelling is the written elements, single-spaced.
    assert text.count("->") == 1
    left, right = text.split("->")
    assert str(expression) == f"{' '.join(left.split())} -> {' '.join(right.split())}".strip()
    assert expression.left_names == tuple(name for name in left.split() if name != "...")
    assert str(einshard.parse(str(expression))) == str(expression)


names = st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=3)


@st.composite
def expressions(draw):
    axes = draw(st.lists(names, min_size=0, max_size=4, unique=True))
    right = []
    for name in axes:
        count = draw(st.sampled_from(["", "2", "3", "12"]))
        star = draw(st.sampled_from(["", "*"]))
        right.append(name + count + star)
    for _ in range(draw(st.integers(0, 2))):
        right.insert(draw(st.integers(0, len(right))), draw(st.sampled_from(["2", "*", "4*", "1"])))
    right = draw(st.permutations(right))
    left = list(axes)
    if draw(st.booleans()):
        left.insert(draw(st.integers(0, len(left))), "...")
        right.insert(draw(st.integers(0, len(right))), "...")
    gap = draw(st.sampled_from([" ", "  ", "\t"]))
    return gap.join(left) + gap + "->" + gap + gap.join(right)


@settings(max_examples=500, deadline=None)
@given(text=expressions())
def test_valid_expressions_round_trip(text):
    assume(text.strip() != "->")
    expression = einshard.parse(text)
    again = einshard.parse(str(expression))
    assert str(again) == str(expression)
    assert [(e.name, e.count, e.star, e.is_ellipsis) for e in again.right] == [
        (e.name, e.count, e.star, e.is_ellipsis) for e in expression.right
    ]
    assert again.left_names == expression.left_names


@settings(max_examples=500, deadline=None)
@given(text=expressions(), data=st.data())
def test_caret_points_at_an_inserted_fault(text, data):
    """Insert one stray character into a valid expression: the caret lands on it."""
    safe = [i for i in range(len(text) + 1) if not any(c in "->." for c in text[max(0, i - 1) : i + 1])]
    assume(safe)
    position = data.draw(st.sampled_from(safe))
    stray = data.draw(st.sampled_from("#,;!?()[]{}%$&@+=~^"))
    broken = text[:position] + stray + text[position:]
    with pytest.raises(EinshardError) as info:
        einshard.parse(broken)
    start, end = info.value.span
    assert start <= position < end, (broken, info.value.span, str(info.value))
