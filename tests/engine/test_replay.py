"""``kvlab.engine.replay``: a timed workload run on an engine, read per request from ``llm.decisions``."""

import random

import numpy as np
import pytest

from engine_helpers import make_llm
from kvlab.engine import SamplingParams
from kvlab.engine.replay import RAN_STATES, Arrival, replay
from kvlab.errors import InvalidArgumentError

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)


def workload(seed: int, arrivals=(0, 0, 0, 3, 6, 6), lengths=(12, 31), params=GREEDY) -> dict[str, Arrival]:
    rng = random.Random(seed)
    return {name: Arrival([rng.randrange(1, 100) for _ in range(rng.randrange(*lengths))], step, params)
            for name, step in zip("ABCDEF", arrivals)}


def run(path, work, **kwargs):
    kwargs.setdefault("scheduling", "v0")
    llm = make_llm(path, max_num_seqs=8, record_decisions=True, **kwargs)
    return replay(llm, work)


def test_requests_join_at_their_step_and_scheduling_changes_no_token(llama):
    work = workload(0)
    roomy, tight = run(llama[0], work), run(llama[0], work, num_blocks=12)
    alone = make_llm(llama[0]).generate([a.prompt for a in work.values()], GREEDY, use_tqdm=False)
    assert roomy.outputs == tight.outputs == {name: out.outputs[0].token_ids for name, out in zip(work, alone)}
    assert roomy.arrived == {name: a.step for name, a in work.items()}
    frame = roomy.schedule_frame()
    assert frame.groupby("request")["step"].min().to_dict() == roomy.arrived  # absent before it arrives
    assert frame.groupby("request")["step"].max().to_dict() == roomy.finished  # and gone once finished
    assert not frame.duplicated(["step", "request"]).any()
    for decision in roomy.llm.decisions:  # one row per request that ran, in the state it ran as
        ran = frame[(frame["step"] == decision.step) & frame["state"].isin(RAN_STATES)]
        assert sorted(ran["request"]) == sorted(seq.request_id for seq in decision.ran)


def test_a_preemption_by_recompute_is_counted_once_in_tokens_and_hits(llama):
    rep = run(llama[0], workload(0), num_blocks=12)
    frame = rep.schedule_frame()
    victims = set(frame.loc[frame["preempted"], "request"])
    assert victims, "the pool must be short enough to preempt"
    recomputes = [seq for d in rep.llm.decisions for seq in d.ran if seq.prefill and seq.request_id in victims
                  and d.step > frame[(frame["request"] == seq.request_id) & frame["preempted"]]["step"].min()]
    # V0 re-prefills the victim whole: its cached prefix (hits) plus what it computes again.
    assert rep.recomputed_tokens == sum(seq.num_tokens for seq in recomputes) > 0
    assert rep.recomputed_tokens + rep.recompute_hits == sum(seq.end for seq in recomputes)
    assert set(frame.loc[frame["state"] == "recompute", "request"]) == victims
    with_recompute, recompute_only = rep.recompute_steps()
    assert with_recompute == len({(d.step) for d in rep.llm.decisions for seq in d.ran if seq in recomputes})
    assert 0 <= recompute_only <= with_recompute


def test_swapped_requests_are_swapped_never_recomputed(llama):
    rep = run(llama[0], workload(0), num_blocks=12, preemption_mode="swap", num_cpu_blocks=64)
    states = set(rep.schedule_frame()["state"])
    assert "swapped" in states and "recompute" not in states
    assert rep.recomputed_tokens == rep.recompute_hits == 0 and rep.recompute_steps() == (0, 0)


def test_chunks_of_a_first_prefill_are_prefill_not_recompute(llama):
    """V1 with a budget of 8: a 20-token prompt is prefilled over several steps, each a prefill chunk."""
    work = {"A": Arrival(list(range(1, 21)), 0, GREEDY)}
    rep = run(llama[0], work, scheduling="v1", max_num_batched_tokens=8)
    states = rep.schedule_frame().query("request == 'A'")["state"].tolist()
    assert states == ["prefill"] * 3 + ["decode"] * 9
    assert rep.first_token == {"A": 2} and rep.token_steps["A"] == list(range(2, 12))
    assert rep.recomputed_tokens == 0 and rep.recompute_steps() == (0, 0)


def test_durations_in_steps_and_in_any_per_step_cost(llama):
    rep = run(llama[0], workload(1))
    tokens = rep.llm.step_dataframe()["num_tokens"].to_numpy()
    assert rep.time_to_first_token() == {n: rep.first_token[n] + 1 - rep.arrived[n] for n in rep.first_token}
    assert rep.latency() == {n: rep.finished[n] + 1 - rep.arrived[n] for n in rep.finished}
    assert rep.latency(tokens) == {n: tokens[rep.arrived[n]:rep.finished[n] + 1].sum() for n in rep.finished}
    gaps = rep.gaps(tokens)
    assert len(gaps) == sum(len(steps) - 1 for steps in rep.token_steps.values())
    for gap in gaps.itertuples():
        assert gap.end in rep.token_steps[gap.request] and gap.cost == tokens[gap.start + 1:gap.end + 1].sum()
    # D arrives while A-C decode: V0 prefills it in a step of its own, so A waits two steps for a token.
    longest = rep.longest_gap(requests="A")
    assert longest["steps"] == 2 and longest["request"] == "A"
    assert rep.longest_gap(tokens)["cost"] == gaps["cost"].max()
    with pytest.raises(InvalidArgumentError, match="one number per step"):
        rep.latency(np.ones(rep.num_steps + 1))


def test_an_arrival_while_the_engine_idles_joins_at_the_next_step(llama):
    work = {"A": Arrival([1, 2, 3], 0, GREEDY), "B": Arrival([4, 5, 6], 100, GREEDY)}
    rep = run(llama[0], work)
    assert rep.arrived == {"A": 0, "B": 10} and rep.finished == {"A": 9, "B": 19}


def test_bad_engines_and_workloads_are_refused_before_anything_runs(llama):
    work = workload(0)
    plain = make_llm(llama[0])
    with pytest.raises(InvalidArgumentError, match="record_decisions=True"):
        replay(plain, work)
    bad = [({}, "non-empty dict"), ({1: work["A"]}, "strings"), ({"A": ([1, 2], 0, GREEDY)}, "Arrival"),
           ({"A": work["A"]._replace(step=-1)}, "int >= 0"), ({"A": work["A"]._replace(step=1.5)}, "int >= 0"),
           ({**work, "G": Arrival([1, 2], 0, SamplingParams(n=2))}, "n=1")]
    llm = make_llm(llama[0], record_decisions=True)
    for workload_, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            replay(llm, workload_)
        assert not llm.has_unfinished_requests() and not llm.step_records  # nothing ran, nothing queued
    replay(llm, work)
    with pytest.raises(InvalidArgumentError, match="fresh engine"):
        replay(llm, work)
