"""Qwen3 models with sliding-window layers: a mix of sliding and full attention (KV cache groups on one pool,
as vLLM groups them: 2 sliding layers and 1 full are 3 groups of one layer sharing one cache tensor) and
all-sliding ones (one windowed group), checked token for token against HF greedy generation, which applies
the window itself. Window 8 and blocks of 4, so prompts and outputs run far past the window and blocks leave
it."""

import random

import pytest

from engine_helpers import hf_greedy, make_llm, save_tiny_model
from kvlab.engine import PromptTooLongError, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
WINDOW, BLOCK = 8, 4
LAYER_TYPES = {"mixed": ["sliding_attention", "full_attention", "sliding_attention"],
               "sliding": ["sliding_attention"] * 2}
SEEDS = {"mixed": 1, "sliding": 0}  # weights whose greedy choices on these prompts are all clear-cut


@pytest.fixture(scope="module", params=sorted(LAYER_TYPES))
def windowed(request, tmp_path_factory):
    """(kind, model directory, the HF model saved there)."""
    kind, path = request.param, tmp_path_factory.mktemp(f"qwen3_{request.param}")
    hf = save_tiny_model("qwen3", path, seed=SEEDS[kind], use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=LAYER_TYPES[kind], num_hidden_layers=len(LAYER_TYPES[kind]))
    return kind, path, hf


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)  # token 0 is the oracle's pad token: left out
    return [[rng.randrange(1, 128) for _ in range(n)] for n in lengths]


def check_matches_hf(llm, hf, batch, max_tokens):
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, max_tokens)
    llm.block_manager.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks - 1  # block 0: a window's null block
    return outs


@pytest.mark.parametrize("settings", [
    dict(scheduling="v1", max_num_batched_tokens=7, max_num_seqs=3),  # chunks that end inside blocks
    dict(scheduling="v1", max_num_batched_tokens=1, max_num_seqs=1),  # one token a step
    dict(scheduling="v0", max_num_batched_tokens=64, max_num_seqs=3),               # whole prompts past the window
])
def test_greedy_matches_hf(windowed, settings):
    kind, path, hf = windowed
    llm = make_llm(path, block_size=BLOCK, num_blocks=64, **settings)
    assert (len(llm.block_manager.groups) > 1) == (kind == "mixed")  # one KV cache group per layer kind
    check_matches_hf(llm, hf, prompts(1, (5, 19, 30)), 14)


def test_prefix_hits_match_hf(windowed):
    kind, path, hf = windowed
    llm = make_llm(path, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=9, max_num_seqs=2)
    first, tail = prompts(2, (21, 6))
    check_matches_hf(llm, hf, [first], 5)
    out, = check_matches_hf(llm, hf, [first[:16] + tail], 9)
    assert out.metrics.num_cached_prompt_tokens == 16  # every group serves the shared blocks


@pytest.mark.parametrize("scheduling", ["v1", "v0"])
def test_preemption_by_recompute_matches_hf(windowed, scheduling):
    kind, path, hf = windowed
    if kind != "mixed":
        pytest.skip("an all-sliding sequence holds a window's blocks at most: decodes never outgrow the pool")
    llm = make_llm(path, block_size=BLOCK, num_blocks=20, scheduling=scheduling, max_num_batched_tokens=32,
                   max_num_seqs=4)
    check_matches_hf(llm, hf, prompts(3, (12, 17, 9, 22)), 24)
    assert llm.step_dataframe()["preempted"].sum() > 0


# The longest prompt a pool serves needs every usable block (the pool's, less block 0: the windows' null block),
# and one token more needs more. mixed: 2 sliding layers and 1 full are 3 KV cache groups of one layer (vLLM's
# grouping), and each group holds every prompt block while a whole prompt is prefilled (8 tokens: 2 + 2 + 2 of 6
# usable blocks, 9 tokens: 3 + 3 + 3); with 4-token chunks a window group holds 3 blocks at most (16 tokens:
# 4 + 3 + 3 of 10). sliding: one group, 7 blocks of 4 of 7. A pool that the prompt fills leaves no room to
# decode, except in the sliding model, whose window moves on.
LONGEST_FITTING = [  # (model, settings, num_blocks, longest prompt, blocks one token more needs, max_tokens)
    ("mixed", dict(scheduling="v1"), 7, 8, 9, 1), ("mixed", dict(scheduling="v0"), 7, 8, 9, 1),
    ("mixed", dict(scheduling="v1", max_num_batched_tokens=4), 11, 16, 11, 1),
    ("sliding", dict(scheduling="v1"), 8, 28, 8, 4)]


@pytest.mark.parametrize("kind, settings, num_blocks, longest, needed, max_tokens", LONGEST_FITTING)
def test_a_prompt_that_never_fits_is_refused_up_front_and_one_that_just_fits_is_served(
        windowed, kind, settings, num_blocks, longest, needed, max_tokens):
    """A prompt one token too long used to be queued, then aborted at its first step, told (for a 32-token
    prompt) "32 tokens need 8 blocks, more than the 8-block pool holds": the window group's blocks and the null
    block were left out."""
    model_kind, path, hf = windowed
    if model_kind != kind:
        pytest.skip("the other model")
    llm = make_llm(path, block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=1, **settings)
    fits, too_long = prompts(6, (longest, longest + 1))
    groups = " across the model's 3 KV cache groups" if kind == "mixed" else ""
    with pytest.raises(PromptTooLongError, match=f"the prompt has {longest + 1} tokens, which need {needed} blocks of "
                                                 f"4 at once{groups}; the KV pool holds only {num_blocks - 1} usable "
                                                 f"blocks of its {num_blocks}$"):
        llm.generate([fits, too_long], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    with pytest.raises(PromptTooLongError):
        llm.add_request(too_long)
    assert not llm.has_unfinished_requests()
    assert llm.block_manager.blocks_for_prompt(longest, settings.get("max_num_batched_tokens")) == num_blocks - 1
    out, = check_matches_hf(llm, hf, [fits], max_tokens)
    assert out.outputs[0].finish_reason == "length"


def test_a_sequence_that_outgrows_the_pool_is_told_what_the_pool_holds(windowed):
    """Its message used to count the null block as room: "more than the 7-block pool holds"."""
    kind, path, hf = windowed
    if kind != "mixed":
        pytest.skip("an all-sliding sequence holds a window's blocks at most: decodes never outgrow the pool")
    llm = make_llm(path, block_size=BLOCK, num_blocks=7)
    prompt, = prompts(6, (8,))  # 2 blocks in each of the 3 groups fill the 6 usable blocks; a decode needs more
    out, = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == hf_greedy(hf, prompt, 1)
    assert out.outputs[0].abort_reason == ("grew to 9 tokens, more than the KV pool holds for one sequence "
                                           "(6 usable blocks of its 7)")


def test_the_true_count_for_a_32_token_prompt(windowed):
    kind, path, _ = windowed
    llm = make_llm(path, block_size=BLOCK, num_blocks=8)
    needed = 24 if kind == "mixed" else 8  # each of the 3 groups holds the 8 blocks while the prompt is prefilled
    with pytest.raises(PromptTooLongError, match=f"32 tokens, which need {needed} blocks of 4 at once.*7 usable"):
        llm.generate([list(range(1, 33))], use_tqdm=False)


def test_sliding_blocks_are_released_as_they_leave_the_window(windowed):
    """60 tokens are 15 blocks of 4; the all-sliding model serves them from a pool of 6 (null block, the
    window's 2-3 blocks and the next one) without preemption: blocks leave the window as it moves."""
    kind, path, hf = windowed
    if kind != "sliding":
        pytest.skip("the full-attention group keeps every block")
    llm = make_llm(path, block_size=BLOCK, num_blocks=6, max_num_batched_tokens=4, max_num_seqs=1)
    check_matches_hf(llm, hf, prompts(4, (30,)), 30)
    assert llm.step_dataframe()["preempted"].sum() == 0


def test_triton_backend_matches_hf(windowed):
    kind, path, hf = windowed
    llm = make_llm(path, block_size=BLOCK, num_blocks=32, attention_backend="triton", max_num_batched_tokens=6,
                   max_num_seqs=1)
    check_matches_hf(llm, hf, prompts(5, (11,)), 6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swap_preemption_matches_hf(windowed, backend):
    """Every group's blocks go to the CPU pool and come back (one list of moves over all groups)."""
    kind, path, hf = windowed  # an all-sliding sequence holds a window's blocks at most: a smaller pool
    llm = make_llm(path, block_size=BLOCK, num_blocks=18 if kind == "mixed" else 6, preemption_mode="swap",
                   max_num_seqs=3, attention_backend=backend)
    check_matches_hf(llm, hf, prompts(8, (9, 10, 11)), 10)
    records = llm.step_dataframe()
    swapped = records["blocks_swapped_out"].sum()
    assert records["preempted"].sum() > 0 and swapped > 0 and records["blocks_swapped_in"].sum() == swapped


def test_forked_samples_match_hf(windowed):
    """n > 1: the samples share every group's blocks and copy a shared partial block on write."""
    kind, path, hf = windowed
    llm = make_llm(path, block_size=BLOCK, num_blocks=48, max_num_seqs=4)
    batch = prompts(9, (6, 13))
    outs = llm.generate(batch, SamplingParams(n=3, max_tokens=9, **GREEDY), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert [o.token_ids for o in out.outputs] == [hf_greedy(hf, prompt, 9)] * 3
    assert llm.step_dataframe()["cow_copies"].sum() > 0
    llm.block_manager.check_invariants()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks - 1


def test_a_prompt_alone_in_a_tight_pool_is_chunked_smaller_instead_of_aborted(windowed):
    """V1 with a budget of 7: a 21-token prompt needs 12 blocks at once in its 3 groups when its later chunks
    are small enough, which is why ``generate`` admits it with 12 usable blocks; a 7-token chunk of positions
    14-20 needs 16, and the sequence, alone, was aborted ("grew to 21 tokens ...") instead of taking a smaller
    chunk."""
    kind, path, hf = windowed
    if kind != "mixed":
        pytest.skip("the mixed model's full-attention group is what makes the pool tight")
    llm = make_llm(path, block_size=BLOCK, num_blocks=13, scheduling="v1", max_num_batched_tokens=7,
                   max_num_seqs=1)
    prompt, = prompts(7, (21,))
    assert llm.block_manager.blocks_for_prompt(21, 7) == llm.block_manager.usable_blocks == 12
    out, = check_matches_hf(llm, hf, [prompt], 2)
    assert out.outputs[0].finish_reason == "length"


def test_groups_of_two_layers_sharing_two_tensors_match_hf(tmp_path):
    """5 layers, 3 sliding and 2 full: vLLM's groups of 2 layers (full 1 and 3; sliding 0 and 4, and 2 with a
    padding layer), the j-th layer of each group on cache tensor j. Chunks, a prefix hit, and preemption by swap,
    which moves every group's pages in both tensors."""
    kinds = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    hf = save_tiny_model("qwen3", tmp_path, seed=0, use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=kinds, num_hidden_layers=len(kinds))
    llm = make_llm(tmp_path, block_size=BLOCK, num_blocks=24, preemption_mode="swap", max_num_batched_tokens=7,
                   max_num_seqs=3)
    config = llm.kv_cache_config
    assert [group.layers for group in config.groups] == [(1, 3), (0, 4), (2,)]
    assert config.tensors == ((1, 0, 2), (3, 4)) and len(llm.kv_cache.gpu) == 2
    first, second, third = prompts(10, (13, 9, 11))
    check_matches_hf(llm, hf, [first, second, third], 10)
    records = llm.step_dataframe()
    assert records["preempted"].sum() > 0 and records["blocks_swapped_out"].sum() > 0
    roomy = make_llm(tmp_path, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=7, max_num_seqs=2)
    check_matches_hf(roomy, hf, [first], 5)
    out, = check_matches_hf(roomy, hf, [first[:12] + second], 6)
    assert out.metrics.num_cached_prompt_tokens == 12  # every group serves the shared blocks
