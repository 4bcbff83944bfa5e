"""The capstone (``kvlab.course.engine_with``, ``check_engine``): SmolLM2-135M served with every puzzle's solution
plugged into the engine gives Hugging Face's greedy tokens exactly, as kvlab's own parts do, on chat prompts
sharing their system prompt (prefix hits) with n-gram speculation on; a wrong part is named, by its puzzle's
check before any model loads, by serving with one learner part at a time when the engine's tokens differ, or at
once where the engine checks a part's answer (an admission other than kvlab's, in either scheduler)."""

import random

import sys
from pathlib import Path

import pytest
import torch

from kvlab.blocks import AllocStatus, Sequence
from kvlab.blocks.manager import KVCacheManager
from kvlab.course import check_engine, engine_with
from kvlab.course.capstone import FLEET_PARTS, PARTS, QUESTIONS, _tiny_model, describe
from kvlab.engine.parts import EngineParts
from kvlab.errors import InvalidArgumentError, LearnerPartError
from kvlab.puzzles import puzzle
from kvlab.puzzles.solutions.decode_attention import decode_attention

sys.path.insert(0, str(Path(__file__).parents[1] / "puzzles"))
from wrong_solutions import (attends_to_whole_blocks, caches_the_key_as_the_value_too,  # noqa: E402
                             admits_whole_prompts_only, copies_every_written_block, copies_keys_only,
                             drops_a_block_being_promoted, every_partition_from_block_zero, never_copies,
                             preempts_the_oldest_waiting, promotes_past_the_last_token, releases_a_block_still_seen,
                             uses_first_to_last)
from wrong_solutions import (CountsBlocksAsTokens, FirstOfEquals, admits_strictly_above_watermark,  # noqa: E402
                             admits_without_watermark)

SOLUTIONS = {name: puzzle(name).solution() for name in PARTS}


def slots_off_by_one(table, bs, start, end):
    return [table[p // bs] * bs + p % bs + 1 for p in range(start, end)]


def decode_attention_without_the_last_block(query, kv_cache, block_tables, seq_lens, scale):
    """A plausible slip: the last block of a sequence is left out (its length rounded down to whole blocks)."""
    bs = kv_cache.shape[2]
    whole = torch.clamp(seq_lens // bs * bs, min=1).to(seq_lens.dtype)
    return decode_attention(query, kv_cache, block_tables, whole, scale)


def verify_without_return(drafts, draft_probs, target_probs, uniforms, sample):
    kept = []
    for i, draft in enumerate(drafts):
        if uniforms[i] * draft_probs[i][draft] > target_probs[i][draft]:
            break
        kept.append(draft)
    kept.append(sample(target_probs[len(kept)]))  # forgot "return kept"


@pytest.mark.slow
def test_every_solution_plugged_in_gives_hf_greedy_tokens():
    run = check_engine(SOLUTIONS)
    assert run.matches and len(run.tokens) == 2 and all(run.tokens)
    assert run.cached_prompt_tokens[1] > 0  # the second prompt hit the first one's system-prompt blocks
    assert run.accepted_drafts[0] > 0  # the first answer quotes its question: drafts proposed and accepted
    assert run.abort_reasons == [None, None]
    assert len(run.kernels) == 2  # the Triton parts with every other part on the tiny model, once per decode path
    for kernels in run.kernels:
        assert kernels.matches and kernels.cached_prompt_tokens == [0, 0, 32, 32]  # two samples per prompt
        assert kernels.abort_reasons == [None] * 4
    assert run.forks.matches and run.forks.tokens[0] != run.forks.tokens[1]  # seeded samples: forks that diverge
    assert run.windowed.matches and run.windowed.abort_reasons == [None] * 4  # the sliding-window model
    # The routed fleet: each follow-up's first one goes where its prefix is cached, the second where no queue is.
    assert run.fleet.matches and run.fleet.cached_prompt_tokens == [0, 0, 32, 0, 32, 0, 0]


@pytest.mark.slow
def test_kvlabs_own_parts_give_hf_greedy_tokens(capsys):
    run = check_engine(None)
    assert run.matches and run.cached_prompt_tokens[1] > 0
    assert capsys.readouterr().out.count("your parts: none; kvlab's own parts (not given): slot_mapping") == 1


def test_a_part_failing_its_puzzle_check_is_named_before_any_model_loads():
    parts = {**SOLUTIONS, "slot_mapping": slots_off_by_one}
    with pytest.raises(LearnerPartError, match=r"^slot_mapping fails its puzzle's check.*block_table="):
        engine_with(parts)


@pytest.mark.slow
def test_a_wrong_part_that_passes_no_check_is_named_by_the_engines_tokens():
    parts = {"prefill_attention": SOLUTIONS["prefill_attention"],
             "decode_attention": decode_attention_without_the_last_block}
    with pytest.raises(LearnerPartError, match=r"^decode_attention is wrong: on question \d the engine's greedy "
                                               r"tokens differ from Hugging Face's"):
        check_engine(parts, check=False, max_tokens=6)  # the first decode step reads a partial last block


def merges_by_averaging(partial_out, partial_max, partial_sum, num_partitions):
    """A plausible slip: every partition weighs the same, whatever its share of the whole softmax."""
    return torch.stack([partial_out[s, :int(n)].mean(0) for s, n in enumerate(num_partitions)])


@pytest.mark.slow
def test_a_wrong_split_k_merge_is_named_by_the_engines_tokens():
    with pytest.raises(LearnerPartError, match=r"^split_k_merge is wrong: on question \d"):
        check_engine({"split_k_merge": merges_by_averaging}, check=False, max_tokens=6)


@pytest.mark.slow
def test_a_split_k_decode_computes_its_partitions_by_the_learners_decode_attention():
    parts = {"split_k_merge": SOLUTIONS["split_k_merge"], "decode_attention": decode_attention_without_the_last_block}
    with pytest.raises(LearnerPartError, match=r"^decode_attention is wrong"):
        check_engine(parts, check=False, max_tokens=6)


@pytest.mark.slow
@pytest.mark.parametrize("name, kernel", [("triton_reshape_and_cache", caches_the_key_as_the_value_too),
                                          ("triton_decode_attention", attends_to_whole_blocks),
                                          ("triton_split_k_decode", every_partition_from_block_zero),
                                          ("triton_copy_blocks", copies_keys_only)])
def test_a_wrong_triton_kernel_is_named_by_the_tiny_models_tokens(name, kernel):
    parts = {"prefill_attention": SOLUTIONS["prefill_attention"], name: kernel}
    with pytest.raises(LearnerPartError, match=rf"^{name} is wrong: on sample \d the engine's greedy tokens differ"):
        check_engine(parts, check=False, max_tokens=6)


@pytest.mark.slow
def test_a_copy_on_write_plan_that_never_copies_is_named_by_seeded_samples():
    """Greedy, both samples of a fork write the same K/V, so a missing copy changes no token; sampled, they
    differ, and one reads the K/V the other wrote into their shared block."""
    with pytest.raises(LearnerPartError, match=r"^copy_on_write is wrong: on sample \d the engine's tokens differ "
                                               r"from kvlab's own engine's \(seed 1\)"):
        check_engine({"copy_on_write": never_copies}, check=False, max_tokens=6)


@pytest.mark.slow
def test_a_window_release_freeing_a_block_still_seen_is_named_by_the_windowed_models_tokens():
    with pytest.raises(LearnerPartError, match=r"^window_release is wrong: on sample \d the engine's greedy tokens "
                                               r"differ .*aborted: sampling failed"):
        check_engine({"window_release": releases_a_block_still_seen}, check=False, max_tokens=6)


def _group(window):
    from kvlab.blocks.kv_cache_groups import spec_for
    from kvlab.sizing.groups import KVCacheGroupSpec

    return KVCacheGroupSpec(spec_for(window), (0, 1), 16, 2, 32, "float32")


def test_window_release_needs_a_window_and_attention_parts_none():
    from kvlab.engine.parts import check_model_for_parts

    with pytest.raises(InvalidArgumentError, match="window_release releases a sliding window's blocks; smollm2 has "
                                                   "no window"):
        check_model_for_parts(EngineParts(window_release=SOLUTIONS["window_release"]), [_group(None)], "smollm2")
    with pytest.raises(InvalidArgumentError, match="for parts other than attention, a sliding window"):
        check_model_for_parts(EngineParts(decode_attention=decode_attention), [_group(16)], "windowed")


@pytest.mark.slow
@pytest.mark.parametrize("router, request_index, views", [
    (CountsBlocksAsTokens, 4, "replica 0: 0 blocks cached, 37 tokens waiting, 1 in flight; replica 1: 2 blocks "
                              "cached, 41 tokens waiting, 1 in flight"),
    (FirstOfEquals, 6, "replica 0: 0 blocks cached, 0 tokens waiting, 0 in flight; replica 1: 0 blocks cached")])
def test_a_wrong_router_is_named_at_its_first_choice_other_than_kv_costs(router, request_index, views):
    with pytest.raises(LearnerPartError, match=rf"^kv_cost_router chose 0 .* expected replica 1; it saw "
                                               rf"{views}.*\(request {request_index} of the fleet\)"):
        check_engine({"kv_cost_router": router}, check=False, max_tokens=6)


@pytest.mark.slow
def test_a_copy_on_write_plan_that_would_corrupt_the_pool_is_refused():
    with pytest.raises(LearnerPartError, match=r"^copy_on_write\(\[.*returned .*: a copy of a block this sequence "
                                               r"holds alone \(write it in place\)"):
        check_engine({"copy_on_write": copies_every_written_block}, check=False, max_tokens=6)


@pytest.mark.slow
def test_a_part_breaking_its_contract_in_the_engine_is_named_in_the_abort_reason():
    with pytest.raises(LearnerPartError, match=r"rejection_sampling is wrong.*aborted: .*rejection_sampling "
                                               r"returned None .*expected the accepted drafts"):
        check_engine({"rejection_sampling": verify_without_return}, check=False)


def test_the_call_says_which_parts_fall_back_to_kvlabs(capsys):
    llm = engine_with({"slot_mapping": SOLUTIONS["slot_mapping"], "lru_policy": SOLUTIONS["lru_policy"]})
    said = capsys.readouterr().out
    assert ("your parts: slot_mapping, lru_policy; kvlab's own parts (not given): block_hashes, copy_on_write, "
            "window_release, decode_attention, prefill_attention, ngram_proposer, rejection_sampling") in said
    assert llm.parts.slot_mapping is SOLUTIONS["slot_mapping"] and llm.parts.decode_attention is None
    assert describe({}).endswith(f"kvlab's own parts (not given): {', '.join(PARTS)}")
    assert describe({"can_allocate": SOLUTIONS["can_allocate"]}).endswith(
        "v1_step, kv_cost_router; with your can_allocate the pool keeps a watermark of free blocks at admission "
        "(kvlab.engine.parts.ADMISSION_WATERMARK)")


def test_every_part_of_the_engine_is_a_puzzle():
    assert PARTS == EngineParts.names() + FLEET_PARTS
    assert all(puzzle(name).name == name for name in PARTS)


def test_parts_are_checked_at_the_boundary():
    with pytest.raises(InvalidArgumentError, match=r"unknown part 'slot_maping'; the parts are: slot_mapping, "
                                                   r"block_hashes, lru_policy"):
        engine_with({"slot_maping": SOLUTIONS["slot_mapping"]})
    with pytest.raises(InvalidArgumentError, match=r"'lru_policy' must be your solution .* got int"):
        engine_with({"lru_policy": 3})
    with pytest.raises(InvalidArgumentError, match="parts must be a dict"):
        engine_with([SOLUTIONS["slot_mapping"]])


class Spy:
    """A part that records every call's arguments and answer."""

    def __init__(self, part):
        self.part, self.calls = part, []

    def __call__(self, *args):
        answer = self.part(*args)
        self.calls.append((*args, answer))
        return answer


@pytest.mark.slow
def test_a_learners_can_allocate_admits_and_defers_the_waiting_prompts():
    spy = Spy(SOLUTIONS["can_allocate"])
    run = check_engine({"can_allocate": spy}, check=False)  # the puzzle's check would call it too
    assert run.matches and run.cached_prompt_tokens == [0, 16]
    first, second = (len(p) for p in run.prompt_token_ids)  # 49 and 35 tokens: 4 blocks, then a hit and 2 more
    assert spy.calls[0] == (first, 16, 8, 8, 0.5, AllocStatus.OK)  # 8 - 4 = 4 blocks left: exactly the watermark
    assert spy.calls[1] == (second - 16, 16, 4, 8, 0.5, AllocStatus.LATER)  # its hit is in use: 2 new blocks
    # Admitted once the first one finished: its hit was free and cached, taken back out of the 8 free blocks.
    assert spy.calls[-1] == (second - 16, 16, 7, 8, 0.5, AllocStatus.OK)
    assert {call[-1] for call in spy.calls[2:-1]} == {AllocStatus.LATER}


@pytest.mark.slow
@pytest.mark.parametrize("wrong, admitting, expected", [
    (admits_without_watermark, 19, r"OK, expected AllocStatus.LATER"),
    (admits_strictly_above_watermark, 49, r"LATER, expected AllocStatus.OK")])
@pytest.mark.parametrize("scheduling", ["v1", "v0"])
def test_a_wrong_can_allocate_is_named_where_the_engine_admits(wrong, admitting, expected, scheduling):
    options = {} if scheduling == "v1" else dict(scheduling="v0", speculative_config=None)
    with pytest.raises(LearnerPartError, match=rf"^can_allocate\(num_tokens={admitting}, block_size=16, "
                                               rf"num_free_blocks=\d, num_blocks=8, watermark=0.5\) returned "
                                               rf"AllocStatus.{expected}: admitting sequence"):
        check_engine({"can_allocate": wrong}, check=False, max_tokens=6, **options)


def test_kvlabs_never_stands_where_the_spec_cannot_see_the_whole_prompt():
    """A first chunk that fits, of a prompt that never can: the spec sees the chunk (OK), kvlab the prompt."""
    parts = EngineParts(can_allocate=Spy(SOLUTIONS["can_allocate"]))
    manager = KVCacheManager(8, 16, **parts.block_manager_options())
    seq = Sequence(range(100), 16)
    hit = manager.lookup(seq)
    status = manager.can_allocate(seq, num_new_tokens=16, hit=hit)
    assert status is AllocStatus.NEVER
    assert parts.admit(manager, seq, hit, 16, status) is AllocStatus.NEVER
    assert parts.can_allocate.calls == [(16, 16, 8, 8, 0.5, AllocStatus.OK)]


def test_on_the_numbers_the_learner_is_given_the_spec_answers_as_kvlabs_can_allocate():
    """Pools partly held by prompts sharing prefixes, some freed again (their hits free and cached), and prompts
    admitted whole or by a first chunk: the solution, asked about the tokens after the hit and the blocks free
    once the hit's free ones are taken back, says what kvlab says (save kvlab's NEVER, which stands)."""
    parts = EngineParts(can_allocate=SOLUTIONS["can_allocate"])
    rng = random.Random(0)
    answers = set()
    for _ in range(300):
        bs, num_blocks = rng.choice((1, 4, 16)), rng.randint(4, 40)
        manager = KVCacheManager(num_blocks, bs, **parts.block_manager_options())
        shared = [rng.randrange(3) for _ in range(8 * bs)]
        held = []
        for _ in range(rng.randint(0, 5)):
            seq = Sequence(shared[:rng.randint(0, 6 * bs)] + [rng.randrange(4) for _ in range(rng.randint(1, 3 * bs))],
                           bs)
            if manager.can_allocate(seq) is AllocStatus.OK:
                seq.start_running(manager.allocate(seq))
                held.append(seq)
        for seq in rng.sample(held, rng.randint(0, len(held))):
            manager.free(seq)
        prompt = Sequence(shared[:rng.randint(1, 8 * bs)], bs)
        hit = manager.lookup(prompt)
        num_new = rng.choice((None, rng.randint(1, prompt.num_tokens - hit.num_tokens)))
        status = manager.can_allocate(prompt, num_new_tokens=num_new, hit=hit)
        assert parts.admit(manager, prompt, hit, num_new, status) is status
        answers.add(status)
    assert answers == set(AllocStatus)


@pytest.mark.slow
def test_a_learners_tier_promotion_orders_the_tier_when_the_second_question_promotes_its_system_prompt():
    spy = Spy(SOLUTIONS["tier_promotion"])
    run = check_engine({"tier_promotion": spy}, check=False)
    assert run.matches and run.cached_prompt_tokens == [0, 16]
    first, second = (len(p) for p in run.prompt_token_ids)
    assert [call[2] for call in spy.calls] == [first, 113, second]  # the filler: 8 blocks, its token in the last
    *_, (tier, num_slots, _, _, hashes, num_gpu_hits, overwritten, (promoted, order)) = spy.calls
    # The filler evicted the first question's blocks to the tier; the second's system-prompt block is not on the
    # GPU any more, but in the tier, and is promoted back.
    assert num_slots == 8 and num_gpu_hits == 0 and hashes[0] in tier and promoted == [hashes[0]]
    # 3 new blocks (the promoted one first, 35 tokens); the prompt's first block ends the most recently used
    assert len(overwritten) == 3 and order[-1] == hashes[0]


def run_tier_prompts(part, last=(1, 2, 3, 4, 5, 6, 7)) -> list:
    """Three prompts through a manager of 4 blocks of 2 tokens with a learner's tier_promotion and an offload
    tier of 3 slots: the second evicts the first's blocks to the tier, the third (``last``) finds them all
    there and promotes them, the last token's block excepted. Returns the tier's order after each admission."""
    manager = KVCacheManager(4, 2, num_offload_blocks=3,
                             **EngineParts(tier_promotion=part).block_manager_options())
    orders = []
    for tokens in ([1, 2, 3, 4, 5, 6, 7], [9, 9, 8, 8, 7, 7, 6], list(last)):
        seq = Sequence(tokens, 2)
        manager.allocate(seq)
        orders.append(list(manager._tier.order.resident()))
        manager.free(seq)
    return orders


def test_the_tier_keeps_the_learners_order_after_each_admission():
    spy = Spy(SOLUTIONS["tier_promotion"])
    orders = run_tier_prompts(spy, last=(1, 2, 3, 4, 5, 6))
    assert [call[-1][1] for call in spy.calls] == orders
    assert [call[-1][0] for call in spy.calls][2] == spy.calls[2][4][:2]  # two promoted: the last token's block is not


@pytest.mark.parametrize("wrong, last, problem", [
    (promotes_past_the_last_token, (1, 2, 3, 4, 5, 6), r"promoted \[\d+, \d+, \d+\], but the tier promoted "
                                                       r"\[\d+, \d+\]"),
    (uses_first_to_last, (1, 2, 3, 4, 5, 6, 7), r"tier \[.*\]: expected \[.*\] \(least recently used first\)"),
    (drops_a_block_being_promoted, (1, 2, 3, 4, 5, 6, 7),
     r"tier \[.*\]: expected \[.*\] \(least recently used first\)")])
def test_a_wrong_tier_promotion_is_named_where_the_manager_admits(wrong, last, problem):
    with pytest.raises(LearnerPartError, match=rf"^tier_promotion\(tier=\[.*\], num_slots=3, "
                                               rf"num_tokens={len(last)}, block_size=2, .*\) returned .*: {problem}$"):
        run_tier_prompts(wrong, last)


def test_the_call_says_a_learners_tier_promotion_brings_an_offload_tier():
    assert describe({"tier_promotion": SOLUTIONS["tier_promotion"]}).endswith(
        "kv_cost_router; with your tier_promotion the engine has an LRU offload tier, kept in your answer's order")


def test_a_learners_tier_promotion_needs_an_lru_offload_tier():
    with pytest.raises(InvalidArgumentError, match=r"order_tier \(a learner's tier_promotion\) needs an "
                                                    r"offload tier of its own"):
        KVCacheManager(4, 2, **EngineParts(tier_promotion=SOLUTIONS["tier_promotion"]).block_manager_options())


def test_a_learners_preemption_preempts_the_newest_request_and_recomputes_it():
    spy = Spy(SOLUTIONS["preemption"])
    run = check_engine({"preemption": spy}, check=False)  # the puzzle's check would call it too
    assert run.preemption.matches and run.preemption.abort_reasons == [None, None]
    # 13 blocks of 8: the second took the last free one, the first needs one: the second is preempted.
    assert ([7, 6], [True, False], 0, ([0], [1])) in spy.calls
    assert all(len(call[0]) == 2 for call in spy.calls)  # asked only while both decode: none waits


@pytest.mark.slow
def test_a_wrong_preemption_is_named_where_the_scheduler_preempts():
    # Three questions in 18 blocks: the first needs a block with none free and two requests behind it.
    questions = (*QUESTIONS, "Say hello.")
    with pytest.raises(LearnerPartError, match=r"^preemption\(blocks_held=\[7, 6, 5\], needs_block=\[True, False, "
                                               r"True\], num_free_blocks=0\) returned \(\[0, 2\], \[1\]\), "
                                               r"expected \(\[0, 1\], \[2\]\)"):
        check_engine({"preemption": preempts_the_oldest_waiting}, questions=questions, check=False, num_blocks=18)


@pytest.mark.parametrize("name", ["preemption", "v1_step"])
def test_the_v1_schedulers_parts_are_refused_by_a_v0_engine(name):
    with pytest.raises(InvalidArgumentError, match=rf"{name} is the V1 scheduler's .* scheduling is 'v0'"):
        engine_with({name: SOLUTIONS[name]}, check=False, verbose=False, scheduling="v0",
                    speculative_config=None, model=_tiny_model())


@pytest.mark.slow
def test_a_learners_v1_step_chunks_the_prompts_under_the_budget():
    spy = Spy(SOLUTIONS["v1_step"])
    run = check_engine({"v1_step": spy}, check=False)  # the puzzle's check would call it too
    assert run.v1_step.matches and run.v1_step.abort_reasons == [None, None]
    # 24 tokens a step, two seats: the first prompt (49 tokens) in chunks of 24, 24 and 1, the second's first
    # chunk beside its last token.
    assert [call[:4] for call in spy.calls[:3]] == [([], [49, 35], 24, 2), ([25], [35], 24, 2), ([1], [35], 24, 2)]
    assert [call[-1] for call in spy.calls[:3]] == [([], [24]), ([24], []), ([1], [23])]


@pytest.mark.slow
def test_a_wrong_v1_step_is_named_where_the_scheduler_chunks():
    with pytest.raises(LearnerPartError, match=r"^v1_step\(running=\[\], waiting=\[49, 35\], token_budget=24, "
                                               r"max_num_seqs=2\) returned \(\[\], \[\]\), expected \(\[\], \[24\]\)"):
        check_engine({"v1_step": admits_whole_prompts_only}, check=False, max_tokens=6)
