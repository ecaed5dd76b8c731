"""Free-capacity index over devices of one capacity key (e.g. ``memory``), for cluster-mode node choice.

Items are (node, device id) with a free amount and an "in use" flag (a shared device with live shares).
``iter_at_least(amount)`` yields in-use devices first, then unused ones, each by ascending free amount:
exactly the best-fit preference (fill shared devices, keep whole devices free). Buckets keep insertion
order (dicts, never sets) so iteration does not depend on hash seeds.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import Any

from driver.allocator.quantity import Number

__all__ = ["FreeIndex"]

Item = tuple[str, Any]


class FreeIndex:
    def __init__(self) -> None:
        self._buckets: tuple[dict[Number, dict[Item, None]], dict[Number, dict[Item, None]]] = ({}, {})
        self._keys: tuple[list[Number], list[Number]] = ([], [])
        self._where: dict[Item, tuple[int, Number]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def put(self, item: Item, *, in_use: bool, free: Number) -> None:
        group = 0 if in_use else 1
        if self._where.get(item) == (group, free):
            return
        self.remove(item)
        buckets = self._buckets[group]
        bucket = buckets.get(free)
        if bucket is None:
            bucket = buckets[free] = {}
            insort(self._keys[group], free)
        bucket[item] = None
        self._where[item] = (group, free)

    def free_of(self, item: Item) -> Number:
        where = self._where.get(item)
        return where[1] if where is not None else 0

    def remove(self, item: Item) -> None:
        where = self._where.pop(item, None)
        if where is None:
            return
        group, free = where
        bucket = self._buckets[group][free]
        del bucket[item]
        if not bucket:
            del self._buckets[group][free]
            keys = self._keys[group]
            del keys[bisect_left(keys, free)]

    def iter_at_least(self, amount: Number) -> Iterator[tuple[Item, bool, Number]]:
        for group in (0, 1):
            keys = self._keys[group]
            buckets = self._buckets[group]
            for key in keys[bisect_left(keys, amount) :]:
                bucket = buckets.get(key)
                if bucket is None:
                    continue
                # No copy: consumers stop iterating before they change the index.
                for item in bucket:
                    yield item, group == 0, key
