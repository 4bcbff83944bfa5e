"""The engine sizes and lays out its KV cache with kvlab.sizing: the bytes per block it plans with are the
bytes its cache tensors take, and ``kvlab size`` reading the same model directory finds the same numbers."""

import pytest
import torch

from engine_helpers import make_llm, save_tiny_model
from kvlab.engine.config import load_model_config
from kvlab.engine.kv_cache import blocks_for_memory
from kvlab.sizing.hf_config import read_model_shape


def tensor_bytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


def check_layout(llm, path) -> None:
    cache = llm.kv_cache
    assert tensor_bytes(cache.gpu) == cache.num_blocks * cache.bytes_per_block
    assert tensor_bytes(cache.cpu) == cache.num_cpu_blocks * cache.bytes_per_block
    dtype = str(llm.dtype).removeprefix("torch.")
    assert read_model_shape(path).layout(dtype).bytes_per_block(cache.block_size) == cache.bytes_per_block


def test_bytes_per_block_are_what_the_cache_tensors_take(tiny_model):
    path, _ = tiny_model
    llm = make_llm(path, num_blocks=24, preemption_mode="swap", num_cpu_blocks=40, dtype=torch.float32)
    check_layout(llm, path)
    # 2 layers x K and V x 8 tokens x 2 kv heads x 32 head_dim x 4 bytes
    assert llm.kv_cache.bytes_per_block == 2 * 2 * 8 * 2 * 32 * 4


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention", "sliding_attention"],
                                         ["sliding_attention"] * 2])
def test_a_windowed_model_keeps_a_page_in_every_layer_for_each_block_id(tmp_path, layer_types):
    save_tiny_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8, layer_types=layer_types,
                    num_hidden_layers=len(layer_types))
    llm = make_llm(tmp_path, num_blocks=16, block_size=4)
    check_layout(llm, tmp_path)
    assert llm.kv_cache.bytes_per_block == len(layer_types) * 2 * 4 * 2 * 32 * 4


def test_on_a_gpu_the_pool_is_what_utilization_leaves_after_weights_and_activations(llama, monkeypatch):
    """The GPU branch of ``blocks_for_memory`` with the device's memory faked: 10 GiB in all, 6 GiB free."""
    total, free = 10 * 2**30, 6 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    config = load_model_config(llama[0])
    num_blocks = blocks_for_memory(config, 8, torch.float16, torch.device("cuda"), gpu_memory_utilization=0.9,
                                   max_num_batched_tokens=256, max_num_seqs=4, max_useful_blocks=10**9)
    # hidden 64, 4 heads on 2 kv heads of 32, intermediate 96, vocab 128, fp16
    activations = 2 * 256 * (3 * 64 + (4 + 2 * 2) * 32 + 2 * 96) * 2 + 3 * 4 * 128 * 4
    per_block = 2 * 2 * 8 * 2 * 32 * 2  # 2 layers x K and V x 8 tokens x 2 kv heads x 32 dims x 2 bytes
    assert num_blocks == int(free - (1 - 0.9) * total - activations) // per_block
