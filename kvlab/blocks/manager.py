"""The block manager: which physical KV blocks each sequence's tokens live in (vLLM V1's ``KVCacheManager`` and
its coordinator, in one class over one ``GroupManager`` per KV cache group; ``BlockManager`` is the same with the
sequences' progress written for callers without a scheduler).

A call, end to end (admitting a prompt with a prefix hit, as the V1 scheduler does)::

    hit = manager.lookup(seq)                               one lookup per group: a PrefixHit value
    manager.can_allocate(seq, num_new_tokens=k, hit=hit)    OK / LATER / NEVER, from the same hit
    admitted = manager.allocate(seq, num_new_tokens=k, hit=hit)
        -> each group plans from its hits (kvlab.blocks.group_manager), the room is checked, every group's
           eviction-policy calls run in one transaction (kvlab.blocks.block_pool), then each group records the
           sequence; the value returned names the new blocks per group and the offload tier's copies

Engine ordering rule (the prefix cache relies on it): within a forward pass, every layer writes the new
tokens' K/V into their slots before that layer's attention reads the cache. So a full block becomes hittable as
soon as the step that writes its last token is scheduled (prompt blocks when ``allocate`` returns, a decode
block when ``append_slots`` seals it), and once ``allocate`` or ``append_slots`` returned, the step that writes
those slots must run before the sequence is freed.

Lifecycle: ``allocate`` (RUNNING) -> ``append_token`` + ``append_slots`` per step -> ``free`` (FINISHED, or
WAITING with ``preempted=True``); ``fork`` shares a running sequence's blocks with a new child; ``swap_out``
(SWAPPED) / ``swap_in`` (RUNNING) move it to the CPU pool and back. Chunked prompts: ``allocate(seq,
num_new_tokens=k)`` gives slots to the hits plus the next k prompt tokens, each later ``append_slots(seq,
num_new_tokens=k)`` to the next k. A sequence's progress (``num_computed_tokens``, ``num_draft_tokens``,
``prefill_end``, ``num_cached_tokens``) and status are its own fields, and whoever schedules it writes them from
what the calls return, as vLLM V1's scheduler does (``Sequence.start_running``, ``scheduled_through``,
``stopped``): the engine's scheduler over a ``KVCacheManager``, or ``BlockManager`` itself. The manager reads
them and decides what is valid from its own records.

Every call is planned in every group, checked, and only then acted on, so a failed call changes nothing in any
group; every public method holds one re-entrant lock, and KV events reach subscribers only after the outermost
call's whole change. A hybrid model (``HybridBlockManager``: full and sliding-window layers) is the same class
with several groups drawing pages from one pool; each group is a namespace of the prefix index (vLLM's
``BlockHashWithGroupId``), and the hit is the longest prefix every group serves.
"""

import dataclasses
import functools
import threading
from itertools import filterfalse
from operator import attrgetter
from typing import NamedTuple, Optional

from kvlab.blocks.block_pool import BlockPool
from kvlab.blocks.eviction import make_policy
from kvlab.blocks.events import EventLog, GroupSink, KVCacheMetricsCollector, KVEventPublisher, make_sink
from kvlab.blocks.group_manager import NULL_BLOCK, CrossTable, GroupManager, check_cross_tables, check_sequence, \
    least_peak_blocks
from kvlab.blocks.kv_cache_groups import check_group_specs, spec_for
from kvlab.blocks.prefix_cache import ROOT, PrefixIndex, UnitPrefixIndex, prompt_blocks
from kvlab.blocks.records import AllocStatus, PrefixCacheStats, TierMove
from kvlab.blocks.sequence import Sequence, SequenceStatus, check_block_size, copy_tokens
from kvlab.blocks.tiers import SwapSpace, check_offload_options, is_shared, make_tier
from kvlab.errors import InvalidArgumentError, InvariantViolation, OutOfBlocksError, SequenceStateError
from kvlab.validation import check_int, check_number

__all__ = ["KVCacheManager", "BlockManager", "HybridBlockManager", "PrefixHit", "Admitted", "BlockCopies",
           "AllocStatus", "PrefixCacheStats", "NULL_BLOCK", "MAX_BLOCKS"]

#: Largest pool (GPU or CPU): the manager keeps ~100 bytes of Python state per block (2**24 blocks: ~2 GB).
MAX_BLOCKS = 1 << 24


class PrefixHit(NamedTuple):
    """What ``lookup(seq)`` found: the hit every group serves, to pass to ``can_allocate`` and ``allocate``."""
    seq_id: int
    num_tokens: int     # tokens of the hit: len(tier_hits) + every group's len(hits), times block_size
    hashes: list        # the prompt's full blocks' hashes and bytes (what the groups seal after the hit)
    contents: list
    hits: tuple         # per group: the cached GPU blocks of its first full blocks, cut to the common hit
    content_ids: tuple  # per group: what each hit block held when looked up (a stale hit is refused)
    tier_hits: tuple    # offload-tier slots continuing the GPU hits (a one-group manager's tier)
    tier_content_ids: tuple  # what each of those slots held
    generations: tuple  # the GPU index's and the tier index's generation then: unchanged, nothing was evicted
    num_external_tokens: int = 0  # KV a connector would load (disaggregated prefill): the seam, none today
    num_cut_tokens: int = 0    # cached in the first group but cut off by another group's hit (a hybrid model)
    num_eagle_tokens: int = 0  # the hit's last block, given up to be recomputed (``use_eagle``)
    partial: tuple = ()  # per group: the block whose first units continue the hit (prefix_match_unit; None for a
    #                      group the hit does not cut, with groups of different block sizes), or ()
    num_partial_tokens: int = 0  # the first group's units' tokens (in num_tokens): copied into a new block


class Admitted(NamedTuple):
    """What ``allocate`` did: the tokens hit, each group's new blocks, the offload tier's copies to apply
    before the step's forward pass (``TierMove("offload", gpu_blocks, cpu_slots)``, ``TierMove("promote", cpu_slots,
    gpu_blocks)``, in order),
    the positions with slots now (the sequence's ``num_computed_tokens`` once scheduled: the hit and the first
    chunk) and a partial-block hit's source blocks (``prefix_match_unit``; ``copies`` to apply before the pass)."""
    num_cached_tokens: int
    new_blocks: tuple
    tier_moves: list[TierMove]
    num_computed_tokens: int
    partial: tuple = ()  # per group: the block the partial hit's units are copied from, or ()

    @property
    def copies(self) -> list:
        """The partial hit's (src, dst) copies, each group's source block into its first new block (unless the
        policy handed out that very block: its units are in place). The whole block is copied: the positions
        after the hit's units are written by the sequence's own steps before anything reads them."""
        return [(src, blocks[0]) for src, blocks in zip(self.partial, self.new_blocks)
                if src is not None and src != blocks[0]]


class BlockCopies(list):
    """The (src, dst) copies a call returns (copy-on-write pairs, swap mappings), every group's, group after
    group; ``tier_moves``: the offload tier's copies the same call made, to apply first; from ``append_slots``,
    ``num_computed_tokens``: the positions with slots after the step (drafts included)."""
    tier_moves = ()  # set by the call that returns it
    num_computed_tokens = None


class SharedParts(NamedTuple):
    """What every KV cache group of a manager stands on (``_shared_parts`` checks the settings and builds it)."""
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    hash_fn: object
    pool: BlockPool
    swap: SwapSpace
    tier: object           # the offload tier for evicted cached blocks (kvlab.blocks.tiers), or None
    usable: int            # blocks one sequence can hold at most: the pool less the null block, if reserved
    watermark_blocks: int  # kept free at admission
    sink: object           # every change is reported here (kvlab.blocks.events); None when nobody listens
    events: Optional[list]  # the teaching Event log's list (None when off)
    kv_events: Optional[KVEventPublisher]  # vLLM's KV-event stream (None when off)
    prefix_match_unit: int  # tokens per unit of prefix matching (block_size: whole blocks only)
    plan_append: object     # a learner's copy-on-write plan (kvlab.engine.parts), or None: kvlab's
    plan_window_release: object  # a learner's sliding-window release (kvlab.engine.parts), or None: kvlab's
    group_block_sizes: tuple  # each group's tokens per block: multiples of block_size (the sequences' blocks)
    partial_hits: bool        # whether lookups also find a group's block by its first units (prefix_match_unit)


def _shared_parts(num_blocks, block_size, *, num_cpu_blocks, watermark, enable_prefix_caching, sliding_window,
                  hash_fn, eviction, record_events, kv_events, groups=None, num_offload_blocks=0,
                  offload_policy="lru", offload_admission="always", kv_cache_metrics=None,
                  shared_tier=None, prefix_match_unit=None, use_eagle=False, plan_append=None,
                  plan_window_release=None, group_block_sizes=None) -> SharedParts:
    """Check a manager's settings (InvalidArgumentError says which is wrong) and build its shared parts."""
    block_size = check_block_size(block_size)
    num_blocks = check_int("num_blocks", num_blocks, 2 if sliding_window is not None else 1, MAX_BLOCKS)
    check_int("num_cpu_blocks", num_cpu_blocks, 0, MAX_BLOCKS)
    check_number("watermark", watermark, 0, 1, max_open=True)
    if sliding_window is not None:
        check_int("sliding_window", sliding_window, 1)
    check_int("num_offload_blocks", num_offload_blocks, 0, MAX_BLOCKS)
    check_offload_options(offload_policy, offload_admission)
    if shared_tier is not None and (not is_shared(shared_tier) or num_offload_blocks):
        raise InvalidArgumentError(f"shared_tier must be a tier from kvlab.blocks.tiers.make_shared_tier, with "
                                   f"num_offload_blocks=0 (one tier per manager), got {shared_tier!r} and "
                                   f"num_offload_blocks={num_offload_blocks}")
    if (num_offload_blocks or shared_tier is not None) and (sliding_window is not None or not enable_prefix_caching):
        raise InvalidArgumentError("num_offload_blocks needs prefix caching on and no sliding_window (the tier "
                                   "holds cached full-attention blocks); got "
                                   f"enable_prefix_caching={enable_prefix_caching!r}, "
                                   f"sliding_window={sliding_window!r}")
    if kv_cache_metrics is not None and not isinstance(kv_cache_metrics, KVCacheMetricsCollector):
        raise InvalidArgumentError("kv_cache_metrics must be a KVCacheMetricsCollector (kvlab.blocks.events) "
                                   f"or None, got {type(kv_cache_metrics).__name__}")
    if hash_fn is not None and not callable(hash_fn):
        raise InvalidArgumentError("hash_fn must be callable as hash_fn(parent_hash_or_None, token_ids)")
    if plan_append is not None and not callable(plan_append):
        raise InvalidArgumentError("plan_append must be callable as plan_append(block_table, ref_counts, "
                                   "num_computed_tokens, num_tokens, block_size), or None")
    if plan_window_release is not None and not callable(plan_window_release):
        raise InvalidArgumentError("plan_window_release must be callable as plan_window_release(block_table, "
                                   "num_released, first_query, window, block_size), or None")
    sizes = _check_group_block_sizes(group_block_sizes, block_size, groups, use_eagle, kv_events)
    window_sizes = [size for size, spec in zip(sizes, groups or [spec_for(sliding_window)])
                    if spec.sliding_window is not None]
    unit = _check_prefix_match_unit(prefix_match_unit, block_size, window_sizes, num_offload_blocks or shared_tier,
                                    use_eagle)
    eviction = make_policy(eviction)
    log = EventLog() if record_events else None
    publisher = KVEventPublisher(block_size, groups) if kv_events else None  # vLLM's KV events, for routers
    sink = make_sink(log, publisher, kv_cache_metrics)
    first_block = NULL_BLOCK + 1 if sliding_window is not None else 0
    ids, num_groups = shared_tier.index.ids if shared_tier is not None else None, len(groups) if groups else 1
    # one namespace per KV cache group; partial-block entries only with a unit finer than the block
    partial_hits = prefix_match_unit is not None and unit < max(sizes)
    index = UnitPrefixIndex(num_blocks, unit, sizes, ids, num_groups) if partial_hits else \
        PrefixIndex(num_blocks, ids, num_groups=num_groups)
    pool = BlockPool(num_blocks, eviction, first_block, sink, index)
    tier = shared_tier if shared_tier is not None else make_tier(num_offload_blocks, pool.index, offload_policy,
                                                                 offload_admission)
    if tier is not None:
        pool.tier = tier
        if shared_tier is None:  # a shared tier reports to no replica's sink
            tier.sink = sink
    return SharedParts(block_size, num_blocks, bool(enable_prefix_caching), hash_fn, pool, SwapSpace(num_cpu_blocks),
                       tier, num_blocks - first_block, int(watermark * num_blocks), sink,
                       log.events if record_events else None, publisher, unit, plan_append, plan_window_release,
                       sizes, partial_hits and bool(enable_prefix_caching))


def _check_group_block_sizes(sizes, block_size: int, groups, use_eagle, kv_events) -> tuple:
    """Each group's block size (None: ``block_size`` for every group), or InvalidArgumentError."""
    num_groups = len(groups) if groups else 1
    if sizes is None:
        return (block_size,) * num_groups
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise InvalidArgumentError(f"group_block_sizes must be a list of block sizes, one per group, got {sizes!r}")
    sizes = tuple(check_block_size(size) for size in sizes)
    if not groups or len(sizes) != num_groups or any(size % block_size for size in sizes):
        raise InvalidArgumentError(f"group_block_sizes needs groups=[...] and one block size per group, each a "
                                   f"multiple of block_size {block_size} (the sequences' blocks, at which prompts are "
                                   f"hashed); got {list(sizes)} for {num_groups} group(s)")
    if len(set(sizes)) > 1 and (use_eagle or kv_events):
        # EAGLE drops the hit's last block (whose?), and a KV event names one block size: refused, not guessed.
        raise InvalidArgumentError(f"groups of different block sizes ({list(sizes)}) do not combine with use_eagle "
                                   f"or kv_events yet; got use_eagle={use_eagle!r}, kv_events={kv_events!r}")
    return sizes


def _check_prefix_match_unit(unit, block_size: int, window_sizes, offload, use_eagle) -> int:
    """The unit of prefix matching (None: the block size), or InvalidArgumentError."""
    if unit is None:
        return block_size
    unit = check_int("prefix_match_unit", unit, 1, block_size)
    if block_size % unit:
        raise InvalidArgumentError(f"prefix_match_unit must divide block_size {block_size}, got {unit}")
    if unit < block_size and (offload or use_eagle) or any(size > unit for size in window_sizes):
        # A window's released blocks, the tier's slots and EAGLE's dropped last block would each need their own
        # rule for a partial block; refused rather than half-supported. (A window group whose blocks are one unit
        # has no partial block.)
        raise InvalidArgumentError(f"prefix_match_unit={unit} (finer than the block) does not combine with a sliding "
                                   "window whose blocks are larger than the unit, an offload tier or use_eagle yet; "
                                   f"got sliding-window block sizes {window_sizes}, offload tier={bool(offload)}, "
                                   f"use_eagle={use_eagle!r}")
    return unit


def admission(live_blocks: int, needed_free: int, num_free: int, usable: int, watermark_blocks: int) -> AllocStatus:
    """The watermark rule of ``can_allocate``: a prompt that holds ``live_blocks`` blocks at once, ``needed_free``
    of them taken now from the ``num_free`` free blocks of a pool whose sequences hold at most ``usable`` blocks,
    ``watermark_blocks`` of them kept free at admission: OK (the watermark stays free), LATER (once others leave)
    or NEVER (not even an empty pool takes it). The engine grades a learner's ``can_allocate`` by it
    (``kvlab.engine.parts``)."""
    if live_blocks > usable - watermark_blocks:
        return AllocStatus.NEVER
    return AllocStatus.OK if num_free - needed_free >= watermark_blocks else AllocStatus.LATER


def serialized(cls):
    """Make every public method ``cls`` defines hold ``self._lock`` (re-entrant: public methods call each other);
    the outermost call delivers the KV events it queued once its whole change is made, outside the lock."""
    def locked(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if self.kv_events is None:  # no KV events to deliver after the change: holding the lock is all
                with self._lock:
                    return method(self, *args, **kwargs)
            outermost = False
            try:
                with self._lock:
                    self._depth += 1  # public calls this thread is inside (the lock is re-entrant)
                    try:
                        return method(self, *args, **kwargs)
                    finally:
                        self._depth -= 1
                        outermost = not self._depth
            finally:
                if outermost and self._kv_queue:
                    self.kv_events.deliver()
        return call
    for name, member in list(vars(cls).items()):
        if callable(member) and not name.startswith("_"):
            setattr(cls, name, locked(member))
    return cls


@serialized
class KVCacheManager:
    """``KVCacheManager(num_blocks, block_size=16, *, sliding_window=None, ...)``: one KV cache group (full
    attention, or a sliding window of ``sliding_window`` tokens); with ``groups=[spec, ...]`` one group per spec
    (vLLM V1's hybrid allocator: no offload tier, cross-attention tables or residency metrics yet). Its calls
    return what they did; whoever schedules a sequence writes its progress from those values (the engine's
    scheduler: ``Sequence.start_running``, ``scheduled_through``, ``stopped``; ``BlockManager`` does it itself).
    ``plan_append`` and ``plan_window_release``: None (kvlab's rules), or the course's seams for a learner's
    (``kvlab.engine.parts``): ``plan_append(table, ref, num_computed_tokens, num_tokens, block_size)`` returns the
    indices of the table's entries a step copies before writing and the number of blocks it appends;
    ``plan_window_release(table, num_released, first_query, window, block_size)`` a sliding-window group's
    ``num_released`` after the step (its table entries before that index go back to the pool);
    ``order_tier``: None, or the course's seam for a learner's ``tier_promotion`` (an LRU offload tier only):
    after each admission ``order_tier(tier, num_slots, num_tokens, block_size, prompt_hashes, num_gpu_hits,
    overwritten, promoted, after)`` (the tier's hashes before it, least recently used first; the prompt's
    block hashes; the hashes the new blocks held, None for none; the hashes promoted; the tier's hashes after
    it) returns the hashes in the order the tier then keeps, which decides its later victims."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, num_cpu_blocks: int = 0, watermark: float = 0.0,
                 enable_prefix_caching: bool = True, sliding_window: Optional[int] = None, hash_fn=None,
                 eviction="lru", record_events: bool = False, kv_events: bool = False, num_offload_blocks: int = 0,
                 offload_policy: str = "lru", offload_admission: str = "always",
                 kv_cache_metrics: Optional[KVCacheMetricsCollector] = None, shared_tier=None,
                 use_eagle: bool = False, prefix_match_unit: Optional[int] = None, groups=None, plan_append=None,
                 plan_window_release=None, order_tier=None, group_block_sizes=None):
        if order_tier is not None and (not callable(order_tier) or offload_policy != "lru" or not num_offload_blocks):
            raise InvalidArgumentError(f"order_tier (a learner's tier_promotion) needs an offload tier of its own "
                                       f"(num_offload_blocks > 0) with offload_policy='lru', and must be callable; got "
                                       f"a {type(order_tier).__name__}, num_offload_blocks={num_offload_blocks!r}, "
                                       f"offload_policy={offload_policy!r}")
        if groups is not None:
            if (sliding_window is not None or num_offload_blocks or shared_tier is not None
                    or kv_cache_metrics is not None):
                raise InvalidArgumentError(
                    "with groups=, each group's spec carries its window, and there is no offload tier or residency "
                    f"metrics yet; got sliding_window={sliding_window!r}, num_offload_blocks={num_offload_blocks!r}, "
                    f"shared_tier={shared_tier!r}, kv_cache_metrics={kv_cache_metrics!r}")
            specs = check_group_specs(groups)
            sliding_window = next((spec.sliding_window for spec in specs if spec.sliding_window is not None), None)
        parts = _shared_parts(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                              enable_prefix_caching=enable_prefix_caching, sliding_window=sliding_window,
                              hash_fn=hash_fn, eviction=eviction, record_events=record_events, kv_events=kv_events,
                              groups=None if groups is None else specs, num_offload_blocks=num_offload_blocks,
                              offload_policy=offload_policy, offload_admission=offload_admission,
                              kv_cache_metrics=kv_cache_metrics, shared_tier=shared_tier,
                              prefix_match_unit=prefix_match_unit, use_eagle=use_eagle, plan_append=plan_append,
                              plan_window_release=plan_window_release, group_block_sizes=group_block_sizes)
        self._setup(parts, [spec_for(sliding_window)] if groups is None else specs, use_eagle)
        if order_tier is not None:  # the course's seam wraps allocate: kvlab's own path stays as it is
            self._order_tier, self._allocate_unordered = order_tier, self.allocate
            self.allocate = self._allocate_ordered
        self.kv_cache_metrics = kv_cache_metrics  # residency metrics (kvlab.blocks.events), or None

    def _setup(self, parts: SharedParts, specs, use_eagle) -> None:
        if not isinstance(use_eagle, bool):
            raise InvalidArgumentError(f"use_eagle must be True or False, got {use_eagle!r}")
        # vLLM's use_eagle: an EAGLE/MTP drafter needs the target's hidden states at the hit's last block, so
        # every hit gives its last block up to be recomputed (vLLM's find_longest_cache_hit pops it).
        self.use_eagle = use_eagle
        self.block_size, self.num_blocks = parts.block_size, parts.num_blocks
        self.enable_prefix_caching, self.hash_fn = parts.enable_prefix_caching, parts.hash_fn
        self.events, self.kv_events = parts.events, parts.kv_events
        self.sliding_window = specs[0].sliding_window if len(specs) == 1 else None
        self.stats = PrefixCacheStats()  # allocate's lookups, cumulative (the hit every group serves)
        self._stats_mark = PrefixCacheStats()  # a copy of ``stats`` at the last make_prefix_cache_stats()
        self._pool, self._swap, self._tier, self._sink = parts.pool, parts.swap, parts.tier, parts.sink
        self._usable, self._watermark_blocks = parts.usable, parts.watermark_blocks
        # The prefix indexes a hit comes from: an eviction from either (its generation moves) may make it stale.
        self._indexes = (self._pool.index,) if self._tier is None else (self._pool.index, self._tier.index)
        several = len(specs) > 1  # then each group's reports carry its group
        self._groups = [GroupManager(spec, g, parts, GroupSink(parts.sink, g) if several and parts.sink else
                                     parts.sink) for g, spec in enumerate(specs)]
        self._cross: dict = {}  # root Sequence -> its request group's CrossTable (encoder-decoder, one group only)
        self._lock, self._depth = threading.RLock(), 0
        self._kv_queue = parts.kv_events.queue if parts.kv_events is not None else ()
        # prefix_match_unit (vLLM's hash_block_size): with a unit finer than the block, lookups also find a
        # partial block. Decided once here, so the whole-block manager's calls run exactly as without it.
        self.prefix_match_unit = parts.prefix_match_unit
        self._units = parts.partial_hits
        # Groups of different block sizes (vLLM's hybrid allocator with a hash_block_size): each group's blocks are
        # merged from the sequence's, and the hit every group serves is looked up by ``_lookup_mixed``.
        self.group_block_sizes = parts.group_block_sizes
        self._mixed = len(set(parts.group_block_sizes)) > 1
        if self._mixed:
            self.lookup = self._lookup_mixed
        elif self._units:
            self.lookup = self._lookup_units

    # ---- the prefix lookup ------------------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> PrefixHit:
        """The prompt's cached prefix, once per group: its first full blocks each group holds (then the offload
        tier's), cut to the hit every group serves, at most all but the last token (always computed); one block
        less with ``use_eagle``. Pure."""
        if not isinstance(seq, Sequence) or seq.block_size != self.block_size:
            self._check_block_size(check_sequence(seq))
        if seq.token_array is None:
            raise SequenceStateError(f"sequence {seq.seq_id} is a decode-only copy without its tokens")
        groups = self._groups
        if not self.enable_prefix_caching or not seq.num_tokens:
            return PrefixHit(seq.seq_id, 0, [], [], tuple([] for _ in groups), ((),) * len(groups), (), (),
                             tuple(map(_generation, self._indexes)))
        hashes, contents = prompt_blocks(seq, self.block_size, self.hash_fn)
        limit = (seq.num_tokens - 1) // self.block_size
        found = []
        for group in groups:  # each lookup is prefix-closed, so cutting at the last group's hit is the common hit
            hits, tier_hits = group.find_hits(hashes, contents, limit)
            found.append(hits)
            limit = len(hits) + len(tier_hits)
        cut, eagle = len(found[0]) - limit if len(groups) > 1 else 0, 0
        if self.use_eagle and limit:  # the last hit block is recomputed (see _setup)
            limit, eagle = limit - 1, 1
            if tier_hits:
                tier_hits = tier_hits[:-1]
            else:
                found[0] = found[0][:limit]
        hits = tuple(group_hits[:limit] for group_hits in found) if len(groups) > 1 else (found[0],)
        held = self._pool.index.content.__getitem__
        content_ids = []
        for group_hits in hits:
            content_ids.append(tuple(map(held, group_hits)))
        bs = self.block_size
        return PrefixHit(seq.seq_id, limit * bs, hashes, contents, hits, tuple(content_ids), tier_hits,
                         tuple(self._tier.index.content[slot] for slot in tier_hits) if tier_hits else (),
                         tuple(map(_generation, self._indexes)), 0, cut * bs, eagle * bs)

    def _lookup_units(self, seq: Sequence) -> PrefixHit:
        """``lookup`` with a ``prefix_match_unit`` finer than the block: the whole-block hit, then the most whole
        units of the next block that a block of every group starts with (fewer than a block's, and never the
        prompt's last token)."""
        with self._lock:
            hit = KVCacheManager.lookup(self, seq)
            unit, first = self.prefix_match_unit, hit.num_tokens
            max_units = min((seq.num_tokens - 1 - first) // unit, self.block_size // unit - 1)
            if max_units <= 0 or hit.num_cut_tokens:
                return hit
            index, parents, suffix, token_bytes = self._pool.index, *self._partial_query(seq, hit, max_units * unit)
            chains = {parent: index.unit_chain(parent, suffix, token_bytes) for parent in set(parents)}
            units = max_units
            while units:  # each group's longest, cut to the least until every group serves the same units
                found = [index.find_partial(g, parent, suffix, token_bytes, chains[parent], units)
                         for g, parent in enumerate(parents)]
                least = min(k for k, _ in found)
                if least == units:
                    # the same hit, its tokens counting the units, then the partial fields (the last two)
                    return PrefixHit(hit.seq_id, first + units * unit, *hit[2:-2], tuple(slot for _, slot in found),
                                     units * unit)
                units = least
            return hit

    def _lookup_mixed(self, seq: Sequence) -> PrefixHit:
        """``lookup`` when the groups' block sizes differ: each group's cached blocks under its own block size,
        then the longest prefix every group serves. With whole blocks only, that is a multiple of every group's
        block size (as vLLM aligns a hybrid hit to their least common multiple); with a ``prefix_match_unit``,
        any whole number of units: a group whose block the hit cuts gets a new one, and the first units are
        copied into it from the group's own cached block or from a block whose first units a prompt wrote. At
        most all but the last token. Pure."""
        with self._lock:
            if not isinstance(seq, Sequence) or seq.block_size != self.block_size:
                self._check_block_size(check_sequence(seq))
            if not self.enable_prefix_caching or not seq.num_tokens or seq.token_array is None:
                return KVCacheManager.lookup(self, seq)  # the empty hit, or the error
            groups, n = self._groups, seq.num_tokens
            hashes, contents = prompt_blocks(seq, self.block_size, self.hash_fn)
            found = [group.find_hits(*group.own_blocks(hashes, contents), (n - 1) // group.block_size)[0]
                     for group in groups]
            unit = self.prefix_match_unit if self._units else 1
            limit, queries = (n - 1) // unit * unit, {}
            while True:  # every group's lookup is prefix-closed: cut to the least until all serve the same
                served = [self._served(seq, group, hits, limit, queries) for group, hits in zip(groups, found)]
                least = min(tokens for tokens, _ in served)
                if least == limit:
                    break
                limit = least
            hits = tuple(group_hits[:limit // group.block_size] for group, group_hits in zip(groups, found))
            partial = tuple(slot for _, slot in served)
            held = self._pool.index.content.__getitem__
            first = groups[0].block_size
            return PrefixHit(seq.seq_id, limit, hashes, contents, hits,
                             tuple(tuple(map(held, group_hits)) for group_hits in hits), (), (),
                             tuple(map(_generation, self._indexes)), 0, max(0, len(found[0]) * first - limit), 0,
                             partial if any(slot is not None for slot in partial) else (),
                             limit - len(hits[0]) * first)

    def _served(self, seq, group, hits: list, limit: int, queries: dict) -> tuple[int, Optional[int]]:
        """(the most tokens up to ``limit`` that ``group``, holding the prompt's first blocks in ``hits``, serves;
        the block its partial block's units are copied from, or None). ``queries`` keeps each group's partial
        query (its units' chain) for the next call."""
        bs = group.block_size
        if limit <= len(hits) * bs:
            if limit % bs and self._units:  # the first units of a block the group holds whole
                return limit, hits[limit // bs]
            return limit // bs * bs, None
        whole, unit, index = len(hits) * bs, self.prefix_match_unit, self._pool.index
        if not self._units or bs == unit:
            return whole, None
        query = queries.get(group.group)
        if query is None:  # the block after the hits: its keys, and its units up to all but the last token
            most = min((seq.num_tokens - 1 - whole) // unit, bs // unit - 1) * unit
            parent = index.content[hits[-1]] if hits else ROOT
            suffix = group.own_keys(seq.key_bytes, len(hits))
            token_bytes = memoryview(seq.token_array)[whole:whole + most].tobytes()
            query = queries[group.group] = parent, suffix, token_bytes, index.unit_chain(parent, suffix, token_bytes)
        units, slot = index.find_partial(group.group, *query, min((limit - whole) // unit, len(query[3])))
        return whole + units * unit, slot

    def _partial_query(self, seq, hit, num_tokens: int) -> tuple[list, bytes, bytes]:
        """(each group's content id before the block after ``hit``'s whole blocks, that block's keys' bytes, its
        first ``num_tokens`` tokens' bytes): what a partial entry of that block is matched against."""
        first = len(hit.hits[0]) * self.block_size
        parents = [self._pool.index.content[hits[-1]] if hits else ROOT for hits in hit.hits]
        keys = seq.key_bytes
        suffix = keys.get(first // self.block_size, b"") if keys else b""
        return parents, suffix, memoryview(seq.token_array)[first:first + num_tokens].tobytes()

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s leading full blocks the prefix cache (every group's, and the offload tier) holds
        now: ``lookup(seq).num_tokens``. For allocated and waiting sequences."""
        return self.lookup(seq).num_tokens

    # ---- admission and allocation -----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_lookahead_slots: int = 0, encoder_seq=None, *,
                     num_new_tokens: Optional[int] = None, hit: Optional[PrefixHit] = None) -> AllocStatus:
        """Whether ``allocate(seq, encoder_seq, num_new_tokens=..., hit=...)`` (plus ``num_lookahead_slots``
        later) fits, every group's blocks counted. A hit on a block in use costs nothing; a hit on a free cached
        block takes it out of the free pool. OK and LATER are about this step (keeping the watermark free);
        NEVER: the prompt can never be finished here, however it is chunked. ``hit``: ``lookup(seq)``'s
        answer (None: looked up here)."""
        lookahead = num_lookahead_slots
        if lookahead.__class__ is not int or lookahead < 0:
            lookahead = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        hit, plans, _, _, needed = self._plan_admission(seq, hit, lookahead, num_new_tokens)
        cross = self._cross_blocks(seq, encoder_seq) if encoder_seq is not None or self._cross else 0
        bounds = self._pool.num_free, self._usable, self._watermark_blocks
        return admission(sum(map(_peak_blocks, plans)) + cross, needed + cross, *bounds)

    def allocate(self, seq: Sequence, encoder_seq: Optional[Sequence] = None, *, num_new_tokens: Optional[int] = None,
                 hit: Optional[PrefixHit] = None) -> Admitted:
        """Give the prompt its blocks in every group, sharing the longest prefix every group has cached
        (``hit``: ``lookup(seq)``'s answer, None: looked up here). With ``num_new_tokens=k`` only the hits and
        the next k prompt tokens get slots; ``append_slots`` schedules the rest later. With ``encoder_seq`` (an
        encoder-decoder request, one group only) also a cross-attention table for the encoder's tokens, shared
        by the sequence's future forks. Atomic: raises before changing anything if the blocks are not there,
        or if the prompt could never be finished in this pool."""
        hit, plans, pins, revived, needed = self._plan_admission(seq, hit, 0, num_new_tokens)
        num_cross = self._cross_blocks(seq, encoder_seq) if encoder_seq is not None or self._cross else 0
        pool, several = self._pool, len(plans) > 1
        peak_blocks = sum(map(_peak_blocks, plans)) + num_cross
        if needed + num_cross > pool.num_free or peak_blocks > self._usable:
            self._refuse(seq, needed + num_cross, peak_blocks, len(plans))
        # Out-of-window hits and partial sources nobody holds go back to the free set, still cached, once the
        # groups hold their live hits.
        unpinned = [block for plan in plans for block in plan.hits[:plan.first_live] if not pool.ref[block]] + \
            [block for block in hit.partial if block is not None and not pool.ref[block]] if several else ()
        with pool.transaction() as txn:  # every group's policy calls first: if one raises, nothing changed
            txn.revive(revived)
            taken = []
            for plan in plans:  # the encoder's table comes with the first group's blocks (one group has one)
                taken.append(txn.pop(plan.num_new + (num_cross if not taken else 0)))
                if pool.hit_listener is not None:
                    txn.hits(plan.hits)
            if unpinned:
                txn.add(unpinned, [pool.index.warm[block] for block in unpinned])
        if several:  # pinned while the groups take their blocks: one group's new blocks never evict another's hit
            pool.claim(pins, len(revived))
        cross = None
        if num_cross or self._cross:
            cross_blocks = taken[0][plans[0].num_new:]
            taken[0] = taken[0][:plans[0].num_new]
            cross = self._attach_cross(seq, encoder_seq, cross_blocks)
        for group, plan, blocks in zip(self._groups, plans, taken):
            group.admit(seq, plan, hit.hashes, hit.contents, blocks, 0 if several else len(revived), cross)
        if several:
            pool.drop(pins, unpinned)  # the groups hold their live hits now
        recomputing = seq.num_preemptions > 0  # its own blocks again: not prefix hits (PrefixCacheStats)
        if self._tier is not None:
            self._tier.looked_up(seq.num_tokens, hit.hashes, len(plans[0].hits), len(hit.tier_hits),
                                 self.block_size, counted=not recomputing)
        if self.enable_prefix_caching:
            self.stats.count_lookup(seq.num_tokens, len(hit.hashes) // self._groups[0].span, len(plans[0].hits),
                                    self._groups[0].block_size, recomputing, hit.num_partial_tokens)  # its blocks
        seq.allocation = self._groups[0].records[seq.seq_id]
        return Admitted(hit.num_tokens, tuple(taken), self._tier.take_moves() if self._tier else [],
                        plans[0].scheduled, hit.partial)

    def _allocate_ordered(self, seq: Sequence, encoder_seq: Optional[Sequence] = None, *,
                          num_new_tokens: Optional[int] = None, hit: Optional[PrefixHit] = None) -> Admitted:
        """``allocate``, then the tier's order by ``order_tier`` on the admission's numbers (see the class
        docstring)."""
        tier = self._tier
        hit = self.lookup(seq) if hit is None else hit
        # What the tier and the blocks held before: the admission reuses slots and blocks.
        before, promoted = tier.order.resident(), [tier.index.hash[slot] for slot in hit.tier_hits]
        held = {block: block_hash for block_hash, block in self._pool.index.cached.items()}
        admitted = self._allocate_unordered(seq, encoder_seq, num_new_tokens=num_new_tokens, hit=hit)
        overwritten = [held.get(block) for block in admitted.new_blocks[0]]
        tier.order.reorder(self._order_tier(before, tier.num_slots, seq.num_tokens, self.block_size,
                                            list(hit.hashes), len(hit.hits[0]), overwritten, promoted,
                                            tier.order.resident()))
        return admitted

    def _plan_admission(self, seq, hit, lookahead, num_new_tokens) -> tuple:
        """(the hit, each group's plan to admit ``seq`` with it, the hits allocate pins while the groups take their
        new blocks, the free ones among them, the free blocks allocate takes). ``seq`` must be unallocated, and
        ``hit`` None for a new lookup, or ``seq``'s, every block in it still holding what it held when looked up,
        else InvalidArgumentError (a hit goes stale once a block of it is evicted). Pure.

        With several groups all hits are pinned, a window group's out-of-window ones too: were one evicted by
        another group's new blocks, that group's chain would break. One group pins nothing: its live hits are its
        own to claim (the free ones revived) and its plan counted the free blocks it takes."""
        if (seq.__class__ is not Sequence or seq.allocation is not None or seq.block_size != self.block_size
                or not seq.num_tokens or seq.token_array is None):
            self._check_unallocated(seq)
        if hit is None:
            hit = self.lookup(seq)
        elif not isinstance(hit, PrefixHit) or hit.seq_id != seq.seq_id or len(hit.hits) != len(self._groups):
            raise InvalidArgumentError(f"hit must be this manager's lookup(seq) of sequence {seq.seq_id}, got {hit!r}")
        elif hit.generations != tuple(map(_generation, self._indexes)) or (
                self.enable_prefix_caching and len(hit.hashes) != seq.num_tokens // self.block_size):
            self._check_fresh(seq, hit)  # something was evicted since the lookup, or the sequence grew
        ref, plans = self._pool.ref, []
        for group, hits in zip(self._groups, hit.hits):
            plans.append(group.plan_admission(seq, hits, hit, lookahead, num_new_tokens))
        if len(plans) == 1:
            plan = plans[0]
            return hit, plans, (), list(filterfalse(ref.__getitem__, plan.hits[plan.first_live:])), plan.needed_free
        # A partial hit's source blocks are pinned too: were one group's source handed to another group as a new
        # block, the copies would read a block they also write (the copy kernels refuse a block that is both).
        pins = [block for plan in plans for block in plan.hits] + [block for block in hit.partial if block is not None]
        revived = [block for block in pins if not ref[block]]
        fresh = sum(plan.live_blocks - len(plan.hits) + plan.first_live for plan in plans)
        return hit, plans, pins, revived, fresh + len(revived)

    def _check_fresh(self, seq, hit) -> None:
        """InvalidArgumentError unless every block of ``hit`` still holds what it held when looked up."""
        stale = self.enable_prefix_caching and len(hit.hashes) != seq.num_tokens // self.block_size
        held = self._pool.index.content.__getitem__
        for blocks, content_ids in zip(hit.hits, hit.content_ids):
            stale = stale or tuple(map(held, blocks)) != content_ids
        if hit.tier_hits:
            stale = stale or tuple(map(self._tier.index.content.__getitem__, hit.tier_hits)) != hit.tier_content_ids
        if self._mixed and not stale:  # groups of different block sizes: the partial blocks looked up again
            fresh = self.lookup(seq)
            stale = (fresh.num_tokens, fresh.hits, fresh.partial) != (hit.num_tokens, hit.hits, hit.partial)
        elif hit.num_partial_tokens and not stale:
            parents, suffix, token_bytes = self._partial_query(seq, hit, hit.num_partial_tokens)
            index = self._pool.index
            stale = not all(index.holds(slot, g, parent, suffix, token_bytes)
                            for g, (slot, parent) in enumerate(zip(hit.partial, parents)))
        if stale:
            raise InvalidArgumentError(f"the prefix hit of sequence {seq.seq_id} is stale (a block of it was evicted, "
                                       "or the sequence grew since): look it up again")

    def _refuse(self, seq, needed_free: int, peak_blocks: int, num_groups: int) -> None:
        """Say why ``allocate`` does not fit: too few free blocks now, or more blocks at once than the pool has."""
        pool = self._pool
        across = f" across {num_groups} groups" if num_groups > 1 else ""
        if needed_free > pool.num_free:
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed_free} free blocks{across}, "
                                   f"{pool.num_free} are free (check can_allocate first)")
        if peak_blocks > self._usable:  # a first chunk that fits, of a prompt that never can
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {peak_blocks} blocks at once{across} to finish "
                                   f"its prompt, the pool has {self._usable} (check can_allocate first)")

    # ---- a step's growth and its verification ------------------------------------------------------------
    def can_append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *,
                         num_new_tokens: Optional[int] = None, num_draft_tokens: int = 0) -> bool:
        """Whether ``append_slots`` with the same arguments fits now (a running sequence: no watermark)."""
        steps = self._plan_steps(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        return sum(plan.blocks_needed - len(plan.freed) for _, plan, _ in steps) <= self._pool.num_free

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *, num_new_tokens: Optional[int] = None,
                     num_draft_tokens: int = 0) -> BlockCopies:
        """Schedule a step in every group: release the blocks that left a sliding window, give slots to the
        next ``num_new_tokens`` tokens without one (None: all of them), then to ``num_draft_tokens`` proposed
        tokens after the last one (verified by this step's pass, then ``accept_drafts``) and to
        ``num_lookahead_slots`` more, and seal the blocks whose last token is now scheduled, drafts aside. A
        shared block about to be written is copied first: returns those copy-on-write (src, dst) pairs."""
        steps = self._plan_steps(seq, num_lookahead_slots, num_new_tokens, num_draft_tokens)
        if self._units:  # the earlier steps ran: their prompt units may be found now
            for group in self._groups:
                group.index_units(seq)
        needs, pool = [plan.blocks_needed - len(plan.freed) for _, plan, _ in steps], self._pool
        if sum(needs) > pool.num_free:  # the blocks the step releases count as free
            across = " across its groups" if len(steps) > 1 else ""
            needed = sum(plan.blocks_needed for _, plan, _ in steps)
            raise OutOfBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks{across}, "
                                   f"{pool.num_free + needed - sum(needs)} are free (check can_append_slots first)")
        seals = [group.hashes_to_seal(step) for group, step in zip(self._groups, steps)]
        # Groups that release more than they take go first: then each group finds room when its turn comes.
        order = sorted(range(len(steps)), key=needs.__getitem__) if len(steps) > 1 else (0,)
        taken = [None] * len(steps)
        with pool.transaction() as txn:
            for g in order:
                plan = steps[g][1]
                txn.add(plan.freed, plan.freed_cached)
                taken[g] = txn.pop(plan.blocks_needed)
        pairs = [None] * len(steps)
        for g in order:
            pairs[g] = self._groups[g].apply_step(steps[g], num_lookahead_slots, taken[g], seals[g])
        copies = self._copies(pairs)
        copies.num_computed_tokens = steps[0][1].scheduled
        return copies

    def _plan_steps(self, seq, lookahead, num_new_tokens, num_drafts):
        check_int("num_lookahead_slots", lookahead, 0)
        check_int("num_draft_tokens", num_drafts, 0)
        self._gpu_record(seq)
        if seq.num_draft_tokens:
            raise SequenceStateError(f"sequence {seq.seq_id} has {seq.num_draft_tokens} draft tokens in flight: "
                                     "accept_drafts(seq, num_accepted) before its next step")
        return [group.plan_step(seq, lookahead, num_new_tokens, num_drafts) for group in self._groups]

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> int:
        """The step that scheduled ``seq``'s draft tokens ran and its first ``num_accepted`` drafts were accepted
        (0: all rejected); append those tokens first. Their K/V stays where the pass wrote it and the blocks they
        complete are sealed. Returns the positions verified now: ``seq.num_computed_tokens`` rolls back to it,
        past the rejected drafts, whose slots the next step overwrites."""
        self._gpu_record(seq)
        drafts = seq.num_draft_tokens
        if not drafts:
            raise SequenceStateError(f"sequence {seq.seq_id} has no draft tokens to verify")
        accepted = check_int("num_accepted", num_accepted, 0, drafts)
        verified = seq.num_computed_tokens - drafts + accepted
        if verified > seq.num_tokens:
            raise InvalidArgumentError(f"sequence {seq.seq_id} has {seq.num_tokens} tokens, but accepting "
                                       f"{accepted} drafts makes {verified} positions verified: append the "
                                       "accepted tokens first")
        plans = [group.plan_accept(seq, verified) for group in self._groups]  # every group hashes first
        for group, (alloc, seals) in zip(self._groups, plans):
            group.accept(alloc, seals)
        return verified

    # ---- free and fork -----------------------------------------------------------------------------------
    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        """Drop the sequence's references in every group, tail block first (so LRU reuses the chain's tail
        first): it finished, or (``preempted=True``) it is to be recomputed later (``seq.stopped(preempted)``
        says so). A cross-attention table stays with its request group until ``free_cross``."""
        self._record(seq)
        if self._units:  # its steps ran: its prompt units stay findable once its blocks are free
            for group in self._groups:
                group.index_units(seq, leaving=True)
        releases = [group.plan_release(seq) for group in self._groups]
        with self._pool.transaction() as txn:
            for _, _, freed, cached in releases:
                txn.add(freed, cached)
        for group, (alloc, live, freed, _) in zip(self._groups, releases):
            group.release(alloc, live, freed)
        seq.allocation = None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give the new ``child`` the parent's tokens (and block size, salt and keys) and share all its blocks,
        in every group: nothing is allocated; a later append into a shared partial block copies it. Whatever
        tokens and keys the child had are replaced (``Sequence([])`` is the usual child). A parent's drafts in
        flight are the child's too, and each verifies them on its own."""
        self._gpu_record(parent)
        self._check_unallocated(child, need_tokens=False, same_block_size=False)
        child.block_size = parent.block_size
        copy_tokens(parent, child)
        for group in self._groups:
            group.fork(parent, child)
        child.allocation = self._groups[0].records[child.seq_id]

    # ---- swapping (vLLM V0's preemption) ------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> AllocStatus:
        """Whether ``swap_out(seq)`` fits in the CPU pool now (OK), once swapped sequences leave it (LATER), or
        never (NEVER)."""
        return self._swap.admission(self._cpu_blocks_needed(self._moving_out(seq)))

    def swap_out(self, seq: Sequence) -> BlockCopies:
        """Move the sequence's blocks in every group (and its request group's cross-attention blocks, if it is
        the last one on the GPU) to the CPU pool; returns the (gpu, cpu) copies to make. A block shared with a
        sequence swapped out earlier is not copied again."""
        moving = self._moving_out(seq)
        if self._cpu_blocks_needed(moving) > self._swap.num_free:
            raise OutOfBlocksError(f"not enough free CPU blocks to swap out sequence {seq.seq_id}")
        released = [self._pool.freed_by(blocks) for _, (blocks, _) in moving]
        with self._pool.transaction() as txn:
            for freed, cached in released:
                txn.add(freed, cached)
        pairs = [group.moved_out(alloc, group_moving, freed)
                 for group, (alloc, group_moving), (freed, _) in zip(self._groups, moving, released)]
        return self._copies(pairs)

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        return self._admission(*map(sum, zip(*self._swap_in_needs(seq))))

    def swap_in(self, seq: Sequence) -> BlockCopies:
        """Bring a swapped sequence back in every group (with its request group's cross-attention blocks if
        they are on the CPU); returns the (cpu, gpu) copies to make. Swapped-in blocks are not re-registered in
        the prefix cache."""
        needs = self._swap_in_needs(seq)
        if self._admission(*map(sum, zip(*needs))) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        with self._pool.transaction() as txn:
            new_blocks = [txn.pop(fresh) for _, fresh in needs]
        pairs = [group.moved_in(seq, blocks) for group, blocks in zip(self._groups, new_blocks)]
        return self._copies(pairs)

    def _moving_out(self, seq):
        self._gpu_record(seq)
        return [group.moving_out(seq) for group in self._groups]

    def _cpu_blocks_needed(self, moving) -> int:
        return sum(self._swap.blocks_needed_out(blocks) for _, (blocks, _) in moving)

    def _swap_in_needs(self, seq):
        self._record(seq)
        return [group.swap_in_needs(seq) for group in self._groups]

    def touch(self, seq: Sequence, now: float) -> None:
        """``seq``'s blocks were used at time ``now``: an eviction policy that orders by use (``on_access``)
        hears of each (vLLM V1's ``BlockPool.touch``; V0's ``access_all_blocks_in_seq``)."""
        now = check_number("now", now)
        blocks = [block for group in self._groups for block in group.gpu_record(seq).live_blocks()]
        with self._pool.transaction() as txn:
            txn.access(blocks, now)

    # ---- encoder-decoder cross-attention tables (one group only) --------------------------------------------
    def get_cross_block_table(self, seq: Sequence) -> tuple:
        """The encoder's blocks of ``seq``'s request group (CPU ids while swapped out), for any member or its
        root (the sequence allocated with ``encoder_seq``)."""
        return tuple(self._cross_table_of(seq).blocks)

    def free_cross(self, seq: Sequence) -> None:
        """Free the cross-attention table of ``seq``'s request group (call it with any live member, or with the
        sequence allocated with the encoder, even after it was freed); its members keep running without it."""
        table = self._cross_table_of(seq)
        if table.on_cpu:
            self._swap.release(table.blocks)
        else:
            self._swap.forget_gpu(self._pool.release(table.blocks))
        del self._cross[table.root]
        for alloc in table.members:
            alloc.cross = None
        table.members.clear()

    def _cross_blocks(self, seq, encoder_seq) -> int:
        """New blocks ``allocate(seq, encoder_seq)`` takes for a cross table (raises if the call is not valid)."""
        existing = self._cross.get(seq)
        if encoder_seq is None:
            if existing is not None and existing.on_cpu:
                raise SequenceStateError(f"sequence {seq.seq_id}'s cross-attention blocks are swapped out with "
                                         "no sequence to bring them back: free_cross, then allocate it again "
                                         "with its encoder sequence")
            return 0
        if len(self._groups) > 1:
            raise InvalidArgumentError("a hybrid manager has no encoder-decoder cross-attention tables: "
                                       "encoder_seq must be None")
        check_sequence(encoder_seq)
        if existing is not None:
            raise SequenceStateError(f"sequence {seq.seq_id} already has a cross-attention table (reallocating "
                                     "reattaches it): pass no encoder_seq, or free_cross first")
        if encoder_seq.block_size != self.block_size or encoder_seq.num_tokens == 0:
            raise InvalidArgumentError(f"encoder_seq must have tokens and block_size {self.block_size}, got "
                                       f"{encoder_seq.num_tokens} tokens, block_size {encoder_seq.block_size}")
        return -(-encoder_seq.num_tokens // self.block_size)

    def _attach_cross(self, seq, encoder_seq, blocks) -> Optional[CrossTable]:
        """The request group's table of a sequence being allocated: a new one of ``blocks`` (with
        ``encoder_seq``), the one it kept from before a recompute preemption, or None."""
        if encoder_seq is not None:
            self._pool.fill(blocks)
            self._cross[seq] = CrossTable(seq, list(blocks), encoder_seq.num_tokens)
        return self._cross.get(seq)

    def _cross_table_of(self, seq) -> CrossTable:
        check_sequence(seq)
        alloc = self._groups[0].records.get(seq.seq_id)
        table = alloc.cross if alloc is not None and alloc.seq is seq else self._cross.get(seq)
        if table is None:
            raise SequenceStateError(f"sequence {seq.seq_id} has no cross-attention table here (allocate its "
                                     "group with encoder_seq=...)")
        return table

    # ---- the pool every group draws from ------------------------------------------------------------------
    @property
    def groups(self) -> tuple:
        """Each KV cache group's attention spec (kvlab.blocks.kv_cache_groups), in group order."""
        return tuple(group.spec for group in self._groups)

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_evictions(self) -> int:
        """Cached prefixes dropped because their block was reused for new content."""
        return self._pool.evictions

    @property
    def num_cached_blocks(self) -> int:
        """Blocks a prefix lookup (of any group) can hit now (in use or free-but-warm)."""
        return self._pool.index.num_cached

    @property
    def tier_stats(self):
        """Hits per tier (GPU, offload tier, miss) in blocks and tokens: a ``TierHitStats``; None without a tier."""
        return self._tier.stats if self._tier is not None else None

    @property
    def num_offload_blocks(self) -> int:
        """Slots of the offload tier (a shared tier's, which other managers use too); 0 without one."""
        return self._tier.num_slots if self._tier is not None else 0

    @property
    def num_cpu_blocks(self) -> int:
        return self._swap.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._swap.num_free

    @property
    def usable_blocks(self) -> int:
        """The most blocks one sequence can hold at once, every group's together: the pool less the null block
        (reserved when there is a sliding window) and the watermark."""
        return self._usable - self._watermark_blocks

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref[check_int("block id", block_id, 0, self.num_blocks - 1)]

    def cpu_ref_count(self, block_id: int) -> int:
        """How many swapped-out table entries point at CPU block ``block_id``."""
        return self._swap.ref[check_int("CPU block id", block_id, 0, self._swap.num_blocks - 1)]

    def block_hash(self, block_id: int) -> Optional[int]:
        return self._pool.index.block_hash(check_int("block id", block_id, 0, self.num_blocks - 1))

    def is_cached(self, block_id: int) -> bool:
        """Whether a prefix lookup can hit this block now (it may be in use or free-but-warm)."""
        return self._pool.index.is_cached(check_int("block id", block_id, 0, self.num_blocks - 1))

    def free_block_ids(self) -> list[int]:
        """Free GPU blocks, in the order they will be reused."""
        return list(self._pool.policy)

    def blocks_for_prompt(self, num_tokens: int, num_new_tokens: Optional[int] = None) -> int:
        """Blocks a prompt of ``num_tokens`` tokens must hold at once, every group's together, when none of it
        is cached, its first step computing ``num_new_tokens`` tokens (None: all of them) and later steps the
        rest, however chunked. ``can_allocate`` says NEVER for such a prompt exactly when this is more than
        ``usable_blocks``."""
        n = check_int("num_tokens", num_tokens, 1)
        first = n if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1, n)
        return sum(max(-(-first // group.block_size), least_peak_blocks(first, n, group.block_size, group.spec, 0))
                   for group in self._groups)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache counters of this run: a ``PrefixCacheStats`` of the lookups since the last call (or
        since the manager was made or ``reset_prefix_cache``), then a new run starts (vLLM V1's
        ``KVCacheManager.make_prefix_cache_stats()``); ``stats`` stays cumulative."""
        run = self.stats.since(self._stats_mark)
        self._stats_mark = dataclasses.replace(self.stats)
        return run

    # ---- a sequence, in every group -------------------------------------------------------------------------
    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """A copy of each group's block table (CPU block ids while swapped out; the null block 0 where a
        sliding window released an entry)."""
        self._record(seq)
        return [list(group.records[seq.seq_id].table) for group in self._groups]

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Every group's table, group after group (one group: a copy of its table)."""
        return [block for table in self.block_tables(seq) for block in table]

    def slot_mappings(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """Each group's cache slots of positions start..end-1 (-1 where its window released the block)."""
        self._gpu_record(seq)
        return [group.slot_mapping(seq, start, end) for group in self._groups]

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot (block_id * block_size + offset) of positions start..end-1 of a one-group manager's
        sequence (-1 where the sliding window released the block); ``slot_mappings`` has every group's."""
        if len(self._groups) > 1:
            raise InvalidArgumentError("a hybrid manager has a slot mapping per group: call slot_mappings")
        return self.slot_mappings(seq, start, end)[0]

    def is_swapped(self, seq: Sequence) -> bool:
        """Whether an allocated sequence's blocks are in the CPU pool (its groups move together)."""
        return self._record(seq).on_cpu

    def num_released_blocks(self, seq: Sequence) -> int:
        """Table entries the sliding windows released, every group's together; 0 without a window."""
        return sum(self.num_released_blocks_per_group(seq))

    def num_released_blocks_per_group(self, seq: Sequence) -> list[int]:
        """Each group's released entries: the leading entries of its table that hold the null block 0 (read
        this, not the value 0, while ``seq`` is swapped out: CPU block 0 is a real block)."""
        self._record(seq)
        return [group.records[seq.seq_id].num_released for group in self._groups]

    def num_scheduled_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens have slots (vLLM V1's ``request.num_computed_tokens``):
        ``seq.num_computed_tokens``, for a sequence allocated here."""
        self._record(seq)
        return seq.num_computed_tokens

    # ---- maintenance ------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (every group's, and the offload tier's) and reset the stats; refused
        (False) while any GPU block is in use."""
        pool = self._pool
        if pool.num_free != self._usable:
            return False
        free = list(pool.policy)
        with pool.transaction() as txn:
            txn.revive(free)
            txn.add(free, [False] * len(free))
        pool.index.forget_all()
        if self._tier is not None:
            self._tier.clear()
        if self._sink is not None:
            self._sink.cleared()
        pool.evictions = 0
        self.stats, self._stats_mark = PrefixCacheStats(), PrefixCacheStats()
        return True

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the bookkeeping is inconsistent: every group's records on their own, then
        the shared pools (and the offload tier) against all groups' references together (O(pool); for tests)."""
        gpu_refs, cpu_refs = check_cross_tables(self._cross.values(), self._groups[0].records, self.block_size)
        for group in self._groups:
            gpu, cpu = group.check()
            gpu_refs.update(gpu)
            cpu_refs.update(cpu)
            if group.records.keys() != self._groups[0].records.keys():
                raise InvariantViolation("the KV cache groups hold different sequences")
        for seq_id, alloc in self._groups[0].records.items():
            if alloc.seq.allocation is not alloc:
                raise InvariantViolation(f"sequence {seq_id} does not point at the allocation that holds it")
        self._pool.check(gpu_refs)
        self._swap.check(cpu_refs, self._pool.ref)
        if self._tier is not None:
            self._tier.check(self._pool.index)

    # ---- internals ----------------------------------------------------------------------------------------
    def _record(self, seq):
        """Group 0's record of ``seq`` (the groups hold the same sequences), or SequenceStateError."""
        return self._groups[0].record(check_sequence(seq))

    def _gpu_record(self, seq):
        return self._groups[0].gpu_record(check_sequence(seq))

    def _check_block_size(self, seq) -> None:
        if seq.block_size != self.block_size:
            raise InvalidArgumentError(f"sequence {seq.seq_id} has block_size {seq.block_size}, "
                                       f"this manager uses {self.block_size}")

    def _check_unallocated(self, seq, need_tokens=True, same_block_size=True) -> None:
        """``seq`` may be allocated (or, with ``need_tokens=False, same_block_size=False``, forked into) now."""
        if not isinstance(seq, Sequence):
            check_sequence(seq)
        if same_block_size and seq.block_size != self.block_size:
            self._check_block_size(seq)
        owner = seq.allocation
        if owner is not None:
            where = "this manager" if self._groups[0].records.get(seq.seq_id) is owner else \
                "another BlockManager; free it there first"
            raise SequenceStateError(f"sequence {seq.seq_id} is already allocated in {where}")
        if need_tokens and seq.num_tokens == 0:
            raise InvalidArgumentError(f"sequence {seq.seq_id} has no tokens to allocate")
        if need_tokens and seq.token_array is None:
            raise SequenceStateError(f"sequence {seq.seq_id} is a decode-only copy without its tokens")

    def _admission(self, live_blocks, needed_free) -> AllocStatus:
        """``admission`` in this pool, for the swaps (can_allocate calls ``admission`` itself: one call less on
        the path tests/block_manager/test_call_trace.py bounds)."""
        return admission(live_blocks, needed_free, self._pool.num_free, self._usable, self._watermark_blocks)

    def _copies(self, per_group) -> BlockCopies:
        copies = BlockCopies(per_group[0] if len(per_group) == 1 else [pair for pairs in per_group for pair in pairs])
        copies.tier_moves = self._tier.take_moves() if self._tier is not None else []
        return copies


_peak_blocks = attrgetter("peak_blocks")
_generation = attrgetter("generation")  # a prefix index's count of evictions: a hit is stale once it moved


@serialized
class BlockManager(KVCacheManager):
    """``BlockManager(num_blocks, block_size=16, *, sliding_window=None, ...)``: a ``KVCacheManager`` that also
    writes each sequence's progress and status from what its calls return, as a scheduler would: for code that
    drives the manager itself (the notebooks, the tests, trace replays). Never hand one to the engine's
    schedulers, which write the progress themselves (they refuse it)."""

    def allocate(self, seq: Sequence, encoder_seq: Optional[Sequence] = None, *, num_new_tokens: Optional[int] = None,
                 hit: Optional[PrefixHit] = None) -> Admitted:
        admitted = super().allocate(seq, encoder_seq, num_new_tokens=num_new_tokens, hit=hit)
        seq.start_running(admitted)
        return admitted

    def append_slots(self, seq: Sequence, num_lookahead_slots: int = 0, *, num_new_tokens: Optional[int] = None,
                     num_draft_tokens: int = 0) -> BlockCopies:
        copies = super().append_slots(seq, num_lookahead_slots, num_new_tokens=num_new_tokens,
                                      num_draft_tokens=num_draft_tokens)
        seq.scheduled_through(copies.num_computed_tokens, num_draft_tokens)
        return copies

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> int:
        verified = super().accept_drafts(seq, num_accepted)
        seq.scheduled_through(verified)
        return verified

    def free(self, seq: Sequence, *, preempted: bool = False) -> None:
        super().free(seq, preempted=preempted)
        seq.stopped(preempted)

    def swap_out(self, seq: Sequence) -> BlockCopies:
        copies = super().swap_out(seq)
        seq.status = SequenceStatus.SWAPPED
        return copies

    def swap_in(self, seq: Sequence) -> BlockCopies:
        copies = super().swap_in(seq)
        seq.status = SequenceStatus.RUNNING
        return copies


class HybridBlockManager(BlockManager):
    """``HybridBlockManager(num_blocks, block_size=16, *, groups, ...)``: KV cache groups (vLLM V1's hybrid
    allocator), one per spec in ``groups`` (``FullAttentionSpec()``, ``SlidingWindowSpec(W)``), each with its own
    block table per sequence, all drawing pages from one pool. Block moves are one list over every group: page
    ids are unique across groups, and a move copies its page in every cache tensor (the engine's tensors are
    each shared by a layer of every group: kvlab.sizing.groups). No offload tier and no cross-attention tables."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, groups, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True, hash_fn=None, eviction="lru",
                 record_events: bool = False, kv_events: bool = False, use_eagle: bool = False,
                 prefix_match_unit: Optional[int] = None, group_block_sizes=None):
        super().__init__(num_blocks, block_size, groups=groups, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                         enable_prefix_caching=enable_prefix_caching, hash_fn=hash_fn, eviction=eviction,
                         record_events=record_events, kv_events=kv_events, use_eagle=use_eagle,
                         prefix_match_unit=prefix_match_unit, group_block_sizes=group_block_sizes)
