"""MkDocs hook (listed in mkdocs.yml): the planner's output on the "Choosing a strategy" page.

``benchmarks/bench_plan.py --json benchmarks/results/plan.json`` keeps what ``print(plan)``
showed for the LLaMA-shaped step at 8 and 64 devices. At build time this module replaces
``<!-- plan-text: N -->`` in a page by that text, as a code block. (The results tables on the
same page come from ``docs/_hooks.py``'s ``benchmark-table`` markers.) It reads JSON only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "plan.json"
MARKER = re.compile(r"<!--\s*plan-text:\s*(\d+)\s*-->")


def plan_text(n_devices: str) -> str:
    """The planner's printed table and chart for ``n_devices``, as a Markdown code block."""
    try:
        results = json.loads(RESULTS.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PluginError(
            "benchmarks/results/plan.json is missing: "
            "`python benchmarks/bench_plan.py --json benchmarks/results/plan.json`"
        ) from None
    texts = results["metadata"].get("plan_text", {})
    if n_devices not in texts:
        raise PluginError(f"plan.json has no plan for {n_devices} devices (it has {sorted(texts)})")
    return f"```text\n{texts[n_devices]}\n```"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replaces the ``plan-text`` markers."""
    if "plan-text" not in markdown:
        return markdown
    return MARKER.sub(lambda match: plan_text(match.group(1)), markdown)
