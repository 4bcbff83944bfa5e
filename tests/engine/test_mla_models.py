"""Tiny random DeepSeek-V3 models (multi-head latent attention, mixture of experts) served by the engine,
checked against Hugging Face token for token: one with low-rank queries and DeepSeek's interleaved rope, one
with full-rank queries, plain rope pairs and YaRN (whose mscale sharpens the softmax). Each layer caches one
latent row per token (kv_lora_rank + qk_rope_head_dim), in the bytes kvlab.sizing counts; prefix hits,
chunked prompts, preemption (recompute and swap), n > 1 forks and the offload tier move those rows."""

import json
import random

import pytest
import torch

from engine_helpers import assert_pool_clean, hf_greedy, make_llm, save_tiny_model
from kvlab.engine import SamplingParams
from kvlab.engine.errors import ModelFileError, UnsupportedModelError
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.step import BlockMoves
from kvlab.sizing import KVCacheConfig, KVLayout, kv_cache_groups
from kvlab.sizing.groups import bytes_per_block
from kvlab.sizing.hf_config import read_model_shape

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 4
VARIANTS = {
    "q_lora": {},
    "yarn": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False, n_group=2, topk_group=1,
                 rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                   mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
}
SEEDS = {"q_lora": 0, "yarn": 4}  # weights whose greedy choices on these prompts are all clear-cut (gap > 5e-3)


def require_deepseek_v3():
    import transformers

    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V3 (the oracle)")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory):
    """(variant, model directory, the HF model saved there)."""
    require_deepseek_v3()
    path = tmp_path_factory.mktemp(f"deepseek_v3_{request.param}")
    return request.param, path, save_tiny_model("deepseek_v3", path, seed=SEEDS[request.param],
                                                **VARIANTS[request.param])


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)  # token 0 is the oracle's pad token: left out
    return [[rng.randrange(1, 128) for _ in range(n)] for n in lengths]


def check_matches_hf(llm, hf, batch, max_tokens, n=1):
    outs = llm.generate(batch, SamplingParams(n=n, max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert [o.token_ids for o in out.outputs] == [hf_greedy(hf, prompt, max_tokens)] * n
    assert_pool_clean(llm)
    return outs


def test_the_config_is_read_as_mla_and_moe(deepseek):
    kind, path, hf = deepseek
    llm = make_llm(path, num_blocks=4)
    mla, moe = llm.model_config.mla, llm.model_config.moe
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.latent_dim) == (32, 16, 48)
    assert mla.q_lora_rank == (24 if kind == "q_lora" else None) and mla.rope_interleave == (kind == "q_lora")
    assert mla.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    if kind == "yarn":  # YaRN's mscale sharpens the softmax
        assert mla.softmax_scale > 1.2 * 48 ** -0.5
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.first_k_dense_replace) == (8, 2, 1)
    assert [type(layer.mlp).__name__ for layer in llm.model.model.layers] == ["SwiGLU", "SparseMoE", "SparseMoE"]


@pytest.mark.parametrize("settings", [
    dict(scheduling="v1", max_num_batched_tokens=7, max_num_seqs=3),  # chunks that end inside blocks
    dict(scheduling="v0", max_num_batched_tokens=64, max_num_seqs=3),  # whole prompts
])
def test_greedy_matches_hf(deepseek, settings):
    _, path, hf = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=64, **settings)
    check_matches_hf(llm, hf, prompts(1, (5, 19, 30)), 8)


def test_prefill_logits_match_hf(deepseek):
    """One prefill step's logits, a sequence that hits the other's cached prefix among them."""
    _, path, hf = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=32)
    first, tail = prompts(2, (13, 5))
    check_matches_hf(llm, hf, [first], 1)
    batch = [first[:8] + tail, tail]
    for prompt in batch:
        llm.add_request(prompt, SamplingParams(max_tokens=1))
    step = llm.scheduler.schedule()
    assert step.kind == "prefill" and step.entries[0].start == 8  # two cached blocks of the first prompt
    llm.runner.begin_step(step)
    logits = llm.runner.forward(step, step.entries)
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in batch])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_prefix_hit_and_a_chunked_prompt_match_hf(deepseek):
    """The second prompt shares 16 tokens (4 blocks) with the first, and its other 11 are prefilled in
    chunks of 5 beside the first's decodes."""
    _, path, hf = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=5, max_num_seqs=2)
    first, tail = prompts(3, (18, 11))
    ids = [llm.add_request(first, SamplingParams(max_tokens=10, **GREEDY))]
    outs, steps = {}, 0
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
        steps += 1
        if steps == 5:  # the first is decoding by now
            ids.append(llm.add_request(first[:16] + tail, SamplingParams(max_tokens=6, **GREEDY)))
    for request_id, prompt, max_tokens in zip(ids, (first, first[:16] + tail), (10, 6)):
        assert outs[request_id].outputs[0].token_ids == hf_greedy(hf, prompt, max_tokens)
    assert outs[ids[1]].metrics.num_cached_prompt_tokens == 16
    records = llm.step_dataframe()
    assert (records["kind"] == "mixed").sum() >= 2  # the second prompt's chunks ran beside decodes
    assert_pool_clean(llm)


def test_the_triton_backend_decodes_with_the_mla_kernel(deepseek, monkeypatch):
    """Decode steps run kvlab.kernels.mla_decode (interpreted here); prompts run the torch path."""
    import kvlab.engine.attention as attention

    _, path, hf = deepseek
    calls = []
    kernel = attention.mla_decode_unchecked
    monkeypatch.setattr(attention, "mla_decode_unchecked", lambda *args: calls.append(1) or kernel(*args))
    llm = make_llm(path, block_size=BLOCK, num_blocks=32, attention_backend="triton", max_num_seqs=2)
    check_matches_hf(llm, hf, prompts(4, (6, 11)), 4)
    assert len(calls) == 3 * 3  # 3 decode steps x 3 layers


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_hf(deepseek, mode):
    _, path, hf = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=10, preemption_mode=mode, max_num_seqs=3)
    check_matches_hf(llm, hf, prompts(8, (9, 10, 11)), 10)
    records = llm.step_dataframe()
    assert records["preempted"].sum() > 0
    if mode == "swap":
        assert records["blocks_swapped_out"].sum() > 0


def test_forked_samples_share_latent_blocks_and_copy_on_write(deepseek):
    _, path, hf = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=48, max_num_seqs=4)
    check_matches_hf(llm, hf, prompts(9, (6, 13)), 9, n=3)
    assert llm.step_dataframe()["cow_copies"].sum() > 0


def test_the_offload_tier_keeps_latent_blocks(deepseek):
    """A 16-token prefix evicted from a 9-block pool is offloaded and promoted back for the next prompt."""
    _, path, hf = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=9, num_offload_blocks=16)
    system, tail, evictor = prompts(5, (16, 3, 34))  # the evictor and its 2 written decodes: all 9 blocks
    for prompt in (system + tail, evictor, system + tail[::-1]):
        check_matches_hf(llm, hf, [prompt], 3)
    assert llm.block_manager.tier_stats.tier_hit_blocks == 4


def test_cache_bytes_are_what_sizing_counts(deepseek):
    """One [blocks, block_size, 48] latent tensor per layer, no V: 3 layers x 4 tokens x 48 x 4 bytes a block,
    what `kvlab size` reads from the same directory (KVLayout.mla_latent_dim): the engine's KV cache group is
    the one sizing lays out, latent pages included."""
    _, path, _ = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=24, preemption_mode="swap", num_cpu_blocks=5)
    cache = llm.kv_cache
    assert [tuple(t.shape) for t in cache.gpu] == [(24, BLOCK, 48)] * 3
    assert [tuple(t.shape) for t in cache.cpu] == [(5, BLOCK, 48)] * 3
    assert cache.bytes_per_block == 3 * BLOCK * 48 * 4
    assert sum(t.nbytes for t in cache.gpu) == 24 * cache.bytes_per_block
    assert sum(t.nbytes for t in cache.cpu) == 5 * cache.bytes_per_block
    sized = kv_cache_groups(read_model_shape(path).layout("float32"), BLOCK)
    assert llm.kv_cache_config.groups == sized and sized[0].mla_latent_dim == 48
    assert bytes_per_block(sized) == cache.bytes_per_block


def test_the_cache_lays_out_latent_pages_from_the_group_spec_alone():
    """No ModelConfig: a KVCacheConfig whose group spec has mla_latent_dim makes latent tensors (device, swap
    and tier alike), and whole latent pages move between them."""
    groups = kv_cache_groups(KVLayout(1, 8, "float32", (None, None), mla_latent_dim=12), BLOCK)
    cache = PagedKVCache(KVCacheConfig(groups, 6), torch.float32, torch.device("cpu"), num_cpu_blocks=2,
                         num_offload_blocks=3)
    assert [tuple(t.shape) for t in cache.gpu + cache.cpu + cache.tier] == (
        [(6, BLOCK, 12)] * 2 + [(2, BLOCK, 12)] * 2 + [(3, BLOCK, 12)] * 2)
    assert all(layer is tensor for layer, tensor in zip(cache.layer_caches, cache.gpu))
    assert cache.bytes_per_block == 2 * BLOCK * 12 * 4
    for layer, tensor in enumerate(cache.gpu):
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view_as(tensor) + 1000 * layer)
    pages = [tensor[4].clone() for tensor in cache.gpu]
    moves = BlockMoves()
    moves.add("swap_out", [(4, 1)])
    moves.add("copy", [(4, 0)])
    cache.apply(moves)
    for layer, page in enumerate(pages):
        assert torch.equal(cache.cpu[layer][1], page) and torch.equal(cache.gpu[layer][0], page)


def test_the_router_stays_fp32_in_a_bf16_model(deepseek):
    """As in transformers and vLLM: its small score-correction biases would round away in bf16."""
    _, path, _ = deepseek
    llm = make_llm(path, block_size=BLOCK, num_blocks=16, dtype=torch.bfloat16)
    gate = llm.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert llm.model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    out, = llm.generate([prompts(6, (7,))[0]], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("field, value, error, match", [
    ("scoring_func", "softmax", UnsupportedModelError, "scoring_func 'softmax' is not supported"),
    ("topk_method", "group_limited_greedy", UnsupportedModelError, "topk_method 'group_limited_greedy'"),
    ("n_group", 3, ModelFileError, r"n_routed_experts \(8\) must split into n_group \(3\) groups"),
    ("num_experts_per_tok", 5, ModelFileError, r"num_experts_per_tok \(5\) at most the experts of topk_group"),
    ("kv_lora_rank", 0, ModelFileError, "kv_lora_rank must be an int >= 1, got 0"),
])
def test_a_config_the_engine_cannot_run_faithfully_is_refused(tmp_path, field, value, error, match):
    require_deepseek_v3()
    save_tiny_model("deepseek_v3", tmp_path)
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), field: value}))
    with pytest.raises(error, match=match):
        make_llm(tmp_path)


def test_a_quantized_latent_cache_is_refused(deepseek):
    _, path, _ = deepseek
    with pytest.raises(UnsupportedModelError, match="MLA model, whose latent cache is kept in the model's dtype"):
        make_llm(path, kv_cache_dtype="fp8")
