"""``LLM(kv_events=True)``: the block manager's KV cache events (vLLM's schema) for every model, hybrid included.

A router replays them into an index of what the replica caches; after every step that index must be the
manager's own: the hashes its pool can hit now (for a hybrid model, group by group: each stored block is
under exactly one group, the one whose layers own it). The pools are small, so prompts evict each other's
prefixes and both kinds of event flow. A subscriber that raises is dropped (the manager's subscriber
isolation), and the requests keep their outputs, token for token those of an engine without events.
"""

import random

import pytest

from engine_helpers import make_llm, save_tiny_model
from kvlab.blocks.events import BlockRemoved, BlockStored, CachedHashes
from kvlab.engine import SamplingParams
from kvlab.errors import InvalidArgumentError, KVEventSubscriberWarning

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
BLOCK = 4
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
# Pools that cache fewer prefixes than the workload has, but hold 3 running sequences: a hybrid model's tokens
# take blocks in each of its 3 groups (vLLM's grouping of 2 sliding layers and 1 full: groups of one layer).
NUM_BLOCKS = {"single": 24, "hybrid": 56}


@pytest.fixture(scope="module", params=["single", "hybrid"])
def model(request, tmp_path_factory):
    """(kind, model directory): a full-attention Llama (one KV cache group) or a Qwen3 mixing sliding-window
    and full-attention layers (three groups on one pool)."""
    path = tmp_path_factory.mktemp(f"kv_events_{request.param}")
    if request.param == "single":
        save_tiny_model("llama", path)
    else:
        save_tiny_model("qwen3", path, seed=1, use_sliding_window=True, sliding_window=8, layer_types=MIXED,
                        num_hidden_layers=len(MIXED))
    return request.param, path


def workload(seed: int = 0) -> list[list[int]]:
    """Four families of three prompts sharing a 12-token prefix (hits), more than the pool caches (evictions)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 128) for _ in range(12)] for _ in range(4)]
    return [prefixes[i // 3] + [rng.randrange(1, 128) for _ in range(rng.randrange(1, 9))] for i in range(12)]


def manager_cached(manager) -> list[set[int]]:
    """Per KV cache group, the hashes a prefix lookup of that group can hit now (the groups share one pool;
    each is a namespace of its index)."""
    index = manager._pool.index
    return [set(namespace) for namespace in index.namespaces]


def assert_replay_is_the_managers(kind, replay: CachedHashes, manager) -> None:
    cached = manager_cached(manager)
    if kind == "single":
        assert [replay.hashes] == cached and not replay.groups
        return
    assert not replay.hashes  # every event names its group
    assert [replay.groups.get(g, set()) for g in range(len(manager.groups))] == cached


def run_checked(llm, kind, replay, prompts) -> dict:
    """Every prompt to completion, step by step, checking the replayed index after each step; the outputs by id."""
    ids = [llm.add_request(prompt, GREEDY) for prompt in prompts]
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in llm.step())
        assert_replay_is_the_managers(kind, replay, llm.block_manager)
    return {i: outputs[i].outputs[0].token_ids for i in ids}


def test_llm_publishes_the_managers_kv_events(model):
    kind, path = model
    llm = make_llm(path, block_size=BLOCK, num_blocks=NUM_BLOCKS[kind], max_num_seqs=3, max_num_batched_tokens=16,
                   kv_events=True)
    assert llm.kv_events is llm.block_manager.kv_events
    replay = CachedHashes()
    llm.kv_events.subscribe(replay)
    buffered = llm.kv_events.subscribe()
    run_checked(llm, kind, replay, workload())
    seen = list(buffered)
    assert any(isinstance(e, BlockStored) for e in seen) and any(isinstance(e, BlockRemoved) for e in seen)
    assert llm.block_manager.stats.hit_blocks > 0
    if kind == "single":
        assert all(e.group_idx is None for e in seen)
    else:
        stored = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                  for e in seen if isinstance(e, BlockStored)}
        assert stored == {(0, "full_attention", None), (1, "sliding_window", 8), (2, "sliding_window", 8)}
        assert {e.group_idx for e in seen if isinstance(e, BlockRemoved)} <= {0, 1, 2}
    llm.block_manager.reset_prefix_cache()
    assert_replay_is_the_managers(kind, replay, llm.block_manager)


def test_a_faulty_kv_event_subscriber_costs_no_request_its_output(model):
    kind, path = model
    settings = dict(block_size=BLOCK, num_blocks=NUM_BLOCKS[kind], max_num_seqs=3, max_num_batched_tokens=16)
    expected = make_llm(path, **settings).generate(workload(), GREEDY, use_tqdm=False)
    llm = make_llm(path, kv_events=True, **settings)

    def broken(event):
        raise RuntimeError("a broken router")

    faulty = llm.kv_events.subscribe(broken)
    replay = CachedHashes()
    llm.kv_events.subscribe(replay)  # after the faulty one: it must still get every event
    with pytest.warns(KVEventSubscriberWarning, match="a broken router"):
        got = run_checked(llm, kind, replay, workload())
    assert faulty.closed and isinstance(faulty.error, RuntimeError)
    assert list(got.values()) == [out.outputs[0].token_ids for out in expected]
    assert all(out.outputs[0].finish_reason == "length" for out in expected)


def test_kv_events_are_off_by_default_and_the_flag_is_checked(llama):
    path, _ = llama
    assert make_llm(path).kv_events is None
    with pytest.raises(InvalidArgumentError, match="kv_events must be a bool, got 'yes'"):
        make_llm(path, kv_events="yes")
