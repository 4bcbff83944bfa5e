"""Puzzle: speculative decoding's verification by rejection sampling. Read first: notebook 13 (§1).

**Spec.** A draft model proposed k tokens ``drafts``, drawing draft i from its distribution ``draft_probs[i]``
(``[k, V]``); the target model's distributions after the context and the first i drafts are
``target_probs[i]`` (``[k + 1, V]``; row k comes after all the drafts). Keep what sampling from the target
would give, token for token in distribution (Leviathan et al. 2023; vLLM's ``rejection_sampler.py``):

* draft i is **accepted** when ``uniforms[i] * draft_probs[i][d] <= target_probs[i][d]`` (``d = drafts[i]``: with
  probability ``min(1, p / q)``); go on with draft i + 1;
* at the first **rejected** draft i, stop: keep the accepted ones and one token drawn from the *recovered*
  distribution, ``max(target_probs[i] - draft_probs[i], 0)`` normalised to sum to 1;
* if every draft is accepted, add the **bonus** token, drawn from ``target_probs[k]``.

Draw a token with ``sample(probs)`` (given: it takes a list of V probabilities summing to 1 and returns a token).
Return the kept tokens: the accepted drafts, then the recovered or bonus token::

    verify([5], draft_probs=[[...q...]], target_probs=[[...p...], [...]], uniforms=[0.3], sample=sample)

``check`` compares your tokens, and the distributions you handed ``sample``, with the rule above on random
distributions over a tiny vocabulary (the rule is what makes greedy and sampled speculative decoding exact:
notebook 13 measures it).
"""

import random

from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded

NAME = "rejection_sampling"
TOLERANCE = 1e-9


def verify(drafts: list[int], draft_probs: list[list[float]], target_probs: list[list[float]],
           uniforms: list[float], sample) -> list[int]:
    """The tokens one verification keeps (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 100) -> Report:
    """Run ``fn`` on ``num_cases`` random verifications (from ``seed``) against the rule."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


class _Sampler:
    """``sample(probs)``: the token where a fixed uniform falls in ``probs``' cumulative sums; remembers each
    distribution it was handed."""

    def __init__(self, u: float):
        self.u, self.seen = u, []

    def __call__(self, probs) -> int:
        probs = [float(p) for p in probs]
        self.seen.append(probs)
        total = 0.0
        for token, p in enumerate(probs):
            total += p
            if self.u < total:
                return token
        return max(range(len(probs)), key=probs.__getitem__)


def _rule(drafts, q, p, uniforms, sample):
    for i, d in enumerate(drafts):
        if uniforms[i] * q[i][d] <= p[i][d]:
            continue
        residual = [max(a - b, 0.0) for a, b in zip(p[i], q[i])]
        return list(drafts[:i]) + [sample([r / sum(residual) for r in residual])]
    return list(drafts) + [sample(p[len(drafts)])]


def _distribution(rng, vocab):
    weights = [rng.random() ** 2 for _ in range(vocab)]
    return [w / sum(weights) for w in weights]


def _case(rng: random.Random) -> Case:
    vocab, k = rng.randint(2, 5), rng.randint(1, 4)
    q = [_distribution(rng, vocab) for _ in range(k)]
    p = [_distribution(rng, vocab) for _ in range(k + 1)]
    drafts = [rng.choices(range(vocab), weights=q[i])[0] for i in range(k)]
    uniforms = [rng.random() for _ in range(k)]
    u = rng.random()
    reference = _Sampler(u)
    expected = _rule(drafts, q, p, uniforms, reference)

    def run(fn):
        theirs = _Sampler(u)
        got = fn(list(drafts), [list(row) for row in q], [list(row) for row in p], list(uniforms), theirs)
        return got, theirs.seen

    inputs = (f"drafts={drafts}, draft_probs={_rounded(q)}, target_probs={_rounded(p)}, uniforms={_rounded(uniforms)}")
    return Case(inputs, run, lambda got: _judge(got, expected, reference.seen, drafts, q, p, uniforms))


def _rounded(values):
    if isinstance(values[0], list):
        return [_rounded(row) for row in values]
    return [round(v, 3) for v in values]


def _judge(got, expected, wanted_draws, drafts, q, p, uniforms) -> str | None:
    tokens, draws = got
    wrong = not_an_int(tokens) if isinstance(tokens, list) else f"{tokens!r} is no list"
    if wrong:
        return f"expected the kept tokens {expected}, got {tokens!r}: {wrong}"
    accepted = len(expected) - 1
    if len(tokens) != len(expected) or tokens[:accepted] != expected[:accepted]:
        i = next((j for j in range(min(len(tokens), accepted + 1)) if j >= len(tokens) or j == accepted
                  or tokens[j] != expected[j]), accepted)
        if i < len(drafts) and i <= accepted:
            d = drafts[i]
            verdict = "accepted" if i < accepted else "rejected"
            return (f"expected {expected}, got {tokens}: draft {i} ({d}) is {verdict}: uniforms[{i}] x "
                    f"draft_probs[{i}][{d}] = {uniforms[i] * q[i][d]:.4g} against target_probs[{i}][{d}] = "
                    f"{p[i][d]:.4g}")
        return f"expected {expected}, got {tokens}: every draft is accepted, then one bonus token from target_probs[k]"
    if len(draws) != 1:
        return f"expected one call of sample (for the last token), got {len(draws)}"
    if len(draws[0]) != len(wanted_draws[0]) or any(abs(a - b) > TOLERANCE for a, b in zip(draws[0], wanted_draws[0])):
        what = "the bonus token from target_probs[k]" if accepted == len(drafts) else (
            f"the recovered token from max(target_probs[{accepted}] - draft_probs[{accepted}], 0), normalised")
        return (f"the last token must be drawn for {what}: sample got {_rounded(draws[0])}, expected "
                f"{_rounded(wanted_draws[0])}")
    if not same(tokens, expected):
        return f"expected {expected}, got {tokens}"
    return None
