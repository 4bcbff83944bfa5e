"""V1 scheduling: one token budget per step, prompt chunks and decodes in one forward pass, checked token for
token against HF greedy generation."""

import random

import pytest

from engine_helpers import assert_pool_clean, hf_greedy, make_llm
from kvlab.engine import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 128) for _ in range(n)] for n in lengths]


def check_budget(llm, budget: int):
    """Every step kept to the budget, and its tokens are its prefill and decode tokens; returns the records."""
    records = llm.step_dataframe()
    assert (records["num_tokens"] <= budget).all()
    assert (records["num_tokens"] == records["prefill_tokens"] + records["decode_tokens"]).all()
    return records


@pytest.mark.parametrize("arch, budget, max_num_seqs", [
    ("llama", 2, 2),    # chunks of one token beside one decode
    ("qwen3", 11, 3),   # chunk boundaries inside blocks of 8
    ("llama", 11, 3),
])
def test_chunked_prompts_and_mixed_steps_match_hf(request, arch, budget, max_num_seqs):
    path, hf = request.getfixturevalue(arch)
    llm = make_llm(path, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    prompts = random_prompts(1, (5, 19, 27))  # two of them longer than the budget
    max_tokens = [6, 4, 5]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, m)
        assert out.metrics.num_generated_tokens == m  # a chunk short of the prompt's end samples nothing
    records = check_budget(llm, budget)
    assert (records["kind"] == "mixed").any()
    mixed = records[records["kind"] == "mixed"]
    assert (mixed["prefill_tokens"] > 0).all() and (mixed["decode_tokens"] > 0).all()
    assert records["prefill_tokens"].sum() == sum(map(len, prompts))  # nothing cached, nothing computed twice
    assert records["decode_tokens"].sum() == sum(max_tokens) - len(prompts)
    if budget == 2:
        assert records["prefill_tokens"].max() == 2 and (records["prefill_tokens"] == 1).any()
    assert_pool_clean(llm)


def test_a_prompt_hits_blocks_another_prompts_chunks_sealed(llama):
    """A (25 tokens) is prefilled 11 tokens a step; B shares its first 16 tokens and is admitted in A's last
    chunk's step, hitting the two blocks A's earlier chunks completed."""
    path, hf = llama
    llm = make_llm(path, max_num_batched_tokens=11, max_num_seqs=2)
    first, = random_prompts(2, (25,))
    second = first[:16] + random_prompts(3, (6,))[0]
    outs = llm.generate([first, second], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in (first, second)]
    assert [o.metrics.num_cached_prompt_tokens for o in outs] == [0, 16]
    records = check_budget(llm, 11)
    assert list(records["prefill_tokens"][:3]) == [11, 11, 3 + 6] and records.loc[2, "cached_tokens"] == 16
    assert_pool_clean(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_partially_prefilled_sequence_is_preempted_and_resumes(qwen3, preemption_mode):
    """Three prompts in an 8-block pool: the 30-token one is still being prefilled, 4 tokens a step beside two
    decodes, when the decodes need its blocks; it is preempted, and served again later."""
    path, hf = qwen3
    llm = make_llm(path, num_blocks=8, max_num_batched_tokens=6, max_num_seqs=3, preemption_mode=preemption_mode)
    partial, preempt = [], llm.scheduler._preempt

    def spy(seq, step):
        partial.append(seq.is_prefilling)
        preempt(seq, step)

    llm.scheduler._preempt = spy
    prompts = random_prompts(3, (13, 14, 30))
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
    assert partial and all(partial)
    records = check_budget(llm, 6)
    assert (records["blocks_swapped_out"].sum() > 0) == (preemption_mode == "swap")
    assert outs[2].metrics.num_preemptions == len(partial)
    assert_pool_clean(llm)


def test_triton_attention_serves_mixed_steps(llama):
    """paged_prefill takes decode rows as query length 1, so one kernel call serves a mixed step."""
    path, hf = llama
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=5, max_num_seqs=2)
    prompts = random_prompts(4, (3, 9))
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in prompts]
    assert (check_budget(llm, 5)["kind"] == "mixed").any()
    assert_pool_clean(llm)


def test_a_failure_in_a_mixed_step_aborts_only_its_request(llama):
    path, hf = llama
    llm = make_llm(path, max_num_batched_tokens=6, max_num_seqs=2)
    prompts = random_prompts(5, (4, 14))
    ids = [llm.add_request(p, SamplingParams(max_tokens=5, **GREEDY)) for p in prompts]
    culprit = llm._loop.requests[ids[1]]
    forward = llm.runner.forward

    def flaky(step, entries):  # the long prompt's second chunk, beside the first request's decode
        if step.kind == "mixed" and any(e.seq is culprit.seqs[0] and e.start > 0 for e in entries):
            raise RuntimeError("injected mixed-step failure")
        return forward(step, entries)

    llm.runner.forward = flaky
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
    assert outs[ids[0]].outputs[0].token_ids == hf_greedy(hf, prompts[0], 5)
    assert outs[ids[1]].outputs[0].finish_reason == "abort"
    assert "injected mixed-step failure" in outs[ids[1]].outputs[0].abort_reason
    assert (llm.step_dataframe()["kind"] == "mixed").any()
    assert_pool_clean(llm)


def test_v0_scheduling_is_kept(llama):
    path, hf = llama
    llm = make_llm(path, scheduling="v0", max_num_batched_tokens=30, max_num_seqs=3)
    prompts = random_prompts(6, (5, 19))
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in prompts]
    records = llm.step_dataframe()
    assert list(records["kind"]) == ["prefill", "decode", "decode"] and records.loc[0, "prefill_tokens"] == 24
    assert_pool_clean(llm)
