"""Puzzle: preemption by recompute, as vLLM V1's scheduler does it. Read first: notebook 10a (§3).

**Spec.** Every running request decodes one token this step, in order (the token budget is large here). A
request whose new token starts a new block (``needs_block[i]``) must get one free block; the others write
into their last block. ``blocks_held[i]`` is how many blocks request i holds, ``num_free_blocks`` how many
are free. When a request needs a block and none is free, the scheduler preempts by recompute::

    the victim is the LAST running request not yet scheduled this step (the newest: the lowest priority),
        possibly the request that needs the block itself;
    its blocks are freed (num_free_blocks grows by blocks_held[victim]), its computed tokens reset to 0 (its
        prompt and output are prefilled again later), and it goes to the FRONT of the waiting queue;
    repeat until the request gets its block, or it was itself the victim (it does not run this step, and
        nothing after it is left)

Return ``(scheduled, waiting)``: the indices of the requests that decode this step, in order, and the waiting
queue's indices after the step, front first (nothing waited before the step).

``check`` builds each case in kvlab's own ``V1Scheduler`` (``preemption_mode="recompute"``) on a pool that has
exactly these blocks, and compares your answer with what its ``schedule()`` does.
"""

import random

from kvlab.blocks import KVCacheManager
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, seeded, same
from kvlab.puzzles.v1_step import BLOCK_SIZE, add_request, scheduler_with

NAME = "preemption"


def preemption(blocks_held: list[int], needs_block: list[bool],
               num_free_blocks: int) -> tuple[list[int], list[int]]:
    """``(scheduled, waiting)`` after one decode step (see the module docstring). Your code here."""
    raise NotImplementedError


def check(fn, *, strict: bool = False, seed: int = 0, num_cases: int = 200) -> Report:
    """Run ``fn`` on ``num_cases`` random pools (from ``seed``) against kvlab's ``V1Scheduler.schedule``."""
    rng = seeded(seed, num_cases)
    return grade(NAME, fn, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    num_running = rng.randint(1, 6)
    # Tokens computed so far: a multiple of the block size means the next token starts a new block.
    computed = [rng.randint(1, 4) * BLOCK_SIZE if rng.random() < 0.6 else rng.randint(1, 4 * BLOCK_SIZE)
                for _ in range(num_running)]
    held = [-(-n // BLOCK_SIZE) for n in computed]
    needs = [n % BLOCK_SIZE == 0 for n in computed]
    free = rng.choice((0, 0, 1, rng.randint(0, 3)))
    if num_running == 1:
        free = max(free, 1)  # alone with no room kvlab aborts the request (vLLM would wait forever): not asked here
    scheduler = scheduler_with(KVCacheManager(sum(held) + free, BLOCK_SIZE, enable_prefix_caching=False), 1000, 64)
    seqs = [add_request(scheduler, n + 1, n) for n in computed]
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    step = scheduler.schedule()
    expected = ([index[entry.seq.seq_id] for entry in step.entries], [index[seq.seq_id] for seq in scheduler.waiting])
    inputs = f"blocks_held={held}, needs_block={needs}, num_free_blocks={free}"
    return Case(inputs, lambda fn: fn(list(held), list(needs), free), lambda got: _judge(got, expected))


def _judge(got, expected) -> str | None:
    if not (type(got) in (tuple, list) and len(got) == 2 and all(type(part) is list for part in got)):
        return f"expected (scheduled, waiting), two lists, got {got!r}"
    for part in got:
        wrong = not_an_int(part)
        if wrong:
            return wrong
    scheduled, waiting = expected
    if not same(got[0], scheduled):
        return (f"expected scheduled {scheduled}, got {got[0]}: a request short of a block preempts the last "
                "request not yet scheduled, freeing all its blocks, until it gets its block or is the victim itself")
    if not same(got[1], waiting):
        return (f"scheduled is right, but expected waiting {waiting}, got {got[1]}: each victim goes to the front "
                "of the waiting queue, so the last one preempted is first")
    return None
