"""Shared bits of the benchmark scripts: run metadata, percentiles, result files.

Benchmarks are not tests: they measure, they never assert a wall-clock time.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> str:
    cpus = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            models = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpus = f"{len(models)}x {models[0]}" if models else "?"
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpus}, Python {platform.python_version()}"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=5
        )
        # The results this run is writing do not make the code under test "dirty".
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":!bench/results", ":!BENCHMARKS.md"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    """Median, p99 and spread (IQR) of a sample."""
    if not values:
        return {"median": float("nan"), "p99": float("nan"), "iqr": float("nan"), "n": 0}
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "p99": percentile(values, 99),
        "iqr": q[2] - q[0],
        "n": len(values),
    }


def write_result(
    area: str, rows: list[dict[str, Any]], *, title: str, notes: str = "", command: str | None = None
) -> Path:
    """``command``: what to record as the command (default: this process's); for a command line
    that names a folder outside the checkout, written as the variable that holds it."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{area}.json"
    document = {
        "area": area,
        "title": title,
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "command": command or " ".join([Path(sys.executable).name, *sys.argv]),
        "notes": notes,
        "rows": rows,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    return path
