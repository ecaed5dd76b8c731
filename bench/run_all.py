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


def render_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_no rows_\n"
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_format(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_report(documents: list[dict[str, Any]], failures: dict[str, str]) -> str:
    parts = [
        "# Benchmarks\n",
        "Written by `make bench` (bench/run_all.py) from `bench/results/*.json`.",
        "Every number below comes from",
        "the run recorded with it (machine, date, commit, command). Medians with p99 and the inter-quartile",
        "range as spread; ratios compare against the baseline measured in the same run.\n",
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
    documents = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(RESULTS_DIR.glob("*.json"))]
    (ROOT / "BENCHMARKS.md").write_text(render_report(documents, failures), encoding="utf-8")
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
