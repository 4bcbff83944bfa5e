"""A solution of kvlab.puzzles.copy_on_write."""


def plan_append(block_table: list[int], ref_counts: dict[int, int], num_computed_tokens: int, num_tokens: int,
                block_size: int) -> tuple[list[int], int]:
    blocks_needed = -(-num_tokens // block_size)
    # The step writes blocks from the one holding its first position to the last one the table already has.
    written = range(num_computed_tokens // block_size, min(len(block_table), blocks_needed))
    copies = [i for i in written if ref_counts[block_table[i]] > 1]
    return copies, max(0, blocks_needed - len(block_table))
