"""Every code block of README.md and docs/index.md, and of the sections of other pages that say
they paste (the strategies page's plan, shard, train), run as a reader pastes it: in a fresh
interpreter.

What a newcomer sees first must work as shown, with nothing hidden:

* each ```` ```python ```` block runs on its own in a fresh interpreter, whose environment has no
  simulated-device settings (the block sets up what it needs), and prints exactly the
  ```` ```text ```` block that follows it, with nothing on stderr (no warning, no traceback);
* each one is also read as the interactive interpreter reads a paste, line by line (a blank
  line inside an indented block ends it; a statement right after one needs a blank line first),
  and must be accepted whole: pasted into ``python``, it runs as it runs as a script;
* each ```` ```console ```` block's ``$ python ...`` commands run in a fresh process and print
  what the block shows;
* ```` ```sh ```` blocks install or run the suite; CI runs the README's two commands
  (tests/test_first_hour.py checks that ``.ci/run`` has them verbatim);
* no other kind of block, and no hidden set-up (invisible code blocks, skipped blocks).

The examples are written for 8 simulated devices, so this runs with the doctests, at 8.
"""

from __future__ import annotations

import code
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DOCTEST_DEVICES, N_DEVICES

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/index.md"]
# Sections of other pages written to be pasted whole: (page, heading).
SECTIONS = [("docs/strategies.md", "## Plan, shard, train")]
SHOWN_AS_IS = {"sh", "text"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# What a user's shell does not set, and the test session does: simulated devices, a platform.
SESSION_ONLY = ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS", "EINSHARD_TEST_DEVICES")

pytestmark = pytest.mark.skipif(
    N_DEVICES != DOCTEST_DEVICES,
    reason=f"runs once per Python, at {DOCTEST_DEVICES} devices; its interpreters set up their own",
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    source: str
    output: str | None  # the ```text block that follows a ```python block, if any

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: str, section: str | None = None) -> list[Block]:
    text = (ROOT / page).read_text(encoding="utf-8")
    fences = list(FENCE.finditer(text))
    if section is not None:  # the blocks between the heading and the next heading of its level
        start = text.index(f"\n{section}\n")
        level = section.split(" ")[0]
        following = re.compile(f"^{level} ", re.MULTILINE).search(text, start + len(section) + 2)
        end = following.start() if following else len(text)
        fences = [fence for fence in fences if start < fence.start() < end]
    blocks = []
    for i, fence in enumerate(fences):
        language, source = fence.group(1).strip(), fence.group(2)
        if language == "text" and i and fences[i - 1].group(1).strip() == "python":
            continue  # the output of the block before it
        output = None
        if language == "python" and i + 1 < len(fences) and fences[i + 1].group(1).strip() == "text":
            between = text[fence.end() : fences[i + 1].start()].strip()
            if "\n\n" not in between:  # at most one paragraph introduces the output
                output = fences[i + 1].group(2)
        blocks.append(Block(page, text.count("\n", 0, fence.start()) + 1, language, source, output))
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks(page)]
BLOCKS += [block for page, section in SECTIONS for block in _blocks(page, section)]


def test_the_pasted_sections_are_there():
    """A renamed heading would drop its blocks from these tests silently: each must have some."""
    for page, section in SECTIONS:
        languages = [block.language for block in _blocks(page, section)]
        assert "python" in languages, f"{page}: no python block under {section!r}"


def _environment() -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k not in SESSION_ONLY}
    return {**environment, "PYTHONPATH": str(ROOT)}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=_environment(), cwd=cwd, timeout=600)


def test_the_pages_hide_nothing():
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        assert "invisible-code-block" not in text, f"{page} has hidden set-up"
        assert "<!-- skip" not in text, f"{page} skips a block"
        assert not re.search(r"^>>> ", text, re.MULTILINE), f"{page}: a block with prompts does not paste"
    languages = {block.language for block in BLOCKS}
    assert languages <= {"python", "console"} | SHOWN_AS_IS, languages
    assert {"python", "console"} <= languages


class _Paste(code.InteractiveConsole):
    """The interactive interpreter reading a paste: compiles what it would run, and runs none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []
        self.statements = 0

    def runcode(self, code):  # compiled, so accepted: that is all this checks
        self.statements += 1

    def showsyntaxerror(self, filename=None, **kwargs):
        self.errors.append(f"line {self.line}: {sys.exc_info()[1]}")

    def read_paste(self, source: str) -> None:
        more = False
        for self.line, text in enumerate(source.splitlines(), 1):
            more = self.push(text)
        if more:
            self.push("")


def _python_blocks() -> list[Block]:
    return [block for block in BLOCKS if block.language == "python"]


@pytest.mark.parametrize("block", _python_blocks(), ids=str)
def test_a_python_block_pastes_whole(block):
    paste = _Paste()
    paste.read_paste(block.source)
    assert not paste.errors, f"{block}: pasted into python, the interpreter refuses {paste.errors}"
    assert paste.statements > 0


@pytest.mark.parametrize("block", _python_blocks(), ids=str)
def test_a_python_block_prints_what_the_page_shows(block, tmp_path):
    assert block.output is not None, f"{block}: show what it prints in a ```text block right after it"
    done = _run([sys.executable, "-c", block.source], tmp_path)
    assert done.returncode == 0 and not done.stderr, f"{block}: exit {done.returncode}\n{done.stderr}"
    got = [line.rstrip() for line in done.stdout.splitlines()]
    assert got == [line.rstrip() for line in block.output.splitlines()], f"{block} printed:\n{done.stdout}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "console"], ids=str)
def test_a_console_block_prints_what_the_page_shows(block, tmp_path):
    commands: list[tuple[str, list[str]]] = []
    for line in block.source.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            assert commands, f"{block}: output before any '$ ' command"
            commands[-1][1].append(line.rstrip())
    for command, expected in commands:
        argv = shlex.split(command)
        assert argv[0] == "python", f"{block}: only python commands run here, not {command!r}"
        done = _run([sys.executable, *argv[1:]], tmp_path)
        got = [line.rstrip() for line in (done.stdout + done.stderr).rstrip().splitlines()]
        assert (done.returncode, got) == (0, expected), f"{block}: $ {command}\n{done.stdout}{done.stderr}"


def test_the_install_line_gets_this_version_from_the_source_at_hand():
    """The package index, and the public repository, serve einshard 0.2.0: the pages install from
    the source the reader has (a clone or an unpacked archive), name no address that would install
    another version, and show how to check the version, with this version as its output."""
    import tomllib

    import einshard

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "yixiaoer" not in repr(project.get("urls", {})), "pyproject's URLs lead to the public 0.2.0"
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        sh = [block.source for block in _blocks(page) if block.language == "sh"]
        lines = [line for block in sh for line in block.splitlines()]
        assert "python3 -m venv .venv && .venv/bin/pip install '.[all]'" in lines, page
        assert not re.search(r"git\+|git clone", text), page
        assert not any(re.search(r"pip install '?einshard\b", line) for line in lines), page
        assert "0.2.0" in text, f"{page} says nothing of the index's 0.2.0"
        check = [b for b in _blocks(page) if b.language == "console" and "__version__" in b.source]
        assert len(check) == 1, f"{page}: one version check"
        assert check[0].source.splitlines()[-1] == einshard.__version__, page  # run by the console test
