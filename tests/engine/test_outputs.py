"""Every request's output is returned exactly once: by the generate() call that added it, else by step() (the
step of its finish, or the next one when it finished between steps or inside another call)."""

import pytest

from engine_helpers import assert_pool_clean, make_llm
from kvlab.engine import SamplingParams
from kvlab.errors import InvalidArgumentError

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_generate_runs_earlier_requests_in_its_batch_and_step_returns_their_outputs(llama):
    llm = make_llm(llama[0])
    alone = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    first = len(llm.step_records)
    earlier = llm.add_request([4, 5, 6], SamplingParams(max_tokens=2, **GREEDY))
    out, = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert out.request_id != earlier and len(out.outputs[0].token_ids) == 4
    assert llm.step_records[first].num_seqs == 2  # one batch
    assert llm.has_unfinished_requests()  # finished, its output not returned yet
    kept, = llm.step()  # returned although nothing is queued
    assert kept.request_id == earlier and kept.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.step() == [] and not llm.has_unfinished_requests()
    assert len(llm.step_records) == first + 4  # no step ran to return it
    assert_pool_clean(llm)


def test_generate_that_raises_leaves_its_finished_outputs_to_step(llama, monkeypatch):
    llm = make_llm(llama[0])
    sampler, calls = llm._loop.sampler, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return sampler(*args)

    interrupted.generator = sampler.generator
    monkeypatch.setattr(llm._loop, "sampler", interrupted)
    ids = [str(i) for i in range(2)]
    with pytest.raises(KeyboardInterrupt):  # the first prompt finishes in step 1, step 2 is interrupted
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=3)],
                     use_tqdm=False)
    outs = llm.step()
    assert [o.request_id for o in outs] == ids
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort"]
    assert_pool_clean(llm)


def test_an_aborted_request_is_returned_by_the_next_step(llama):
    llm = make_llm(llama[0])
    running = llm.add_request([1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))
    forked = llm.add_request([4, 5], SamplingParams(n=3, max_tokens=5, **GREEDY))
    llm.step()
    llm.abort_request(running)
    llm.abort_request(running)  # twice: one output
    llm.abort_request("no such request")  # unknown: ignored
    out, = llm.step()
    assert out.request_id == running and out.finished and len(out.outputs[0].token_ids) == 1
    assert (out.outputs[0].finish_reason, out.outputs[0].abort_reason) == ("abort", "aborted by the caller")
    llm.abort_request(forked)
    assert llm.has_unfinished_requests()
    out, = llm.step()  # nothing else is queued
    assert out.request_id == forked and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not llm.has_unfinished_requests() and llm.step() == []
    with pytest.raises(InvalidArgumentError, match="request_id must be a string, got int"):
        llm.abort_request(0)
    assert_pool_clean(llm)


def test_a_request_id_stays_taken_until_its_output_is_returned(llama):
    llm = make_llm(llama[0])
    llm.add_request([1, 2], request_id="1")
    llm.abort_request("1")
    with pytest.raises(InvalidArgumentError, match="output step\\(\\) has not returned yet.*'1'"):
        llm.add_request([1, 2], request_id="1")
    assert llm.add_request([3], SamplingParams(max_tokens=1)) == "0"
    assert llm.add_request([3], SamplingParams(max_tokens=1)) == "2"  # "1" is skipped: its output is pending
    assert sorted(o.request_id for o in llm.step()) == ["0", "1", "2"]
    llm.add_request([1, 2], SamplingParams(max_tokens=1), request_id="1")  # free again
    assert [o.request_id for o in llm.generate([], use_tqdm=False)] == []
    assert [o.request_id for o in llm.step()] == ["1"]
    assert_pool_clean(llm)
