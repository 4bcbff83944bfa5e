"""The engine with an offload tier (``LLM(num_offload_blocks=...)``): a shared system prompt evicted from a pool
too small to keep it is offloaded to the tier, promoted back for the next request (a CPU -> GPU copy before the
forward pass) and generation stays token for token HF's greedy output, with both attention backends."""

import random

import pytest
from engine_helpers import VOCAB, assert_pool_clean, hf_greedy, make_llm

from kvlab import InvalidArgumentError
from kvlab.engine import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("backend, policy", [("torch", "lru"), ("torch", "arc"), ("triton", "lru")])
def test_greedy_matches_hf_when_a_shared_system_prompt_is_evicted_and_promoted_back(llama, backend, policy):
    path, hf = llama
    llm = make_llm(path, num_blocks=8, num_offload_blocks=16, offload_policy=policy, attention_backend=backend)
    rng = random.Random(3)
    system = [rng.randrange(1, VOCAB) for _ in range(24)]   # three blocks of 8
    first, second = system + [rng.randrange(1, VOCAB) for _ in range(5)], system + [7, 8, 9]
    evictor = [rng.randrange(1, VOCAB) for _ in range(60)]  # with its 3 decode slots, all 8 blocks of the pool
    outputs = [llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
               for prompt in (first, evictor, second)]
    for prompt, out in zip((first, evictor, second), outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 4)
    stats = llm.block_manager.tier_stats
    assert stats.tier_hit_blocks == 3 and stats.gpu_hit_blocks == 0 and stats.offloaded_blocks >= 3
    assert outputs[2].metrics.num_cached_prompt_tokens == 24
    assert_pool_clean(llm)


def test_a_bad_tier_option_is_refused_before_the_model_loads(llama):
    path, _ = llama
    with pytest.raises(InvalidArgumentError, match="offload_policy"):
        make_llm(path, num_offload_blocks=4, offload_policy="mru")
