"""Speculative decoding's parts without a model: ``speculative_config`` checking, the n-gram proposer, and the
acceptance rule, whose kept tokens must be distributed as the target's (chi-square over many draws)."""

import pytest
import torch
from scipy.stats import chisquare

from engine_helpers import hf_greedy, make_llm
from kvlab.engine.proposers import PROPOSERS, NgramProposer, Proposer, SuffixProposer
from kvlab.engine.sampler import Sampler, probabilities, sample_generator
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.speculative import accept, resolve_speculative_config
from kvlab.errors import InvalidArgumentError


@pytest.mark.parametrize("config, match", [
    ("ngram", "must be None or a dict"),
    ({"method": "eagle", "num_speculative_tokens": 2}, r"method.*\['ngram', 'suffix'\].*'eagle'"),
    ({"num_speculative_tokens": 2}, r"method.*got None"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, r"method.*\['ngram', 'suffix'\].*got \['ngram'\]"),
    ({"method": {"ngram": 1}, "num_speculative_tokens": 2}, r"method.*\['ngram', 'suffix'\].*got \{'ngram': 1\}"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens.*>= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"unknown keys \['model'\].*allowed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min.*>= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=3"),
])
def test_a_bad_speculative_config_is_refused_saying_what_is_allowed(config, match):
    with pytest.raises(InvalidArgumentError, match=match):
        resolve_speculative_config(config)


def test_llm_refuses_a_bad_config_and_v0_scheduling(llama):
    path, _ = llama
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        make_llm(path, speculative_config={"method": "ngram"})
    with pytest.raises(InvalidArgumentError, match="needs V1 scheduling"):
        make_llm(path, scheduling="v0", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("given, expected", [
    ({}, (5, 5)),                                            # vLLM's defaults
    ({"prompt_lookup_max": 3}, (3, 3)),                      # one bound: the other equals it
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
])
def test_ngram_bounds_default_as_vllm(given, expected):
    speculation = resolve_speculative_config({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (speculation.proposer.min_n, speculation.proposer.max_n) == expected
    assert speculation.num_speculative_tokens == 3 and speculation.method == "ngram"


def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    propose = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3).propose
    # last 3 tokens (1, 2, 3) occur at 0: what followed them is proposed, up to max_tokens
    assert propose([1, 2, 3, 7, 8, 9, 5, 1, 2, 3], 4) == [7, 8, 9, 5]
    assert propose([1, 2, 3, 7, 8, 9, 5, 1, 2, 3], 2) == [7, 8]
    # the 3-gram (4, 2, 3) never occurred before; the 2-gram (2, 3) did, twice: the most recent one wins
    assert propose([2, 3, 6, 2, 3, 9, 4, 2, 3], 2) == [9, 4]
    # only the 1-gram matches; a match may run into the suffix itself (proposals stop at the context's end)
    assert propose([5, 6, 5], 3) == [6, 5]
    assert propose([1, 2, 3], 3) == []                       # no earlier occurrence of anything
    assert propose([4], 3) == []
    assert NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2).propose([9, 3, 9, 4, 3], 2) == []


def test_the_registry_plugs_in_another_proposer(llama, monkeypatch):
    class Repeat(Proposer):
        options = ("token",)

        def __init__(self, token=1):
            self.token = token

        def propose(self, tokens, max_tokens):
            return [self.token] * max_tokens

    monkeypatch.setitem(PROPOSERS, "repeat", Repeat)
    speculation = resolve_speculative_config({"method": "repeat", "num_speculative_tokens": 3, "token": 7})
    assert isinstance(speculation.proposer, Repeat) and speculation.proposer.token == 7
    path, hf = llama
    llm = make_llm(path, speculative_config={"method": "repeat", "num_speculative_tokens": 2, "token": 7})
    out, = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, [3, 1, 4, 1, 5], 5)
    assert out.metrics.num_draft_tokens > 0


def test_greedy_acceptance_keeps_the_run_matching_the_argmax_and_the_targets_token():
    logits = torch.full((4, 10), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 1] = logits[3, 9] = 5.0  # argmax per row: 3, 4, 1, 9
    greedy = SamplingParams(temperature=0.0)
    assert accept(logits, (3, 4, 1), greedy, torch.Generator()) == [3, 4, 1, 9]  # all accepted + bonus
    assert accept(logits, (3, 4, 2), greedy, torch.Generator()) == [3, 4, 1]     # the correction of draft 3
    assert accept(logits, (0, 4, 1), greedy, torch.Generator()) == [3]
    assert accept(logits[:1], (), greedy, torch.Generator()) == [3]
    with pytest.raises(FloatingPointError):
        accept(torch.full((2, 10), float("nan")), (1,), greedy, torch.Generator())


@pytest.mark.parametrize("params, which", [
    (SamplingParams(temperature=0.8, top_k=6), ("likeliest", "likely", "unlikely")),
    (SamplingParams(temperature=1.3, top_p=0.8), ("likely",)),
])
def test_sampled_acceptance_keeps_the_targets_distribution(params, which):
    """Point-mass drafts: the first kept token is distributed as p_0 and, when the draft was kept, the next as
    p_1, whatever the drafts (the likeliest token, a likely one, an unlikely one)."""
    torch.manual_seed(0)
    vocab, draws = 8, 1500
    logits = torch.randn(3, vocab) * 1.5
    p = probabilities(logits, [params] * 3)
    choices = {"likeliest": (int(p[0].argmax()), int(p[1].argmax())), "likely": (int(p[0].argsort()[-2]), 0),
               "unlikely": (int(p[0].argsort()[-4]), int(p[1].argmin()))}
    for drafts in map(choices.get, which):
        generator = torch.Generator().manual_seed(sum(drafts))
        runs = [accept(logits, drafts, params, generator) for _ in range(draws)]
        first = torch.bincount(torch.tensor([run[0] for run in runs]), minlength=vocab)
        _check_fits(first, p[0])
        second = [run[1] for run in runs if len(run) > 1]  # the first draft was kept
        assert len(second) == int(first[drafts[0]])
        if len(second) > 200:
            _check_fits(torch.bincount(torch.tensor(second), minlength=vocab), p[1])


def _check_fits(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit over the tokens the distribution allows (none drawn outside them)."""
    allowed = probs > 0
    assert int(counts[~allowed].sum()) == 0
    observed = counts[allowed].double().numpy()
    expected = probs[allowed].double().numpy()
    expected *= observed.sum() / expected.sum()
    assert chisquare(observed, expected).pvalue > 1e-3


def test_sampled_acceptance_keeps_the_tokens_and_the_stream_the_sampler_would_draw():
    """A seeded sequence's verification keeps the tokens the sampler draws from the same generator, one per
    token kept, and leaves the generator where that many draws would: whatever the drafts, so the next
    token's noise does not depend on how many drafts this step had. Before, each draft took a uniform draw and
    the target's token a multinomial draw from the residual or from p."""
    vocab, params = 20, SamplingParams(temperature=0.7)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    sampler, plain = Sampler(0, "cpu"), sample_generator(9, 0, "cpu")
    expected, states = [], [plain.get_state()]
    for row in logits:
        expected += sampler(row[None], [params], [plain])
        states.append(plain.get_state())
    wrong = [(t + 1) % vocab for t in expected]
    for drafts, kept in [(tuple(expected[:3]), 4), (tuple(expected[:2]) + (wrong[2],), 3),
                         ((expected[0], wrong[1]), 2), ((wrong[0],), 1), ((), 1)]:
        generator = sample_generator(9, 0, "cpu")
        assert accept(logits[:len(drafts) + 1], drafts, params, generator) == expected[:kept]
        assert generator.get_state().equal(states[kept])


def suffix(**options) -> SuffixProposer:
    return resolve_speculative_config({"method": "suffix", "num_speculative_tokens": 8, **options}).proposer


def test_suffix_proposes_what_followed_the_best_match_in_the_context():
    # "1 2 3" matched: 1 token per token of match (max_spec_factor 1), so 3 tokens
    assert suffix().propose([1, 2, 3, 4, 9, 1, 2, 3], 8) == [4, 9, 1]
    assert suffix().propose([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]
    assert suffix(suffix_decoding_max_spec_factor=0.5).propose([1, 2, 3, 4, 9, 1, 2, 3], 8) == [4]
    assert suffix(suffix_decoding_max_tree_depth=3).propose([1, 2, 3, 4, 9, 1, 2, 3], 8) == [4]  # match + draft <= 3
    assert suffix().propose([1, 2, 3], 8) == []


def test_suffix_proposes_the_most_frequent_continuation_while_it_is_likely_enough():
    context = [5, 1, 5, 1, 5, 2, 5]  # 5 was followed by 1 twice and by 2 once
    assert suffix().propose(context, 8) == [1]
    assert suffix(suffix_decoding_min_token_prob=0.7).propose(context, 8) == []  # 2/3 < 0.7


def test_suffix_learns_from_earlier_outputs_first_in_first_out():
    proposer = suffix(suffix_decoding_max_cached_requests=1)
    proposer.finished([0, 0, 10, 11, 12, 13], 2)
    assert proposer.propose([7, 8, 10, 11], 8) == [12, 13]  # nothing in the context; the earlier output
    proposer.finished([0, 20, 21], 1)  # evicts the first output
    assert [o.tolist() for o in proposer.cached_outputs] == [[20, 21]]
    assert proposer.propose([7, 8, 10, 11], 8) == []
    off = suffix(suffix_decoding_max_cached_requests=0)
    off.finished([0, 0, 10, 11, 12, 13], 2)
    assert len(off.cached_outputs) == 0 and off.propose([7, 8, 10, 11], 8) == []


@pytest.mark.parametrize("option, value, match", [
    ("suffix_decoding_max_tree_depth", 1, r"max_tree_depth.*>= 2"),
    ("suffix_decoding_max_cached_requests", -1, r"max_cached_requests.*>= 0"),
    ("suffix_decoding_max_spec_factor", 0, r"max_spec_factor.*> 0"),
    ("suffix_decoding_min_token_prob", 1.5, r"min_token_prob.*<= 1"),
    ("prompt_lookup_min", 2, r"unknown keys \['prompt_lookup_min'\]"),
])
def test_a_bad_suffix_option_is_refused(option, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        suffix(**{option: value})
