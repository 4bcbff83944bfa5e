"""The numbers sizing needs from a Hugging Face ``config.json``: the KV layout, and a weight estimate.

``transformers`` parses the file with the config class of its ``model_type`` (so fields a published config
leaves out get that class's defaults, as they do when the model is served: Gemma-3-4B's ``config.json``
states neither its KV heads nor its 5:1 sliding/full pattern), and a multimodal config is reduced to its
text model (``text_config``). Each layer's kind comes from ``layer_types`` when the config has it (newer
transformers derive it from Gemma 3's ``sliding_window_pattern``); without it a ``sliding_window`` applies to
every layer (Mistral). MLA is recognised by ``kv_lora_rank``.

Parameters (for the weight estimate, ``kvlab.sizing.plan``): embeddings (and an untied LM head), the
attention projections (MLA's low-rank ones for DeepSeek), the MLP (SwiGLU: 3 matrices; for mixture-of-experts
models every routed and shared expert plus the router). Not counted: norms and biases (under 0.1% for the
models here), vision towers, and DeepSeek's multi-token-prediction layers.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvlab.errors import InvalidArgumentError
from kvlab.extras import require
from kvlab.sizing.layout import KVLayout

#: Assumed when a config states no dtype.
DEFAULT_DTYPE = "bfloat16"


class Parameters(NamedTuple):
    total: int
    embeddings: int       # the embedding table and an untied LM head
    routed_experts: int   # mixture-of-experts models' routed experts (0 for dense models)


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    architecture: str | None
    dtype: str | None          # the config's torch_dtype / dtype, None when it states none
    num_heads: int
    num_kv_heads: int
    head_dim: int              # MLA: the query/key head width, qk_nope_head_dim + qk_rope_head_dim
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_windows: tuple       # [num_layers]: each layer's window, None for full attention
    mla_latent_dim: int | None
    parameters: Parameters
    quantization: str | None   # quantization_config's quant_method (the weights are smaller than counted)
    weight_files_bytes: int | None  # the *.safetensors files' total size, when a model directory has them

    def layout(self, kv_cache_dtype: str) -> KVLayout:
        return KVLayout(self.num_kv_heads, self.head_dim, kv_cache_dtype, self.layer_windows, self.mla_latent_dim)


def _config_file(path) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"model must be a model directory or a config.json path, got {type(path).__name__}")
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InvalidArgumentError(f"{path} is neither a config.json file nor a directory holding one")
    return file


def _layer_windows(text, file: Path) -> tuple:
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        return (window,) * text.num_hidden_layers
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown or len(kinds) != text.num_hidden_layers:
        raise InvalidArgumentError(f"{file}: layer_types must give full_attention or sliding_attention for each of "
                                   f"the {text.num_hidden_layers} layers; got {sorted(unknown) or len(kinds)}")
    # A sliding layer without a window (Qwen3 with use_sliding_window off) attends to everything.
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _attention_parameters(t, h: int) -> int:
    if getattr(t, "kv_lora_rank", None) is not None:  # MLA: low-rank q (optional) and kv, then per-head up-projections
        qk_dim = t.qk_nope_head_dim + t.qk_rope_head_dim
        q_rank = getattr(t, "q_lora_rank", None)
        q = h * q_rank + q_rank * t.num_attention_heads * qk_dim if q_rank else h * t.num_attention_heads * qk_dim
        kv = (h * (t.kv_lora_rank + t.qk_rope_head_dim)
              + t.kv_lora_rank * t.num_attention_heads * (t.qk_nope_head_dim + t.v_head_dim))
        return q + kv + t.num_attention_heads * t.v_head_dim * h
    head_dim = getattr(t, "head_dim", None) or h // t.num_attention_heads
    kv_heads = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
    return 2 * h * t.num_attention_heads * head_dim + 2 * h * kv_heads * head_dim


def parameter_count(t) -> Parameters:
    """Parameters of the text model ``t`` (a transformers config), as the module docstring says."""
    h, layers = t.hidden_size, t.num_hidden_layers
    embeddings = t.vocab_size * h * (1 if getattr(t, "tie_word_embeddings", False) else 2)
    experts = (getattr(t, "num_local_experts", None) or getattr(t, "n_routed_experts", None)
               or getattr(t, "num_experts", None) or 0)
    dense_layers = layers if not experts else min(layers, getattr(t, "first_k_dense_replace", 0) or 0)
    expert = 3 * h * (getattr(t, "moe_intermediate_size", None) or t.intermediate_size)
    routed = (layers - dense_layers) * experts * expert
    shared_and_router = (layers - dense_layers) * ((getattr(t, "n_shared_experts", None) or 0) * expert + h * experts)
    total = (embeddings + layers * _attention_parameters(t, h) + dense_layers * 3 * h * t.intermediate_size
             + routed + shared_and_router)
    return Parameters(total, embeddings, routed)


def read_model_shape(path) -> ModelShape:
    """Read ``path`` (a model directory or a ``config.json``). Raises InvalidArgumentError for a missing or
    unreadable file, a model_type transformers does not know, or layers sizing cannot describe."""
    require(("transformers",), "engine", "reading a Hugging Face config.json")
    from transformers import CONFIG_MAPPING  # imported here: transformers is slow to import, and an extra

    file = _config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read {file}: {e}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise InvalidArgumentError(f"{file}: needs a model_type that transformers knows (e.g. llama, qwen3, gemma3, "
                                   f"gpt_oss, deepseek_v3), got {model_type!r}")
    try:
        text = CONFIG_MAPPING[model_type].from_dict(raw).get_text_config()
        heads, hidden = text.num_attention_heads, text.hidden_size
    except Exception as e:  # noqa: BLE001 - transformers' checks raise many types; each means a bad config
        raise InvalidArgumentError(f"{file}: transformers rejects this {model_type} config: {e}") from None
    mla = getattr(text, "kv_lora_rank", None) is not None
    dtype = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("torch_dtype")
    files = sorted(file.parent.glob("*.safetensors")) if Path(path).is_dir() else []
    quantization = (raw.get("quantization_config") or {}).get("quant_method")
    return ModelShape(
        name=file.parent.name if file.name == "config.json" else file.name, model_type=model_type,
        architecture=(raw.get("architectures") or [None])[0], dtype=dtype if isinstance(dtype, str) else None,
        num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=(text.qk_nope_head_dim + text.qk_rope_head_dim if mla
                  else getattr(text, "head_dim", None) or hidden // heads),
        hidden_size=hidden, intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings, layer_windows=_layer_windows(text, file),
        mla_latent_dim=text.kv_lora_rank + text.qk_rope_head_dim if mla else None,
        parameters=parameter_count(text), quantization=quantization,
        weight_files_bytes=sum(f.stat().st_size for f in files) if files else None)
