"""Small value types the block manager hands out: admission answers, events and prefix-cache counters."""

import enum
from dataclasses import dataclass
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


@dataclass
class PrefixCacheStats:
    """Counters of ``allocate``'s prefix-cache lookups (a prompt's full blocks are queried)."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0

    def count_lookup(self, num_tokens: int, num_blocks: int, num_hits: int, block_size: int) -> None:
        """One prompt of ``num_tokens`` tokens and ``num_blocks`` full blocks, ``num_hits`` of them cached."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hits * block_size
        self.queried_blocks += num_blocks
        self.hit_blocks += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class TierHitStats:
    """``allocate``'s lookups with an offload tier (``manager.tier_stats``), per tier: each prompt's full blocks
    hit on the GPU, hit in the tier (promoted: copied, not computed) or missed, and in tokens the same, where
    the misses are every prompt token not hit (a partial last block is never hittable). ``offloaded_blocks``:
    blocks the tier took in from GPU evictions."""
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
