"""``scheduling_policy="lpm"``: waiting prompts admitted longest cached prefix first (SGLang's ``lpm``), with the
FCFS fall-back past a queue length and an overtake bound, on hand-built queues and on the tiny model."""

import pytest

from engine_helpers import hf_greedy, make_llm
from kvlab.blocks.manager import KVCacheManager
from kvlab.engine import SamplingParams
from kvlab.engine import queue_order
from kvlab.engine.queue_order import WaitingOrder
from kvlab.engine.request import Request
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.scheduler_v1 import V1Scheduler
from kvlab.errors import InvalidArgumentError

BS = 4
WARM = list(range(1, 13))  # three full blocks, cached before the queue is built
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def cached_scheduler(cls, policy: str, max_num_seqs: int = 1):
    """A scheduler admitting one sequence at a time, on a pool where ``WARM``'s blocks are cached."""
    manager = KVCacheManager(32, BS)  # the scheduler's: it writes its sequences' progress
    warm = Request.create("warm-up", None, WARM + [99], ONE, BS, "cpu").seqs[0]
    manager.allocate(warm)
    manager.free(warm)
    scheduler = cls(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, preemption_mode="recompute")
    scheduler.waiting_order = WaitingOrder(policy)
    return scheduler


def add(scheduler, name: str, tokens) -> Request:
    request = Request.create(name, None, tokens, ONE, BS, "cpu")
    scheduler.add(request)
    return request


def admitted(scheduler) -> list[str]:
    """Run one step; the requests it admitted (by id), and finish them so the next step admits again."""
    step = scheduler.schedule()
    names = [scheduler.owner[e.seq.seq_id].request_id for e in step.entries if e.prefill]
    for entry in step.entries:
        scheduler.remove(entry.seq)
    return names


COLD = [50 + i for i in range(9)]  # nothing cached
HALF = WARM[:4] + [70 + i for i in range(5)]  # one block cached
FULL = WARM + [80]  # three blocks cached


@pytest.mark.parametrize("cls", [V1Scheduler, Scheduler])
def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_arrival_order(cls):
    orders = {}
    for policy in ("fcfs", "lpm"):
        scheduler = cached_scheduler(cls, policy)
        for name, tokens in (("cold", COLD), ("half", HALF), ("full", FULL)):
            add(scheduler, name, tokens)
        orders[policy] = [name for _ in range(3) for name in admitted(scheduler)]
    assert orders == {"fcfs": ["cold", "half", "full"], "lpm": ["full", "half", "cold"]}


def test_the_queue_keeps_arrival_order_between_passes():
    scheduler = cached_scheduler(V1Scheduler, "lpm")
    for name, tokens in (("cold", COLD), ("half", HALF), ("full", FULL)):
        add(scheduler, name, tokens)
    assert admitted(scheduler) == ["full"]
    assert [scheduler.owner[s.seq_id].request_id for s in scheduler.waiting] == ["cold", "half"]
    cold, half = scheduler.waiting
    assert scheduler.waiting_order.overtaken == {cold.seq_id: 1, half.seq_id: 1}


def test_lpm_falls_back_to_fcfs_past_the_queue_length_limit(monkeypatch):
    monkeypatch.setattr(queue_order, "LPM_QUEUE_LIMIT", 2)
    scheduler = cached_scheduler(V1Scheduler, "lpm")
    for name, tokens in (("cold", COLD), ("half", HALF), ("full", FULL)):
        add(scheduler, name, tokens)
    assert admitted(scheduler) == ["cold"]  # three waiting: FCFS
    assert admitted(scheduler) == ["full"]  # two waiting: LPM again


def test_a_cold_request_is_overtaken_at_most_the_bound_then_runs(monkeypatch):
    """Warm prompts keep arriving; the cold one that arrived first still runs after LPM_MAX_OVERTAKES of them."""
    monkeypatch.setattr(queue_order, "LPM_MAX_OVERTAKES", 3)
    scheduler = cached_scheduler(V1Scheduler, "lpm")
    add(scheduler, "cold", COLD)
    order = []
    for i in range(6):
        add(scheduler, f"warm{i}", FULL)
        order += admitted(scheduler)
    assert order == ["warm0", "warm1", "warm2", "cold", "warm3", "warm4"]


@pytest.mark.parametrize("scheduling", ["v1", "v0"])
def test_lpm_changes_the_order_not_the_greedy_outputs(llama, scheduling):
    """Prompt 2 shares prompt 0's first two blocks; with one sequence at a time it runs before prompt 1 under
    LPM, after it under FCFS, and every request's tokens are HF's either way."""
    path, hf = llama
    first = [(7 * i) % 120 + 1 for i in range(20)]
    prompts = [first, [(11 * i) % 120 + 3 for i in range(13)], first[:16] + [5, 9, 2]]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    expected = [hf_greedy(hf, prompt, 4) for prompt in prompts]
    for policy, order in (("fcfs", ["0", "1", "2"]), ("lpm", ["0", "2", "1"])):
        llm = make_llm(path, scheduling=scheduling, scheduling_policy=policy, max_num_seqs=1,
                       record_decisions=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [d.ran[0].request_id for d in llm.decisions if d.kind == "prefill"] == order
        assert outs[2].metrics.num_cached_prompt_tokens == 16


@pytest.mark.parametrize("policy", ["sjf", "LPM", None, 1])
def test_an_unknown_scheduling_policy_is_refused(llama, policy):
    with pytest.raises(InvalidArgumentError, match=r"scheduling_policy must be one of \('fcfs', 'lpm'\)"):
        make_llm(llama[0], scheduling_policy=policy)
