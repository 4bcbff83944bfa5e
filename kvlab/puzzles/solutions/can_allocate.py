"""A solution of kvlab.puzzles.can_allocate."""

from kvlab.blocks import AllocStatus


def can_allocate(num_tokens: int, block_size: int, num_free_blocks: int, num_blocks: int,
                 watermark: float) -> AllocStatus:
    needed = -(-num_tokens // block_size)
    kept_free = int(watermark * num_blocks)
    if needed > num_blocks - kept_free:
        return AllocStatus.NEVER
    if num_free_blocks - needed >= kept_free:
        return AllocStatus.OK
    return AllocStatus.LATER
