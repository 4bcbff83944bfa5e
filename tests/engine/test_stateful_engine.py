"""Model check: random programs against the engine (``LLM``) with speculative decoding by a learner's proposer
that, at random calls, raises or returns junk in ``propose`` and ``finished``, or scribbles on the tokens it
was given. Requests join, step and get aborted in any order, with prompts chunked and sequences preempted (a
small pool and token budget). Every request's greedy output must equal a solo run without speculation (an
aborted one's a prefix of it), every request must finish, and the pool must be clean at the end: the
proposer's failures cost drafts, never output or blocks (``kvlab.engine.speculative``).

The model is ``kvlab.engine.random_model``'s "tiny" (random weights, a step in a few ms on CPU)."""

import functools
import os
import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_helpers import assert_pool_clean
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.proposers import PROPOSERS, NgramProposer, Proposer
from kvlab.engine.random_model import save_random_model

pytestmark = pytest.mark.filterwarnings("ignore::kvlab.errors.ProposerWarning")  # they are the point here

ENGINE = dict(block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
#: Steps that finish any program's requests: at most 6 in flight, prompts of 14 tokens and 8 new ones each, a
#: step of 16 tokens; a preemption only repeats a prompt.
DRAIN_STEPS = 500


@functools.cache
def model_dir() -> str:
    return str(save_random_model(tempfile.mkdtemp(prefix="kvlab_stateful_engine_"), "tiny"))


@functools.cache
def solo(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy output of ``prompt`` alone, without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out, = _plain_llm().generate([list(prompt)], params, use_tqdm=False)
    return out.outputs[0].token_ids


@functools.cache
def _plain_llm() -> LLM:
    return LLM(model_dir(), block_size=4, num_blocks=64)


class Unreadable(list):
    def __iter__(self):
        raise RuntimeError("unreadable")


def _raise(*args):
    raise RuntimeError("proposer bug")


def _scribble(tokens, max_tokens, drafts):
    tokens[:] = [0] * len(tokens)  # the engine's tokens must not change
    return drafts


# Each: (tokens, max_tokens, prompt lookup's drafts) -> what propose returns. The good ones come first.
PROPOSE = [
    lambda t, k, d: d, lambda t, k, d: tuple(d), lambda t, k, d: np.array(d, dtype=np.int64), lambda t, k, d: [],
    _scribble, _raise, lambda t, k, d: None, lambda t, k, d: [10**6] * len(d), lambda t, k, d: [-1],
    lambda t, k, d: [float(x) for x in d], lambda t, k, d: [True], lambda t, k, d: d + [0] * (k + 1 - len(d)),
    lambda t, k, d: (x for x in d), lambda t, k, d: Unreadable(d), lambda t, k, d: np.array(d, dtype=float),
    lambda t, k, d: "drafts",
]
FINISHED = [lambda tokens: None, lambda tokens: tokens.clear(), _raise, lambda tokens: "junk"]


class Chaos(Proposer):
    """Prompt lookup whose every call does what ``rng`` picks from ``PROPOSE`` (or ``FINISHED``)."""
    options = ("rng",)

    def __init__(self, rng):
        self.rng, self.lookup = rng, NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)

    def propose(self, tokens, max_tokens):
        drafts = self.lookup.propose(tokens, max_tokens)
        return self.rng.choice(PROPOSE)(tokens, max_tokens, drafts)

    def finished(self, tokens, num_prompt_tokens):
        return self.rng.choice(FINISHED)(tokens)


prompts = st.lists(st.integers(1, 6), min_size=1, max_size=14)  # few distinct tokens: prompt lookup matches


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.llm = None
        self.requests = {}  # request_id -> (prompt, max_tokens), unfinished

    @initialize(rng=st.randoms(use_true_random=False), k=st.integers(1, 4))
    def start(self, rng, k):
        PROPOSERS["chaos"] = Chaos
        self.llm = LLM(model_dir(), **ENGINE, speculative_config={"method": "chaos", "num_speculative_tokens": k,
                                                                  "rng": rng})

    def teardown(self):
        PROPOSERS.pop("chaos", None)
        if self.llm is None:
            return
        for _ in range(DRAIN_STEPS):  # bounded: an engine that stops making progress fails, never hangs
            if not self.llm.has_unfinished_requests():
                break
            self.check(self.llm.step())
        assert not self.llm.has_unfinished_requests() and not self.requests, self.requests
        assert_pool_clean(self.llm)

    def check(self, outputs) -> None:
        for out in outputs:
            prompt, max_tokens = self.requests.pop(out.request_id)
            got, expected = out.outputs[0].token_ids, solo(prompt, max_tokens)
            if out.outputs[0].finish_reason == "abort":
                assert got == expected[:len(got)], out.outputs[0]  # aborted by us, with a prefix of its output
            else:
                assert (out.outputs[0].finish_reason, got) == ("length", expected)
            assert out.prompt_token_ids == list(prompt)

    @precondition(lambda self: len(self.requests) < 6)
    @rule(prompt=prompts, max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.requests[self.llm.add_request(prompt, params)] = (tuple(prompt), max_tokens)

    @rule()
    def step(self):
        self.check(self.llm.step())

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        self.llm.abort_request(data.draw(st.sampled_from(sorted(self.requests))))

    @invariant()
    def consistent(self):
        if self.llm is not None:
            self.llm.block_manager.check_invariants()


# max_examples comes from the Hypothesis profile; a soak can also lengthen every program.
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(stateful_step_count=int(os.environ.get("KVLAB_STATEFUL_STEPS", "40")),
                                      deadline=None)
