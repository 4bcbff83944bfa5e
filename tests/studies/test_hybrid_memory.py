"""Hybrid memory study: per-step page counts by hand, the same counts from a replay through
HybridBlockManager, and the summary's ratios."""

import numpy as np
import pandas as pd
import pytest

from kvlab import Sequence
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.studies.hybrid_memory import ALL_FULL, LayerMix, pages_held, request_footprints, step_bounds, summarize

# One request, prompt 10 and output 3, blocks of 4, window 8. Whole-prompt steps schedule [0, 10), then
# positions 10, 11, 12. Full layers hold ceil(end / 4) pages: 3 3 3 4. A window layer releases the pages
# wholly before start - 7: none, none, page 0 (start 11), page 0: 3 3 2 3.
HALF = LayerMix("1:1, W=8", 1, 1, 8)
TRACE = pd.DataFrame({"input_length": [10], "output_length": [3]})


def test_pages_by_hand():
    starts, ends = step_bounds(10, 3, None)
    assert pages_held(starts, ends, 4, None).tolist() == [3, 3, 3, 4]
    assert pages_held(starts, ends, 4, 8).tolist() == [3, 3, 2, 3]
    # Chunks of 4: [0, 4) [4, 8) [8, 10), then 10, 11, 12; the window layer never holds a fourth page.
    starts, ends = step_bounds(10, 3, 4)
    assert list(zip(starts, ends)) == [(0, 4), (4, 8), (8, 10), (10, 11), (11, 12), (12, 13)]
    assert pages_held(starts, ends, 4, 8).tolist() == [1, 2, 3, 3, 2, 3]


def test_footprints_and_summary_by_hand():
    footprints = request_footprints(TRACE, block_size=4, mixes=(ALL_FULL, HALF))
    # all full: peak 4, mean 13/4; 1:1 averages the two layers: 3 3 2.5 3.5, peak 3.5, mean 3.
    assert footprints[["peak", "mean"]].to_numpy().tolist() == [[4, 3.25], [3.5, 3.0]]
    table = summarize(footprints)
    assert table.loc[HALF.name, "mean_peak_vs_full"] == pytest.approx(3.5 / 4)
    assert table.loc[HALF.name, "mean_mean_vs_full"] == pytest.approx(3.0 / 3.25)


def replay(input_length, output_length, block_size, window, chunk):
    """Live pages of each group after every step, from the manager itself."""
    manager = HybridBlockManager(256, block_size, groups=[FullAttentionSpec(), SlidingWindowSpec(window)],
                                 enable_prefix_caching=False)
    seq = Sequence(list(range(input_length)), block_size)
    held = []
    for start, end in zip(*step_bounds(input_length, output_length, chunk)):
        if start == 0:
            manager.allocate(seq, num_new_tokens=end)
        elif start < input_length:
            manager.append_slots(seq, num_new_tokens=end - start)
        else:
            seq.append_token(10_000 + int(start))
            manager.append_slots(seq)
        held.append([sum(block != 0 for block in table) for table in manager.block_tables(seq)])
        manager.check_invariants()
    return np.array(held).T


@pytest.mark.parametrize("input_length, output_length, block_size, window, chunk", [
    (10, 3, 4, 8, None), (10, 3, 4, 8, 4), (37, 20, 4, 5, 7), (33, 9, 8, 1, 3), (50, 30, 4, 16, None),
    (17, 0, 4, 4, 5), (64, 40, 16, 17, 16)])
def test_closed_form_matches_the_manager(input_length, output_length, block_size, window, chunk):
    full, windowed = replay(input_length, output_length, block_size, window, chunk)
    starts, ends = step_bounds(input_length, output_length, chunk)
    assert full.tolist() == pages_held(starts, ends, block_size, None).tolist()
    assert windowed.tolist() == pages_held(starts, ends, block_size, window).tolist()


def test_chunking_bounds_a_window_layer():
    # Whole-prompt prefill holds every prompt page for one step; chunks of 512 keep a 1024 window's layer
    # within ceil((1024 - 1 + 512) / 16) + 1 pages however long the prompt.
    trace = pd.DataFrame({"input_length": [100_000], "output_length": [5]})
    window_only = LayerMix("window", 1, 0, 1024)
    whole = request_footprints(trace, 16, None, mixes=(window_only,))
    chunked = request_footprints(trace, 16, 512, mixes=(window_only,))
    assert whole["peak"].item() == 100_000 // 16
    assert chunked["peak"].item() <= -(-(1024 - 1 + 512) // 16) + 1
