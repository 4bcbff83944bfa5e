"""n > 1: the samples are forks of the prompt's sequence (shared blocks), and the copy-on-write pairs from
``append_slots`` are applied with ``copy_blocks`` before the step's attention."""

from engine_helpers import assert_pool_clean, hf_greedy, make_llm
from kvlab.engine import SamplingParams

PROMPT = [5, 17, 99, 3, 64, 23, 8, 41, 77, 12, 90, 31, 6]  # 13 tokens: one full block of 8 and a partial one


def test_n4_greedy_gives_four_copies_and_applies_cow(llama):
    path, hf = llama
    llm = make_llm(path)
    request_id = llm.add_request(PROMPT, SamplingParams(n=4, temperature=0.0, max_tokens=5, ignore_eos=True))
    llm.step()  # prefill, then the fork: four sequences on the prompt's two blocks
    seqs = llm.scheduler.running
    assert len(seqs) == 4
    tables = [llm.block_manager.get_block_table(s) for s in seqs]
    assert all(t == tables[0] for t in tables)
    assert [llm.block_manager.ref_count(b) for b in tables[0]] == [4, 4]
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
    expected = hf_greedy(hf, PROMPT, 5)
    out = outs[request_id]
    assert [c.token_ids for c in out.outputs] == [expected] * 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    records = llm.step_dataframe()
    # The first decode writes position 13 into the shared partial block: three samples copy it, the last one
    # (then its only owner) writes in place. The full block stays shared.
    assert records.loc[1, "kind"] == "decode" and records.loc[1, "cow_copies"] == 3
    assert records["cow_copies"].sum() == 3
    assert out.metrics.num_generated_tokens == 20
    assert_pool_clean(llm)


def test_n4_sampling_gives_different_samples_sharing_the_prompt(qwen3):
    path, _ = qwen3
    llm = make_llm(path)
    out, = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=11, ignore_eos=True),
                        use_tqdm=False)
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) > 1 and all(len(s) == 4 for s in samples)
    assert_pool_clean(llm)
