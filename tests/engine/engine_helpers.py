"""Tiny random Hugging Face models (the oracle) saved to disk for kvlab.engine to load, and the checks every
engine test shares. Shapes are tiny: the kernels run in the Triton interpreter on CPU."""

import torch

from kvlab.engine import LLM

VOCAB = 128
BLOCK_SIZE = 8
#: The tiny DeepSeek-V3's MLA and MoE (tiny_config): low-rank queries, a 32 + 16 latent, interleaved rope; 8 experts
#: in 4 groups, the best 2 groups compete for each token's 2 experts, plus one shared expert.
DEEPSEEK_V3 = dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=24, rope_interleave=True, first_k_dense_replace=1,
                   moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                   n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)


def tiny_config(arch: str, **overrides):
    """2 layers, head dim 32, 4 query heads on 2 kv heads, fp32. Weights are initialised wider than usual
    (std 0.1) so that greedy choices are clear-cut: the top two logits differ by far more than rounding.
    "deepseek_v3": 3 layers of MLA (``DEEPSEEK_V3``), a dense MLP in the first and MoE in the others; its
    ``rope_scaling`` override goes to the config's constructor, which standardises it."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    # Rope settings in the transformers 4.x spelling, which 5.x reads too.
    if arch == "llama":  # untied, with llama3 rope scaling
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=64))
    elif arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        del common["head_dim"]  # DeepSeek's head dims are DEEPSEEK_V3's
        config = DeepseekV3Config(**{**common, **DEEPSEEK_V3}, rope_theta=10000.0,
                                  rope_scaling=overrides.pop("rope_scaling", None))
    else:  # Qwen3: q/k norm, tied embeddings, plain rope
        config = Qwen3Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def save_tiny_model(arch: str, path, seed: int = 0, **overrides):
    """Build, save and return the HF model (eval mode, fp32). DeepSeek-V3's routers get random score-correction
    biases (transformers starts them at 0), so that routing depends on them."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if arch == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM as cls
    else:
        cls = LlamaForCausalLM if arch == "llama" else Qwen3ForCausalLM
    model = cls(tiny_config(arch, **overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the oracle generates exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, min_margin: float = 1e-3) -> list[int]:
    """HF ``generate(do_sample=False)`` for one prompt; asserts every choice is clear-cut (top-2 logit gap)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    for logits in out.logits:
        top2 = logits[0].topk(2).values
        assert top2[0] - top2[1] > min_margin, "the oracle's greedy choice is a near tie: pick another seed"
    return out.sequences[0, len(prompt):].tolist()


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("num_blocks", 64)
    return LLM(path, **kwargs)


def assert_pool_clean(llm: LLM) -> None:
    """Nothing in flight; the manager is consistent; every block is free (possibly still cached) and so is
    every CPU block."""
    assert not llm.has_unfinished_requests()
    manager = llm.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.num_free_cpu_blocks == manager.num_cpu_blocks
