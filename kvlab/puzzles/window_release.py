"""Puzzle: sliding-window release, which blocks a step may free. Read first: notebook 11 (§1).

**Spec.** With a sliding window of W tokens, a query at position p sees only the keys at positions
``p - W + 1 .. p``. A running sequence's next step computes positions from ``first_query`` on (its
``num_computed_tokens``), so no query of this step or a later one sees a position before
``first_query - W + 1``: a block whose every position lies before it can go back to the pool. The step
releases those blocks, except the first ``num_released`` table entries, which earlier steps released already
(they now point at the null block, block 0). Return the block ids this step releases, in table order::

    released_blocks([0, 5, 6, 7], num_released=1, first_query=13, window=4, block_size=4) == [5]

(the query at 13 sees 10 .. 13: block 5 holds positions 4 .. 7 and goes; block 6 holds 8 .. 11 and stays.)

``check`` compares your answer with what ``BlockManager(sliding_window=W).append_slots`` releases as
sequences grow.
"""

import random

from kvlab.blocks import BlockManager, Sequence
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded

NAME = "window_release"
STEPS_PER_SEQUENCE = 10


def released_blocks(block_table: list[int], num_released: int, first_query: int, window: int,
                    block_size: int) -> list[int]:
    """The blocks the next step releases, in table order (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 200) -> Report:
    """Run ``fn`` on ``num_cases`` random steps (from ``seed``) against kvlab's sliding-window manager."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, _cases(rng, num_cases), num_cases=num_cases, strict=strict)


def _cases(rng: random.Random, num_cases: int):
    made = 0
    while made < num_cases:
        bs, window = rng.choice((1, 2, 4, 8)), rng.randint(1, 20)
        manager = BlockManager(200, bs, sliding_window=window)
        seq = Sequence(range(rng.randint(1, 3 * bs + window)), bs)
        manager.allocate(seq)
        for _ in range(min(STEPS_PER_SEQUENCE, num_cases - made)):
            for _ in range(rng.choice((1, 1, rng.randint(1, bs + window)))):
                seq.append_token(7)
            yield _step(manager, seq, window)
            made += 1


def _step(manager, seq, window) -> Case:
    """Schedule ``seq``'s step and return the case of it: what the learner saw before the step."""
    table, released, first = manager.get_block_table(seq), manager.num_released_blocks(seq), seq.num_computed_tokens
    bs = manager.block_size
    manager.append_slots(seq)
    expected = table[released:manager.num_released_blocks(seq)]
    return Case(f"block_table={table}, num_released={released}, first_query={first}, window={window}, "
                f"block_size={bs}", lambda fn: fn(list(table), released, first, window, bs),
                lambda got: _judge(table, released, first, window, bs, expected, got))


def _judge(table, released, first, window, bs, expected, got):
    if same(got, expected):
        return None
    why = not_an_int(got) if isinstance(got, list) else None
    if not isinstance(got, list) or why:
        return f"expected a list of block ids {expected}, got {got!r}" + (f": {why}" if why else "")
    seen = max(0, first - window + 1)
    sees = f"the step's first query, at {first}, sees positions {seen} .. {first}"
    for i, block in enumerate(table):
        where = f"table entry {i} (block {block}, positions {i * bs} .. {i * bs + bs - 1})"
        if i < released and block in got:
            return (f"expected {expected}, got {got}: {where} is one of the first {released} entries, released "
                    "by an earlier step")
        if block in expected and block not in got:
            return f"expected {expected}, got {got}: {where} is wholly before {seen}, and {sees}: release it"
        if block in got and block not in expected:
            return f"expected {expected}, got {got}: {sees}, so {where} is still seen (or not yet written): keep it"
    return f"expected {expected}, got {got}: list them in table order"
