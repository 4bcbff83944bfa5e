"""Speculative decoding with model-free proposers: guess a sequence's next k tokens, verify them all in one forward
pass, keep the longest run the target model agrees with, plus one token of its own.

``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k, ...})`` takes vLLM's dictionary
(``method`` names a proposer in ``kvlab.engine.proposers.PROPOSERS``; the other keys are the proposer's own,
except kvlab's ``draft_acceptance_floor`` and ``draft_acceptance_ema_weight``, which give fewer drafts, or
none, to a sequence whose drafts are mostly rejected: ``kvlab.engine.draft_control``).
A step of V1 scheduling gives a decoding sequence with d <= k drafts a query of d + 1 rows over its paged
context: its last token (no K/V yet) and the drafts, whose slots the block manager hands out without sealing
them (``kvlab.blocks.drafts``). Logit row i is the target's distribution p_i for the token after row i's
token, so row i verifies draft i + 1 and the row after the last accepted draft gives the bonus token.

Acceptance (``accept``): greedy, draft i is accepted while it is row i's argmax, so the tokens kept are
exactly those plain decoding would have produced. Sampling: exact speculative sampling accepts a draft x
drawn from q with probability min(1, p(x) / q(x)) and otherwise samples from the residual max(0, p - q),
renormalised; the kept token is then distributed as p. A model-free proposer's q is a point mass on its
draft d (q(d) = 1), so the rule reduces to: **accept d with probability p(d); else sample from p with d
removed and renormalised** (the residual p - q is 0 at d and p elsewhere). The first rejection ends the run;
after a run of accepted drafts the bonus token is sampled from p as usual. p is the sampler's own
distribution (temperature, top-k, top-p: ``kvlab.engine.sampler.probabilities``), so every token is
distributed as without speculation.

kvlab draws that rule as the sampler draws a token: row i's token x is sampled from p_i with the sequence's
next noise row (``kvlab.engine.sampler.noise_row``), and d is accepted exactly when x = d; otherwise x is the
correction. That is the rule above (x = d with probability p(d); given x != d, x is distributed as p with d
removed), and it consumes one noise row per token kept, whatever the drafts. So a seeded sequence's t-th
token always comes from its generator's t-th row: its samples are the ones decoding without speculation
draws, whatever k, the proposer, the drafts it got this step (which the budget and the pool, so the rest of
the batch, can cut) or preemption. A draw per draft (a uniform for acceptance, then a multinomial) would
shift its stream by every draft it was or was not given.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.blocks.sequence import Sequence
from kvlab.engine.draft_control import DraftControl
from kvlab.engine.proposers import PROPOSERS, Proposer
from kvlab.engine.sampling_params import SamplingParams
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int

if TYPE_CHECKING:  # ``accept`` imports torch when it runs (see there)
    import torch

_COMMON_KEYS = ("method", "num_speculative_tokens", "draft_acceptance_floor", "draft_acceptance_ema_weight")


@dataclass(frozen=True)
class Speculation:
    """The engine's drafter: ``proposer`` proposes up to ``num_speculative_tokens`` drafts per sequence and step;
    ``control`` (None: every draft proposed is verified) cuts them where they are mostly rejected."""
    method: str
    num_speculative_tokens: int
    proposer: Proposer
    control: DraftControl | None = None

    def drafts(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """At most ``min(num_speculative_tokens, limit)`` draft tokens to follow ``seq``'s last token. Called
        once per step for each decoding sequence (the control scores the previous step's guess here)."""
        if self.control is not None:
            self.control.observe(seq)
        room = min(self.num_speculative_tokens, limit)
        if room <= 0:
            return ()
        proposal = self.proposer.propose(seq.token_slice(0, seq.num_tokens), room)[:room]
        if self.control is None:
            return tuple(proposal)
        allowed = self.control.allowed(seq, room)
        self.control.remember(seq, proposal[:max(allowed, 1)])  # off (0 allowed): its first guess still scored
        return tuple(proposal[:allowed])

    def finished(self, seq: Sequence) -> None:
        """``seq`` finished (any reason): the proposer may learn from its output, the control forgets it."""
        self.proposer.finished(seq.token_slice(0, seq.num_tokens), seq.num_prompt_tokens)
        if self.control is not None:
            self.control.forget(seq)


def resolve_speculative_config(config) -> Speculation | None:
    """``LLM``'s ``speculative_config``: None (no speculation) or a dict as vLLM takes it."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"speculative_config must be None or a dict such as {{'method': 'ngram', "
                                   f"'num_speculative_tokens': 4}}, got {config!r}")
    method = config.get("method")
    if method not in PROPOSERS:
        raise InvalidArgumentError(f"speculative_config['method'] must be one of {sorted(PROPOSERS)} (model-free "
                                   f"proposers; kvlab.engine.proposers.PROPOSERS), got {method!r}")
    cls = PROPOSERS[method]
    unknown = sorted(set(config) - set(_COMMON_KEYS) - set(cls.options))
    if unknown:
        raise InvalidArgumentError(f"speculative_config has unknown keys {unknown} for method {method!r}; allowed: "
                                   f"{list(_COMMON_KEYS + cls.options)}")
    if "num_speculative_tokens" not in config:
        raise InvalidArgumentError("speculative_config needs 'num_speculative_tokens' (drafts per step, >= 1)")
    k = check_int("speculative_config['num_speculative_tokens']", config["num_speculative_tokens"], 1)
    if "draft_acceptance_floor" in config:
        control = DraftControl(config["draft_acceptance_floor"], config.get("draft_acceptance_ema_weight"))
    elif "draft_acceptance_ema_weight" in config:
        raise InvalidArgumentError("speculative_config['draft_acceptance_ema_weight'] needs 'draft_acceptance_floor' "
                                   "(the rule it weights; e.g. 0.3)")
    else:
        control = None
    return Speculation(method, k, cls(**{key: config[key] for key in cls.options if key in config}), control)


def accept(logits: "torch.Tensor", drafts: tuple[int, ...], params: SamplingParams,
           generator: "torch.Generator") -> list[int]:
    """The tokens one verification keeps: the accepted drafts, then the target's own token (the correction of
    the first rejected draft, or the bonus token after them all). ``logits`` fp32 ``[len(drafts) + 1, vocab]``,
    row i the target's logits after the context and drafts ``[:i]``. Sampling takes one noise row from
    ``generator`` (the sequence's) per token kept, as the sampler would. Raises FloatingPointError on unusable
    logits, as the sampler does."""
    # the sampler (torch) here only: the drafter (Speculation) runs in cost-model replays too, which import no torch
    from kvlab.engine.sampler import noise_row, probabilities, race

    if not bool((logits.isfinite() | (logits == float("-inf"))).all() and (logits > float("-inf")).any(-1).all()):
        raise FloatingPointError("the model's logits hold NaN or +inf, or are all -inf: no token can be chosen")
    if params.greedy:
        choice = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == choice[kept]:
            kept += 1
        return list(drafts[:kept]) + [choice[kept]]
    probs = probabilities(logits, [params] * len(logits))  # [d + 1, vocab], the sampler's distribution

    def sample(row: "torch.Tensor") -> int:  # distributed as the row's p; takes the sequence's next noise row
        return int(race(row, noise_row(generator, row)))

    for i, draft in enumerate(drafts):
        token = sample(probs[i])
        if token != draft:  # rejected (draft i is kept with probability p_i(draft)): token is its correction
            return list(drafts[:i]) + [token]
    return list(drafts) + [sample(probs[-1])]
