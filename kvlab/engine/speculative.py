"""Speculative decoding with model-free proposers: guess a sequence's next k tokens, verify them all in one forward
pass, keep the longest run the target model agrees with, plus one token of its own.

``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k, ...})`` takes vLLM's dictionary
(``method`` names a proposer in ``kvlab.engine.proposers.PROPOSERS``; the other keys are the proposer's own,
except kvlab's ``draft_acceptance_floor`` and ``draft_acceptance_ema_weight``, which give fewer drafts, or
none, to a sequence whose drafts are mostly rejected: ``kvlab.engine.draft_control``).
A step of V1 scheduling gives a decoding sequence with d <= k drafts a query of d + 1 rows over its paged
context: its last token (no K/V yet) and the drafts, whose slots the block manager hands out without sealing
them (``kvlab.blocks.group_manager``). Logit row i is the target's distribution p_i for the token after row i's
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

import reprlib
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvlab.blocks.sequence import Sequence
from kvlab.engine.draft_control import DraftControl
from kvlab.engine.proposers import PROPOSERS, Proposer
from kvlab.engine.sampling_params import SamplingParams
from kvlab.errors import InvalidArgumentError, KvlabError, ProposerWarning
from kvlab.validation import check_int, is_int

if TYPE_CHECKING:  # ``accept`` imports torch when it runs (see there)
    import torch

_COMMON_KEYS = ("method", "num_speculative_tokens", "draft_acceptance_floor", "draft_acceptance_ema_weight")


@dataclass(frozen=True)
class Speculation:
    """The engine's drafter: ``proposer`` proposes up to ``num_speculative_tokens`` drafts per sequence and step;
    ``control`` (None: every draft proposed is verified) cuts them where they are mostly rejected.

    The proposer may be a learner's: a hook that raises or returns something other than what the contract
    says (``checked_drafts``) costs only what that call was for (the sequence's drafts this step, or what
    ``finished`` would have learnt), never the engine; a ``ProposerWarning`` says so once per hook and kind of
    failure, and ``failures`` counts every one by hook."""
    method: str
    num_speculative_tokens: int
    proposer: Proposer
    control: DraftControl | None = None
    vocab_size: int | None = None  # drafts must be token ids below it (LLM sets the model's); None: unchecked
    failures: Counter = field(default_factory=Counter, init=False, compare=False)
    _warned: set = field(default_factory=set, init=False, compare=False, repr=False)

    def drafts(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """At most ``min(num_speculative_tokens, limit)`` draft tokens to follow ``seq``'s last token. Called
        once per step for each decoding sequence (the control scores the previous step's guess here)."""
        if self.control is not None:
            self.control.observe(seq)
        room = min(self.num_speculative_tokens, limit)
        if room <= 0:
            return ()
        proposal = self._propose(seq, room)
        if self.control is None:
            return proposal
        allowed = self.control.allowed(seq, room)
        self.control.remember(seq, proposal[:max(allowed, 1)])  # off (0 allowed): its first guess still scored
        return proposal[:allowed]

    def _propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """The proposer's drafts for ``seq``; none when it raised or returned anything but at most
        ``room`` token ids. It gets a copy of the tokens, so changing that list changes nothing."""
        try:
            proposal = self.proposer.propose(seq.token_slice(0, seq.num_tokens), room)
        except Exception as error:  # noqa: BLE001 - the proposer's failure costs this sequence's drafts only
            self._failed("propose", f"raised {error!r}", type(error), "the sequence's drafts for this step")
            return ()
        try:
            return checked_drafts(proposal, room, self.vocab_size)
        except Exception as error:  # noqa: BLE001 - also what reading a strange object raises (its __iter__)
            self._failed("propose", f"returned {reprlib.repr(proposal)}: {error}", "returned",
                         "the sequence's drafts for this step")
            return ()

    def finished(self, seq: Sequence) -> None:
        """``seq`` finished (any reason): the proposer may learn from its output, the control forgets it."""
        if self.control is not None:
            self.control.forget(seq)
        try:
            self.proposer.finished(seq.token_slice(0, seq.num_tokens), seq.num_prompt_tokens)
        except Exception as error:  # noqa: BLE001 - the proposer's failure costs what it would have learnt
            self._failed("finished", f"raised {error!r}", type(error), "what it would have learnt from the sequence")

    def _failed(self, hook: str, what: str, kind, lost: str) -> None:
        self.failures[hook] += 1
        if (hook, kind) in self._warned:
            return
        self._warned.add((hook, kind))
        warnings.warn(ProposerWarning(
            f"speculative_config method {self.method!r} ({type(self.proposer).__qualname__}): {hook} {what}. "
            f"Dropped {lost}; every request carries on (greedy output unchanged). Counted in "
            f"LLM.speculation.failures[{hook!r}]; warned once per hook and kind of failure."), stacklevel=3)


def checked_drafts(proposal, room: int, vocab_size: int | None) -> tuple[int, ...]:
    """``propose``'s answer as draft token ids, or InvalidArgumentError saying what is wrong with it. The
    contract: a list or tuple of ints (NumPy integers too) or a 1-D integer NumPy array, at most ``room`` long,
    each a token id (``0 <= id < vocab_size``). Anything else (None, floats, bools, a generator, more drafts than
    asked for) is refused whole: a proposer that breaks the contract once may be wrong in any of its drafts."""
    if isinstance(proposal, np.ndarray):
        if proposal.ndim != 1 or not np.issubdtype(proposal.dtype, np.integer):
            raise InvalidArgumentError(f"an array of drafts must be 1-D of an integer dtype, got {proposal.ndim}-D "
                                       f"{proposal.dtype}")
        proposal = proposal.tolist()
    elif not isinstance(proposal, (list, tuple)):
        raise InvalidArgumentError(f"drafts must be a list (or tuple, or 1-D integer NumPy array) of token ids, "
                                   f"not a {type(proposal).__name__}")
    if len(proposal) > room:
        raise InvalidArgumentError(f"{len(proposal)} drafts, but at most {room} were asked for")
    drafts = tuple(proposal)
    allowed = "an int >= 0" if vocab_size is None else f"an int in [0, {vocab_size}) (the model's vocabulary)"
    for draft in drafts:
        if not is_int(draft) or draft < 0 or (vocab_size is not None and draft >= vocab_size):
            raise InvalidArgumentError(f"draft {draft!r} is not a token id: each must be {allowed}")
    return tuple(map(int, drafts))


def resolve_speculative_config(config) -> Speculation | None:
    """``LLM``'s ``speculative_config``: None (no speculation) or a dict as vLLM takes it."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"speculative_config must be None or a dict such as {{'method': 'ngram', "
                                   f"'num_speculative_tokens': 4}}, got {config!r}")
    method = config.get("method")
    if not isinstance(method, str) or method not in PROPOSERS:
        raise InvalidArgumentError(f"speculative_config['method'] must be one of {sorted(PROPOSERS)} (model-free "
                                   f"proposers; kvlab.engine.proposers.PROPOSERS), got {method!r}")
    cls = PROPOSERS[method]
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise InvalidArgumentError(f"PROPOSERS[{method!r}] must be a subclass of kvlab.engine.proposers.Proposer, "
                                   f"got {cls!r}")
    if not isinstance(cls.options, tuple) or not all(isinstance(key, str) for key in cls.options):
        raise InvalidArgumentError(f"{cls.__qualname__}.options must be a tuple of the config keys it takes "
                                   f"(strings), got {cls.options!r}")
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
    options = {key: config[key] for key in cls.options if key in config}
    try:
        proposer = cls(**options)
    except KvlabError:
        raise  # the proposer's own check of its options (kvlab's proposers: InvalidArgumentError)
    except Exception as error:
        raise InvalidArgumentError(f"speculative_config method {method!r}: building {cls.__qualname__}(**{options!r}) "
                                   f"raised {error!r}") from error
    return Speculation(method, k, proposer, control)


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
