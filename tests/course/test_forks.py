"""The fork engine of notebooks 03a/03b: copies and swaps move the right data, and skipping the copies shows."""

import numpy as np

from kvlab import Sequence
from kvlab.course.forks import Blocks, TinyEngine


def forked(engine, prompt_len=20, samples=3):
    parent = Sequence(np.arange(prompt_len), 8)
    engine.prefill(parent)
    return [parent] + [engine.fork(parent) for _ in range(samples - 1)]


def test_copy_on_write_keeps_every_sample_reading_its_own_kv():
    engine = TinyEngine(num_blocks=12, block_size=8)
    group = forked(engine)
    pairs = [p for k, seq in enumerate(group) for p in engine.step({seq: 100 + k})]
    assert len(pairs) == 2  # the partial prompt block is copied for all but its last writer
    assert engine.wrong_reads(group) == []


def test_skipped_copies_are_seen_as_wrong_reads():
    engine = TinyEngine(num_blocks=12, block_size=8)
    group = forked(engine)
    for k, seq in enumerate(group):
        engine.step({seq: 100 + k}, apply_copies=False)
    assert len(engine.wrong_reads(group)) == 2


def test_swapping_a_group_out_and_in_keeps_its_kv_and_moves_each_shared_block_once():
    engine = TinyEngine(num_blocks=12, block_size=8, num_cpu_blocks=12)
    group = forked(engine)
    distinct = {b for seq in group for b in seq.block_table}
    assert sum(len(engine.swap_out(seq)) for seq in group) == len(distinct)
    engine.gpu.zero_()  # whatever ran meanwhile overwrote the GPU blocks
    for seq in group:
        engine.swap_in(seq)
    assert engine.wrong_reads(group) == []


def test_blocks_counts_shared_blocks_once_and_frees_them_all():
    blocks = Blocks(num_blocks=12, block_size=8)
    group = forked(blocks)
    assert blocks.blocks_in_use() == 3
    for seq in group:
        blocks.free(seq)
    assert blocks.blocks_in_use() == 0
