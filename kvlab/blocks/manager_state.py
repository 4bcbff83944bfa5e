"""The block manager's state, created in one place, and the record lookups every part of it shares.

A group's core (``GroupCore``, kvlab.blocks.group_core) is built from parts that each add calls over the same
state: its halves of the lifecycle calls (group_core.py, manager_steps.py, drafts.py: the calls themselves are
the coordinator's, kvlab.blocks.coordinator) and its own queries; a ``BlockManager`` (kvlab.blocks.manager) is a
``GroupCore`` with vLLM V0's interface (vllm_v0.py, which creates the cross-attention tables it reads). Each part
derives from ``ManagerState``, so the state a part reads is created by its own base class, here, never by a
subclass that happens to combine it: the components below and the settings, nothing else. The components are
built (and the settings checked) by ``shared_parts``; a core joins them as one group of attention ``spec``
(``_join``): a ``BlockManager`` joins parts of its own, each group of a hybrid manager the one set its
coordinator built (``GroupCore.joined``, kvlab.blocks.group_manager).

    _pool          BlockPool: the GPU pool and its ref counts (kvlab.blocks.block_pool); ``_pool.index`` its
                   PrefixIndex, the prefix cache (kvlab.blocks.prefix_index)
    _swap          SwapSpace: the CPU pool (kvlab.blocks.swap)
    _tier          OffloadTier: the CPU tier of cached blocks, None without one (kvlab.blocks.offload_tier)
    _allocs        the Allocation of every sequence allocated here (kvlab.blocks.allocations)
    _sink          the EventSink every change is reported to, None when nobody listens (kvlab.blocks.event_sink)
    spec           the attention spec whose rules the planning follows (kvlab.blocks.kv_cache_groups)
    events, kv_events   its consumers: the teaching Event log's list and vLLM's KV-event stream (None when off)
    kv_cache_metrics    a third consumer: sampled residency metrics (kvlab.blocks.kv_cache_metrics), None when off
    stats          PrefixCacheStats of ``allocate``'s lookups, cumulative (``_stats_mark``: where the current run
                   began, for ``make_prefix_cache_stats``)
    _lock          the re-entrant lock every public call holds (kvlab.blocks.locking)
"""

import threading
from typing import NamedTuple, Optional

from kvlab.blocks.allocations import Allocation, allocation_of
from kvlab.blocks.block_pool import BlockPool
from kvlab.blocks.event_sink import EventLog, EventSink, make_sink
from kvlab.blocks.eviction import make_policy
from kvlab.blocks.hashing import HashFn
from kvlab.blocks.kv_cache_groups import KVCacheSpec, spec_for
from kvlab.blocks.kv_cache_metrics import KVCacheMetricsCollector
from kvlab.blocks.kv_events import KVEventPublisher
from kvlab.blocks.offload_policies import check_offload_options
from kvlab.blocks.offload_tier import is_shared, make_tier
from kvlab.blocks.prefix_index import PrefixIndex
from kvlab.blocks.records import AllocStatus, Event, PrefixCacheStats
from kvlab.blocks.sequence import check_block_size
from kvlab.blocks.swap import SwapSpace
from kvlab.errors import InvalidArgumentError, SequenceStateError
from kvlab.validation import check_int, check_number

NULL_BLOCK = 0  # with a sliding window, block 0 is reserved: every released table entry points at it
#: Largest pool (GPU or CPU): the manager keeps ~100 bytes of Python state per block (2**24 blocks: ~2 GB).
MAX_BLOCKS = 1 << 24


class SharedParts(NamedTuple):
    """What the KV cache groups of one manager share (``shared_parts`` checks the settings and builds them): a
    ``BlockManager`` is one group on parts of its own; a hybrid manager's groups (kvlab.blocks.group_manager)
    all stand on one."""
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    hash_fn: Optional[HashFn]
    pool: BlockPool
    swap: SwapSpace
    usable: int            # blocks one sequence can hold at most: the pool less the null block, if reserved
    watermark_blocks: int  # kept free at admission
    sink: Optional[EventSink]  # every change is reported here; None when nobody listens
    events: Optional[list[Event]]  # the teaching Event log's list (None when off)
    kv_events: Optional[KVEventPublisher]  # vLLM's KV-event stream (None when off)
    tier: Optional[object]  # the offload tier for evicted cached blocks (kvlab.blocks.offload_tier), or None


def shared_parts(num_blocks: int, block_size: int, *, num_cpu_blocks: int, watermark: float,
                 enable_prefix_caching: bool, sliding_window: Optional[int], hash_fn: Optional[HashFn], eviction,
                 record_events: bool, kv_events: bool, groups=None, num_offload_blocks: int = 0,
                 offload_policy: str = "lru", offload_admission: str = "always",
                 kv_cache_metrics: Optional[KVCacheMetricsCollector] = None, shared_tier=None) -> SharedParts:
    """Check a manager's settings (InvalidArgumentError says which is wrong) and build its shared parts. A
    ``sliding_window`` (any group's) reserves the null block; ``groups`` are a hybrid manager's group specs, which
    its KV events describe; ``shared_tier`` a tier several managers share (``make_shared_tier``)."""
    block_size = check_block_size(block_size)
    num_blocks = check_int("num_blocks", num_blocks, 2 if sliding_window is not None else 1, MAX_BLOCKS)
    check_int("num_cpu_blocks", num_cpu_blocks, 0, MAX_BLOCKS)
    check_number("watermark", watermark, 0, 1, max_open=True)
    if sliding_window is not None:
        check_int("sliding_window", sliding_window, 1)
    check_int("num_offload_blocks", num_offload_blocks, 0, MAX_BLOCKS)
    check_offload_options(offload_policy, offload_admission)
    if shared_tier is not None and (not is_shared(shared_tier) or num_offload_blocks):
        raise InvalidArgumentError(f"shared_tier must be a tier from kvlab.blocks.offload_tier.make_shared_tier, with "
                                   f"num_offload_blocks=0 (one tier per manager), got {shared_tier!r} and "
                                   f"num_offload_blocks={num_offload_blocks}")
    if (num_offload_blocks or shared_tier is not None) and (sliding_window is not None or not enable_prefix_caching):
        raise InvalidArgumentError("num_offload_blocks needs prefix caching on and no sliding_window (the tier "
                                   "holds cached full-attention blocks); got "
                                   f"enable_prefix_caching={enable_prefix_caching!r}, "
                                   f"sliding_window={sliding_window!r}")
    if kv_cache_metrics is not None and not isinstance(kv_cache_metrics, KVCacheMetricsCollector):
        raise InvalidArgumentError("kv_cache_metrics must be a KVCacheMetricsCollector (kvlab.blocks.kv_cache_metrics) "
                                   f"or None, got {type(kv_cache_metrics).__name__}")
    if hash_fn is not None and not callable(hash_fn):
        raise InvalidArgumentError("hash_fn must be callable as hash_fn(parent_hash_or_None, token_ids)")
    eviction = make_policy(eviction)
    log = EventLog() if record_events else None
    # What enters and leaves the prefix cache, for routers (vLLM's KV events: kvlab.blocks.kv_events).
    publisher = KVEventPublisher(block_size, groups) if kv_events else None
    sink = make_sink(log, publisher, kv_cache_metrics)  # the one sink the groups and the pool report to
    first_block = NULL_BLOCK + 1 if sliding_window is not None else 0
    # One namespace of the prefix index per KV cache group (kvlab.blocks.prefix_index).
    index = PrefixIndex(num_blocks, shared_tier.index.ids if shared_tier is not None else None,
                        num_groups=len(groups) if groups else 1)
    pool = BlockPool(num_blocks, eviction, first_block, sink, index)
    tier = shared_tier if shared_tier is not None else make_tier(num_offload_blocks, pool.index, offload_policy,
                                                                 offload_admission)
    if tier is not None:  # the offload tier (kvlab.blocks.offload_tier): a single-group manager's only
        pool.tier = tier
        if shared_tier is None:  # a shared tier reports to no replica's sink (offload_tier's docstring)
            tier.sink = sink
    return SharedParts(block_size, num_blocks, bool(enable_prefix_caching), hash_fn, pool, SwapSpace(num_cpu_blocks),
                       num_blocks - first_block, int(watermark * num_blocks), sink,
                       log.events if record_events else None, publisher, tier)


def admission(pool, usable: int, watermark_blocks: int, live_blocks: int, needed_free: int) -> AllocStatus:
    """Whether a sequence holding ``live_blocks`` at once, ``needed_free`` of them taken from the free pool now,
    fits now (OK, keeping the watermark free), once others leave (LATER), or never (NEVER)."""
    if live_blocks > usable - watermark_blocks:
        return AllocStatus.NEVER
    if pool.num_free - needed_free >= watermark_blocks:
        return AllocStatus.OK
    return AllocStatus.LATER


class ManagerState:
    def __init__(self, num_blocks: int, block_size: int = 16, *, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None, hash_fn: Optional[HashFn] = None,
                 eviction="lru", record_events: bool = False, kv_events: bool = False,
                 num_offload_blocks: int = 0, offload_policy: str = "lru", offload_admission: str = "always",
                 kv_cache_metrics: Optional[KVCacheMetricsCollector] = None, shared_tier=None):
        shared = shared_parts(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                              enable_prefix_caching=enable_prefix_caching, sliding_window=sliding_window,
                              hash_fn=hash_fn, eviction=eviction, record_events=record_events, kv_events=kv_events,
                              num_offload_blocks=num_offload_blocks, offload_policy=offload_policy,
                              offload_admission=offload_admission, kv_cache_metrics=kv_cache_metrics,
                              shared_tier=shared_tier)
        self._join(shared, spec_for(sliding_window), shared.sink, shared.events, shared.kv_events)
        self.kv_cache_metrics = kv_cache_metrics  # residency metrics (kvlab.blocks.kv_cache_metrics), or None

    @classmethod
    def joined(cls, shared: SharedParts, spec: KVCacheSpec, sink: Optional[EventSink], group: int):
        """A core that is group ``group`` of ``shared`` (see ``_join``), its settings checked by
        ``shared_parts``."""
        manager = cls.__new__(cls)
        manager._join(shared, spec, sink, group=group)
        return manager

    def _join(self, shared: SharedParts, spec: KVCacheSpec, sink: Optional[EventSink], events=None,
              kv_events=None, group: int = 0) -> None:
        """Become group ``group`` of ``shared`` (its namespace of the prefix index), of attention ``spec``,
        reporting to ``sink``; ``events`` and ``kv_events`` are the consumers this manager shows (a hybrid
        manager's groups show none: their coordinator holds and delivers them)."""
        self.group = group
        self.block_size, self.num_blocks = shared.block_size, shared.num_blocks
        self.spec, self.sliding_window = spec, spec.sliding_window
        self.enable_prefix_caching, self.hash_fn = shared.enable_prefix_caching, shared.hash_fn
        self.events, self.kv_events = events, kv_events
        self._kv_queue = kv_events.queue if kv_events is not None else ()  # delivered after each call (locking.py)
        self._sink, self._pool, self._swap, self._tier = sink, shared.pool, shared.swap, shared.tier
        self._usable, self._watermark_blocks = shared.usable, shared.watermark_blocks
        self._allocs: set[Allocation] = set()
        self._lock = threading.RLock()
        self.stats = PrefixCacheStats()
        self._stats_mark = PrefixCacheStats()  # a copy of ``stats`` at the last make_prefix_cache_stats()

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
