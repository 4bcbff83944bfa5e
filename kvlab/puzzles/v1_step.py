"""Puzzle: one step of vLLM V1's scheduler: a token budget shared by every request, prompts in chunks.
Read first: notebook 10b (§1-§2).

**Spec.** V1 has no prefill steps and decode steps: each step spends at most ``token_budget`` tokens
(``max_num_batched_tokens``) on whatever requests need. ``running[i]`` is how many tokens running request i
still has to compute: 1 for a request that decodes (its last sampled token), more for a prompt being
prefilled in chunks. ``waiting[j]`` is the prompt length of waiting request j (nothing cached). At most
``max_num_seqs`` requests run at once. The pool has room for everything here (no preemption). Return
``(running_tokens, admitted_tokens)``::

    running first, in order: request i gets min(running[i], budget left) tokens, and the budget shrinks by
        as much; once the budget is spent the rest get 0 (running_tokens has one entry per running request)
    then waiting requests, in order, while the budget is not spent and fewer than max_num_seqs requests run
        (the running ones included): request j is admitted with min(waiting[j], budget left) tokens, the last
        one admitted possibly a chunk of its prompt (the rest of it is scheduled by later steps);
        admitted_tokens lists the admitted ones' tokens (the first len(admitted_tokens) waiting requests)

``check`` builds each case in kvlab's own ``V1Scheduler`` (running prompts partly prefilled, decodes,
waiting prompts) and compares your answer with the tokens its ``schedule()`` gives each request.

(vLLM also caps a long prompt's chunk at ``long_prefill_token_threshold`` when it is set; kvlab does not.)
"""

import random

from kvlab.blocks import KVCacheManager, Sequence
from kvlab.engine.request import Request, RequestMetrics
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, seeded, same

NAME = "v1_step"
BLOCK_SIZE = 4


def v1_step(running: list[int], waiting: list[int], token_budget: int,
            max_num_seqs: int) -> tuple[list[int], list[int]]:
    """``(running_tokens, admitted_tokens)`` for one step (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 200) -> Report:
    """Run ``fn`` on ``num_cases`` random queues (from ``seed``) against kvlab's ``V1Scheduler.schedule``."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def scheduler_with(manager: KVCacheManager, budget: int, max_num_seqs: int) -> V1Scheduler:
    return V1Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                       preemption_mode="recompute")


def add_request(scheduler: V1Scheduler, num_tokens: int, num_computed: int | None) -> Sequence:
    """A request of ``num_tokens`` tokens in ``scheduler``: running with ``num_computed`` of them computed (their
    blocks allocated), or waiting (None)."""
    seq = Sequence(range(num_tokens), BLOCK_SIZE)
    scheduler.owner[seq.seq_id] = Request(str(seq.seq_id), None, list(range(num_tokens)),
                                          SamplingParams(max_tokens=1000), [seq], [None],
                                          RequestMetrics(0.0, num_tokens))
    if num_computed is None:
        scheduler.waiting.append(seq)
    else:
        seq.start_running(scheduler.manager.allocate(seq, num_new_tokens=num_computed))
        scheduler.running.append(seq)
    return seq


def _case(rng: random.Random) -> Case:
    budget, max_num_seqs = rng.choice((rng.randint(1, 8), rng.randint(8, 40))), rng.randint(1, 8)
    running = []
    for _ in range(rng.randint(0, max_num_seqs)):  # a decode (1 token left) or a prompt partly prefilled
        running.append(1 if rng.random() < 0.6 else rng.randint(2, 30))
    waiting = [rng.randint(1, 30) for _ in range(rng.randint(0, 4))]
    scheduler = scheduler_with(KVCacheManager(1000, BLOCK_SIZE, enable_prefix_caching=False), budget, max_num_seqs)
    seqs = [add_request(scheduler, done + left, done) for left in running
            for done in [rng.randint(1, 20)]]
    waiting_seqs = [add_request(scheduler, n, None) for n in waiting]
    scheduled = {entry.seq.seq_id: entry.num_tokens for entry in scheduler.schedule().entries}
    expected = ([scheduled.get(seq.seq_id, 0) for seq in seqs],
                [scheduled[seq.seq_id] for seq in waiting_seqs if seq.seq_id in scheduled])
    inputs = f"running={running}, waiting={waiting}, token_budget={budget}, max_num_seqs={max_num_seqs}"
    return Case(inputs, lambda fn: fn(list(running), list(waiting), budget, max_num_seqs),
                lambda got: _judge(got, expected, running, budget, max_num_seqs))


def _judge(got, expected, running, budget, max_num_seqs) -> str | None:
    if not (type(got) in (tuple, list) and len(got) == 2 and all(type(part) is list for part in got)):
        return f"expected (running_tokens, admitted_tokens), two lists, got {got!r}"
    for part in got:
        wrong = not_an_int(part)
        if wrong:
            return wrong
    running_tokens, admitted = expected
    if not same(got[0], running_tokens):
        return (f"expected running_tokens {running_tokens}, got {got[0]}: running requests come first, in order, "
                f"each taking min(tokens left, budget left) of the budget of {budget}")
    if not same(got[1], admitted):
        left = budget - sum(running_tokens)
        seats = max_num_seqs - len(running)
        return (f"running_tokens are right, but expected admitted_tokens {admitted}, got {got[1]}: the running "
                f"requests leave {left} of the budget and {seats} of the {max_num_seqs} seats; waiting prompts are "
                "admitted in order while both last, the last one admitted with a chunk of what the budget has left")
    return None
