"""A rule table decides exactly as ``re.search`` per rule, first match wins, whatever the regexes.

Regexes are drawn from a grammar with groups (numbered and named), backreferences, conditionals,
lookarounds, anchors, alternation, quantifiers and inline flags (global and scoped); every table
is asked about many paths, twice (the second time from its memo, where digit-blind tables decide
'l/12' as 'l/00'), and its answers are compared with a plain loop of ``re.search``.
"""

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from einshard import Rules

REPLICATE = "... -> * ..."
ALPHABET = "ab12/"  # digits too: digit-blind tables decide 'l/12' as 'l/00'
ATOMS = ["a", "b", "1", "/", ".", r"\d", r"\w", r"\D", "[a1]", "[^/]", "[0-9]", "[b-z]"]
ANCHORS = ["^", "$", r"\A", r"\Z", r"\b", r"\B"]
QUANTIFIERS = ["", "", "", "", "?", "*", "+", "{1,2}", "*?", "{2}"]
# Tables without a digit in any regex decide digit-blind ('l/12' as 'l/00'): a grammar for them.
DIGIT_FREE_ATOMS = ["a", "b", "/", ".", r"\d", r"\w", r"\D", "[^/]", "[b-z]", r"\d\d"]
DIGIT_FREE_QUANTIFIERS = ["", "", "", "?", "*", "+", "*?"]
GLOBAL_FLAGS = ["(?i)", "(?s)", "(?m)", "(?a)", "(?x)"]


class _Groups:
    """What a regex being drawn has defined so far, so its references are valid."""

    def __init__(self, digit_free: bool) -> None:
        self.digit_free = digit_free
        self.atoms = DIGIT_FREE_ATOMS if digit_free else ATOMS
        self.quantifiers = DIGIT_FREE_QUANTIFIERS if digit_free else QUANTIFIERS
        self.count = 0  # groups opened
        self.closed: list[int] = []  # numbers of closed groups
        self.names: dict[str, int] = {}  # closed named groups


def _group_name(number: int) -> str:
    # Letters only: a digit in a regex makes its table digit-sensitive, and digit-blind
    # tables with named backreferences are a case to test.
    return "n" + "abcdefghijklmnopqrstuvwxyz"[(number - 1) % 26] * ((number - 1) // 26 + 1)


@st.composite
def _regex_body(draw, groups: _Groups, depth: int) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 3 - depth))):
        kind = draw(
            st.sampled_from(
                ["atom"] * 8
                + ["anchor", "group", "group", "group", "named", "noncap", "scoped", "look"]
                + ["behind", "backref", "named_ref", "conditional", "conditional", "alternation"]
            )
        )
        if depth >= 1 and kind in (
            "group",
            "named",
            "noncap",
            "scoped",
            "look",
            "conditional",
            "alternation",
        ):
            kind = "atom"
        if kind == "atom":
            part = draw(st.sampled_from(groups.atoms)) + draw(st.sampled_from(groups.quantifiers))
        elif kind == "anchor":
            part = draw(st.sampled_from(ANCHORS))
        elif kind in ("group", "named"):
            groups.count += 1
            number = groups.count
            inner = draw(_regex_body(groups, depth + 1))
            if kind == "named":
                name = _group_name(number)
                part = f"(?P<{name}>{inner})"
                groups.names[name] = number
            else:
                part = f"({inner})"
            groups.closed.append(number)
            part += draw(st.sampled_from(["?", *groups.quantifiers]))
        elif kind == "noncap":
            part = f"(?:{draw(_regex_body(groups, depth + 1))})" + draw(st.sampled_from(groups.quantifiers))
        elif kind == "scoped":
            flag = draw(st.sampled_from(["i", "-i", "s", "m", "x", "i-s"]))
            part = f"(?{flag}:{draw(_regex_body(groups, depth + 1))})"
        elif kind == "look":
            sign = draw(st.sampled_from("=!"))
            part = f"(?{sign}{draw(_regex_body(groups, depth + 1))})"
        elif kind == "behind":  # fixed width: literals only
            sign = draw(st.sampled_from("=!"))
            literal = draw(st.text(alphabet="ab/" if groups.digit_free else "ab1/", min_size=1, max_size=2))
            part = f"(?<{sign}{literal})"
        elif kind == "backref" and not groups.digit_free:
            part = f"\\{draw(st.sampled_from(groups.closed))}" if groups.closed else "a"
        elif kind in ("named_ref", "backref"):
            part = f"(?P={draw(st.sampled_from(sorted(groups.names)))})" if groups.names else "b"
        elif kind == "conditional":
            if not groups.closed or (groups.digit_free and not groups.names):
                part = "b"
            else:
                by_name = groups.names and (groups.digit_free or draw(st.booleans()))
                ref = (
                    draw(st.sampled_from(sorted(groups.names)))
                    if by_name
                    else draw(st.sampled_from(groups.closed))
                )
                yes, no = draw(st.lists(st.sampled_from(groups.atoms), min_size=2, max_size=2, unique=True))
                part = f"(?({ref}){yes}|{no})"
        else:
            part = f"{draw(_regex_body(groups, depth + 1))}|{draw(_regex_body(groups, depth + 1))}"
            part = f"(?:{part})"
        parts.append(part)
    return "".join(parts)


@st.composite
def regexes(draw, digit_free: bool = False) -> str:
    """One regex from the grammar, that compiles on its own."""
    flags = draw(st.sampled_from([""] * 20 + GLOBAL_FLAGS))
    groups = _Groups(digit_free)
    lead = ""
    if draw(st.booleans()):  # often a group first, so that references have something to refer to
        groups.count = 1
        groups.closed.append(1)
        lead = draw(st.sampled_from(["(", "(?P<na>"])) + draw(st.sampled_from(groups.atoms)) + ")"
        lead += draw(st.sampled_from(["", "?"]))
        if lead.startswith("(?P"):
            groups.names["na"] = 1
    pattern = flags + lead + draw(_regex_body(groups, 0))
    if draw(st.integers(0, 5)) == 0:
        pattern = f"{pattern}|{draw(st.sampled_from(groups.atoms))}"
    try:
        re.compile(pattern)
    except re.error:  # rare (e.g. a reference inside a lookbehind); a plain literal stands in
        return "ab"
    return pattern


def search_loop(patterns, path):
    """The definition: the first rule whose regex re.search-matches the path."""
    return next((i for i, p in enumerate(patterns) if re.search(p, path)), None)


# Every path of up to 3 characters over 'a12/' (85), then drawn longer ones with '2' too.
SHORT_PATHS = [""] + ["".join(chars) for n in (1, 2, 3) for chars in itertools.product("a12/", repeat=n)]


@settings(max_examples=400, deadline=None)
@given(
    patterns=st.booleans().flatmap(lambda free: st.lists(regexes(free), min_size=1, max_size=12)),
    drawn=st.lists(st.text(alphabet=ALPHABET, min_size=4, max_size=9), max_size=20),
    order=st.randoms(use_true_random=False),
)
def test_table_decides_as_a_loop_of_re_search(patterns, drawn, order):
    paths = list(dict.fromkeys(SHORT_PATHS + drawn))
    order.shuffle(paths)
    rules = Rules([(p, REPLICATE) for p in patterns])
    for _ in range(2):  # searched, then from the memo
        for path in paths:
            found = rules.match(path)
            assert (found.index if found else None) == search_loop(patterns, path), (patterns, path)
    for path in paths:
        assert [r.index for r in rules.matches(path)] == [
            i for i, p in enumerate(patterns) if re.search(p, path)
        ]


@pytest.mark.parametrize(
    ("patterns", "path", "expected"),
    [
        (["never_zzz", r"^(p)?(?(1)q|r)$", ".*"], "pq", 1),  # a conditional on group 1
        ([r"(a)\1", r"(b)\1", ".*"], "bb", 1),  # numbered backreferences
        ([r"(?P<x>a)(?P=x)", r"(?P<x>b)(?P=x)", ".*"], "bb", 1),  # a name repeated across rules
        (["zzz", "(?i)AB", ".*"], "ab", 1),  # a global flag, legal only at the start
        (["zzz", "(?i:A)B", ".*"], "aB", 1),  # a scoped one
        ([r"(?P<d>\d)(?P=d)", ".*"], "l/12", 1),  # named backreference: '12' is not '00'
    ],
)
def test_each_rule_keeps_its_meaning(patterns, path, expected):
    rules = Rules([(p, REPLICATE) for p in patterns])
    for i in range(70):  # a table that has searched many paths decides as a fresh one
        rules.match(f"filler{i}zz")
    assert search_loop(patterns, path) == expected
    assert rules.match(path).index == expected
    assert rules.match(path.replace("2", "3")).index == search_loop(patterns, path.replace("2", "3"))
