"""Seeded share traces for packing quality: six families, a tuning split and a held-out split.

A trace is a list of (memory GiB, compute %) shares for GPUs of 80 GiB / 100 %. Every weight, order and
budget of the burst planner (driver/allocator/batch.py) and of online best-fit was chosen looking only at
``TUNING_SEEDS``; the figures reported in BENCHMARKS.md are those on ``HELD_OUT_SEEDS``, which nothing
was tuned on. Traces hold up to 100 shares and need up to about 100 GPUs (``CLUSTER_NODES`` x 8).

Families (sizes drawn independently per share):
- memory-bound: 5-40 GiB, 0-10 % (memory sets the lower bound).
- compute-bound: 5-30 GiB, 10-60 % (compute sets the lower bound; "compute-heavy" shares).
- balanced: 5-40 GiB, 5-50 % (bench_allocator.py's compute-bound family: both dimensions about as tight).
- mixed: half memory-heavy (20-40 GiB, 0-10 %), half compute-heavy (5-15 GiB, 20-50 %).
- tiny: 1-8 GiB, 1-10 % in steps of 1 (many small shares, a handful of GPUs).
- near-whole: two thirds 45-75 GiB / 10-60 %, one third 5-20 GiB / 0-20 % (pairs rarely fit).

Burst step budget (driver/allocator/batch.py ``PLAN_STEPS``, fit tests per burst, counted rather than
timed so that a burst gets the same plan on any machine). At 200,000 (the least at which every trace of
seeds 1..60 reached its volume bound) the held-out balanced seed 1029 took 28 GPUs where 27 suffice (a
27-GPU packing exists: HiGHS found one in 397 s; memory is 2,130 of 2,160 GiB there). So the budget was
chosen again on more tuning traces, seeds 61..1000 of every family (5,640 traces): 33 of them ended one
GPU above the volume bound (compute-bound 18, balanced 14, mixed 1). Nearly all of a burst's budget goes
on its last close, to the bound; bisecting each of the 33 for the budget that reaches its bound gave
205k to 2.0M fit tests (median 342k), and 3 not within 3M (their optimum may be above the bound). 400,000
takes 19 of the 33 to the bound, 1,000,000 would take 25; a fit test costs about 0.21 us here, so a burst
that spends the whole budget takes about 85 ms at 400,000 and 210 ms at 1,000,000. Chosen: 400,000,
within the target of "tens of milliseconds" per burst. Not blind: seed 1029 was among the first budgets
measured (it needs about 280k); the figures above that decided are the tuning traces' alone, and no
other held-out trace was run with a larger budget before the bench.

Online best-fit (one share at a time: driver/allocator/capacity.py ``room_score``). Criterion, on the
tuning seeds only: best-fit at least first-fit on every family, both measures of bench_allocator.py
(``packing_online``: GPUs used on 13 x 8, lower better; ``online_prefix``: shares placed on one node
of 8 GPUs before the first refusal, higher better). Chosen: the share goes to the fullest device in
use that can take it, fullness being the weighted L4 norm of the fractions used *before* it (compute
counting double, ``CAPACITY_WEIGHTS``); ties by topology, then upstream order. It is first-fit with
the devices in use ordered fullest first instead of oldest first (in one dimension, exactly best-fit).
Tuning sums, best-fit less first-fit, GPUs/prefix, for memory-bound, compute-bound, balanced, mixed,
near-whole (tiny: 0/0 but where said; first-fit: 1194/1661, 1630/1272, 1405/1481, 1115/1760,
1788/738):
- room left *after* the share, sum of square roots, compute x2 (the rule before): -4/+7 -5/+3 -2/+0
  +4/+0 -3/+3 (fails mixed); the same with equal weights: -4/+8 -4/+3 -2/-4 +4/+1 -3/+3; compute x1.5:
  -4/+8 -5/+3 -1/+0 +5/+1 -3/+3.
- room left after, other norms: sum (Kubernetes' MostAllocated) +0/+4 +3/-4 -8/-2 +4/-1 -3/+3;
  sum of squares (norm-based greedy) +3/+1 +5/-4 -8/-3 +2/-1 -3/+3; largest fraction left +6/-4
  +6/-7 -9/-2 +2/-5 +0/+0; smallest fraction left -4/+8 -1/+8 +3/-4 +6/+3 -3/+3; weights from the
  cluster's load per capacity (scarcity), square roots -4/+8 -5/+3 -2/-5 +0/+1 -3/+3.
- alignment: the largest dot product of share and room (Tetris) +71/-73 +76/-54 +68/-62 +35/-58
  +1/-1 (tiny +2/+0); an exact fit in some capacity first, else first-fit -3/+8 -3/+1 -1/-3 +4/+1 +0/+0;
  fragmentation against the shares seen so far (FGD-like) +16/-9 -2/+9 -6/+0 +0/+6 +0/-1
  (tiny +1/+0).
- load *before* the share (fullest first): sum +0/+4 +3/-4 -8/-2 +4/-1 -3/+3; L2 -4/+8 -2/+3 -3/+0
  +2/+0 -3/+3; L2 compute x2 -4/+8 -3/+7 -8/+3 +3/-2 -3/+3; L3 compute x2 -4/+8 -3/+8 -6/+4 +1/-2
  -3/+3; L4 -4/+8 -3/+8 -4/-1 +1/+0 -3/+3; L4 compute x2 (chosen) -4/+8 -3/+8 -4/+0 +0/+0 -3/+3; L5
  compute x2 -4/+8 -3/+8 -4/+0 +1/+0 -3/+3; L8 compute x2 -4/+8 -3/+8 -4/-6 +0/+0 -3/+3; largest
  fraction used (dominant share) -4/+8 -3/+8 -4/-8 -2/+2 -3/+3.
Of the powers 2 to 12 and compute weights 1 to 3 tried, only powers 3.5 to 4.5 with compute x2 met it,
with no margin on mixed and balanced: a family's sum of per-trace differences varies by 2 to 5 from trace
sample to trace sample, so those two are close to a coin toss on new traces for any rule. On
lower-variance checks built from the same tuning traces (each rotated to start at every 5th share: GPUs;
every 10th, on nodes of 4, 8 and 12 GPUs: prefix) the chosen rule beats first-fit on every family (GPUs
-40 -85 -76 -9 -24, prefix +108 +112 +70 +60 +33) and the rule before on balanced and mixed (-29 and -2,
+24 and +44). Elsewhere in bench_allocator.py (not looked at to choose): its three compute-bound
traces against the optimum take 66 GPUs online against first-fit's 65 (the rule before: 65); its share
families over seeds 1..100 are as before but compute-bound, 2216 GPUs (before: 2221; first-fit 2226) and
a prefix of 2433 (before: 2434; first-fit 2426); the churn row keeps 33.7 whole GPUs free (before: 32.7).

How much 60 traces can say (looked at after the held-out balanced prefix came out 1479 against
first-fit's 1480): on 2,940 more tuning traces per family (seeds 1..1000 and 1061..3000, run with a
quick model of this allocator's two orders that gives exactly its sums on the tuning and held-out seeds),
the chosen rule is ahead of first-fit per 60 traces by 2.6/4.2 GPUs/prefix on memory-bound, 5.4/6.2 on
compute-bound, 4.0/4.7 on balanced, 2.1/2.2 on near-whole, but by 0.1/1.2 on mixed: there, a sum of 60
traces is at least first-fit's on both measures in 37 % of the samples of 60, on balanced in 88 %. None of
the 25 other rules tried on that set (powers 2 to 12, compute weights 0 to 3, load buckets broken by
first-fit order, a penalty for the imbalance a share leaves, the share's dominant capacity alone) did
better than 55 % on mixed without losing elsewhere, so the rule was kept, and the bench reports it on
``WIDE_HELD_OUT_SEEDS`` as well, where a family's sum is decided by the rule rather than by the sample.
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
    "WIDE_HELD_OUT_SEEDS",
    "Share",
    "packing_trace",
    "volume_bound",
]

Share = tuple[int, int]  # (memory GiB, compute %)

FAMILIES = ("memory-bound", "compute-bound", "balanced", "mixed", "tiny", "near-whole")
TUNING_SEEDS = range(1, 61)  # 60 per family: what weights and budgets were chosen on
HELD_OUT_SEEDS = range(1001, 1061)  # 60 per family: what is reported
WIDE_HELD_OUT_SEEDS = range(10001, 13001)  # 3,000 per family, online only: also never tuned on
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
