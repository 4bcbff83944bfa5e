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
