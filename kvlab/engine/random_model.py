"""Write a randomly initialised Hugging Face model directory, for demos, CI and benchmarks where nothing can
be downloaded. The weights are random, so the text is noise, but every shape, kernel launch and byte of KV
cache is what the real model of that shape would cost."""

from pathlib import Path

import torch

#: Model shapes by name (Qwen3 architecture unless ``arch`` says otherwise). "qwen3-0.6b" is Qwen3-0.6B's
#: config (0.6B parameters, tied embeddings); "smollm2-135m" is SmolLM2-135M's (Llama, 135M parameters, tied
#: embeddings, the CPU benchmark's model); "tiny" runs in the Triton interpreter in seconds. Its output matrix
#: is untied and its weights wider than usual (std 0.2): a tiny tied model with the usual 0.02 mostly repeats
#: its last input token, and its top logits are so close that rounding could pick either.
SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                 tie_word_embeddings=False, initializer_range=0.2),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
}


def save_random_model(path, shape: str = "tiny", *, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """A model of ``SHAPES[shape]`` (plus ``overrides``, e.g. ``eos_token_id``) with random weights, saved to
    ``path`` as ``config.json`` + ``model.safetensors``. Returns the path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if not isinstance(shape, str) or shape not in SHAPES:
        from kvlab.errors import InvalidArgumentError

        raise InvalidArgumentError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    settings = dict(SHAPES[shape])
    config_class, model_class = ((LlamaConfig, LlamaForCausalLM) if settings.pop("arch", "qwen3") == "llama"
                                 else (Qwen3Config, Qwen3ForCausalLM))
    config = config_class(**{"rms_norm_eps": 1e-6, "rope_theta": 1000000.0,  # the 4.x spelling, 5.x reads it too
                             "bos_token_id": None, "eos_token_id": None, **settings, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    model.save_pretrained(path)
    return Path(path)
