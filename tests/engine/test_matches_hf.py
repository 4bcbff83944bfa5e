"""The engine against Hugging Face transformers on tiny random Llama and Qwen3 models (fp32, CPU): prefill
logits, greedy generation with prefix hits mid-batch, under preemption (recompute and swap) and without
prefix caching, with both attention backends (the Triton one, interpreted on CPU, on fewer cases: it is
slow there). After every run the pool is clean (check_invariants, every block free or cached)."""

import random

import pytest
import torch

from engine_helpers import VOCAB, assert_pool_clean, hf_greedy, make_llm
from kvlab.engine import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def shared_prefix_prompts(seed=1):
    """Five prompts (block size 8): two share a 20-token prefix (16 tokens = 2 full blocks), one shares its
    first 12 tokens (1 block), two share nothing; and a sixth, sent later, shares the 20-token prefix too."""
    rng = random.Random(seed)
    base = random_tokens(rng, 20)
    prompts = [base + random_tokens(rng, 3), base + random_tokens(rng, 6), random_tokens(rng, 5),
               base[:12] + random_tokens(rng, 4), random_tokens(rng, 11)]
    return prompts, base + random_tokens(rng, 9)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_logits_match_hf(tiny_model, backend):
    path, hf = tiny_model
    llm = make_llm(path, attention_backend=backend)
    prompts, late = shared_prefix_prompts()
    for batch in (prompts, [late]):  # the second batch hits blocks the first one left cached
        ids = [llm.add_request(p, SamplingParams(max_tokens=1)) for p in batch]
        step = llm.scheduler.schedule()
        assert step.kind == "prefill" and len(step.seqs) == len(batch)
        llm.runner.begin_step(step)
        logits = llm.runner.forward(step, step.entries)
        for i in ids:  # the step ran, so its sequences may be freed now
            llm.abort_request(i)
        assert [o.request_id for o in llm.step()] == ids  # the aborted requests' outputs
        with torch.no_grad():
            expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in batch])
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert llm.block_manager.stats.hit_tokens == 16 + 8 + 16
    assert_pool_clean(llm)


@pytest.mark.parametrize("arch, backend", [("llama", "torch"), ("qwen3", "torch"), ("llama", "triton")])
def test_greedy_matches_hf_with_prefix_hits_mid_batch(request, arch, backend):
    path, hf = request.getfixturevalue(arch)
    llm = make_llm(path, attention_backend=backend)
    prompts, late = shared_prefix_prompts()
    max_tokens = [6, 4, 7, 5, 3]
    ids = [llm.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts, max_tokens)]
    outs, steps = {}, 0
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
        steps += 1
        if steps == 2:  # joins while the others decode
            ids.append(llm.add_request(late, SamplingParams(max_tokens=4, **GREEDY)))
            max_tokens.append(4)
    for request_id, prompt, m in zip(ids, prompts + [late], max_tokens):
        out = outs[request_id]
        assert out.finished and out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, m)
        assert out.outputs[0].finish_reason == "length"
    assert [outs[i].metrics.num_cached_prompt_tokens for i in ids] == [0, 16, 0, 8, 0, 16]
    records = llm.step_dataframe()
    assert records.loc[0, "kind"] == "prefill" and records.loc[0, "cached_tokens"] == 24  # hits within one step
    assert records.loc[0, "num_tokens"] == sum(map(len, prompts)) - 24
    # The late request's prompt runs in the same step as the others' decodes (V1 scheduling, the default).
    assert list(records["kind"][:3]) == ["prefill", "decode", "mixed"]
    assert (records.loc[2, "prefill_tokens"], records.loc[2, "decode_tokens"]) == (len(late) - 16, 5)
    assert_pool_clean(llm)


@pytest.mark.parametrize("scheduling, cached", [("v1", [0, 10, 12]), ("v0", [0, 8, 12])])
def test_greedy_matches_hf_with_partial_block_hits(qwen3, scheduling, cached):
    """prefix_match_unit=2 on 8-token blocks: a prompt hits the whole 2-token units of a block another prompt
    wrote, copied into its own block before its step (the copy's later positions hold the other sequence's K/V
    until this one writes them). V1: the second prompt joins while the first decodes and copies from its block
    in use (V0 runs the prompt before the decode that makes the first one's units findable: whole blocks only);
    the third, the first prompt again, copies from a free block."""
    path, hf = qwen3
    llm = make_llm(path, scheduling=scheduling, prefix_match_unit=2)
    assert llm.kv_cache_config.prefix_match_unit == llm.block_manager.prefix_match_unit == 2  # the spec carries it
    rng = random.Random(3)
    base = random_tokens(rng, 13)
    prompts = [base, base[:11] + random_tokens(rng, 4)]  # the second: 8 + 3 tokens of the first, then others
    ids = [llm.add_request(prompts[0], SamplingParams(max_tokens=6, **GREEDY))]
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
        if len(ids) == 1:  # joins once the first prompt's step ran
            ids.append(llm.add_request(prompts[1], SamplingParams(max_tokens=5, **GREEDY)))
    again, = llm.generate([base], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    for out, prompt, m in zip([outs[ids[0]], outs[ids[1]], again], prompts + [base], [6, 5, 4]):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, m)
    assert [out.metrics.num_cached_prompt_tokens for out in (outs[ids[0]], outs[ids[1]], again)] == cached
    assert llm.step_dataframe()["cow_copies"].sum() == sum(c % 8 > 0 for c in cached)  # one copy per partial hit
    assert llm.miss_causes["tokens"]["hit_gpu"] == sum(cached)  # the hit-rate doctor counts the units as hits
    assert_pool_clean(llm)


def preemption_prompts():
    rng = random.Random(2)
    return [random_tokens(rng, 15) for _ in range(4)]


@pytest.mark.parametrize("settings", [
    dict(preemption_mode="recompute"),
    dict(preemption_mode="swap"),
    dict(preemption_mode="recompute", enable_prefix_caching=False),
    dict(preemption_mode="recompute", attention_backend="triton"),
    dict(preemption_mode="swap", attention_backend="triton"),
], ids=["recompute", "swap", "no_prefix_caching", "recompute-triton", "swap-triton"])
def test_greedy_matches_hf_under_preemption(qwen3, settings):
    """Four 15-token prompts take 2 blocks each of a 9-block pool; growing to 23 tokens needs 3 each."""
    path, hf = qwen3
    llm = make_llm(path, num_blocks=9, **settings)
    prompts = preemption_prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    records = llm.step_dataframe()
    assert records["preempted"].sum() > 0
    assert sum(o.metrics.num_preemptions for o in outs) == records["preempted"].sum()
    swapped = records["blocks_swapped_out"].sum()
    if settings["preemption_mode"] == "swap":
        assert swapped > 0 and records["blocks_swapped_in"].sum() == swapped
    else:
        assert swapped == 0
    if not settings.get("enable_prefix_caching", True):
        assert llm.block_manager.stats.queried_tokens == 0 and records["blocks_cached"].max() == 0
    assert_pool_clean(llm)


def test_a_sequence_that_outgrows_the_pool_is_aborted_with_a_reason(llama):
    path, hf = llama
    llm = make_llm(path, num_blocks=4)
    rng = random.Random(3)
    long, short = random_tokens(rng, 25), random_tokens(rng, 3)
    params = [SamplingParams(max_tokens=20, **GREEDY), SamplingParams(max_tokens=2, **GREEDY)]
    outs = llm.generate([long, short], params, use_tqdm=False)
    aborted = outs[0].outputs[0]
    assert aborted.finish_reason == "abort" and "pool" in aborted.abort_reason
    # It ran until its 4 blocks (32 tokens) were full; the token sampled from position 31 is kept: 8 tokens,
    # all of them right.
    assert aborted.token_ids == hf_greedy(hf, long, 8)
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, short, 2)
    assert_pool_clean(llm)
