"""The block manager: which KV block holds which token, for every sequence.

One module per part, in the manner of vLLM V1's ``vllm/v1/core/``:

    coordinator.py         the lifecycle calls (allocate, append_slots, accept_drafts, fork, free), written once
                           over KV cache groups, atomic across them: both managers below are a Coordinator
    manager_swap.py        the coordinator's swap_out and swap_in (vLLM V0's preemption by swapping)
    coordinator_queries.py the coordinator's queries (the pool's; a sequence's tables, slots, place in every group)
    manager.py             BlockManager, the public API: a group's core and the coordinator of that one group
    manager_state.py       its constructor: the shared parts (pools, sink, settings) and the state every part reads
    group_core.py          GroupCore: one group's records, its halves of each call and its own queries
    manager_steps.py       a group's halves of append_slots (window release, copy-on-write, new blocks, seals)
    vllm_v0.py             vLLM V0's block-space-manager calls and the cross-attention tables (one group's only)
    hybrid_manager.py      HybridBlockManager: KV cache groups (full and sliding-window layers) sharing one pool,
                           the coordinator over one GroupManager per group
    group_manager.py       GroupManager: one group's two halves of each call, offered over its GroupCore
    group_planning.py      what a call needs from every group (the common hit, pins, steps, CPU blocks)
    kv_cache_groups.py     the groups' specs: FullAttentionSpec, SlidingWindowSpec (vLLM's KVCacheSpec family),
                           each with its release rule (the planning asks the spec)
    locking.py             one re-entrant lock held by every public method, so threads may share a manager
    sequence.py            Sequence: a request's tokens and its read-only block table
    block_pool.py          the device pool: reference counts, the free blocks (eviction/), its prefix index
    prefix_index.py        the prefix index of a tier: verified lookup, seal, evict (hash -> block, keyed by content)
    hashing.py             chained xxh64 block hashes, computed once in a sequence's life
    block_keys.py          cache salts and extra keys (LoRA adapter, images): what else makes a block distinct
    planning.py            how many blocks a step needs, and which a sliding window can release
    allocations.py         who owns which blocks (one record per sequence, one manager per sequence)
    swap.py                the CPU pool that preempted sequences are swapped into
    offload_tier.py        the CPU offload tier of cached blocks: offload at GPU eviction, promote on a GPU miss
    offload_policies.py    the tier's replacement (LRU, ARC) and admission (always, reused) policies
    cross_attention.py     encoder-decoder cross-attention tables
    eviction/              which cached block to reuse first (LRU, FIFO, LFU, or your own policy)
    policy_transaction.py  undo for a user policy that raises half-way through an operation
    invariants.py          check_invariants(): the manager's state checked against itself
    records.py             AllocStatus, Event, PrefixCacheStats
    event_sink.py          the one sink the manager and pool report to; EventLog (the Event records) consumes it
    kv_events.py           vLLM's KV cache events (BlockStored, BlockRemoved, AllBlocksCleared): its other consumer
    kv_event_subscribers.py  their subscribers: a failing one is dropped, never the manager's problem
"""

from kvlab.blocks.eviction import POLICIES, EvictionPolicy
from kvlab.blocks.manager import BlockManager
from kvlab.blocks.records import AllocStatus, Event, PrefixCacheStats
from kvlab.blocks.sequence import Sequence, SequenceStatus

__all__ = ["AllocStatus", "BlockManager", "Event", "EvictionPolicy", "POLICIES", "PrefixCacheStats", "Sequence",
           "SequenceStatus"]
