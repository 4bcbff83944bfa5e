"""The acceptance rule (``draft_acceptance_floor``, ``kvlab.engine.draft_control``): fewer drafts, then none, for a
sequence whose drafts are rejected, and drafts again once they would be accepted; output unchanged."""

import dataclasses

import pytest

from engine_helpers import assert_pool_clean, hf_greedy, make_llm
from kvlab.blocks.sequence import Sequence
from kvlab.engine import SamplingParams
from kvlab.engine.proposers import Proposer
from kvlab.engine.speculative import resolve_speculative_config
from kvlab.errors import InvalidArgumentError
from test_speculative import copy_heavy_prompts, generate, ngram, tokens


class Sevens(Proposer):
    """Always guesses token 7, as far as asked."""

    def propose(self, tokens, max_tokens):
        return [7] * max_tokens


def run_steps(speculation, seq, target: int, steps: int) -> list[int]:
    """Steps as the engine runs them, the target always producing ``target``: the drafts it matches are kept,
    then its own token. Returns the number of drafts each step got."""
    counts = []
    for _ in range(steps):
        drafts = speculation.drafts(seq, limit=8)
        counts.append(len(drafts))
        kept = 0
        while kept < len(drafts) and drafts[kept] == target:
            kept += 1
        for token in drafts[:kept] + (target,):
            seq.append_token(token)
    return counts


def sevens(floor=0.3, **extra):
    config = {"method": "ngram", "num_speculative_tokens": 4, "draft_acceptance_floor": floor, **extra}
    return dataclasses.replace(resolve_speculative_config(config), proposer=Sevens())


def test_the_rule_turns_drafts_off_when_they_are_rejected_and_back_on_when_they_match():
    speculation, seq = sevens(), Sequence([1, 2, 3], 16)
    rejected = run_steps(speculation, seq, target=5, steps=10)
    # a = 1, .75, .56, .42, .32, .24: the j-th draft only while a**j >= 0.3, then none
    assert rejected == [4, 4, 2, 1, 1, 0, 0, 0, 0, 0]
    matching = run_steps(speculation, seq, target=7, steps=8)
    assert matching[:2] == [0, 0]  # off: each step scores the unverified guess against the token made
    assert matching[-1] == 4 and matching == sorted(matching)
    speculation.finished(seq)
    assert speculation.control.acceptance == {} and speculation.control._guesses == {}


def test_a_new_sequence_starts_from_what_earlier_sequences_taught_the_engine():
    speculation = sevens()
    first = Sequence([1, 2, 3], 16)
    assert run_steps(speculation, first, target=5, steps=10)[0] == 4  # the engine knows nothing yet: full k
    speculation.finished(first)
    # a no-match workload: the next wave starts with drafts off instead of paying for rejected ones again
    assert run_steps(speculation, Sequence([1, 2, 3], 16), target=5, steps=4) == [0, 0, 0, 0]
    # a sequence that quotes its context turns them back on (its unverified guesses are still scored)
    quoting = run_steps(speculation, Sequence([1, 2, 3], 16), target=7, steps=12)
    assert quoting[0] == 0 and quoting[-1] == 4 and quoting == sorted(quoting)


def test_a_workload_whose_drafts_are_kept_keeps_full_k_for_new_sequences():
    speculation = sevens()
    run_steps(speculation, Sequence([1, 2, 3], 16), target=7, steps=4)
    assert speculation.control.engine_acceptance == 1.0
    assert run_steps(speculation, Sequence([1, 2, 3], 16), target=7, steps=3) == [4, 4, 4]


def test_without_the_rule_every_proposal_is_verified():
    speculation = dataclasses.replace(resolve_speculative_config(ngram(4)), proposer=Sevens())
    assert run_steps(speculation, Sequence([1, 2, 3], 16), target=5, steps=6) == [4] * 6


def test_the_ema_weight_sets_how_fast_it_backs_off():
    fast = run_steps(sevens(draft_acceptance_ema_weight=0.9), Sequence([1], 16), target=5, steps=3)
    assert fast == [4, 0, 0]


@pytest.mark.parametrize("extra, match", [
    ({"draft_acceptance_floor": 0}, r"draft_acceptance_floor.*> 0 and < 1, got 0"),
    ({"draft_acceptance_floor": 1}, r"draft_acceptance_floor.*< 1"),
    ({"draft_acceptance_floor": "high"}, "draft_acceptance_floor"),
    ({"draft_acceptance_floor": 0.3, "draft_acceptance_ema_weight": 0}, r"ema_weight.*> 0 and <= 1"),
    ({"draft_acceptance_ema_weight": 0.5}, "needs 'draft_acceptance_floor'"),
])
def test_a_bad_rule_is_refused(extra, match):
    with pytest.raises(InvalidArgumentError, match=match):
        resolve_speculative_config({**ngram(4), **extra})


@pytest.mark.parametrize("floor", [0.2, 0.6])
def test_greedy_output_is_unchanged_with_the_rule(llama, floor):
    path, hf = llama
    prompts = copy_heavy_prompts(1)
    llm = make_llm(path, speculative_config={**ngram(8), "draft_acceptance_floor": floor})
    outs = generate(llm, prompts, 16)
    assert tokens(outs) == [[hf_greedy(hf, p, 16)] for p in prompts]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert llm.speculation.control.acceptance == {}  # every finished sequence forgotten
    assert_pool_clean(llm)


def test_sampled_runs_with_the_rule_finish(llama):
    path, _ = llama
    llm = make_llm(path, speculative_config={**ngram(4), "draft_acceptance_floor": 0.5})
    outs = llm.generate(copy_heavy_prompts(2), SamplingParams(temperature=0.8, max_tokens=12, seed=0, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 3
    assert_pool_clean(llm)
