"""Trace replay through the real BlockManager: hit rates with known answers, both modes, the timing model."""

import math
from collections import OrderedDict

import numpy as np
import pandas as pd
import pytest
from tqdm.auto import tqdm

from kvlab import BlockManager
from kvlab.blocks.eviction import EvictionPolicy
from kvlab.blocks.manager import MAX_BLOCKS
from kvlab.errors import InvalidArgumentError
from kvlab.studies import EngineModel, cache_hit_study, replay, reuse_profile
from kvlab.studies.overlap import replay_overlap
from kvlab.studies.simulator import check_capacity
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.traces import load_trace


def trace_of(prompts, outputs=None, times_ms=None) -> pd.DataFrame:
    n = len(prompts)
    return pd.DataFrame({
        "timestamp": np.arange(n) * 1000.0 if times_ms is None else np.asarray(times_ms, dtype=float),
        "input_length": [len(p) for p in prompts],
        "output_length": [1] * n if outputs is None else outputs,
        "hash_ids": None,
        "token_ids": [np.asarray(p, dtype=np.int64) for p in prompts],
    })


A = list(range(12))
HAND_BUILT = [A, A[:8] + [100, 101, 102, 103], A, A + [200, 201]]


@pytest.mark.parametrize("mode", ["sequential", "overlap"])
def test_hits_on_a_hand_built_trace(mode):
    # Block size 4. A: 3 full blocks, nothing cached. B shares A's first 2 blocks. A again: its last token
    # is always computed, so only 2 of its 3 blocks hit. A + 2 tokens: all 3 full blocks hit.
    row = replay(trace_of(HAND_BUILT, outputs=[5, 3, 1, 7]), block_size=4, capacity=64, mode=mode)
    assert row["prefill_tokens_saved"] == 0 + 8 + 8 + 12
    assert row["prompt_tokens"] == 50
    assert row["hit_rate_tokens"] == pytest.approx(28 / 50)
    assert row["hit_rate_blocks"] == pytest.approx(7 / 12)
    assert row["evictions"] == 0 and row["requests"] == 4


def random_prefix_trace(rng, num_requests, block_size):
    """Prompts stitched from a few shared segments of odd lengths, so that they share prefixes of every
    length, sometimes ending mid-block and sometimes exactly on a block boundary."""
    segments = [rng.integers(0, 50, size=int(rng.integers(1, 3 * block_size))) for _ in range(6)]
    prompts = []
    for _ in range(num_requests):
        parts = [segments[int(k)] for k in rng.integers(0, len(segments), size=int(rng.integers(1, 4)))]
        prompts.append(np.concatenate(parts))
    return prompts


def seen_before_reference(prompts, block_size):
    """Plain reference: a block hits iff the same whole prefix was a full block of an earlier prompt
    (and it is not the block holding the prompt's last token, which is always computed)."""
    seen, hits = set(), 0
    for p in prompts:
        p = tuple(int(t) for t in p)
        hits += sum(p[:(i + 1) * block_size] in seen for i in range((len(p) - 1) // block_size))
        seen.update(p[:(i + 1) * block_size] for i in range(len(p) // block_size))
    return hits, sum(len(p) // block_size for p in prompts)


@pytest.mark.parametrize("seed, block_size", [(0, 3), (1, 5), (2, 16), (3, 1)])
@pytest.mark.parametrize("mode", ["sequential", "overlap"])
def test_an_infinite_cache_hits_exactly_the_blocks_seen_before(seed, block_size, mode):
    rng = np.random.default_rng(seed)
    prompts = random_prefix_trace(rng, 60, block_size)
    trace = trace_of(prompts, outputs=list(rng.integers(1, 40, size=60)),
                     times_ms=np.sort(rng.uniform(0, 2000, size=60)))  # overlapping in overlap mode
    hits, blocks = seen_before_reference(prompts, block_size)
    row = replay(trace, block_size=block_size, capacity=math.inf, mode=mode)
    assert row["hit_rate_blocks"] == pytest.approx(hits / blocks)
    assert row["prefill_tokens_saved"] == hits * block_size and row["evictions"] == 0
    assert reuse_profile(trace, block_size)["ceiling_hit_rate_blocks"] == pytest.approx(hits / blocks)


def test_on_mooncake_an_infinite_cache_reaches_the_trace_ceiling():
    trace = load_trace("mooncake_conversation", limit=300)
    row = replay(trace, block_size=48, capacity=math.inf)  # 48 does not divide 512: blocks straddle ids
    profile = reuse_profile(trace, 48)
    assert row["evictions"] == 0 and row["hit_rate_blocks"] > 0.05
    assert row["hit_rate_blocks"] == pytest.approx(profile["ceiling_hit_rate_blocks"])
    assert row["hit_rate_tokens"] == pytest.approx(profile["ceiling_hit_rate_tokens"])


def five_tokens(first):
    return list(range(first, first + 5))  # block size 2: two full blocks and one token in a third


@pytest.mark.parametrize("policy, hit_tokens, evictions", [("lru", 6, 2), ("fifo", 4, 3), ("lfu", 8, 1)])
def test_a_small_pool_by_hand(policy, hit_tokens, evictions):
    # Pool of 6 blocks of 2 tokens. A, A again (hits 2 blocks), B, C (evicts one cached block), A again.
    # C evicts A's tail under LRU (A freed before B), A's head under FIFO (filled first), B's tail under
    # LFU (never hit); the last A then hits 1, 0 or 2 blocks, and evicts 1, 2 or 0 more.
    prompts = [five_tokens(0), five_tokens(0)[:4] + [99], five_tokens(100), five_tokens(200), five_tokens(0)]
    row = replay(trace_of(prompts), block_size=2, capacity=6, policy=policy)
    assert (row["prefill_tokens_saved"], row["evictions"]) == (hit_tokens, evictions)
    assert row["hit_rate_tokens"] == pytest.approx(hit_tokens / 25)


@pytest.mark.parametrize("mode", ["sequential", "overlap"])
def test_a_prompt_larger_than_the_pool_is_skipped_and_counts_as_missed(mode):
    prompts = [list(range(40)), list(range(10)), list(range(10)) + [7]]
    row = replay(trace_of(prompts), block_size=4, capacity=6, mode=mode)
    assert row["requests_skipped"] == 1 and row["requests"] == 2
    assert row["prefill_tokens_saved"] == 8 and row["hit_rate_tokens"] == pytest.approx(8 / 61)


def test_the_timing_model_on_two_requests():
    # Request 1 at t=0: prefill 100 tokens in its first step, then 9 decode steps (10 outputs). Request 2
    # at t=1 s shares 6 full blocks (96 tokens) and prefills only 4. decode 10 ms, prefill 0.5 ms/token.
    prompt = list(range(100))
    engine = EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.5)
    row = replay(trace_of([prompt, prompt], outputs=[10, 10], times_ms=[0, 1000]), block_size=16,
                 capacity=100, mode="overlap", engine=engine)
    assert row["makespan_s"] == pytest.approx((1000 + 10 * 10 + 4 * 0.5) / 1000)
    assert row["prefill_tokens_saved"] == 96 and row["mean_queue_s"] == 0 and row["preemptions"] == 0


def test_overlap_under_memory_pressure_preempts_finishes_everything_and_leaves_a_clean_pool():
    rng = np.random.default_rng(5)
    prompts = random_prefix_trace(rng, 40, 4)
    trace = trace_of(prompts, outputs=list(rng.integers(20, 80, size=40)), times_ms=np.zeros(40))
    manager = BlockManager(60, 4, eviction="lfu")
    metrics = replay_overlap(trace, manager, EngineModel(), tqdm(disable=True))
    assert metrics["preemptions"] > 0 and metrics["recomputed_tokens"] > 0
    assert metrics["requests"] == 40 and metrics["requests_skipped"] == 0
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


class MostRecentlyFreed(EvictionPolicy):
    """A user's policy in a few lines: reuse never-cached blocks first, then the most recently freed."""

    def __init__(self):
        self.uncached, self.cached = OrderedDict(), OrderedDict()

    def add(self, block_id, cached):
        (self.cached if cached else self.uncached)[block_id] = None

    def remove(self, block_id):
        self.cached.pop(block_id, None) if block_id in self.cached else self.uncached.pop(block_id)

    def pop(self):
        return (self.uncached.popitem(last=False) if self.uncached else self.cached.popitem(last=True))[0]

    def __iter__(self):
        return iter([*self.uncached, *reversed(self.cached)])

    def __len__(self):
        return len(self.uncached) + len(self.cached)


def test_a_user_policy_class_plugs_in():
    prompts = [five_tokens(0), five_tokens(0)[:4] + [99], five_tokens(100), five_tokens(200), five_tokens(0)]
    row = replay(trace_of(prompts), block_size=2, capacity=6, policy=MostRecentlyFreed)
    # C evicts B's head (B freed last, head after tail); the last A then hits both its blocks.
    assert row["policy"] == "MostRecentlyFreed" and row["prefill_tokens_saved"] == 8 and row["evictions"] == 1


@pytest.mark.parametrize("kwargs", [dict(mode="parallel"), dict(capacity=0), dict(capacity=2.5),
                                    dict(capacity=True), dict(capacity=2**24 + 1), dict(capacity=math.nan),
                                    dict(block_size=0), dict(block_size=10**30), dict(policy="random"),
                                    dict(policy=object)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        replay(trace_of(HAND_BUILT), **kwargs)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        replay(trace_of(HAND_BUILT).head(0))
    with pytest.raises(InvalidArgumentError):
        EngineModel(max_num_seqs=0)


def test_capacities_stop_where_the_block_manager_does():
    assert check_capacity(MAX_BLOCKS) == MAX_BLOCKS
    with pytest.raises(InvalidArgumentError, match=r"capacity must be a number of blocks in \[1, 16,777,216\]"):
        check_capacity(MAX_BLOCKS + 1)


def test_an_infinite_pool_larger_than_a_block_manager_is_refused_before_any_replay(monkeypatch):
    def no_replays(*args, **kwargs):
        raise AssertionError("replayed before checking the infinite pool")
    monkeypatch.setattr("kvlab.studies.study.run_replays", no_replays)
    monkeypatch.setattr("kvlab.studies.simulator.MAX_CAPACITY", 100)  # synthetic_chat at block size 16: ~3,000
    with pytest.raises(InvalidArgumentError, match=r"synthetic_chat at block size 16: a pool that never evicts "
                                                   r"would need [\d,]+ blocks, and a block manager holds at most 100"):
        cache_hit_study("synthetic_chat", block_sizes=[16], capacities=[50, math.inf], progress=False)


def test_a_study_has_one_row_per_combination_and_shares_the_infinite_row():
    table = cache_hit_study(["synthetic_few_shot", ("hand", trace_of(HAND_BUILT))], block_sizes=[4, 16],
                            capacities=[8, 64, math.inf], policies=["lru", "fifo", "lfu"], limit=60,
                            progress=False)
    assert len(table) == 2 * 2 * 3 * 3
    inf_rows = table[table["capacity_blocks"] == math.inf]
    for _, group in inf_rows.groupby(["trace", "block_size"]):
        assert group["hit_rate_tokens"].nunique() == 1 and (group["evictions"] == 0).all()
        assert group["hit_rate_tokens"].iloc[0] == pytest.approx(group["ceiling_hit_rate_tokens"].iloc[0])
    assert (table["hit_rate_tokens"] <= table["ceiling_hit_rate_tokens"] + 1e-12).all()
    assert set(table["trace"]) == {"synthetic_few_shot", "hand"} and "synthetic_few_shot" in WORKLOADS


def test_a_study_accepts_a_tuple_of_names_and_refuses_bad_block_sizes():
    table = cache_hit_study(("synthetic_chat", "synthetic_parallel"), block_sizes=(16,), capacities=(64,),
                            policies=("lru",), limit=10, progress=False)
    assert table["trace"].tolist() == ["synthetic_chat", "synthetic_parallel"]
    with pytest.raises(InvalidArgumentError, match="block_size"):
        cache_hit_study("synthetic_chat", block_sizes=(0,), progress=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(traces=("nan", trace_of(HAND_BUILT).assign(timestamp=np.nan))), "timestamp must hold finite numbers"),
    (dict(traces=("float", trace_of(HAND_BUILT).assign(input_length=12.0))), "input_length must hold ints"),
    (dict(limit=0), "limit must be an int >= 1"),
    (dict(capacities=[10**30]), "capacity must be a number of blocks"),
])
def test_a_study_refuses_bad_frames_and_bounds_before_replaying(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        cache_hit_study(**{"traces": ("hand", trace_of(HAND_BUILT)), **kwargs}, progress=False)
