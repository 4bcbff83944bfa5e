"""The sequential replay's compact prompts (two token ids per block) give exactly the rows that the real
token ids give, whatever the trace, block size, capacity or policy; and block keys name exact prefixes."""

import math

import numpy as np
import pandas as pd
import pytest

from kvlab import BlockManager, Sequence
from kvlab.blocks.eviction import POLICIES, EvictionPolicy
from kvlab.studies import cache_hit_study, replay, reuse_profile
from kvlab.studies.doctor import HitDoctor
from kvlab.studies.reuse import block_keys
from kvlab.studies.sequential import unit_hit_rates
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.traces import PromptTokens, load_trace


def replay_real_tokens(trace, block_size, capacity, policy) -> dict:
    """Reference: every request's real token ids, one at a time, through a fresh BlockManager (and the hit-rate
    doctor, which sees the real tokens where the replay's sees compact prompts and their probes)."""
    manager = BlockManager(capacity, block_size, eviction=policy())
    doctor = HitDoctor(manager)
    prompts, skipped, peak = PromptTokens(trace), 0, 0
    for i in np.argsort(trace["timestamp"].to_numpy(), kind="stable"):
        if -(-int(trace["input_length"].iloc[i]) // block_size) > capacity:
            skipped += 1
            doctor.not_admitted(int(trace["input_length"].iloc[i]))
            continue
        seq = Sequence(prompts[i], block_size)
        hit = manager.lookup(seq)
        manager.allocate(seq, hit=hit)
        doctor.admitted(seq, hit)
        peak = max(peak, capacity - manager.num_free_blocks)
        manager.free(seq)
    return {"prefill_tokens_saved": manager.stats.hit_tokens, "evictions": manager.num_evictions,
            "peak_blocks_used": peak, "requests_skipped": skipped, **comparable(doctor.columns())}


def comparable(columns: dict) -> dict:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in columns.items()}


def same_as_real_tokens(trace, block_size, capacities, policies=tuple(POLICIES.values())) -> None:
    for capacity in capacities:
        for policy in policies:
            row = replay(trace, block_size=block_size, capacity=capacity, policy=policy)
            expected = replay_real_tokens(trace, block_size, row["pool_blocks"], policy)
            assert comparable({k: row[k] for k in expected}) == expected, (block_size, capacity, policy)


# Block sizes that divide Mooncake's 512-token ids, one that straddles two ids, and one that spans several.
@pytest.mark.parametrize("block_size", [512, 64, 48, 1300])
def test_mooncake_rows_equal_the_real_tokens_rows(block_size):
    trace = load_trace("mooncake_conversation", limit=150)
    blocks = int((trace["input_length"] // block_size).sum())
    same_as_real_tokens(trace, block_size, [blocks // 20, blocks // 4, math.inf])


@pytest.mark.parametrize("name", WORKLOADS)
def test_synthetic_rows_equal_the_real_tokens_rows(name):
    trace = WORKLOADS[name]().head(60)
    same_as_real_tokens(trace, 16, [40, 400, math.inf])


def test_prompts_ending_on_a_block_boundary_and_skipped_prompts_too():
    # Block size 4: prompts of 8 and 12 tokens end exactly on a boundary (their last block cannot hit);
    # the 40-token prompt does not fit a pool of 6 and is skipped.
    prompts = [list(range(8)), list(range(12)), list(range(9)), list(range(40)), list(range(12)), [1, 2, 3]]
    trace = pd.DataFrame({"timestamp": np.arange(6.0), "input_length": [len(p) for p in prompts],
                          "output_length": 1, "token_ids": [np.array(p) for p in prompts]})
    same_as_real_tokens(trace, 4, [3, 6, math.inf])


def test_azure_and_mixed_traces():
    same_as_real_tokens(load_trace("azure_code", limit=40), 16, [300, math.inf])
    # Rows with hash ids, explicit tokens and neither, in one frame.
    mooncake = load_trace("mooncake_conversation", limit=12)
    explicit = [np.arange(n) if i % 4 == 1 else None for i, n in enumerate(mooncake["input_length"])]
    mixed = mooncake.assign(hash_ids=[h if i % 3 else None for i, h in enumerate(mooncake["hash_ids"])],
                            token_ids=explicit)
    same_as_real_tokens(mixed, 128, [60, math.inf])


class NewestCachedFirst(EvictionPolicy):
    """Evicts the most recently freed cached block, before any never-cached one: the replay must not rely
    on a policy's order."""

    def __init__(self):
        self.blocks = {}

    def add(self, block_id, cached):
        self.blocks[block_id] = cached

    def remove(self, block_id):
        del self.blocks[block_id]

    def pop(self):
        cached = [b for b, c in self.blocks.items() if c]
        block = cached[-1] if cached else next(iter(self.blocks))
        del self.blocks[block]
        return block

    def __iter__(self):
        return iter(list(self.blocks))

    def __len__(self):
        return len(self.blocks)


def test_a_policy_that_evicts_cached_blocks_first():
    trace = WORKLOADS["synthetic_chat"]().head(40)
    same_as_real_tokens(trace, 16, [120, 600, math.inf], policies=[NewestCachedFirst])


def test_an_infinite_pool_that_evicts_is_replayed_for_every_policy():
    # NewestCachedFirst evicts even from a pool that could keep everything, so LRU cannot share its row.
    table = cache_hit_study(("chat", WORKLOADS["synthetic_chat"]().head(40)), block_sizes=[16],
                            capacities=[math.inf], policies=[NewestCachedFirst, "lru"], progress=False)
    assert table["evictions"].tolist()[1] == 0 < table["evictions"].tolist()[0]
    assert table["hit_rate_tokens"].iloc[1] == pytest.approx(table["ceiling_hit_rate_tokens"].iloc[1])


def seen_before(trace, block_size) -> int:
    """Hittable full blocks whose whole prefix is a full block of an earlier prompt, from the real tokens."""
    prompts, seen, hits = PromptTokens(trace), set(), 0
    for i in range(len(prompts)):
        p = prompts[i].tobytes()
        width, n = 8 * block_size, len(prompts[i])
        hits += sum(p[:(j + 1) * width] in seen for j in range((n - 1) // block_size))
        seen.update(p[:(j + 1) * width] for j in range(n // block_size))
    return hits


@pytest.mark.parametrize("block_size", [512, 48, 1024])
def test_hash_id_keys_name_the_whole_prefix_even_when_an_id_follows_different_prefixes(block_size):
    # Mooncake ids name their whole prefix, but a file may not keep that promise: id 2 follows id 5 in one
    # request and id 6 in the other, so their second blocks hold the same tokens after different prefixes.
    trace = pd.DataFrame({"timestamp": [0.0, 1.0, 2.0], "input_length": [1100, 1100, 1100], "output_length": 1,
                          "hash_ids": [np.array([5, 2, 9]), np.array([6, 2, 9]), np.array([5, 2, 9])]})
    profile = reuse_profile(trace, block_size)
    assert profile["ceiling_hit_rate_blocks"] * profile["full_blocks"] == pytest.approx(seen_before(trace, block_size))
    keys, _ = block_keys(trace, block_size)
    assert len(np.unique(keys)) == 2 * (1100 // block_size)  # request 3 repeats request 1, nothing else repeats


def test_too_few_hash_ids_for_the_prompt_are_refused():
    trace = pd.DataFrame({"timestamp": [0.0], "input_length": [1100], "output_length": 1,
                          "hash_ids": [np.array([5, 2])]})
    with pytest.raises(ValueError, match="cannot cover input_length"):
        replay(trace, block_size=16)


def test_a_finer_prefix_match_unit_recovers_the_hits_a_528_token_block_loses():
    """vLLM #40696 on Mooncake's conversation trace: the shared 512-token system prompt never fills a 528-token
    block, so prompts of 528-2047 tokens hit nothing; matched at 16 tokens they hit as 16-token blocks do."""
    rates = unit_hit_rates("mooncake_conversation", limit=300).set_index(
        ["block_size", "prefix_match_unit", "prompt_tokens"])["hit_rate"]
    assert rates[528, 528, "528-2047"] == 0
    assert rates[528, 16, "528-2047"] == rates[16, 16, "528-2047"] > 40


def test_a_hybrid_model_with_a_528_token_group_hits_at_16_tokens_only_with_a_unit():
    """Groups of 528 and 16 tokens: whole-block hits come in steps of 528 (both groups must serve them), so the
    528-2047 prompts hit nothing; matched at 16 tokens they hit as 16-token blocks do, in every bucket."""
    rates = unit_hit_rates("mooncake_conversation", limit=300,
                           configs=[((528, 16), None), ((528, 16), 16), (16, None)])
    rates = rates[rates["requests"] > 0].set_index(["config", "prompt_tokens"])["hit_rate"].unstack("config")
    whole, unit = "hybrid: full attention in 528, window 1024 in 16", \
        "hybrid: full attention in 528, window 1024 in 16, unit 16"
    assert rates.loc["528-2047", whole] == 0 and rates.loc["528-2047", unit] > 40
    assert (rates[unit] >= 0.95 * rates["blocks of 16"]).all()
