"""A fleet's second tier: none, one per replica ("local"), or one for the whole fleet ("shared", Mooncake's store).

``TierSettings(kind="shared", capacity=8000)`` gives every replica its GPU pool (the fleet's ``capacity``) and
the fleet ``capacity`` tier blocks in all: "local" splits them over the replicas (the first ``capacity % N``
get one more), "shared" puts them in one tier every replica offloads to and promotes from
(``kvlab.blocks.tiers.make_shared_tier``: entries are content-keyed and verified on any replica).
So local and shared compare at equal total memory, and "none" is the same GPU pools without the tier memory.

The cost of a tier hit: a block promoted into a step adds its copy time to the step (``EngineModel``'s
``tier_ms_per_block``): bytes per block / bandwidth, where the bytes are ``kv_bytes_per_token`` x the block
size (default Llama-3-8B in bf16: 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token,
64 MiB per 512-token block) and the bandwidth is ``host_gbps`` for a local tier (CPU -> GPU over PCIe) and
``network_gbps`` for the shared one (a remote pool over the network). Recomputing a block costs
``prefill_ms_per_token`` x the block size; with the defaults (50k tokens/s, 25 GB/s host, 12.5 GB/s
network: a 100 Gb/s NIC) a 512-token block costs 10.2 ms to recompute, 2.7 ms from a local tier and 5.4 ms
from the shared one. Assumptions, printed with the results, not measurements.
"""

from dataclasses import dataclass

from kvlab.blocks.manager import KVCacheManager
from kvlab.blocks.tiers import check_offload_options
from kvlab.blocks.tiers import make_shared_tier
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number

#: The values of ``TierSettings.kind``.
TIER_KINDS = ("none", "local", "shared")
#: Llama-3-8B's KV bytes per token in bf16 (kvlab.studies.kv_capacity's layout): 2 x 32 x 8 x 128 x 2.
LLAMA3_8B_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def check_tier_kind(kind) -> str:
    if not isinstance(kind, str) or kind not in TIER_KINDS:
        raise InvalidArgumentError(f"tier must be one of {TIER_KINDS}, got {kind!r}")
    return kind


@dataclass(frozen=True)
class TierSettings:
    kind: str = "none"
    capacity: int = 0           # tier blocks of the whole fleet (0 with kind "none")
    policy: str = "lru"         # the tier's replacement policy: "lru" or "arc"
    host_gbps: float = 25.0     # GB/s, CPU -> GPU, for local tiers
    network_gbps: float = 12.5  # GB/s, remote pool -> GPU, for the shared tier
    kv_bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN

    def __post_init__(self):
        check_tier_kind(self.kind)
        check_int("tier capacity", self.capacity, 0)
        if (self.kind == "none") != (self.capacity == 0):
            needs = "no capacity" if self.kind == "none" else "a tier capacity of 1 block or more"
            raise InvalidArgumentError(f"a {self.kind!r} tier needs {needs}, got capacity {self.capacity}")
        check_offload_options(self.policy, "always")
        check_number("host_gbps", self.host_gbps, 0, min_open=True)
        check_number("network_gbps", self.network_gbps, 0, min_open=True)
        check_int("kv_bytes_per_token", self.kv_bytes_per_token, 1)

    def ms_per_block(self, block_size: int) -> float:
        """Milliseconds to bring one block from this tier to a GPU (0 without a tier)."""
        if self.kind == "none":
            return 0.0
        gbps = self.host_gbps if self.kind == "local" else self.network_gbps
        return self.kv_bytes_per_token * block_size / (gbps * 1e9) * 1e3


def fleet_managers(settings: TierSettings, replicas: int, capacity: int, block_size: int, policy_class) -> list:
    """Each replica's KVCacheManager, driven by its engine's scheduler (GPU pool of ``capacity`` blocks, eviction
    ``policy_class()``, KV events on) with the tier ``settings`` asks for."""
    def manager(**tier):
        return KVCacheManager(capacity, block_size, eviction=policy_class(), kv_events=True, **tier)

    if settings.kind == "shared":
        shared = make_shared_tier(settings.capacity, settings.policy)
        return [manager(shared_tier=shared) for _ in range(replicas)]
    share, extra = divmod(settings.capacity, replicas)
    return [manager(num_offload_blocks=share + (i < extra), offload_policy=settings.policy) for i in range(replicas)]


def tier_columns(settings: TierSettings, managers, hit_rate_blocks: float, full_blocks: int) -> dict:
    """The row's tier columns: the tier memory the managers hold (a shared tier once), and the fleet's block hit
    rate split per tier, ``hit_rate_blocks`` (the full prompt blocks hit at first admission, over all of them)
    = gpu_hit_rate_blocks + tier_hit_rate_blocks. Tier hits are the tiers' ``TierHitStats`` (first admissions,
    not recomputations: the lookups the hit rate counts), over the trace's ``full_blocks`` as the hit rate."""
    tiers = {id(m.tier_stats): m for m in managers if m.tier_stats is not None}  # a shared tier: one stats
    stats = [m.tier_stats for m in tiers.values()]
    tier_hits = sum(s.tier_hit_blocks for s in stats)
    tier_rate = tier_hits / max(full_blocks, 1)
    return {"tier": settings.kind, "tier_capacity_blocks": sum(m.num_offload_blocks for m in tiers.values()),
            "gpu_hit_rate_blocks": hit_rate_blocks - tier_rate, "tier_hit_rate_blocks": tier_rate,
            "tier_hit_blocks": tier_hits, "offloaded_blocks": sum(s.offloaded_blocks for s in stats)}


def tier_assumptions(settings: TierSettings, block_size: int, engine) -> str:
    """The cost model of a tier hit against recomputing, in one line (printed with the results)."""
    recompute = engine.prefill_ms_per_token * block_size
    mib = settings.kv_bytes_per_token * block_size / 2**20
    local = TierSettings("local", 1, host_gbps=settings.host_gbps).ms_per_block(block_size)
    shared = TierSettings("shared", 1, network_gbps=settings.network_gbps).ms_per_block(block_size)
    return (f"tier cost at block size {block_size}: {mib:g} MiB per block ({settings.kv_bytes_per_token:,} bytes "
            f"per token, Llama-3-8B bf16 by default); recompute {recompute:.2f} ms (prefill "
            f"{engine.prefill_ms_per_token} ms/token), local tier {local:.2f} ms ({settings.host_gbps:g} GB/s), "
            f"shared tier {shared:.2f} ms ({settings.network_gbps:g} GB/s); copies are not overlapped with compute")
