"""Free-capacity index over devices of one capacity key (e.g. ``memory``), for cluster-mode node choice.

Items are (node, device id) with a free amount, an "in use" flag (a shared device with live shares)
and whether the device may be shared at all (``allowMultipleAllocations``).
``iter_at_least(amount)`` yields in-use devices first, then unused ones, each by ascending free amount:
exactly the best-fit preference (fill shared devices, keep whole devices free). Among unused devices,
those that may be shared come before those that may not (a share on a device that may not be shared
takes all of it), or after them with ``unshareable_first`` (a request for whole devices leaves the
shareable ones to shares). Buckets keep insertion order (dicts, never sets) so iteration does not
depend on hash seeds.
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
        # Groups: 0 in use, 1 unused and shareable, 2 unused and not shareable.
        self._buckets: tuple[dict[Number, dict[Item, None]], ...] = ({}, {}, {})
        self._keys: tuple[list[Number], ...] = ([], [], [])
        self._where: dict[Item, tuple[int, Number]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def put(self, item: Item, *, in_use: bool, free: Number, shareable: bool = True) -> None:
        group = 0 if in_use else 1 if shareable else 2
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

    def iter_at_least(
        self, amount: Number, *, unshareable_first: bool = False
    ) -> Iterator[tuple[Item, bool, Number]]:
        for group in (0, 2, 1) if unshareable_first else (0, 1, 2):
            keys = self._keys[group]
            buckets = self._buckets[group]
            for key in keys[bisect_left(keys, amount) :]:
                bucket = buckets.get(key)
                if bucket is None:
                    continue
                # No copy: consumers stop iterating before they change the index.
                for item in bucket:
                    yield item, group == 0, key
