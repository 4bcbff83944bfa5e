"""Merged projections (q/k/v as one GEMM, gate/up as another): the same numbers as the separate projections
a checkpoint holds, and each part's tensor loaded into its own rows."""

import torch
from torch import nn

from kvlab.engine.config import load_model_config
from kvlab.engine.layers import MergedLinear
from kvlab.engine.weights import checkpoint_layout, load_model


def test_a_merged_projection_is_bitwise_its_separate_parts():
    torch.manual_seed(0)
    parts = {"q_proj": 48, "k_proj": 16, "v_proj": 16}
    separate = {name: nn.Linear(32, size, bias=True) for name, size in parts.items()}
    merged = MergedLinear(32, parts, bias=True)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([p.weight for p in separate.values()]))
        merged.bias.copy_(torch.cat([p.bias for p in separate.values()]))
    for tokens in (1, 8, 77):  # a decode batch and a prompt
        x = torch.randn(tokens, 32)
        for out, part in zip(merged(x), separate.values(), strict=True):
            assert torch.equal(out, part(x))


def test_checkpoint_names_map_to_rows_of_the_merged_parameters(llama):
    model = load_model(load_model_config(llama[0]), torch.float32, torch.device("cpu"))
    layout = checkpoint_layout(model)
    attention = model.model.layers[0].self_attn
    q_size, kv_size = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    prefix = "model.layers.0.self_attn"
    assert layout[f"{prefix}.q_proj.weight"] == (f"{prefix}.qkv_proj.weight", slice(0, q_size))
    assert layout[f"{prefix}.v_proj.weight"] == (f"{prefix}.qkv_proj.weight", slice(q_size + kv_size,
                                                                                     q_size + 2 * kv_size))
    assert layout["model.layers.1.mlp.up_proj.weight"][0] == "model.layers.1.mlp.gate_up_proj.weight"
    assert layout["model.norm.weight"] == ("model.norm.weight", slice(None))
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in layout)  # only checkpoint names
