"""A solution of kvlab.puzzles.slot_mapping."""


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
