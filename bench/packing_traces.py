"""Seeded share traces for packing quality (issue 26): six families, a tuning split and a held-out split.

A trace is a list of (memory GiB, compute %) shares for GPUs of 80 GiB / 100 %. Every weight, order and
budget of the burst planner (driver/allocator/batch.py) and of online best-fit was chosen looking only at
``TUNING_SEEDS``; the figures reported in BENCHMARKS.md are those on ``HELD_OUT_SEEDS``, which nothing
was tuned on. Traces hold up to 100 shares and need up to about 100 GPUs (``CLUSTER_NODES`` x 8).

Families (sizes drawn independently per share):
- memory-bound: 5-40 GiB, 0-10 % (memory sets the lower bound).
- compute-bound: 5-30 GiB, 10-60 % (compute sets the lower bound; the issue's "compute-heavy" kind).
- balanced: 5-40 GiB, 5-50 % (issue 15's family: both dimensions about as tight).
- mixed: half memory-heavy (20-40 GiB, 0-10 %), half compute-heavy (5-15 GiB, 20-50 %).
- tiny: 1-8 GiB, 1-10 % in steps of 1 (many small shares, a handful of GPUs).
- near-whole: two thirds 45-75 GiB / 10-60 %, one third 5-20 GiB / 0-20 % (pairs rarely fit).
"""

from __future__ import annotations

import random

__all__ = [
    "CLUSTER_NODES",
    "FAMILIES",
    "GPU_COMPUTE",
    "GPU_MEMORY_GI",
    "HELD_OUT_SEEDS",
    "TUNING_SEEDS",
    "Share",
    "packing_trace",
    "volume_bound",
]

Share = tuple[int, int]  # (memory GiB, compute %)

FAMILIES = ("memory-bound", "compute-bound", "balanced", "mixed", "tiny", "near-whole")
TUNING_SEEDS = range(1, 61)  # 60 per family: what weights and budgets were chosen on
HELD_OUT_SEEDS = range(1001, 1061)  # 60 per family: what is reported
GPU_MEMORY_GI = 80
GPU_COMPUTE = 100
CLUSTER_NODES = 13  # x 8 GPUs: room for any trace below


def packing_trace(family: str, seed: int) -> list[Share]:
    """The trace of ``family`` for ``seed`` (30 to 100 shares; the same list on every run)."""
    rng = random.Random(f"packing-{family}-{seed}")
    shares: list[Share] = []
    if family == "tiny":
        for _ in range(rng.randint(60, 100)):
            shares.append((rng.randint(1, 8), rng.randint(1, 10)))
        return shares
    if family == "near-whole":
        for _ in range(rng.randint(30, 60)):
            if rng.random() < 2 / 3:
                shares.append((5 * rng.randint(9, 15), 5 * rng.randint(2, 12)))
            else:
                shares.append((5 * rng.randint(1, 4), 5 * rng.randint(0, 4)))
        return shares
    for _ in range(rng.randint(40, 100)):
        if family == "memory-bound":
            shares.append((5 * rng.randint(1, 8), 5 * rng.randint(0, 2)))
        elif family == "compute-bound":
            shares.append((5 * rng.randint(1, 6), 5 * rng.randint(2, 12)))
        elif family == "balanced":
            shares.append((5 * rng.randint(1, 8), 5 * rng.randint(1, 10)))
        elif family == "mixed":
            if rng.random() < 0.5:
                shares.append((5 * rng.randint(4, 8), 5 * rng.randint(0, 2)))
            else:
                shares.append((5 * rng.randint(1, 3), 5 * rng.randint(4, 10)))
        else:
            raise ValueError(f"family: unknown family {family!r} (expected one of {', '.join(FAMILIES)})")
    return shares


def volume_bound(shares: list[Share]) -> int:
    """The volume lower bound on GPUs: the larger of total memory and total compute, in whole GPUs,
    and never below the shares too large to pair (over half of a GPU in one dimension)."""
    memory = sum(m for m, _ in shares)
    compute = sum(c for _, c in shares)
    volume = max(-(-memory // GPU_MEMORY_GI), -(-compute // GPU_COMPUTE))
    large_memory = sum(1 for m, _ in shares if 2 * m > GPU_MEMORY_GI)
    large_compute = sum(1 for _, c in shares if 2 * c > GPU_COMPUTE)
    return max(volume, large_memory, large_compute)
