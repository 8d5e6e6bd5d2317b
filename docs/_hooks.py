"""MkDocs hooks (listed in mkdocs.yml): the benchmark page's tables and plots, from the committed results.

``benchmarks/bench_*.py --json PATH`` write their tables to ``benchmarks/results/*.json``. At build
time this module

* adds two generated SVG plots to the site (:func:`on_files`): ``benchmarks/placement.svg``
  (einshard / device_put per layout and input, with the 1.05 bar) and ``benchmarks/rules.svg``
  (resolving a rule table, µs per leaf, with the 2 µs bar), and ``cost/strategies.svg`` (what a
  LLaMA-shaped step costs under four rule tables, from ``bench_step.py``); nothing is written to
  ``docs/``;
* replaces markers in a page's Markdown (:func:`on_page_markdown`):
  ``<!-- benchmark-table: FILE/TABLE -->`` by a table as the script printed it,
  ``<!-- benchmark-setup: FILE -->`` by the versions, machine, load, repetitions and memcpy rate
  it was measured with (and whether the machine was idle), ``<!-- benchmark-bars -->`` by every
  bar of every results file with its worst measured value and verdict, met or not, and
  ``<!-- section-contents -->`` by a table of the page's sections (the error catalogue's);
* shows the repository's ``CHANGELOG.md`` as the ``changelog.md`` page.

It reads JSON and draws with matplotlib; it never imports JAX.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# `<!-- benchmark-table: placement/placement -->`; `without pairs, layout` leaves columns out of the
# page (the JSON and the script's printout keep them) where a table would not fit its width.
MARKER = re.compile(
    r"<!--\s*benchmark-(table|setup|bars|conditions)(?::\s*([\w./-]+))?(?:\s+without\s+([^>]*?))?\s*-->"
)
SECTIONS = "<!-- section-contents -->"
# A run is from an idle machine when the 1-minute load average stayed below this share of its cores.
IDLE_LOAD_PER_CORE = 0.25

PLACEMENT_SVG = "benchmarks/placement.svg"
RULES_SVG = "benchmarks/rules.svg"


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        relative = path.relative_to(RESULTS.parents[1])
        raise PluginError(
            f"{relative} is missing: `python benchmarks/bench_{name}.py --json {relative}`"
        ) from None


# --- Markdown -------------------------------------------------------------------------------------


def _cell(text: str, column: str) -> str:
    if column == "expression":
        return f"`{text}`"
    if text == "FAIL":
        return "**FAIL**"
    text = text.replace("|", "\\|")
    return re.sub(r"([*_\[\]])", r"\\\1", text).replace("<", "&lt;")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def table_markdown(table: dict[str, Any], without: Sequence[str] = ()) -> str:
    """A results table as a Markdown table: the columns and rows as the script printed them.

    A numeric column that is zero in every row (a kind of collective no table moves) is left
    out, and so are the columns named in ``without``, so the page's tables fit its width.
    """
    columns: list[str] = table["columns"]
    rows: list[list[str]] = table["rows"]
    unknown = set(without) - set(columns)
    if unknown:
        raise PluginError(f"no column {sorted(unknown)} in the table {table.get('title')!r}: {columns}")
    zero = [
        i
        for i, c in enumerate(columns)
        if c in without or (rows and all(_is_number(r[i]) and float(r[i]) == 0 for r in rows))
    ]
    if zero:
        columns = [c for i, c in enumerate(columns) if i not in zero]
        rows = [[v for i, v in enumerate(r) if i not in zero] for r in rows]
    numeric = set(
        table.get("numeric") or [c for i, c in enumerate(columns) if all(_is_number(r[i]) for r in rows)]
    )
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if c in numeric else ":---" for c in columns) + "|",
    ]
    lines += [
        "| " + " | ".join(_cell(v, c) for v, c in zip(row, columns, strict=True)) + " |" for row in rows
    ]
    return "\n".join(lines)


def _repetitions(options: dict[str, Any]) -> str:
    """How long each row was measured, from the script's options."""
    if options.get("quick"):
        return "the quick run (fewer, smaller points)"
    if "reps" not in options:
        return "repetitions not recorded"
    text = f"{options['reps']} repetition{'s' if options['reps'] != 1 else ''} per row"
    if options.get("seconds"):
        text += f" (at least; more while they fit in {options['seconds']:g} s)"
    if options.get("warmup"):
        text += f", after {options['warmup']} warm-up"
    return text


def _idle(m: dict[str, Any]) -> bool | None:
    """Whether the machine was idle through the run (``None``: load not recorded)."""
    loads = [m.get("load_average_before"), m.get("load_average_after")]
    if not all(loads) or not m.get("cpu_count"):
        return None
    return max(load[0] for load in loads if load) < IDLE_LOAD_PER_CORE * m["cpu_count"]


def setup_markdown(results: dict[str, Any]) -> str:
    """When, with what and on which machine a results file was measured, and whether it was idle."""
    m = results["metadata"]
    load = m.get("load_average_before"), m.get("load_average_after")
    text = (
        f"Measured on {m['date'][:10]} by `{m['script']}`: einshard {m['einshard']}, "
        f"jax {m['jax']} (jaxlib {m['jaxlib']}), NumPy {m['numpy']}, Python {m['python']}; "
        f"{m['devices']} simulated CPU devices on {m['cpu_count']} cores; malloc {m['malloc']}; "
        f"{_repetitions(m.get('options', {}))}"
    )
    if all(load):
        text += f"; load average (1 min) {load[0][0]:g} before, {load[1][0]:g} after"
    memcpy = m.get("memcpy")
    if memcpy:
        text += (
            f". One host memcpy of {memcpy['bytes'] / 2**20:.0f} MiB took {memcpy['seconds'] * 1e3:.2f} ms "
            f"({memcpy['GB_per_s']:.1f} GB/s)"
        )
    text += "."
    idle = _idle(m)
    if idle is False:
        text += (
            " **The machine was not idle** (a load above a quarter of its cores): other work shared "
            "the CPU, so times scatter more than on an idle machine. These figures were not measured "
            "again on an idle one."
        )
    elif idle is None:
        text += " The load during the run was not recorded."
    if results.get("all_bars_met") is False:
        text += " **Not every bar was met** in this run: the bar column says which."
    return text


def conditions_markdown() -> str:
    """The conditions of all the committed runs together: dates, machine, load, bars missed."""
    runs = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(RESULTS.glob("*.json"))]
    if not runs:
        raise PluginError(f"no results in {RESULTS}")
    meta = [run["metadata"] for run in runs]
    dates = sorted({m["date"][:10] for m in meta})
    cores = sorted({m["cpu_count"] for m in meta})
    loads = [
        load[0] for m in meta for load in (m.get("load_average_before"), m.get("load_average_after")) if load
    ]
    idle = [_idle(m) for m in meta]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    text = f"The figures come from {len(runs)} runs on {when}, on {' or '.join(map(str, cores))} cores"
    if loads:
        text += f", at a load average (1 min) of {min(loads):g} to {max(loads):g}"
    if any(state is False for state in idle):
        text += (
            f": **{sum(state is False for state in idle)} of them on a machine that was not idle**, "
            "and not measured again on an idle one. Times scatter with the load; the ratios, whose "
            "two sides run back to back, much less"
        )
    missed = sum(run.get("all_bars_met") is False for run in runs)
    if missed:
        text += f". **{missed} of the {len(runs)} results files record a missed bar.**"
    else:
        text += ". Every bar was met."
    return text


def _worst(records: list[dict[str, Any]], field: str, **where: Any) -> tuple[float, str]:
    """The largest ``field`` among the records held to a bar (and matching ``where``); PASS/FAIL."""
    held = [r for r in records if r.get("bar") is not None and all(r[k] == v for k, v in where.items())]
    if not held:
        raise PluginError(f"no records held to a bar for {field} {where}")
    value = max(r[field] for r in held)
    return value, "PASS" if all(r["verdict"] == "PASS" for r in held) else "**FAIL**"


def bars_markdown() -> str:
    """Every bar, what it is measured against, the worst measured value and the verdict."""
    placement = _load("placement")["tables"]
    rules = _load("rules")["tables"]
    rows = []
    layout_rows = [r for r in placement["placement"]["records"] if "expression" in r]
    worst, _ = _worst(layout_rows, "ratio")
    held = [r for r in layout_rows if r.get("bar") is not None]
    verdict = "PASS" if all(r["ratio"] <= r["bar"] for r in held) else "**FAIL**"
    rows.append(
        f"| `einshard(x, e)`, 64 MiB, every layout and input | `jax.device_put(x, sharding)`, built before "
        f"| ratio ≤ {placement['placement']['bar']:g} | {worst:.3f} | {verdict} |"
    )
    if "shard_pytree" in placement:
        for record in placement["shard_pytree"]["records"]:
            rows.append(
                f"| `shard_pytree(tree, rules)`, {record['tree']}, from {record['input']} "
                f"| `jax.device_put(tree, shardings)` "
                f"| ratio ≤ {record['bar']:g} | {record['ratio']:.3f} "
                f"| {'PASS' if record['verdict'] == 'PASS' else '**FAIL**'} |"
            )
    worst, verdict = _worst(placement["per_call"]["records"], "us")
    rows.append(
        f"| cached `make_sharding(e)`, repeated | (absolute) "
        f"| ≤ {placement['per_call']['bar']:g} µs | {worst:.2f} µs | {verdict} |"
    )
    resolve = rules["resolve"]["records"]
    worst, verdict = _worst(resolve, "us_per_leaf", key="cold")
    easylm = [r["us_per_leaf"] for r in resolve if r["key"] == _easylm_cold_key(resolve)]
    rows.append(
        f"| resolving a rule table, cold, per leaf | EasyLM `match_partition_rules`, cold: "
        f"{min(easylm):.1f}–{max(easylm):.1f} µs "
        f"| ≤ {rules['resolve']['bar']:g} µs | {worst:.2f} µs | {verdict} |"
    )
    worst, verdict = _worst(rules["shard_pytree"]["records"], "ratio")
    rows.append(
        f"| `shard_pytree(tree, rules)`, 424 MiB LLaMA-shaped tree | `jax.device_put(tree, shardings)` "
        f"| ratio ≤ {rules['shard_pytree']['bar']:g} | {worst:.3f} | {verdict} |"
    )
    if "memory" in rules:
        worst, verdict = _worst(rules["memory"]["records"], "peak_over_model")
        other = [r["peak_over_model"] for r in rules["memory"]["records"] if r["bar"] is None]
        against = f"init-then-shard: {other[0]:.2f} × model" if other else "init-then-shard"
        rows.append(
            f"| `init_sharded`, peak host memory | {against} "
            f"| ≤ {rules['memory']['bar']:g} × model | {worst:.2f} × model | {verdict} |"
        )
    summarized = {"placement", "rules"}
    for name, summary in (("errors", _errors_bar), ("step", _step_bar), ("plan", _plan_bar)):
        try:
            rows.append(summary(_load(name)["tables"]))
        except (KeyError, IndexError, PluginError):  # a results file of another shape: its rows as they are
            continue
        summarized.add(name)
    rows += _other_bars(summarized)
    head = "| what | measured against | bar | worst measured | verdict |\n|:---|:---|---:|---:|:---|"
    return "\n".join([head, *rows])


def _errors_bar(tables: dict[str, Any]) -> str:
    errors = tables["errors"]
    worst_ms = max(float(row[errors["columns"].index("worst ms")]) for row in errors["rows"])
    return (
        f"| every answer or error, device counts and sizes up to 2\\*\\*63 | (absolute) "
        f"| ≤ {errors['bar'] * 1e3:g} ms | {worst_ms:g} ms | {_verdict(errors['records'])} |"
    )


def _step_bar(tables: dict[str, Any]) -> str:
    overhead = tables["overhead"]
    held = [r for r in overhead["records"] if r.get("bar") is not None]
    return (
        f"| reading a step report ([what does my table cost?](cost.md)) | the step's compile "
        f"| ≤ {overhead['bar']:g} × compile | {max(r['ratio'] for r in held):.3f} × compile "
        f"| {_verdict(held)} |"
    )


def _plan_bar(tables: dict[str, Any]) -> str:
    held = [r for r in tables["scaling"]["records"] if r.get("bar") is not None]
    return (
        f"| `plan`, the default candidates at 8 devices ([choosing a strategy](strategies.md)) "
        f"| (absolute) | ≤ {held[0]['bar']:g} s | {max(r['seconds'] for r in held):.1f} s "
        f"| {_verdict(held)} |"
    )


def _verdict(records: list[dict[str, Any]]) -> str:
    held = [r for r in records if r.get("bar") is not None]
    return "PASS" if all(r["verdict"] == "PASS" for r in held) else "**FAIL**"


def _other_bars(summarized: set[str]) -> list[str]:
    """A row for each table of a results file not summarized above that holds rows to a bar."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        if path.stem in summarized:
            continue
        for table in json.loads(path.read_text(encoding="utf-8")).get("tables", {}).values():
            held = [r for r in table.get("records", []) if r.get("bar") is not None]
            if held:
                failed = sum(r["verdict"] != "PASS" for r in held)
                title = table.get("title", path.stem).replace("|", "\\|")
                rows.append(
                    f"| {title} | (see `benchmarks/results/{path.name}`) | as the title says "
                    f"| {len(held) - failed} of {len(held)} rows within | {_verdict(held)} |"
                )
    return rows


def sections_markdown(markdown: str) -> str:
    """A table of a page's ``##`` sections: each linked, with its first sentence and its entries.

    Entries are the headings below a section that have no headings of their own (a message, not
    a group of messages such as *Flax*).
    """
    heading = re.compile(r"^(#{2,4}) (.*?)(?: \{ #([\w-]+) \})?$", re.MULTILINE)
    found = [(len(m.group(1)), m.group(2), m.group(3), m.end()) for m in heading.finditer(markdown)]
    lines = ["| section | what it covers | entries |", "|:---|:---|---:|"]
    for i, (level, title, anchor, end) in enumerate(found):
        if level != 2:
            continue
        if anchor is None:
            raise PluginError(f"section {title!r} has no {{ #anchor }} for the table of sections")
        below = []
        for j in range(i + 1, len(found)):
            if found[j][0] == 2:
                break
            below.append(found[j][0])
        entries = sum(1 for k, depth in enumerate(below) if k + 1 == len(below) or below[k + 1] <= depth)
        paragraph = markdown[end:].lstrip("\n").split("\n\n", 1)[0]
        first = "" if paragraph.startswith(("#", "```", "<!--")) else paragraph.replace("\n", " ")
        first = re.split(r"(?<=\.)\s", first, maxsplit=1)[0].rstrip(":").replace("|", "\\|")
        lines.append(f"| [{title}](#{anchor}) | {first} | {entries or ''} |")
    return "\n".join(lines)


def changelog_markdown() -> str:
    """The repository's CHANGELOG.md, its links to ``docs/`` pages made relative to the site."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Replaces the markers with the tables and set-up of the committed results, and the sections."""
    if page.file.src_uri == "changelog.md":
        return changelog_markdown()
    if SECTIONS in markdown:
        markdown = markdown.replace(SECTIONS, sections_markdown(markdown))
    if "benchmark-" not in markdown:
        return markdown

    def replace(match: re.Match[str]) -> str:
        kind, target, without = match.groups()
        if kind == "bars":
            return bars_markdown()
        if kind == "conditions":
            return conditions_markdown()
        if target is None:
            raise PluginError(f"{page.file.src_uri}: {match.group(0)} names no results file")
        if kind == "setup":
            return setup_markdown(_load(target))
        name, _, key = target.partition("/")
        tables = _load(name)["tables"]
        if key not in tables:
            raise PluginError(f"{page.file.src_uri}: no table {key!r} in {name}.json (it has {list(tables)})")
        left_out = [c.strip() for c in without.split(",")] if without else []
        return table_markdown(tables[key], left_out)

    return MARKER.sub(replace, markdown)


# --- plots ----------------------------------------------------------------------------------------

INPUT_COLOURS = {"numpy": "#4c72b0", "jax, 1 device": "#55a868", "jax, another sharding": "#c4a35a"}
BAR_STYLE = {"color": "#c44e52", "linestyle": "--", "linewidth": 1.2}


def _svg(fig: Any) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", facecolor="white", metadata={"Date": None})
    return buffer.getvalue()


def _figure(width: float, height: float) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "einshard"  # the same SVG for the same results
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    return fig, ax


def placement_svg(results: dict[str, Any]) -> str:
    """einshard / device_put for each layout (a group) and input (a bar), with the bar as a line."""
    table = results["tables"]["placement"]
    records = [r for r in table["records"] if "expression" in r]  # not the summary rows
    layouts = {r["expression"]: r["layout"] for r in records}
    expressions = list(layouts)
    fig, ax = _figure(7.0, 3.2)
    width = 0.8 / len(INPUT_COLOURS)
    for j, (source, colour) in enumerate(INPUT_COLOURS.items()):
        xs, ys = [], []
        for i, expression in enumerate(expressions):
            for r in records:
                kind = "jax, another sharding" if r["input"].startswith("jax, x") else r["input"]
                if r["expression"] == expression and kind == source:
                    xs.append(i + (j - (len(INPUT_COLOURS) - 1) / 2) * width)
                    ys.append(r["ratio"])
        bars = ax.bar(xs, ys, width * 0.92, color=colour, label=source)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.axhline(1.0, color="#888888", linewidth=0.8)
    ax.axhline(table["bar"], **BAR_STYLE, label=f"bar: {table['bar']:g}")
    top = max(r["ratio"] for r in records)
    ax.set_ylim(0, max(1.3, top + 0.1))
    return _finish(
        fig,
        ax,
        [f"{e}\n{layouts[e]}" for e in expressions],
        ylabel="einshard / device_put\n(median per-pair ratio)",
        title="einshard against jax.device_put: a 64 MiB float32 array, 8 CPU devices",
        legend=(4, -0.22),
    )


RULE_MEASURES = {
    "cold": ("cold", "#c44e52"),
    "warm": ("warm", "#55a868"),
    "easylm_cold": ("EasyLM match_partition_rules, cold", "#8172b2"),
    "easylm": ("EasyLM match_partition_rules, warm", "#b3a2d6"),
    "flatten": ("tree_flatten_with_path alone", "#999999"),
}


def _easylm_cold_key(records: list[dict[str, Any]]) -> str:
    """The key of the cold EasyLM row: results written before it was also timed warm have only 'easylm'."""
    return "easylm_cold" if any(r["key"] == "easylm_cold" for r in records) else "easylm"


def rules_svg(results: dict[str, Any]) -> str:
    """µs per leaf to resolve a rule table, per tree, with the 2 µs bar as a line."""
    table = results["tables"]["resolve"]
    records = table["records"]
    trees = list(dict.fromkeys(r["tree"] for r in records))
    leaves = {r["tree"]: r["leaves"] for r in records}
    fig, ax = _figure(7.0, 3.2)
    measures = dict(RULE_MEASURES)
    if _easylm_cold_key(records) == "easylm":  # older results: their one EasyLM row was timed cold
        measures = {k: v for k, v in measures.items() if k != "easylm_cold"}
        measures["easylm"] = RULE_MEASURES["easylm_cold"]
    width = 0.8 / len(measures)
    for j, (key, (label, colour)) in enumerate(measures.items()):
        values = [
            next(r["us_per_leaf"] for r in records if r["tree"] == t and r["key"] == key) for t in trees
        ]
        xs = [i + (j - (len(measures) - 1) / 2) * width for i in range(len(trees))]
        bars = ax.bar(xs, values, width * 0.92, color=colour, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.axhline(table["bar"], **BAR_STYLE, label=f"bar for cold: {table['bar']:g} µs")
    return _finish(
        fig,
        ax,
        [f"{t} ({leaves[t]:,} leaves)" for t in trees],
        ylabel="µs per leaf",
        title="Resolving a 13-rule table: pytree_shardings(abstract tree, rules)",
        legend=(3, -0.12),
    )


def _finish(
    fig: Any, ax: Any, ticks: list[str], *, ylabel: str, title: str, legend: tuple[int, float]
) -> str:
    """Labels a grouped bar chart (one tick per group), puts the legend below it, and draws it."""
    columns, below = legend
    ax.set_xticks(range(len(ticks)))
    ax.set_xticklabels(ticks)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncols=columns, loc="upper center", bbox_to_anchor=(0.5, below), frameon=False)
    return _svg(fig)


STEP_SVG = "cost/strategies.svg"
KIND_COLOURS = {
    "all-reduce": "#4c72b0",
    "all-gather": "#55a868",
    "reduce-scatter": "#8172b2",
    "all-to-all": "#c4a35a",
    "collective-permute": "#999999",
}


def step_svg(results: dict[str, Any]) -> str:
    """The step report of each rule table on 8 and 64 devices: MiB per device per step, stacked
    by kind of collective (left), and the estimated step time at each bandwidth (right)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "einshard"
    from matplotlib.figure import Figure

    records = results["tables"]["strategies"]["records"]
    labels = [f"{r['strategy']}\n{r['devices']} devices" for r in records]
    fig = Figure(figsize=(10.0, 3.6))
    left, right = fig.subplots(1, 2)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    ys = list(range(len(records)))[::-1]
    base = [0.0] * len(records)
    for kind, colour in KIND_COLOURS.items():
        values = [r["bytes_by_kind"].get(kind, 0) / 2**20 for r in records]
        if any(values):
            left.barh(ys, values, left=base, color=colour, label=kind, height=0.7)
            base = [b + v for b, v in zip(base, values, strict=True)]
    left.set_yticks(ys, labels, fontsize=7)
    left.set_xlabel("MiB per device per step")
    left.legend(fontsize=7, frameon=False)
    left.set_title("Bytes each device's collectives move", fontsize=9)
    bandwidths = list(records[0]["step_seconds"])
    height = 0.8 / len(bandwidths)
    for j, (bandwidth, colour) in enumerate(zip(bandwidths, ("#c44e52", "#4c72b0"), strict=False)):
        values = [r["step_seconds"][bandwidth] * 1e3 for r in records]
        right.barh(
            [y + (0.5 - j) * height for y in ys],
            values,
            height * 0.9,
            color=colour,
            label=f"{bandwidth} GB/s",
        )
    right.set_yticks(ys, [""] * len(ys))
    right.set_xlabel("estimated ms per step (communication + compute)")
    right.legend(fontsize=7, frameon=False)
    right.set_title("Estimated step time", fontsize=9)
    fig.tight_layout()
    return _svg(fig)


CURVES_SVG = "benchmarks/curves.svg"


def curves_svg(results: dict[str, Any]) -> str:
    """The four cost curves of ``bench_curves.py``, each on log-log axes against its work."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "einshard"
    from matplotlib.figure import Figure

    tables = results["tables"]
    fig = Figure(figsize=(10.0, 7.0))
    axes = fig.subplots(2, 2).flatten()
    colours = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#999999"]

    def series(ax: Any, records: list[dict[str, Any]], x: str, y: str, by: str | None, scale: float) -> None:
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            if x in r and y in r:  # a point, not a growth summary
                groups.setdefault(str(r[by]) if by else y, []).append(r)
        for colour, (name, points) in zip(colours, groups.items(), strict=False):
            ax.plot(
                [p[x] for p in points], [p[y] * scale for p in points], "o-", color=colour, label=name, ms=4
            )

    def style(ax: Any, title: str, xlabel: str, ylabel: str, *, logy: bool = True) -> None:
        ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(color="#dddddd", linewidth=0.6)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7, frameon=False)

    placement = tables["placement_devices"]["records"]
    for source, colour in (("numpy", colours[0]), ("jax, 1 device", colours[1])):
        points = [r for r in placement if r.get("input") == source]
        xs = [p["devices"] for p in points]
        axes[0].plot(
            xs, [p["einshard_s"] * 1e3 for p in points], "o-", color=colour, ms=4, label=f"einshard, {source}"
        )
        axes[0].plot(
            xs, [p["device_put_s"] * 1e3 for p in points], "x:", color=colour, label=f"device_put, {source}"
        )
    style(axes[0], "Placement of a fixed array vs device count", "devices", "ms")
    counts = sorted({p["devices"] for p in placement if "devices" in p})
    axes[0].set_xticks(counts, [str(c) for c in counts])
    axes[0].minorticks_off()
    series(axes[1], tables["resolve_leaves"]["records"], "leaves", "us_per_leaf", "measure", 1.0)
    style(axes[1], "Rule resolution vs leaves (flat = linear)", "leaves", "µs per leaf", logy=False)
    axes[1].set_ylim(bottom=0)
    explain = [r for r in tables["explain_devices"]["records"] if "seconds" in r]
    axes[2].plot(
        [r["devices"] for r in explain],
        [r["seconds"] * 1e3 for r in explain],
        "o-",
        color=colours[0],
        ms=4,
        label=f"explain, {explain[0]['leaves']} leaves",
    )
    style(axes[2], "explain(tree, rules, n_devices=N) vs N", "devices (planned)", "ms", logy=False)
    axes[2].set_ylim(bottom=0)
    memory = [r for r in tables["init_memory"]["records"] if "model_bytes" in r]
    axes[3].plot(
        [r["model_bytes"] / 2**30 for r in memory],
        [r["peak_bytes"] / 2**30 for r in memory],
        "o-",
        color=colours[0],
        ms=4,
        label="init_sharded peak",
    )
    top = max(r["model_bytes"] for r in memory) / 2**30
    axes[3].plot([0, top], [0, top], ":", color="#888888", label="1 × model")
    axes[3].plot([0, top], [0, 2 * top], ":", color=colours[2], label="2 × model")
    style(axes[3], "init_sharded peak host memory vs model size", "model GiB", "peak GiB", logy=False)
    axes[3].set_xscale("linear")
    fig.tight_layout()
    return _svg(fig)


def on_files(files: Files, config: Any) -> Files:
    """Adds the plots, drawn from ``benchmarks/results/*.json``, as generated files of the site."""
    files.append(File.generated(config, PLACEMENT_SVG, content=placement_svg(_load("placement"))))
    files.append(File.generated(config, CURVES_SVG, content=curves_svg(_load("curves"))))
    files.append(File.generated(config, RULES_SVG, content=rules_svg(_load("rules"))))
    files.append(File.generated(config, STEP_SVG, content=step_svg(_load("step"))))
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """``mkdocs serve`` rebuilds when a results file or the changelog changes."""
    server.watch(str(RESULTS))
    server.watch(str(ROOT / "CHANGELOG.md"))
    return server
