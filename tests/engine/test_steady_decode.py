"""``Scheduler.steady_decode_steps`` / ``advance_steady_decode``: the scheduler's own promise that its plain decode
step repeats, and the stretch run in one go (what the overlap study skips with), model-free on a KVCacheManager.
Block size 4: a sequence at position p needs a new block when p is a multiple of 4."""

import pytest

from kvlab.blocks.manager import KVCacheManager
from kvlab.engine import SamplingParams
from kvlab.engine.request import Request
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.errors import InvalidArgumentError

BS = 4
LONG = SamplingParams(max_tokens=100, ignore_eos=True)


def sample(seq) -> int:
    """The model's token: any function of the sequence will do, the same in both runs."""
    return 1000 + 7 * seq.num_tokens + seq.num_prompt_tokens


def scheduler_after_prefill(cls, prompts, *, num_blocks=16, max_num_seqs=8):
    """A scheduler whose first step prefilled ``prompts`` (each then sampled a token), plus a first decode step."""
    scheduler = cls(KVCacheManager(num_blocks, BS), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                    preemption_mode="recompute")
    for i, prompt in enumerate(prompts):
        scheduler.add(Request.create(str(i), None, prompt, LONG, BS, "cpu"))
    for _ in range(2):
        step_and_sample(scheduler)
    return scheduler


def step_and_sample(scheduler):
    step = scheduler.schedule()
    for entry in step.entries:
        if entry.samples:
            entry.seq.append_token(sample(entry.seq))
    return step


def state(scheduler):
    manager = scheduler.manager
    return ([(seq.token_slice(0, seq.num_tokens), seq.num_computed_tokens, manager.block_tables(seq))
             for seq in scheduler.running], manager.num_free_blocks, manager.num_cached_blocks)


@pytest.mark.parametrize("cls", [Scheduler, V1Scheduler])
def test_a_stretch_run_in_one_go_leaves_what_its_steps_leave(cls):
    # After the prefill (prompts of 6 and 9 tokens: pos 6 and 9 sampled) and one decode (pos 6 and 9 stored),
    # the next steps store pos 7 (block 2's last) and 10, 11: 1 step before A needs block 3 at pos 8.
    one_by_one, in_one_go = (scheduler_after_prefill(cls, [list(range(1, 7)), list(range(20, 29))])
                             for _ in range(2))
    assert in_one_go.steady_decode_steps() == 1
    in_one_go.advance_steady_decode(1, sample)
    step = step_and_sample(one_by_one)
    assert step.kind == "decode" and len(step.entries) == 2
    assert state(in_one_go) == state(one_by_one)
    assert in_one_go.steady_decode_steps() == 0  # A's pos 8 needs a new block: that step must run
    for _ in range(2):  # pos 8 and 9 for A, 11 and 12 (a new block) for B
        for scheduler in (one_by_one, in_one_go):
            step_and_sample(scheduler)
    assert in_one_go.steady_decode_steps() == one_by_one.steady_decode_steps() == 2  # A: pos 10, 11
    in_one_go.advance_steady_decode(2, sample)
    for _ in range(2):
        step_and_sample(one_by_one)
    assert state(in_one_go) == state(one_by_one)

def test_only_what_keeps_the_step_keeps_the_promise():
    scheduler = scheduler_after_prefill(V1Scheduler, [list(range(1, 7))], num_blocks=3, max_num_seqs=8)
    assert scheduler.steady_decode_steps() == 1
    scheduler.add(Request.create("cold", None, list(range(40, 52)), LONG, BS, "cpu"))  # nothing waited: the new head
    assert scheduler.steady_decode_steps() == 0
    step_and_sample(scheduler)  # 12 tokens need 3 blocks, 1 is free: it waits, the step is a plain decode again
    assert scheduler.steady_decode_steps() == 0  # pos 8 needs a new block (and it is the last one)
    step_and_sample(scheduler)
    assert scheduler.steady_decode_steps() == 3 and len(scheduler.waiting) == 1
    scheduler.add(Request.create("behind", None, [1], LONG, BS, "cpu"))  # FCFS stops at the refused head
    assert scheduler.steady_decode_steps() == 3
    scheduler.waiting_order.policy = "lpm"  # longest prefix first would try the newcomer first
    scheduler.add(Request.create("later", None, [2], LONG, BS, "cpu"))
    assert scheduler.steady_decode_steps() == 0


def test_a_subclass_promises_nothing_unless_it_opts_in():
    class Mine(V1Scheduler):
        def _schedule_running(self, step, budget, planned=None):
            return super()._schedule_running(step, budget, planned)

    class MineRepeats(Mine):
        repeats_plain_decode = True

    assert not Mine.repeats_plain_decode and MineRepeats.repeats_plain_decode and Scheduler.repeats_plain_decode
    prompts = [list(range(1, 7))]
    assert scheduler_after_prefill(Mine, prompts).steady_decode_steps() == 0
    assert scheduler_after_prefill(MineRepeats, prompts).steady_decode_steps() == 1


@pytest.mark.parametrize("steps", [0, 2, 1.0])
def test_a_stretch_longer_than_promised_is_refused_and_changes_nothing(steps):
    scheduler = scheduler_after_prefill(V1Scheduler, [list(range(1, 7))])
    before = state(scheduler)
    with pytest.raises(InvalidArgumentError, match=r"steps must be a whole number from 1 to 1"):
        scheduler.advance_steady_decode(steps, sample)
    assert state(scheduler) == before
