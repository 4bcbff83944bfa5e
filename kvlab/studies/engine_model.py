"""The overlap replay's engine knobs: the cost model of a step and the engine's batching settings.

Kept apart from ``kvlab.studies.overlap`` so that a study that only replays sequentially never imports the
serving engine (and torch with it): the scheduler is looked up in ``kvlab.engine.schedulers`` only when an
overlap replay asks for it.
"""

from dataclasses import dataclass

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number


@dataclass(frozen=True)
class EngineModel:
    """Timing and batching knobs of the overlap replay (orders of magnitude for an 8B model on one
    H100-class GPU: ~20 ms per decode step, ~50k prefill tokens/s; assumptions, not measurements). The
    batching knobs, ``scheduler`` and ``scheduling_policy`` are ``LLM``'s, with its defaults: ``scheduler`` is a
    name in ``kvlab.engine.schedulers.SCHEDULERS`` or a ``Scheduler`` subclass (``scheduler_class`` resolves it);
    ``scheduling_policy`` "fcfs" or "lpm" (longest cached prefix first: ``kvlab.engine.queue_order``)."""
    decode_step_ms: float = 20.0
    prefill_ms_per_token: float = 0.02
    max_num_seqs: int = 256
    time_scale: float = 1.0  # multiplies arrival times: 2.0 halves the request rate
    max_num_batched_tokens: int = 8192
    scheduler: object = "v1"
    scheduling_policy: str = "fcfs"
    tier_ms_per_block: float = 0.0  # a block promoted from an offload tier: its copy, serial with the step

    def __post_init__(self):
        # Finite, and a decode step of at least a microsecond: the clock divides gaps by it and must not
        # overflow (an infinite or NaN clock would never reach the next arrival).
        check_number("decode_step_ms", self.decode_step_ms, 1e-3)
        check_number("prefill_ms_per_token", self.prefill_ms_per_token, 0)
        check_number("tier_ms_per_block", self.tier_ms_per_block, 0)
        check_number("time_scale", self.time_scale, 0, min_open=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.scheduling_policy not in ("fcfs", "lpm"):  # kvlab.engine.queue_order's (not imported: torch)
            raise InvalidArgumentError(f"scheduling_policy must be one of ('fcfs', 'lpm'), got "
                                       f"{self.scheduling_policy!r}")
        if not isinstance(self.scheduler, (str, type)):
            raise InvalidArgumentError(f"scheduler must be a name in kvlab.engine.schedulers.SCHEDULERS or a "
                                       f"Scheduler subclass, got {self.scheduler!r}")

    def scheduler_class(self) -> type:
        """The engine's scheduler class for ``scheduler`` (``LLM(scheduler=...)``'s rules); raises
        InvalidArgumentError for an unknown name or a class that is not a ``Scheduler``."""
        from kvlab.engine.schedulers import resolve_scheduler  # the engine imports torch: only when replaying

        return resolve_scheduler(self.scheduler, None)

    def make_scheduler(self, manager):
        """The engine's scheduler on ``manager``, built as ``LLM`` builds it (preemption by recompute)."""
        from kvlab.engine.queue_order import WaitingOrder

        scheduler = self.scheduler_class()(manager, max_num_seqs=self.max_num_seqs,
                                           max_num_batched_tokens=self.max_num_batched_tokens,
                                           preemption_mode="recompute")
        scheduler.waiting_order = WaitingOrder(self.scheduling_policy)
        return scheduler
