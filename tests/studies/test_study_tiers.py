"""Studies with an offload tier: per-tier hit columns with known answers, the compact replay against real tokens,
the sweep's rows, and residency metrics in the rows."""

import math

import numpy as np
import pandas as pd
import pytest

from kvlab import BlockManager, Sequence
from kvlab.errors import InvalidArgumentError
from kvlab.studies import cache_hit_study, replay
from kvlab.studies.summary import summary
from kvlab.studies.tiers import TierConfig, tier_configs


def trace_of(prompts, times_ms=None) -> pd.DataFrame:
    n = len(prompts)
    return pd.DataFrame({
        "timestamp": np.arange(n) * 1000.0 if times_ms is None else np.asarray(times_ms, dtype=float),
        "input_length": [len(p) for p in prompts], "output_length": [1] * n, "hash_ids": None,
        "token_ids": [np.asarray(p, dtype=np.int64) for p in prompts]})


A, B = list(range(10)), list(range(100, 110))
# Block size 4, pool of 3 blocks: A (2 full blocks and a partial one) fills the pool; B evicts A's two cached
# blocks, which the tier keeps; A again misses on the GPU and hits both in the tier.
EVICT_THEN_RETURN = [A, B, A]


def test_a_block_evicted_from_the_pool_is_hit_in_the_tier():
    no_tier = replay(trace_of(EVICT_THEN_RETURN), block_size=4, capacity=3)
    tier = replay(trace_of(EVICT_THEN_RETURN), block_size=4, capacity=3, tier=TierConfig(4))
    assert no_tier["hit_rate_blocks"] == 0 and no_tier["tier_hit_blocks"] == 0
    assert no_tier["offload_capacity_blocks"] == 0 and no_tier["offload_policy"] == "none"
    assert (tier["gpu_hit_blocks"], tier["tier_hit_blocks"], tier["miss_blocks"]) == (0, 2, 4)
    assert (tier["gpu_hit_tokens"], tier["tier_hit_tokens"], tier["miss_tokens"]) == (0, 8, 30 - 8)
    assert tier["hit_rate_blocks"] == pytest.approx(2 / 6)  # the total over both tiers
    assert tier["hit_rate_tokens"] == pytest.approx(8 / 30) and tier["prefill_tokens_saved"] == 8
    assert tier["offloaded_blocks"] == 4 and tier["offload_policy"] == "lru" and tier["offload_admission"] == "always"


def test_the_reuse_filter_keeps_blocks_looked_up_once_out_of_the_tier():
    row = replay(trace_of(EVICT_THEN_RETURN), block_size=4, capacity=3, tier=TierConfig(4, "arc", "reused"))
    assert row["tier_hit_blocks"] == 0 and row["offloaded_blocks"] == 0 and row["offload_admission"] == "reused"


def random_prompts(rng, num_requests, block_size):
    segments = [rng.integers(0, 50, size=int(rng.integers(1, 3 * block_size))) for _ in range(6)]
    return [np.concatenate([segments[int(k)] for k in rng.integers(0, 6, size=int(rng.integers(1, 4)))])
            for _ in range(num_requests)]


@pytest.mark.parametrize("policy, admission", [("lru", "always"), ("arc", "always"), ("arc", "reused")])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_compact_replay_counts_the_tiers_as_real_tokens_do(seed, policy, admission):
    block_size, pool, slots = 4, 8, 6
    prompts = random_prompts(np.random.default_rng(seed), 60, block_size)
    manager = BlockManager(pool, block_size, num_offload_blocks=slots, offload_policy=policy,
                           offload_admission=admission)
    for prompt in prompts:
        if -(-len(prompt) // block_size) <= pool:
            seq = Sequence(prompt.tolist(), block_size)
            manager.allocate(seq)
            manager.free(seq)
    expected = manager.tier_stats
    assert expected.tier_hit_blocks > 0  # the trace exercises the tier
    row = replay(trace_of(prompts), block_size=block_size, capacity=pool, tier=TierConfig(slots, policy, admission))
    assert (row["gpu_hit_blocks"], row["tier_hit_blocks"], row["offloaded_blocks"]) == (
        expected.gpu_hit_blocks, expected.tier_hit_blocks, expected.offloaded_blocks)


def test_tier_configs_have_one_no_tier_and_every_policy_and_admission_of_the_others():
    configs = tier_configs([0, 8, 16], ["lru", "arc"], ["always", "reused"])
    assert configs[0] == TierConfig() and len(configs) == 1 + 2 * 4
    assert configs[1:5] == [TierConfig(8, p, a) for p in ("lru", "arc") for a in ("always", "reused")]


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacities=[-1]), "offload capacity is a number of CPU blocks in \\[0, "),
    (dict(capacities=[1.5]), "offload capacity is a number of CPU blocks"),
    (dict(policies=["mru"]), "unknown offload policy 'mru'; known: lru, arc"),
    (dict(policies=[["lru"]]), r"unknown offload policy \['lru'\]; known: lru, arc"),
    (dict(admissions=["never"]), "unknown offload admission 'never'; known: always, reused"),
    (dict(capacities=[]), "need at least one offload capacity"),
])
def test_bad_tier_settings_are_refused(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        tier_configs(**kwargs)


def test_a_study_has_a_row_per_tier_and_the_infinite_pool_shares_its_row():
    table = cache_hit_study([("t", trace_of(EVICT_THEN_RETURN))], block_sizes=[4], capacities=[3, math.inf],
                            policies=["lru", "fifo"], offload_capacities=[0, 4], offload_policies=["lru", "arc"],
                            progress=False, jobs=1)
    assert len(table) == 2 * 2 * 3
    finite = table[table["capacity_blocks"] == 3]
    assert finite["offload_capacity_blocks"].tolist() == [0, 4, 4] * 2
    assert finite["offload_policy"].tolist() == ["none", "lru", "arc"] * 2
    assert finite["tier_hit_blocks"].tolist() == [0, 2, 2] * 2
    infinite = table[table["capacity_blocks"] == math.inf]
    assert infinite["offload_policy"].tolist() == ["none", "lru", "arc"] * 2
    assert (infinite["tier_hit_blocks"] == 0).all() and (infinite["gpu_hit_blocks"] == 2).all()
    # The TTFT model's columns, the tier's gain only where it hit.
    assert (finite["ttft_tier_gain_ms"] > 0).tolist() == [False, True, True] * 2
    assert (table["ttft_mean_ms"] < table["ttft_no_cache_ms"]).tolist() == [False, True, True] * 2 + [True] * 6


def test_the_summary_says_each_tier_on_its_own_line():
    table = cache_hit_study([("t", trace_of(EVICT_THEN_RETURN))], block_sizes=[4], capacities=[3],
                            policies=["lru"], offload_capacities=[0, 4], progress=False, jobs=1)
    lines = summary(table).splitlines()
    assert lines[1] == ("          3 blocks: lru hits 0.0% (0% of the ceiling); misses: 66.7% cold, 26.7% evicted, "
                        "6.7% partial block (reuse distance p50: 2 admissions)")
    assert lines[2] == ("          3 blocks + 4-block tier (lru, always): lru hits 26.7% (100% of the ceiling); misses: "
                        "66.7% cold, 6.7% partial block")  # the tier serves what the GPU pool evicted


def test_a_tier_or_residency_metrics_in_overlap_mode_are_refused_before_any_replay():
    for kwargs in (dict(offload_capacities=[4]), dict(kv_cache_metrics_sample=0.5)):
        with pytest.raises(InvalidArgumentError, match="sequential mode only"):
            cache_hit_study([("t", trace_of(EVICT_THEN_RETURN))], block_sizes=[4], capacities=[3], mode="overlap",
                            progress=False, **kwargs)


def test_residency_metrics_run_on_the_arrival_clock():
    # A's two blocks are sealed at 0 s and evicted when B arrives at 5 s; B's when A comes back at 7 s; with a
    # tier, A's blocks enter it at 5 s, are promoted at 7 s and are never dropped (no CPU event).
    row = replay(trace_of(EVICT_THEN_RETURN, times_ms=[0, 5000, 7000]), block_size=4, capacity=3,
                 tier=TierConfig(4), kv_cache_metrics_sample=1.0)
    assert row["gpu_lifetime_s_count"] == 4
    assert row["gpu_lifetime_s_p50"] == pytest.approx(3.5)  # 5, 5, 2, 2
    assert row["gpu_idle_s_mean"] == pytest.approx(3.5) and row["gpu_reuse_gap_s_count"] == 0
    assert row["cpu_lifetime_s_count"] == 0 and math.isnan(row["cpu_lifetime_s_p50"])
    assert "gpu_lifetime_s_p50" not in replay(trace_of(EVICT_THEN_RETURN), block_size=4, capacity=3)


@pytest.mark.parametrize("rate", [0, 1.5, float("nan")])
def test_a_bad_sample_rate_is_refused(rate):
    with pytest.raises(InvalidArgumentError, match="kv_cache_metrics_sample"):
        replay(trace_of(EVICT_THEN_RETURN), block_size=4, capacity=3, kv_cache_metrics_sample=rate)
