"""Oracles shared by the property tests that do not come from einshard itself."""

import re

from test_error_catalogue import MESSAGES, TEXT


def _message_regex(template):
    return re.compile("".join("(?s:.*)" if part is None else re.escape(part) for part in template))


# The catalogue's messages: those the source raises that docs/errors.md shows.
CATALOGUED = {
    kind: [_message_regex(m.template) for m in MESSAGES if m.kind == kind and m.pattern().search(TEXT)]
    for kind in ("error", "context")
}


def assert_catalogued(error):
    """The error's headline and context lines are messages docs/errors.md shows."""
    assert str(error).startswith(error.headline)
    assert any(t.fullmatch(error.headline) for t in CATALOGUED["error"]), f"uncatalogued: {error.headline!r}"
    for line in error.context:
        assert any(t.fullmatch(line) for t in CATALOGUED["context"]), f"uncatalogued context: {line!r}"
