"""The parts of a Llama/Qwen3/DeepSeek-V3 decoder layer that are not attention: RMSNorm, rotary embeddings,
SwiGLU, DeepSeek-V3's mixture of experts, and the merged projections they use.

Each computes exactly what ``transformers`` computes (same dtypes at the same places), so that fp32 logits
match Hugging Face's to rounding.
"""

import torch
from torch import nn

from kvlab.engine.config import ModelConfig, rope_parameters


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, normalised in fp32 and cast back before the weight (as HF)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MergedLinear(nn.Linear):
    """Several projections of the same input as one GEMM (vLLM's ``QKVParallelLinear`` and
    ``MergedColumnParallelLinear``): their matrices stacked by output rows, in the order of ``parts`` (the
    checkpoint's module name of each, beside this one, -> its output size). ``kvlab.engine.weights`` loads each
    part's tensor into its rows. One GEMM reads the same weights as the separate ones, with fewer calls and
    fewer threads woken; on CPU (MKL) each output column is the same dot product, so the result is bitwise
    that of the separate projections. ``[T, in]`` -> ``[T, out_1]``, ``[T, out_2]`` ..."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(list(self.parts.values()), dim=-1)


class SwiGLU(nn.Module):
    """The MLP: down(silu(gate(x)) * up(x)); [T, hidden] -> [T, hidden]. gate and up are one GEMM.
    ``intermediate_size``: the config's unless given (an expert's)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        hidden, bias = config.hidden_size, config.mlp_bias
        inner = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inner, "up_proj": inner}, bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)


class TopkRouter(nn.Module):
    """DeepSeek-V3's router (``MoEConfig`` says how it routes): ``[T, hidden]`` -> each token's experts
    ``[T, top_k]`` and their weights (fp32). Its weight and score-correction bias stay in fp32 whatever the
    model's dtype (``FP32_PARAMETERS``: ``kvlab.engine.weights`` loads them so), as transformers and vLLM keep
    them: the bias shifts scores by small amounts that bf16 would round away, changing which experts win."""

    FP32_PARAMETERS = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.moe = config.moe
        self.weight = nn.Parameter(torch.zeros(self.moe.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.moe.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        corrected = scores + self.e_score_correction_bias                         # used to choose only
        grouped = corrected.view(-1, moe.n_group, moe.n_routed_experts // moe.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)                    # [T, n_group]
        best_groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices
        in_best = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        corrected = grouped.masked_fill(~in_best[..., None], float("-inf")).flatten(1)
        experts = corrected.topk(moe.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * moe.routed_scaling_factor


class SparseMoE(nn.Module):
    """DeepSeek-V3's MoE MLP: each token's routed experts' outputs, weighted, plus the shared experts' output.
    A plain loop over the experts some token chose (as transformers' eager path): simple, and as fast as
    anything on CPU for tiny models; a GPU would want grouped GEMMs. [T, hidden] -> [T, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(SwiGLU(config, moe.moe_intermediate_size) for _ in range(moe.n_routed_experts))
        self.shared_experts = SwiGLU(config, moe.moe_intermediate_size * moe.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x)
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            tokens, choice = (experts == expert).nonzero(as_tuple=True)
            routed = self.experts[expert](x[tokens]) * weights[tokens, choice, None]
            out.index_add_(0, tokens, routed.to(x.dtype))
        return out + self.shared_experts(x)


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim / 2]`` and the factor cos/sin are scaled by (1 except YaRN-like
    types). The plain variant is one line; the scaled ones come from transformers' own helpers (which read
    the rotary dim from the config's ``head_dim``: DeepSeek's config sets it to ``qk_rope_head_dim``)."""
    params = rope_parameters(config.hf_config)
    if config.rope_type == "default":
        exponents = torch.arange(0, config.rotary_dim, 2, dtype=torch.int64).float() / config.rotary_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[config.rope_type](config.hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding:
    """Rotary position embedding: ``at(positions [T])`` gives the cos/sin of one step's positions, computed in
    fp32 as HF does (position times inverse frequency) and cast to the model dtype. Computed per step, not
    tabled: a table for every position would cost memory in proportion to the context (gigabytes for a
    million-token config, and a config's ``max_position_embeddings`` may be anything)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        inv_freq, self.scaling = rope_frequencies(config)
        self.inv_freq, self.dtype = inv_freq.to(device), dtype

    def at(self, positions: torch.Tensor) -> "Rotation":
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]       # [T, 1, D]
        return Rotation((angles.cos() * self.scaling).to(self.dtype), (angles.sin() * self.scaling).to(self.dtype))


class Rotation:
    """One step's cos/sin ``[T, 1, D]``; ``apply`` rotates q ``[T, H, D]`` and k ``[T, KH, D]``, pairing
    features (i, i + D/2); ``apply_interleaved`` pairs (2i, 2i + 1), DeepSeek's layout."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def apply(self, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos, self.sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def apply_interleaved(self, q: torch.Tensor, k: torch.Tensor):
        """Rotate pairs (2i, 2i + 1) by frequency i, returned as [rotated evens, rotated odds] (transformers'
        ``apply_rotary_pos_emb_interleave``): the same permutation of q and k, so q.k is that of the rotated
        interleaved vectors; the cache keeps k in this order, and every query is rotated the same way."""
        half = self.cos.shape[-1] // 2
        cos, sin = self.cos[..., :half], self.sin[..., :half]

        def rotate(x):
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

        return rotate(q), rotate(k)
