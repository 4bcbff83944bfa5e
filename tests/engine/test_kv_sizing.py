"""The engine sizes and lays out its KV cache with kvlab.sizing: one ``KVCacheConfig`` (vLLM's layout: groups
of layers sharing cache tensors) is what the block manager, the cache tensors and the runner are made from,
the bytes per block it plans with are the bytes its cache tensors take, and ``kvlab size`` reading the same
model directory finds the same groups."""

import pytest
import torch

from engine_helpers import make_llm, save_tiny_model
from kvlab.engine.config import load_model_config
from kvlab.engine.kv_cache import blocks_for_memory, engine_kv_cache_groups
from kvlab.sizing import kv_cache_groups
from kvlab.sizing.groups import bytes_per_block
from kvlab.sizing.hf_config import read_model_shape


def tensor_bytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


def check_layout(llm, path) -> None:
    cache = llm.kv_cache
    assert tensor_bytes(cache.gpu) == cache.num_blocks * cache.bytes_per_block
    assert tensor_bytes(cache.cpu) == cache.num_cpu_blocks * cache.bytes_per_block
    dtype = str(llm.dtype).removeprefix("torch.")
    assert kv_cache_groups(read_model_shape(path).layout(dtype), cache.block_size) == llm.kv_cache_config.groups
    assert bytes_per_block(llm.kv_cache_config.groups) == cache.bytes_per_block


def test_bytes_per_block_are_what_the_cache_tensors_take(tiny_model):
    path, _ = tiny_model
    llm = make_llm(path, num_blocks=24, preemption_mode="swap", num_cpu_blocks=40, dtype=torch.float32)
    check_layout(llm, path)
    # 2 layers x K and V x 8 tokens x 2 kv heads x 32 head_dim x 4 bytes
    assert llm.kv_cache.bytes_per_block == 2 * 2 * 8 * 2 * 32 * 4


S, F = "sliding_attention", "full_attention"
# layer_types -> the layers sharing each cache tensor. vLLM's groups: [S, F, S] is 1 full and 2 sliding groups of
# one layer, sharing one tensor; [S, F, S, F, S] is groups of 2 (full 1, 3; sliding 0, 4 and 2 with a padding
# layer) sharing 2 tensors; one kind is one group, a tensor per layer.
TENSORS = {(S, F, S): ((1, 0, 2),), (S, F, S, F, S): ((1, 0, 2), (3, 4)), (S, S): ((0,), (1,))}


@pytest.mark.parametrize("layer_types", sorted(TENSORS))
def test_a_windowed_model_shares_its_cache_tensors_as_vllm_does(tmp_path, layer_types):
    """A block id used to be a page in every layer's own tensor: 3 pages for [S, F, S], 5 for [S, F, S, F, S]."""
    save_tiny_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8, layer_types=list(layer_types),
                    num_hidden_layers=len(layer_types))
    llm = make_llm(tmp_path, num_blocks=16, block_size=4, preemption_mode="swap")
    check_layout(llm, tmp_path)
    config, cache = llm.kv_cache_config, llm.kv_cache
    assert config.tensors == TENSORS[layer_types] and len(cache.gpu) == len(cache.cpu) == len(config.tensors)
    for tensor, layers in zip(cache.gpu, config.tensors):
        assert all(cache.layer_caches[layer] is tensor for layer in layers)
    # a page: 4 tokens x K and V x 2 kv heads x 32 head_dim x 4 bytes, in each tensor
    assert cache.bytes_per_block == len(config.tensors) * 4 * 2 * 2 * 32 * 4


def test_one_kv_cache_config_is_what_the_manager_the_cache_the_runner_and_sizing_see(tmp_path):
    save_tiny_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8, layer_types=[S, F, S, F, S],
                    num_hidden_layers=5)
    llm = make_llm(tmp_path, num_blocks=20, block_size=4)
    config = llm.kv_cache_config
    assert llm.kv_cache.config is config and llm.runner.kv_cache.config is config
    manager = llm.block_manager
    assert (manager.num_blocks, manager.block_size) == (config.num_blocks, config.block_size) == (20, 4)
    assert list(manager.groups) == [group.attention for group in config.groups]
    assert llm.runner.layer_groups == config.layer_groups == (1, 0, 2, 0, 1)
    assert config.groups == kv_cache_groups(read_model_shape(tmp_path).layout("float32"), 4)


def fake_gpu(monkeypatch, total=10 * 2**30, free=6 * 2**30) -> int:
    """The device's memory faked for the GPU branch of ``blocks_for_memory``: returns what 0.9 of it leaves."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    return int(free - (1 - 0.9) * total)


def test_on_a_gpu_the_pool_is_what_utilization_leaves_after_weights_and_activations(llama, monkeypatch):
    """10 GiB in all, 6 GiB free."""
    left = fake_gpu(monkeypatch)
    config = load_model_config(llama[0])
    groups = engine_kv_cache_groups(config, torch.float16, "auto", 8)
    num_blocks = blocks_for_memory(groups, config, torch.float16, torch.device("cuda"), gpu_memory_utilization=0.9,
                                   max_num_batched_tokens=256, max_num_seqs=4, max_useful_blocks=10**9)
    # hidden 64, 4 heads on 2 kv heads of 32, intermediate 96, vocab 128, fp16
    activations = 2 * 256 * (3 * 64 + (4 + 2 * 2) * 32 + 2 * 96) * 2 + 3 * 4 * 128 * 4
    per_block = 2 * 2 * 8 * 2 * 32 * 2  # 2 layers x K and V x 8 tokens x 2 kv heads x 32 dims x 2 bytes
    assert num_blocks == (left - activations) // per_block


def test_a_hybrid_models_pool_is_vllms_for_the_same_memory(tmp_path, monkeypatch):
    """[S, F, S, F, S]: a block id is a page in vLLM's 2 shared tensors (it used to be one in each of the 5
    layers), so the same memory holds 5 / 2 times the blocks, the number vLLM would make."""
    left = fake_gpu(monkeypatch)
    save_tiny_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8, layer_types=[S, F, S, F, S],
                    num_hidden_layers=5)
    config = load_model_config(tmp_path)
    groups = engine_kv_cache_groups(config, torch.float16, "auto", 4)
    num_blocks = blocks_for_memory(groups, config, torch.float16, torch.device("cuda"), gpu_memory_utilization=0.9,
                                   max_num_batched_tokens=256, max_num_seqs=4, max_useful_blocks=10**9)
    activations = 2 * 256 * (3 * 64 + (4 + 2 * 2) * 32 + 2 * 96) * 2 + 3 * 4 * 128 * 4
    page = 4 * 2 * 2 * 32 * 2  # 4 tokens x K and V x 2 kv heads x 32 dims x 2 bytes
    assert num_blocks == (left - activations) // (2 * page)
