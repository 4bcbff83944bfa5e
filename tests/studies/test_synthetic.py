"""Synthetic workloads: the trace shape, seeding, and the sharing each pattern promises."""

import numpy as np
import pytest

from kvlab.errors import InvalidArgumentError
from kvlab.studies import synthetic
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.traces import COLUMNS


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_shape_as_a_trace_and_seeded(name):
    make = WORKLOADS[name]
    trace = make(seed=3)
    assert list(trace.columns) == COLUMNS + ["token_ids"] and trace["timestamp"].is_monotonic_increasing
    assert (trace["input_length"] == trace["token_ids"].map(len)).all() and (trace["output_length"] >= 1).all()
    again, other = make(seed=3), make(seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(trace["token_ids"], again["token_ids"]))
    assert not trace["input_length"].equals(other["input_length"])


def common_prefix(a, b):
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def test_system_prompt_is_the_only_shared_part():
    trace = synthetic.shared_system_prompt(num_requests=20, system_tokens=300, seed=1)
    prompts = trace["token_ids"].tolist()
    assert {common_prefix(a, b) for a in prompts for b in prompts if a is not b} == {300}


def test_few_shot_prompts_share_the_instruction_and_a_leading_run_of_examples():
    trace = synthetic.few_shot(num_requests=40, num_examples=4, shots=2, instruction_tokens=50,
                               example_tokens=30, seed=2)
    shared = {common_prefix(a, b) for a in trace["token_ids"] for b in trace["token_ids"] if a is not b}
    assert shared <= {50, 80, 110} and {50, 80} <= shared   # instruction, + first example, + both


def test_each_chat_turn_extends_the_previous_one():
    trace = synthetic.multi_turn_chat(num_conversations=3, turns=4, seed=5)
    by_length = sorted(trace["token_ids"], key=len)
    extended = sum(common_prefix(a, b) == len(a) for a in by_length for b in by_length if len(b) > len(a))
    assert extended >= 3 * (4 * 3 // 2)   # within each conversation every earlier turn is a prefix


def test_parallel_samples_repeat_the_prompt_at_the_same_moment():
    trace = synthetic.parallel_sampling(num_prompts=5, samples=3, seed=0)
    for _, group in trace.groupby("timestamp"):
        assert len(group) == 3 and all(np.array_equal(group["token_ids"].iloc[0], p) for p in group["token_ids"])


@pytest.mark.parametrize("make, kwargs", [
    (synthetic.few_shot, dict(shots=9, num_examples=8)),
    (synthetic.shared_system_prompt, dict(user_tokens=(10, 5))),
    (synthetic.shared_system_prompt, dict(user_tokens=(10.5, 20))),
    (synthetic.shared_system_prompt, dict(system_tokens=True)),
    (synthetic.shared_system_prompt, dict(system_tokens=2**30)),
    (synthetic.parallel_sampling, dict(rate_per_s=0)),
    (synthetic.parallel_sampling, dict(rate_per_s=float("inf"))),
    (synthetic.parallel_sampling, dict(samples=1.0)),
    (synthetic.multi_turn_chat, dict(think_time_s=float("nan"))),
])
def test_bad_parameters_are_refused(make, kwargs):
    with pytest.raises(InvalidArgumentError):
        make(**kwargs)
