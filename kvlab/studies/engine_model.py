"""The overlap replay's engine knobs: the cost model of a step and the engine's batching settings.

Kept apart from ``kvlab.studies.overlap`` so that a study that only replays sequentially never imports the
serving engine: the scheduler is built by ``kvlab.engine.schedulers.SchedulerConfig``, as ``LLM`` builds its
own, only when an overlap replay asks for it.
"""

from dataclasses import dataclass, replace

import numpy as np

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number

#: A draft no request generates (a replay's generated tokens are private ids from 2**40 on, and a draft must be a
#: token id >= 0: kvlab.engine.speculative.checked_drafts): ``StatedAcceptance`` proposes it from the first miss on.
WRONG_DRAFT = 0


@dataclass(frozen=True)
class EngineModel:
    """Timing and batching knobs of the overlap replay (orders of magnitude for an 8B model on one
    H100-class GPU: ~20 ms per decode step, ~50k prefill tokens/s; assumptions, not measurements). The
    batching knobs, ``scheduler``, ``scheduling_policy`` and ``speculative_config`` are ``LLM``'s, with its
    defaults: ``scheduler`` is a name in ``kvlab.engine.schedulers.SCHEDULERS`` or a ``Scheduler`` subclass;
    ``scheduling_policy`` "fcfs" or "lpm" (longest cached prefix first: ``kvlab.engine.queue_order``).

    Speculative decoding: ``speculative_config`` is ``LLM``'s dictionary (V1 scheduling; checked by the same
    rules, ``draft_acceptance_floor`` included), but the method's proposer is not run: a replay's generated
    tokens are private ids on which no model-free proposer ever finds a match. The drafts follow a stated
    acceptance model instead, ``draft_acceptance_rate`` (required with it; ``StatedAcceptance``), and each
    draft verified costs ``draft_ms_per_token`` on top of the step (0 by default: the decode part of a step is
    fixed whatever the batch, so a verification row costs what a decode row does, nothing)."""
    decode_step_ms: float = 20.0
    prefill_ms_per_token: float = 0.02
    max_num_seqs: int = 256
    time_scale: float = 1.0  # multiplies arrival times: 2.0 halves the request rate
    max_num_batched_tokens: int = 8192
    scheduler: object = "v1"
    scheduling_policy: str = "fcfs"
    tier_ms_per_block: float = 0.0  # a block promoted from an offload tier: its copy, serial with the step
    speculative_config: dict | None = None
    draft_acceptance_rate: float | None = None  # each draft right with this chance if the ones before it were
    draft_ms_per_token: float = 0.0

    def __post_init__(self):
        # Finite, and a decode step of at least a microsecond: the clock divides gaps by it and must not
        # overflow (an infinite or NaN clock would never reach the next arrival).
        check_number("decode_step_ms", self.decode_step_ms, 1e-3)
        check_number("prefill_ms_per_token", self.prefill_ms_per_token, 0)
        check_number("tier_ms_per_block", self.tier_ms_per_block, 0)
        check_number("draft_ms_per_token", self.draft_ms_per_token, 0)
        check_number("time_scale", self.time_scale, 0, min_open=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.scheduling_policy not in ("fcfs", "lpm"):  # kvlab.engine.queue_order's (not imported: see above)
            raise InvalidArgumentError(f"scheduling_policy must be one of ('fcfs', 'lpm'), got "
                                       f"{self.scheduling_policy!r}")
        if not isinstance(self.scheduler, (str, type)):
            raise InvalidArgumentError(f"scheduler must be a name in kvlab.engine.schedulers.SCHEDULERS or a "
                                       f"Scheduler subclass, got {self.scheduler!r}")
        if (self.speculative_config is None) != (self.draft_acceptance_rate is None):
            raise InvalidArgumentError(
                "speculative_config and draft_acceptance_rate go together: a replay's drafts follow a stated "
                "acceptance model (e.g. speculative_config={'method': 'ngram', 'num_speculative_tokens': 4}, "
                "draft_acceptance_rate=0.7), got " f"speculative_config={self.speculative_config!r}, "
                f"draft_acceptance_rate={self.draft_acceptance_rate!r}")
        if self.draft_acceptance_rate is not None:
            check_number("draft_acceptance_rate", self.draft_acceptance_rate, 0, 1)

    def scheduler_config(self):
        """The engine's ``SchedulerConfig`` for these knobs (``LLM``'s rules; preemption by recompute: a replay
        has no CPU pool), with a fresh drafter (``StatedAcceptance`` in place of the method's proposer).
        Raises InvalidArgumentError for an unknown scheduler, a bad ``speculative_config``, or speculation
        under V0 scheduling."""
        from kvlab.engine.schedulers import SchedulerConfig
        from kvlab.engine.speculative import resolve_speculative_config

        drafter = resolve_speculative_config(self.speculative_config)
        if drafter is not None:
            drafter = replace(drafter, proposer=StatedAcceptance(self.draft_acceptance_rate))
        return SchedulerConfig(scheduler=self.scheduler, scheduling_policy=self.scheduling_policy,
                               preemption_mode="recompute", max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens, drafter=drafter)

    def make_scheduler(self, manager):
        """The engine's scheduler on ``manager``, built as ``LLM`` builds it (``scheduler_config``)."""
        return self.scheduler_config().build(manager)


class StatedAcceptance:
    """A cost-model replay's drafts (``EngineModel.draft_acceptance_rate``), in place of a proposer: of the k
    drafts asked for, each is the token the replay generates there with probability ``rate`` if the drafts
    before it were (the geometric model ``kvlab.engine.draft_control`` assumes), and ``WRONG_DRAFT`` from the
    first miss on, so the replay's verification (``kvlab.studies.overlap``: the engine's greedy rule) keeps
    exactly the leading run. A replay's generated tokens count up by one per position within each request's
    private range (``kvlab.studies.fast_forward.generated_token``), so the token after a decoding sequence's
    last one is that plus one. The draws are seeded by that last token: they depend on the request and the
    position only, so replays of one trace under two schedulers draft alike. It has a ``Proposer``'s interface
    (``kvlab.engine.proposers``; not imported: see the module docstring)."""

    def __init__(self, rate: float):
        self.rate = rate

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        last = int(tokens[-1])
        hits = np.random.default_rng(last).random(max_tokens) < self.rate
        right = max_tokens if hits.all() else int(hits.argmin())
        return [last + 1 + i for i in range(right)] + [WRONG_DRAFT] * (max_tokens - right)

    def finished(self, tokens: list[int], num_prompt_tokens: int) -> None:
        """Nothing to learn: the acceptance is stated."""
