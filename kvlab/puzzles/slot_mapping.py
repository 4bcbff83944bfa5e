"""Puzzle: the slot mapping of a sequence. Read first: notebook 01 (§2-3) and notebook 04 (§3).

**Spec.** The token at position p of a sequence sits in its logical block ``p // block_size``, at offset
``p % block_size``. The sequence's block table maps logical block i to the physical block ``block_table[i]``,
and the token's K/V lives in the cache's slot ``block_table[p // block_size] * block_size + p % block_size``
(the index ``reshape_and_cache`` writes to). Return the slots of positions ``start .. end - 1``, in order::

    slot_mapping([7, 2], block_size=4, start=3, end=6) == [31, 8, 9]

``check`` compares your answer with ``BlockManager.slot_mapping`` on sequences allocated in a pool that other
sequences came and went from, so their tables are not in order.
"""

import random

from kvlab.blocks import BlockManager, Sequence
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded

NAME = "slot_mapping"


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots of positions ``start .. end - 1`` (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 100) -> Report:
    """Run ``fn`` on ``num_cases`` random sequences (from ``seed``) against kvlab's own slot mapping."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    bs = rng.choice((1, 2, 4, 8, 16))
    # Fill most of the pool with short sequences, free some in random order, then allocate ours: it gets the
    # never-used blocks first, then the freed ones in the order they were freed.
    others = [rng.randint(1, 3 * bs) for _ in range(rng.randint(2, 6))]
    num_blocks = sum(-(-n // bs) for n in others) + rng.randint(1, 3)
    manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
    live = []
    for n in others:
        live.append(Sequence(range(n), bs))
        manager.allocate(live[-1])
    rng.shuffle(live)
    for seq in live[:rng.randint(1, len(live))]:
        manager.free(seq)
    num_tokens = rng.randint(1, manager.num_free_blocks * bs)
    seq = Sequence(range(num_tokens), bs)
    manager.allocate(seq)
    start = rng.randint(0, num_tokens)
    end = rng.randint(start, num_tokens)
    table, expected = manager.get_block_table(seq), manager.slot_mapping(seq, start, end)
    return Case(f"block_table={table}, block_size={bs}, start={start}, end={end}",
                lambda fn: fn(list(table), bs, start, end), lambda got: _judge(table, bs, start, end, expected, got))


def _judge(table, bs, start, end, expected, got):
    if same(got, expected):
        return None
    why = not_an_int(got) if isinstance(got, list) else None
    if not isinstance(got, list) or why or len(got) != len(expected):
        return (f"expected a list of {len(expected)} slots (positions {start} .. {end - 1}), got {got!r}"
                + (f": {why}" if why else ""))
    i = next(i for i, (e, g) in enumerate(zip(expected, got)) if e != g)
    p = start + i
    return (f"expected {expected}, got {got}: position {p} is in logical block {p // bs} at offset {p % bs}, and "
            f"block_table[{p // bs}] = {table[p // bs]}, so its slot is {table[p // bs]} x {bs} + {p % bs} = "
            f"{expected[i]}, not {got[i]}")
