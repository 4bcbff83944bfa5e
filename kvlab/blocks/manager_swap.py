"""Swapping (vLLM V0's preemption): a running sequence's blocks, in every KV cache group, move to the CPU pool
and back.

``Swapping`` is the coordinator's part that swaps (kvlab.blocks.coordinator: ``BlockManager`` and
``HybridBlockManager`` both are one), written once for any number of groups. It reads the coordinator's groups
(``_members``), its shared pools (``_pool``, ``_swap``) and a sequence's views (``_views``, ``_gpu_views``).
Like every call of the coordinator, a swap plans every group (the blocks each moves; the swap space,
kvlab.blocks.swap, decides which and where, a one-group manager's cross-attention table included), checks room
for all of them, makes every group's policy calls in one transaction, and only then has each group do its
bookkeeping, so a failed swap changes nothing in any group. The moves come back as one list, group after
group (page ids are unique across groups: kvlab.blocks.hybrid_manager says why that is enough).
"""

from kvlab.blocks.group_planning import cpu_blocks_needed
from kvlab.blocks.locking import serialized
from kvlab.blocks.records import AllocStatus
from kvlab.blocks.sequence import Sequence, SequenceStatus
from kvlab.errors import OutOfBlocksError


@serialized
class Swapping:
    def can_swap_out(self, seq: Sequence) -> AllocStatus:
        """Whether ``swap_out(seq)`` fits in the CPU pool now (OK), once swapped sequences leave it (LATER),
        or never (NEVER)."""
        return self._swap.admission(cpu_blocks_needed(self._swap, self._moving_out(seq)))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks in every group (and its request group's cross-attention blocks, if it is
        the last one on the GPU) to the CPU pool; returns the (gpu, cpu) copies to make, every group's in one
        list. A block shared with a sequence swapped out earlier is not copied again."""
        moving = self._moving_out(seq)
        if cpu_blocks_needed(self._swap, moving) > self._swap.num_free:
            raise OutOfBlocksError(f"not enough free CPU blocks to swap out sequence {seq.seq_id}")
        released = [self._pool.freed_by(blocks) for _, (blocks, _) in moving]
        with self._pool.transaction() as txn:
            for freed, cached in released:
                txn.add(freed, cached)
        mappings = [member.moved_out(view, alloc, group_moving, freed)
                    for member, view, (alloc, group_moving), (freed, _)
                    in zip(self._members, self._views(seq), moving, released)]
        seq.status = SequenceStatus.SWAPPED
        return flat_moves(mappings)

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        return self._admission(*map(sum, zip(*self._swap_in_needs(seq))))

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back in every group (with its request group's cross-attention blocks if
        they are on the CPU); returns the (cpu, gpu) copies to make, every group's in one list. Swapped-in
        blocks are not re-registered in the prefix cache."""
        needs = self._swap_in_needs(seq)
        if self._admission(*map(sum, zip(*needs))) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        with self._pool.transaction() as txn:
            new_blocks = [txn.pop(fresh) for _, fresh in needs]
        mappings = [member.moved_in(view, blocks)
                    for member, view, blocks in zip(self._members, self._views(seq), new_blocks)]
        seq.status = SequenceStatus.RUNNING
        return flat_moves(mappings)

    # ---- internals ---------------------------------------------------------------------------------------
    def _moving_out(self, seq):
        """Each group's (record, (GPU blocks a swap-out moves, the cross table moving with them or None))."""
        return [member.moving_out(view) for member, view in zip(self._members, self._gpu_views(seq))]

    def _swap_in_needs(self, seq):
        return [member.swap_in_needs(view) for member, view in zip(self._members, self._views(seq))]


def flat_moves(per_group: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Every group's block moves in one list, group after group: what a coordinator's calls return."""
    return per_group[0] if len(per_group) == 1 else [pair for pairs in per_group for pair in pairs]
