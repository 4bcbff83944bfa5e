"""``LLM(scheduler=...)``: a registered name or a learner's own ``Scheduler`` subclass, beside the older
``scheduling=`` ("v1"/"v0"), refused when the two disagree."""

from collections import deque

import pytest

from engine_helpers import hf_greedy, make_llm
from kvlab.engine import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.engine.schedulers import SCHEDULERS
from kvlab.errors import InvalidArgumentError

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1], [8, 2, 8, 1, 8, 2, 8]]  # 11, 3 and 7 tokens


class ShortestPromptFirst(Scheduler):
    """A learner's V0 variant: the waiting queue is served shortest sequence first (stable among equals)."""

    def schedule(self):
        self.waiting = deque(sorted(self.waiting, key=lambda seq: seq.num_tokens))
        return super().schedule()


def test_a_learners_scheduler_serves_requests_with_the_same_greedy_outputs(llama):
    path, hf = llama  # one sequence at a time, so the admission order shows in the steps
    llm = make_llm(path, scheduler=ShortestPromptFirst, max_num_seqs=1, record_decisions=True)
    assert type(llm.scheduler) is ShortestPromptFirst and llm.scheduling == "v0"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = [hf_greedy(hf, prompt, 5) for prompt in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == expected
    default = make_llm(path, max_num_seqs=1).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in default] == expected
    prefills = [d.ran[0].request_id for d in llm.decisions if d.kind == "prefill"]
    assert prefills == ["1", "2", "0"]  # the 3-token prompt first, the 11-token one last


def test_a_registered_scheduler_is_chosen_by_name(llama, monkeypatch):
    monkeypatch.setitem(SCHEDULERS, "shortest_first", ShortestPromptFirst)
    llm = make_llm(llama[0], scheduler="shortest_first", scheduling="v0")
    assert type(llm.scheduler) is ShortestPromptFirst


@pytest.mark.parametrize("settings, expected", [
    (dict(), V1Scheduler),
    (dict(scheduling="v0"), Scheduler),
    (dict(scheduler="v0"), Scheduler),
    (dict(scheduler="v1", scheduling="v1"), V1Scheduler),
    (dict(scheduler=V1Scheduler), V1Scheduler),
])
def test_scheduler_and_scheduling_agree(llama, settings, expected):
    llm = make_llm(llama[0], **settings)
    assert type(llm.scheduler) is expected and llm.scheduling == expected.scheduling


@pytest.mark.parametrize("settings, match", [
    (dict(scheduler="v0", scheduling="v1"), "scheduler 'v0' is a v0 scheduler but scheduling='v1'"),
    (dict(scheduler=ShortestPromptFirst, scheduling="v1"),
     "scheduler 'ShortestPromptFirst' is a v0 scheduler but scheduling='v1'"),
    (dict(scheduler="fcfs"), "unknown scheduler 'fcfs'; known: v1, v0"),
    (dict(scheduler=object), "scheduler must be a name in"),
    (dict(scheduler=lambda *a, **k: None), "subclass of kvlab.engine.scheduler.Scheduler"),
    (dict(scheduler=type("Chunky", (Scheduler,), {"scheduling": "v2"})),
     "scheduler Chunky's class attribute scheduling must be one of"),
    (dict(scheduling="v2"), r"scheduling must be one of \('v1', 'v0'\), got 'v2'"),
])
def test_bad_scheduler_arguments_are_refused(llama, settings, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_llm(llama[0], **settings)
