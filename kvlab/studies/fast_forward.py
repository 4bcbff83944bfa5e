"""Plain decode steps in one go: how the overlap replay keeps the engine's scheduler at the speed of a study.

A replay of the Mooncake trace runs about 200,000 steps of some 50 sequences each; most of them are plain
decode steps in which nothing the scheduler looks at changes. After a step of the built-in V0 or V1
scheduler (``kvlab.engine.schedulers``) that

* scheduled every running sequence for one decode token and admitted, preempted and aborted nothing (so
  the waiting queue's head, if any, was refused for its seats, the budget or the pool), and finished a
  request only if no one waits (else the blocks it freed may admit the head),

each following step is the same plain decode step until one of these comes: a sequence needs a new block
(``can_append_slots`` may say no, and the scheduler preempts), a request samples its last token, a request
arrives while none waits (with some waiting it only joins the queue behind a head that stays refused: both
built-ins admit first come first served, and the seats, the budget and the pool do not change), or the
caller's time limit. ``plain_decode_steps`` counts the steps before the first of them, and
``run_plain_decode_steps`` runs them: each sequence gets the tokens and slots those steps would have given
it, and the clock and counters advance as k steps. Two ``append_slots`` calls (k - 1 tokens, then one)
leave the manager's records exactly as k calls of one token would: no block is taken, and a block that
fills is sealed with the same tokens and hash. Only the order of seals across sequences within the run can
differ, and nothing reads it before the next real step: no prefix lookup, eviction or free happens in
between (a decode block holds private token ids, so it is never hit anyway).

The second saving is in every step that does run: a step names each sequence's block tables and slots for
the model runner (``kvlab.engine.step``), thousands of slots for a prompt chunk, and a cost model reads none
of them. The scheduler is given the manager through a ``CostModelView``, which passes every call on to it
except those two reads, answered with empty tables: the decisions are the manager's, unchanged.

Only the exact built-in classes are trusted to repeat themselves: a learner's subclass may decide anything
at any step, so its replay runs every step through its ``schedule()`` (as with ``record_decisions``).
``tests/studies/test_overlap.py`` checks that rows are the same with and without this.
"""

import math

from kvlab.blocks.manager import BlockManager
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.studies.traces import PRIVATE_RANGE, PRIVATE_TOKEN_BASE

#: Schedulers whose plain decode step repeats while nothing above changes (exact classes, not subclasses).
REPEATS_PLAIN_DECODE = (Scheduler, V1Scheduler)


class CostModelView:
    """A ``BlockManager`` as a replay's scheduler sees it: every call and attribute is the manager's, except
    ``block_tables`` and ``slot_mappings``, which only a model runner reads; they answer one empty group
    (so a replayed step's ``SeqStep.tables`` and ``slots`` are empty, and nothing in a replay reads them)."""

    def __init__(self, manager):
        self._manager = manager

    def __getattr__(self, name):
        value = getattr(self._manager, name)
        if callable(value):  # a bound method: kept, so the next call skips this lookup (properties are not)
            setattr(self, name, value)
        return value

    def block_tables(self, seq) -> list:
        return [[]]

    def slot_mappings(self, seq, start: int, end: int) -> list:
        return [[]]


def generated_token(index: int, position: int) -> int:
    """The private id of the token request ``index`` of the trace generates at ``position`` (its own range:
    never equal to another request's token, so decode blocks are never hit)."""
    return PRIVATE_TOKEN_BASE + index * PRIVATE_RANGE + position


def plain_decode_steps(engine, limit: float) -> int:
    """How many steps after the one ``engine`` (a ``kvlab.studies.overlap.Engine``) just ran, a plain decode
    step of every running sequence that left the waiting queue as it was, are certainly the same step again,
    none starting at or after ``limit``."""
    scheduler, manager, bs = engine.scheduler, engine.m, engine.bs
    if (type(scheduler) not in REPEATS_PLAIN_DECODE or scheduler.swapped or scheduler.prefix_reset_pending
            or not scheduler.running or not isinstance(manager, BlockManager) or manager.sliding_window is not None):
        return 0
    steps = math.inf
    for seq in scheduler.running:
        done = seq.num_computed_tokens  # the next step gives position `done` its slot
        if done % bs == 0:  # it needs a new block
            return 0
        # Steps 1 .. bs - done % bs fill its last block (the last of them seals it); the next needs a new one.
        steps = min(steps, bs - done % bs, engine.jobs[seq.seq_id].max_tokens - seq.num_completion_tokens - 1)
    if engine.next_arrival < len(engine.arrivals) and not scheduler.waiting:
        limit = min(limit, engine.arrivals[engine.next_arrival].arrival_ms)
    return _steps_starting_before(engine, limit, steps) if steps > 0 else 0


def _steps_starting_before(engine, limit: float, most: int) -> int:
    """How many of the next ``most`` steps start before ``limit``, each one plain decode step after the last
    (the same sums as the engine's clock, so the answer agrees with running them one by one)."""
    if limit == math.inf:
        return most
    step_ms, now = engine.model.decode_step_ms, engine.now_ms
    count = max(0, min(most, math.ceil((limit - now) / step_ms)))
    while count > 0 and engine.start_after(count - 1) >= limit:
        count -= 1
    while count < most and engine.start_after(count) < limit:
        count += 1
    return count


def run_plain_decode_steps(engine, steps: int) -> None:
    """Run ``steps`` plain decode steps of every running sequence (``plain_decode_steps`` said they are)."""
    manager, running = engine.m, engine.scheduler.running
    for seq in running:
        job = engine.jobs[seq.seq_id]
        for _ in range(steps - 1):  # the tokens steps 1 .. steps - 1 sample, each stored by the step after
            seq.append_token(generated_token(job.index, seq.num_tokens))
        if steps > 1:
            manager.append_slots(seq, num_new_tokens=steps - 1)
        manager.append_slots(seq, num_new_tokens=1)  # the last step's: the records end as after `steps` calls
        seq.append_token(generated_token(job.index, seq.num_tokens))
        job.computed = seq.num_computed_tokens
    engine.count_plain_decode_steps(steps, len(running))
