"""The manager's record of one allocated sequence, and of one request group's cross-attention blocks.

A ``Sequence`` knows its record (``allocation_record(seq)``) and the record knows its manager, so ownership is
explicit: a sequence is allocated in at most one manager at a time, and a manager acts only on sequences
whose record it created. The block table lives here, in the record; ``Sequence.block_table`` is a
read-only copy of it.
"""

from kvlab.blocks.sequence import Sequence, allocation_record, token_buffer
from kvlab.errors import InvalidArgumentError, SequenceStateError


class Allocation:
    """How far the sequence got is not here: it is ``seq.num_computed_tokens`` (kvlab.blocks.sequence), which
    the manager advances when it schedules a step and ``check_invariants`` audits against this record."""
    __slots__ = ("manager", "seq", "table", "on_cpu", "num_sealed", "last_hash", "last_content",
                 "num_released", "num_slots", "num_computed", "cross", "forked_drafts")

    def __init__(self, manager, seq, table, num_sealed, last_hash, last_content, num_released, num_computed,
                 num_slots, cross=None):
        self.manager, self.seq, self.table, self.on_cpu = manager, seq, table, False
        # Leading full blocks already sealed, and the chain's tail (hash, content id) that the next seal extends.
        # With prefix caching, num_sealed == seq.num_computed_tokens // block_size: a block is sealed (hittable)
        # exactly when the step that writes its last token is scheduled, never before.
        self.num_sealed, self.last_hash, self.last_content = num_sealed, last_hash, last_content
        self.num_released = num_released   # leading table entries released by the sliding window
        # Positions < num_slots have a slot: the scheduled ones (< seq.num_computed_tokens) plus lookahead
        # slots. The table holds exactly ceil(num_slots / block_size) entries (it never shrinks, so this is the
        # largest reservation so far).
        self.num_slots = num_slots
        # vLLM V0's mark (kvlab.blocks.vllm_v0): positions < num_computed are confirmed written (a step ran since).
        self.num_computed = num_computed
        self.cross = cross                 # the group's CrossTable (encoder-decoder), shared by its forks
        # Blocks shared with a fork while drafts were in flight: a sibling may seal one (kvlab.blocks.drafts).
        self.forked_drafts = frozenset()

    @classmethod
    def admitted(cls, manager, seq, plan, table, last_content) -> "Allocation":
        """The record of a prompt that ``manager.allocate`` just gave ``table`` by ``plan``
        (kvlab.blocks.planning.AllocationPlan): its hits are computed and its first chunk scheduled."""
        sealed = plan.num_sealed
        return cls(manager, seq, table, sealed, plan.hashes[sealed - 1] if sealed else None, last_content,
                   plan.first_live, (len(plan.hits) + len(plan.tier_hits)) * manager.block_size, plan.scheduled)

    def live_blocks(self) -> list[int]:
        """Table entries that hold a reference (the sliding window's released ones do not)."""
        return self.table[self.num_released:]

    def copy_for(self, seq) -> "Allocation":
        twin = Allocation(self.manager, seq, list(self.table), self.num_sealed, self.last_hash,
                          self.last_content, self.num_released, self.num_computed, self.num_slots, self.cross)
        twin.forked_drafts = self.forked_drafts
        return twin


class CrossTable:
    """The encoder's K/V blocks of one request group (vLLM's cross-attention block table): written once by
    the encoder pass, read by every decoder sequence of the group, never prefix-cached. The group holds one
    reference to each block, however many forks it has; the blocks move to the CPU when the last member on
    the GPU swaps out and come back with the first one that swaps in."""
    __slots__ = ("root", "blocks", "num_tokens", "on_cpu", "members")

    def __init__(self, root, blocks, num_tokens):
        self.root, self.blocks, self.num_tokens, self.on_cpu = root, blocks, num_tokens, False
        self.members: set = set()  # allocations of the group's live sequences

    def members_on_gpu(self) -> int:
        return sum(1 for alloc in self.members if not alloc.on_cpu)


def check_sequence(seq) -> Sequence:
    if not isinstance(seq, Sequence):
        raise InvalidArgumentError(f"expected a kvlab.Sequence, got {type(seq).__name__}")
    return seq


def check_block_size_matches(manager, seq) -> None:
    if seq.block_size != manager.block_size:
        raise InvalidArgumentError(f"sequence {seq.seq_id} has block_size {seq.block_size}, "
                                   f"this manager uses {manager.block_size}")


def check_unallocated(manager, seq, need_tokens=True, same_block_size=True) -> None:
    """``seq`` may be allocated (or, with ``need_tokens=False, same_block_size=False``, forked into) now."""
    check_sequence(seq)
    if same_block_size:
        check_block_size_matches(manager, seq)
    owner = allocation_record(seq)
    if owner is not None:
        where = "this manager" if owner.manager is manager else "another BlockManager; free it there first"
        raise SequenceStateError(f"sequence {seq.seq_id} is already allocated in {where}")
    if need_tokens and seq.num_tokens == 0:
        raise InvalidArgumentError(f"sequence {seq.seq_id} has no tokens to allocate")
    if need_tokens and token_buffer(seq) is None:
        raise SequenceStateError(f"sequence {seq.seq_id} is a decode-only copy without its tokens")


def allocation_of(manager, seq) -> Allocation:
    """The record ``manager`` keeps for ``seq``, or SequenceStateError."""
    check_sequence(seq)
    alloc = allocation_record(seq)
    if alloc is None or alloc.manager is not manager:
        raise SequenceStateError(f"sequence {seq.seq_id} is not allocated in this manager (never allocated, "
                                 "already freed, allocated in another manager, or an unpickled copy)")
    return alloc
