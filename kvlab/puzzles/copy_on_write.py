"""Puzzle: copy-on-write on append. Read first: notebook 03a (forks and copy-on-write).

**Spec.** A running sequence's next step writes the K/V of positions ``num_computed_tokens .. num_tokens - 1``
(the tokens appended since its last step). Before the step, say

* ``copies``: the indices i of the table entries the step writes whose block is shared
  (``ref_counts[block_table[i]] > 1``, e.g. with a fork): each must be copied into a fresh block first, or
  the write would change what the other holders read (copy-on-write). A block this sequence holds alone is
  written in place. List them in increasing order.
* ``num_new_blocks``: how many blocks to append to the table so that every position up to
  ``num_tokens - 1`` has one.

``ref_counts`` maps each block of the table to its reference count. Return ``(copies, num_new_blocks)``::

    plan_append([4, 9], {4: 2, 9: 2}, num_computed_tokens=6, num_tokens=9, block_size=4) == ([1], 1)

``check`` compares your answer with what ``BlockManager.append_slots`` does to forked sequences that grow
at random.
"""

import random
from collections.abc import Iterable

from kvlab.blocks import BlockManager, Sequence
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded

NAME = "copy_on_write"
STEPS_PER_POOL = 8


def plan_append(block_table: list[int], ref_counts: dict[int, int], num_computed_tokens: int, num_tokens: int,
                block_size: int) -> tuple[list[int], int]:
    """``(copies, num_new_blocks)`` of the next step (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 200) -> Report:
    """Run ``fn`` on ``num_cases`` random steps of forked sequences (from ``seed``) against kvlab's manager."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, _cases(rng, num_cases), num_cases=num_cases, strict=strict)


def _cases(rng: random.Random, num_cases: int):
    made = 0
    while made < num_cases:
        bs = rng.choice((1, 2, 4, 8))
        manager = BlockManager(64, bs, enable_prefix_caching=rng.random() < 0.5)
        parent = Sequence([rng.randrange(50) for _ in range(rng.randint(1, 4 * bs))], bs)
        manager.allocate(parent)
        if rng.random() < 0.5:  # slots reserved ahead (as for drafts): a fork then shares blocks not yet written,
            manager.append_slots(parent, num_lookahead_slots=rng.randint(1, 2 * bs))  # and a step may write two
        family = [parent]
        for _ in range(rng.randint(1, 3)):
            family.append(Sequence([], bs))
            manager.fork(rng.choice(family[:-1]), family[-1])
        for _ in range(min(STEPS_PER_POOL, num_cases - made)):
            seq = rng.choice(family)
            for _ in range(rng.randint(1, 2 * bs)):
                seq.append_token(rng.randrange(50))
            if not manager.can_append_slots(seq):
                break
            yield _step(manager, seq)
            made += 1


def _step(manager, seq) -> Case:
    """Schedule ``seq``'s step on ``manager`` and return the case of it: what the learner saw before the step."""
    table = manager.get_block_table(seq)
    refs = {block: manager.ref_count(block) for block in table}
    computed, n, bs = seq.num_computed_tokens, seq.num_tokens, manager.block_size
    pairs = manager.append_slots(seq)
    after = manager.get_block_table(seq)
    copies = [i for i, (old, new) in enumerate(zip(table, after)) if old != new]
    assert sorted(pairs) == sorted((table[i], after[i]) for i in copies)  # the pairs append_slots returned
    expected = (copies, len(after) - len(table))
    return Case(f"block_table={table}, ref_counts={refs}, num_computed_tokens={computed}, num_tokens={n}, "
                f"block_size={bs}", lambda fn: fn(list(table), dict(refs), computed, n, bs),
                lambda got: _judge(table, refs, computed, n, bs, expected, got))


def _judge(table, refs, computed, n, bs, expected, got):
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], Iterable) and not isinstance(got[0], str):
        got = (list(got[0]), got[1])  # copies in any sequence
    if same(got, expected):
        return None
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], list)):
        return f"expected a tuple (copies, num_new_blocks) = {expected}, got {got!r}"
    copies, num_new = got
    wrong = not_an_int(copies + [num_new])
    if wrong:
        return f"expected (copies, num_new_blocks) = {expected}, got {got!r}: {wrong}"
    want_copies, want_new = expected
    for i in sorted(set(copies) ^ set(want_copies)):
        if i >= len(table):
            return f"expected copies {want_copies}, got {copies}: the table has no index {i}"
        held = (f"table index {i} (block {table[i]}, ref count {refs[table[i]]}, positions {i * bs} .. "
                f"{i * bs + bs - 1})")
        if i in want_copies:
            return f"expected copies {want_copies}, got {copies}: {held} is written by this step and shared: copy it"
        if refs[table[i]] == 1:
            return f"expected copies {want_copies}, got {copies}: {held} is held by this sequence alone: write in place"
        return (f"expected copies {want_copies}, got {copies}: {held} is not written by this step, which writes "
                f"positions {computed} .. {n - 1}")
    if copies != want_copies:
        return f"expected copies {want_copies}, got {copies}: list them in increasing order"
    return (f"expected num_new_blocks = {want_new}, got {num_new}: positions up to {n - 1} need ceil({n} / {bs}) = "
            f"{-(-n // bs)} blocks and the table has {len(table)}")
