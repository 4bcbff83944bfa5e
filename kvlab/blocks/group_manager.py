"""One KV cache group of a coordinator: the two halves of each lifecycle call, over the group's core.

The coordinator (kvlab.blocks.coordinator) drives one ``GroupManager`` per group. Each holds a ``GroupCore``
of its group's spec (kvlab.blocks.group_core, kvlab.blocks.kv_cache_groups), so every rule of the single-group
manager (chunked prompts, window release, copy-on-write, sealing, swapping) holds per group. A ``BlockManager``
is a ``GroupCore`` and its own one group's core (``GroupManager(self)``). A ``HybridBlockManager``'s cores are
``GroupCore``s (no coordinator, no vLLM V0 interface, no cross-attention tables) built on its
``SharedParts`` (kvlab.blocks.manager_state: one ``BlockPool``, one ``SwapSpace``, one event sink, which each
reports to through a ``GroupSink`` that adds its group) and show no event consumers of their own: the
coordinator delivers every group's events once its own call is over.

A group composes its core instead of being one: it offers the two halves below, ``fork``'s bookkeeping (no
policy call) and the group's own queries (its tables, slots, hits and stats; the pool's are the coordinator's,
kvlab.blocks.coordinator_queries), never a whole lifecycle call (``allocate``, ``append_slots``, ``free``,
``swap_out``: the coordinator's, across groups), vLLM V0's interface or the encoder-decoder cross-attention
tables.

Two phases. The coordinator plans every group (hashing every group's blocks, so a ``hash_fn`` that raises
does so before anything changed), checks room for all of them, makes EVERY group's policy calls in one
transaction (undone whole if one raises), and only then has each group do its bookkeeping. So a failed call
changes nothing in any group. This class offers each call's two halves: its plan (``plan_admission``,
``plan_step`` and ``hashes_to_seal``, ``plan_accept``, ``plan_release``, ``moving_out``, ``swap_in_needs``)
and its bookkeeping (``admit``, ``apply_step``, ``accept``, ``release``, ``moved_out``, ``moved_in``,
``fork``); the policy calls between them are the coordinator's, made from the plans. (Blocks never move
between groups: each group looks up and seals in its own namespace of the prefix index, so one group's plan
never depends on another group's bookkeeping.)
"""

from kvlab.blocks.invariants import check_records
from kvlab.blocks.records import PrefixCacheStats
from kvlab.blocks.sequence import SequenceStatus, allocation_record

__all__ = ["GroupManager", "HybridRecord"]


class GroupManager:
    """One KV cache group, over its ``core`` (a ``GroupCore`` of the group's spec). In a hybrid manager its
    sequences are group shadows (``kvlab.blocks.sequence.group_shadow``): the coordinator's sequence's tokens,
    keys and hashes, with the group's record and counters; in a ``BlockManager`` the sequences themselves."""

    def __init__(self, core):
        self._core = core
        self.block_size, self.num_blocks, self.spec = core.block_size, core.num_blocks, core.spec

    @property
    def stats(self) -> PrefixCacheStats:
        return self._core.stats

    def reset_stats(self) -> None:
        """``reset_prefix_cache``'s part in this group: its lookup counters start again."""
        self._core.stats, self._core._stats_mark = PrefixCacheStats(), PrefixCacheStats()

    @property
    def num_sequences(self) -> int:
        return len(self._core._allocs)

    def record(self, shadow):
        """The shadow's record (kvlab.blocks.allocations); SequenceStateError if it is not allocated here."""
        return self._core._alloc(shadow)

    def gpu_record(self, shadow):
        """The shadow's record; SequenceStateError if it is swapped out."""
        return self._core._on_gpu(shadow)

    # ---- the group's own questions (the pool's are the coordinator's: kvlab.blocks.coordinator_queries) ------
    def get_block_table(self, shadow) -> list[int]:
        """A copy of the shadow's block table in this group (CPU block ids while it is swapped out)."""
        return self._core._block_table(shadow)

    def slot_mapping(self, shadow, start: int, end: int) -> list[int]:
        """The shadow's cache slots in this group of positions start..end-1 (see ``BlockManager.slot_mapping``)."""
        return self._core.slot_mapping(shadow, start, end)

    def get_num_cached_tokens(self, shadow) -> int:
        """Tokens of the shadow's leading full blocks this group's prefix cache holds now."""
        return self._core.get_num_cached_tokens(shadow)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """This group's lookup counters since the last call (see ``BlockManager.make_prefix_cache_stats``)."""
        return self._core.make_prefix_cache_stats()

    # ---- allocate ------------------------------------------------------------------------------------------
    def plan_admission(self, shadow, lookahead: int, num_new_tokens, max_hits=None):
        """The AllocationPlan of ``shadow`` (kvlab.blocks.planning), its hits cut to ``max_hits`` blocks (None:
        all that are cached): the coordinator cuts every group's to the hit all of them serve."""
        return self._core._plan_allocation(shadow, lookahead, num_new_tokens, max_hits)

    def admit(self, shadow, plan, new_blocks, num_revived: int, cross_blocks=()) -> None:
        """allocate's bookkeeping, once the policy handed out ``new_blocks`` for this group (and ``cross_blocks``
        for an encoder's table: one group only) and took ``num_revived`` of its live hits out of the free set
        (0 where the coordinator pinned every group's hits itself)."""
        self._core._admit(shadow, plan, new_blocks, num_revived, cross_blocks)

    # ---- append_slots --------------------------------------------------------------------------------------
    def plan_step(self, shadow, lookahead: int, num_new_tokens, num_drafts: int):
        """(record, StepPlan, num_drafts) of the shadow's next step (with ``num_drafts`` draft tokens)."""
        alloc = self._core._on_gpu(shadow)
        return alloc, self._core._plan_step(alloc, lookahead, num_new_tokens, num_drafts), num_drafts

    def hashes_to_seal(self, step):
        """The (hashes, contents) of the blocks ``step`` (from ``plan_step``) seals, or None."""
        return self._core._hashes_to_seal(*step)

    def apply_step(self, step, lookahead: int, taken, seals) -> list[tuple[int, int]]:
        """append_slots' bookkeeping, once the policy took back ``step``'s freed blocks and handed out ``taken``;
        returns the group's copy-on-write pairs."""
        alloc, plan, num_drafts = step
        return self._core._apply_step(alloc, plan, lookahead, taken, seals, num_drafts)

    def plan_accept(self, shadow, num_accepted: int):
        """accept_drafts' plan (checked, hashed): (record, verified positions, seals)."""
        return self._core._plan_accept(shadow, num_accepted)

    def accept(self, plan) -> None:
        """accept_drafts' bookkeeping."""
        self._core._accept(*plan)

    def fork(self, shadow, twin) -> None:
        """fork's bookkeeping (it makes no policy call): ``twin`` takes the shadow's tokens, keys and counters
        and shares its blocks."""
        self._core._fork(shadow, twin)

    # ---- free ----------------------------------------------------------------------------------------------
    def plan_release(self, shadow):
        """(record, its live blocks tail first, the GPU ones that become free, whether each of those is cached)."""
        return self._core._plan_release(shadow)

    def release(self, alloc, live, freed, preempted: bool) -> None:
        """free's bookkeeping, once the policy took back ``freed``."""
        self._core._release(alloc, live, freed, preempted)

    # ---- swapping ------------------------------------------------------------------------------------------
    def moving_out(self, shadow):
        """(record, (GPU blocks a swap-out moves, the cross-attention table moving with them or None))."""
        alloc = self._core._on_gpu(shadow)
        return alloc, self._core._swap.moving_out(alloc)

    def moved_out(self, shadow, alloc, moving, freed) -> list[tuple[int, int]]:
        """swap_out's bookkeeping, once the policy took back ``freed`` (those of ``moving``'s blocks that become
        free); returns the group's (gpu, cpu) copies."""
        core = self._core
        core._pool.drop(moving[0], freed)
        mapping = core._swap.moved_out(alloc, moving, freed)
        shadow.status = SequenceStatus.SWAPPED
        if core._sink is not None:
            core._sink.swapped_out(shadow.seq_id, mapping)
        return mapping

    def swap_in_needs(self, shadow) -> tuple[int, int]:
        """(GPU blocks the swapped-out shadow holds once back, free GPU blocks that takes)."""
        return self._core._swap.blocks_needed_in(self._core._on_cpu(shadow))

    def moved_in(self, shadow, new_blocks) -> list[tuple[int, int]]:
        """swap_in's bookkeeping, once the policy handed out ``new_blocks`` (``swap_in_needs(shadow)[1]`` of
        them); returns the group's (cpu, gpu) copies."""
        core = self._core
        mapping = core._swap.moved_in(core._on_cpu(shadow), core._pool, new_blocks)
        shadow.status = SequenceStatus.RUNNING
        if core._sink is not None:
            core._sink.swapped_in(shadow.seq_id, mapping)
        return mapping

    # ---- checks --------------------------------------------------------------------------------------------
    def check_records(self, cross_tables=()):
        """Check this group's records on their own, with the ``cross_tables`` its sequences read (a one-group
        manager's); returns the (GPU, CPU) references they hold (the coordinator checks the shared pools
        against every group's together)."""
        core = self._core
        return check_records(core._allocs, cross_tables, core._pool, self.block_size, core.enable_prefix_caching)


class HybridRecord:
    """``allocation_record(seq)`` of a sequence a HybridBlockManager allocated: its shadow in each group."""
    __slots__ = ("manager", "shadows")

    def __init__(self, manager, shadows):
        self.manager, self.shadows = manager, shadows

    @property
    def table(self):  # Sequence.block_table shows group 0's; block_tables(seq) has them all
        return allocation_record(self.shadows[0]).table
