"""The block manager's state, created in one place, and the record lookups every part of it shares.

``BlockManager`` (kvlab.blocks.manager) is built from parts that each add public calls over the same state:
its lifecycle (manager.py), its queries (manager_queries.py), swapping (manager_swap.py), speculative
drafts (drafts.py) and vLLM V0's interface (vllm_v0.py). Each part derives from ``ManagerState``, so the state a part reads is created by its
own base class, here, never by a subclass that happens to combine it: the components below and the
settings, nothing else.

    _pool          BlockPool: the GPU pool and its ref counts (kvlab.blocks.block_pool); ``_pool.index`` its
                   PrefixIndex, the prefix cache (kvlab.blocks.prefix_index)
    _swap          SwapSpace: the CPU pool (kvlab.blocks.swap)
    _tier          OffloadTier: the CPU tier of cached blocks, None without one (kvlab.blocks.offload_tier)
    _cross         CrossTables: encoder-decoder cross-attention tables (kvlab.blocks.cross_attention)
    _allocs        the Allocation of every sequence allocated here (kvlab.blocks.allocations)
    _sink          the EventSink every change is reported to, None when nobody listens (kvlab.blocks.event_sink)
    events, kv_events   its consumers: the teaching Event log's list and vLLM's KV-event stream (None when off)
    stats          PrefixCacheStats of ``allocate``'s lookups
    _lock          the re-entrant lock every public call holds (kvlab.blocks.locking)
"""

import threading
from typing import Optional

from kvlab.blocks.allocations import Allocation, allocation_of
from kvlab.blocks.block_pool import BlockPool
from kvlab.blocks.cross_attention import CrossTables
from kvlab.blocks.event_sink import EventLog, make_sink
from kvlab.blocks.eviction import make_policy
from kvlab.blocks.hashing import HashFn
from kvlab.blocks.kv_events import KVEventPublisher
from kvlab.blocks.offload_policies import check_offload_options
from kvlab.blocks.offload_tier import make_tier
from kvlab.blocks.records import AllocStatus, Event, PrefixCacheStats
from kvlab.blocks.sequence import check_block_size
from kvlab.blocks.swap import SwapSpace
from kvlab.errors import InvalidArgumentError, SequenceStateError
from kvlab.validation import check_int, check_number

NULL_BLOCK = 0  # with a sliding window, block 0 is reserved: every released table entry points at it
#: Largest pool (GPU or CPU): the manager keeps ~100 bytes of Python state per block (2**24 blocks: ~2 GB).
MAX_BLOCKS = 1 << 24


class ManagerState:
    def __init__(self, num_blocks: int, block_size: int = 16, *, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None, hash_fn: Optional[HashFn] = None,
                 eviction="lru", record_events: bool = False, kv_events: bool = False,
                 num_offload_blocks: int = 0, offload_policy: str = "lru", offload_admission: str = "always"):
        self.block_size = check_block_size(block_size)
        self.num_blocks = check_int("num_blocks", num_blocks, 2 if sliding_window is not None else 1, MAX_BLOCKS)
        check_int("num_cpu_blocks", num_cpu_blocks, 0, MAX_BLOCKS)
        check_number("watermark", watermark, 0, 1, max_open=True)
        if sliding_window is not None:
            check_int("sliding_window", sliding_window, 1)
        check_int("num_offload_blocks", num_offload_blocks, 0, MAX_BLOCKS)
        check_offload_options(offload_policy, offload_admission)
        if num_offload_blocks and (sliding_window is not None or not enable_prefix_caching):
            raise InvalidArgumentError("num_offload_blocks needs prefix caching on and no sliding_window (the tier "
                                       "holds cached full-attention blocks); got "
                                       f"enable_prefix_caching={enable_prefix_caching!r}, "
                                       f"sliding_window={sliding_window!r}")
        if hash_fn is not None and not callable(hash_fn):
            raise InvalidArgumentError("hash_fn must be callable as hash_fn(parent_hash_or_None, token_ids)")
        eviction = make_policy(eviction)
        self.sliding_window = sliding_window
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_fn = hash_fn
        log = EventLog() if record_events else None
        self.events: Optional[list[Event]] = log.events if record_events else None
        # What enters and leaves the prefix cache, for routers (vLLM's KV events: kvlab.blocks.kv_events).
        self.kv_events = KVEventPublisher(self.block_size) if kv_events else None
        self._kv_queue = self.kv_events.queue if kv_events else ()  # delivered after each call (locking.py)
        # The one sink the lifecycle and the pool report to: None when neither consumer is on.
        self._sink = make_sink(log, self.kv_events)
        first_block = NULL_BLOCK + 1 if sliding_window is not None else 0
        self._pool = BlockPool(self.num_blocks, eviction, first_block, self._sink)
        self._swap = SwapSpace(num_cpu_blocks)
        self._tier = make_tier(num_offload_blocks, self._pool.index, offload_policy, offload_admission)
        if self._tier is not None:
            self._pool.tier, self._tier.sink = self._tier, self._sink
        self._cross = CrossTables(self.block_size)
        self._usable = self.num_blocks - first_block
        self._watermark_blocks = int(watermark * self.num_blocks)
        self._allocs: set[Allocation] = set()
        self._lock = threading.RLock()
        self.stats = PrefixCacheStats()

    # ---- a sequence's record, checked against where its blocks are ------------------------------------
    def _alloc(self, seq) -> Allocation:
        return allocation_of(self, seq)

    def _on_gpu(self, seq) -> Allocation:
        alloc = allocation_of(self, seq)
        if alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is swapped out; swap_in first")
        return alloc

    def _on_cpu(self, seq) -> Allocation:
        alloc = allocation_of(self, seq)
        if not alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is not swapped out")
        return alloc

    # ---- admission: ``live_blocks`` held at once, ``needed_free`` of them taken from the free pool now ----
    def _admission(self, live_blocks, needed_free) -> AllocStatus:
        if live_blocks > self._usable - self._watermark_blocks:
            return AllocStatus.NEVER
        if self._pool.num_free - needed_free >= self._watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER
