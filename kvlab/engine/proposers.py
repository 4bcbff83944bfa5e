"""Draft proposers by name, for ``LLM(speculative_config={"method": name, ...})``: model-free guesses of a
sequence's next tokens, which the target model then verifies in one forward pass (``kvlab.engine.speculative``).

``PROPOSERS`` maps a ``method`` to a ``Proposer`` subclass; add yours there to pick it by name. The engine
builds it once, as ``cls(**options)`` with the config's keys other than ``method`` and
``num_speculative_tokens`` (``cls.options`` names the keys it takes), and then only calls ``propose``. A
proposer must be cheap (it runs for every decoding sequence at every step, between forward passes) and may
return fewer tokens than asked, or none: a sequence with no drafts decodes one token as usual.

``ngram`` is prompt lookup (vLLM's ``method="ngram"``, the same keys and defaults): the context's last n tokens,
n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, are looked up earlier in the context (prompt and
output so far); at the first n with a match, the tokens that followed its most recent earlier occurrence are
proposed. It pays where the answer quotes its context (editing code, summarising with citations) and costs
nothing where it finds no match.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int

#: vLLM's default for prompt_lookup_min and prompt_lookup_max when neither is given ("arbitrarily chosen").
DEFAULT_PROMPT_LOOKUP = 5


class Proposer:
    """Base class: ``propose(tokens, max_tokens)`` returns at most ``max_tokens`` draft token ids that may
    follow ``tokens`` (a sequence's whole context, prompt and output); ``options``: the config keys it takes.
    ``finished`` is told every sequence that finishes, for proposers that learn from earlier outputs."""
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


#: Proposers by ``speculative_config["method"]``; a learner may add their own.
PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer}
