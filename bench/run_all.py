"""`make bench`: run every bench/bench_*.py, then write BENCHMARKS.md from bench/results/*.json.

Each script writes its own JSON (see bench/_common.py). A script that fails is reported in
BENCHMARKS.md as failed, and the run exits non-zero after writing the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def _format(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def _columns(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(key for key, value in row.items() if value not in (None, ""))


def render_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table per run of rows that share their columns (a script may mix kinds of rows)."""
    if not rows:
        return "_no rows_\n"
    groups: list[tuple[tuple[str, ...], list[dict[str, Any]]]] = []
    for row in rows:
        columns = _columns(row)
        if groups and (set(columns) <= set(groups[-1][0]) or set(groups[-1][0]) <= set(columns)):
            merged = groups[-1][0] + tuple(c for c in columns if c not in groups[-1][0])
            groups[-1] = (merged, [*groups[-1][1], row])  # the same kind of row, one column more or less
        else:
            groups.append((columns, [row]))
    tables = []
    for columns, members in groups:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_format(row.get(c, "")) for c in columns) + " |" for row in members]
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


def render_report(documents: list[dict[str, Any]], failures: dict[str, str]) -> str:
    parts = [
        "# Benchmarks\n",
        "Written by `make bench` (bench/run_all.py) from `bench/results/*.json`. Every number below comes",
        "from the run recorded with it (machine, date, commit, command). Medians with p99 and the",
        "inter-quartile range (iqr) as spread; ratios compare against the baseline measured in the same run.",
        "This machine is shared and noisy (2 cores): read ratios, not absolute times.\n",
    ]
    for doc in documents:
        parts.append(f"## {doc.get('title', doc['area'])}\n")
        parts.append(
            f"- machine: {doc['machine']}\n- date: {doc['date']}\n- commit: {doc['commit']}\n"
            f"- command: `{doc['command']}`\n"
        )
        if doc.get("notes"):
            parts.append(doc["notes"].rstrip() + "\n")
        parts.append(render_table(doc["rows"]))
    if failures:
        parts.append("## Failed benchmark scripts\n")
        parts += [f"- `{name}`: {reason}" for name, reason in failures.items()]
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    if argv == ["--report-only"]:
        rewrite_report()
        return 0
    only = set(argv)
    failures: dict[str, str] = {}
    for script in sorted(BENCH_DIR.glob("bench_*.py")):
        if only and script.stem not in only:
            continue
        print(f"== {script.name}", flush=True)
        started = time.monotonic()
        result = subprocess.run([sys.executable, str(script)], cwd=ROOT, check=False)
        print(f"== {script.name}: exit {result.returncode} in {time.monotonic() - started:.1f}s", flush=True)
        if result.returncode != 0:
            failures[script.name] = f"exit status {result.returncode}"
    documents = _documents()
    (ROOT / "BENCHMARKS.md").write_text(render_report(documents, failures), encoding="utf-8")
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 1 if failures else 0


def _documents() -> list[dict[str, Any]]:
    """The stored results by name (a result ``x`` before ``x-held-out``)."""
    paths = sorted(RESULTS_DIR.glob("*.json"), key=lambda p: p.stem)
    return [json.loads(p.read_text(encoding="utf-8")) for p in paths]


def rewrite_report() -> None:
    """Re-render BENCHMARKS.md from the stored results without running anything."""
    documents = _documents()
    (ROOT / "BENCHMARKS.md").write_text(render_report(documents, {}), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
