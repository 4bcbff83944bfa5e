"""The hit-rate doctor (kvlab.studies.doctor): every admitted prompt token is a hit or a miss with one cause,
the causes add up exactly (property-tested on random workloads), and vLLM's two hit laws get their names."""

import pytest
from hypothesis import given, strategies as st

from kvlab import Sequence
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.manager import BlockManager, HybridBlockManager
from kvlab.errors import InvalidArgumentError
from kvlab.studies import replay
from kvlab.studies.doctor import CAUSES, HITS, DoctorView, HitDoctor
from kvlab.studies.fleet import replay_fleet
from kvlab.studies.synthetic import multi_turn_chat

BS = 4


def admit(manager, doctor, tokens, *, salt=None, keep=False):
    seq = tokens if isinstance(tokens, Sequence) else Sequence(tokens, manager.block_size, cache_salt=salt)
    hit = manager.lookup(seq)
    admitted = manager.allocate(seq, hit=hit)
    doctor.admitted(seq, hit, tier_moves=admitted.tier_moves)
    if not keep:
        doctor.freed(seq)
        manager.free(seq)
    return seq


def causes(doctor) -> dict:
    return {cause: tokens for cause, tokens in doctor.tokens.items() if tokens}


def test_a_prompt_sharing_less_than_a_large_hybrid_block_is_a_partial_block_not_cold():
    # vLLM #40696: a hybrid model with a 528-token block hits nothing below one block.
    m = HybridBlockManager(64, 528, groups=[FullAttentionSpec(), SlidingWindowSpec(1024)])
    doctor = HitDoctor(m)
    admit(m, doctor, range(400))                          # shorter than a block: nothing to cache
    admit(m, doctor, [*range(300), *range(1000, 1100)])   # shares 300 tokens of it
    assert causes(doctor) == {"cold": 400, "partial_block": 400}
    doctor = HitDoctor(m)
    admit(m, doctor, range(1000))
    admit(m, doctor, [*range(400), *range(5000, 5600)])   # shares 400 of the first 528-token block
    assert causes(doctor) == {"cold": 1000 + 1000 - 528, "partial_block": 528}


@pytest.mark.parametrize("groups", [None, [FullAttentionSpec(), SlidingWindowSpec(6)]])
def test_use_eagle_s_dropped_block_is_a_speculative_drop(groups):
    # vLLM #54360: a fully cached prompt of L tokens hits max(0, floor((L - 1) / B) - 1) * B.
    for length in range(1, 6 * BS):
        m = HybridBlockManager(32, BS, groups=groups, use_eagle=True) if groups else \
            BlockManager(32, BS, use_eagle=True)
        doctor = HitDoctor(m)
        admit(m, doctor, range(length + BS))
        before = dict(doctor.tokens)
        admit(m, doctor, range(length))
        second = {cause: doctor.tokens[cause] - before[cause] for cause in CAUSES}
        dropped = BS if (length - 1) // BS else 0
        assert second["hit_gpu"] == max(0, (length - 1) // BS - 1) * BS
        assert second["speculative_drop"] == dropped
        assert second["partial_block"] == length - second["hit_gpu"] - dropped  # the last token's block
        assert sum(second.values()) == length


def test_a_hybrid_hit_cut_by_the_window_group_is_a_group_cut():
    m = HybridBlockManager(13, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(4)])
    doctor = HitDoctor(m)
    admit(m, doctor, range(14))
    admit(m, doctor, range(14))
    admit(m, doctor, [103, 136, 137, 125, 103, 114, 102, 135, 108, 118, 126, 109, 134, 107, 136, 119, 135, 143, 111])
    before = dict(doctor.tokens)
    seq = Sequence(range(18), BS)
    hit = m.lookup(seq)
    assert hit.num_tokens == 0 and hit.num_cut_tokens == BS  # the full group holds block 0, the window not
    m.allocate(seq, hit=hit)
    doctor.admitted(seq, hit)
    assert doctor.tokens["group_cut"] - before["group_cut"] == BS


def test_another_salt_s_tokens_are_isolated_and_the_same_salt_s_evicted_ones_are_evicted():
    m = BlockManager(6, BS)
    doctor = HitDoctor(m)
    admit(m, doctor, range(9), salt="a")
    admit(m, doctor, range(9), salt="b")   # same tokens, another tenant
    admit(m, doctor, range(9))             # no salt: isolated from both
    assert causes(doctor) == {"cold": 9, "isolated": 18}
    admit(m, doctor, range(100, 121))      # evicts every cached block
    admit(m, doctor, range(9), salt="a")
    assert doctor.tokens["evicted"] == 8 and doctor.tokens["partial_block"] == 1
    assert doctor.reuse_distances == [4, 4]  # admissions since the blocks' last use


def test_a_recomputed_prompt_is_never_a_hit():
    m = BlockManager(16, BS)
    doctor = HitDoctor(m)
    seq = admit(m, doctor, range(9), keep=True)
    doctor.freed(seq)
    m.free(seq, preempted=True)
    admit(m, doctor, seq)
    assert causes(doctor) == {"cold": 9, "recompute": 9} and m.stats.recomputed_tokens == 8


def test_a_block_lost_in_the_offload_tier_too_is_a_tier_miss():
    m = BlockManager(4, BS, num_offload_blocks=2)
    doctor = HitDoctor(m)
    admit(m, doctor, range(13))             # 3 blocks
    admit(m, doctor, range(100, 113))       # evicts them: 2 go to the tier
    admit(m, doctor, range(200, 213))       # evicts the tier's
    admit(m, doctor, range(13))
    assert doctor.tokens["tier_miss"] >= 4 and doctor.tokens["hit_tier"] == 0


def test_the_engine_view_tells_the_doctor_and_refuses_what_is_not_a_doctor():
    m = BlockManager(16, BS)
    view = DoctorView(m, HitDoctor(m))
    seq = Sequence(range(9), BS)
    view.allocate(seq)
    view.free(seq)
    view.allocate(Sequence(range(9), BS))
    assert view.doctor.tokens["hit_gpu"] == 8 and view.num_free_blocks == m.num_free_blocks
    with pytest.raises(InvalidArgumentError, match="HitDoctor"):
        DoctorView(m, object())
    with pytest.raises(InvalidArgumentError, match="BlockManager"):
        HitDoctor(object())
    with pytest.raises(InvalidArgumentError, match="one block size"):
        HitDoctor(HybridBlockManager(16, BS, groups=[FullAttentionSpec(), FullAttentionSpec()],
                                     group_block_sizes=[BS, 2 * BS]))
    doctor, seq = HitDoctor(m), Sequence(range(5), BS)
    with pytest.raises(InvalidArgumentError, match="lookup"):
        doctor.admitted(seq, m.lookup(Sequence(range(5), BS)))
    assert sum(doctor.tokens.values()) == 0


prompts = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.sampled_from([None, None, "a", "b"]),
                             st.booleans()), min_size=1, max_size=25)


@given(prompts, st.integers(12, 40), st.sampled_from(["full", "hybrid", "tier"]), st.booleans(),
       st.sampled_from([1, 4, 5]))
def test_the_causes_add_up_to_the_misses_exactly(workload, num_blocks, kind, use_eagle, block_size):
    """Random prompts (a few shared stems, random lengths and salts, some preempted and recomputed): the hits are
    the manager's, every token has one cause, and a cause appears only where its mechanism exists."""
    if kind == "hybrid":
        m = HybridBlockManager(num_blocks, block_size, groups=[FullAttentionSpec(), SlidingWindowSpec(6)],
                               use_eagle=use_eagle)
    else:
        m = BlockManager(num_blocks, block_size, use_eagle=use_eagle,
                         num_offload_blocks=8 if kind == "tier" else 0)
    doctor, admitted = HitDoctor(m), 0
    for stem, length, salt, preempt in workload:
        seq = Sequence([stem * 1000 + t for t in range(length)], block_size, cache_salt=salt)
        hit = m.lookup(seq)
        if not m.can_allocate(seq, hit=hit):
            doctor.not_admitted(seq.num_tokens)
            admitted += seq.num_tokens
            continue
        done = m.allocate(seq, hit=hit)
        doctor.admitted(seq, hit, tier_moves=done.tier_moves)
        admitted += seq.num_tokens
        doctor.freed(seq)
        m.free(seq, preempted=preempt)
        if preempt:  # recomputed at once
            hit = m.lookup(seq)
            done = m.allocate(seq, hit=hit)
            doctor.admitted(seq, hit, tier_moves=done.tier_moves)
            admitted += seq.num_tokens
            doctor.freed(seq)
            m.free(seq)
    tokens = doctor.tokens
    assert set(tokens) == set(CAUSES) and sum(tokens.values()) == admitted
    tier_hits = m.tier_stats.tier_hit_tokens if kind == "tier" else 0
    assert tokens["hit_gpu"] == m.stats.hit_tokens and tokens["hit_tier"] == tier_hits
    assert tokens["recompute"] == m.stats.recomputed_queried_tokens
    assert sum(tokens[c] for c in CAUSES if c not in HITS) == admitted - m.stats.hit_tokens - tier_hits
    assert use_eagle or not tokens["speculative_drop"]
    assert kind == "hybrid" or not tokens["group_cut"]
    assert kind == "tier" or not (tokens["tier_miss"] or tokens["hit_tier"])
    assert any(salt for _, _, salt, _ in workload) or not tokens["isolated"]
    assert len(doctor.reuse_distances) * block_size == tokens["evicted"]
    columns = doctor.columns()
    assert (columns["evicted_reuse_distance_p50"] or 1) > 0 and (columns["evicted_reuse_distance_p50"] is None) == \
        (not doctor.reuse_distances)


@given(prompts)
def test_a_pool_that_never_evicts_has_no_evicted_tokens(workload):
    m = BlockManager(4096, BS)
    doctor = HitDoctor(m)
    for stem, length, salt, _ in workload:
        admit(m, doctor, [stem * 1000 + t for t in range(length)], salt=salt)
    assert not doctor.tokens["evicted"] and not doctor.tokens["tier_miss"]


def test_study_fleet_and_overlap_rows_split_every_prompt_token():
    chat = multi_turn_chat(num_conversations=8, turns=5, rate_per_s=4.0, seed=1)
    causes_but_recompute = [f"{c}_tokens" for c in CAUSES if c != "recompute"]
    for row in (replay(chat, block_size=16, capacity=60, mode="overlap"),
                replay(chat, block_size=16, capacity=200),
                replay_fleet(chat, block_size=16, capacity=300, replicas=3, router="round_robin")):
        assert sum(row[c] for c in causes_but_recompute) == row["prompt_tokens"]
        assert row["hit_gpu_tokens"] == row["prefill_tokens_saved"]
    assert row["cold_tokens"] > 0
    squeezed = replay(chat, block_size=16, capacity=60, mode="overlap")
    assert squeezed["preemptions"] and squeezed["recompute_tokens"] > 0
