"""The offload tier a study's replay puts behind its GPU pool, and the per-tier columns of its rows.

``kvlab study --offload-capacity 0,8000 --offload-policy lru,arc --offload-admission always,reused`` replays
every GPU pool with each tier: ``TierConfig(blocks, policy, admission)`` is ``BlockManager(num_offload_blocks=,
offload_policy=, offload_admission=)`` (kvlab.blocks.tiers). ``blocks == 0`` is no tier at all, so its
policy and admission mean nothing: a sweep has one no-tier configuration however many policies it names
(``tier_configs``), and its rows say ``"none"`` for both.

Columns (``tier_columns``), over the whole trace like ``hit_rate_blocks`` (a skipped request's blocks are
misses): ``gpu_hit_blocks`` hit in the GPU pool, ``tier_hit_blocks`` hit in the tier (promoted: copied back,
not computed), ``miss_blocks`` neither, and the same in tokens (``miss_tokens``: every prompt token not hit,
partial last blocks included); ``offloaded_blocks`` the GPU evictions the tier took in. ``hit_rate_blocks``
and ``hit_rate_tokens`` stay the totals over both tiers.
"""

from dataclasses import dataclass

from kvlab.blocks.manager import MAX_BLOCKS
from kvlab.blocks.tiers import OFFLOAD_ADMISSIONS, OFFLOAD_POLICIES, check_offload_options
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int

TIER_COLUMNS = ["offload_capacity_blocks", "offload_policy", "offload_admission", "gpu_hit_blocks", "tier_hit_blocks",
                "miss_blocks", "gpu_hit_tokens", "tier_hit_tokens", "miss_tokens", "offloaded_blocks"]


@dataclass(frozen=True)
class TierConfig:
    """One offload tier: ``blocks`` CPU slots (0: no tier) with its replacement ``policy`` and ``admission``."""
    blocks: int = 0
    policy: str = "lru"
    admission: str = "always"

    def __post_init__(self):
        check_int("offload capacity", self.blocks, 0, MAX_BLOCKS)
        check_offload_options(self.policy, self.admission)

    def manager_options(self) -> dict:
        """The ``BlockManager`` keyword arguments of this tier."""
        return dict(num_offload_blocks=self.blocks, offload_policy=self.policy, offload_admission=self.admission)

    def labels(self) -> dict:
        none = self.blocks == 0
        return {"offload_capacity_blocks": self.blocks, "offload_policy": "none" if none else self.policy,
                "offload_admission": "none" if none else self.admission}


def tier_label(blocks, policy: str, admission: str) -> str:
    """How a summary line or a plot's legend names a row's tier: "" without one."""
    return f" + {int(blocks):,}-block tier ({policy}, {admission})" if blocks else ""


def check_offload_capacity(blocks) -> int:
    try:
        return check_int("offload capacity", blocks, 0, MAX_BLOCKS)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"an offload capacity is a number of CPU blocks in [0, {MAX_BLOCKS:,}] (0: no "
                                   f"tier), got {blocks!r}") from None


def tier_configs(capacities=(0,), policies=("lru",), admissions=("always",)) -> list[TierConfig]:
    """Every tier of the sweep, in order: capacity by capacity, then policy, then admission; a capacity of 0 is
    one configuration (no tier). Raises InvalidArgumentError for a bad value or an empty list."""
    capacities, policies, admissions = list(capacities), list(policies), list(admissions)
    if not (capacities and policies and admissions):
        raise InvalidArgumentError("need at least one offload capacity, offload policy and offload admission")
    for policy in policies:
        if not isinstance(policy, str) or policy not in OFFLOAD_POLICIES:
            raise InvalidArgumentError(f"unknown offload policy {policy!r}; known: {', '.join(OFFLOAD_POLICIES)}")
    for admission in admissions:
        if not isinstance(admission, str) or admission not in OFFLOAD_ADMISSIONS:
            raise InvalidArgumentError(f"unknown offload admission {admission!r}; known: "
                                       f"{', '.join(OFFLOAD_ADMISSIONS)}")
    configs = []
    for blocks in (check_offload_capacity(c) for c in capacities):
        if blocks == 0:
            configs.append(TierConfig())
        else:
            configs += [TierConfig(blocks, p, a) for p in policies for a in admissions]
    return configs


def tier_columns(tier: TierConfig, gpu_hit_blocks: int, tier_hit_blocks: int, offloaded_blocks: int,
                 full_blocks: int, prompt_tokens: int, block_size: int) -> dict:
    """One row's tier columns from its replay's counts (see the module docstring)."""
    hits = gpu_hit_blocks + tier_hit_blocks
    return {**tier.labels(), "gpu_hit_blocks": gpu_hit_blocks, "tier_hit_blocks": tier_hit_blocks,
            "miss_blocks": full_blocks - hits, "gpu_hit_tokens": gpu_hit_blocks * block_size,
            "tier_hit_tokens": tier_hit_blocks * block_size, "miss_tokens": prompt_tokens - hits * block_size,
            "offloaded_blocks": offloaded_blocks}
