"""Plain decode steps in one go: how the overlap replay keeps the engine's scheduler at the speed of a study.

A replay of the Mooncake trace runs about 200,000 steps of some 50 sequences each; most of them are plain
decode steps in which nothing the scheduler looks at changes. The scheduler itself says how many of the coming
steps are certainly the plain decode step it just made (``Scheduler.steady_decode_steps``: until a sequence
needs a new block, provided nothing joins or leaves in a way that could change admission) and runs them in one
go (``Scheduler.advance_steady_decode``); ``kvlab.engine.scheduler`` says why they repeat. What the replay adds
is its own part, the model's: ``plain_decode_steps`` also stops before a request samples its last token (that
step must run: the request finishes and its blocks are freed), before the next arrival (it joins the queue at
the step that starts at or after it; ``add`` then says whether the stretch goes on) and before the caller's
time limit; ``run_plain_decode_steps`` gives each sequence the private tokens those steps sample and advances
the clock and counters as k steps.

The second saving is in every step that does run: a step names each sequence's block tables and slots for
the model runner (``kvlab.engine.step``), thousands of slots for a prompt chunk, and a cost model reads none
of them. The scheduler is given the manager through a ``CostModelView``, which passes every call on to it
except those two reads, answered with empty tables: the decisions are the manager's, unchanged.

A learner's subclass of the built-in schedulers promises no repeats unless it opts in
(``Scheduler.repeats_plain_decode``), so its replay runs every step through its ``schedule()`` (as with
``record_decisions``). ``tests/studies/test_overlap.py`` checks that rows are the same with and without this.
"""

import math

from kvlab.studies.traces import PRIVATE_RANGE, PRIVATE_TOKEN_BASE


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
    """How many of the next steps ``engine`` (a ``kvlab.studies.overlap.Engine``) can run in one go: steady decode
    steps of its scheduler before any request samples its last token, none starting at or after ``limit`` or
    the next arrival."""
    steps = engine.scheduler.steady_decode_steps()
    if not steps:
        return 0
    for seq in engine.scheduler.running:
        steps = min(steps, engine.jobs[seq.seq_id].max_tokens - seq.num_completion_tokens - 1)
    if engine.next_arrival < len(engine.arrivals):
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
    jobs, running = engine.jobs, engine.scheduler.running
    engine.scheduler.advance_steady_decode(steps, lambda seq: generated_token(jobs[seq.seq_id].index, seq.num_tokens))
    for seq in running:
        jobs[seq.seq_id].computed = seq.num_computed_tokens
    engine.count_plain_decode_steps(steps, len(running))
