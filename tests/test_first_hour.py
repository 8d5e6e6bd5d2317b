"""A newcomer's first hour: the README's commands, missing frameworks, one device, swapped arguments."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: hides one framework (None in sys.modules makes its import fail as if
# it were not installed), imports the integration, and prints the error it raised.
HIDDEN_FRAMEWORK = """
import sys
sys.modules[{hidden!r}] = None
try:
    import einshard.integrations.{integration}
except ImportError as error:
    print(type(error).__name__, error, sep=": ")
    print("cause:", type(error.__cause__).__name__, getattr(error.__cause__, "name", None))
else:
    print("imported")
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("integration", "hidden", "pretty"),
    [
        ("flax", "flax", "Flax"),
        ("equinox", "equinox", "Equinox"),
        ("optax", "optax", "optax"),
        ("orbax", "orbax.checkpoint", "orbax-checkpoint"),
    ],
)
def test_a_missing_framework_says_how_to_install_it(integration, hidden, pretty):
    pytest.importorskip("orbax.checkpoint" if integration == "orbax" else integration)
    done = _python(HIDDEN_FRAMEWORK.format(hidden=hidden, integration=integration))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"ImportError: einshard.integrations.{integration} needs {pretty}, which is not installed; "
        f"install it with: pip install {hidden.split('.')[0] if integration != 'orbax' else pretty} "
        f"(or pip install '.[{integration}]' in einshard's source folder)",
        f"cause: ModuleNotFoundError {hidden}",
    ]


def test_a_broken_framework_keeps_its_own_error():
    """Flax installed but missing something it imports: the message must not say to install Flax."""
    pytest.importorskip("flax")
    code = HIDDEN_FRAMEWORK.format(hidden="msgpack", integration="flax")
    done = _python(code)
    assert done.returncode == 0, done.stderr
    if done.stdout.startswith("imported"):
        pytest.skip("this Flax does not import msgpack when einshard's integration imports it")
    assert done.stdout.splitlines()[0].startswith("ModuleNotFoundError: import of msgpack halted")
    assert "einshard[flax]" not in done.stdout


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```sh\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _readme_command(part: str) -> str:
    (command,) = [line for line in _readme_commands() if part in line]
    return command


def test_ci_runs_the_readmes_commands_verbatim():
    run, tests = _readme_command("examples/mlp_tensor_parallel.py"), _readme_command("nox -s tests")
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert run in ci_lines and tests in ci_lines


def test_the_readmes_commands_install_into_a_virtual_environment():
    """pip refuses to install into an externally managed (PEP 668) system Python: the commands must not."""
    installs = [command for command in _readme_commands() if "pip install" in command]
    assert len(installs) >= 3  # from the source, and the example's and the tests' own
    for command in installs:
        steps = [step.strip() for step in command.split("&&")]
        assert steps[0] == "python3 -m venv .venv", command
        assert all(not step.startswith(("python3 -m pip", "pip ")) for step in steps), command


ONE_DEVICE = """
import warnings
import jax, jax.numpy as jnp
import einshard
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    w = einshard.einshard(jnp.zeros((128, 256)), 'x y -> x y*')
    einshard.einshard(jnp.zeros((8,)), 'x -> x*')
    einshard.make_sharding('x y -> y* x')
print(len(jax.devices()), w.sharding.shard_shape(w.shape))
for warning in caught:
    print(warning.category.__name__, warning.filename, warning.lineno, warning.message, sep=" | ")
"""


def test_one_device_warns_once_where_the_user_called():
    """A newcomer's laptop: one CPU device, where 'x y -> x y*' splits nothing."""
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", ONE_DEVICE],
        capture_output=True,
        text=True,
        env={**environment, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "1 (128, 256)"
    assert len(lines) == 2, lines  # once, though three calls split a starred axis
    category, filename, lineno, message = lines[1].split(" | ")
    assert (category, filename, lineno) == ("EinshardWarning", "<string>", "7")  # the user's line
    assert message.startswith("einshard sees 1 device, so 'x y -> x y*' splits nothing ('y*' resolves")
    assert "jax.config.update('jax_num_cpu_devices', 8)" in message


def test_no_warning_with_several_devices_or_explicit_devices():
    import jax
    import jax.numpy as jnp

    import einshard

    # The suite turns warnings into errors: these would fail if they warned.
    w = einshard.einshard(jnp.zeros((128, 240)), "x y -> x y*")  # 240 splits on 6, 8 and 16 devices
    assert w.sharding.shard_shape(w.shape) == (128, 240 // len(jax.devices()))
    one = einshard.einshard(jnp.zeros((128, 240)), "x y -> x y*", devices=jax.devices()[:1])
    assert one.sharding.device_set == {jax.devices()[0]}


def test_swapped_arguments_say_the_order():
    import jax.numpy as jnp

    import einshard

    with pytest.raises(einshard.EinshardError) as info:
        einshard.einshard("x y -> x y*", jnp.zeros((128, 256)))
    error = info.value
    assert error.headline == "the first argument is an expression: the array comes first, then the expression"
    assert error.expression == "x y -> x y*"
    assert error.hint == "Call einshard(array, 'x y -> x y*')."
    # A string that is not an expression is still data, with the error for data.
    with pytest.raises(einshard.EinshardError, match="cannot shard an array of dtype <U5"):
        einshard.einshard("hello", "... -> * ...")


def test_the_version_is_a_release_the_changelog_describes():
    import tomllib

    import einshard

    assert re.fullmatch(r"\d+\.\d+\.\d+", einshard.__version__), einshard.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## (\S+) \((\d{4}-\d\d-\d\d)\)$", changelog, re.MULTILINE)
    assert versions and versions[0][0] == einshard.__version__, versions  # dated
    # Work since the release sits under "## Unreleased", above it; the release says what changed since 0.2.0.
    sections = changelog.split("\n## ")[1:]
    assert sections[0].startswith(("Unreleased\n", f"{einshard.__version__} (")), sections[0][:40]
    release = next(section for section in sections if section.startswith(f"{einshard.__version__} ("))
    assert "0.2.0" in release
    # No address that serves another version (the public repository's newest is 0.2.0).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "urls" not in project, project.get("urls")


def test_the_cli_documents_every_shape_form_it_accepts(capsys):
    from einshard.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    forms = ["4,8", "4x8", "'4 8'", "'(4, 8)'"]
    for form in forms:
        assert f"({form})" in help_text, form
    for form in forms:
        assert main(["x y -> x y*", "--shape", form.strip("'"), "--devices", "4"]) == 0
        assert capsys.readouterr().out.startswith("'x y -> x y*': shape (4, 8) on 4 devices: 4 shards of")
    with pytest.raises(SystemExit) as exit_info:
        main(["x y -> x y*", "--shape", "4;8", "--devices", "4"])
    assert exit_info.value.code == 2
    assert "'4;8' is not a shape" in capsys.readouterr().err


def test_explain_says_what_the_replication_overhead_is_and_which_leaves_cause_it():
    import jax
    import jax.numpy as jnp

    import einshard

    f32 = jnp.float32
    tree = {
        "w": jax.ShapeDtypeStruct((1024, 1024), f32),  # 4 MiB, split over all devices
        "embed": jax.ShapeDtypeStruct((1024, 64), f32),  # 256 KiB, replicated
        "half": jax.ShapeDtypeStruct((128, 64), f32),  # 32 KiB, split in 2 only
        "b": jax.ShapeDtypeStruct((64,), f32),  # 256 B, replicated
        "c": jax.ShapeDtypeStruct((16,), f32),  # 64 B, replicated
    }
    rules = [("w", "x y -> x y*"), ("half", "x y -> x2 y *"), (".*", "... -> * ...")]
    report = einshard.explain(tree, rules, n_devices=256)
    total = (1024 * 1024 + 1024 * 64 + 128 * 64 + 64 + 16) * 4
    per_device = (1024 * 4 + 1024 * 64 + 64 * 64 + 64 + 16) * 4
    assert (report.total_bytes, report.max_bytes_per_device) == (total, per_device)
    assert report.replication_overhead == pytest.approx(per_device * 256 / total)  # the attribute stays
    lines = str(report).splitlines()
    assert lines[-2] == (
        f"5 arrays, 4.3 MiB on 256 devices: {per_device / 1024:.1f} KiB per device, "
        f"replication overhead {per_device * 256 / total:.2f}x"
    )
    # Beyond an even share (17.1 KiB): embed's whole 256 KiB less its 1 KiB share, half's 16 KiB
    # block less its 128 B share, then b's and c's 256 B and 64 B less theirs (1 B and 0.25 B).
    assert lines[-1] == (
        "replication: each device holds 271.2 KiB beyond an even 1/256 share of the model (17.1 KiB), "
        "from leaves not split over all 256 devices; most from embed (255.0 KiB), half (15.9 KiB), "
        "b (255 B) and 1 more"
    )


def test_explain_with_every_leaf_split_everywhere_has_no_replication_line():
    import jax
    import jax.numpy as jnp

    import einshard

    tree = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    text = str(einshard.explain(tree, [("w", "x y -> x y*")], n_devices=256))
    assert text.splitlines()[-1].endswith("replication overhead 1.00x")
    assert "replication:" not in text


def test_explain_shows_rules_as_written_not_as_markup():
    """A regex's brackets are text in the table and the footer, with rich installed or not."""
    import jax
    import jax.numpy as jnp

    import einshard

    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    text = str(einshard.explain(tree, [(r"[w]", "x y -> x y*"), (r"[bold]x", "x -> x*")], n_devices=8))
    assert "'[w]'" in text.splitlines()[2]  # the rule column of w's row
    lines = text.splitlines()
    assert "unused rules: ('[bold]x', 'x -> x*')" in lines
    assert lines[-1] == "1 rule matches no path of this tree (a layer name it does not have?): '[bold]x'"


# --- one word: a plan is what einshard.plan returns ---------------------------------------------------


def _code_blocks(text: str) -> list[str]:
    """The Python in a page's code blocks: doctest lines (>>> and ...) and ```python blocks."""
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            if fenced and current:
                blocks.append("\n".join(current))
            fenced, current = line.strip() == "```python", []
            continue
        stripped = line.lstrip()
        if stripped.startswith((">>> ", "... ")) or stripped in (">>>", "..."):
            current.append(stripped[4:])
        elif fenced and not any(s.startswith(">>>") for s in current):
            current.append(line)
    return blocks


def _plans_bound_to_other_things(source: str) -> list[str]:
    """Each ``plan = ...`` whose value is not a call of einshard.plan (or plan) itself."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not any(isinstance(t, ast.Name) and t.id == "plan" for t in targets):
                continue
            value = node.value
            called = value.func if isinstance(value, ast.Call) else None
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
            if name != "plan":
                found.append(ast.unparse(node))
    return found


def test_the_word_plan_names_only_what_einshard_plan_returns():
    """explain's result is a layout report (Report), not a plan: no example binds `plan` to it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong = []
    for page in pages:
        for block in _code_blocks(page.read_text()):
            wrong += [f"{page.name}: {line}" for line in _plans_bound_to_other_things(block)]
    for example in sorted((ROOT / "examples").glob("*.py")):
        wrong += [f"{example.name}: {line}" for line in _plans_bound_to_other_things(example.read_text())]
    assert not wrong, wrong
