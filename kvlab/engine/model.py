"""Llama / Qwen3 / DeepSeek-V3 decoder-only models in plain torch. Module names follow Hugging Face's
(``model.layers.0.self_attn.o_proj.weight`` ...), so a checkpoint's tensors load by name, except the merged
projections (``qkv_proj``, ``gate_up_proj``, DeepSeek's ``qkv_a_proj``: ``kvlab.engine.layers.MergedLinear``),
which load their parts' tensors (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``;
``q_a_proj``, ``kv_a_proj_with_mqa``) into their rows."""

import torch
from torch import nn

from kvlab.engine.attention import AttentionBatch, PagedLatentAttention, PagedSelfAttention
from kvlab.engine.config import ModelConfig
from kvlab.engine.layers import RMSNorm, RotaryEmbedding, SparseMoE, SwiGLU


class DecoderLayer(nn.Module):
    """One layer: attention over the paged cache (K/V heads, or DeepSeek's latent attention), then the MLP
    (DeepSeek-V3: a mixture of experts from layer ``first_k_dense_replace`` on)."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedSelfAttention(config) if config.mla is None else PagedLatentAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = config.moe is not None and index >= config.moe.first_k_dense_replace
        self.mlp = SparseMoE(config) if sparse else SwiGLU(config)

    def forward(self, h, rotation, kv_cache, batch):
        h = h + self.self_attn(self.input_layernorm(h), rotation, kv_cache, batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` runs one step's new tokens (flattened across sequences) through every layer; the caller
    picks the rows it wants logits for (each prefill sequence's last token, every decode token)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # built by ``init_rope`` once the device and dtype are known

    def init_rope(self, dtype: torch.dtype, device) -> None:
        self.rope = RotaryEmbedding(self.config, dtype, device)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batches: list[AttentionBatch],
                kv_caches: list) -> torch.Tensor:
        """input_ids, positions int64 ``[T]`` -> hidden states ``[T, hidden]`` (final norm applied);
        ``batches`` and ``kv_caches``: one attention batch (shared by the layers of a KV cache group) and one
        paged cache per layer."""
        h = self.model.embed_tokens(input_ids)
        rotation = self.rope.at(positions)  # once per step, shared by every layer
        for layer, batch, kv_cache in zip(self.model.layers, batches, kv_caches, strict=True):
            h = layer(h, rotation, kv_cache, batch)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> fp32 logits ``[R, vocab]``."""
        return self.lm_head(hidden).float()
