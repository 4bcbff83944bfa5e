"""Continuous-batching replay under the engine's scheduler: what a preempted request keeps, a sequence that
outgrows the whole pool, plain decode steps run in one go, and the scheduler chosen.

Every expected number is worked out by hand in the comments (block size 4 throughout; "pos p" is the
0-based position of the token a step stores; a new block starts at every pos that is a multiple of 4).
"""

import math
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tqdm.auto import tqdm

from kvlab import BlockManager
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.errors import InvalidArgumentError
from kvlab.studies import EngineModel, replay
from kvlab.studies.engine_model import WRONG_DRAFT, StatedAcceptance
from kvlab.studies.overlap import Engine, arrivals, replay_overlap
from kvlab.studies.traces import PRIVATE_TOKEN_BASE, PromptTokens

ENGINE = EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.5)


def trace_of(prompts, outputs, times_ms) -> pd.DataFrame:
    return pd.DataFrame({
        "timestamp": np.asarray(times_ms, dtype=float), "input_length": [len(p) for p in prompts],
        "output_length": outputs, "hash_ids": None,
        "token_ids": [np.asarray(p, dtype=np.int64) for p in prompts],
    })


def replay_on_a_fresh_pool(trace, capacity):
    """The replay's metrics, after checking that it left every block free and the manager consistent."""
    manager = BlockManager(capacity, 4)
    metrics = replay_overlap(trace, manager, ENGINE, tqdm(disable=True))
    assert manager.num_free_blocks == capacity
    manager.check_invariants()
    return metrics


def test_a_sequence_that_outgrows_the_whole_pool_is_dropped_mid_decode_not_skipped():
    # The reviewer's case: an 8-token prompt (2 blocks) that would decode 99 more tokens, in a pool of 4
    # blocks. Its prompt fits, so it is admitted; at step 9 (pos 16) it needs a 5th block while running
    # alone: it can never finish. It used to be preempted, re-queued one token too long and counted as a
    # skipped prompt.
    trace = trace_of([list(range(8))], outputs=[100], times_ms=[0])
    row = replay(trace, block_size=4, capacity=4, mode="overlap")
    assert row["requests_skipped"] == 0 and row["preemptions"] == 0 and row["peak_blocks_used"] == 4
    assert row["requests"] == 0 and row["requests_dropped_mid_decode"] == 1
    assert replay_on_a_fresh_pool(trace, 4)["requests_dropped_mid_decode"] == 1


def test_a_request_preempted_before_outgrowing_the_pool_is_dropped_once_it_runs_alone():
    # K: 1-token prompt, 7 more tokens (2 blocks), finishes at step 7, grows at step 4 (pos 4).
    # J: 8-token prompt (2 blocks), grows at step 1 (pos 8: 4 blocks used). Step 4: K needs a block, J is
    # the newest: preempted with its 12 tokens (pos 8..10 stored, pos 11 sampled). J waits for K's
    # blocks, returns at step 8 hitting 2 blocks (recomputes pos 8..10, computes pos 11: its 4th block)
    # and at step 13 (pos 16) needs a 5th while alone: dropped.
    trace = trace_of([[500], list(range(8))], outputs=[8, 100], times_ms=[0, 0])
    metrics = replay_on_a_fresh_pool(trace, 4)
    assert metrics["requests_skipped"] == 0 and metrics["preemptions"] == 1 and metrics["recomputed_tokens"] == 3
    assert metrics["requests"] == 1 and metrics["requests_dropped_mid_decode"] == 1


def test_a_self_preempted_sequence_keeps_its_tokens_and_hits_its_own_blocks():
    # Pool of 6, the engine's V1 scheduler. A: 4-token prompt, 9 samples (stores 12 tokens: 3 blocks).
    # B: 6-token prompt, 19 samples (stores 24: 6 blocks). Step 0 prefills both (3 blocks). Step 7: B's
    # pos 12 needs its 4th block, none is free, and B is the newest running sequence: it preempts itself,
    # keeping its 13 tokens (12 with K/V and the one step 6 sampled). Step 8: A decodes its last token;
    # B would need 4 blocks (its 3 cached ones, then one for pos 12) while A holds 3: it waits. Step 9: it
    # hits all 3 of its blocks and computes only pos 12, which never had K/V (recomputes nothing), then
    # samples its 8th token; steps 10 .. 20 sample the other 11. Makespan: 21 steps + 4 + 6 + 1 prefilled.
    trace = trace_of([list(range(4)), list(range(100, 106))], outputs=[9, 19], times_ms=[0, 0])
    metrics = replay_on_a_fresh_pool(trace, 6)
    assert metrics["preemptions"] == 1 and metrics["recomputed_tokens"] == 0 and metrics["requests"] == 2
    assert metrics["makespan_s"] == pytest.approx((21 * 10 + (4 + 6 + 1) * 0.5) / 1000)


@pytest.mark.parametrize("younger_row_first", [True, False])
def test_the_newest_sequence_is_preempted_whatever_the_row_order(younger_row_first):
    # Pool of 4. X (t=0): 4-token prompt, 6 samples (stores 9). Step 0 prefills it and ends at 12 ms.
    # Y (t=1 ms): 5-token prompt, 10 samples; step 1 (12 ms) admits it (2 blocks) while X takes its 2nd.
    # Step 5: X's pos 8 needs a 3rd block, none is free; Y, the newest running sequence, is preempted with
    # its 9 tokens (8 with K/V), and X takes Y's freed tail block (freed first, so evicted first), then
    # finishes. Step 6: Y hits its first block, recomputes pos 4..7 and computes pos 8 (5 prefill tokens),
    # then decodes to its 10th sample at step 11. Makespan: 12 steps + 4 + 5 + 5 prefilled tokens.
    x, y = (list(range(300, 304)), 6, 0.0), (list(range(200, 205)), 10, 1.0)
    rows = [y, x] if younger_row_first else [x, y]
    trace = trace_of(*(list(column) for column in zip(*rows)))
    metrics = replay_on_a_fresh_pool(trace, 4)
    assert metrics["preemptions"] == 1 and metrics["recomputed_tokens"] == 4 and metrics["requests"] == 2
    assert metrics["makespan_s"] == pytest.approx((12 * 10 + (4 + 5 + 5) * 0.5) / 1000)
    assert metrics["mean_queue_s"] == pytest.approx((0 + 0.011) / 2)  # Y waits for step 1, at 12 ms


@pytest.mark.parametrize("seed, block_size, capacity", [(0, 3, 12), (1, 4, 7), (2, 5, 20)])
def test_who_finishes_is_decided_by_sizes_alone(seed, block_size, capacity):
    # Plain reference: a prompt needing more blocks than the pool is skipped; a request whose final
    # sequence needs more is dropped mid-decode; every other request finishes, however crowded the pool
    # (whoever is preempted eventually runs alone, and then it fits).
    rng = np.random.default_rng(seed)
    n = 40
    prompts = [rng.integers(0, 30, size=int(rng.integers(1, 1.3 * capacity * block_size))) for _ in range(n)]
    outputs = rng.integers(0, capacity * block_size, size=n)
    trace = trace_of(prompts, list(outputs), np.sort(rng.uniform(0, 200, size=n)))
    prompt_len = np.array([len(p) for p in prompts])
    prompt_blocks = -(-prompt_len // block_size)
    final_blocks = -(-(prompt_len + np.maximum(outputs - 1, 0)) // block_size)
    skipped = int((prompt_blocks > capacity).sum())
    dropped = int(((prompt_blocks <= capacity) & (final_blocks > capacity)).sum())
    assert skipped and dropped and n - skipped - dropped  # the trace exercises every outcome
    manager = BlockManager(capacity, block_size)
    metrics = replay_overlap(trace, manager, ENGINE, tqdm(disable=True))
    assert (metrics["requests_skipped"], metrics["requests_dropped_mid_decode"]) == (skipped, dropped)
    assert metrics["requests"] == n - skipped - dropped and metrics["preemptions"] > 0
    assert manager.num_free_blocks == capacity
    manager.check_invariants()


@pytest.mark.parametrize("kwargs", [dict(time_scale=math.inf), dict(time_scale=math.nan), dict(time_scale=0),
                                    dict(decode_step_ms=math.inf), dict(decode_step_ms=1e-300),
                                    dict(prefill_ms_per_token=math.nan), dict(max_num_seqs=True),
                                    dict(max_num_seqs=2.0)])
def test_engine_knobs_must_be_finite_and_in_range(kwargs):
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        EngineModel(**kwargs)


def test_arrival_times_that_overflow_are_refused_not_replayed():
    trace = trace_of([[1, 2, 3], [4, 5, 6]], outputs=[2, 2], times_ms=[0.0, 1e308])
    with pytest.raises(InvalidArgumentError, match="arrival times overflow"):
        replay(trace, block_size=4, capacity=8, mode="overlap", engine=EngineModel(time_scale=10.0))


@pytest.mark.parametrize("times_ms", [[0.0, math.inf], [math.nan, 0.0]])
def test_non_finite_arrival_times_in_a_frame_are_refused(times_ms):
    with pytest.raises(InvalidArgumentError, match="timestamp must hold finite numbers"):
        replay(trace_of([[1, 2, 3], [4, 5, 6]], outputs=[2, 2], times_ms=times_ms), block_size=4, mode="overlap")


def random_trace(seed: int, n: int, block_size: int, capacity: int) -> pd.DataFrame:
    """Prompts up to 1.3 pools long (some never fit), outputs up to a pool (some outgrow it), arrivals
    spread over 200 ms with idle gaps, and shared prefixes (prefix hits)."""
    rng = np.random.default_rng(seed)
    shared = list(rng.integers(0, 30, size=3 * block_size))
    prompts = [(shared if rng.random() < 0.5 else [])
               + list(rng.integers(0, 30, size=int(rng.integers(1, capacity * block_size))))
               for _ in range(n)]
    return trace_of(prompts, list(rng.integers(0, capacity * block_size, size=n)),
                    np.sort(rng.uniform(0, 2000, size=n)))


@pytest.mark.parametrize("scheduler, budget, policy", [("v1", 8192, "fcfs"), ("v1", 7, "fcfs"), ("v0", 8192, "fcfs"),
                                                     ("v1", 8192, "lpm"), ("v0", 8192, "lpm")])
@pytest.mark.parametrize("seed", [0, 1])
def test_plain_decode_steps_run_in_one_go_give_the_same_replay(scheduler, budget, policy, seed):
    # kvlab.studies.fast_forward: the replay that skips the scheduler in plain decode stretches ends with
    # the same counters, clock and pool as the one that asks it at every step (admission order aside).
    block_size, capacity = 4, 24
    trace = random_trace(seed, 40, block_size, capacity)
    model = EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.5, max_num_batched_tokens=budget,
                        scheduler=scheduler, scheduling_policy=policy)
    results, schedules = [], []
    for fast in (True, False):
        manager = BlockManager(capacity, block_size)
        engine = Engine(PromptTokens(trace), arrivals(trace, model), manager, model, tqdm(disable=True),
                        record_decisions=not fast)
        calls, schedule = [], engine.scheduler.schedule
        engine.scheduler.schedule = lambda: calls.append(1) or schedule()
        engine.advance()
        manager.check_invariants()
        results.append({**engine.metrics(), "evictions": manager.num_evictions, "ttft": engine.ttft_ms,
                        "free": manager.num_free_blocks, "cached": manager.num_cached_blocks})
        schedules.append(len(calls))
    assert results[0] == results[1]
    assert results[0]["preemptions"] and results[0]["requests_skipped"] and results[0]["requests_dropped_mid_decode"]
    assert schedules[0] < schedules[1]  # it did skip steps


def test_an_arrival_that_lpm_admits_ends_a_plain_decode_stretch_while_others_wait():
    # Pool of 12 blocks. R0 (8 shared tokens + 1, 0 ms) leaves the 2 shared blocks cached. A (17 tokens, 12 to
    # generate, 10 ms) decodes alone at 20, 30, ... ms; W (36 tokens: 9 blocks, 20 ms) never finds room beside
    # it and waits. A's steps at 60, 70 and 80 ms (pos 21-23) fill its 6th block: a plain decode stretch. N
    # (the shared blocks + 1 token, 65 ms) hits 2 blocks and needs 1: longest prefix first tries it before W,
    # so the step at 70 ms admits it (queue 5 ms), with or without running the stretch in one go (which used to
    # ignore arrivals while someone waits, and admitted N at 90 ms). W: after A's last step, at 130 ms.
    shared = list(range(1, 9))
    trace = trace_of([shared + [50], list(range(100, 117)), list(range(200, 236)), shared + [60]],
                     outputs=[1, 12, 2, 2], times_ms=[0.0, 10.0, 20.0, 65.0])
    model = EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.0, scheduling_policy="lpm")
    for fast in (True, False):
        engine = Engine(PromptTokens(trace), arrivals(trace, model), BlockManager(12, 4), model, tqdm(disable=True),
                        record_decisions=not fast)
        engine.advance()
        assert engine.queue_ms == [0.0, 0.0, 5.0, 110.0]  # in admission order: R0, A, N, W


def test_a_block_promoted_from_an_offload_tier_costs_tier_ms_per_block():
    # A (3 full blocks + 1 token) finishes; B (6 blocks: the whole pool) evicts A's blocks into the tier; A again
    # (same 3 blocks, another last token) hits them in the tier: its step promotes 3 blocks, 3 x 7 ms more.
    a, b = list(range(1, 13)), list(range(20, 44))
    trace = trace_of([a + [90], b, a + [91]], outputs=[1, 1, 1], times_ms=[0.0, 100.0, 200.0])
    runs = []
    for tier_ms in (0.0, 7.0):
        manager = BlockManager(6, 4, num_offload_blocks=8)
        model = EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.5, tier_ms_per_block=tier_ms)
        engine = Engine(PromptTokens(trace), arrivals(trace, model), manager, model, tqdm(disable=True))
        engine.advance()
        runs.append((engine.metrics()["hit_blocks"], manager.tier_stats.tier_hit_blocks, engine.ttft_ms))
    (hits, tier_hits, ttft), (hits_7, tier_hits_7, ttft_7) = runs
    assert hits == hits_7 == tier_hits == tier_hits_7 == 3
    assert ttft_7[:2] == ttft[:2] and ttft_7[2] == ttft[2] + 21.0


NGRAM_4 = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize("rate, steps, drafts, accepted", [
    (1.0, 3, 6, 6),   # after the prefill's token: 4 drafts + 1 (6 tokens), then 2 + 1 (no draft past max_tokens)
    (0.0, 9, 22, 0),  # every draft missed: one token a step, drafts min(4, tokens left - 1): 4 x 4, 3, 2, 1, 0
])
def test_speculation_in_a_replay_follows_the_stated_acceptance(rate, steps, drafts, accepted):
    # One request, a 4-token prompt and 9 tokens to generate; each step 10 ms, each draft verified 1 ms more.
    trace = trace_of([[1, 2, 3, 4]], outputs=[9], times_ms=[0.0])
    model = EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.0, speculative_config=NGRAM_4,
                        draft_acceptance_rate=rate, draft_ms_per_token=1.0)
    manager = BlockManager(8, 4)
    metrics = replay_overlap(trace, manager, model, tqdm(disable=True))
    assert (metrics["draft_tokens"], metrics["accepted_draft_tokens"]) == (drafts, accepted)
    assert metrics["makespan_s"] == pytest.approx((10.0 * steps + drafts) / 1000.0)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_a_stated_acceptance_rate_is_the_share_of_first_drafts_kept():
    # Geometric: draft i is right with the rate if the ones before it were; a miss ends the run (WRONG_DRAFT on).
    proposer = StatedAcceptance(0.6)
    lasts = [PRIVATE_TOKEN_BASE + position for position in range(4000)]
    runs = [proposer.propose([1, 2, last], 3) for last in lasts]
    for last, run in zip(lasts, runs):  # the right drafts are the tokens after `last`; a miss ends them
        right = len(run) - run.count(WRONG_DRAFT)
        assert run == [last + 1 + i for i in range(right)] + [WRONG_DRAFT] * (3 - right)
    first = np.mean([run[0] != WRONG_DRAFT for run in runs])
    second = np.mean([run[1] != WRONG_DRAFT for run in runs if run[0] != WRONG_DRAFT])
    assert abs(first - 0.6) < 0.03 and abs(second - 0.6) < 0.03


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_config=NGRAM_4), "speculative_config and draft_acceptance_rate go together"),
    (dict(draft_acceptance_rate=0.5), "speculative_config and draft_acceptance_rate go together"),
    (dict(speculative_config=NGRAM_4, draft_acceptance_rate=1.5), "draft_acceptance_rate must be"),
])
def test_a_replay_speculates_only_with_a_stated_acceptance_rate(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        EngineModel(**kwargs)


class NewestFirst(V1Scheduler):
    """A learner's policy: the newest waiting request is admitted first."""

    def schedule(self):
        self.waiting = deque(reversed(self.waiting))
        try:
            return super().schedule()
        finally:
            self.waiting = deque(reversed(self.waiting))


def test_the_replay_runs_the_scheduler_it_is_given():
    # The same workload under the engine's V1 and V0 schedulers and a learner's subclass: each decides
    # differently (V0 never mixes prompts into decode steps; NewestFirst admits the newest first), and a
    # name the registry does not know is refused before anything is replayed.
    trace = random_trace(3, 30, 4, 24)
    rows = {name: replay(trace, block_size=4, capacity=24, mode="overlap",
                         engine=EngineModel(decode_step_ms=10.0, prefill_ms_per_token=0.5, scheduler=scheduler))
            for name, scheduler in [("v1", "v1"), ("v0", "v0"), ("newest", NewestFirst)]}
    assert rows["v1"]["mean_queue_s"] != rows["v0"]["mean_queue_s"] != rows["newest"]["mean_queue_s"]
    assert all(row["requests"] + row["requests_skipped"] + row["requests_dropped_mid_decode"] == 30
               for row in rows.values())
    with pytest.raises(InvalidArgumentError, match="unknown scheduler 'v2'"):
        replay(trace, block_size=4, capacity=24, mode="overlap", engine=EngineModel(scheduler="v2"))
    with pytest.raises(InvalidArgumentError, match="scheduler must be a name"):
        EngineModel(scheduler=3)


def test_a_sequential_study_never_imports_the_engine():
    # A sequential study, `make study`, needs no engine: only an overlap replay imports kvlab.engine
    # (kvlab.studies.engine_model), and neither imports torch (test_cost_model_replays_never_import_torch).
    code = ("import sys, math; from kvlab.studies import cache_hit_study, EngineModel; "
            "from kvlab.studies.cli import main; "
            "cache_hit_study('synthetic_parallel', limit=8, capacities=[math.inf], policies=['lru'], jobs=1, "
            "progress=False, engine=EngineModel(scheduler='v0')); "
            "print('torch' in sys.modules, 'kvlab.engine' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "False"]


def test_cost_model_replays_never_import_torch():
    # The engine's scheduler, its step and its drafter are plain Python: `import kvlab.studies` and a sequential,
    # an overlap and a fleet replay (the fleet of every router) load no torch; only LLM does (kvlab.engine).
    code = ("import sys, math; import kvlab.studies; from kvlab.studies import EngineModel, replay; "
            "from kvlab.studies.fleet import replay_fleet; from kvlab.studies.synthetic import multi_turn_chat; "
            "trace = multi_turn_chat(num_conversations=4, turns=3, seed=0); "
            "rows = [replay(trace, block_size=16, capacity=64, mode=mode, engine=EngineModel(scheduler=scheduler)) "
            "        for mode in ('sequential', 'overlap') for scheduler in ('v1', 'v0')]; "
            "fleet = replay_fleet(trace, block_size=16, capacity=64, replicas=2, router='cache_aware'); "
            "assert all(row['requests'] for row in rows) and fleet['requests']; "
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch')[:3], "
            "'kvlab.engine.llm' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]", "False"]
