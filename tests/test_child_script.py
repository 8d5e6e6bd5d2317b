"""The user's script in the child process: a step defined in the script being run.

A child process (another ``n_devices=``, a target) finds such a step by running the script's top
level again. Real scripts, written to a temporary folder and run in a fresh interpreter:

* written as JAX's docs show (``jax.config.update('jax_num_cpu_devices', 8)`` at the top, the
  calls unguarded): ``explain_step`` and ``plan`` work at 2 and 4 devices; the second run sees
  the parent's ``sys.argv``, stops at the script's first call, and is announced when slow; a step
  defined after that first call is an error saying so;
* a script whose top level fails in the child (8 devices asked of a 4-device child): the error
  says that the top level ran again, names the line and the guard;
* the guarded script of the cost page (``if __name__ == '__main__':``), as it is shown there,
  prints what the page says.

Each script costs a few seconds (an interpreter, JAX and a child per call): they are few.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import einshard
from einshard._cost.child import _rerun

ROOT = Path(__file__).resolve().parents[1]

HEADER = """\
import os, sys
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
import jax
jax.config.update('jax_platforms', 'cpu')
jax.config.update('jax_num_cpu_devices', 8)
import jax.numpy as jnp
import einshard
from einshard import strategies

def step(params, batch):
    grads = jax.grad(lambda p: jnp.sum((batch @ p['w']) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

WIDTH = int(sys.argv[1])  # the child's second run must see the parent's arguments
params = {'w': jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)}
batch = jax.ShapeDtypeStruct((256, WIDTH), jnp.float32)
"""


def _run(folder: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = folder / "train.py"
    script.write_text(textwrap.dedent(source))
    environment = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    environment["PYTHONPATH"] = str(ROOT)
    environment.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator plugin's noise on stderr
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=folder,
        timeout=300,
    )


def test_a_script_written_as_jaxs_docs_show_explains_and_plans_at_any_device_count(tmp_path):
    """Data parallel's one all-reduce is the whole gradient: 32 x 32 float32 = 4,096 bytes (the
    width from the script's argument), at 2 devices and at 4; the script's lines before its first
    call run here and again in each of the three children, those after it only here."""
    source = HEADER + textwrap.dedent(
        """
        from einshard._cost.child import _child
        _child.SLOW_RERUN_SECONDS = 0.0  # every second run is announced
        with open('runs.txt', 'a') as log:
            log.write(f'before {__name__}\\n')
        report = einshard.explain_step(step, params, batch, n_devices=2, rules=strategies.data_parallel())
        print('report', report.n_devices, report.bytes_by_kind)
        with open('runs.txt', 'a') as log:
            log.write(f'after {__name__}\\n')
        candidates = [strategies.data_parallel(), strategies.fsdp(min_bytes=0)]
        plan = einshard.plan(step, params, batch, n_devices=4, candidates=candidates)
        print('plan', plan.n_devices, [(row.name, row.report.n_devices) for row in plan.rows])

        def later_step(params, batch):
            return step(params, batch)

        try:
            einshard.explain_step(later_step, params, batch, n_devices=4)
        except einshard.EinshardError as error:
            print('later', error.headline)
        """
    )
    done = _run(tmp_path, source, "32")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:2] == [
        "report 2 {'all-reduce': 4096}",
        "plan 4 [('data parallel', 4), ('fsdp', 4)]",
    ], done.stdout
    assert lines[2] == (
        "later the script's top level ran again in a child process, to find 'later_step' defined in "
        "it, and 'later_step' was not defined by its first explain_step call (train.py:22), where "
        "that run stops"
    )
    first_call = (
        "train.py:22: EinshardWarning: the child process ran the top level of train.py again, to find"
    )
    assert first_call in done.stderr  # pointing at the user's line
    runs = (tmp_path / "runs.txt").read_text().splitlines()
    assert sorted(runs) == sorted(["before __main__"] + ["before __mp_main__"] * 3 + ["after __main__"])


def test_a_script_whose_top_level_fails_in_the_child_says_so_with_its_line(tmp_path):
    source = HEADER + textwrap.dedent(
        """
        import numpy as np
        devices = np.array(jax.devices()).reshape(2, 4)  # 8 here; the child has 4
        einshard.explain_step(step, params, batch, n_devices=4)
        """
    )
    done = _run(tmp_path, source, "64")
    assert done.returncode != 0
    message = done.stderr[done.stderr.index("einshard.EinshardError: ") :]
    headline, hint = message.splitlines()[:2]
    assert headline.startswith(
        "einshard.EinshardError: the script's top level ran again in a child process, to find the step "
        "defined in it, and failed at train.py:19 (devices = np.array(jax.devices()).reshape(2, 4)  "
        "# 8 here; the child has 4): ValueError: cannot reshape array of size 4 into shape (2,4)"
    ), message
    assert "if __name__ == '__main__':" in hint
    assert "  in a child process with 4 simulated CPU devices" in message


def test_the_cost_pages_guarded_script_runs_as_shown(tmp_path):
    page = (ROOT / "docs" / "cost.md").read_text()
    block = r"```python\n((?:(?!```).)*?if __name__ == '__main__':(?:(?!```).)*)```\n"
    found = re.search(block + r"(?:(?!```).)*```text\n((?:(?!```).)*)```", page, re.S)
    assert found is not None, "the cost page shows no guarded script followed by its output"
    source, output = found.groups()
    done = _run(tmp_path, source)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == output


# --- without a child (cheap) -----------------------------------------------------------------------


def test_only_the_running_scripts_names_make_the_child_run_it():
    import json

    _, names = _rerun.pickled({"fn": json.dumps, "args": (1, "__main__")})
    assert names == () and _rerun.script_of_main(names, 4) is None


def test_a_step_from_an_interactive_session_cannot_cross_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no file: a notebook
    with pytest.raises(einshard.EinshardError) as caught:
        _rerun.script_of_main(("step",), 4)
    assert caught.value.headline == (
        "the step cannot cross into a child process with 4 devices: it needs 'step', defined in an "
        "interactive session (a notebook, the REPL), which the child cannot run again"
    )
