"""Shared helpers for block-manager tests."""

from kvlab import BlockManager, Sequence


def snapshot(manager: BlockManager) -> tuple:
    """Everything a failed operation must leave unchanged."""
    return (manager.num_free_blocks, manager.free_block_ids(),
            [manager.ref_count(b) for b in range(manager.num_blocks)],
            [manager.block_hash(b) for b in range(manager.num_blocks)], vars(manager.stats).copy(),
            manager.num_free_cpu_blocks)


def allocated(manager: BlockManager, tokens, block_size=None) -> Sequence:
    seq = Sequence(tokens, block_size or manager.block_size)
    manager.allocate(seq)
    return seq


def grow(manager: BlockManager, seq: Sequence, tokens) -> list:
    """Append tokens one decode step at a time; returns all copy-on-write pairs."""
    pairs = []
    for t in tokens:
        seq.append_token(t)
        pairs += manager.append_slots(seq)
    return pairs


class TierMoves:
    """The offload tier's copies that ``manager``'s calls return (``Admitted.tier_moves``, ``BlockCopies.tier_moves``),
    collected in order, so a test reads them with ``take()``: one ``(kind, source, target)`` per block copied (or
    the ``TierMove`` batches the calls returned, with ``batches=True``)."""

    def __init__(self, manager):
        self.moves = []
        for name in ("allocate", "append_slots", "swap_in", "swap_out"):
            setattr(manager, name, self._recording(getattr(manager, name)))

    def _recording(self, call):
        def recorded(*args, **kwargs):
            result = call(*args, **kwargs)
            self.moves += result.tier_moves
            return result
        return recorded

    def take(self, batches: bool = False) -> list:
        moves, self.moves = self.moves, []
        if batches:
            return moves
        return [(kind, src, dst) for kind, sources, targets in moves for src, dst in zip(sources, targets)]
