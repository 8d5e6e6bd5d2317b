"""Pytest set-up for the whole repository: tests/ and the doctests in einshard/.

JAX simulates ``EINSHARD_TEST_DEVICES`` CPU devices (default 8); the nox
``tests`` session runs the suite with 8, 16 and 6. The count must be set before
JAX starts its backend, hence here, at import time, before anything is
collected. The doctests are written for 8 devices and are skipped at other
counts. Doctests of an integration whose framework is not installed are not
collected (its module would fail to import).
"""

import importlib.util
import os
from pathlib import Path

import jax
import pytest

N_DEVICES = int(os.environ.get("EINSHARD_TEST_DEVICES", "8"))
DOCTEST_DEVICES = 8

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", N_DEVICES)


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return True


collect_ignore = [
    f"einshard/integrations/{name}.py"
    for name, module in (
        ("flax", "flax"),
        ("equinox", "equinox"),
        ("optax", "optax"),
        ("orbax", "orbax.checkpoint"),
    )
    if _missing(module)
]
if _missing("optax"):  # optax's integration in two modules: the derivations beside the placing
    collect_ignore.append("einshard/integrations/_optax_state.py")
# Real models from PyPI, installed only by `nox -s real_models` (which sets EINSHARD_REAL_MODELS=1).
if not os.environ.get("EINSHARD_REAL_MODELS"):
    collect_ignore.append("tests/real_models")

try:
    import hypothesis
except ImportError:
    pass
else:
    # The first examples of a property trace and compile; a deadline would make them flaky.
    hypothesis.settings.register_profile("einshard", deadline=None)
    # nox -s fuzz: many more examples for the properties that take theirs from the profile.
    hypothesis.settings.register_profile("fuzz", deadline=None, max_examples=5000)
    hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "einshard"))


ROOT = Path(__file__).parent


def _readme_collector():
    """The docs' example runner for README.md, when the docs tools (Sybil) are installed."""
    if N_DEVICES != DOCTEST_DEVICES or _missing("sybil"):
        return None
    spec = importlib.util.spec_from_file_location("_einshard_doc_examples", ROOT / "docs" / "_examples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.collector(ROOT, ["README.md"])


_README = _readme_collector()


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    """Runs README.md's examples when it is named (``pytest docs README.md``, as nox -s docs does)."""
    if _README is not None and file_path == ROOT / "README.md":
        return _README(file_path, parent)
    return None


def pytest_report_header(config: pytest.Config) -> str:
    """Shows the simulated device count and the JAX version at the top of the run."""
    return f"einshard: {N_DEVICES} simulated CPU devices, jax {jax.__version__}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the doctests unless there are the 8 devices their outputs assume."""
    if N_DEVICES == DOCTEST_DEVICES:
        return
    skip = pytest.mark.skip(
        reason=f"doctests assume {DOCTEST_DEVICES} devices; EINSHARD_TEST_DEVICES={N_DEVICES}"
    )
    for item in items:
        if type(item).__name__ == "DoctestItem":
            item.add_marker(skip)


@pytest.fixture
def compiles(monkeypatch) -> list:
    """The table of every step compiled in this process."""
    from einshard._cost.pipeline import _analysis

    seen: list = []
    compile_step = _analysis.compile_step

    def counting(call):
        seen.append(call.table)
        return compile_step(call)

    monkeypatch.setattr(_analysis, "compile_step", counting)
    return seen


@pytest.fixture
def side_by_side(monkeypatch) -> list:
    """Plans' children side by side: more start after the first answer however short it was (3 at
    most), as on a larger machine; the threads that ran a child, one entry per child."""
    import threading

    from einshard._cost.child import _child

    threads: list[int] = []
    run_child = _child._run_child

    def counted(compiles, first):
        threads.append(threading.get_ident())
        return run_child(compiles, first)

    monkeypatch.setattr(_child, "SECOND_CHILD_AFTER", 0.0)
    monkeypatch.setattr(_child, "_room_for_children", lambda peak_bytes: 3)
    monkeypatch.setattr(_child, "_run_child", counted)
    return threads
