"""The tier replay notebooks 14a and 14b share: a trace's prompts replayed one at a time (allocate, then free)
through a GPU pool with a CPU offload tier behind it, counted per tier. 14a reads the hit rates as the tier
grows; 14b prices the same replays in time to first token.

``replay_through_tier`` is one pass; ``tier_hit_runs`` is the sweep, one row per tier and size, with the
share of prompt tokens each tier served. Every prompt token is a GPU hit, a tier hit or a miss (a partial last
block is never hittable), so the three shares add up to 1.
"""

import pandas as pd
from tqdm.auto import tqdm

from kvlab.blocks import BlockManager, Sequence
from kvlab.blocks.records import TierHitStats
from kvlab.errors import InvalidArgumentError


def replay_through_tier(seqs: list[Sequence], gpu_blocks: int, num_offload_blocks: int = 0, policy: str = "lru",
                        admission: str = "always") -> TierHitStats:
    """One pass over ``seqs`` (each allocated, then freed, so its full blocks stay cached) through a pool of
    ``gpu_blocks`` with a tier of ``num_offload_blocks`` (0: none); returns the tier's counters. A no-tier run
    counts its GPU hits the same way, from the pool's prefix-cache stats. The sequences are left freed, so the
    same list can be replayed again."""
    block_size = _block_size_of(seqs)
    m = BlockManager(gpu_blocks, block_size, num_offload_blocks=num_offload_blocks, offload_policy=policy,
                     offload_admission=admission)
    for seq in seqs:
        m.allocate(seq)
        m.free(seq)
    if num_offload_blocks:
        return m.tier_stats
    s = m.stats
    return TierHitStats(gpu_hit_blocks=s.hit_blocks, miss_blocks=s.queried_blocks - s.hit_blocks,
                        gpu_hit_tokens=s.hit_tokens, miss_tokens=s.queried_tokens - s.hit_tokens)


def tier_hit_runs(seqs: list[Sequence], gpu_blocks: int, tiers: dict[str, tuple[str, str]], tier_blocks: list[int],
                  progress: bool = True) -> pd.DataFrame:
    """A no-tier run (``tier="none"``, ``blocks=0``), then every tier of ``tiers`` (label -> (policy, admission))
    at every size of ``tier_blocks``: one row each with ``TierHitStats``' counters and the shares of prompt
    tokens ``gpu_hit``, ``tier_hit``, ``miss`` and ``total_hit`` (GPU + tier). ``progress``: a tqdm bar per
    tier."""
    _block_size_of(seqs)  # a bad list fails here, before any replay
    if not tiers or not tier_blocks or any(int(b) != b or b < 1 for b in tier_blocks):
        raise InvalidArgumentError(f"need at least one tier and tier sizes of at least 1 block, got tiers "
                                   f"{list(tiers)} and sizes {list(tier_blocks)}")
    runs = [dict(tier="none", blocks=0, **vars(replay_through_tier(seqs, gpu_blocks)))]
    for label, (policy, admission) in tiers.items():
        for blocks in tqdm(tier_blocks, desc=label, disable=not progress):
            runs.append(dict(tier=label, blocks=blocks, **vars(replay_through_tier(seqs, gpu_blocks, blocks, policy,
                                                                                   admission))))
    runs = pd.DataFrame(runs)
    prompt_tokens = sum(seq.num_prompt_tokens for seq in seqs)
    for part in ("gpu_hit", "tier_hit", "miss"):
        runs[part] = runs[f"{part}_tokens"] / prompt_tokens
    runs["total_hit"] = runs.gpu_hit + runs.tier_hit
    return runs


def _block_size_of(seqs) -> int:
    """The block size every sequence shares (the pool's); raises InvalidArgumentError for none or a mix."""
    sizes = {seq.block_size for seq in seqs}
    if len(sizes) != 1:
        raise InvalidArgumentError(f"need at least one sequence, all of one block size; got {len(seqs)} sequences "
                                   f"of block sizes {sorted(sizes)}")
    return sizes.pop()
