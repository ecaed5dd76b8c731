"""A de-duplicating work queue of string keys with delayed re-adds and per-key backoff.

Watchers add keys; the one worker takes them. A key added while queued is queued once; a key
added while the worker holds it is queued again (so no change is missed).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["WorkQueue"]


class WorkQueue:
    """Owns one condition; never calls out while holding it."""

    def __init__(
        self,
        *,
        base_delay_seconds: float = 0.05,
        max_delay_seconds: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._condition = threading.Condition()
        self._ready: deque[str] = deque()
        self._queued: set[str] = set()
        self._delayed: list[tuple[float, int, str]] = []
        self._sequence = 0
        self._failures: dict[str, int] = {}
        self._base_delay_seconds = base_delay_seconds
        self._max_delay_seconds = max_delay_seconds
        self._monotonic = monotonic
        self._shut_down = False

    def add(self, key: str) -> None:
        with self._condition:
            if key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
                self._condition.notify()

    def add_after(self, key: str, delay_seconds: float) -> None:
        with self._condition:
            self._sequence += 1
            heapq.heappush(self._delayed, (self._monotonic() + delay_seconds, self._sequence, key))
            self._condition.notify()

    def add_rate_limited(self, key: str) -> float:
        """Re-add after an exponential delay that grows with each failure of this key."""
        with self._condition:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(self._base_delay_seconds * float(2**failures), self._max_delay_seconds)
        self.add_after(key, delay)
        return delay

    def failures(self, key: str) -> int:
        """How many times in a row ``key`` was re-added with backoff since it last succeeded."""
        with self._condition:
            return self._failures.get(key, 0)

    def forget(self, key: str) -> None:
        """The key succeeded: reset its backoff."""
        with self._condition:
            self._failures.pop(key, None)

    def _promote_due(self) -> float | None:
        now = self._monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key = heapq.heappop(self._delayed)
            if key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
        return (self._delayed[0][0] - now) if self._delayed else None

    def get(self, timeout_seconds: float | None = None) -> str | None:
        """The next key, or None on shutdown or when ``timeout_seconds`` passed with nothing due."""
        deadline = None if timeout_seconds is None else self._monotonic() + timeout_seconds
        with self._condition:
            while not self._shut_down:
                next_due = self._promote_due()
                if self._ready:
                    key = self._ready.popleft()
                    self._queued.discard(key)
                    return key
                wait = next_due
                if deadline is not None:
                    remaining = deadline - self._monotonic()
                    if remaining <= 0:
                        return None
                    wait = remaining if wait is None else min(wait, remaining)
                self._condition.wait(wait)
            return None

    def take_ready(self, limit: int) -> list[str]:
        """Up to ``limit`` more keys that are due now, without waiting (a burst decided together)."""
        with self._condition:
            self._promote_due()
            taken: list[str] = []
            while self._ready and len(taken) < limit:
                key = self._ready.popleft()
                self._queued.discard(key)
                taken.append(key)
            return taken

    def shut_down(self) -> None:
        with self._condition:
            self._shut_down = True
            self._condition.notify_all()

    def __len__(self) -> int:
        with self._condition:
            return len(self._ready) + len(self._delayed)
