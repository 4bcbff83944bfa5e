"""One KV cache group of a hybrid manager: a ``BlockManager`` of the group's attention spec, on shared pools.

``HybridBlockManager`` (kvlab.blocks.hybrid_manager) coordinates one ``GroupManager`` per group. Each is a
``BlockManager`` of its group's spec (kvlab.blocks.kv_cache_groups), so every rule of the single-group manager
(chunked prompts, window release, copy-on-write, sealing, swapping) holds per group. It is built on the
coordinator's ``SharedParts`` (kvlab.blocks.manager_state: one ``BlockPool``, one ``SwapSpace``, one event
sink, which it reports to through a ``GroupSink`` that adds its group) and shows no event consumers of its
own: the coordinator delivers every group's events once its own call is over.

Two phases. A ``BlockManager`` call plans, checks there is room, makes all of its eviction-policy calls in one
transaction, and then does its bookkeeping, which cannot fail. The coordinator does the same across groups:
it plans every group (hashing every group's blocks, so a ``hash_fn`` that raises does so before anything
changed), checks room for all of them, makes EVERY group's policy calls in one transaction (undone whole if
one raises), and only then has each group do its bookkeeping. So a failed call changes nothing in any group.
This class offers each call's two halves: its plan (``plan_admission``, ``plan_step`` and
``hashes_to_seal``, ``plan_accept``, ``plan_release``, ``moving_out``, ``swap_in_needs``) and its bookkeeping
(``admit``, ``apply_step``, ``accept``, ``release``, ``moved_out``, ``moved_in``); the policy calls between them are the
coordinator's, made from the plans. (Blocks never move between groups: a group's keys make its blocks'
bytes its own, so one group's plan never depends on another group's bookkeeping.)
"""

from kvlab.blocks.event_sink import GroupSink
from kvlab.blocks.invariants import check_records
from kvlab.blocks.kv_cache_groups import KVCacheSpec
from kvlab.blocks.manager import BlockManager
from kvlab.blocks.manager_state import SharedParts
from kvlab.blocks.sequence import SequenceStatus, allocation_record

__all__ = ["GroupManager", "HybridRecord"]


class GroupManager(BlockManager):
    """KV cache group ``group`` of attention ``spec``, on the coordinator's ``shared`` parts. Its sequences are
    group shadows (``kvlab.blocks.sequence.group_shadow``): the coordinator's sequence, with the group in its
    keys."""

    def __init__(self, shared: SharedParts, spec: KVCacheSpec, group: int):
        self._join(shared, spec, None if shared.sink is None else GroupSink(shared.sink, group))

    @property
    def num_sequences(self) -> int:
        return len(self._allocs)

    def gpu_record(self, shadow):
        """The shadow's record; SequenceStateError if it is swapped out."""
        return self._on_gpu(shadow)

    # ---- allocate ------------------------------------------------------------------------------------------
    def plan_admission(self, shadow, lookahead: int, num_new_tokens, max_hits=None):
        """The AllocationPlan of ``shadow`` (kvlab.blocks.planning), its hits cut to ``max_hits`` blocks (None:
        all that are cached): the coordinator cuts every group's to the hit all of them serve."""
        return self._plan_allocation(shadow, lookahead, num_new_tokens, max_hits)

    def admit(self, shadow, plan, new_blocks) -> None:
        """allocate's bookkeeping: the coordinator pinned every group's hits (so none is revived here) and took
        ``new_blocks`` for this group."""
        self._admit(shadow, plan, new_blocks, 0)

    # ---- append_slots --------------------------------------------------------------------------------------
    def plan_step(self, shadow, lookahead: int, num_new_tokens, num_drafts: int):
        """(record, StepPlan, num_drafts) of the shadow's next step (with ``num_drafts`` draft tokens)."""
        alloc = self._on_gpu(shadow)
        return alloc, self._plan_step(alloc, lookahead, num_new_tokens, num_drafts), num_drafts

    def hashes_to_seal(self, step):
        """The (hashes, contents) of the blocks ``step`` (from ``plan_step``) seals, or None."""
        return self._hashes_to_seal(*step)

    def apply_step(self, step, lookahead: int, taken, seals) -> list[tuple[int, int]]:
        """append_slots' bookkeeping, once the policy took back ``step``'s freed blocks and handed out ``taken``;
        returns the group's copy-on-write pairs."""
        alloc, plan, num_drafts = step
        return self._apply_step(alloc, plan, lookahead, taken, seals, num_drafts)

    def plan_accept(self, shadow, num_accepted: int):
        """accept_drafts' plan (checked, hashed): (record, verified positions, seals)."""
        return self._plan_accept(shadow, num_accepted)

    def accept(self, plan) -> None:
        """accept_drafts' bookkeeping."""
        self._accept(*plan)

    # ---- free ----------------------------------------------------------------------------------------------
    def plan_release(self, shadow):
        """(record, its live blocks tail first, the GPU ones that become free, whether each of those is cached)."""
        return self._plan_release(shadow)

    def release(self, alloc, live, freed, preempted: bool) -> None:
        """free's bookkeeping, once the policy took back ``freed``."""
        self._release(alloc, live, freed, preempted)

    # ---- swapping ------------------------------------------------------------------------------------------
    def moving_out(self, shadow):
        """(record, (GPU blocks a swap-out moves, None: no cross-attention table in a group))."""
        alloc = self._on_gpu(shadow)
        return alloc, self._swap.moving_out(alloc)

    def moved_out(self, shadow, alloc, moving, freed) -> list[tuple[int, int]]:
        """swap_out's bookkeeping, once the policy took back ``freed`` (those of ``moving``'s blocks that become
        free); returns the group's (gpu, cpu) copies."""
        self._pool.drop(moving[0], freed)
        mapping = self._swap.moved_out(alloc, moving, freed)
        shadow.status = SequenceStatus.SWAPPED
        if self._sink is not None:
            self._sink.swapped_out(shadow.seq_id, mapping)
        return mapping

    def swap_in_needs(self, shadow) -> tuple[int, int]:
        """(GPU blocks the swapped-out shadow holds once back, free GPU blocks that takes)."""
        return self._swap.blocks_needed_in(self._on_cpu(shadow))

    def moved_in(self, shadow, new_blocks) -> list[tuple[int, int]]:
        """swap_in's bookkeeping, once the policy handed out ``new_blocks`` (``swap_in_needs(shadow)[1]`` of
        them); returns the group's (cpu, gpu) copies."""
        mapping = self._swap.moved_in(self._on_cpu(shadow), self._pool, new_blocks)
        shadow.status = SequenceStatus.RUNNING
        if self._sink is not None:
            self._sink.swapped_in(shadow.seq_id, mapping)
        return mapping

    # ---- checks --------------------------------------------------------------------------------------------
    def check_records(self):
        """Check this group's records on their own; returns the (GPU, CPU) references they hold (the
        coordinator checks the shared pools against every group's together)."""
        return check_records(self._allocs, self._cross, self._pool, self.block_size, self.enable_prefix_caching)


class HybridRecord:
    """``allocation_record(seq)`` of a sequence a HybridBlockManager allocated: its shadow in each group."""
    __slots__ = ("manager", "shadows")

    def __init__(self, manager, shadows):
        self.manager, self.shadows = manager, shadows

    @property
    def table(self):  # Sequence.block_table shows group 0's; block_tables(seq) has them all
        return allocation_record(self.shadows[0]).table
