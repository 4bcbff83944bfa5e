"""The scheduler's decisions, kept for reading: ``LLM(..., record_decisions=True)`` fills ``llm.decisions``.

Each step's ``ScheduledStep`` (``kvlab.engine.step``) names ``Sequence`` objects, which a record kept for
the engine's lifetime must not hold on to; a ``StepDecision`` names sequences by request instead, as
``(request_id, sample)`` (sample 0 is the prompt's sequence, sample k its k-th fork), with each one's
positions copied out. It is taken as ``schedule()`` returns, before the step's forward pass: who runs and as
what, who was preempted to make room, who was aborted, and the queues as the scheduler left them. Notebooks
and exercises read it instead of wrapping ``schedule``.

Invariant: ``llm.decisions[i]`` is the decision of the step recorded in ``llm.step_records[i]`` (a decision
is kept only for a step that is recorded, so both lists have one entry per step that ran).
"""

from dataclasses import dataclass

from kvlab.blocks.sequence import Sequence
from kvlab.engine.step import ScheduledStep

SeqRef = tuple[str, int]  # (request id, sample index)


@dataclass(frozen=True, slots=True)
class SeqDecision:
    """One sequence's part of a step (``kvlab.engine.step.SeqStep`` by name): positions ``start .. end - 1``."""
    request_id: str
    sample: int
    start: int       # after the prefix hits, the chunks already computed, or a decode's last token
    end: int
    prefill: bool    # prompt (or recomputed) tokens; else one decode token
    samples: bool    # the step computes its last token, so a token is sampled for it

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepDecision:
    step: int                                  # this step's index in ``llm.step_records``
    kind: str                                  # as ``StepRecord.kind``: prefill, decode, mixed or idle
    ran: tuple[SeqDecision, ...]               # in scheduling order
    preempted: tuple[SeqRef, ...]              # to make room, in order; now in ``waiting`` (recompute) or ``swapped``
    aborted: tuple[tuple[str, int, str], ...]  # (request id, sample, why): can never run in this pool
    waiting: tuple[SeqRef, ...]                # the queues once scheduled, in queue order
    running: tuple[SeqRef, ...]
    swapped: tuple[SeqRef, ...]


def decide(index: int, step: ScheduledStep, scheduler) -> StepDecision:
    """``step``, just returned by ``scheduler.schedule()``, as a record that holds no sequence."""
    def ref(seq: Sequence) -> SeqRef:
        request = scheduler.owner[seq.seq_id]
        return request.request_id, request.seqs.index(seq)

    ran = tuple(SeqDecision(*ref(e.seq), e.start, e.end, e.prefill, e.samples) for e in step.entries)
    return StepDecision(index, step.kind if step.entries else "idle", ran, tuple(map(ref, step.preempted)),
                        tuple((*ref(seq), why) for seq, why in step.aborted), tuple(map(ref, scheduler.waiting)),
                        tuple(map(ref, scheduler.running)), tuple(map(ref, scheduler.swapped)))
