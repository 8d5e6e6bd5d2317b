"""How the examples on the documentation pages (and in README.md) run, on 8 simulated CPU devices.

``python3 -m nox -s docs`` runs ``pytest docs README.md`` (docs/conftest.py
collects the pages, the top-level conftest.py the README and sets the device
count), then builds the site in strict mode. On each page:

* a ```` ```python ```` block is run; when it starts with ``>>>`` it is a
  doctest, and its printed output (pictures, layouts, error messages) must
  match what the page shows. The blocks of one page share one namespace, in
  page order;
* a ```` ```console ```` block is a shell session of ``$ python -m einshard …``
  commands, each run in a fresh process, whose output must match;
* ```` ```sh ```` (commands to install or to run a tool, not run here),
  ```` ```text ```` and ```` ```toml ```` blocks are shown as they are.

Any other fence language fails the page, so an example cannot escape testing
by a typo in its language. ``<!-- skip: next -->`` before a block skips it
(for code that needs several hosts or the network); use it sparingly and say why.
"""

from __future__ import annotations

import doctest
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).parents[1]
DOCTEST_DEVICES = 8
SHOWN_AS_IS = {"sh", "text", "toml"}
RUN = {"python", "console"}


def _run_console(example: Example) -> str | None:
    """Runs each ``$ command`` of a console block and compares its output with the page's."""
    session: str = example.parsed
    commands: list[tuple[str, list[str]]] = []
    for line in session.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line.rstrip())
        elif line.strip():
            return f"console block: output before any '$ ' command: {line!r}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DOCTEST_DEVICES)}
    for command, expected_lines in commands:
        argv = shlex.split(command)
        if argv[0] != "python":
            return f"console block: only 'python ...' commands are run here, not {command!r} (use ```sh)"
        done = subprocess.run(
            [sys.executable, *argv[1:]], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
        )
        got = "\n".join(line.rstrip() for line in (done.stdout + done.stderr).rstrip().splitlines())
        expected = "\n".join(expected_lines).rstrip()
        if got != expected:
            return f"$ {command}\nexpected:\n{expected}\ngot (exit status {done.returncode}):\n{got}"
    return None


def _parse_console(document: Document) -> Iterable[Region]:
    for region in FencedCodeBlockLexer("console")(document):
        region.parsed = region.lexemes["source"]
        region.evaluator = _run_console
        yield region


def _fence_languages(document: Document) -> Iterable[Region]:
    """Fails on a fence whose language is neither run nor known to be shown as it is."""
    for region in FencedCodeBlockLexer(r"[^\n]*")(document):
        language = region.lexemes["language"].strip()
        if language in RUN | SHOWN_AS_IS:
            continue
        line = document.text.count("\n", 0, region.start) + 1

        def fail(example: Example, language: str = language, line: int = line) -> str:
            return (
                f"line {line}: a ```{language or ''} block is neither run nor known; use ```python "
                f"(run), ```console (run), or one of {sorted(SHOWN_AS_IS)} (shown as is)"
            )

        region.evaluator = fail
        yield region


def collector(path: Path, patterns: list[str]) -> Callable[..., Any]:
    """A pytest ``pytest_collect_file`` hook running the examples of the matching Markdown files."""
    return Sybil(
        parsers=[
            _fence_languages,
            SkipParser(),
            PythonCodeBlockParser(doctest_optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS),
            _parse_console,
        ],
        path=str(path),
        patterns=patterns,
    ).pytest()
