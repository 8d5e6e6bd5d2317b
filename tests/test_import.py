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
