"""Puzzle: an offload tier behind the GPU pool: what a prompt promotes, what the tier takes in and drops.
Read first: notebook 14a (§1).

**Spec.** kvlab's CPU offload tier (vLLM V1's ``kv_offload``) is a second prefix cache of ``num_slots`` block
hashes, least recently used (LRU) first in ``tier``. A prompt of ``num_tokens`` tokens, with
``prompt_hashes`` the chained hashes of its full blocks, is admitted; its first ``num_gpu_hits`` blocks hit on
the GPU. In this order::

    1. tier hits (promoted): continuing after the GPU hits, the longest run prompt_hashes[num_gpu_hits], ...
       that the tier holds, as long as the hits (GPU and tier together) stay within (num_tokens - 1) //
       block_size blocks (the last prompt token is always computed). Each is copied into a new GPU block; the
       tier keeps its copy (it is inclusive).
    2. offloads: the prompt takes new GPU blocks, the promoted ones first; ``overwritten[i]`` is the hash of
       the cached block the i-th new block overwrites (None: it held nothing cached). In that order each such
       hash is offered to the tier: skipped if the tier holds it already; else stored as the most recently
       used, in a free slot if there is one (fewer than num_slots entries), else in the place of the least
       recently used entry, which for the promoted blocks' offers must not be a hash being promoted (its copy
       to the GPU is not made yet: skip the offer if every entry is); the later offers come after the
       promotions' copies, so any entry may go.
    3. the uses: the tier was asked about prompt_hashes[num_gpu_hits:] (all of them, hit or not): visiting them
       from the LAST to the first, each one the tier holds becomes the most recently used, so the prompt's
       first block asked about ends up the most recent (its blocks are reused in the order they were used).

Return ``(promoted, tier)``: the promoted hashes, in order, and the tier's hashes after the admission, least
recently used first (a new list).

``check`` runs prompts through kvlab's ``BlockManager`` with an offload tier (LRU, every block
admitted), and compares your answer with what its ``allocate`` does to the tier.
"""

import random

from kvlab.blocks import AllocStatus, BlockManager, Sequence
from kvlab.blocks.tiers import make_shared_tier
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, numbering_hash_fn, same, seeded

NAME = "tier_promotion"


def tier_promotion(tier: list[int], num_slots: int, num_tokens: int, block_size: int, prompt_hashes: list[int],
                   num_gpu_hits: int, overwritten: list) -> tuple[list[int], list[int]]:
    """``(promoted, tier)`` after admitting the prompt (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 300) -> Report:
    """Run ``fn`` on ``num_cases`` random pools and tiers (from ``seed``) against kvlab's offload tier."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    while True:  # a pool, a tier and a prompt that fits
        bs, hash_fn = rng.choice((1, 2, 4)), numbering_hash_fn(rng)
        # A shared tier's content ids are interned: a block computed again after its eviction chains to the
        # tier's entries as before, so a hit is decided by the hashes, as the spec says.
        tier = make_shared_tier(rng.randint(2, 6))
        manager = BlockManager(rng.randint(3, 6), bs, shared_tier=tier, hash_fn=hash_fn)
        shared = [rng.randrange(3) for _ in range(5 * bs)]  # prompts share prefixes of this
        for _ in range(rng.randint(1, 8)):  # one after the other, as in notebook 14a: the pool evicts to the tier
            prefix = shared[:rng.randint(0, 5 * bs)] if rng.random() < 0.6 else []  # else it only evicts
            seq = Sequence(prefix + [rng.randrange(9) for _ in range(rng.randint(1, 3 * bs))], bs)
            if manager.can_allocate(seq) is AllocStatus.OK:
                manager.allocate(seq)
                manager.free(seq)
        prompt = Sequence(shared[:rng.randint(1, 5 * bs)], bs)
        if manager.can_allocate(prompt) is AllocStatus.OK:
            break
    before = list(tier.order.resident())
    hit = manager.lookup(prompt)
    promoted = [tier.index.hash[slot] for slot in hit.tier_hits]  # before the offloads reuse slots
    held = [manager.block_hash(b) if manager.is_cached(b) else None for b in range(manager.num_blocks)]
    manager.allocate(prompt)
    overwritten = [held[b] for b in manager.get_block_table(prompt)[len(hit.hits[0]):]]
    expected = (promoted, list(tier.order.resident()))
    hashes, num_gpu_hits, num_tokens, slots = list(hit.hashes), len(hit.hits[0]), prompt.num_tokens, tier.num_slots
    inputs = (f"tier={before}, num_slots={slots}, num_tokens={num_tokens}, block_size={bs}, prompt_hashes={hashes}, "
              f"num_gpu_hits={num_gpu_hits}, overwritten={overwritten}")
    return Case(inputs,
                lambda fn: fn(list(before), slots, num_tokens, bs, list(hashes), num_gpu_hits, list(overwritten)),
                lambda got: _judge(got, expected))


def _judge(got, expected) -> str | None:
    if not (type(got) in (tuple, list) and len(got) == 2 and all(type(part) is list for part in got)):
        return f"expected (promoted, tier), two lists, got {got!r}"
    for part in got:
        wrong = not_an_int(part)
        if wrong:
            return wrong
    promoted, tier = expected
    if not same(got[0], promoted):
        return (f"expected promoted {promoted}, got {got[0]}: the tier hits continue the GPU hits, a run the tier "
                "holds, within (num_tokens - 1) // block_size blocks in all")
    if not same(got[1], tier):
        return (f"promoted is right, but expected tier {tier} (least recently used first), got {got[1]}: offers "
                "first (held: skipped; full: drop the least recently used not being promoted), then the prompt's "
                "hashes after the GPU hits become the most recent, visited last to first")
    return None
