"""The "small" design card, measured: how much of kvlab a reader walks through to admit a prompt with a 4-block
prefix hit (``call_trace.trace_admission``: lookup, then can_allocate + allocate with its hit) on the manager the
engine's scheduler drives (``KVCacheManager``). The bound is the architecture issue's target, met (vLLM V1 walks
scheduler -> manager -> coordinator -> single-type manager -> block pool, one lookup per group whose hit is passed
on as a value); a test keeps it there."""

from kvlab import BlockManager
from kvlab.blocks.manager import HybridBlockManager, KVCacheManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec

from call_trace import trace_admission

# Measured on this code (November 2026), KVCacheManager: 7 files, 25 functions, 300 line events, depth 6, one
# lookup. Before the flat manager (the nine-class manager; can_allocate + allocate, each looking up): 20 files,
# 74 functions, 488 line events, depth 10, two lookups. nano-vllm (the measure): 2 files, 7 functions,
# 152 line events, depth 3.
TARGET = dict(files=8, functions=25, line_events=300, max_depth=6, lookups_per_group=1)


def _within(trace, bound, num_groups=1):
    return {"files": len(trace.files) <= bound["files"],
            "functions": len(trace.functions) <= bound["functions"],
            "line_events": trace.line_events <= bound["line_events"],
            "max_depth": trace.max_depth <= bound["max_depth"],
            "lookups": trace.prefix_lookups <= bound["lookups_per_group"] * num_groups}


def test_admitting_a_prefix_hit_walks_no_more_of_kvlab_than_the_small_target():
    trace = trace_admission(KVCacheManager)
    assert all(_within(trace, TARGET).values()), (trace, sorted(trace.files))


def test_the_taught_block_manager_adds_only_its_progress_write():
    core, taught = trace_admission(KVCacheManager), trace_admission(BlockManager)
    added = {name for _, name, _ in taught.functions - core.functions}
    assert added == {"allocate", "start_running"}, added  # its allocate, then Sequence.start_running


def test_a_hybrid_manager_looks_the_prefix_up_a_bounded_number_of_times_per_group():
    groups = [FullAttentionSpec(), SlidingWindowSpec(32)]
    trace = trace_admission(lambda **kw: HybridBlockManager(groups=groups, **kw))
    assert trace.prefix_lookups == len(groups), trace  # one lookup per group, its hit passed on as a value
