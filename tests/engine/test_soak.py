"""A soak of everything that can go wrong at once: speculative decoding (n-gram, suffix, and a faulty custom
proposer that raises or returns junk at random), the offload tier, an fp8 KV cache, prefix caching, preemption by
recompute and by swap, aborts mid-flight, n <= 3 and seeded sampling, in a pool small enough to preempt.

Every request that is not aborted must give what it gives run alone in an idle engine of the same settings:
greedy tokens, and seeded samples too (a request's seed alone fixes its samples); at the end every block of the
pool is free again. ``KVLAB_SOAK_SECONDS`` (default 20) bounds the run: set it to minutes to soak for real.
"""

import os
import random
import time
import warnings

import pytest
from engine_helpers import VOCAB, assert_pool_clean, make_llm

from kvlab.engine import SamplingParams
from kvlab.engine.proposers import PROPOSERS, NgramProposer
from kvlab.errors import ProposerWarning

SOAK_SECONDS = float(os.environ.get("KVLAB_SOAK_SECONDS", "20"))


class FaultyProposer(NgramProposer):
    """Prompt lookup that, at random, raises or answers junk in either hook (what a learner's first proposer
    does): the engine must drop its drafts, never a request."""
    options = NgramProposer.options + ("fault_seed",)

    def __init__(self, fault_seed=0, **options):
        super().__init__(**options)
        self.rng = random.Random(fault_seed)

    def propose(self, tokens, max_tokens):
        tokens.append(-7)  # the engine hands out a copy: changing it must change nothing
        fault = self.rng.randrange(8)
        if fault == 0:
            raise RuntimeError("the proposer fell over")
        junk = {1: None, 2: [10**6, -1], 3: "abc", 4: [1.5], 5: list(range(max_tokens + 3))}
        if fault in junk:
            return junk[fault]
        return super().propose(tokens[:-1], max_tokens)

    def finished(self, tokens, num_prompt_tokens):
        if self.rng.random() < 0.3:
            raise ValueError("the proposer cannot learn from this")


# (speculative method, engine settings): each round runs one, in turn.
SETTINGS = [
    ("faulty", dict(preemption_mode="recompute", kv_cache_dtype="fp8")),
    ("ngram", dict(preemption_mode="swap", num_offload_blocks=24)),
    ("suffix", dict(preemption_mode="recompute", num_offload_blocks=24, offload_policy="arc")),
    ("faulty", dict(preemption_mode="swap", kv_cache_dtype="fp8")),
]


def _engine(path, method, settings):
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": 3}
    return make_llm(path, num_blocks=14, max_num_seqs=8, max_num_batched_tokens=32, speculative_config=spec, **settings)


def _workload(rng):
    """Prompts sharing a few prefixes (so hits, evictions and tier promotions happen), with repeats inside
    (so n-gram drafts are accepted), each greedy or seeded with n <= 3."""
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.choice((8, 16, 20)))] for _ in range(3)]
    requests = []
    for _ in range(rng.randrange(5, 9)):
        motif = [rng.randrange(1, VOCAB) for _ in range(3)]
        prompt = rng.choice(prefixes) + motif * rng.randrange(1, 4) + [rng.randrange(1, VOCAB)]
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(3, 12), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.8, n=rng.randrange(1, 4), seed=rng.randrange(2**32),
                                    max_tokens=rng.randrange(3, 12), ignore_eos=True)
        requests.append((prompt, params))
    return requests


def _samples(output):
    return [list(sample.token_ids) for sample in sorted(output.outputs, key=lambda s: s.index)]


@pytest.mark.slow
def test_a_soak_of_speculation_tiers_fp8_preemption_and_aborts_gives_every_request_its_solo_output(
        llama, monkeypatch):
    path, _ = llama
    monkeypatch.setitem(PROPOSERS, "faulty", FaultyProposer)
    warnings.simplefilter("ignore", ProposerWarning)  # the faults are the point; each is checked below
    rng = random.Random(2026)
    deadline, rounds = time.monotonic() + SOAK_SECONDS, 0
    seen = dict(preemptions=0, accepted_drafts=0, tier_hits=0, aborts=0, compared=0)
    while rounds < len(SETTINGS) or time.monotonic() < deadline:
        method, settings = SETTINGS[rounds % len(SETTINGS)]
        llm, solo = _engine(path, method, settings), _engine(path, method, settings)
        requests = _workload(rng)
        ids = [llm.add_request(prompt, params) for prompt, params in requests]
        outputs, aborted = {}, set()
        while llm.has_unfinished_requests():
            if rng.random() < 0.1:
                victim = rng.choice(ids)
                llm.abort_request(victim)
                aborted.add(victim)
            for output in llm.step():
                outputs[output.request_id] = output
        for request_id, (prompt, params) in zip(ids, requests):
            output = outputs[request_id]
            seen["preemptions"] += output.metrics.num_preemptions
            seen["accepted_drafts"] += output.metrics.num_accepted_tokens
            if request_id in aborted and any(s.finish_reason == "abort" for s in output.outputs):
                seen["aborts"] += 1
                continue
            assert all(s.finish_reason == "length" for s in output.outputs), (method, settings, output)
            alone = solo.generate([prompt], params, use_tqdm=False)[0]
            assert _samples(output) == _samples(alone), (method, settings, prompt, params)
            seen["compared"] += 1
        if settings.get("num_offload_blocks"):
            seen["tier_hits"] += llm.block_manager.tier_stats.tier_hit_blocks
        assert_pool_clean(llm)
        assert_pool_clean(solo)
        if method == "faulty":
            assert llm.speculation.failures["propose"] > 0  # the faults did happen
        rounds += 1
    assert all(seen.values()), seen  # every hazard happened at least once, and outputs were compared
