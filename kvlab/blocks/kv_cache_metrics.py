"""Residency metrics of cached blocks, sampled, as vLLM V1's ``KVCacheMetricsCollector``
(``vllm/v1/core/kv_cache_metrics.py``).

``BlockManager(..., kv_cache_metrics=KVCacheMetricsCollector(sample_rate=0.01))`` (vLLM: ``--kv-cache-metrics``
with ``--kv-cache-metrics-sample 0.01``). The collector is one more consumer of the manager's event sink
(kvlab.blocks.event_sink), so a manager without one pays nothing: its sink stays None. For each block that
enters a cache, a ``sample_rate`` share of them (a seeded draw: a replay is reproducible), it keeps the time it
entered, its last access and its last four accesses (vLLM's bounded history); when the block is evicted it
records one ``ResidencyEvent``:

    lifetime_s     eviction time - entry time
    idle_s         eviction time - last access (the entry time if never hit): idle before eviction
    reuse_gaps_s   the gaps between its successive recorded accesses (none with fewer than two: as in vLLM,
                   the entry itself is not an access, so a block hit once has no gap)

vLLM samples at allocation; kvlab at sealing (the moment the block becomes cached, the same step for a prompt
block), since only a cached block can be hit or evicted. Both tiers are covered, each event carrying its
``medium`` (vLLM's KV-event field): "GPU" (entry: sealed or promoted into the pool; access: a prefix hit;
eviction: reused for new content) and "CPU" (the offload tier: entry at offload, access at promotion, eviction
when the tier's policy drops it). Blocks still resident at the end are not events: only evictions are.

``clock`` gives the time in seconds (``time.monotonic`` by default; a replay passes its trace's arrival clock).
``summary(medium)`` turns the events into histogram summaries (count, mean, percentiles) per metric.
"""

import random
import time
from collections import deque
from typing import NamedTuple

import numpy as np

from kvlab.blocks.event_sink import EventSink
from kvlab.validation import check_number

#: Accesses remembered per sampled block (vLLM's ``deque(maxlen=4)``): bounded, however often a block is hit.
ACCESS_HISTORY = 4
MEDIA = ("GPU", "CPU")
METRICS = ("lifetime_s", "idle_s", "reuse_gap_s")
QUANTILES = (0.5, 0.9, 0.99)


class ResidencyEvent(NamedTuple):
    """One sampled block's eviction (vLLM's ``KVCacheEvictionEvent``), in ``medium`` ("GPU" or "CPU")."""
    medium: str
    lifetime_s: float
    idle_s: float
    reuse_gaps_s: tuple


class KVCacheMetricsCollector(EventSink):
    def __init__(self, sample_rate: float = 0.01, clock=time.monotonic, seed: int = 0):
        self.sample_rate = check_number("sample_rate", sample_rate, 0, 1, min_open=True)
        self.clock = clock
        self._draw = random.Random(seed).random
        # medium -> slot -> [entry time, last access, deque of access times]
        self._tracked = {medium: {} for medium in MEDIA}
        self.events: list[ResidencyEvent] = []

    # ---- the sink's reports ----------------------------------------------------------------------------------
    def sealed(self, blocks):
        self._enter("GPU", blocks)

    def promoted(self, slots, blocks):
        self._access("CPU", slots)
        self._enter("GPU", blocks)

    def looked_up(self, seq_id, hits, misses):
        self._access("GPU", hits)

    def evicted(self, blocks, hashes, contents):
        self._evict("GPU", blocks)

    def offloaded(self, block, slot, block_hash, content):
        self._enter("CPU", (slot,))

    def tier_removed(self, slots, hashes):
        self._evict("CPU", slots)

    def cleared(self):
        self.reset()

    # ---- results ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every tracked block and event (vLLM's ``reset``, on ``reset_prefix_cache``)."""
        for tracked in self._tracked.values():
            tracked.clear()
        self.events = []

    def drain_events(self) -> list[ResidencyEvent]:
        """The events recorded since the last call (vLLM's ``drain_events``)."""
        events, self.events = self.events, []
        return events

    def summary(self, medium: str = "GPU", events=None) -> dict:
        """``{metric_count, metric_mean, metric_p50, metric_p90, metric_p99}`` for each metric of ``METRICS``
        over ``events`` (default: those recorded and not drained) in ``medium``; NaN where there is no sample."""
        events = self.events if events is None else events
        mine = [e for e in events if e.medium == medium]
        values = {"lifetime_s": [e.lifetime_s for e in mine], "idle_s": [e.idle_s for e in mine],
                  "reuse_gap_s": [gap for e in mine for gap in e.reuse_gaps_s]}
        return {key: value for metric in METRICS for key, value in describe(metric, values[metric]).items()}

    # ---- internals ---------------------------------------------------------------------------------------------
    def _enter(self, medium, slots):
        tracked, draw, rate = self._tracked[medium], self._draw, self.sample_rate
        now = None
        for slot in slots:
            if draw() < rate:
                now = self.clock() if now is None else now
                tracked[slot] = [now, now, deque(maxlen=ACCESS_HISTORY)]
            else:
                tracked.pop(slot, None)  # new content in a slot sampled before: its old record is stale

    def _access(self, medium, slots):
        tracked = self._tracked[medium]
        if not tracked:
            return
        now = None
        for slot in slots:
            state = tracked.get(slot)
            if state is not None:
                now = self.clock() if now is None else now
                state[1] = now
                state[2].append(now)

    def _evict(self, medium, slots):
        tracked = self._tracked[medium]
        if not tracked:
            return
        now = None
        for slot in slots:
            state = tracked.pop(slot, None)
            if state is not None:
                now = self.clock() if now is None else now
                entered, last, history = state
                gaps = tuple(b - a for a, b in zip(history, list(history)[1:]))
                self.events.append(ResidencyEvent(medium, now - entered, now - last, gaps))


def describe(metric: str, values) -> dict:
    """Histogram summary of ``values``: ``{metric}_count``, ``_mean`` and ``_p50`` / ``_p90`` / ``_p99``."""
    out = {f"{metric}_count": len(values)}
    array = np.asarray(values, dtype=float)
    out[f"{metric}_mean"] = float(array.mean()) if len(array) else float("nan")
    for q in QUANTILES:
        out[f"{metric}_p{round(q * 100)}"] = float(np.quantile(array, q)) if len(array) else float("nan")
    return out
