"""A solution of kvlab.puzzles.window_release."""


def released_blocks(block_table: list[int], num_released: int, first_query: int, window: int,
                    block_size: int) -> list[int]:
    oldest_seen = max(0, first_query - window + 1)  # no query from first_query on sees a position before it
    first_live = oldest_seen // block_size          # blocks wholly before it: 0 .. first_live - 1
    return block_table[num_released:first_live]
