"""Speculative decoding in the engine (n-gram prompt lookup): greedy output token for token equal to decoding
without speculation and to HF transformers, for k = 1..8 and with everything else the engine does (prefix hits,
chunked prompts, preemption, forks, sliding windows, stops inside an accepted run); drafts counted; prefix
hits unchanged; sampled output distributed as the target's."""

import random

import pytest
import torch
from scipy.stats import chisquare

from engine_helpers import assert_pool_clean, hf_greedy, make_llm, save_tiny_model
from kvlab.engine import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ngram(k: int, low: int = 1, high: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}


def copy_heavy_prompts(seed: int, count: int = 3) -> list[list[int]]:
    """Prompts that repeat a random phrase: the tiny random model tends to continue such patterns, and prompt
    lookup finds them, so drafts get accepted as well as rejected."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(1, 128) for _ in range(5 + i)]
        prompts.append(phrase * 3 + [rng.randrange(1, 128) for _ in range(i)])
    return prompts


def generate(llm, prompts, max_tokens, **params):
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **{**GREEDY, **params}), use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def expected(llama):
    """The prompts of the k sweep and their greedy outputs: HF's, checked equal to kvlab's without speculation."""
    path, hf = llama
    prompts = copy_heavy_prompts(1)
    outputs = [[hf_greedy(hf, p, 16)] for p in prompts]
    assert tokens(generate(make_llm(path), prompts, 16)) == outputs
    return prompts, outputs


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_equals_hf_and_plain_decoding_for_every_k(llama, expected, k):
    path, _ = llama
    prompts, outputs = expected
    llm = make_llm(path, speculative_config=ngram(k))
    outs = generate(llm, prompts, 16)
    assert tokens(outs) == outputs
    proposed = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0 < accepted < proposed  # drafts were both accepted and rejected
    records = llm.step_dataframe()
    assert (records["draft_tokens"].sum(), records["accepted_tokens"].sum()) == (proposed, accepted)
    assert records["rejected_draft_slots"].sum() == proposed - accepted
    assert records["draft_tokens"].max() <= k * len(prompts)
    assert len(records) < 16  # fewer steps than one token a step would take
    assert_pool_clean(llm)


@pytest.mark.parametrize("k", [2, 8])
def test_suffix_decoding_keeps_greedy_output_and_learns_from_earlier_requests(llama, expected, k):
    """The same prompts twice on one engine: the second time, the first run's outputs (cached when their
    sequences finished) are proposed as well, and more drafts are accepted; output equal to HF's both times."""
    path, _ = llama
    prompts, outputs = expected
    llm = make_llm(path, speculative_config={"method": "suffix", "num_speculative_tokens": k})
    first = generate(llm, prompts, 16)
    assert tokens(first) == outputs
    assert len(llm.speculation.proposer.cached_outputs) == len(prompts)
    again = generate(llm, prompts, 16)
    assert tokens(again) == outputs
    accepted = [sum(o.metrics.num_accepted_tokens for o in outs) for outs in (first, again)]
    assert 0 < accepted[0] < accepted[1]
    assert llm.step_dataframe()["draft_tokens"].max() <= k * len(prompts)
    assert_pool_clean(llm)


def test_metrics_are_vllms(llama):
    path, _ = llama
    out, = generate(make_llm(path, speculative_config=ngram(4)), copy_heavy_prompts(3, 1), 20)
    m = out.metrics
    assert m.num_drafting_steps > 0
    assert m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
    assert m.mean_accepted_length == 1 + m.num_accepted_tokens / m.num_drafting_steps
    assert m.num_rejected_draft_slots == m.num_draft_tokens - m.num_accepted_tokens
    assert m.num_generated_tokens == 20


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prompts_and_prefix_hits_on_blocks_others_sealed(llama, backend):
    """A budget of 7: prompts in chunks beside decodes with drafts (drafts also fit the budget); the later
    prompts share the first one's first 16 tokens and hit the blocks its chunks sealed. The hit count is the
    same with speculation as without."""
    path, hf = llama
    first = copy_heavy_prompts(11, 1)[0] * 2
    prompts = [first, first[:16] + [5, 9, 5, 9, 5], first[:17] + [77]]
    runs = {}
    for k in (0, 4):
        llm = make_llm(path, max_num_batched_tokens=7, max_num_seqs=3, attention_backend=backend,
                       speculative_config=ngram(k) if k else None)
        outs = generate(llm, prompts, 12)
        assert tokens(outs) == [[hf_greedy(hf, p, 12)] for p in prompts]
        records = llm.step_dataframe()
        assert (records["num_tokens"] <= 7).all() and (records["kind"] == "mixed").any()
        runs[k] = ([o.metrics.num_cached_prompt_tokens for o in outs], llm.block_manager.stats.hit_tokens,
                   sum(o.metrics.num_accepted_tokens for o in outs))
        assert_pool_clean(llm)
    assert runs[0][:2] == runs[4][:2] and runs[0][0][1:] == [16, 16]
    assert runs[4][2] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts(qwen3, mode):
    """Four 15-token prompts in a 9-block pool: growing needs room the others hold, drafts included."""
    path, hf = qwen3
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 128) for _ in range(5)] * 3 for _ in range(4)]
    llm = make_llm(path, num_blocks=9, preemption_mode=mode, speculative_config=ngram(3))
    outs = generate(llm, prompts, 8)
    assert tokens(outs) == [[hf_greedy(hf, p, 8)] for p in prompts]
    records = llm.step_dataframe()
    assert records["preempted"].sum() > 0 and records["draft_tokens"].sum() > 0
    if mode == "swap":
        assert records["blocks_swapped_out"].sum() > 0
    assert_pool_clean(llm)


def test_forked_samples_verify_their_drafts_each(llama):
    path, hf = llama
    prompts = copy_heavy_prompts(5, 2)
    llm = make_llm(path, speculative_config=ngram(3))
    outs = generate(llm, prompts, 12, n=3)
    assert tokens(outs) == [[hf_greedy(hf, p, 12)] * 3 for p in prompts]
    assert all(o.metrics.num_accepted_tokens > 0 for o in outs)
    assert_pool_clean(llm)


@pytest.mark.parametrize("kind", ["mixed", "sliding"])
def test_sliding_window_models(tmp_path, kind):
    """Window 8, blocks of 4: drafts run past the window and blocks leave it (the hybrid models' fixture)."""
    layer_types = {"mixed": ["sliding_attention", "full_attention", "sliding_attention"],
                   "sliding": ["sliding_attention"] * 2}[kind]
    hf = save_tiny_model("qwen3", tmp_path, seed={"mixed": 1, "sliding": 0}[kind], use_sliding_window=True,
                         sliding_window=8, layer_types=layer_types, num_hidden_layers=len(layer_types))
    prompts = copy_heavy_prompts(7, 2)
    llm = make_llm(tmp_path, block_size=4, num_blocks=48, max_num_batched_tokens=9, max_num_seqs=3,
                   speculative_config=ngram(4))
    outs = generate(llm, prompts, 14)
    assert tokens(outs) == [[hf_greedy(hf, p, 14)] for p in prompts]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    llm.block_manager.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks - 1  # block 0: the null block


def test_a_stop_token_or_max_tokens_inside_an_accepted_run_ends_it_there(llama):
    """Every token of the plain output, made a stop token, ends the output right after its first occurrence,
    as without speculation, even when it was an accepted draft; every max_tokens ends it at that length."""
    path, hf = llama
    prompt = copy_heavy_prompts(3, 1)[0]
    expected = hf_greedy(hf, prompt, 20)
    llm = make_llm(path, speculative_config=ngram(8))
    stops = list(dict.fromkeys(expected))
    outs = llm.generate([prompt] * len(stops), [SamplingParams(max_tokens=20, stop_token_ids=[t], **GREEDY)
                                                for t in stops], use_tqdm=False)
    for out, stop in zip(outs, stops):
        sample = out.outputs[0]
        assert sample.token_ids == expected[:expected.index(stop) + 1]
        assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)
    length_runs = [SamplingParams(max_tokens=m, **GREEDY) for m in range(1, 21)]
    outs = llm.generate([prompt] * 20, length_runs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[:m] for m in range(1, 21)]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert_pool_clean(llm)


@pytest.mark.parametrize("config", [ngram(3), {"method": "suffix", "num_speculative_tokens": 4}],
                         ids=["ngram", "suffix"])
def test_a_seeded_request_samples_the_same_whatever_else_runs(llama, config):
    """vLLM's seed contract with speculation: a seeded request (n = 2: a stream per sample) gets the same
    samples alone, beside other requests, in a pool small enough to preempt it (recompute or swap) and under a
    budget that cuts drafts; and they are the samples decoding without speculation draws. The drafts a
    sequence gets differ between these runs (the budget, the pool and, for suffix decoding, other requests'
    outputs decide them); before, each draft took its own random draws, so the stream shifted with them."""
    path, _ = llama
    prompts = copy_heavy_prompts(1, 4)
    seeded = SamplingParams(n=2, temperature=0.3, seed=1234, max_tokens=24, ignore_eos=True)
    others = [SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=12, **GREEDY)]

    def samples(num_others: int, speculative_config=config, **settings):
        llm = make_llm(path, speculative_config=speculative_config, **settings)
        outs = llm.generate(prompts[:1 + num_others], [seeded] + others[:num_others], use_tqdm=False)
        assert_pool_clean(llm)
        return [c.token_ids for c in outs[0].outputs], outs[0].metrics, llm.step_dataframe()

    alone, metrics, _ = samples(0)
    assert alone[0] != alone[1] and metrics.num_accepted_tokens > 0
    for num_others, settings in [(2, {}), (3, dict(max_num_batched_tokens=6, max_num_seqs=6)),
                                 (3, dict(num_blocks=14)), (3, dict(num_blocks=14, preemption_mode="swap"))]:
        batched, _, records = samples(num_others, **settings)
        assert batched == alone, (num_others, settings)
        if "num_blocks" in settings:
            assert records["preempted"].sum() > 0
    assert samples(0, speculative_config=None)[0] == alone


def test_sampled_next_token_distribution_is_the_targets(llama):
    """Temperature 0.7, many seeds: after a 128-token prompt holding every token once, prompt lookup proposes
    for every first token t1 what followed t1 in the prompt, so the second token is always verified against a
    draft. Drafts are accepted as often as p(draft | t1) says (a z-bound), and the second tokens drawn fit
    their distribution, sum over t1 of p(t1) p(t2 | t1), computed by HF (chi-square)."""
    path, hf = llama
    prompt = random.Random(4).sample(range(128), 128)
    llm = make_llm(path, num_blocks=256, max_num_seqs=100, speculative_config=ngram(2, 1, 1))
    draws, temperature = 1000, 0.7
    outs = llm.generate([prompt] * draws, [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True,
                                                          seed=s) for s in range(draws)], use_tqdm=False)
    # one draft each, at the second step (max_tokens leaves room for one draft and the target's token)
    assert [o.metrics.num_draft_tokens for o in outs] == [1] * draws
    with torch.no_grad():
        p1 = (hf(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)
        p2 = (hf(torch.tensor([prompt + [t] for t in range(128)])).logits[:, -1].double() / temperature).softmax(-1)
    follows = {t: prompt[i + 1] if i + 1 < len(prompt) else t for i, t in enumerate(prompt)}  # the draft after t
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    accept_p = torch.tensor([float(p2[t, follows[t]]) for t in firsts])
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert abs(accepted - accept_p.sum()) < 4 * (accept_p * (1 - accept_p)).sum().sqrt()
    second = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=128).double()
    expected = (p1 @ p2) * draws
    big = expected >= 5  # bins: every token expected at least 5 times, and the rest together
    assert int(big.sum()) >= 10
    observed = second[big].tolist() + [float(second[~big].sum())]
    expected = expected[big].tolist() + [float(expected[~big].sum())]
    assert chisquare(observed, expected).pvalue > 1e-3
