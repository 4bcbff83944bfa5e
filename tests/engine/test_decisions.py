"""The decision record (``LLM(record_decisions=True)``, ``llm.decisions``): each step's scheduling decision
by request id, as the scheduler returned it, without wrapping ``schedule`` and without keeping sequences."""

import gc
import random
import weakref

import pytest

from engine_helpers import hf_greedy, make_llm
from kvlab.engine import SamplingParams, StepDecision
from kvlab.errors import InvalidArgumentError

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 100) for _ in range(rng.randrange(5, 20))] for _ in range(count)]


@pytest.mark.parametrize("scheduling, budget", [("v0", 256), ("v1", 7)])
def test_the_record_is_what_schedule_returned(llama, monkeypatch, scheduling, budget):
    """A small pool (preemptions) and, for V1, a budget that chunks prompts: every decision names what the
    scheduler's step held when it was returned, and agrees with the step's record."""
    path, hf = llama
    llm = make_llm(path, scheduling=scheduling, max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=6,
                   record_decisions=True)
    returned, schedule = [], llm.scheduler.schedule

    def watched():  # the notebook's old way: wrap schedule and read the step
        step = schedule()
        name = {seq.seq_id: request.request_id for request in llm.scheduler.owner.values() for seq in request.seqs}
        returned.append((step.kind if step.entries else "idle",
                         [(name[e.seq.seq_id], e.start, e.end, e.prefill, e.samples) for e in step.entries],
                         [name[seq.seq_id] for seq in step.preempted],
                         [name[seq.seq_id] for seq in llm.scheduler.waiting]))
        return step

    monkeypatch.setattr(llm.scheduler, "schedule", watched)
    batch = prompts(3, 5)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in batch]
    decisions, records = llm.decisions, llm.step_records
    assert len(decisions) == len(records) == len(returned) and all(isinstance(d, StepDecision) for d in decisions)
    for i, (decision, record, (kind, ran, preempted, waiting)) in enumerate(zip(decisions, records, returned)):
        assert decision.step == i and decision.kind == record.kind == kind
        assert [(e.request_id, e.start, e.end, e.prefill, e.samples) for e in decision.ran] == ran
        assert [r for r, _ in decision.preempted] == preempted and [r for r, _ in decision.waiting] == waiting
        assert all(sample == 0 for _, sample in decision.running)
        assert sum(e.num_tokens for e in decision.ran) == record.num_tokens
        assert len(decision.preempted) == record.preempted and len(decision.swapped) == record.swapped
    assert sum(len(d.preempted) for d in decisions) > 0  # the pool was short: the test can tell
    if scheduling == "v1":
        assert any(e.prefill and not e.samples for d in decisions for e in d.ran)  # a chunk short of the end
    # Every sampled token came from a step whose decision samples that request.
    assert sum(e.samples for d in decisions for e in d.ran) == sum(o.metrics.num_generated_tokens for o in outs)


def test_forks_are_named_by_sample_and_nothing_is_kept_alive(llama):
    llm = make_llm(llama[0], record_decisions=True)
    request_id = llm.add_request([5, 6, 7, 8, 9], SamplingParams(n=2, temperature=0.0, max_tokens=3))
    prompt_seq = weakref.ref(llm.scheduler.waiting[-1])
    while llm.has_unfinished_requests():
        llm.step()
    first, second = llm.decisions[:2]
    assert [(e.request_id, e.sample, e.prefill) for e in first.ran] == [(request_id, 0, True)]
    assert [(e.request_id, e.sample, e.prefill) for e in second.ran] == [(request_id, 0, False), (request_id, 1, False)]
    gc.collect()
    assert prompt_seq() is None  # the record names sequences; it does not hold them


def test_off_by_default_and_checked(llama):
    llm = make_llm(llama[0])
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.decisions is None and len(llm.step_records) == 2
    with pytest.raises(InvalidArgumentError, match="record_decisions must be a bool"):
        make_llm(llama[0], record_decisions="yes")
