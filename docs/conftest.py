"""Collects the examples of every documentation page (see _examples.py), on 8 devices only."""

import os
from pathlib import Path

import pytest
from _examples import DOCTEST_DEVICES, collector

if int(os.environ.get("EINSHARD_TEST_DEVICES", "8")) != DOCTEST_DEVICES:
    pytest.skip(f"the pages' examples assume {DOCTEST_DEVICES} devices", allow_module_level=True)

pytest_collect_file = collector(Path(__file__).parent, ["*.md"])

# A script for the docs_screenshots session (it needs selenium and a browser), not a module to test.
collect_ignore = ["_screenshots.py"]
