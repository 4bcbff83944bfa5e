"""Small value types the block manager hands out: admission answers, events, the offload tier's copies and
prefix-cache counters."""

import enum
from dataclasses import astuple, dataclass
from typing import NamedTuple, Optional


class AllocStatus(enum.Enum):
    """Answer of ``can_allocate``, ``can_swap_in`` and ``can_swap_out``.

    True in a boolean context only when OK: vLLM's ``can_swap_out`` is a bool, so code written for it
    (``if manager.can_swap_out(seq): manager.swap_out(seq)``) must not go ahead on LATER or NEVER."""
    OK = "ok"        # fits now
    LATER = "later"  # fits once other sequences free blocks
    NEVER = "never"  # can never fit in this pool

    def __bool__(self) -> bool:
        return self is AllocStatus.OK


class Event(NamedTuple):
    """One step of the manager's work, recorded when ``record_events=True`` (for timelines and teaching)."""
    kind: str
    seq_id: Optional[int] = None
    block_id: Optional[int] = None
    other: Optional[int] = None


class TierMove(NamedTuple):
    """One batch of the offload tier's copies, in order: ``sources[i]`` is copied to ``targets[i]``. "offload":
    GPU blocks to CPU slots; "promote": CPU slots to GPU blocks."""
    kind: str
    sources: list[int]
    targets: list[int]


@dataclass
class PrefixCacheStats:
    """Counters of ``allocate``'s prefix-cache lookups, cumulative since the manager was made (or
    ``reset_prefix_cache``); ``make_prefix_cache_stats()`` gives those since its last call (a run's).

    What is hittable: only full blocks, and never the block holding the prompt's last token, which is
    always computed (its logits are needed). A prompt of n tokens queries all n tokens and its n // block_size
    full blocks, and hits at most (n - 1) // block_size blocks: a prompt of exactly N blocks at most N - 1,
    one of N blocks plus a partial block all N. So a shared prefix shorter than a block hits nothing, and
    even a repeated prompt stays below 100%.

    A sequence re-admitted after a preemption by recompute finds its own blocks again: that lookup is not a
    prefix hit (vLLM #25780) and goes to ``recomputed_*`` instead (vLLM's ``preempted_queries`` /
    ``preempted_hits``): ``recomputed_queried_*`` what it asked for, ``recomputed_*`` what it found again.
    ``hit_rate`` counts neither."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    recomputed_queried_tokens: int = 0
    recomputed_queried_blocks: int = 0
    recomputed_tokens: int = 0
    recomputed_blocks: int = 0

    def count_lookup(self, num_tokens: int, num_blocks: int, num_hits: int, block_size: int,
                     preempted: bool = False, num_partial_tokens: int = 0) -> None:
        """One prompt of ``num_tokens`` tokens and ``num_blocks`` full blocks, ``num_hits`` of them cached, then
        ``num_partial_tokens`` of a partial block (``prefix_match_unit``: in the tokens, not the blocks);
        ``preempted``: the prompt of a sequence preempted by recompute (its recomputation)."""
        if preempted:
            self.recomputed_queried_tokens += num_tokens
            self.recomputed_queried_blocks += num_blocks
            self.recomputed_tokens += num_hits * block_size + num_partial_tokens
            self.recomputed_blocks += num_hits
            return
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hits * block_size + num_partial_tokens
        self.queried_blocks += num_blocks
        self.hit_blocks += num_hits

    def since(self, earlier: "PrefixCacheStats") -> "PrefixCacheStats":
        """The counts added after ``earlier`` (a copy of these counters taken then)."""
        return PrefixCacheStats(*(now - then for now, then in zip(astuple(self), astuple(earlier))))

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any query); recomputations after preemption excluded."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class TierHitStats:
    """``allocate``'s lookups with an offload tier (``manager.tier_stats``), per tier: each prompt's full blocks
    hit on the GPU, hit in the tier (promoted: copied, not computed) or missed, and in tokens the same, where
    the misses are every prompt token not hit (a partial last block is never hittable). ``offloaded_blocks``:
    blocks the tier took in from GPU evictions. A sequence re-admitted after a preemption by recompute is not
    counted (its lookup is a recomputation: ``PrefixCacheStats.recomputed_*``)."""
    gpu_hit_blocks: int = 0
    tier_hit_blocks: int = 0
    miss_blocks: int = 0
    gpu_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    miss_tokens: int = 0
    offloaded_blocks: int = 0

    def count_lookup(self, num_tokens: int, num_blocks: int, gpu_hits: int, tier_hits: int, block_size: int) -> None:
        """One prompt of ``num_tokens`` tokens and ``num_blocks`` full blocks."""
        self.gpu_hit_blocks += gpu_hits
        self.tier_hit_blocks += tier_hits
        self.miss_blocks += num_blocks - gpu_hits - tier_hits
        self.gpu_hit_tokens += gpu_hits * block_size
        self.tier_hit_tokens += tier_hits * block_size
        self.miss_tokens += num_tokens - (gpu_hits + tier_hits) * block_size
