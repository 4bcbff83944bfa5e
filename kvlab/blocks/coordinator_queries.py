"""What a coordinator answers about its state, written once for any number of KV cache groups.

``CoordinatorQueries`` is the coordinator's part that answers (kvlab.blocks.coordinator: ``BlockManager`` and
``HybridBlockManager`` both are one); it changes nothing. It reads what a coordinator provides: the shared
pools (``_pool``, ``_swap``), its groups (``_members``) and a sequence's views (``_views(seq)``).

* Pool-level questions (free and cached blocks, ref counts, block hashes, the CPU pool, the offload tier) read
  the one pool every group draws from.
* Per-sequence questions are answered per group where there are several: ``block_tables`` and
  ``slot_mappings`` (a group's layers read its own), ``get_block_table`` (every group's table, group after
  group), ``num_released_blocks`` (every group's released entries together, so it counts the null blocks of
  ``get_block_table``; ``num_released_blocks_per_group`` has each group's). A sequence's place and progress
  are the same in every group (they move and schedule together), so ``is_swapped`` and
  ``num_scheduled_tokens`` read group 0's record.
* Per-spec questions add up the groups: ``blocks_for_prompt`` (``can_allocate`` counts every group's blocks).

A ``BlockManager`` answers each of them for its one group, exactly as before the groups. What stays per class:
``get_num_cached_tokens`` (a ``BlockManager`` asks its group's lookup; a hybrid manager plans the hit every
group serves: the same answer for allocated and waiting sequences), ``stats`` and
``make_prefix_cache_stats`` (a ``BlockManager``'s own group's; a hybrid manager's group 0's: every group counts
the same hits), ``slot_mapping`` (one group's slots: a ``BlockManager``'s) and vLLM V0's interface
(kvlab.blocks.vllm_v0).
"""

from typing import Optional

from kvlab.blocks.locking import serialized
from kvlab.blocks.planning import least_peak_blocks
from kvlab.blocks.sequence import Sequence
from kvlab.validation import check_int


@serialized
class CoordinatorQueries:
    # ---- the pool every group draws from ------------------------------------------------------------
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
        return self._pool.tier.stats if self._pool.tier is not None else None

    @property
    def num_offload_blocks(self) -> int:
        """Slots of the offload tier (a shared tier's, which other managers use too); 0 without one."""
        return self._pool.tier.num_slots if self._pool.tier is not None else 0

    @property
    def num_cpu_blocks(self) -> int:
        return self._swap.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._swap.num_free

    @property
    def usable_blocks(self) -> int:
        """The most blocks one sequence can hold at once, every group's together: the pool less the null block
        (reserved when there is a sliding window) and the watermark. ``can_allocate`` says NEVER for a prompt
        that needs more."""
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

    # ---- the groups' specs -----------------------------------------------------------------------------
    @property
    def groups(self) -> tuple:
        """Each KV cache group's attention spec (kvlab.blocks.kv_cache_groups), in group order."""
        return tuple(member.spec for member in self._members)

    def blocks_for_prompt(self, num_tokens: int, num_new_tokens: Optional[int] = None) -> int:
        """Blocks a prompt of ``num_tokens`` tokens must hold at once, every group's together, when none of it
        is cached, its first step computing ``num_new_tokens`` tokens (None: all of them, as V0 scheduling
        does) and later steps the rest, however chunked. ``can_allocate`` says NEVER for such a prompt exactly
        when this is more than ``usable_blocks``. (A prefix hit starts the first step later, which moves the
        blocks a window holds.)"""
        n = check_int("num_tokens", num_tokens, 1)
        first = n if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1, n)
        # plan_allocation's peak_blocks with no hits: the first step's blocks, or the most a later step needs.
        bs = self.block_size
        return sum(max(-(-first // bs), least_peak_blocks(first, n, bs, member.spec, 0)) for member in self._members)

    # ---- a sequence, in every group ----------------------------------------------------------------------
    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """A copy of each group's block table (CPU block ids while swapped out; the null block 0 where a
        sliding window released an entry)."""
        return [member.get_block_table(view) for member, view in zip(self._members, self._views(seq))]

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Every group's table, group after group (one group: a copy of its table)."""
        return [block for table in self.block_tables(seq) for block in table]

    def slot_mappings(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """Each group's cache slots of positions start..end-1 (-1 where its window released the block)."""
        return [member.slot_mapping(view, start, end) for member, view in zip(self._members, self._views(seq))]

    def is_swapped(self, seq: Sequence) -> bool:
        """Whether an allocated sequence's blocks are in the CPU pool (its tables then hold CPU ids); its groups
        move together."""
        return self._members[0].record(self._views(seq)[0]).on_cpu

    def num_released_blocks(self, seq: Sequence) -> int:
        """Table entries the sliding windows released, every group's together: the entries of
        ``get_block_table(seq)`` that point at the null block (on the GPU); 0 without a window."""
        return sum(self.num_released_blocks_per_group(seq))

    def num_released_blocks_per_group(self, seq: Sequence) -> list[int]:
        """Each group's released entries: the leading entries of its ``block_tables(seq)`` table that hold the
        null block 0. Read this, not the value 0, while ``seq`` is swapped out (CPU block 0 is a real block)."""
        return [member.record(view).num_released for member, view in zip(self._members, self._views(seq))]

    def num_scheduled_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens have slots: their K/V is written by now or by the step just scheduled
        (vLLM V1's ``request.num_computed_tokens``, which its scheduler advances when it schedules a step).
        The tokens after them (the rest of a chunked prompt, or tokens appended since) still need a step.
        ``seq.num_computed_tokens`` itself, for a sequence allocated here (every group schedules the same)."""
        self._members[0].record(self._views(seq)[0])  # allocated here: else the counter is not ours to report
        return seq.num_computed_tokens
