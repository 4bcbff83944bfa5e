"""KV cache sizing (kvlab.sizing, ``kvlab size``) against numbers worked by hand from the published configs in
configs/ (abridged copies: see configs/README.md). Every expected value is written as its arithmetic:
2 (K and V) x kv heads x head_dim x dtype bytes per token and layer, times layers, times tokens per block."""

from pathlib import Path

import pytest

from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.cli import main
from kvlab.errors import InvalidArgumentError
from kvlab.sizing import KVCacheConfig, KVLayout, kv_cache_groups, parse_memory
from kvlab.sizing.hf_config import read_model_shape
from kvlab.sizing.plan import size_model

CONFIGS = Path(__file__).parent / "configs"
GiB = 2**30


def shape(name: str):
    return read_model_shape(CONFIGS / name)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# model -> (bytes per token and layer in bf16, layers, full-attention layers, {window: layers})
MODELS = {
    "Meta-Llama-3-8B": (2 * 8 * 128 * 2, 32, 32, {}),
    "Qwen3-0.6B": (2 * 8 * 128 * 2, 28, 28, {}),              # head_dim 128 set, not 1024 / 16 = 64
    "SmolLM2-135M": (2 * 3 * (576 // 9) * 2, 30, 30, {}),      # head_dim = hidden / heads
    "gemma-3-4b-it": (2 * 4 * 256 * 2, 34, 34 // 6, {1024: 34 - 34 // 6}),  # every 6th layer global
    "gpt-oss-20b": (2 * 8 * 64 * 2, 24, 12, {128: 12}),        # sliding and full alternate
    "DeepSeek-V3": ((512 + 64) * 2, 61, 61, {}),               # MLA: one latent, no factor 2
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bytes_per_token_and_block_match_the_hand_worked_numbers(name):
    per_layer, layers, full, windows = MODELS[name]
    layout = shape(name).layout("bfloat16")
    assert (layout.bytes_per_token_per_layer, layout.num_layers, layout.full_layers, layout.windows) == (
        per_layer, layers, full, windows)
    assert layout.bytes_per_token == per_layer * layers
    assert layout.bytes_per_token_past_windows == per_layer * full
    assert layout.page_bytes(16) == per_layer * 16
    assert layout.is_hybrid == bool(windows)


def test_the_per_layer_formula_is_shown():
    assert shape("Meta-Llama-3-8B").layout("bfloat16").per_layer_formula() == (
        "2 (K and V) x 8 kv heads x 128 head_dim x 2 bytes (bfloat16) = 4,096 B")
    assert shape("DeepSeek-V3").layout("fp8").per_layer_formula() == (
        "576 latent (kv_lora_rank + qk_rope_head_dim, one for K and V) x 1 bytes (fp8) = 576 B")


def test_gemma3_global_layers_are_every_sixth():
    windows = shape("gemma-3-4b-it").layer_windows
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17, 23, 29]


def test_a_sliding_layer_holds_at_most_its_window():
    layout = shape("gemma-3-4b-it").layout("bfloat16")
    assert layout.bytes_for_tokens(100) == 2 * 4 * 256 * 2 * 34 * 100
    assert layout.bytes_for_tokens(131072) == 2 * 4 * 256 * 2 * (5 * 131072 + 29 * 1024)


@pytest.mark.parametrize("dtype, element_bytes", [("fp8", 1), ("fp8_e4m3", 1), ("fp8_e5m2", 1), ("fp16", 2),
                                                  ("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_the_kv_cache_dtype_sets_the_element_size(dtype, element_bytes):
    sizing = size_model(shape("Meta-Llama-3-8B"), kv_cache_dtype=dtype, gpu_memory=80 * GiB, gpu_memory_utilization=0.9)
    assert sizing.layout.bytes_per_token == 2 * 8 * 128 * element_bytes * 32


def test_auto_is_the_configs_dtype_else_bfloat16():
    assert size_model(shape("Qwen3-0.6B"), gpu_memory=GiB, gpu_memory_utilization=0.9).layout.dtype == "bfloat16"
    assert shape("gpt-oss-20b").dtype is None
    assert size_model(shape("gpt-oss-20b"), gpu_memory=GiB, gpu_memory_utilization=0.9).layout.dtype == "bfloat16"


@pytest.mark.parametrize("args, message", [
    ((8, 128, "int3", (None,)), "unknown KV cache dtype 'int3'"),
    ((0, 128, "fp16", (None,)), "num_kv_heads"),
    ((8, 128, "fp16", ()), "layer_windows"),
    ((8, 128, "fp16", (None, 0)), "layer_windows"),
    ((8, 128, "fp16", [None]), "layer_windows"),
])
def test_a_bad_layout_is_refused(args, message):
    with pytest.raises(InvalidArgumentError, match=message):
        KVLayout(*args)


def test_a_block_holds_at_least_one_token():
    with pytest.raises(InvalidArgumentError, match="block_size"):
        KVLayout(8, 128, "fp16", (None,)).page_bytes(0)


@pytest.mark.parametrize("name, parameters, published", [
    ("Meta-Llama-3-8B", 2 * 128256 * 4096 + 32 * (2 * 4096 * 32 * 128 + 2 * 4096 * 8 * 128 + 3 * 4096 * 14336), 8.03e9),
    ("SmolLM2-135M", 49152 * 576 + 30 * (2 * 576 * 9 * 64 + 2 * 576 * 3 * 64 + 3 * 576 * 1536), 135e6),
    ("Qwen3-0.6B", 151936 * 1024 + 28 * (2 * 1024 * 16 * 128 + 2 * 1024 * 8 * 128 + 3 * 1024 * 3072), 0.6e9),
])
def test_parameter_count_of_dense_models(name, parameters, published):
    assert shape(name).parameters.total == parameters
    assert abs(parameters / published - 1) < 0.01


@pytest.mark.parametrize("name, published", [("DeepSeek-V3", 671e9), ("gpt-oss-20b", 20.9e9)])
def test_parameter_count_of_moe_models_is_within_a_percent_of_the_published_total(name, published):
    assert abs(shape(name).parameters.total / published - 1) < 0.01


def test_llama3_8b_on_80gib():
    sizing = size_model(shape("Meta-Llama-3-8B"), gpu_memory=80 * GiB, gpu_memory_utilization=0.9)
    weights = 8029995008 * 2
    activations = 2 * 8192 * (3 * 4096 + (32 + 2 * 8) * 128 + 2 * 14336) * 2 + 3 * 256 * 128256 * 4
    kv_memory = int(80 * GiB * 0.9 - weights - activations)
    (pool,) = sizing.pools
    assert (sizing.weights, sizing.activations, sizing.kv_memory) == (weights, activations, kv_memory)
    assert pool.num_blocks == kv_memory // (2 * 8 * 128 * 2 * 32 * 16)
    assert pool.blocks_per_request == 8192 // 16
    assert pool.max_concurrency == pool.num_blocks / (8192 // 16)


def test_quantized_weights_are_counted_at_their_size():
    deepseek = shape("DeepSeek-V3")  # fp8: every linear layer at 1 byte, the embeddings in bf16
    assert size_model(deepseek, gpu_memory=GiB, gpu_memory_utilization=0.9).weights == (
        deepseek.parameters.embeddings * 2 + (deepseek.parameters.total - deepseek.parameters.embeddings) * 1)
    assert deepseek.parameters.embeddings == 2 * 129280 * 7168
    oss = shape("gpt-oss-20b")  # mxfp4: the routed experts at 4.25 bits, the rest in bf16
    experts = 24 * 32 * 3 * 2880 * 2880
    assert oss.parameters.routed_experts == experts
    assert size_model(oss, gpu_memory=GiB, gpu_memory_utilization=0.9).weights == int(
        (oss.parameters.total - experts) * 2 + experts * 4.25 / 8)


def test_a_model_directory_is_sized_by_its_safetensors_files(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "SmolLM2-135M" / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(bytes(1000))
    sizing = size_model(read_model_shape(tmp_path), gpu_memory=GiB, gpu_memory_utilization=0.9)
    assert sizing.weights == 1000 and "safetensors" in sizing.weights_source


@pytest.mark.parametrize("options, message", [
    (dict(gpu_memory=0), "gpu_memory"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(block_size=0), "block_size"), (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(kv_cache_dtype="int3"), "int3"),
])
def test_size_model_refuses_bad_settings(options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        size_model(shape("SmolLM2-135M"), **{"gpu_memory": GiB, "gpu_memory_utilization": 0.9, **options})


def test_layer_kinds_sizing_cannot_describe_are_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2, '
                                          '"layer_types": ["full_attention", "linear_attention"]}')
    with pytest.raises(InvalidArgumentError, match="layer_types"):
        read_model_shape(tmp_path)


def test_a_model_that_does_not_fit_gets_no_blocks():
    (pool,) = size_model(shape("DeepSeek-V3"), gpu_memory=80 * GiB, gpu_memory_utilization=0.9).pools
    assert pool.num_blocks == 0 and pool.max_concurrency == 0


def windows_and_layers(groups) -> list:
    return [(group.sliding_window, group.layers) for group in groups]


def test_kv_cache_groups_of_hybrid_models_are_vllms():
    """Groups of the fewest layers of any kind, each kind's layers dealt out over its groups (layer i of a kind
    to group i % n), and one tensor per layer of a group, shared by the groups."""
    gemma = KVCacheConfig(kv_cache_groups(shape("gemma-3-4b-it").layout("bfloat16"), 16), 0)  # 5 full, 29 sliding
    sliding = [i for i in range(34) if (i + 1) % 6]
    assert windows_and_layers(gemma.groups) == [(None, (5, 11, 17, 23, 29))] + [
        (1024, tuple(sliding[g::6])) for g in range(6)]
    assert (gemma.group_size, gemma.padding_layers) == (5, 6 * 5 - 29)
    # tensor j: the j-th layer of each group; the last sliding group has 4 layers, so tensor 4 has 6 of 7 groups'
    assert gemma.tensors[0] == (5, 0, 1, 2, 3, 4, 6) and gemma.tensors[4] == (29, 28, 30, 31, 32, 33)
    oss = KVCacheConfig(kv_cache_groups(shape("gpt-oss-20b").layout("bfloat16"), 16), 0)  # alternating
    assert windows_and_layers(oss.groups) == [(None, tuple(range(1, 24, 2))), (128, tuple(range(0, 24, 2)))]
    assert oss.tensors == tuple((2 * j + 1, 2 * j) for j in range(12)) and oss.padding_layers == 0
    # 12 sliding + 13 full (gpt-oss-20b with an eagle layer): within 25%, so groups of the larger count.
    eagle = KVCacheConfig(kv_cache_groups(KVLayout(8, 64, "bfloat16", (128, None) * 12 + (None,)), 16), 0)
    assert ([len(group.layers) for group in eagle.groups], eagle.group_size, eagle.padding_layers) == ([13, 12], 13, 1)
    uniform = KVCacheConfig(kv_cache_groups(shape("Meta-Llama-3-8B").layout("bfloat16"), 16), 0)
    assert windows_and_layers(uniform.groups) == [(None, tuple(range(32)))]
    assert uniform.tensors == tuple((i,) for i in range(32))


def test_a_group_spec_owns_its_pages_and_rules():
    group = kv_cache_groups(shape("gemma-3-4b-it").layout("fp8"), 32)[1]
    assert (group.block_size, group.num_kv_heads, group.head_size, group.cache_format) == (32, 4, 256, "fp8")
    assert group.attention == SlidingWindowSpec(1024) and group.is_quantized and group.mla_latent_dim is None
    assert group.page_bytes == 2 * 4 * 256 * 1 * 32
    assert group.blocks_per_request(131072, 8192) == cdiv(1024 - 1 + 8192, 32) + 1
    deepseek = kv_cache_groups(shape("DeepSeek-V3").layout("bfloat16"), 16)[0]  # MLA: one latent row a token
    assert (deepseek.mla_latent_dim, deepseek.page_bytes) == (512 + 64, (512 + 64) * 2 * 16)


def test_a_kv_cache_config_refuses_groups_that_do_not_share_one_pool():
    groups = kv_cache_groups(shape("gpt-oss-20b").layout("bfloat16"), 16)
    other = kv_cache_groups(shape("gpt-oss-20b").layout("fp8"), 16)
    with pytest.raises(InvalidArgumentError, match="the same pages"):
        KVCacheConfig((groups[0], other[1]), 10)
    with pytest.raises(InvalidArgumentError, match="each of the model's layers"):
        KVCacheConfig((groups[0],), 10)


def test_a_group_spec_owns_its_prefix_match_unit():
    layout = shape("gpt-oss-20b").layout("bfloat16")
    groups = kv_cache_groups(layout, 528, prefix_match_unit=16)
    assert {group.prefix_match_unit for group in groups} == {16}
    assert KVCacheConfig(groups, 10).prefix_match_unit == 16
    with pytest.raises(InvalidArgumentError, match="must divide block_size 528"):
        kv_cache_groups(layout, 528, prefix_match_unit=100)
    whole = kv_cache_groups(layout, 528)
    with pytest.raises(InvalidArgumentError, match="prefix_match_unit"):  # one manager serves every group
        KVCacheConfig((groups[0], whole[1]), 10)


def test_blocks_per_request():
    assert FullAttentionSpec().blocks_per_request(131072, 16, 8192) == 131072 // 16
    assert SlidingWindowSpec(1024).blocks_per_request(131072, 16, 8192) == cdiv(1024 - 1 + 8192, 16) + 1
    assert SlidingWindowSpec(1024).blocks_per_request(100, 16, 8192) == cdiv(100, 16) + 1  # never more than it


def test_gemma3_pools_engine_and_vllm_are_one():
    sizing = size_model(shape("gemma-3-4b-it"), gpu_memory=80 * GiB, gpu_memory_utilization=0.9)
    engine, all_full = sizing.pools
    page = 2 * 4 * 256 * 2 * 16
    window_blocks = cdiv(1024 - 1 + 8192, 16) + 1
    # vLLM V1: 7 groups of 5 layers share 5 tensors; a request takes blocks in each of them.
    assert (engine.bytes_per_block, all_full.bytes_per_block) == (page * 5, page * 34)
    assert engine.num_blocks == sizing.kv_memory // (page * 5)
    assert engine.blocks_per_request == 131072 // 16 + 6 * window_blocks
    assert all_full.num_blocks == sizing.kv_memory // (page * 34) and all_full.blocks_per_request == 131072 // 16
    assert f"{engine.max_concurrency:.2f}x" == "17.72x" and f"{all_full.max_concurrency:.2f}x" == "3.71x"


def test_gpt_oss_20b_at_128k_gets_vllms_concurrency():
    """The engine used to keep a tensor per layer for every block id: 9.09x, below the 9.67x of every layer as
    full attention; vLLM's layout (2 groups of 12 layers sharing 12 tensors) gives 18.19x."""
    sizing = size_model(shape("gpt-oss-20b"), gpu_memory=80 * GiB, gpu_memory_utilization=0.9)
    engine, all_full = sizing.pools
    page = 2 * 8 * 64 * 2 * 16
    assert engine.num_blocks == sizing.kv_memory // (page * 12)
    assert engine.blocks_per_request == 131072 // 16 + cdiv(128 - 1 + 8192, 16) + 1
    assert f"{engine.max_concurrency:.2f}x" == "18.19x" and f"{all_full.max_concurrency:.2f}x" == "9.67x"


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("24e9", 24 * 10**9),
                                            ("512 MiB", 512 * 2**20), ("1.5gib", 3 * 2**29), ("4096", 4096)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80 GiBs", "lots", "", "-1GB", "0"])
def test_parse_memory_refuses_what_is_not_memory(text):
    with pytest.raises(InvalidArgumentError, match="memory"):
        parse_memory(text)


def test_kvlab_size_prints_the_formula_and_the_pool(capsys):
    assert main(["size", "--model", str(CONFIGS / "Meta-Llama-3-8B"), "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "per token and layer: 2 (K and V) x 8 kv heads x 128 head_dim x 2 bytes (bfloat16) = 4,096 B" in out
    assert "per token, model:    4,096 B x 32 layers = 131,072 B (128.00 KiB)" in out
    assert f"= {2 * 8 * 128 * 2 * 32 * 16:,} B (2.00 MiB)" in out
    assert "Maximum concurrency for 8,192 tokens per request:" in out and "assumptions:" in out


def test_kvlab_size_prints_the_all_full_layout_beside_a_hybrid_models(capsys):
    config = CONFIGS / "gpt-oss-20b" / "config.json"
    assert main(["size", "--model", str(config), "--kv-cache-dtype", "fp8", "--max-model-len", "8192",
                 "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert f"per block id, kvlab engine and vLLM V1: {2 * 8 * 64 * 32:,} B x 12" in out
    assert f"per block id, every layer as full attention: {2 * 8 * 64 * 32:,} B x 24" in out
    assert "hybrid model:" in out


@pytest.mark.parametrize("dtype, row_bytes, formula", [
    # KIVI: codes (128 x 4 / 8 or 128 x 2 / 8 bytes) plus fp16 scale and zero: keys per channel over a group of
    # G tokens, spread over its rows (4 x 128 / G bytes a row); values per G channels (4 x 128 / G bytes)
    ("kivi_int4", 64 + 4 * 128 // 32 + 64 + 4 * 128 // 32,
     "8 kv heads x (K 80 B (kivi4_key_g32) + V 80 B (kivi4_value_g32) per 128-element row) = 1,280 B"),
    ("kivi_int2_g128", 32 + 4 + 32 + 4,
     "8 kv heads x (K 36 B (kivi2_key_g128) + V 36 B (kivi2_value_g128) per 128-element row) = 576 B"),
    # the calibrated int4: keys 128 / 2 packed bytes; values the same plus an fp16 scale and zero per 32 channels
    ("int4_calibrated_channel", 128 // 2 + 128 // 2 + 4 * 128 // 32,
     "8 kv heads x (K 64 B (int4_channel) + V 80 B (int4_token) per 128-element row) = 1,152 B"),
    ("k_fp16_v_fp8", 128 * 2 + 128, "8 kv heads x (K 256 B (float16) + V 128 B (fp8_e4m3) per 128-element row)"),
])
def test_kvlab_size_counts_integer_and_asymmetric_formats_by_their_rows(capsys, dtype, row_bytes, formula):
    sizing = size_model(shape("Meta-Llama-3-8B"), kv_cache_dtype=dtype, gpu_memory=80 * GiB, gpu_memory_utilization=0.9,
                        block_size=128)  # whole KIVI key groups of up to 128 tokens
    assert sizing.layout.bytes_per_token == 8 * row_bytes * 32
    assert main(["size", "--model", str(CONFIGS / "Meta-Llama-3-8B"), "--kv-cache-dtype", dtype,
                 "--block-size", "128"]) == 0
    assert f"per token and layer: {formula}" in capsys.readouterr().out


def test_kvlab_size_sets_kivis_full_precision_windows_aside(capsys):
    """A KIVI cache keeps each running sequence's newest R tokens in the model's dtype (bf16) beside the pages:
    256 sequences x R x 32 layers x (K and V x 8 kv heads x 128 x 2 B) come out of the KV memory before it is cut
    into blocks, as the engine's pool does (``kivi_window_bytes``)."""
    llama = shape("Meta-Llama-3-8B")
    options = dict(gpu_memory=80 * GiB, gpu_memory_utilization=0.9, block_size=128)
    r32 = size_model(llama, kv_cache_dtype="kivi_int4", kv_residual_length=32, **options)
    window = 256 * 32 * 32 * (2 * 8 * 128 * 2)
    assert r32.window_bytes == window == GiB
    assert r32.kv_memory == size_model(llama, kv_cache_dtype="fp8", **options).kv_memory - window
    assert size_model(llama, kv_cache_dtype="kivi_int4", **options).window_bytes == 4 * window  # R = block size
    assert main(["size", "--model", str(CONFIGS / "Meta-Llama-3-8B"), "--kv-cache-dtype", "kivi_int2",
                 "--block-size", "64", "--kv-residual-length", "32", "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    assert f"KIVI windows    32.00 MiB  (the newest tokens in full precision beside the pages: 8 sequences x " \
           f"R 32 tokens x 131,072 B per token in bfloat16 = {32 * 2**20:,} B)" in out
    for dtype, residual, message in (("kivi_int4", 48, "must be a multiple of the key group 32 that divides"),
                                     ("fp8", 32, "kv_residual_length is the full-precision window of a KIVI")):
        with pytest.raises(InvalidArgumentError, match=message):
            size_model(llama, kv_cache_dtype=dtype, kv_residual_length=residual, **options)


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent"], "neither a config.json file nor a directory"),
    (["--model", str(CONFIGS / "SmolLM2-135M"), "--max-model-len", "9000"], "longer than the model's context"),
    (["--model", str(CONFIGS / "SmolLM2-135M"), "--gpu-memory", "lots"], "argument --gpu-memory: expected"),
    (["--model", str(CONFIGS / "SmolLM2-135M"), "--kv-cache-dtype", "int3"], "argument --kv-cache-dtype"),
    (["--model", str(CONFIGS / "SmolLM2-135M"), "--block-size", "0"], "argument --block-size"),
    (["--model", str(CONFIGS / "SmolLM2-135M"), "--gpu-memory-utilization", "1.5"], "gpu memory utilization"),
])
def test_bad_input_is_one_error_line_and_exit_status_2(argv, message, capsys):
    try:
        status = main(["size", *argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and message in err[-1] and err[-1].startswith("kvlab size: error:"), err


def test_a_config_without_model_type_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    assert main(["size", "--model", str(tmp_path)]) == 2
    assert "needs a model_type that transformers knows" in capsys.readouterr().err
