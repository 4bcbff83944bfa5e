"""Schedulers by name, for ``LLM(scheduler=...)``: the built-in V1 and V0 policies, or a learner's own.

``SCHEDULERS`` maps a name to a ``Scheduler`` subclass; add yours there to pick it by name, or pass the
class itself. The engine builds it as ``cls(block_manager, max_num_seqs=..., max_num_batched_tokens=...,
preemption_mode=...)`` and then only calls what ``kvlab.engine.scheduler.Scheduler`` defines (``add``,
``schedule``, ``remove``, ...), so a subclass changes the policy by overriding ``schedule`` (or the steps
it is made of) and keeps the queues and the step contract (``kvlab.engine.step``) as they are.

A scheduler's class attribute ``scheduling`` names its family: "v1" chunks prompts (a prompt may be longer
than ``max_num_batched_tokens``), "v0" schedules whole prompts (``LLM`` refuses a longer one). Subclasses
inherit their base's; a V0 subclass that chunks would say "v1".

``scheduler`` and ``scheduling`` (the older argument, which names only the built-ins): given neither, "v1";
given one, that one; given both, ``scheduling`` must be the scheduler's family, so
``LLM(scheduler=MyV0Variant, scheduling="v0")`` runs ``MyV0Variant`` and ``LLM(scheduler="v0",
scheduling="v1")`` is refused.

``SchedulerConfig`` is the one place a scheduler is built: ``LLM`` and the studies' overlap replay
(``kvlab.studies.engine_model.EngineModel.make_scheduler``) both build theirs with it, so a replay runs the
scheduler an engine with the same settings runs, speculative drafter included. Nothing here imports torch.
"""

from dataclasses import dataclass, field

from kvlab.engine.queue_order import WaitingOrder, check_queue_policy
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.errors import InvalidArgumentError

#: The values ``LLM(scheduling=...)`` accepts: V1 (one token budget shared by decodes and prompt chunks) or
#: V0 (a step of whole prompts or a step of decodes).
SCHEDULING_POLICIES = ("v1", "v0")
_BUILTIN = {"v1": V1Scheduler, "v0": Scheduler}

#: Schedulers by name, for ``LLM(scheduler=name)``; a learner may add their own.
SCHEDULERS: dict[str, type[Scheduler]] = dict(_BUILTIN)

__all__ = ["SCHEDULERS", "SCHEDULING_POLICIES", "Scheduler", "SchedulerConfig", "V1Scheduler", "resolve_scheduler"]


def resolve_scheduler(scheduler, scheduling) -> type[Scheduler]:
    """The class ``LLM`` runs for its ``scheduler`` and ``scheduling`` arguments (see the module docstring)."""
    if scheduling is not None and (not isinstance(scheduling, str) or scheduling not in SCHEDULING_POLICIES):
        raise InvalidArgumentError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {scheduling!r}")
    if scheduler is None:
        return _BUILTIN[scheduling or "v1"]
    if isinstance(scheduler, str):
        if scheduler not in SCHEDULERS:
            raise InvalidArgumentError(f"unknown scheduler {scheduler!r}; known: {', '.join(SCHEDULERS)} (or pass a "
                                       "subclass of kvlab.engine.scheduler.Scheduler)")
        cls = SCHEDULERS[scheduler]
    elif isinstance(scheduler, type) and issubclass(scheduler, Scheduler):
        cls = scheduler
    else:
        raise InvalidArgumentError(f"scheduler must be a name in kvlab.engine.schedulers.SCHEDULERS "
                                   f"({', '.join(SCHEDULERS)}) or a subclass of kvlab.engine.scheduler.Scheduler, "
                                   f"got {scheduler!r}")
    family = getattr(cls, "scheduling", None)
    if family not in SCHEDULING_POLICIES:
        raise InvalidArgumentError(f"scheduler {cls.__name__}'s class attribute scheduling must be one of "
                                   f"{SCHEDULING_POLICIES}, got {family!r}")
    if scheduling is not None and scheduling != family:
        shown = scheduler if isinstance(scheduler, str) else cls.__name__
        raise InvalidArgumentError(f"scheduler {shown!r} is a {family} scheduler but scheduling={scheduling!r}: "
                                   "pass only scheduler=, or a scheduling= that names its family")
    return cls


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's scheduler settings, checked when made (``LLM`` fails before it loads weights): ``scheduler``
    and ``scheduling`` as ``resolve_scheduler`` takes them (the class it picks is ``scheduler_class``), the
    waiting order ``scheduling_policy`` ("fcfs" or "lpm": ``kvlab.engine.queue_order``), the preemption mode,
    the token budget and the cap on running sequences, and the speculative ``drafter`` (a
    ``kvlab.engine.speculative.Speculation``; V1 scheduling only) with the ``max_model_len`` no draft goes past
    (None: no context limit, only each request's ``max_tokens``; a replay has no model). ``build(manager)``
    makes a scheduler on a block manager; the drafter is shared by every scheduler built from one config."""
    scheduler: object = None
    scheduling: str | None = None
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    drafter: object = None
    max_model_len: int | None = None
    scheduler_class: type = field(init=False)

    def __post_init__(self):
        cls = resolve_scheduler(self.scheduler, self.scheduling)
        check_queue_policy(self.scheduling_policy)
        if self.drafter is not None and not issubclass(cls, V1Scheduler):
            raise InvalidArgumentError(f"speculative_config needs V1 scheduling (a step that mixes decodes with "
                                       f"drafts), got scheduler {cls.__name__}: use scheduling='v1'")
        object.__setattr__(self, "scheduler_class", cls)

    def build(self, manager) -> Scheduler:
        scheduler = self.scheduler_class(manager, max_num_seqs=self.max_num_seqs,
                                         max_num_batched_tokens=self.max_num_batched_tokens,
                                         preemption_mode=self.preemption_mode)
        scheduler.waiting_order = WaitingOrder(self.scheduling_policy)
        if self.drafter is not None:
            scheduler.drafter, scheduler.max_model_len = self.drafter, self.max_model_len
        return scheduler
