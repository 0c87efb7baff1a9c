"""A data server's memory of decoded samples, up to a budget in bytes.

Decoding (reading a file, parsing an image) is the part of a sample's preparation that is the
same every epoch; the random augmentation is not. So a data server keeps a copy of what
``dataset[i]`` returned and applies the transform afresh to the cached sample each time it
serves it: epochs still differ, and a later epoch skips the decode. (The transform must
therefore not change its input in place, which torchvision's transforms do not.) Project
Adam's data servers did the same with most of their memory.

The policy is *keep until full*: a sample enters while its bytes fit in what is left of the
budget and stays for the job's life; nothing is evicted. Every epoch visits every sample once
in a fresh random order, and for that access pattern any eviction (LRU included) only trades
one future hit for another, at the cost of the copying; with the budget at a fraction f of the
server's share, a fraction f of each later epoch's samples hit either way.
"""

from __future__ import annotations

import copy
import threading

__all__ = ["Cache"]


class Cache:
    """Decoded samples by id, with hit and miss counters.

    Args:
        budget: bytes of leaves it may hold; 0 holds nothing (every lookup misses).
    """

    def __init__(self, budget: int):
        if budget < 0:
            raise ValueError(f"a cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.used = 0
        self.hits = 0
        self.misses = 0
        self._samples: dict[int, object] = {}
        self._lock = threading.Lock()

    def get(self, sample_id: int):
        """The cached sample ``sample_id`` (counts a hit), or None (counts a miss)."""
        with self._lock:
            sample = self._samples.get(sample_id)
            if sample is None:
                self.misses += 1
            else:
                self.hits += 1
            return sample

    def put(self, sample_id: int, sample, nbytes: int) -> bool:
        """Keeps a copy of ``sample`` (``nbytes`` of arrays) if it fits the budget; returns
        whether it was kept. The copy detaches the cache from the dataset's own buffers (a
        dataset may hand out views of memory it reuses)."""
        with self._lock:
            if sample_id in self._samples or self.used + nbytes > self.budget:
                return False
            self.used += nbytes
            self._samples[sample_id] = copy.deepcopy(sample)
            return True

    def __len__(self) -> int:
        return len(self._samples)

    def counters(self) -> dict:
        """``{"hits", "misses", "samples", "bytes", "budget"}``."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "samples": len(self._samples),
                    "bytes": self.used, "budget": self.budget}
