"""An LRU map bounded by the bytes of what it holds, not by its number of entries.

    cache = ByteLRU(max_bytes=32 * 1024 * 1024, max_entry_bytes=1024 * 1024)
    cache.put(key, value, num_bytes)      # num_bytes: the caller's estimate of key + value
    cache.get(key)                        # the value (now most recently used), or None

Every cache on a request path whose keys or values a caller chooses is one of these: a count
bound lets a few multi-megabyte entries grow a process by gigabytes. An entry over
`max_entry_bytes` is not kept at all (one huge entry must not evict everything else); putting one
evicts least recently used entries until the total is within `max_bytes` again. Not thread-safe
beyond the GIL: one event loop, or one worker thread, at a time (a lost race costs a miss).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_INT_BYTES = 28  # a Python int above the small-int cache (a token id), as sys.getsizeof says


def str_bytes(text: str) -> int:
    """Bytes a str occupies in CPython (its header and its 1-, 2- or 4-byte code units)."""
    return sys.getsizeof(text)


def int_list_bytes(values: Sequence[int]) -> int:
    """Bytes of a list of ints: the list and one int object per element (an upper bound)."""
    return sys.getsizeof(values) + _INT_BYTES * len(values)


class ByteLRU(Generic[K, V]):
    def __init__(self, max_bytes: int, max_entry_bytes: int | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_bytes if max_entry_bytes is None else min(max_entry_bytes,
                                                                            max_bytes)
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, num_bytes: int) -> bool:
        """Keep `value` under `key`; False (and nothing kept) when it alone is over the entry
        bound."""
        self.pop(key)
        if num_bytes > self.max_entry_bytes:
            return False
        self._entries[key] = (value, num_bytes)
        self.num_bytes += num_bytes
        while self.num_bytes > self.max_bytes:
            _, (_, evicted_bytes) = self._entries.popitem(last=False)
            self.num_bytes -= evicted_bytes
        return True

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.num_bytes -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0
