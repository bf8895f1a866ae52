"""Exact LRU cache of encoded prompts, bounded in bytes.

Values are the encoded wire chunks (immutable protobuf bytes), so a hit sends the same bytes
again without re-encoding, and no caller can mutate what the cache holds.

Keys (`prompt_key`, `media_key`) start with the model revision and the encoder variant ("bf16", "fp32", "int8",
"nf4": h3serve/services/encoder/placement.py::variant): the same weights quantized compute other embeddings, so a
quantized encoder never serves bf16 embeddings from a shared cache, nor the reverse.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


def prompt_key(revision: str, variant: str, prompt: str) -> tuple:
    """A t2va prompt's key."""
    return (revision, variant, prompt)


def media_key(revision: str, variant: str, spec) -> tuple:
    """fl2va / ref2va (a MediaSpec): the canvas, the frame count and the assets' content addresses too."""
    return (
        revision,
        variant,
        spec.prompt,
        spec.workflow,
        spec.height,
        spec.width,
        spec.num_frames,
        tuple((item.role, item.asset_id) for item in spec.items),
    )


@dataclass
class CacheStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ByteLRU:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def get(self, key: tuple):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._stats.hits += 1
            return item[0]

    def put(self, key: tuple, value: object, nbytes: int) -> None:
        """Insert, evicting least-recently-used entries; a value larger than the bound is not kept."""
        with self._lock:
            if key in self._items:
                self._stats.bytes -= self._items.pop(key)[1]
            if nbytes > self.capacity_bytes:
                return
            while self._stats.bytes + nbytes > self.capacity_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self._stats.bytes -= evicted
                self._stats.evictions += 1
            self._items[key] = (value, nbytes)
            self._stats.bytes += nbytes

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                len(self._items), self._stats.bytes, self._stats.hits, self._stats.misses, self._stats.evictions
            )
