"""Swapping for a hybrid manager (vLLM V0's preemption): every KV cache group's blocks go to the CPU pool and back.

``HybridSwapping`` is the part of ``HybridBlockManager`` (kvlab.blocks.hybrid_manager) that swaps, as
kvlab.blocks.manager_swap is ``BlockManager``'s. It reads the coordinator's groups (``_members``), its shared
pools (``_pool``, ``_swap``) and a sequence's shadows (``_shadows``, ``_gpu_shadows``). Like every call of the
coordinator, a swap plans every group (the blocks each moves), checks room for all of them, makes every
group's policy calls in one transaction, and only then has each group do its bookkeeping, so a failed swap
changes nothing in any group. The moves come back as one list, group after group (page ids are unique across
groups: kvlab.blocks.hybrid_manager says why that is enough).
"""

from kvlab.blocks.group_planning import cpu_blocks_needed
from kvlab.blocks.locking import serialized
from kvlab.blocks.records import AllocStatus
from kvlab.blocks.sequence import Sequence, SequenceStatus
from kvlab.errors import OutOfBlocksError


@serialized
class HybridSwapping:
    def can_swap_out(self, seq: Sequence) -> AllocStatus:
        return self._swap.admission(cpu_blocks_needed(self._swap, self._moving_out(seq)))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move every group's blocks to the CPU pool; returns every group's (gpu, cpu) copies in one list."""
        moving = self._moving_out(seq)
        if cpu_blocks_needed(self._swap, moving) > self._swap.num_free:
            raise OutOfBlocksError(f"not enough free CPU blocks to swap out sequence {seq.seq_id}")
        released = [self._pool.freed_by(blocks) for _, (blocks, _) in moving]
        with self._pool.transaction() as txn:
            for freed, cached in released:
                txn.add(freed, cached)
        mappings = [member.moved_out(shadow, alloc, group_moving, freed)
                    for member, shadow, (alloc, group_moving), (freed, _)
                    in zip(self._members, self._shadows(seq), moving, released)]
        seq.status = SequenceStatus.SWAPPED
        return flat_moves(mappings)

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        return self._admission(*map(sum, zip(*self._swap_in_needs(seq))))

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring every group's blocks back; returns every group's (cpu, gpu) copies in one list."""
        needs = self._swap_in_needs(seq)
        if self._admission(*map(sum, zip(*needs))) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        with self._pool.transaction() as txn:
            new_blocks = [txn.pop(fresh) for _, fresh in needs]
        mappings = [member.moved_in(shadow, blocks)
                    for member, shadow, blocks in zip(self._members, self._shadows(seq), new_blocks)]
        seq.status = SequenceStatus.RUNNING
        return flat_moves(mappings)

    # ---- internals ---------------------------------------------------------------------------------------
    def _moving_out(self, seq):
        """Each group's (record, (GPU blocks a swap-out moves, None))."""
        return [member.moving_out(shadow) for member, shadow in zip(self._members, self._gpu_shadows(seq))]

    def _swap_in_needs(self, seq):
        return [member.swap_in_needs(shadow) for member, shadow in zip(self._members, self._shadows(seq))]


def flat_moves(per_group: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Every group's block moves in one list, group after group: what a hybrid manager's calls return."""
    return [pair for pairs in per_group for pair in pairs]
