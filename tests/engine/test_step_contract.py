"""The step contract (kvlab.engine.step): once ``schedule()`` returns, the frozen step is all the runner, the
step loop and failure isolation read. The block manager's answers about a sequence (its progress, tables and
slots) are read once, at scheduling; asking it again mid-step could run something other than what was
scheduled."""

import dataclasses
import random

import pytest

from engine_helpers import hf_greedy, make_llm
from kvlab.blocks.sequence import Sequence
from kvlab.engine import SamplingParams
from kvlab.engine.step import SeqStep

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
    assert len(entry.slots[0]) == 6 and entry.tables[0] == tuple(llm.block_manager.get_block_table(entry.seq))
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
