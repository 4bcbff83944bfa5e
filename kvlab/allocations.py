"""Which sequences a manager holds, and the checks that a sequence handed to it is one of them.

The manager keys its records by ``seq_id`` but also keeps the Sequence object: an unpickled copy carries
the same id, and acting on it would update a table the manager is not tracking.
"""

from kvlab.errors import InvalidArgumentError, SequenceStateError
from kvlab.sequence import Sequence


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(name, value, minimum) -> int:
    if not is_int(value) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class Allocation:
    """The manager's own record of an allocated sequence."""
    __slots__ = ("seq", "on_cpu", "num_sealed", "last_hash", "last_content", "num_released", "num_written")

    def __init__(self, seq, num_sealed, last_hash, last_content, num_released):
        self.seq, self.on_cpu = seq, False
        # Leading full blocks already sealed, and the chain's tail (hash, content id) that the next seal extends.
        self.num_sealed, self.last_hash, self.last_content = num_sealed, last_hash, last_content
        self.num_released = num_released   # leading table entries released by the sliding window
        self.num_written = seq.num_tokens  # positions before this already have their K/V written

    def copy_for(self, seq) -> "Allocation":
        twin = Allocation(seq, self.num_sealed, self.last_hash, self.last_content, self.num_released)
        twin.num_written = self.num_written
        return twin


class Registry:
    """BlockManager's records of allocated sequences (a mixin: it uses ``_allocs`` and ``block_size``)."""

    def num_released_blocks(self, seq) -> int:
        """Leading block-table entries the sliding window released (they point at the null block on the
        GPU; they are skipped when the sequence is swapped)."""
        return self._alloc(seq).num_released

    def _check_new(self, seq, need_tokens=True) -> None:
        if not isinstance(seq, Sequence):
            raise InvalidArgumentError(f"expected a kvlab.Sequence, got {type(seq).__name__}")
        if seq.block_size != self.block_size:
            raise InvalidArgumentError(f"sequence {seq.seq_id} has block_size {seq.block_size}, "
                                       f"this manager uses {self.block_size}")
        if seq.seq_id in self._allocs:
            raise SequenceStateError(f"sequence {seq.seq_id} is already allocated")
        if need_tokens and seq.num_tokens == 0:
            raise InvalidArgumentError(f"sequence {seq.seq_id} has no tokens to allocate")
        if need_tokens and seq._tokens is None:
            raise SequenceStateError(f"sequence {seq.seq_id} is a decode-only copy without its tokens")

    def _alloc(self, seq) -> Allocation:
        if not isinstance(seq, Sequence):
            raise InvalidArgumentError(f"expected a kvlab.Sequence, got {type(seq).__name__}")
        alloc = self._allocs.get(seq.seq_id)
        if alloc is None:
            raise SequenceStateError(f"sequence {seq.seq_id} is not allocated in this manager "
                                     "(never allocated, or already freed)")
        if alloc.seq is not seq:
            raise SequenceStateError(f"another Sequence object holds seq_id {seq.seq_id} here (an unpickled "
                                     "copy?); pass the object that was allocated")
        return alloc

    def _on_gpu(self, seq) -> Allocation:
        alloc = self._alloc(seq)
        if alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is swapped out; swap_in first")
        return alloc

    def _on_cpu(self, seq) -> Allocation:
        alloc = self._alloc(seq)
        if not alloc.on_cpu:
            raise SequenceStateError(f"sequence {seq.seq_id} is not swapped out")
        return alloc
