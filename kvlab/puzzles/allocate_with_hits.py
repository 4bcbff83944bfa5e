"""Puzzle: admit a prompt with prefix hits: reuse the cached blocks, take new ones for the rest.
Read first: notebook 02 (§1, §3-§4), and the puzzles ``block_hashes`` and ``lru_policy``.

**Spec.** A pool of blocks, each with a reference count (``ref_counts[b]``: how many sequences hold block b).
The prefix cache maps a full block's chained hash to the block holding it (``cached``: hash -> block); a cached
block may be in use (ref count > 0) or free and still warm (ref count 0: its K/V is kept until the block is
reused). ``free_queue`` lists the free blocks (ref count 0) in the order they are handed out, next first: kvlab's
LRU puts never-cached blocks first, then cached ones least recently freed first (puzzle ``lru_policy``).

A prompt of ``num_tokens`` tokens arrives, with ``prompt_hashes``, the chained hashes of its full blocks.
Admit it, and return ``(block_table, ref_counts, free_queue)`` after the admission (new lists)::

    hits = the longest run prompt_hashes[0], prompt_hashes[1], ... found in cached, at most
           (num_tokens - 1) // block_size blocks: the prompt's last token is always computed (its logits
           give the first new token), so a prompt that is all cached still recomputes its last block
    each hit block: ref count + 1; a free one leaves free_queue (it is no longer evictable)
    then ceil(num_tokens / block_size) - len(hits) new blocks, taken from the front of free_queue (after the
    hits left it), each with ref count 1
    block_table = the hit blocks, then the new blocks, in order

``check`` builds pools by running kvlab's ``BlockManager`` (prompts sharing prefixes, some freed again), and
compares your answer with what ``BlockManager.allocate`` does to the same pool. Every case fits in the pool.
"""

import random

from kvlab.blocks import AllocStatus, BlockManager, Sequence
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, numbering_hash_fn, same, seeded

NAME = "allocate_with_hits"


def allocate_with_hits(num_tokens: int, block_size: int, prompt_hashes: list[int], cached: dict[int, int],
                       ref_counts: list[int], free_queue: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``(block_table, ref_counts, free_queue)`` after admitting the prompt (see the module docstring). Your
    code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 150) -> Report:
    """Run ``fn`` on ``num_cases`` random pools and prompts (from ``seed``) against kvlab's ``allocate``."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    while True:  # a pool and a prompt that fits in it
        bs, num_blocks, hash_fn = rng.choice((1, 2, 4)), rng.randint(6, 16), numbering_hash_fn(rng)
        manager = BlockManager(num_blocks, bs, hash_fn=hash_fn)
        shared = [rng.randrange(3) for _ in range(6 * bs)]  # prompts share prefixes of this
        held = []
        for _ in range(rng.randint(1, 5)):
            seq = Sequence(shared[:rng.randint(0, 5 * bs)] + [rng.randrange(4) for _ in range(rng.randint(1, 3 * bs))],
                           bs)
            if manager.can_allocate(seq) is AllocStatus.OK:
                manager.allocate(seq)
                held.append(seq)
        for seq in rng.sample(held, rng.randint(0, len(held))):  # freed: their cached blocks stay warm
            manager.free(seq)
        length = rng.choice((rng.randint(1, 5 * bs), rng.randint(1, 5) * bs))  # whole blocks: the last-token rule
        prompt = Sequence(shared[:length] if rng.random() < 0.8 else [rng.randrange(4) for _ in range(length)], bs)
        if manager.can_allocate(prompt) is AllocStatus.OK:
            break
    prompt_hashes = list(manager.lookup(prompt).hashes)
    cached = {manager.block_hash(b): b for b in range(num_blocks) if manager.is_cached(b)}
    refs = [manager.ref_count(b) for b in range(num_blocks)]
    free = manager.free_block_ids()
    manager.allocate(prompt)
    expected = (manager.get_block_table(prompt), [manager.ref_count(b) for b in range(num_blocks)],
                manager.free_block_ids())
    num_hits = prompt.num_cached_tokens // bs
    inputs = (f"num_tokens={length}, block_size={bs}, prompt_hashes={prompt_hashes}, cached={cached}, "
              f"ref_counts={refs}, free_queue={free}")
    return Case(inputs, lambda fn: fn(length, bs, list(prompt_hashes), dict(cached), list(refs), list(free)),
                lambda got: _judge(got, expected, num_hits, length, bs, prompt_hashes, cached))


def _judge(got, expected, num_hits, num_tokens, bs, prompt_hashes, cached) -> str | None:
    if not (type(got) in (tuple, list) and len(got) == 3 and all(type(part) is list for part in got)):
        return f"expected (block_table, ref_counts, free_queue), three lists, got {got!r}"
    for part in got:
        wrong = not_an_int(part)
        if wrong:
            return wrong
    table, refs, free = expected
    if not same(got[0], table):
        run = 0
        while run < len(prompt_hashes) and prompt_hashes[run] in cached:
            run += 1
        why = (f"the first {num_hits} blocks are hits" + (
            f" (the prompt's first {run} hashes are cached, but its last token, {num_tokens - 1}, is always "
            f"computed: at most ({num_tokens} - 1) // {bs} = {(num_tokens - 1) // bs} hit blocks)"
            if run > num_hits else "") + "; the new blocks come from the front of free_queue once the hits left it")
        return f"expected block_table {table}, got {got[0]}: {why}"
    if not same(got[1], refs):
        block = next(b for b, (g, e) in enumerate(zip(got[1], refs)) if g != e)
        return (f"block_table {table} is right, but expected ref_counts {refs}, got {got[1]}: block {block} "
                f"has {refs[block]} (each block of the table gains one reference, hit or new)")
    if not same(got[2], free):
        return (f"block_table and ref_counts are right, but expected free_queue {free}, got {got[2]}: the hits "
                f"that were free leave it, the new blocks were taken from its front, the rest keep their order")
    return None
