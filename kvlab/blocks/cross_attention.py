"""Encoder-decoder requests: one cross-attention block table per request group (vLLM V0's cross block table).

A group is the decoder sequence allocated with ``encoder_seq`` (its *root*) plus every sequence forked from
it. The encoder's K/V is written once and read by all of them, so the group holds one reference to each
cross block, whatever its size. Cross blocks are never prefix-cached (vLLM does not cache them either),
count in admission like the decoder's own blocks, move to the CPU with the group's last sequence on the GPU
and come back with the first one swapped in, and live until ``free_cross``, so a group preempted by
recompute keeps its encoder output (re-allocating the root reattaches it).
"""

from kvlab.blocks.allocations import CrossTable, check_sequence
from kvlab.blocks.sequence import allocation_record
from kvlab.errors import InvalidArgumentError, SequenceStateError


class CrossTables:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._by_root: dict = {}  # root Sequence -> its group's CrossTable (identity-keyed)

    def __iter__(self):
        return iter(self._by_root.values())

    def blocks_for(self, seq, encoder_seq) -> int:
        """New blocks ``allocate(seq, encoder_seq)`` needs for a cross table (0 without an encoder); raises if
        the call is not valid."""
        existing = self._by_root.get(seq)
        if encoder_seq is None:
            if existing is not None and existing.on_cpu:
                raise SequenceStateError(f"sequence {seq.seq_id}'s cross-attention blocks are swapped out with "
                                         "no sequence to bring them back: free_cross, then allocate it again "
                                         "with its encoder sequence")
            return 0
        check_sequence(encoder_seq)
        if existing is not None:
            raise SequenceStateError(f"sequence {seq.seq_id} already has a cross-attention table (reallocating "
                                     "reattaches it): pass no encoder_seq, or free_cross first")
        if encoder_seq.block_size != self.block_size or encoder_seq.num_tokens == 0:
            raise InvalidArgumentError(f"encoder_seq must have tokens and block_size {self.block_size}, got "
                                       f"{encoder_seq.num_tokens} tokens, block_size {encoder_seq.block_size}")
        return -(-encoder_seq.num_tokens // self.block_size)

    def attach(self, alloc, encoder_seq, blocks) -> None:
        """Give a new allocation its group's table: a new one made of ``blocks`` (with ``encoder_seq``), or
        the one its sequence kept from before a recompute preemption."""
        if encoder_seq is not None:
            self._by_root[alloc.seq] = CrossTable(alloc.seq, list(blocks), encoder_seq.num_tokens)
        table = self._by_root.get(alloc.seq)
        if table is not None:
            alloc.cross = table
            table.members.add(alloc)

    @staticmethod
    def share(parent_alloc, child_alloc) -> None:
        """A fork joins its parent's group."""
        if parent_alloc.cross is not None:
            parent_alloc.cross.members.add(child_alloc)

    @staticmethod
    def detach(alloc) -> None:
        if alloc.cross is not None:
            alloc.cross.members.discard(alloc)

    def table_of(self, manager, seq) -> CrossTable:
        """The table of ``seq``'s group: ``seq`` is a live member in ``manager`` or a group's root."""
        check_sequence(seq)
        alloc = allocation_record(seq)
        table = alloc.cross if alloc is not None and alloc.manager is manager else self._by_root.get(seq)
        if table is None:
            raise SequenceStateError(f"sequence {seq.seq_id} has no cross-attention table here (allocate its "
                                     "group with encoder_seq=...)")
        return table

    def free(self, table, pool, swap) -> None:
        """Release the table's blocks (GPU or CPU) and forget it; its members keep running without it."""
        if table.on_cpu:
            swap.release(table.blocks)
        else:
            swap.forget_gpu(pool.release(table.blocks))
        del self._by_root[table.root]
        for alloc in table.members:
            alloc.cross = None
        table.members.clear()
