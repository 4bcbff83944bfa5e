"""The step contract (kvlab.engine.step): once ``schedule()`` returns, the frozen step is all the runner, the
step loop and failure isolation read. The block manager's answers about a sequence (its progress, tables and
slots) are read once, at scheduling; asking it again mid-step could run something other than what was
scheduled."""

import dataclasses
import random

import pytest

from engine_helpers import BLOCK_SIZE, hf_greedy, make_llm, save_tiny_model
from kvlab.blocks import TierMove
from kvlab.blocks.sequence import Sequence
from kvlab.engine import SamplingParams
from kvlab.engine.step import SeqStep, StepBuilder

QUERIES = ("num_scheduled_tokens", "get_block_table", "slot_mapping", "block_tables", "slot_mappings")


@pytest.mark.parametrize("scheduling, budget", [("v0", 256), ("v1", 5)])
def test_nothing_after_scheduling_asks_the_manager_where_a_sequence_stands(llama, monkeypatch, scheduling, budget):
    path, hf = llama  # V1 with a budget of 5: prompts in chunks beside decodes; a small pool: preemptions
    llm = make_llm(path, scheduling=scheduling, max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=12)
    scheduled, asked = [False], []
    schedule = llm.scheduler.schedule

    def scheduling_then_closed():
        scheduled[0] = False
        step = schedule()
        scheduled[0] = True  # from here until the next schedule(): the step's own record only
        return step

    monkeypatch.setattr(llm.scheduler, "schedule", scheduling_then_closed)
    for name in filter(lambda name: hasattr(llm.block_manager, name), QUERIES):
        query = getattr(llm.block_manager, name)

        def watched(*args, _query=query, _name=name, **kwargs):
            if scheduled[0]:
                asked.append(_name)
            return _query(*args, **kwargs)
        monkeypatch.setattr(llm.block_manager, name, watched)

    rng = random.Random(3)
    prompts = [[rng.randrange(1, 100) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False)
    assert asked == []
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in prompts]


def test_a_scheduled_step_is_frozen_and_says_what_each_sequence_computes(llama):
    path, _ = llama
    llm = make_llm(path, scheduling="v1", max_num_batched_tokens=6, max_num_seqs=2)
    llm.add_request([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=2))
    step = llm.scheduler.schedule()
    [entry] = step.entries
    assert (entry.start, entry.end, entry.prefill, entry.samples) == (0, 6, True, False)  # a first chunk of 6
    assert len(entry.slots[0]) == 6  # and the whole table, sent for the first time:
    assert entry.table_edits[0] == (0, tuple(llm.block_manager.get_block_table(entry.seq)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.kind = "decode"
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.end = 10
    assert step.num_prefill_tokens == 6 and step.num_decode_tokens == 0


def test_a_last_chunk_of_one_prompt_token_is_a_prefill_read_from_the_sequence(llama):
    """V1 derives "still prefilling" from the sequence (``num_computed_tokens < prefill_end``): a prompt one token
    longer than the budget ends with a one-token chunk, which a count of tokens left alone would call a decode."""
    path, _ = llama
    llm = make_llm(path, scheduling="v1", max_num_batched_tokens=6, max_num_seqs=2)
    llm.add_request([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=2))
    first = llm.scheduler.schedule()
    [entry] = llm.scheduler.schedule().entries
    assert [(e.start, e.end, e.prefill, e.samples) for e in first.entries] == [(0, 6, True, False)]
    assert (entry.start, entry.end, entry.prefill, entry.samples) == (6, 7, True, True)
    assert entry.seq.num_computed_tokens == 7 and not entry.seq.is_prefilling


def test_a_step_entry_has_room_for_draft_tokens():
    """``SeqStep.num_draft_tokens`` (0 unless speculative decoding proposes some): a sequence samples when its
    positions, drafts aside, reach its last token."""
    seq = Sequence(range(10), 4)
    plain = SeqStep(seq, 9, 10, False, ((1, 2, 3),), ((12,),))
    drafted = SeqStep(seq, 9, 13, False, ((1, 2, 3, 4),), ((12, 13, 14, 15),), num_draft_tokens=3)
    assert (plain.num_draft_tokens, plain.samples) == (0, True)
    assert (drafted.num_tokens, drafted.samples) == (4, True)
    assert not dataclasses.replace(drafted, num_draft_tokens=2).samples


def _recording_steps(llm) -> list:
    steps, schedule = [], llm.scheduler.schedule

    def recorded():
        steps.append(schedule())
        return steps[-1]

    llm.scheduler.schedule = recorded
    return steps


def test_a_step_sends_each_block_of_a_table_once(llama):
    """A decode step that stays in its sequence's last block sends no table change; a new block is sent alone."""
    path, _ = llama
    llm = make_llm(path)
    steps = _recording_steps(llm)
    prompt = list(range(1, 2 * BLOCK_SIZE + 2))
    llm.generate([prompt], SamplingParams(max_tokens=2 * BLOCK_SIZE, ignore_eos=True), use_tqdm=False)
    sent = [len(entry.table_edits[0].blocks) for step in steps for entry in step.entries]
    final_blocks = -(-(len(prompt) + 2 * BLOCK_SIZE - 1) // BLOCK_SIZE)  # the last sampled token gets no slot
    assert sent[0] == 3 and sum(sent) == final_blocks and set(sent[1:]) == {0, 1}, sent


def _runner_checked_against_the_manager(llm) -> list:
    """Wrap the runner's forward: before each pass, every sequence's tables as the runner holds them (from the
    steps' edits) must be the manager's. Returns the list of passes checked."""
    checked, forward = [], llm.runner.forward

    def checking(step, entries):
        for entry in entries:
            assert llm.runner.block_tables(entry.seq.seq_id) == llm.block_manager.block_tables(entry.seq)
        checked.append(len(entries))
        return forward(step, entries)

    llm.runner.forward = checking
    return checked


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_the_runner_tables_follow_the_manager_through_forks_preemption_and_swaps(llama, preemption_mode):
    """Parallel samples (forks sharing blocks, copy-on-write), a pool small enough to preempt, in both modes."""
    path, _ = llama
    llm = make_llm(path, num_blocks=10, max_num_seqs=6, preemption_mode=preemption_mode, num_cpu_blocks=16)
    checked = _runner_checked_against_the_manager(llm)
    steps = _recording_steps(llm)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 100) for _ in range(rng.randrange(5, 20))] for _ in range(3)]
    llm.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    assert sum(checked) > 20 and any(step.preempted for step in steps)
    assert any(step.moves.counts["copy"] for step in steps)  # copy-on-write changed a table entry
    if preemption_mode == "swap":
        assert any(step.moves.counts["swap_in"] for step in steps)
    first_run = {seq.seq_id for step in steps for seq in step.seqs}
    llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)  # its steps forget the first run
    for seq_id in first_run:
        with pytest.raises(KeyError):
            llm.runner.block_tables(seq_id)


def test_the_runner_tables_follow_a_sliding_window(tmp_path):
    """Released window blocks turn into the null block in the runner's tables as in the manager's."""
    save_tiny_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    llm = make_llm(tmp_path, block_size=4, max_num_seqs=2, scheduling="v1", max_num_batched_tokens=7)
    checked = _runner_checked_against_the_manager(llm)
    steps = _recording_steps(llm)
    llm.generate([list(range(1, 20)), list(range(3, 30))], SamplingParams(max_tokens=10, ignore_eos=True),
                 use_tqdm=False)
    window = [spec.sliding_window for spec in llm.block_manager.groups].index(8)
    window_edits = [entry.table_edits[window] for step in steps for entry in step.entries]
    assert sum(checked) > 10 and any(edit.blocks[:1] == (0,) and edit.start > 0 for edit in window_edits)


def test_a_step_applies_the_tier_batches_in_order_never_writing_a_block_twice_in_one_launch():
    # A tier smaller than a batch reuses a slot within it (the later copy wins): two launches, in order.
    step = StepBuilder("prefill")
    step.record_tier_moves([TierMove("offload", [1, 2], [3, 3]), TierMove("promote", [2, 1, 0], [0, 1, 2]),
                            TierMove("offload", [3], [0])])
    assert [(kind, pairs) for kind, pairs, _, _ in step.moves.rounds] == [
        ("offload", [(1, 3)]), ("offload", [(2, 3)]), ("promote", [(2, 0), (1, 1), (0, 2)]), ("offload", [(3, 0)])]
    assert step.moves.counts["offload"] == 3 and step.moves.counts["promote"] == 3
