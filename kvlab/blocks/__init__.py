"""The block manager: which KV block holds which token, for every sequence (in the manner of vLLM V1's
``vllm/v1/core/``: scheduler -> manager -> per-group managers -> block pool).

    manager.py          KVCacheManager: every call, over the KV cache groups, atomic across them; lookup ->
                        can_allocate -> allocate return values (the scheduler writes the sequence's progress);
                        BlockManager (and HybridBlockManager: several groups) also writes the progress
    group_manager.py    GroupManager: one KV cache group's records and its half of each call (plan, then
                        bookkeeping): prefix hits, chunked prompts, window release, copy-on-write, drafts, swap
    kv_cache_groups.py  the groups' attention specs (FullAttentionSpec, SlidingWindowSpec, MambaStateSpec) and
                        their rules: which blocks a query still sees, how many a request holds
    block_pool.py       the GPU pool: reference counts, the free blocks, and the transaction that makes a call's
                        eviction-policy calls undoable
    eviction.py         which free block to reuse first (LRU, FIFO, LFU, or your own EvictionPolicy)
    prefix_cache.py     chained block hashes and the verified prefix index (hash -> block, checked by content)
    sequence.py         Sequence: a request's tokens, its keys (salt, adapter, images) and its progress
    tiers.py            the CPU tiers: the swap space and the offload tier of cached blocks (LRU, ARC)
    events.py           the event sink, the teaching Event log, vLLM's KV events and residency metrics
    records.py          AllocStatus, Event, TierMove, PrefixCacheStats, TierHitStats: the values calls hand out
    vllm_v0.py          BlockSpaceManager: vLLM V0's extra calls over a BlockManager
"""

from kvlab.blocks.eviction import POLICIES, EvictionPolicy
from kvlab.blocks.manager import Admitted, BlockCopies, BlockManager, HybridBlockManager, KVCacheManager, PrefixHit
from kvlab.blocks.records import AllocStatus, Event, PrefixCacheStats, TierMove
from kvlab.blocks.sequence import Sequence, SequenceStatus

__all__ = ["Admitted", "AllocStatus", "BlockCopies", "BlockManager", "Event", "EvictionPolicy",
           "HybridBlockManager", "KVCacheManager", "POLICIES", "PrefixCacheStats", "PrefixHit", "Sequence",
           "SequenceStatus", "TierMove"]
