"""Continuous-batching replay: what a preempted request keeps, and a sequence that outgrows the whole pool.

Every expected number is worked out by hand in the comments (block size 4 throughout; "pos p" is the
0-based position of the token a step stores; a new block starts at every pos that is a multiple of 4).
"""

import math

import numpy as np
import pandas as pd
import pytest
from tqdm.auto import tqdm

from kvlab import BlockManager
from kvlab.errors import InvalidArgumentError
from kvlab.studies import EngineModel, replay
from kvlab.studies.overlap import replay_overlap

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
    # the youngest: preempted with the 8 + 3 tokens it stored (pos 8..10). J waits for K's blocks,
    # returns at step 8 hitting 2 blocks (recomputes 3 tokens), grows at step 10 (pos 12, its 4th block)
    # and at step 14 (pos 16) needs a 5th while alone: dropped.
    trace = trace_of([[500], list(range(8))], outputs=[8, 100], times_ms=[0, 0])
    metrics = replay_on_a_fresh_pool(trace, 4)
    assert metrics["requests_skipped"] == 0 and metrics["preemptions"] == 1 and metrics["recomputed_tokens"] == 3
    assert metrics["requests"] == 1 and metrics["requests_dropped_mid_decode"] == 1


def test_a_self_preempted_sequence_keeps_the_tokens_whose_kv_it_stored():
    # Pool of 6. A: 4-token prompt, final 12 tokens, grows at steps 1 and 5, finishes at step 8.
    # B: 6-token prompt, final 24 tokens (6 blocks), grows at steps 3, 7, ... Step 7: B needs its 4th
    # block, none is free, and B is the youngest: it preempts itself with the 12 tokens it stored (3 full
    # blocks, all sealed). Step 8: readmitted, hits 2 blocks (its last token is always computed),
    # recomputes 4, finishes at step 8 + 24 - 12 = 20. Makespan: 21 steps + 14 prefilled tokens.
    trace = trace_of([list(range(4)), list(range(100, 106))], outputs=[9, 19], times_ms=[0, 0])
    metrics = replay_on_a_fresh_pool(trace, 6)
    assert metrics["preemptions"] == 1 and metrics["recomputed_tokens"] == 4 and metrics["requests"] == 2
    assert metrics["makespan_s"] == pytest.approx((21 * 10 + (10 + 4) * 0.5) / 1000)


@pytest.mark.parametrize("younger_row_first", [True, False])
def test_a_preemption_does_not_depend_on_who_grew_first_within_the_step(younger_row_first):
    # Pool of 4. X (t=0): 4-token prompt, final 9 tokens, grows at steps 1 and 5, finishes at step 5.
    # Y (t=1 ms, admitted at step 1): 5-token prompt, final 14, grows at step 5 (pos 8). At step 5 both
    # need a block and none is free; Y is the youngest, so Y goes whether it asks first (preempting
    # itself) or X does. Either way Y stored 8 tokens, returns at step 6 hitting 1 block, recomputes 4
    # and finishes at step 6 + 14 - 8 = 12. Makespan: 13 steps + 13 prefilled tokens.
    x, y = (list(range(300, 304)), 6, 0.0), (list(range(200, 205)), 10, 1.0)
    rows = [y, x] if younger_row_first else [x, y]
    trace = trace_of(*(list(column) for column in zip(*rows)))
    metrics = replay_on_a_fresh_pool(trace, 4)
    assert metrics["preemptions"] == 1 and metrics["recomputed_tokens"] == 4 and metrics["requests"] == 2
    assert metrics["makespan_s"] == pytest.approx((13 * 10 + (4 + 5 + 4) * 0.5) / 1000)
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
