"""Process-wide memory setting of the node agent: fewer glibc malloc arenas.

glibc gives threads their own malloc arenas (up to eight per core), and an arena keeps what was
freed in it. The agent's threads come and go (the probe server answers each scrape and probe on
a new thread; gRPC workers), so every arena they touched keeps a few hundred KiB: the bench
(bench/bench_metrics.py) saw 4 MiB of RSS growth from 30 scrapes with 64 shares, 0.6 MiB with two
arenas. ``MALLOC_ARENA_MAX=2`` in the environment does the same, but only at exec.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["limit_malloc_arenas"]

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """``mallopt(M_ARENA_MAX, arenas)``; False where the C library has no mallopt (musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("malloc arenas not limited: no mallopt in the C library")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas))
