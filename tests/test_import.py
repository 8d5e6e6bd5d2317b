"""``import einshard`` stays light: no framework, no picture library, no backend."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
import einshard
heavy = ["flax", "equinox", "optax", "orbax", "rich", "torch", "tensorflow"]
import jax._src.xla_bridge as xb
print(json.dumps({
    "imported": [name for name in heavy if name in sys.modules],
    "backend_started": bool(xb._backends),
    "public": sorted(name for name in dir(einshard) if not name.startswith("_")),
}))
"""


def probe() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True, timeout=120
    )
    return json.loads(out.stdout)


def test_import_einshard_imports_no_framework():
    result = probe()
    assert result["imported"] == []


def test_import_einshard_does_not_start_a_backend():
    # So users can still configure devices (jax_num_cpu_devices, distributed) after importing.
    assert probe()["backend_started"] is False


def test_public_names_are_curated():
    public = set(probe()["public"])
    assert {"einshard", "make_sharding", "EinshardError", "use_devices", "parse", "layout"} <= public
    assert not {"jax", "np", "functools"} & public


def test_the_core_names_no_framework():
    """Framework knowledge lives in einshard/integrations: no core module's code names a framework.

    Comments and docstrings may mention one; identifiers, imports and strings may not (a
    ``sys.modules.get('flax.nnx')`` would be the core knowing Flax).
    """
    import ast
    import re

    frameworks = re.compile(r"\b(flax|nnx|linen|equinox|eqx|optax|orbax)\b", re.IGNORECASE)
    named = []
    for path in sorted(p for p in (ROOT / "einshard").rglob("*.py") if "integrations" not in p.parts):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            elif isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.alias):
                text = node.name
            else:
                continue
            if frameworks.search(text):
                named.append(f"{path.name}:{getattr(node, 'lineno', '?')}: {text[:60]!r}")
    assert not named, "the core names a framework:\n" + "\n".join(named)


def test_every_public_name_has_its_entry_in_the_api_page():
    """A name ``import einshard`` offers is documented: ``::: einshard.NAME`` on docs/api.md (the
    strict site build fails on a cross-reference to a name without one)."""
    import types

    import einshard

    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    names = [name for name in probe()["public"] if not isinstance(getattr(einshard, name), types.ModuleType)]
    missing = [name for name in names if f"::: einshard.{name}\n" not in api]
    assert names and not missing, missing
