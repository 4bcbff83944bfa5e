"""Hybrid state models in ``kvlab size``: Qwen3-Next's gated delta net layers (Jamba's Mamba layers, Falcon-H1's
Mamba-2 mixers) keep one fixed state per request beside the full-attention pages, and the attention block size
grows to vLLM's aligned one (``HybridAttentionMambaModelConfig.verify_and_update_config``: the fewest multiples
of 16 tokens whose page holds a state, the state page then padded to it). Every figure is worked from the
published config's shapes."""

from pathlib import Path

import pytest

from kvlab.__main__ import main
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, MambaStateSpec, check_group_specs
from kvlab.errors import InvalidArgumentError
from kvlab.sizing import KVCacheConfig
from kvlab.sizing.groups import KVCacheGroupSpec, kv_cache_groups
from kvlab.sizing.hf_config import read_model_shape
from kvlab.sizing.plan import size_model

QWEN3_NEXT = Path(__file__).parent / "configs" / "Qwen3-Next-80B-A3B-Instruct"
JAMBA = Path(__file__).parent / "configs" / "Jamba-v0.1"
FALCON_H1 = Path(__file__).parent / "configs" / "Falcon-H1-7B-Instruct"
GiB = 2**30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 kv heads x 256), the others gated delta nets with
# 16 key heads and 32 value heads of 128, a convolution of width 4 over q, k and v.
CONV_ELEMENTS = (4 - 1) * (2 * 16 * 128 + 32 * 128)   # the convolution's last 3 inputs of q, k and v
RECURRENT_ELEMENTS = 32 * 128 * 128                    # a key dim x value dim matrix per value head
FULL_LAYERS = tuple(range(3, 48, 4))
STATE_LAYERS = tuple(layer for layer in range(48) if layer not in FULL_LAYERS)


def attention_token_page(element_bytes: int) -> int:
    return 2 * 2 * 256 * element_bytes  # K and V, 2 kv heads, head_dim 256


def vllm_block_size(state_bytes: int, element_bytes: int) -> int:
    """vLLM's rule without prefix caching: 16 x cdiv(mamba page, 16 x attention page of one token)."""
    return 16 * cdiv(state_bytes, 16 * attention_token_page(element_bytes))


def test_the_state_is_read_from_the_published_shapes():
    shape = read_model_shape(QWEN3_NEXT)
    assert (shape.conv_state_elements, shape.recurrent_state_elements) == (CONV_ELEMENTS, RECURRENT_ELEMENTS)
    assert shape.state_layers == STATE_LAYERS and shape.layer_windows == (None,) * len(FULL_LAYERS)


@pytest.mark.parametrize("kv_cache_dtype, element_bytes", [("auto", 2), ("fp8", 1)])
@pytest.mark.parametrize("ssm_dtype, ssm_bytes", [("auto", 2), ("float32", 4)])
def test_the_attention_block_size_is_vllms_aligned_one(kv_cache_dtype, element_bytes, ssm_dtype, ssm_bytes):
    state = CONV_ELEMENTS * 2 + RECURRENT_ELEMENTS * ssm_bytes  # the convolution in the model's bf16
    sizing = size_model(read_model_shape(QWEN3_NEXT), kv_cache_dtype=kv_cache_dtype, gpu_memory=400 * GiB,
                        gpu_memory_utilization=0.9, max_model_len=32768, mamba_ssm_cache_dtype=ssm_dtype)
    block = vllm_block_size(state, element_bytes)
    assert sizing.state_bytes == state and sizing.block_size == block
    (pool,) = sizing.pools
    config = pool.config
    assert config.block_size == block and config.page_bytes == attention_token_page(element_bytes) * block >= state
    # one full group and three state groups of 12 layers; a request: its attention blocks and one state each
    assert [(type(g.attention), g.layers) for g in config.groups] == [(FullAttentionSpec, FULL_LAYERS)] + [
        (MambaStateSpec, STATE_LAYERS[i::3]) for i in range(3)]
    assert pool.blocks_per_request == cdiv(32768, block) + 3
    assert pool.num_blocks == int(sizing.kv_memory) // (config.page_bytes * 12) > 0
    assert pool.max_concurrency == pool.num_blocks / pool.blocks_per_request


@pytest.mark.parametrize("kv_cache_dtype, ssm_dtype, block", [
    ("auto", "float32", 1056), ("fp8", "float32", 2096),  # the issue's figures: a float32 recurrent state
    ("auto", "auto", 544), ("fp8", "auto", 1072)])         # vLLM's auto: the state in the model's bf16
def test_the_rule_gives_the_issues_figures_with_a_float32_recurrent_state(kv_cache_dtype, ssm_dtype, block):
    state = CONV_ELEMENTS * 2 + RECURRENT_ELEMENTS * (4 if ssm_dtype == "float32" else 2)
    assert vllm_block_size(state, 2 if kv_cache_dtype == "auto" else 1) == block
    assert size_model(read_model_shape(QWEN3_NEXT), kv_cache_dtype=kv_cache_dtype, gpu_memory=400 * GiB,
                      gpu_memory_utilization=0.9, mamba_ssm_cache_dtype=ssm_dtype).block_size == block


def test_a_larger_block_size_asked_for_is_kept():
    sizing = size_model(read_model_shape(QWEN3_NEXT), gpu_memory=400 * GiB, gpu_memory_utilization=0.9,
                        block_size=2048)
    assert sizing.block_size == 2048 and sizing.pools[0].config.block_size == 2048


def test_kvlab_size_prints_the_block_size_the_state_and_the_concurrency(capsys):
    status = main(["size", "--model", str(QWEN3_NEXT), "--gpu-memory", "400GiB", "--max-model-len", "32768",
                   "--mamba-ssm-cache-dtype", "float32"])
    out, err = capsys.readouterr()
    assert status == 0, err
    state = CONV_ELEMENTS * 2 + RECURRENT_ELEMENTS * 4
    assert "36 Mamba / linear attention" in out and f"= {state:,} B" in out
    assert f"attention block size: 1,056 tokens; a page must hold a state: 16 x cdiv({state:,} B, 16 x 2,048 B) = " \
           "1,056 tokens at least" in out
    assert f"holds {cdiv(32768, 1056):,} (full) + 3 x 1 (state) = {cdiv(32768, 1056) + 3:,} blocks" in out
    assert "Maximum concurrency for 32,768 tokens per request" in out and "does not serve" in out


def test_a_state_group_needs_a_state_that_fits_its_page():
    state = CONV_ELEMENTS * 2 + RECURRENT_ELEMENTS * 2
    with pytest.raises(InvalidArgumentError, match="the block size must be at least 544"):
        KVCacheGroupSpec(MambaStateSpec(), (0,), 16, 2, 256, "bfloat16", state_bytes=state)
    with pytest.raises(InvalidArgumentError, match="only a MambaStateSpec"):
        KVCacheGroupSpec(FullAttentionSpec(), (0,), 16, 2, 256, "bfloat16", state_bytes=state)
    with pytest.raises(InvalidArgumentError, match="state_bytes"):
        KVCacheGroupSpec(MambaStateSpec(), (0,), 544, 2, 256, "bfloat16")
    groups = kv_cache_groups(read_model_shape(QWEN3_NEXT).layout("bfloat16"), 544, STATE_LAYERS, state)
    assert KVCacheConfig(groups, 1).blocks_per_request(32768, 8192) == cdiv(32768, 544) + 3
    with pytest.raises(InvalidArgumentError, match="each group must be one of"):
        check_group_specs([MambaStateSpec()])  # the block manager does not plan state groups


def test_jamba_keeps_a_mamba_state_in_seven_of_eight_layers():
    """Jamba-v0.1: attention every 8th layer from layer 4 (8 kv heads of 4096 / 32); the other 28 layers are Mamba
    with an inner width of 2 x 4096, a convolution of width 4 and 16 SSM values per channel, all in bf16."""
    shape = read_model_shape(JAMBA)
    inner = 2 * 4096
    assert (shape.conv_state_elements, shape.recurrent_state_elements) == ((4 - 1) * inner, inner * 16)
    attention = tuple(range(4, 32, 8))
    assert shape.state_layers == tuple(layer for layer in range(32) if layer not in attention)
    sizing = size_model(shape, gpu_memory=400 * GiB, gpu_memory_utilization=0.9, max_model_len=65536)
    state = ((4 - 1) * inner + inner * 16) * 2
    token_page = 2 * 8 * 128 * 2
    assert (sizing.state_bytes, sizing.block_size) == (state, 16 * cdiv(state, 16 * token_page))
    (pool,) = sizing.pools
    # 4 attention layers, 28 Mamba: groups of 4, so 1 attention group and 7 state groups
    assert [type(g.attention) for g in pool.config.groups] == [FullAttentionSpec] + [MambaStateSpec] * 7
    assert pool.blocks_per_request == cdiv(65536, sizing.block_size) + 7


# Falcon-H1-7B: each of its 44 layers runs attention (12 heads on 2 kv heads of 128) and a Mamba-2 mixer side by
# side. vLLM makes each a layer of the KV cache (FalconH1ForCausalLM.get_mamba_state_shape_from_config ->
# MambaStateShapeCalculator.mamba2_state_shape, tensor parallel size 1): 44 full-attention layers and 44 state layers.
FALCON_CONV = (4 - 1) * (3072 + 2 * 1 * 256)   # d_conv - 1 inputs of x (d_ssm 3072), B and C (n_groups 1 x d_state 256)
FALCON_SSM = 24 * 128 * 256                    # a d_head x d_state matrix for each of the 24 Mamba heads


def test_falcon_h1_keeps_a_mamba2_state_beside_every_attention_layer(tmp_path):
    shape = read_model_shape(FALCON_H1)
    assert (FALCON_CONV, FALCON_SSM) == (10_752, 786_432)
    assert (shape.conv_state_elements, shape.recurrent_state_elements) == (FALCON_CONV, FALCON_SSM)
    # cache layers 0..43 are the layers' attention, 44..87 their mixers; the model still has 44 layers
    assert shape.layer_windows == (None,) * 44 and shape.state_layers == tuple(range(44, 88))
    assert shape.num_layers == 44
    # A 14 GiB weights file stands in for the checkpoint, so the KV memory below is worked from stated sizes.
    (tmp_path / "config.json").write_text((FALCON_H1 / "config.json").read_text())
    with open(tmp_path / "model.safetensors", "wb") as weights:
        weights.truncate(14 * GiB)  # sparse: the size is what sizing reads
    sizing = size_model(read_model_shape(tmp_path), gpu_memory=80 * GiB, gpu_memory_utilization=0.9,
                        max_model_len=32768)
    # vLLM's page-size alignment (HybridAttentionMambaModelConfig, no prefix caching), all in bf16:
    #   state = (10,752 + 786,432) x 2 B = 1,594,368 B; a token's attention page = 2 (K, V) x 2 x 128 x 2 B = 1,024 B
    #   block = 16 x cdiv(1,594,368, 16 x 1,024) = 16 x 98 = 1,568 tokens (16 x 97 x 1,024 = 1,589,248 is too small)
    assert (sizing.state_bytes, sizing.block_size) == (1_594_368, 1_568)
    (pool,) = sizing.pools
    config = pool.config
    # 44 full-attention and 44 state layers: one group of each (44 < 1.25 x 44), each of the 44 tensors shared
    # by a layer's attention and its mixer; a page is 1,024 B x 1,568 = 1,605,632 B, a block id 44 pages
    assert [(type(g.attention), g.layers) for g in config.groups] == [
        (FullAttentionSpec, tuple(range(44))), (MambaStateSpec, tuple(range(44, 88)))]
    assert config.tensors == tuple((layer, 44 + layer) for layer in range(44))
    assert pool.bytes_per_block == 1_605_632 * 44 == 70_647_808
    # KV memory: 80 GiB x 0.9 = 77,309,411,328 B, less the 15,032,385,536 B of weights and the activations' bound
    # 2 x 8,192 tokens x (3 x 3,072 + (12 + 2 x 2) x 128 + 2 x 14,336) x 2 B + 3 x 256 seqs x 128,000 x 4 B
    # = 1,308,622,848 + 393,216,000 = 1,701,838,848 B (intermediate_size 14,336 and vocab_size 128,000 are
    # FalconH1Config's defaults: the abridged config leaves them out) -> 60,575,186,944 B
    assert sizing.activations == 1_701_838_848 and sizing.kv_memory == 60_575_186_944
    # 60,575,186,944 // 70,647,808 = 857 blocks; a request of 32,768 tokens holds cdiv(32,768, 1,568) = 21
    # attention blocks and 1 state block: maximum concurrency 857 / 22 = 38.95
    assert (pool.num_blocks, pool.blocks_per_request) == (857, 21 + 1)
    assert pool.max_concurrency == pytest.approx(38.95, abs=0.005)


@pytest.mark.parametrize("kv_cache_dtype, ssm_dtype, state, block", [
    # fp8 attention pages: 512 B a token, so 16 x cdiv(1,594,368, 16 x 512) = 16 x 195 = 3,120
    ("fp8", "auto", 1_594_368, 3_120),
    # a float32 SSM state: 10,752 x 2 B + 786,432 x 4 B = 3,167,232 B -> 16 x cdiv(3,167,232, 16,384) = 16 x 194
    ("auto", "float32", 3_167_232, 3_104)])
def test_falcon_h1_block_size_follows_its_state_and_page(kv_cache_dtype, ssm_dtype, state, block):
    sizing = size_model(read_model_shape(FALCON_H1), kv_cache_dtype=kv_cache_dtype, gpu_memory=80 * GiB,
                        gpu_memory_utilization=0.9, mamba_ssm_cache_dtype=ssm_dtype)
    assert (sizing.state_bytes, sizing.block_size) == (state, block)


def test_kvlab_size_prints_falcon_h1_as_44_layers_each_with_a_state(capsys):
    status = main(["size", "--model", str(FALCON_H1), "--gpu-memory", "80GiB", "--max-model-len", "32768"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "44 layers: 44 full attention, 44 Mamba / linear attention (a fixed state per request, beside the " \
           "attention in the same layers)" in out
    assert "16 x cdiv(1,594,368 B, 16 x 1,024 B) = 1,568 tokens at least" in out
    assert "holds 21 (full) + 1 (state) = 22 blocks" in out
