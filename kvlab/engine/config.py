"""What the engine needs to know about a Hugging Face model directory, read from its ``config.json``.

``transformers`` parses the config (filling in each architecture's defaults); this module checks that the
model is one the engine implements and reduces it to the handful of numbers the model code uses.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.engine.errors import UnsupportedModelError, WeightsError

#: model_type in config.json -> whether attention normalises q and k per head (Qwen3's q_norm / k_norm).
ARCHITECTURES = {"llama": False, "qwen3": True}
#: Rotary variants whose frequencies do not depend on the current length (so one table serves every step).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    model_type: str
    hf_config: object          # the transformers config (rope helpers read it)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_type: str
    eos_token_ids: frozenset
    dtype: torch.dtype | None  # the dtype the weights were saved in, if the config says


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"cannot read {path}: {e}") from None


def _as_id_set(value) -> set:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def rope_parameters(hf_config) -> dict:
    """The config's rotary settings as one dict with ``rope_type`` and ``rope_theta``, from transformers 5
    (``rope_parameters``) or 4.x (``rope_theta`` + ``rope_scaling``, whose type key was once ``type``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def load_model_config(path) -> ModelConfig:
    """Read and check ``path/config.json``. Raises UnsupportedModelError for anything the engine cannot run."""
    from transformers import AutoConfig  # imported here: transformers is slow to import

    path = Path(path)
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path} is not a Hugging Face model directory: it has no config.json")
    raw = _read_json(path / "config.json")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} (architectures {raw.get('architectures')}) is not supported; "
            f"kvlab.engine runs {', '.join(sorted(ARCHITECTURES))}")
    hf = AutoConfig.from_pretrained(path)
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{path}: hidden_act {hf.hidden_act!r}; the MLP implemented here is SwiGLU "
                                    "(silu)")
    if getattr(hf, "use_sliding_window", False) or "sliding_attention" in (getattr(hf, "layer_types", None) or ()):
        raise UnsupportedModelError(f"{path}: sliding-window layers are not supported by kvlab.engine")
    rope_type = rope_parameters(hf)["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"{path}: rope type {rope_type!r} is not supported; supported: "
                                    f"{', '.join(ROPE_TYPES)}")
    num_heads, num_kv_heads = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{path}: {num_heads} attention heads is not a multiple of {num_kv_heads} kv heads")
    eos = _as_id_set(getattr(hf, "eos_token_id", None))
    if (path / "generation_config.json").is_file():
        eos |= _as_id_set(_read_json(path / "generation_config.json").get("eos_token_id"))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    return ModelConfig(
        path=path, model_type=model_type, hf_config=hf, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        rms_norm_eps=hf.rms_norm_eps, attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)), qk_norm=ARCHITECTURES[model_type],
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=hf.max_position_embeddings, rope_type=rope_type, eos_token_ids=frozenset(eos),
        dtype=DTYPES.get(dtype_name))
