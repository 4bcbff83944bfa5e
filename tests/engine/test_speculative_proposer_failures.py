"""A learner's proposer that raises or returns junk in any hook costs only what that call was for: the sequence's
drafts for the step (or what ``finished`` would have learnt), never the engine. Every request's greedy output
equals decoding without speculation, a ``ProposerWarning`` names the proposer and the failure once, the failures
are counted, later steps run and the pool ends clean."""

import numpy as np
import pytest

from engine_helpers import VOCAB, assert_pool_clean, make_llm
from kvlab.engine import SamplingParams
from kvlab.engine.proposers import PROPOSERS, Proposer
from kvlab.engine.speculative import resolve_speculative_config
from kvlab.errors import InvalidArgumentError, ProposerWarning

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BAD = 1  # the proposer misbehaves only for sequences whose prompt starts with this token
PROMPTS = [[BAD, 5, 9, 5, 9, 5], [2, 7, 3, 7, 3, 7, 3], [4, 4, 6, 4, 4, 6, 4]]


class Unreadable(list):
    def __iter__(self):
        raise RuntimeError("unreadable")


def _raise(tokens, max_tokens):
    raise RuntimeError("boom")


# (what the proposer does for BAD's sequences, what the warning says about it)
JUNK = {
    "raises": (_raise, r"raised RuntimeError\('boom'\)"),
    "none": (lambda t, k: None, "returned None: drafts must be a list .* not a NoneType"),
    "out_of_vocabulary": (lambda t, k: [10**6], rf"draft 1000000 is not a token id: .*\[0, {VOCAB}\)"),
    "negative": (lambda t, k: [-1], "draft -1 is not a token id"),
    "float": (lambda t, k: [float(t[-1])], r"draft \d+\.0 is not a token id"),
    "bool": (lambda t, k: [True], "draft True is not a token id"),
    "string": (lambda t, k: "ab", "not a str"),
    "float_array": (lambda t, k: np.array(t[-k:], dtype=float), "1-D of an integer dtype, got 1-D float64"),
    "2d_array": (lambda t, k: np.array([t[-k:]]), "1-D of an integer dtype, got 2-D"),
    "too_many": (lambda t, k: t[-1:] * (k + 1), r"\d+ drafts, but at most \d+ were asked for"),
    "generator": (lambda t, k: (x for x in t[-k:]), "not a generator"),
    "unreadable": (lambda t, k: Unreadable(t[-k:]), "unreadable"),
}


class Flaky(Proposer):
    """Proposes the context's last tokens again (valid drafts, some accepted) except for BAD's sequences, where
    ``propose`` does what ``junk`` says and ``finished`` raises if ``finished_raises``."""
    options = ("junk", "finished_raises")

    def __init__(self, junk=None, finished_raises=False):
        self.junk, self.finished_raises = junk, finished_raises

    def propose(self, tokens, max_tokens):
        if tokens[0] == BAD and self.junk is not None:
            return self.junk(tokens, max_tokens)
        return tokens[-max_tokens:]

    def finished(self, tokens, num_prompt_tokens):
        if tokens[0] == BAD and self.finished_raises:
            raise ValueError("cannot learn")


@pytest.fixture
def flaky(monkeypatch):
    monkeypatch.setitem(PROPOSERS, "flaky", Flaky)


@pytest.fixture(scope="module")
def plain(llama):
    return [out.outputs[0].token_ids for out in make_llm(llama[0]).generate(PROMPTS, GREEDY, use_tqdm=False)]


def generate_twice(llm):
    """Two generate calls: the second shows the engine was left usable."""
    return [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for _ in range(2)]


@pytest.mark.parametrize("junk", JUNK)
def test_a_proposer_that_raises_or_returns_junk_costs_only_that_sequences_drafts(llama, plain, flaky, junk):
    propose, says = JUNK[junk]
    llm = make_llm(llama[0], speculative_config={"method": "flaky", "num_speculative_tokens": 3, "junk": propose})
    with pytest.warns(ProposerWarning, match=r"method 'flaky' \(Flaky\): propose .*" + says) as warned:
        runs = generate_twice(llm)
    assert len(warned) == 1  # once, however many steps it failed in
    for outs in runs:
        assert [out.outputs[0].token_ids for out in outs] == plain
        assert [out.outputs[0].finish_reason for out in outs] == ["length"] * len(PROMPTS)
        assert outs[0].metrics.num_draft_tokens == 0  # its drafts were dropped...
        assert all(out.metrics.num_draft_tokens > 0 for out in outs[1:])  # ...the others' were not
    # asked at every step where a draft fits: after the first token, while 2 or more are still to come
    assert llm.speculation.failures["propose"] == 2 * (GREEDY.max_tokens - 2)
    assert_pool_clean(llm)


def test_a_proposer_whose_finished_raises_leaves_the_engine_running(llama, plain, flaky):
    llm = make_llm(llama[0], speculative_config={"method": "flaky", "num_speculative_tokens": 3,
                                                 "finished_raises": True})
    with pytest.warns(ProposerWarning, match=r"finished raised ValueError\('cannot learn'\)") as warned:
        runs = generate_twice(llm)
    assert len(warned) == 1
    for outs in runs:
        assert [out.outputs[0].token_ids for out in outs] == plain
        assert all(out.metrics.num_draft_tokens > 0 for out in outs)  # proposing is unaffected
    assert llm.speculation.failures["finished"] == 2
    assert_pool_clean(llm)


class Unbuildable(Proposer):
    options = ("size",)

    def __init__(self, size=1):
        raise OSError(f"no table of size {size}")


class NotAProposer:
    options = ()


class OptionsAString(Proposer):
    options = ("size")  # a string, not a tuple: a comma is missing


@pytest.mark.parametrize("cls, match", [
    (Unbuildable, r"method 'custom': building Unbuildable\(\*\*\{'size': 3\}\) raised OSError\('no table of size 3'\)"),
    (NotAProposer, r"PROPOSERS\['custom'\] must be a subclass of kvlab.engine.proposers.Proposer"),
    (OptionsAString, r"OptionsAString.options must be a tuple of the config keys it takes \(strings\), got 'size'"),
])
def test_a_proposer_that_cannot_be_built_is_refused_saying_why(monkeypatch, cls, match):
    monkeypatch.setitem(PROPOSERS, "custom", cls)
    with pytest.raises(InvalidArgumentError, match=match):
        resolve_speculative_config({"method": "custom", "num_speculative_tokens": 2, "size": 3})
