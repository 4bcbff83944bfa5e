"""The engine's prefix-cache counters (issue 25 §3): on prompts that share nothing, preemption by recompute
leaves a 0% hit rate (the re-admitted requests' own blocks are ``recomputed_*``, vLLM #25780), and
``make_prefix_cache_stats()`` gives one run's counters beside the cumulative ones."""

import random

from engine_helpers import VOCAB, make_llm
from kvlab.engine import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_preemption_by_recompute_is_not_a_prefix_hit_and_runs_are_counted_apart(qwen3):
    path, _ = qwen3
    llm = make_llm(path, num_blocks=10, preemption_mode="recompute")  # 3 prompts of 2 blocks grow to 4 each
    rng = random.Random(2)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(15)] for _ in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    stats = llm.prefix_cache_stats
    assert stats.hit_blocks == 0 and stats.hit_rate == 0.0 and stats.queried_tokens == 3 * 15
    assert stats.recomputed_blocks > 0  # what vLLM counted as hits before #25780's fix
    first = llm.make_prefix_cache_stats()
    assert first == stats
    llm.generate([prompts[0] + [1]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    second = llm.make_prefix_cache_stats()  # this run alone: a 16-token prompt whose first block is cached
    assert (second.queried_tokens, second.hit_blocks, second.recomputed_blocks) == (16, 1, 0)
    assert llm.prefix_cache_stats.queried_tokens == 3 * 15 + 16


def test_the_engine_names_every_prompt_token_s_cause(qwen3):
    path, _ = qwen3
    llm = make_llm(path, num_blocks=10, preemption_mode="recompute")
    rng = random.Random(2)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(15)] for _ in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)
    llm.generate([prompts[0] + [1]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    stats, tokens = llm.prefix_cache_stats, llm.hit_doctor.tokens
    assert tokens["recompute"] == stats.recomputed_queried_tokens > 0  # re-admissions: never a hit
    assert tokens["hit_gpu"] == stats.hit_tokens > 0
    assert sum(tokens.values()) - tokens["recompute"] == stats.queried_tokens == 3 * 15 + 16
    causes = llm.miss_causes
    assert causes["tokens"].sum() == sum(tokens.values()) and abs(causes["share"].sum() - 1) < 1e-9
