"""Puzzle: the n-gram proposer (prompt lookup). Read first: notebook 13 (speculative decoding).

**Spec.** Speculative decoding guesses a sequence's next tokens cheaply and lets the model verify them all in
one forward pass. Prompt lookup guesses from the context itself (prompt and output so far, ``tokens``): for n
from ``max_n`` down to ``min_n``, look for an earlier occurrence of the context's last n tokens (one that ends
before the last token, so something follows it); at the first n that has one, propose the tokens that followed
its most recent earlier occurrence, at most ``max_tokens`` of them (fewer if the context ends first). No n
matches: propose nothing, ``[]``::

    propose([1, 2, 3, 4, 1, 2], max_tokens=3, min_n=1, max_n=2) == [3, 4, 1]

(vLLM's proposer takes the earliest occurrence of the longest match instead; the check grades kvlab's choice.)

``check`` compares your proposals with ``kvlab.engine.proposers.NgramProposer`` (``method="ngram"``)
on random contexts over a small vocabulary, so that matches are common.
"""

import random

from kvlab.engine.proposers import NgramProposer
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded

NAME = "ngram_proposer"


def propose(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """At most ``max_tokens`` draft tokens to follow ``tokens`` (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 300) -> Report:
    """Run ``fn`` on ``num_cases`` random contexts (from ``seed``) against kvlab's NgramProposer."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    vocab = rng.randint(2, 5)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
    min_n = rng.randint(1, 3)
    max_n, max_tokens = rng.randint(min_n, 4), rng.randint(1, 5)
    expected = NgramProposer(prompt_lookup_min=min_n, prompt_lookup_max=max_n).propose(list(tokens), max_tokens)
    return Case(f"tokens={tokens}, max_tokens={max_tokens}, min_n={min_n}, max_n={max_n}",
                lambda fn: fn(list(tokens), max_tokens, min_n, max_n),
                lambda got: _judge(tokens, max_tokens, min_n, max_n, expected, got))


def _judge(tokens, max_tokens, min_n, max_n, expected, got):
    if same(got, expected):
        return None
    why = not_an_int(got) if isinstance(got, list) else None
    if not isinstance(got, list) or why:
        return f"expected a list of token ids {expected}, got {got!r}" + (f": {why}" if why else "")
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]  # each ends before the last token
        if starts:
            break
    else:
        return (f"expected {expected}, got {got}: no n in {min_n} .. {max_n} has an earlier occurrence of the last n "
                "tokens that something follows, so propose nothing")
    why = (f"the longest n that matches is {n}: the last {n} tokens {suffix} occur earlier at "
           f"{'positions' if len(starts) > 1 else 'position'} {', '.join(map(str, starts))}")
    if len(starts) > 1 and got == tokens[starts[0] + n:starts[0] + n + max_tokens]:
        return (f"expected {expected}, got {got}: {why}; kvlab proposes what followed the most recent one "
                f"({starts[-1]}), not the first (vLLM takes the first: see notebook 16)")
    if any(got == _most_recent(tokens, shorter, max_tokens) for shorter in range(min_n, n)):
        return f"expected {expected}, got {got}: {why}; try n from max_n down: the longest n that matches wins"
    if not got:
        return (f"expected {expected}, got []: {why} (the last n tokens themselves are no earlier occurrence: one "
                "must end before the last token)")
    return f"expected {expected}, got {got}: {why}; propose the at most {max_tokens} tokens after the most recent one"


def _most_recent(tokens, n, max_tokens):
    """What follows the most recent earlier occurrence of the last ``n`` tokens (None: there is none)."""
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start:start + n] == tokens[-n:]:
            return tokens[start + n:start + n + max_tokens]
    return None
