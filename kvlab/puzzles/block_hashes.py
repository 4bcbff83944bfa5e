"""Puzzle: chained block hashes, what prefix caching looks blocks up by. Read first: notebook 02 (§1).

**Spec.** A prompt's K/V can be reused block by block, but a block's K/V depends on every token before it, not
only on its own: so a full block's hash covers its tokens *and its parent's hash* (the block before it; None for
the first block). With ``hash_fn(parent_hash_or_None, tokens_tuple) -> int``, return the hashes of the
prompt's **full** blocks, in order (a partial last block has no hash: it is never looked up)::

    block_hashes([1, 2, 3, 4, 5], block_size=2, hash_fn=f) == [f(None, (1, 2)), f(f(None, (1, 2)), (3, 4))]

``check`` compares your answer with kvlab's own chained hashes (``kvlab.blocks.prefix_cache.block_hashes``,
which the block manager's lookup uses) under random hash functions, on prompts of random lengths.
"""

import random
from array import array

from kvlab.blocks.prefix_cache import block_hashes as kvlab_block_hashes
from kvlab.puzzles.grading import Case, Report, equal, grade, not_an_int, seeded

NAME = "block_hashes"


def block_hashes(tokens: list[int], block_size: int, hash_fn) -> list[int]:
    """The chained hashes of ``tokens``' full blocks (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 60) -> Report:
    """Run ``fn`` on ``num_cases`` random prompts (from ``seed``) against kvlab's chained hashes."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    bs = rng.choice((1, 2, 3, 4, 8))
    tokens = [rng.randrange(100) for _ in range(rng.randint(0, 5 * bs + bs - 1))]
    salt = rng.randrange(1000)

    def hash_fn(parent, block):  # a small, order-sensitive hash: readable in a report
        return (hash((salt, parent, tuple(block))) % 10_000) if parent is not None else sum(block) * 7 + salt

    full = len(tokens) // bs
    expected = kvlab_block_hashes(array("q", tokens), bs, 0, full, None, hash_fn)[0]

    def explain(got):
        if isinstance(got, list) and not not_an_int(got) and len(got) == len(expected) + 1:
            return "the last block is partial: it has no hash"
        if isinstance(got, list) and len(got) == len(expected) and got[:1] == expected[:1]:
            return "each block's hash takes its parent's hash (the block before it), not None"
        return ""
    return Case(f"tokens={tokens}, block_size={bs}, hash_fn(parent, block)", lambda fn: fn(list(tokens), bs, hash_fn),
                equal(expected, explain))
