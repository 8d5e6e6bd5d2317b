"""Development tasks: ``.venv/bin/nox -s <session>``, after the README's one-time set-up.

``python3 -m venv .venv && .venv/bin/pip install 'nox[uv]'`` makes ``.venv`` (it works where
``python3`` is an externally managed system Python, PEP 668).

Sessions: ``lint`` (ruff), ``types`` (pyright), ``tests`` (each of Python 3.11, 3.12 and 3.13
that is installed, with the newest JAX it can get: the main Python on 8, 16 and 6 simulated CPU
devices, the others on 8; 3.11 and the main one also run the tests of layouts meeting in one jit
on 12),
``tests_oldest_jax`` (the JAX floor of pyproject.toml), ``fuzz`` (Hypothesis
with many examples), ``docs`` (runs every example on the documentation pages,
then builds the site in strict mode), ``docs_serve`` (serves it locally),
``docs_screenshots`` (every page in headless Chromium at 1400 px: fails on clipped content),
``equinox_dev`` (the Equinox tests against the vendored development snapshot),
``mutants`` (planted one-line bugs, each of which the tests must catch; not run by default),
``examples`` (every ``examples/*.py``), ``targets`` (reports and plans compiled by XLA's GPU and
TPU compilers, which it installs; CI runs it), ``real_models`` (strategies and the planner on real
models from PyPI, at 8, 16 and 6 devices) and ``real_models_quick`` (the same at 8 only; CI runs
it), ``benchmarks`` (every
``benchmarks/bench_*.py``) and ``benchmarks_quick`` (each once, bounded; CI runs it). Every
session installs what it needs itself; bare ``nox`` runs lint, types and tests.

Interpreters: a ``pythonX.Y`` that is not on ``PATH`` (or is only a pyenv shim
that does not run) is looked up under ``$(pyenv root)/versions/X.Y*/bin`` and
exposed to nox through a directory of links, so that ``-s tests`` works where
3.12 is installed by pyenv but is not the active version. ``-s tests`` runs on
every supported Python found and skips the others, each with a line saying so
(``tests-3.13: skipped (Python interpreter 3.13 not found)``); it fails when
none is found, or, with ``CI`` set in the environment (as ``.ci/run`` sets it),
when any is missing. Nothing is downloaded: a Python that is not installed is
not fetched. The sessions that run on one Python use the main one: 3.12 where
it is installed, else the newest supported one that is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.download_python = "never"  # test the Pythons that are installed; fetch none
nox.options.sessions = ["lint", "types", "tests", "docs"]

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
PYTHONS = ["3.11", "3.12", "3.13"]  # the supported ones (pyproject.toml's classifiers)
# pytest over the machine's cores, a file per worker (pytest-xdist): the suite is mostly XLA compiles,
# each on one core, so 2 cores run it in about half the time. Whole files keep a file's tests in
# order and its module fixtures built once; more than 4 workers would only add memory.
PYTEST = ["pytest", "--numprocesses=auto", "--maxprocesses=4", "--dist=loadfile"]
MEET_TESTS = [*PYTEST, "tests/test_meet.py", "tests/test_training_steps.py"]
CPU_ONLY = {"JAX_PLATFORMS": "cpu"}  # no probing for accelerators
QUIET_MKDOCS = {"NO_MKDOCS_2_WARNING": "1"}  # the end-of-life banner of Material for MkDocs


def _runs(executable: str, version: str) -> bool:
    """Whether ``executable`` starts and is Python ``version`` (a pyenv shim may not start)."""
    try:
        result = subprocess.run(
            [executable, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and result.stdout.strip() == version


def _pyenv_roots() -> list[Path]:
    roots = [os.environ.get("PYENV_ROOT", "")]
    if pyenv := shutil.which("pyenv"):
        with contextlib.suppress(OSError):
            roots.append(subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip())
    roots.append(str(Path.home() / ".pyenv"))
    return [Path(root) for root in dict.fromkeys(roots) if root]


def _release(path: Path) -> tuple[int, ...]:
    """``.../versions/3.12.10/bin/python3.12`` -> (3, 12, 10), for picking the newest patch release."""
    return tuple(int(n) for n in re.findall(r"\d+", path.parents[1].name))


def _pyenv_interpreter(version: str) -> str | None:
    """The newest working ``$(pyenv root)/versions/X.Y.*/bin/pythonX.Y``, if any."""
    name = f"python{version}"
    candidates = {
        candidate
        for root in _pyenv_roots()
        for pattern in (f"{version}.*", version)
        for candidate in (root / "versions").glob(f"{pattern}/bin/{name}")
    }
    for candidate in sorted(candidates, key=_release, reverse=True):
        if _runs(str(candidate), version):
            return str(candidate)
    return None


def _expose_interpreters(versions: list[str]) -> list[str]:
    """Puts a working ``pythonX.Y`` first on ``PATH`` for every version that lacks one there.

    Returns the versions that have one, on ``PATH`` or under pyenv.
    """
    links = ROOT / ".nox" / "_interpreters"
    present = []
    for version in versions:
        name = f"python{version}"
        on_path = shutil.which(name)
        if on_path and _runs(on_path, version):
            present.append(version)
            continue
        found = _pyenv_interpreter(version)
        if found is None:
            continue  # not installed: nox skips (or, see below, fails) the sessions that need it
        present.append(version)
        links.mkdir(parents=True, exist_ok=True)
        (links / name).unlink(missing_ok=True)
        (links / name).symlink_to(found)
    if links.is_dir() and str(links) not in os.environ["PATH"].split(os.pathsep):
        os.environ["PATH"] = f"{links}{os.pathsep}{os.environ['PATH']}"
    return present


PRESENT_PYTHONS = _expose_interpreters(PYTHONS)
# A missing Python is skipped, with nox's line saying so, unless none is installed or this is CI
# (nox's convention: CI in the environment), where a missing one would go unnoticed.
nox.options.error_on_missing_interpreters = not PRESENT_PYTHONS or "CI" in os.environ
# The Python of the sessions that run on one: 3.12 where installed (the published figures and the
# documentation's outputs are made with it), else the newest supported one that is.
MAIN_PYTHON = "3.12" if "3.12" in PRESENT_PYTHONS or not PRESENT_PYTHONS else PRESENT_PYTHONS[-1]
NEWEST_PYTHON = MAIN_PYTHON  # the name the sessions below use for it


def _test_device_counts(python: str) -> list[int]:
    """The device counts the suite runs at on one Python.

    Every count on the main Python (8, 16, and 6, which is no power of two); a power of two on the
    others. 3.11 gets the oldest JAX of the three and 3.13 the same JAX as 3.12, so a second full
    run at 16 and 6 would cost CI more than it could find: the layout arithmetic behind those counts
    is pure Python, the same on every version, and 3.11's JAX meets a count that is no power of
    two in the 12-device run (``MEET_TESTS``).
    """
    return [8, 16, 6] if python == MAIN_PYTHON else [8]


# The tests of the cost model and the planner: each compiles whole training steps (most of the
# suite's time). They run on every JAX CI tests (3.11's and the main Python's) at 8 and at 6
# devices (no power of two); at 16 (a power of two, like 8) and on 3.13 (the main Python's JAX
# again) they would find nothing new for their minutes, so those runs leave them out. The
# multi-process tests (2 processes x 4 devices, whatever the count) run at 8 devices only.
COMPILES_STEPS = [
    "tests/test_roles.py",
    "tests/test_reading.py",
    "tests/test_primitives.py",
    "tests/test_planner.py",
    "tests/test_strategies.py",
    "tests/test_step.py",
    "tests/test_findings.py",
    "tests/test_finding_fixes.py",
    "tests/test_finding_properties.py",
    "tests/test_report_bytes.py",
    "tests/test_volumes.py",
    "tests/test_targets.py",
    "tests/test_step_time.py",
    "tests/test_hosts.py",
    "tests/test_plan_bounds.py",
    "tests/test_plan_pruning.py",
    "tests/test_plan_opt_state.py",
    "tests/test_batches.py",
    "tests/test_progress.py",
    "tests/test_figures_contract.py",
    "tests/test_child_script.py",
    "tests/test_scanned.py",
    "tests/test_scanned_frameworks.py",
    "tests/test_bounds_rules.py",
    "tests/test_step_time_programs.py",
    "tests/test_children.py",
    "tests/test_every_path.py",
    "tests/test_own_errors.py",
    "tests/test_loops.py",
    "tests/test_one_trace.py",
    "tests/test_plan_layers.py",
    # The pages' examples in fresh interpreters (at 8 devices only): 3.13 has 3.12's JAX.
    "tests/test_pasted_examples.py",
]


# Of those, the tests of the child process's machinery (its pipe, progress, a script run again,
# its crashes and einshard's own errors from it): their children's device counts are their own
# (fixed, or twice this run's), so the run at 6 devices leaves them out too, as it leaves out
# COUNT_INDEPENDENT; 3.11 and the main Python run them at 8.
CHILD_MACHINERY = [
    "tests/test_children.py",
    "tests/test_progress.py",
    "tests/test_child_script.py",
    "tests/test_own_errors.py",
]
assert set(CHILD_MACHINERY) <= set(COMPILES_STEPS)


# Tests whose subject does not depend on the device count (source reading, fresh interpreters,
# regex semantics, checkpoints restored between fixed counts, program text read by the step-time
# walk): the main Python's runs at 16 and 6 leave them out (3.11 runs them all at 8).
COUNT_INDEPENDENT = [
    "tests/test_checkpoint.py",
    "tests/test_rule_search.py",
    "tests/test_import.py",
    "tests/test_signatures.py",
    "tests/test_error_catalogue.py",
    "tests/test_layers.py",
    "tests/test_step_time_rules.py",
    "tests/test_step_time_properties.py",
    "tests/test_matmul_flops.py",
    "tests/test_out_of_memory.py",
    "tests/test_tpu.py",
    "tests/test_links.py",
    "tests/test_jaxprs.py",
    "tests/test_torus.py",
]


def _left_out(python: str, count: int) -> list[str]:
    """The test files a run leaves out (``--ignore``): see ``COMPILES_STEPS``, ``CHILD_MACHINERY`` and
    ``COUNT_INDEPENDENT``."""
    if python == PYTHONS[0] or (python == MAIN_PYTHON and count == 8):
        return []
    files = ["tests/test_multihost.py"]
    if not (python == MAIN_PYTHON and count == 6):  # 16 devices, or 3.13
        files += COMPILES_STEPS
    else:
        files += CHILD_MACHINERY
    if python == MAIN_PYTHON:  # 16 or 6 devices
        files += COUNT_INDEPENDENT
    return [f"--ignore={name}" for name in files]


def _runs_meet_tests(python: str) -> bool:
    """The 12-device tests of layouts meeting in one jit: on the main Python and on 3.11 (the oldest JAX)."""
    return python in (MAIN_PYTHON, PYTHONS[0])


def _group(name: str) -> list[str]:
    """The requirements of a PEP 735 dependency group in pyproject.toml."""
    return list(nox.project.dependency_groups(PYPROJECT, name))


def _dev(tool: str) -> str:
    """The ``dev`` group's requirement for one tool, e.g. ``ruff>=0.9``."""
    for requirement in _group("dev"):
        if re.match(rf"{re.escape(tool)}\b", requirement):
            return requirement
    raise ValueError(f"{tool} is not in the dev dependency group")


def _show_versions(session: nox.Session, *packages: str) -> None:
    """Logs the Python and package versions the session runs with (all must be installed)."""
    code = (
        "import importlib.metadata as m, platform; "
        f"print('Python', platform.python_version(), *(p + ' ' + m.version(p) for p in {packages!r}))"
    )
    session.run("python", "-c", code, silent=False)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff: lint rules and formatting (``ruff format`` fixes the latter)."""
    session.install(_dev("ruff"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=NEWEST_PYTHON)
def types(session: nox.Session) -> None:
    """Pyright (basic) on the package, with every optional framework installed."""
    session.install("--upgrade", "-e", ".[all]", _dev("pyright"))
    session.run("pyright", "einshard")


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The test suite and the doctests, on each supported Python that is installed.

    The main Python (3.12 where installed) runs on 8, 16 and 6 simulated CPU
    devices, the others on 8; the main one and 3.11 also run the tests of
    layouts meeting in one jit on 12 (see ``_test_device_counts``). A Python
    that is not installed is skipped, saying so.

    Installs the newest JAX this Python can get (``--upgrade``), with every
    optional framework, so the integrations are tested too. Extra arguments go
    to pytest: ``nox -s tests -- -k picture -x`` (``-n 0``: in one process,
    without ``PYTEST``'s workers).
    """
    python = str(session.python)
    session.install("--upgrade", "-e", ".[all]", "jax", *_group("test"))
    _show_versions(session, "jax", "jaxlib", "numpy", "flax", "equinox", "optax", "chex", "hypothesis")
    for count in _test_device_counts(python):
        session.log(f"--- {count} simulated CPU devices ---")
        left_out = [] if session.posargs else _left_out(python, count)
        if left_out:
            lists = "COMPILES_STEPS, CHILD_MACHINERY and COUNT_INDEPENDENT"
            session.log(f"(leaving out {len(left_out)} files: see {lists})")
        session.run(
            *PYTEST,
            *left_out,
            *session.posargs,
            env={"EINSHARD_TEST_DEVICES": str(count), **CPU_ONLY},
        )
    if not session.posargs and _runs_meet_tests(python):
        # 12 devices: two prime factors, so the order of the counts matters for the shared mesh.
        session.log("--- 12 simulated CPU devices: layouts meeting in one jit, training steps ---")
        session.run(*MEET_TESTS, env={"EINSHARD_TEST_DEVICES": "12", **CPU_ONLY})


@nox.session(python=NEWEST_PYTHON)
def fuzz(session: nox.Session) -> None:
    """Hypothesis with many examples over expressions, rule tables, trees, the shared mesh, the
    planner's ranking, FSDP's choice and the simulated step time (not run by default)."""
    session.install("--upgrade", "-e", ".[all]", "jax", *_group("test"))
    session.run(
        "pytest",
        "tests/test_fuzz.py",
        "tests/test_expression.py",
        "tests/test_meet.py",
        "tests/test_step_time_properties.py",
        "tests/test_planner.py::test_the_ranking_is_the_reference_order_at_any_figures",
        "tests/test_strategies.py::test_fsdp_splits_the_largest_axis_that_divides_like_the_reference",
        *session.posargs,
        env={
            "EINSHARD_TEST_DEVICES": "8",
            "HYPOTHESIS_PROFILE": "fuzz",
            "EINSHARD_MEET_EXAMPLES": "300",
            **CPU_ONLY,
        },
    )


@nox.session(python=NEWEST_PYTHON)
def mutants(session: nox.Session) -> None:
    """Plants each one-line bug of ``tools/mutants.py`` in a copy of the package and runs its tests.

    Every planted bug must fail at least 3 tests in at least 2 test functions (8 devices); the
    session prints a table and fails when one is not caught, or when a mutant's anchor (module
    and exact snippet) is not found exactly once. Not run by default, nor by CI. Extra arguments
    go to the script: ``nox -s mutants -- --full`` (the whole suite on each), ``-- --only NAME``,
    ``-- --check`` (anchors only), ``-- --markdown mutants.md``.
    """
    session.install("--upgrade", "-e", ".[all]", "jax", *_group("test"))
    _show_versions(session, "jax", "jaxlib", "hypothesis")
    session.run("python", "tools/mutants.py", *session.posargs, env=CPU_ONLY)


@nox.session(python=PYTHONS[0])
def tests_oldest_jax(session: nox.Session) -> None:
    """The suite on 8 devices with the oldest JAX pyproject.toml allows (not run by default)."""
    floor = next(
        match.group(1)
        for requirement in PYPROJECT["project"]["dependencies"]
        if (match := re.fullmatch(r"jax\s*>=\s*([\w.]+)", requirement))
    )
    session.install("-e", ".[all]", f"jax=={floor}", f"jaxlib=={floor}", *_group("test"))
    _show_versions(session, "jax", "jaxlib", "numpy", "flax", "equinox", "optax")
    session.run(*PYTEST, *session.posargs, env={"EINSHARD_TEST_DEVICES": "8", **CPU_ONLY})


@nox.session(python=NEWEST_PYTHON)
def docs(session: nox.Session) -> None:
    """Runs every example on the documentation pages and in README.md (8 devices), then builds the site.

    The site lands in ``site/``. Extra arguments go to pytest: ``nox -s docs -- -k rules``.
    """
    session.install("--upgrade", "-e", ".[all]", "jax", *_group("docs"))
    _show_versions(session, "jax", "flax", "equinox", "optax", "mkdocs", "mkdocs-material", "sybil")
    session.run(
        *PYTEST, "docs", "README.md", *session.posargs, env={"EINSHARD_TEST_DEVICES": "8", **CPU_ONLY}
    )
    session.run("mkdocs", "build", "--strict", env={**CPU_ONLY, **QUIET_MKDOCS})


# The programs XLA's GPU compiler made for 8 real H200s, beside the clone (tests/test_targets.py).
ACCELERATOR_PROGRAMS = ROOT.parent / "shared" / "accelerators" / "h200x8-jax0.11.2"


# The tests that need XLA's GPU or TPU compiler (they skip without it, so only this session runs them).
TARGET_TESTS = [
    "tests/test_targets.py",
    "tests/test_step_time.py",  # the three measured H200 steps: time within 1.5x, peak within 1 %
    "tests/test_hosts.py",  # 16 H100s over 2 hosts: the model axis inside a host, read from the program
    # The compile-only options change nothing of the program (the file's other tests, which need
    # no compiler, run in the tests session).
    "tests/test_plan_bounds.py::test_the_compile_only_gpu_options_leave_the_program_s_figures_unchanged",
    # Each child's kernel cache: the same figures, its folder removed.
    "tests/test_plan_bounds.py::test_a_child_s_kernel_cache_leaves_the_figures_unchanged_and_is_removed",
    # The bounds against simulated programs, the same winner pruned.
    "tests/test_plan_pruning.py::test_on_a_gpu_target_the_bounds_hold_and_the_winner_is_the_same",
    # A plan from a few layers on a GPU and a TPU target: the winner of whole compiles, kernels extrapolated.
    "tests/test_plan_layers.py::test_a_sampled_plan_on_a_target_picks_the_winner_of_whole_compiles",
    # A kept loop's activations gathered in place of weights: reduce-scattered on a GPU, as its finding says.
    "tests/test_finding_fixes.py::test_activations_gathered_in_place_of_weights_are_reduce_scattered_on_the_target_the_fix_names",
    # A TPU's scanned step (its loops, async collective fusions) and a GPU's, compiled here.
    "tests/test_step_time_programs.py::test_a_tpu_scanned_step_s_loops_and_async_collective_fusions_are_read",
    "tests/test_step_time_programs.py::test_a_gpu_scanned_step_s_async_fusions_cost_their_layer_not_their_stack",
    # Every public verb on a GPU and a TPU target, in one child and in several.
    "tests/test_every_path.py::test_every_verb_on_a_target_in_one_child",
    "tests/test_every_path.py::test_a_target_s_plan_in_several_children_is_the_plan_of_one",
    "tests/test_every_path.py::test_every_verb_on_two_tpu_slices",
    # Random einsums compiled for v5e, v5p, v6e and an H100: the same flops, the formula's (8
    # examples, 4 compiles each); the attention step on 8 v5p.
    "tests/test_matmul_flops.py::test_a_random_einsum_s_flops_on_each_tpu_are_the_h100_s_and_the_formula",
    "tests/test_matmul_flops.py::test_the_issue_s_data_parallel_attention_has_its_flops_on_8_v5p",
    # A step libtpu refuses for memory: explain_step's verdict here and from a child, a plan and a
    # batch plan on v5e; XLA's GPU compiler compiling one too large for an H100.
    "tests/test_out_of_memory.py",
    # The TPU generations' figures and libtpu's compile-only devices: their coordinates, slices.
    "tests/test_tpu.py",
    # A TPU device's place as libtpu gives it, and a 2-slice FSDP program's megascale transfers.
    "tests/test_torus.py::test_a_device_s_place_is_libtpu_s_own",
    "tests/test_torus.py::test_two_slices_fsdp_program_sends_between_slices_at_dcn",
    "tests/test_torus.py::test_a_tpu_target_s_figures_make_the_torus_and_a_bandwidth_given_is_every_collective_s",
    # Which host each compile-only GPU is on, and each GPU's links with their sources.
    "tests/test_links.py::test_the_compile_only_gpus_hosts_are_the_links_answer",
    "tests/test_links.py::test_each_gpu_s_links_come_with_their_sources",
]


@nox.session(python=NEWEST_PYTHON)
def targets(session: nox.Session) -> None:
    """Reports and plans for GPUs and TPUs with their own XLA compilers, on this machine (8 devices).

    Installs both compilers (``.[gpu-target,tpu-target]``: jax-cuda13-plugin and -pjrt, and
    libtpu, at the installed JAX's version; about 340 MB to download) and runs
    ``TARGET_TESTS``: the seven real H200 programs of ``../shared/accelerators/`` read and
    recompiled here, 64 H100s, 8 TPU v5e chips, a plan for 64 H100s, the three measured H200
    steps' time and memory, 16 H100s over two hosts. Fails when a
    compiler or ``../shared/accelerators`` is missing (``EINSHARD_TARGET_TESTS=1``: nothing skips).
    Extra arguments go to pytest: ``nox -s targets -- -k v5e``.
    """
    if not ACCELERATOR_PROGRAMS.is_dir():
        session.error(f"no real accelerator programs: expected {ACCELERATOR_PROGRAMS} beside the clone")
    session.install("--upgrade", "-e", ".[all,gpu-target,tpu-target]", "jax", *_group("test"))
    _show_versions(session, "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "libtpu")
    session.run(
        *PYTEST,
        *TARGET_TESTS,
        *session.posargs,
        # Each pytest worker loads libtpu, which takes a lock per machine unless told that
        # several processes may (no TPU is attached: they only compile).
        env={
            "EINSHARD_TEST_DEVICES": "8",
            "EINSHARD_TARGET_TESTS": "1",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            **CPU_ONLY,
        },
    )


# Equinox's development line, vendored beside the clone (EINSHARD_VENDOR names another directory).
EQUINOX_SNAPSHOT = Path(os.environ.get("EINSHARD_VENDOR", ROOT.parent / "shared" / "vendor"))


@nox.session(python=NEWEST_PYTHON)
def equinox_dev(session: nox.Session) -> None:
    """The Equinox tests against the vendored development snapshot of Equinox (8 devices).

    Installs ``../shared/vendor/equinox-*.whl`` (beside the repository root, or in
    ``$EINSHARD_VENDOR``) over the released Equinox, without its dependencies; fails, saying so,
    when it is absent.
    """
    wheels = sorted(EQUINOX_SNAPSHOT.glob("equinox-*.whl"))
    if not wheels:
        session.error(f"no Equinox snapshot: expected {EQUINOX_SNAPSHOT}/equinox-*.whl beside the clone")
    session.install("--upgrade", "-e", ".[all]", "jax", *_group("test"))
    session.install("--no-deps", "--force-reinstall", str(wheels[-1]))
    _show_versions(session, "jax", "equinox", "optax")
    session.run(
        "pytest", "tests/test_equinox.py", *session.posargs, env={"EINSHARD_TEST_DEVICES": "8", **CPU_ONLY}
    )


@nox.session(python=NEWEST_PYTHON)
def docs_serve(session: nox.Session) -> None:
    """Builds the site and serves it at http://127.0.0.1:8000, rebuilding on every change."""
    session.install("-e", ".[all]", "jax", *_group("docs"))
    session.run(
        "mkdocs", "serve", "--dev-addr", "127.0.0.1:8000", *session.posargs, env={**CPU_ONLY, **QUIET_MKDOCS}
    )


@nox.session(python=NEWEST_PYTHON)
def docs_screenshots(session: nox.Session) -> None:
    """Builds the site and opens every page in headless Chromium at 1400 px; fails if any clips.

    A code block, table or page that would scroll sideways, or a picture or ``explain`` table
    whose columns would wrap, fails the session (see ``docs/_screenshots.py``). Screenshots of
    every page land in ``.nox/screenshots/``. Needs Debian's Chromium and its driver
    (``apt-get install chromium chromium-driver``). Extra arguments go to the checker:
    ``nox -s docs_screenshots -- --width 1280``.
    """
    browsers = {tool: shutil.which(tool) for tool in ("chromium", "chromedriver")}
    if not all(browsers.values()):
        session.error("needs chromium and chromedriver: apt-get install chromium chromium-driver")
    session.install("-e", ".[all]", "jax", *_group("docs"), "selenium>=4.11")
    site = ROOT / ".nox" / "screenshots-site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site), env={**CPU_ONLY, **QUIET_MKDOCS})
    session.run(
        "python",
        "docs/_screenshots.py",
        str(site),
        "--out",
        str(ROOT / ".nox" / "screenshots"),
        f"--chromium={browsers['chromium']}",
        f"--chromedriver={browsers['chromedriver']}",
        *session.posargs,
        env={"SE_AVOID_STATS": "true"},  # Selenium's usage statistics: never sent from here
    )


@nox.session(python=NEWEST_PYTHON)
def examples(session: nox.Session) -> None:
    """Runs every ``examples/*.py`` as a script (JAX sees 8 CPU devices unless the example says otherwise)."""
    scripts = sorted((ROOT / "examples").glob("*.py"))
    if not scripts:
        session.error("no examples/*.py to run")
    session.install("--upgrade", "-e", ".[all]", "jax")
    _show_versions(session, "jax", "flax", "equinox", "optax")
    for script in scripts:
        session.log(f"--- {script.relative_to(ROOT)} ---")
        session.run("python", str(script), env={"JAX_NUM_CPU_DEVICES": "8", **CPU_ONLY})


# Real models from PyPI that nobody here wrote, for tests/real_models/ only: pinned, never
# dependencies of einshard. Gemma goes in without its declared dependencies (kauldron, grain,
# sentencepiece and, through them, TensorFlow: about 150 packages for `gemma.gm`); the
# `gemma.transformer` module the tests use needs only Flax and orbax, which `.[all]` brings.
REAL_MODELS = ["equimo==1.1.0", "esm2quinox==0.2.0", "mamba2-jax==1.1.2", "transformers==4.57.6"]
REAL_MODELS_WITHOUT_DEPENDENCIES = ["gemma==2.0.8"]
REAL_MODEL_DEVICE_COUNTS = [8, 16, 6]


def _real_models(session: nox.Session, counts: list[int], select: tuple[str, ...] = ()) -> None:
    session.install("--upgrade", "-e", ".[all]", "jax", *_group("test"), *REAL_MODELS)
    session.install("--no-deps", *REAL_MODELS_WITHOUT_DEPENDENCIES)
    packages = [pin.split("==")[0] for pin in REAL_MODELS_WITHOUT_DEPENDENCIES + REAL_MODELS]
    _show_versions(session, "jax", "flax", "equinox", *packages)
    for count in counts:
        session.log(f"--- real models, {count} simulated CPU devices ---")
        session.run(
            *PYTEST,
            "tests/real_models",
            *select,
            *session.posargs,
            env={"EINSHARD_TEST_DEVICES": str(count), "EINSHARD_REAL_MODELS": "1", **CPU_ONLY},
        )


@nox.session(python=NEWEST_PYTHON)
def real_models(session: nox.Session) -> None:
    """Strategies, derived tensor parallelism and the planner on real models from PyPI (8, 16, 6 devices).

    Installs the pinned model packages of ``REAL_MODELS`` (nothing is downloaded at run time:
    every model is built small from random weights) and runs ``tests/real_models/``, which the
    ``tests`` session does not collect. Extra arguments go to pytest: ``nox -s real_models -- -k gemma``.
    """
    _real_models(session, REAL_MODEL_DEVICE_COUNTS)


@nox.session(python=NEWEST_PYTHON)
def real_models_quick(session: nox.Session) -> None:
    """``real_models`` bounded for CI: Gemma and equimo's ViT only, at 8 devices."""
    _real_models(session, REAL_MODEL_DEVICE_COUNTS[:1], ("-k", "gemma_lm or equimo_vit"))


# What bench_plan_at_size.py's Hugging Face runs import (benchmarks/_hf_llama.py says why this version).
HF_LLAMA = "transformers>=4.57,<4.58"


@nox.session(python=NEWEST_PYTHON)
def benchmarks(session: nox.Session) -> None:
    """Runs every ``benchmarks/bench_*.py``; fails if a benchmark misses its bar.

    Each script writes its results to ``benchmarks/results/<name>.json`` (``bench_rules.py``:
    ``rules.json``), which the docs' benchmark page and plots are built from. Extra arguments
    go to every script: ``nox -s benchmarks -- --no-fail``.
    """
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.error("no benchmarks/bench_*.py to run")
    # bench_plan_at_size: H100s, and Hugging Face's Flax LLaMA (transformers 5 has no Flax models)
    session.install("--upgrade", "-e", ".[all,gpu-target]", "jax", HF_LLAMA)
    _show_versions(session, "jax", "jaxlib", "numpy")
    for script in scripts:
        session.log(f"--- {script.relative_to(ROOT)} ---")
        results = ROOT / "benchmarks" / "results" / f"{script.stem.removeprefix('bench_')}.json"
        session.run("python", str(script), "--json", str(results), *session.posargs, env=CPU_ONLY)


# The bounded run CI makes: each script's fewest repetitions (the figures of a shared CI machine are
# not the published ones), bars reported but not enforced, results kept out of benchmarks/results/.
QUICK_BENCHMARK_ARGS = {
    "bench_curves.py": ["--quick"],
    "bench_plan_at_size.py": ["--quick"],  # the 1.5 B scanned plan and a tiny HF LLaMA for 8 H100s
    "bench_roles.py": ["--warmup", "0", "--reps", "1"],  # two fresh processes per layout: ~1 min
    "bench_rules.py": ["--skip-memory"],
}


@nox.session(python=NEWEST_PYTHON)
def benchmarks_quick(session: nox.Session) -> None:
    """Every ``benchmarks/bench_*.py`` once, bounded (a few minutes; CI runs it).

    Each script runs with ``--reps 2 --seconds 0 --warmup 1 --no-fail`` (``bench_curves.py``:
    ``--quick``; ``bench_rules.py`` without its memory subprocesses) and writes its JSON to
    ``.nox/benchmarks-quick/``; the session fails if a script fails or writes no table. The
    published figures come from ``nox -s benchmarks``, meant for an idle machine; each results
    file records the load it was measured under, and the benchmarks page says when it was not
    idle.
    """
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.error("no benchmarks/bench_*.py to run")
    session.install("--upgrade", "-e", ".[all,gpu-target]", "jax", HF_LLAMA)  # bench_plan_at_size
    out = ROOT / ".nox" / "benchmarks-quick"
    out.mkdir(parents=True, exist_ok=True)
    for script in scripts:
        session.log(f"--- {script.relative_to(ROOT)} (bounded) ---")
        results = out / f"{script.stem.removeprefix('bench_')}.json"
        results.unlink(missing_ok=True)
        bounded = ["--reps", "2", "--seconds", "0", "--warmup", "1", "--no-fail"]
        session.run(
            "python",
            str(script),
            *bounded,
            *QUICK_BENCHMARK_ARGS.get(script.name, []),
            "--json",
            str(results),
            env=CPU_ONLY,
        )
        tables = json.loads(results.read_text()).get("tables", {})
        if not tables or not all(table.get("rows") for table in tables.values()):
            session.error(f"{script.name} wrote no results to {results}")
