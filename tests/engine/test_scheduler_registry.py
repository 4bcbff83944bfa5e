"""``LLM(scheduler=...)``: a registered name or a learner's own ``Scheduler`` subclass, beside the older
``scheduling=`` ("v1"/"v0"), refused when the two disagree."""

from collections import deque

import pytest

from engine_helpers import hf_greedy, make_llm
from kvlab.blocks.manager import KVCacheManager
from kvlab.engine import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.engine.schedulers import SCHEDULERS
from kvlab.errors import InvalidArgumentError
from kvlab.studies import EngineModel

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


def built_settings(scheduler) -> tuple:
    drafter = getattr(scheduler, "drafter", None)
    return (type(scheduler), scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.preemption_mode,
            scheduler.waiting_order.policy,
            None if drafter is None else (drafter.method, drafter.num_speculative_tokens, drafter.control.floor))


@pytest.mark.parametrize("scheduler", ["v1", "shortest_first"])
def test_the_engine_and_the_overlap_study_build_one_scheduler(llama, monkeypatch, scheduler):
    # SchedulerConfig builds both: the class (a learner's by name too), the batching knobs, the waiting order and
    # the speculative drafter (the study's proposes by a stated acceptance model; its draft control is the same).
    monkeypatch.setitem(SCHEDULERS, "shortest_first", ShortestPromptFirst)
    speculation = ({"method": "ngram", "num_speculative_tokens": 3, "draft_acceptance_floor": 0.4}
                   if scheduler == "v1" else None)
    llm = make_llm(llama[0], scheduler=scheduler, max_num_seqs=3, max_num_batched_tokens=40,
                   scheduling_policy="lpm", speculative_config=speculation)
    study = EngineModel(scheduler=scheduler, max_num_seqs=3, max_num_batched_tokens=40, scheduling_policy="lpm",
                        speculative_config=speculation, draft_acceptance_rate=speculation and 0.5)
    built = study.make_scheduler(KVCacheManager(16, 8))
    assert built_settings(built) == built_settings(llm.scheduler)
    if speculation:  # no draft past the model's context; a replay has none
        assert (built.max_model_len, llm.scheduler.max_model_len) == (None, 256)


def test_the_study_refuses_speculation_without_v1_as_the_engine_does():
    with pytest.raises(InvalidArgumentError, match="speculative_config needs V1 scheduling"):
        EngineModel(scheduler="v0", speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                    draft_acceptance_rate=0.5).scheduler_config()
