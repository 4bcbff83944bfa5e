"""How many drafts a sequence gets this step: speculation that backs off where it does not pay.

A draft costs a query row in the verification pass (and a KV slot) whether or not it is kept, so drafts that
are mostly rejected make a step slower and buy nothing: plain chat with prompt lookup ran at 0.77x of no
speculation on this project's CPU. ``DraftControl`` keeps, per sequence, an exponential moving average ``a`` of
the **conditional acceptance rate**: the chance that a draft is accepted given that the drafts before it were.
Under the usual geometric model (each draft accepted with probability a once the earlier ones were), the j-th
draft of a step is kept with probability a**j, so the rule is:

    **draft the j-th token only while a**j >= floor**  (``draft_acceptance_floor``)

i.e. a draft must have at least a ``floor`` chance of being kept to be worth its row. ``floor`` is the price of
a row in tokens: a row that costs a fraction c of a plain step pays on average when a**j > c. When a < floor
the sequence gets no drafts at all (speculation off for it), and it comes back on by itself: the proposer is
still asked (it is model-free and cheap) and its first guess is scored against the token plain decoding then
produces, which costs no row. So a chat that starts quoting its context switches drafting back on.

Observations: a step's guess g (the drafts verified, or the unverified guess while off) made at position n is
scored at the sequence's next step against its tokens from n on: each leading draft that matches is one
success, and the first one that does not, if the target got that far, one failure; drafts after it say
nothing about a (they are conditional on a rejection). Each observation moves ``a`` by
``draft_acceptance_ema_weight`` towards 1 or 0.

Where a new sequence starts: the control also keeps an **engine-wide estimate** A, an EMA with the same weight
over every observation of every sequence it (so this proposer) has scored, starting at 1. A new sequence
starts at a = 1 (speculate fully, as without the rule) while A >= floor, and at a = A (drafts off) once
A < floor; it reads A until its own first observation, then goes on alone. So on plain chat only the first
sequences pay for rejected drafts: later ones start with drafts off (and the unverified-guess scoring above
still turns them on for one that quotes its context), while on a copy-heavy workload A stays above the floor
and every sequence starts at full k, as before. (Starting at A itself also when A >= floor cut copy-heavy
drafts too: A swings with the last few observations, and a quoting answer's first drafts are its best.) A
workload that changes moves A within a few observations. The rule only chooses how many drafts to verify,
from tokens already generated, so greedy output is unchanged and sampled output keeps its distribution
(``kvlab.engine.speculative``).

In vLLM: the V1 ``suffix`` method varies the draft length per request and step (``max_spec_factor`` times the
match length, and only tokens whose frequency-estimated probability is at least ``min_token_prob``), and V0 had
``speculative_disable_by_batch_size`` (speculation off for new requests when the queue is long); neither turns
speculation off per request from its measured acceptance, so the keys here are kvlab's own. HF transformers'
``num_assistant_tokens_schedule="heuristic"`` adapts k the same way per generation (+2 when all drafts were
accepted, -1 otherwise), without a way back from zero.
"""

import math

from kvlab.blocks.sequence import Sequence
from kvlab.validation import check_number

#: The engine-wide acceptance estimate before any observation: speculate fully, as without the rule.
PRIOR_ACCEPTANCE = 1.0
#: ``draft_acceptance_ema_weight`` when not given: an observation moves the estimate a quarter of the way.
DEFAULT_EMA_WEIGHT = 0.25


class DraftControl:
    """Per-sequence acceptance estimates, the engine-wide one new sequences start from, and the draft count they
    allow (see the module docstring)."""

    def __init__(self, floor, ema_weight=None):
        self.floor = check_number("speculative_config['draft_acceptance_floor']", floor, 0, 1,
                                  min_open=True, max_open=True)
        self.weight = DEFAULT_EMA_WEIGHT if ema_weight is None else check_number(
            "speculative_config['draft_acceptance_ema_weight']", ema_weight, 0, 1, min_open=True)
        self.acceptance: dict[int, float] = {}                     # seq_id -> a
        self.engine_acceptance = PRIOR_ACCEPTANCE                  # A: every observation's EMA
        self._guesses: dict[int, tuple[int, list[int]]] = {}       # seq_id -> (position, guess) to score

    def allowed(self, seq: Sequence, limit: int) -> int:
        """Drafts ``seq`` may have this step, at most ``limit``: the largest j with a**j >= floor (0 when
        a < floor)."""
        a = self.acceptance.get(seq.seq_id, self._start())
        if a >= 1.0:
            return limit  # every draft would be kept: the rule sets no limit of its own
        if a < self.floor:
            return 0
        return min(limit, int(math.log(self.floor) / math.log(a) + 1e-9))

    def observe(self, seq: Sequence) -> None:
        """Score the guess made at ``seq``'s previous step against the tokens it has now."""
        position, guess = self._guesses.pop(seq.seq_id, (None, None))
        if guess is None:
            return
        actual = seq.token_slice(position, min(seq.num_tokens, position + len(guess)))
        a = self.acceptance.get(seq.seq_id, self._start())
        for draft, token in zip(guess, actual):
            a += self.weight * ((draft == token) - a)
            self.engine_acceptance += self.weight * ((draft == token) - self.engine_acceptance)
            if draft != token:
                break
        self.acceptance[seq.seq_id] = a

    def _start(self) -> float:
        """A sequence's a before its own first observation: full speculation unless the engine learned that
        drafts are mostly rejected (A < floor)."""
        return PRIOR_ACCEPTANCE if self.engine_acceptance >= self.floor else self.engine_acceptance

    def remember(self, seq: Sequence, guess: list[int]) -> None:
        """The guess for the tokens after ``seq``'s current last one, scored at its next step."""
        if guess:
            self._guesses[seq.seq_id] = (seq.num_tokens, list(guess))

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished: drop its state (its observations stay in the engine-wide estimate)."""
        self.acceptance.pop(seq.seq_id, None)
        self._guesses.pop(seq.seq_id, None)
