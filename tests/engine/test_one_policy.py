"""One scheduling policy: the overlap study's replay (``kvlab.studies.overlap``) runs the engine's own scheduler
under a cost model, so a replay and an engine run of the same workload make the same decisions, step by step:
who is admitted (and with which chunk), who decodes, who is preempted, who is aborted, and the queues."""

import numpy as np
import pandas as pd
import pytest
from tqdm.auto import tqdm

from engine_helpers import BLOCK_SIZE, make_llm
from kvlab import BlockManager
from kvlab.engine import SamplingParams
from kvlab.studies import EngineModel
from kvlab.studies.overlap import Engine, arrivals
from kvlab.studies.traces import PromptTokens

STEP_MS = 10.0
# (prompt, tokens to generate, the step before which it arrives). Shared prefixes give prefix hits; a pool
# of 9 blocks of 8 tokens is too small for all of them at once, so sequences are preempted and recomputed;
# 12 tokens x 6 requests outgrow the token budget of V1's run, so prompts are chunked.
SHARED = list(range(10, 26))
WORKLOAD = [(SHARED + [30, 31, 32], 14, 0), (SHARED + [40, 41], 9, 0), (list(range(50, 61)), 20, 0),
            ([70, 71, 72], 12, 0), (SHARED + [80], 6, 3), (list(range(90, 102)), 11, 7)]


def engine_decisions(path, scheduling: str, budget: int) -> list:
    llm = make_llm(path, scheduling=scheduling, max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=9,
                   record_decisions=True)
    pending, step = list(enumerate(WORKLOAD)), 0
    while pending or llm.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, output, _) = pending.pop(0)
            llm.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output), str(i))
        assert llm.step() is not None and len(llm.step_records) == step + 1  # never idle: steps line up
        step += 1
    return llm.decisions


def replay_decisions(scheduling: str, budget: int) -> list:
    """The same workload as a trace: arriving at the start of its step (a step costs STEP_MS, a prefill
    token nothing, so step k starts at k x STEP_MS)."""
    trace = pd.DataFrame({"timestamp": [STEP_MS * step for _, _, step in WORKLOAD],
                          "input_length": [len(prompt) for prompt, _, _ in WORKLOAD],
                          "output_length": [output for _, output, _ in WORKLOAD], "hash_ids": None,
                          "token_ids": [np.asarray(prompt, dtype=np.int64) for prompt, _, _ in WORKLOAD]})
    model = EngineModel(decode_step_ms=STEP_MS, prefill_ms_per_token=0.0, max_num_seqs=4,
                        max_num_batched_tokens=budget, scheduler=scheduling)
    manager = BlockManager(9, BLOCK_SIZE)
    engine = Engine(PromptTokens(trace), arrivals(trace, model), manager, model, tqdm(disable=True),
                    record_decisions=True)
    engine.advance()
    assert manager.num_free_blocks == 9
    return engine.decisions


@pytest.mark.parametrize("scheduling, budget", [("v1", 12), ("v0", 64)])
def test_a_study_replay_and_an_engine_run_make_the_same_decisions(llama, scheduling, budget):
    served, replayed = engine_decisions(llama[0], scheduling, budget), replay_decisions(scheduling, budget)
    assert sum(len(d.preempted) for d in served) > 0  # the pool is short: victims are chosen
    assert sum(e.prefill and e.start > 0 for d in served for e in d.ran) > 0  # hits (V1: and later chunks)
    assert len(replayed) == len(served)
    for ours, theirs in zip(replayed, served):
        assert ours == theirs, f"step {theirs.step}"
