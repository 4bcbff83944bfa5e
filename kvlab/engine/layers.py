"""The parts of a Llama/Qwen3 decoder layer that are not attention: RMSNorm, rotary embeddings, SwiGLU, and the
merged projections both use.

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
    """The MLP: down(silu(gate(x)) * up(x)); [T, hidden] -> [T, hidden]. gate and up are one GEMM."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inner, "up_proj": inner}, bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` and the factor cos/sin are scaled by (1 except YaRN-like
    types). The plain variant is one line; the scaled ones come from transformers' own helpers."""
    params = rope_parameters(config.hf_config)
    if config.rope_type == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
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
    """One step's cos/sin ``[T, 1, D]``; ``apply`` rotates q ``[T, H, D]`` and k ``[T, KH, D]``."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def apply(self, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos, self.sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
