"""One request's failure costs only that request: wherever a step fails for it (forward pass, sampling, fork,
stop check, unusable logits), it finishes with finish_reason "abort" and the error as its reason, and every
other request's output is what it would have been had the failing request never been sent."""

import re

import pytest

from engine_helpers import assert_pool_clean, hf_greedy, make_llm
from kvlab.engine import SamplingParams

BASE = [9, 4, 33, 61, 2, 87, 15, 70, 5, 48, 26, 93, 11, 57, 38, 80]  # two full blocks of 8
OTHERS = [  # greedy, seeded sampling with n = 2, greedy on the prefix the culprit shares
    ([5, 17, 99, 3, 64, 23, 8, 41, 77, 12, 90, 31, 6], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
    ([7, 7, 1, 100], SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=5, max_tokens=4, ignore_eos=True)),
    (BASE + [1, 2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
]
CULPRIT = (BASE + [3, 4, 5], SamplingParams(n=2, temperature=0.7, seed=9, max_tokens=4, ignore_eos=True))


def run_all(llm) -> dict:
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
    return outs


def samples(out):
    return [(c.token_ids, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def without_culprit(llama):
    llm = make_llm(llama[0])
    ids = [llm.add_request(prompt, params) for prompt, params in OTHERS]
    outs = run_all(llm)
    return [samples(outs[i]) for i in ids]


def fail_sampling(llm, culprit):
    """The sampler raises for the culprit's rows from its second step on, after drawing the batch's noise."""
    sampler = llm._loop.sampler

    def flaky(logits, params, generators):
        tokens = sampler(logits, params, generators)
        if any(p is culprit.params for p in params) and culprit.metrics.num_generated_tokens >= 2:
            raise RuntimeError("injected sampling failure")
        return tokens

    llm._loop.sampler = flaky
    flaky.generator = sampler.generator


def fail_stop_check(llm, culprit):
    def broken(seq, eos_token_ids, max_model_len):
        raise RuntimeError("injected stop-check failure")

    culprit.stop_check = broken


def fail_fork(llm, culprit):
    fork = llm.block_manager.fork

    def flaky(parent, child):
        if parent is culprit.seqs[0]:
            raise RuntimeError("injected fork failure")
        return fork(parent, child)

    llm.block_manager.fork = flaky


def fail_forward(kind):
    def inject(llm, culprit):
        forward = llm.runner.forward

        def flaky(step, entries):
            if step.kind == kind and any(e.seq in culprit.seqs for e in entries):
                raise RuntimeError(f"injected {kind} failure")
            return forward(step, entries)

        llm.runner.forward = flaky
    return inject


def nan_logits(llm, culprit):
    forward = llm.runner.forward

    def broken(step, entries):
        logits = forward(step, entries).clone()  # an inference-mode tensor cannot be written in place
        rows = [i for i, e in enumerate(entries) if e.seq in culprit.seqs]
        if step.kind == "decode":
            logits[rows] = float("nan")
        return logits

    llm.runner.forward = broken


@pytest.mark.parametrize("inject, reason", [
    (fail_sampling, r"sampling failed for this sequence: RuntimeError\('injected sampling failure'\)"),
    (fail_stop_check, r"the stop check failed for this sequence: RuntimeError\('injected stop-check failure'\)"),
    (fail_fork, r"forking its samples failed: RuntimeError\('injected fork failure'\)"),
    (fail_forward("prefill"), r"the forward pass failed for this sequence: RuntimeError\('injected prefill"),
    (fail_forward("decode"), r"the forward pass failed for this sequence: RuntimeError\('injected decode"),
    (nan_logits, r"sampling failed for this sequence: FloatingPointError\(.*NaN"),
], ids=["sampling", "stop check", "fork", "forward prefill", "forward decode", "NaN logits"])
def test_a_failing_request_leaves_every_other_output_as_it_was(llama, without_culprit, inject, reason):
    llm = make_llm(llama[0])
    ids = [llm.add_request(prompt, params) for prompt, params in [CULPRIT] + OTHERS]
    inject(llm, llm._loop.requests[ids[0]])
    outs = run_all(llm)
    assert [samples(outs[i]) for i in ids[1:]] == without_culprit
    culprit = outs[ids[0]].outputs
    assert [c.finish_reason for c in culprit] == ["abort", "abort"]
    assert all(re.search(reason, c.abort_reason) for c in culprit)
    assert_pool_clean(llm)


def test_a_prefill_that_hit_a_failed_sequences_blocks_is_prefilled_again_without_them(llama):
    """The sharer hit the culprit's two prefix blocks in the culprit's own prefill step, which then failed for
    the culprit: those blocks hold no K/V. The sharer goes back to the queue; nothing is admitted until the
    running request finishes and the prefix cache is reset; then the sharer is computed from scratch."""
    path, hf = llama
    llm = make_llm(path)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    culprit_id = llm.add_request(BASE + [3, 4, 5], greedy)
    sharer_id = llm.add_request(BASE + [1, 2], greedy)
    other_id = llm.add_request([5, 17, 99], greedy)
    fail_forward("prefill")(llm, llm._loop.requests[culprit_id])
    outs = run_all(llm)
    assert outs[culprit_id].outputs[0].finish_reason == "abort"
    sharer = outs[sharer_id]
    assert sharer.outputs[0].token_ids == hf_greedy(hf, BASE + [1, 2], 3)
    assert sharer.metrics.num_cached_prompt_tokens == 0
    assert outs[other_id].outputs[0].token_ids == hf_greedy(hf, [5, 17, 99], 3)
    records = llm.step_dataframe()
    assert list(records["kind"]) == ["prefill", "decode", "decode", "prefill", "decode", "decode"]
    assert list(records["num_seqs"]) == [3, 1, 1, 1, 1, 1]
    late, = llm.generate([BASE + [7]], greedy, use_tqdm=False)  # the cache works again: the sharer's blocks
    assert late.metrics.num_cached_prompt_tokens == 16
    assert_pool_clean(llm)


def test_a_forward_pass_that_fails_for_everyone_aborts_each_request_with_the_error(llama, monkeypatch):
    llm = make_llm(llama[0])
    prompt = list(range(1, 20))
    ids = [llm.add_request(prompt, SamplingParams(max_tokens=2)), llm.add_request([3, 4], SamplingParams(n=2))]

    def broken(kind, seqs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.runner, "forward", broken)
    outs = llm.step()  # scheduled: the prompts' blocks were allocated (and made hittable) but never written
    assert [o.request_id for o in outs] == ids
    assert all(c.finish_reason == "abort" and "RuntimeError('device lost')" in c.abort_reason
               for o in outs for c in o.outputs)
    assert_pool_clean(llm)
    monkeypatch.undo()
    out, = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.metrics.num_cached_prompt_tokens == 0  # the unwritten blocks were not hit
    assert_pool_clean(llm)
