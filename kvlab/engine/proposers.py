"""Draft proposers by name, for ``LLM(speculative_config={"method": name, ...})``: model-free guesses of a
sequence's next tokens, which the target model then verifies in one forward pass (``kvlab.engine.speculative``).

``PROPOSERS`` maps a ``method`` to a ``Proposer`` subclass; add yours there to pick it by name. The engine
builds it once, as ``cls(**options)`` with the config's keys other than ``method`` and
``num_speculative_tokens`` (``cls.options`` names the keys it takes), and then only calls ``propose`` and
``finished``. A proposer must be cheap (it runs for every decoding sequence at every step, between forward
passes) and may return fewer tokens than asked, or none: a sequence with no drafts decodes one token as usual.
One that raises, or returns anything but token ids of the model, costs only that sequence's drafts for the
step (or, in ``finished``, what it would have learnt), with a ``kvlab.errors.ProposerWarning``
(``kvlab.engine.speculative.Speculation``; docs/speculative_decoding.md).

``ngram`` is prompt lookup (vLLM's ``method="ngram"``, the same keys and defaults): the context's last n tokens,
n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, are looked up earlier in the context (prompt and
output so far); at the first n with a match, the tokens that followed its most recent earlier occurrence are
proposed. It pays where the answer quotes its context (editing code, summarising with citations) and costs
nothing where it finds no match.

``suffix`` is suffix decoding (vLLM's ``method="suffix"``, which calls Arctic Inference's ``SuffixDecodingCache``;
SuffixDecoding, arXiv 2411.04975), with vLLM's keys and defaults. Chosen as the second proposer because it
differs from prompt lookup exactly where chat hurts it: (1) it also matches against the outputs of earlier
requests (``suffix_decoding_max_cached_requests`` of them, first in first out), so phrasing a model repeats
across answers is proposed, not only text quoted from the prompt; (2) it counts how often each continuation
followed the match and proposes the most frequent one token by token, stopping once the estimated probability
of the path (the product of each step's frequency) falls below ``suffix_decoding_min_token_prob``; (3) the
draft is at most ``suffix_decoding_max_spec_factor`` times the match length, so a 1-token match proposes 1
token, not k. Every match length 1, 2, ... is tried (up to ``suffix_decoding_max_tree_depth`` - 1, and match
plus draft within that depth, as Arctic's trees) and the draft with the highest score (the sum of its tokens'
path probabilities: its expected accepted length) wins, a longer match on a tie (Arctic's
``SuffixTree::speculate``). Arctic keeps suffix trees (a match costs O(match length)); kvlab scans token arrays
with numpy (O(corpus) per step, fine at teaching sizes), with two corpora whose best draft wins, as Arctic's
prompt tree and global tree: the sequence's own context (prompt and output so far; Arctic puts the running
output in its global tree) and the cached outputs of finished sequences.
"""

from collections import deque

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number

#: vLLM's default for prompt_lookup_min and prompt_lookup_max when neither is given ("arbitrarily chosen").
DEFAULT_PROMPT_LOOKUP = 5


class Proposer:
    """Base class: ``propose(tokens, max_tokens)`` returns at most ``max_tokens`` draft token ids that may
    follow ``tokens`` (a copy of a sequence's whole context, prompt and output): a list or tuple of ints or a
    1-D integer NumPy array, each in ``[0, vocab_size)``; ``options``: the config keys it takes (a tuple of
    strings). ``finished`` is told every sequence that finishes, for proposers that learn from earlier outputs."""
    options: tuple[str, ...] = ()

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        raise NotImplementedError

    def finished(self, tokens: list[int], num_prompt_tokens: int) -> None:
        """A sequence finished with ``tokens`` (its prompt, the first ``num_prompt_tokens``, then its output)."""


class NgramProposer(Proposer):
    """Prompt lookup (see the module docstring). Only one of the two bounds given: the other equals it, as in
    vLLM; neither: both are ``DEFAULT_PROMPT_LOOKUP``."""
    options = ("prompt_lookup_min", "prompt_lookup_max")

    def __init__(self, prompt_lookup_min=None, prompt_lookup_max=None):
        given = {name: check_int(f"speculative_config['{name}']", value, 1)
                 for name, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max))
                 if value is not None}
        self.min_n = given.get("prompt_lookup_min", given.get("prompt_lookup_max", DEFAULT_PROMPT_LOOKUP))
        self.max_n = given.get("prompt_lookup_max", self.min_n)
        if self.min_n > self.max_n:
            raise InvalidArgumentError(f"speculative_config: prompt_lookup_min={self.min_n} must be <= "
                                       f"prompt_lookup_max={self.max_n}")

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        context = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            # windows[i] = context[i : i + n] for every i whose window ends before the last token, so a match
            # always has at least one token after it
            windows = sliding_window_view(context[:-1], n)
            matches = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if len(matches):
                after = int(matches[-1]) + n
                return context[after:after + max_tokens].tolist()
        return []


class SuffixProposer(Proposer):
    """Suffix decoding (see the module docstring); defaults are vLLM's ``SpeculativeConfig``'s."""
    options = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")

    def __init__(self, suffix_decoding_max_tree_depth=24, suffix_decoding_max_cached_requests=10000,
                 suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1):
        name = "speculative_config['suffix_decoding_{}']".format
        self.max_depth = check_int(name("max_tree_depth"), suffix_decoding_max_tree_depth, 2)
        max_cached = check_int(name("max_cached_requests"), suffix_decoding_max_cached_requests, 0)
        self.max_spec_factor = check_number(name("max_spec_factor"), suffix_decoding_max_spec_factor, 0,
                                            min_open=True)
        self.min_token_prob = check_number(name("min_token_prob"), suffix_decoding_min_token_prob, 0, 1)
        self.cached_outputs: deque[np.ndarray] = deque(maxlen=max_cached)  # oldest first
        self._corpus = None  # the cached outputs, each followed by -1, built when first needed after a change

    def finished(self, tokens: list[int], num_prompt_tokens: int) -> None:
        if self.cached_outputs.maxlen and len(tokens) > num_prompt_tokens:
            self.cached_outputs.append(np.asarray(tokens[num_prompt_tokens:], dtype=np.int64))
            self._corpus = None

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        context = np.asarray(tokens, dtype=np.int64)
        pattern = context[-self.max_depth:]  # matches of 1 .. len(pattern) - 1 tokens: one depth left to draft
        if self._corpus is None:
            self._corpus = np.concatenate([np.append(o, -1) for o in self.cached_outputs] or [np.array([-1])])
        own = np.append(context, -1)
        # the context's own last token is where the pattern ends, not a match with something after it
        drafts = [self._best(own, len(context) - 1, pattern, max_tokens),
                  self._best(self._corpus, len(self._corpus), pattern, max_tokens)]
        return max(drafts, key=lambda d: (d[0], d[1]))[2]

    def _best(self, corpus: np.ndarray, searched: int, pattern: np.ndarray, max_tokens: int):
        """(score, match length, draft) of the best draft from ``corpus`` (token ids, -1 ending each
        sequence), matching the last m tokens of ``pattern`` for m = 1, 2, ... at positions before
        ``searched``."""
        best = (0.0, 0, [])
        ends = np.flatnonzero(corpus[:searched] == pattern[-1])  # where a match of length m ends
        for m in range(1, len(pattern)):
            if m > 1:
                ends = ends[ends >= m - 1]
                ends = ends[corpus[ends - (m - 1)] == pattern[-m]]  # -1 never matches: no match spans two
            if not len(ends):
                break
            limit = min(max_tokens, int(m * self.max_spec_factor + 1e-6), self.max_depth - m)
            score, draft = self._path(corpus, ends, limit)
            if score >= best[0]:
                best = (score, m, draft)
        return best

    def _path(self, corpus: np.ndarray, ends: np.ndarray, limit: int) -> tuple[float, list[int]]:
        """Follow the most frequent continuation of the matches ending at ``ends``, up to ``limit`` tokens,
        while the path's probability (each step: the matches that continue with the chosen token over those
        still on the path, the ones whose sequence ends there included) stays >= min_token_prob."""
        prob, score, draft, alive = 1.0, 0.0, [], ends
        while len(draft) < limit:
            following = corpus[alive + 1]
            going_on = following >= 0
            if not going_on.any():
                break
            values, counts = np.unique(following[going_on], return_counts=True)
            choice = int(values[np.argmax(counts)])  # ties: the smaller token id, deterministically
            prob *= counts.max() / len(alive)
            if prob < self.min_token_prob:
                break
            draft.append(choice)
            score += prob
            alive = alive[following == choice] + 1
        return score, draft


#: Proposers by ``speculative_config["method"]``; a learner may add their own.
PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "suffix": SuffixProposer}
