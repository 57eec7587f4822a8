"""A memo keyed by the object a result was computed for, by identity, plus a hashable key.

The search prices the same layer, device efficiency and model totals hundreds of thousands of
times for candidates that differ only in fields those numbers do not read (ZeRO stage, hybrid
sharding, schedule). :class:`GPUSpec` and :class:`Cluster` may hold calibration tables that do
not hash, so the memo keys them by ``id`` and keeps a reference to each, so that an id is never
reused while its entry lives. A memo returns the very value it computed: cached numbers are the
uncached ones.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class IdentityMemo(Generic[T]):
    """``get(owner, key, compute)``: ``compute()`` once per ``(owner, key)`` (``owner`` by
    identity); cleared whole when ``limit`` entries are held (a bound, not an LRU)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._values: dict[tuple[int, Hashable], tuple[object, T]] = {}

    def get(self, owner: object, key: Hashable, compute: Callable[[], T]) -> T:
        slot = (id(owner), key)
        hit = self._values.get(slot)
        if hit is not None and hit[0] is owner:
            return hit[1]
        value = compute()
        if len(self._values) >= self.limit:
            self._values.clear()
        self._values[slot] = (owner, value)
        return value
