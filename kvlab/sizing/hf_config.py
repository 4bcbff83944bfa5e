"""The numbers sizing needs from a Hugging Face ``config.json``: the KV layout, and a weight estimate.

``transformers`` parses the file with the config class of its ``model_type`` (so fields a published config
leaves out get that class's defaults, as they do when the model is served: Gemma-3-4B's ``config.json``
states neither its KV heads nor its 5:1 sliding/full pattern), and a multimodal config is reduced to its
text model (``text_config``). Each layer's kind comes from ``layer_types`` when the config has it (newer
transformers derive it from Gemma 3's ``sliding_window_pattern``); without it a ``sliding_window`` applies to
every layer (Mistral). MLA is recognised by ``kv_lora_rank``. A hybrid state model (``STATE_MODELS``:
Qwen3-Next's gated delta net and Jamba's Mamba layers, which transformers lists as ``linear_attention``, beside
full attention; Falcon-H1's ``hybrid`` layers, each a full-attention layer and a Mamba-2 mixer side by side)
also gets each state layer's fixed state per request, in elements, from the shapes vLLM's
``get_mamba_state_shape_from_config`` gives (at tensor parallel size 1).

Parameters (for the weight estimate, ``kvlab.sizing.plan``): embeddings (and an untied LM head), the
attention projections (MLA's low-rank ones for DeepSeek), the MLP (SwiGLU: 3 matrices; for mixture-of-experts
models every routed and shared expert plus the router). Not counted: norms and biases (under 0.1% for the
models here), vision towers, and DeepSeek's multi-token-prediction layers.

Every number sizing reads is checked first, once as the file states it and once as transformers resolved it
(defaults and ``text_config`` included), against ``SIZE_FIELDS``: what the model's own code needs (no zero-width
layer, every KV head serving the same number of query heads, even rotary dims) and bounds far past any
published model that keep the figures within what sizing can hold. A model that is not a decoder of
attention layers (Mamba and recurrent blocks, linear attention, encoders) is refused as not supported,
except the hybrid state models in ``STATE_MODELS``.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvlab.errors import InvalidArgumentError
from kvlab.extras import require
from kvlab.sizing.layout import KVLayout
from kvlab.validation import is_int

#: Assumed when a config states no dtype.
DEFAULT_DTYPE = "bfloat16"
#: The largest context, window or token count sizing takes (4.3 billion tokens; published contexts reach 10M).
MAX_TOKENS = 2**32
#: config.json's sizes -> (smallest, largest) allowed. The upper bounds are far past any published model (at most
#: ~128 layers and heads, head_dim 256, an MLA latent of 576, 53k-wide MLPs, 262k vocabularies, 256 experts)
#: and keep sizing's figures in reach: it holds one entry per layer, and the memory budget is float arithmetic.
SIZE_FIELDS = {
    "num_hidden_layers": (1, 2**16), "num_attention_heads": (1, 2**16), "num_key_value_heads": (1, 2**16),
    "head_dim": (1, 2**16), "hidden_size": (1, 2**20), "intermediate_size": (1, 2**20), "vocab_size": (1, 2**24),
    "max_position_embeddings": (1, MAX_TOKENS),
    # MLA (kv_lora_rank set): the latent's rank, the query's optional one, and each head's parts
    "kv_lora_rank": (1, 2**16), "q_lora_rank": (1, 2**16), "qk_rope_head_dim": (1, 2**16),
    "qk_nope_head_dim": (1, 2**16), "v_head_dim": (1, 2**16),
    # mixture of experts: each model's name for its routed experts, shared experts, the leading dense layers
    "moe_intermediate_size": (1, 2**20), "num_local_experts": (1, 2**16), "n_routed_experts": (1, 2**16),
    "num_experts": (1, 2**16), "n_shared_experts": (0, 2**16), "first_k_dense_replace": (0, 2**16),
    # gated delta net (Qwen3-Next's linear attention): its heads, head sizes and convolution width
    "linear_num_key_heads": (1, 2**16), "linear_num_value_heads": (1, 2**16), "linear_key_head_dim": (1, 2**16),
    "linear_value_head_dim": (1, 2**16), "linear_conv_kernel_dim": (1, 2**16),
    # Mamba (Jamba): the inner width's factor over hidden_size, the SSM state size and the convolution width
    "mamba_expand": (1, 2**8), "mamba_d_state": (1, 2**16), "mamba_d_conv": (1, 2**16),
    # Mamba-2 (Falcon-H1): the inner width (null: mamba_expand x hidden_size), its heads and the B/C groups
    "mamba_d_ssm": (1, 2**20), "mamba_n_heads": (1, 2**16), "mamba_n_groups": (1, 2**16),
}
#: Sizes a config may leave null (absent: the class's default applies): as many kv heads as query heads,
#: head_dim hidden / heads, no MLA, a full-rank query, a dense model, a Mamba-2 width of mamba_expand x hidden.
OPTIONAL_FIELDS = {"num_key_value_heads", "head_dim", "kv_lora_rank", "q_lora_rank", "moe_intermediate_size",
                   "num_local_experts", "n_routed_experts", "num_experts", "n_shared_experts", "first_k_dense_replace",
                   "mamba_d_ssm"}
MLA_FIELDS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # required when kv_lora_rank is set
#: The layer kinds sizing describes; fields a text config must have to be sized.
LAYER_KINDS = ("full_attention", "sliding_attention")
REQUIRED_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                   "intermediate_size", "vocab_size", "max_position_embeddings")
SUPPORTED = ("kvlab size supports decoder-only transformers whose config states num_key_value_heads and whose "
             "every layer is full or sliding-window attention (e.g. llama, mistral, qwen2, qwen3, gemma2, gemma3, "
             "gpt_oss, deepseek_v3), and of hybrid state models qwen3_next, jamba and falcon_h1 (not other Mamba "
             "hybrids yet)")


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
    # A hybrid state model's state layers, as KV cache layer indices, and what each keeps per request, in
    # elements: its convolution's last inputs and its recurrent state. Qwen3-Next and Jamba: the model's layer
    # indices (layer_windows then lists the other layers, in order). Falcon-H1 (parallel_state): each of its N
    # layers runs attention and a Mamba-2 mixer side by side, and vLLM makes each mixer a cache layer of its
    # own, so layer_windows lists the N attention layers (cache layers 0 .. N - 1), the mixers are N .. 2N - 1.
    state_layers: tuple = ()
    conv_state_elements: int = 0
    recurrent_state_elements: int = 0
    parallel_state: bool = False

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (a parallel hybrid's layer holds an attention and a state layer)."""
        return len(self.layer_windows) + (0 if self.parallel_state else len(self.state_layers))

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


def _read_json_object(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # ValueError: invalid JSON or invalid UTF-8
        raise InvalidArgumentError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"{file} must hold a JSON object ({{\"field\": value, ...}}), got a "
                                   f"{type(raw).__name__}")
    return raw


def _check_sizes(get, present, file: Path) -> None:
    """The ``SIZE_FIELDS`` that ``present(name)``, read with ``get(name)``: the raw JSON's (before transformers
    sees them, so the message names the field whatever transformers' version checks) or the parsed config's."""
    mla = get("kv_lora_rank") is not None
    for name, (low, high) in SIZE_FIELDS.items():
        if not present(name) or (name in MLA_FIELDS and not mla):
            continue
        value, optional = get(name), name in OPTIONAL_FIELDS
        if (value is None and not optional) or (value is not None and not (is_int(value) and low <= value <= high)):
            raise InvalidArgumentError(f"{file}: {name} must be an int from {low:,} to {high:,}"
                                       f"{' or null' if optional else ''}, got {value!r}")


def _check_raw(raw: dict, file: Path) -> None:
    """The fields sizing reads as the file states them: sizes, and the names it prints or weighs by."""
    sections = [raw] + ([raw["text_config"]] if isinstance(raw.get("text_config"), dict) else [])
    for section in sections:
        _check_sizes(section.get, section.__contains__, file)
        for name in ("dtype", "torch_dtype"):
            if section.get(name) is not None and not isinstance(section[name], str):
                raise InvalidArgumentError(f"{file}: {name} must be a dtype name such as \"bfloat16\" or absent, "
                                           f"got {section[name]!r}")
        if section.get("tie_word_embeddings") is not None and not isinstance(section["tie_word_embeddings"], bool):
            raise InvalidArgumentError(f"{file}: tie_word_embeddings must be true, false or absent, got "
                                       f"{section['tie_word_embeddings']!r}")
    names = raw.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise InvalidArgumentError(f"{file}: architectures must be a list of class names such as "
                                   f"[\"LlamaForCausalLM\"] or absent, got {names!r}")
    quantization = raw.get("quantization_config")
    if quantization is not None and not (isinstance(quantization, dict)
                                         and isinstance(quantization.get("quant_method", ""), str)):
        raise InvalidArgumentError(f"{file}: quantization_config must be a JSON object whose quant_method is a "
                                   f"name such as \"fp8\", got {quantization!r}")


def _check_supported(text, model_type: str, file: Path) -> None:
    """Refuse what is not a decoder of attention layers, naming what sizing supports."""
    missing = [name for name in REQUIRED_FIELDS if not hasattr(text, name)]
    kinds = getattr(text, "layer_types", None)
    allowed = LAYER_KINDS + ((STATE_MODELS[model_type][0],) if model_type in STATE_MODELS else ())
    other = dict.fromkeys(str(kind) for kind in kinds if kind not in allowed) if isinstance(
        kinds, (list, tuple)) else {}
    reason = ("it is an encoder-decoder model" if getattr(text, "is_encoder_decoder", False) else
              f"its config has no {', '.join(missing)}" if missing else
              f"layer_types has {', '.join(map(str, other))} layers" if other else None)
    if reason:
        raise InvalidArgumentError(f"{file}: {model_type} is not supported: {reason}; {SUPPORTED}")


def _check_shape(text, file: Path) -> None:
    """The parsed config's sizes, defaults included, and the rules the model's code relies on."""
    _check_sizes(lambda name: getattr(text, name, None), lambda name: hasattr(text, name), file)
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    tie = getattr(text, "tie_word_embeddings", None)
    if tie is not None and not isinstance(tie, bool):
        raise InvalidArgumentError(f"{file}: tie_word_embeddings must be true, false or absent, got {tie!r}")
    if getattr(text, "kv_lora_rank", None) is not None:  # MLA: no KV heads; the rotary part is qk_rope_head_dim
        rotary = ("qk_rope_head_dim", text.qk_rope_head_dim)
    else:
        if kv_heads is not None and heads % kv_heads:
            raise InvalidArgumentError(f"{file}: num_attention_heads ({heads}) must be a multiple of "
                                       f"num_key_value_heads ({kv_heads}): each KV head serves the same number of "
                                       "query heads")
        head_dim = getattr(text, "head_dim", None)  # None: hidden_size // heads, as the attention code takes it
        rotary = ("head_dim", head_dim) if head_dim is not None else (
            "head_dim (hidden_size // num_attention_heads)", text.hidden_size // heads)
    if rotary[1] % 2:
        raise InvalidArgumentError(f"{file}: {rotary[0]} must be even (rotary embeddings rotate pairs of "
                                   f"features), got {rotary[1]}")


def _layer_windows(text, file: Path, state_kind: str | None = None) -> tuple:
    """The attention layers' windows (a state model's ``state_kind`` layers are left out; a parallel hybrid's
    are full-attention layers, each with its state layer beside it)."""
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if kinds is not None and (not isinstance(kinds, (list, tuple)) or len(kinds) != text.num_hidden_layers):
        raise InvalidArgumentError(f"{file}: layer_types must list one of {', '.join(LAYER_KINDS)} for each of "
                                   f"the {text.num_hidden_layers} layers, got {kinds!r}")
    if state_kind == PARALLEL_KIND:
        kinds = ["full_attention" if kind == PARALLEL_KIND else kind for kind in kinds]
    elif state_kind is not None:
        kinds = [kind for kind in kinds if kind != state_kind]
        if not kinds:
            raise InvalidArgumentError(f"{file}: layer_types must be {state_kind} layers and at least one attention "
                                       f"layer ({', '.join(LAYER_KINDS)}), got {text.num_hidden_layers} "
                                       f"{state_kind} layers and no other")
    used = window is not None and (kinds is None or "sliding_attention" in kinds)  # a full model's is unused
    if used and not (is_int(window) and 1 <= window <= MAX_TOKENS):
        raise InvalidArgumentError(f"{file}: sliding_window must be an int from 1 to {MAX_TOKENS:,} or null, got "
                                   f"{window!r}")
    if kinds is None:
        return (window,) * text.num_hidden_layers
    # A sliding layer without a window (Qwen3 with use_sliding_window off) attends to everything.
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _gated_delta_net_state(text) -> tuple[int, int]:
    """(convolution, recurrent) state elements of one gated delta net layer, as vLLM shapes them: the
    convolution keeps its last ``kernel - 1`` inputs of q, k (key heads x key dim each) and v (value heads x
    value dim); the recurrent state is a key dim x value dim matrix per value head."""
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + (
        text.linear_num_value_heads * text.linear_value_head_dim)
    return ((text.linear_conv_kernel_dim - 1) * conv_dim,
            text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim)


def _mamba1_state(text) -> tuple[int, int]:
    """(convolution, SSM) state elements of one Mamba layer, as vLLM shapes them: the convolution keeps its
    last ``d_conv - 1`` inputs of the inner width (``mamba_expand x hidden_size``), the SSM ``d_state`` values
    per inner channel."""
    inner = text.mamba_expand * text.hidden_size
    return (text.mamba_d_conv - 1) * inner, inner * text.mamba_d_state


def _mamba2_state(text) -> tuple[int, int]:
    """(convolution, SSM) state elements of one Mamba-2 mixer, as vLLM's ``mamba2_state_shape`` gives them: the
    convolution keeps its last ``d_conv - 1`` inputs of x, B and C (the inner width ``mamba_d_ssm``, else
    ``mamba_expand x hidden_size``, and ``n_groups x d_state`` each for B and C); the SSM state is a
    ``d_head x d_state`` matrix per head."""
    inner = text.mamba_expand * text.hidden_size if text.mamba_d_ssm is None else text.mamba_d_ssm
    return ((text.mamba_d_conv - 1) * (inner + 2 * text.mamba_n_groups * text.mamba_d_state),
            text.mamba_n_heads * text.mamba_d_head * text.mamba_d_state)


#: The layer kind of a parallel hybrid (Falcon-H1): attention and a state layer side by side in one layer.
PARALLEL_KIND = "hybrid"
#: model_type -> (the state layers' kind in layer_types, their state elements): the hybrid state models sized.
STATE_MODELS = {"qwen3_next": ("linear_attention", _gated_delta_net_state),
                "jamba": ("linear_attention", _mamba1_state),
                "falcon_h1": (PARALLEL_KIND, _mamba2_state)}


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
    unreadable file, a model_type transformers does not know or sizing does not support, or a value the
    model's code would not accept (the message names the file, the field and what is allowed)."""
    require(("transformers",), "engine", "reading a Hugging Face config.json")
    from transformers import CONFIG_MAPPING  # imported here: transformers is slow to import, and an extra

    file = _config_file(path)
    raw = _read_json_object(file)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise InvalidArgumentError(f"{file}: needs a model_type that transformers knows (e.g. llama, qwen3, gemma3, "
                                   f"gpt_oss, deepseek_v3), got {model_type!r}")
    _check_raw(raw, file)
    try:
        text = CONFIG_MAPPING[model_type].from_dict(raw).get_text_config()
    except Exception as e:  # noqa: BLE001 - transformers' checks raise many types; each means a bad config
        message = " ".join(str(e).split())  # some span lines; kvlab size prints one
        raise InvalidArgumentError(f"{file}: transformers rejects this {model_type} config: {message}") from None
    _check_supported(text, model_type, file)
    _check_shape(text, file)
    state_kind, state_elements = STATE_MODELS.get(model_type, (None, None))
    layer_windows = _layer_windows(text, file, state_kind)
    first = len(layer_windows) if state_kind == PARALLEL_KIND else 0  # a parallel hybrid's: after its attention
    kinds = text.layer_types if state_kind else ()
    state_layers = tuple(first + i for i, kind in enumerate(kinds) if kind == state_kind)
    conv_state, recurrent_state = state_elements(text) if state_layers else (0, 0)
    heads, hidden = text.num_attention_heads, text.hidden_size
    mla = getattr(text, "kv_lora_rank", None) is not None
    text_raw = raw["text_config"] if isinstance(raw.get("text_config"), dict) else {}
    dtype = raw.get("dtype") or raw.get("torch_dtype") or text_raw.get("torch_dtype")
    files = sorted(file.parent.glob("*.safetensors")) if Path(path).is_dir() else []
    quantization = (raw.get("quantization_config") or {}).get("quant_method")
    head_dim = getattr(text, "head_dim", None)
    return ModelShape(
        name=file.parent.name if file.name == "config.json" else file.name, model_type=model_type,
        architecture=(raw.get("architectures") or [None])[0], dtype=dtype,
        num_heads=heads, num_kv_heads=heads if text.num_key_value_heads is None else text.num_key_value_heads,
        head_dim=(text.qk_nope_head_dim + text.qk_rope_head_dim if mla
                  else hidden // heads if head_dim is None else head_dim),
        hidden_size=hidden, intermediate_size=text.intermediate_size, vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings, layer_windows=layer_windows,
        mla_latent_dim=text.kv_lora_rank + text.qk_rope_head_dim if mla else None,
        parameters=parameter_count(text), quantization=quantization,
        weight_files_bytes=sum(f.stat().st_size for f in files) if files else None,
        state_layers=state_layers, conv_state_elements=conv_state, recurrent_state_elements=recurrent_state,
        parallel_state=state_kind == PARALLEL_KIND)
