"""Who writes a sequence's progress (``num_computed_tokens``, drafts, status): the scheduler, as in vLLM V1. A
``KVCacheManager`` reads it and returns what each call did; ``BlockManager`` (for code without a scheduler) writes
it from those values; the engine's schedulers write it themselves and refuse a ``BlockManager``."""

import pytest

from kvlab import BlockManager, Sequence, SequenceStatus
from kvlab.blocks import KVCacheManager
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.errors import InvalidArgumentError

BS = 4
PROGRESS = ("num_computed_tokens", "num_draft_tokens", "prefill_end", "num_cached_tokens", "num_preemptions",
            "status")


def progress(seq):
    return {name: getattr(seq, name) for name in PROGRESS}


def test_a_kv_cache_manager_returns_the_progress_and_never_writes_it():
    m = KVCacheManager(16, BS, num_cpu_blocks=8)
    seq = Sequence(range(10), BS)
    before = progress(seq)
    admitted = m.allocate(seq, num_new_tokens=6)
    assert progress(seq) == before and admitted.num_computed_tokens == 6
    seq.start_running(admitted)
    assert (seq.status, seq.num_computed_tokens, seq.prefill_end) == (SequenceStatus.RUNNING, 6, 10)
    before = progress(seq)
    copies = m.append_slots(seq, num_new_tokens=4, num_draft_tokens=2)
    assert progress(seq) == before and copies.num_computed_tokens == 12  # 6 + 4 tokens + 2 drafts
    seq.scheduled_through(copies.num_computed_tokens, 2)
    seq.append_token(7)
    before = progress(seq)
    assert m.accept_drafts(seq, 1) == 11 and progress(seq) == before  # one draft kept: 10 + 1 verified
    seq.scheduled_through(11)
    m.check_invariants()
    before = progress(seq)
    m.swap_out(seq)
    m.swap_in(seq)
    m.free(seq, preempted=True)
    assert progress(seq) == before
    seq.stopped(preempted=True)
    assert (seq.status, seq.num_computed_tokens, seq.num_preemptions) == (SequenceStatus.WAITING, 0, 1)
    m.check_invariants()


def test_a_block_manager_writes_what_its_calls_return():
    core, taught = KVCacheManager(16, BS), BlockManager(16, BS)
    a, b = Sequence(range(10), BS), Sequence(range(10), BS)
    admitted = core.allocate(a, num_new_tokens=6)
    a.start_running(admitted)
    assert taught.allocate(b, num_new_tokens=6) == admitted and progress(b) == progress(a)
    a.scheduled_through(core.append_slots(a, num_new_tokens=4).num_computed_tokens)
    taught.append_slots(b, num_new_tokens=4)
    assert progress(b) == progress(a)
    core.free(a)
    a.stopped(preempted=False)
    taught.free(b)
    assert progress(b) == progress(a) and b.status is SequenceStatus.FINISHED


def test_the_engine_scheduler_refuses_a_manager_that_writes_progress_too():
    with pytest.raises(InvalidArgumentError, match="KVCacheManager"):
        V1Scheduler(BlockManager(16, BS), max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="recompute")
    V1Scheduler(KVCacheManager(16, BS), max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="recompute")
