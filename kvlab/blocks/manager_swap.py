"""Swapping (vLLM V0's preemption): a running sequence's blocks move to the CPU pool and back.

``BlockManagerSwapping`` is one of the parts ``BlockManager`` is built from; it reads only the state its base
(``kvlab.blocks.manager_state.ManagerState``) creates. The swap space (kvlab.blocks.swap) decides which
blocks move and where; these calls check the sequence's state and the room for it, set its status and
report the moves to the event sink.
"""

from kvlab.blocks.locking import serialized
from kvlab.blocks.manager_state import ManagerState
from kvlab.blocks.records import AllocStatus
from kvlab.blocks.sequence import Sequence, SequenceStatus
from kvlab.errors import OutOfBlocksError


@serialized
class BlockManagerSwapping(ManagerState):
    def can_swap_out(self, seq: Sequence) -> AllocStatus:
        """Whether ``swap_out(seq)`` fits in the CPU pool now (OK), once swapped sequences leave it (LATER),
        or never (NEVER)."""
        return self._swap.can_move_out(self._on_gpu(seq))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks (and its group's cross-attention blocks, if it is the group's last
        sequence on the GPU) to the CPU pool; returns the (gpu, cpu) copies to make. A block shared with a
        sequence swapped out earlier is not copied again."""
        mapping = self._swap.move_out(self._on_gpu(seq), self._pool)
        seq.status = SequenceStatus.SWAPPED
        if self._sink is not None:
            self._sink.swapped_out(seq.seq_id, mapping)
        return mapping

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        return self._admission(*self._swap.blocks_needed_in(self._on_cpu(seq)))

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back (with its group's cross-attention blocks if they are on the CPU);
        returns the (cpu, gpu) copies to make. Swapped-in blocks are not re-registered in the prefix cache."""
        alloc = self._on_cpu(seq)
        if self._admission(*self._swap.blocks_needed_in(alloc)) is not AllocStatus.OK:
            raise OutOfBlocksError(f"not enough free GPU blocks to swap in sequence {seq.seq_id}")
        mapping = self._swap.move_in(alloc, self._pool)
        seq.status = SequenceStatus.RUNNING
        if self._sink is not None:
            self._sink.swapped_in(seq.seq_id, mapping)
        return mapping
