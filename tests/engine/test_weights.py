"""Loading a Hugging Face directory: sharded checkpoints, tied and untied output matrices, dtype casts."""

import json

import pytest
import torch

from engine_helpers import save_tiny_model
from kvlab.engine.config import load_model_config
from kvlab.engine.weights import checkpoint_layout, load_model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sharded_checkpoint_loads_every_tensor(arch, tmp_path):
    hf = save_tiny_model(arch, tmp_path, seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # overwrites with shards plus an index
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = load_model_config(tmp_path)
    model = load_model(config, torch.float32, torch.device("cpu"))
    ours, layout = dict(model.named_parameters(remove_duplicate=False)), checkpoint_layout(model)
    assert set(layout) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        param, rows = layout[name]
        torch.testing.assert_close(ours[param][rows], tensor, rtol=0, atol=0)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (arch == "qwen3") == config.tie_word_embeddings and config.qk_norm == (arch == "qwen3")


def test_weights_are_cast_to_the_engine_dtype(qwen3):
    config = load_model_config(qwen3[0])
    model = load_model(config, torch.float16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert config.dtype == torch.float32 and config.rope_type == "default" and config.head_dim == 32
