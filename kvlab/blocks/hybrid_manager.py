"""HybridBlockManager: KV cache groups (vLLM V1's hybrid allocator, ``HybridKVCacheCoordinator``).

A model mixing layer kinds has one KV cache group or more per kind (``kvlab.blocks.kv_cache_groups``; vLLM cuts
a kind with more layers into several, as the engine does: ``kvlab.sizing.groups``); each group keeps its own
block table per sequence and all groups draw from ONE pool of equal-size pages. This manager coordinates one
``GroupManager`` per group (kvlab.blocks.group_manager): a ``GroupCore`` of the group's attention spec, built on
the parts all groups share (``shared_parts``: one ``BlockPool``, one ``SwapSpace``, one event sink), so every rule
of the single-group manager (chunked prompts, window release, copy-on-write, sealing, swapping) holds per group. A
sequence is allocated here once and hashed once; each group holds a *shadow* of it (``group_shadow``: its id,
token array, keys and hashes, with the group's record and counters). Each group is a namespace of the pool's
prefix index (vLLM V1's ``BlockHashWithGroupId``): the same tokens in two groups, different layers' K/V, are
two blocks under one hash, and a lookup in one group never hits another's block.

Its lifecycle calls (``allocate``, ``append_slots``, ``accept_drafts``, ``free``, ``fork``, ``swap_out``,
``swap_in``) are the coordinator's (kvlab.blocks.coordinator), the same code a ``BlockManager`` runs for its
one group: a failed call changes nothing, in any group; so are its queries (kvlab.blocks.coordinator_queries).
This class gives the coordinator its groups and its views of a sequence (the shadows), and answers what is
not the same for one group and several: ``stats`` (group 0's: every group counts the same hits) and
``get_num_cached_tokens`` (the hit every group serves).

Hits: the longest prefix every group serves (kvlab.blocks.group_planning plans every group's part). Invariants:
each group's records check out on their own, the pools agree with the sum of every group's references, and
the groups of a sequence schedule the same positions.

One API with ``BlockManager`` (the one-group case): the engine drives either through the same calls. Tables
are per group (``block_tables``, ``slot_mappings``: a group's layers read its own); block moves are one list
(``append_slots``' copy-on-write pairs, ``swap_out`` / ``swap_in`` mappings, group after group): page ids are
unique across groups (one pool, one CPU pool), and a move copies its page in every cache tensor (the engine's
tensors are each shared by a layer of every group: ``kvlab.sizing.groups``), where the other groups' layers
never read that page, so every group's K/V arrives where its layers look.

KV events (``kv_events=True``, kvlab.blocks.kv_events): every group's stores and evictions, tagged with the
group (by its ``GroupSink``), in one stream ``kv_events`` whose queue is this manager's alone: the events of all
groups are delivered once this manager's outermost call has finished, never by a group's own call.
"""

import threading

from kvlab.blocks.allocations import check_block_size_matches, check_sequence
from kvlab.blocks.coordinator import Coordinator
from kvlab.blocks.event_sink import GroupSink
from kvlab.blocks.group_core import GroupCore
from kvlab.blocks.group_manager import GroupManager, HybridRecord
from kvlab.blocks.group_planning import plan_admissions
from kvlab.blocks.kv_cache_groups import check_group_specs
from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import shared_parts
from kvlab.blocks.records import PrefixCacheStats
from kvlab.blocks.sequence import Sequence, allocation_record, group_shadow, sync_shadow
from kvlab.errors import InvalidArgumentError, SequenceStateError

__all__ = ["HybridBlockManager"]


@serialized
class HybridBlockManager(Coordinator):
    def __init__(self, num_blocks: int, block_size: int = 16, *, groups, num_cpu_blocks: int = 0,
                 watermark: float = 0.0, enable_prefix_caching: bool = True, hash_fn=None, eviction="lru",
                 record_events: bool = False, kv_events: bool = False):
        specs = check_group_specs(groups)
        windows = [spec.sliding_window for spec in specs if spec.sliding_window is not None]
        # One set of parts for all groups (reserving the null block if any group has a window).
        shared = shared_parts(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, watermark=watermark,
                              enable_prefix_caching=enable_prefix_caching,
                              sliding_window=windows[0] if windows else None, hash_fn=hash_fn, eviction=eviction,
                              record_events=record_events, kv_events=kv_events, groups=specs)
        self.block_size, self.num_blocks = shared.block_size, shared.num_blocks
        self.enable_prefix_caching = shared.enable_prefix_caching
        self.events, self.kv_events = shared.events, shared.kv_events
        self._kv_queue = self.kv_events.queue if kv_events else ()  # delivered after each call (locking.py)
        self._pool, self._swap, self._sink = shared.pool, shared.swap, shared.sink
        self._usable, self._watermark_blocks = shared.usable, shared.watermark_blocks
        self._members = [GroupManager(GroupCore.joined(shared, spec, _group_sink(shared.sink, g), g))
                         for g, spec in enumerate(specs)]
        self._lock = threading.RLock()

    # ---- queries: the coordinator's (kvlab.blocks.coordinator_queries), but for these -----------------------
    @property
    def stats(self) -> PrefixCacheStats:
        """``allocate``'s lookups: every group counts the same hits (cut to the hit all groups serve)."""
        return self._members[0].stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self._members[0].make_prefix_cache_stats()

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s leading full blocks every group's prefix cache holds now (the hit an ``allocate``
        would take: at most all but the last token); for allocated and waiting sequences, as a
        ``BlockManager``'s. Pure: it plans an admission of fresh group shadows and keeps nothing."""
        check_block_size_matches(self, check_sequence(seq))
        if not self.enable_prefix_caching or seq.num_tokens == 0:
            return 0
        return plan_admissions(self._members, self._new_views(seq), 0, None)[0] * self.block_size

    # ---- lifecycle, reset and check_invariants: the coordinator's (kvlab.blocks.coordinator) ---------------
    # ---- internals: the coordinator's views of a sequence, its group shadows --------------------------------
    def _new_views(self, seq):
        return [group_shadow(seq) for _ in self._members]

    def _shadows(self, seq) -> list:
        record = allocation_record(check_sequence(seq))
        if not isinstance(record, HybridRecord) or record.manager is not self:
            raise SequenceStateError(f"sequence {seq.seq_id} is not allocated in this manager (never allocated, "
                                     "already freed, or allocated in another manager)")
        for shadow in record.shadows:
            sync_shadow(seq, shadow)
        return record.shadows

    _views = _shadows

    def _gpu_views(self, seq) -> list:
        shadows = self._shadows(seq)
        self._members[0].gpu_record(shadows[0])  # all groups move together: group 0 tells where
        return shadows

    def _fork_views(self, child, num_groups: int) -> list:
        return [Sequence((), child.block_size) for _ in range(num_groups)]

    def _cross_blocks(self, seq, encoder_seq) -> int:
        if encoder_seq is not None:
            raise InvalidArgumentError("a hybrid manager has no encoder-decoder cross-attention tables: "
                                       "encoder_seq must be None")
        return 0

    def _attach_cross(self, seq, encoder_seq, blocks) -> None:
        """No cross-attention tables (``_cross_blocks`` refused an encoder)."""

    def _cross_tables(self):
        return ()


def _group_sink(sink, group: int):
    """What group ``group``'s core reports to: the shared sink, each report tagged with the group."""
    return None if sink is None else GroupSink(sink, group)
