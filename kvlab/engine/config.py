"""What the engine needs to know about a Hugging Face model directory, read from its ``config.json``.

``transformers`` parses the config (filling in each architecture's defaults); this module checks that the
model is one the engine implements and reduces it to the handful of numbers the model code uses.
"""

import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.engine.errors import ModelFileError, UnsupportedModelError
from kvlab.errors import InvalidArgumentError
from kvlab.extras import require
from kvlab.validation import is_int

#: model_type in config.json -> whether attention normalises q and k per head (Qwen3's q_norm / k_norm).
#: deepseek_v3: multi-head latent attention and mixture-of-experts layers (``MLAConfig``, ``MoEConfig``).
ARCHITECTURES = {"llama": False, "qwen3": True, "deepseek_v3": False}
#: Rotary variants whose frequencies do not depend on the current length (so they are computed once).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: config.json fields the model code uses -> their smallest allowed value (the context needs a prompt token and a
#: generated one).
INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1,
              "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2, "max_position_embeddings": 2}
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim")  # absent: as many as the query heads; hidden / heads
#: generation_config.json fields used as sampling defaults -> the SamplingParams field each one sets.
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens"}


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
    sampling_defaults: dict    # SamplingParams fields set by generation_config.json (see sampling_defaults)
    layer_windows: tuple = ()  # [num_layers]: each layer's sliding window in tokens, None for full attention
    mla: "MLAConfig | None" = None  # DeepSeek's multi-head latent attention; None: K/V heads (head_dim each)
    moe: "MoEConfig | None" = None  # DeepSeek's mixture-of-experts MLP; None: every layer's MLP is dense

    @property
    def rotary_dim(self) -> int:
        """Features of a query / key head that rope rotates: all of ``head_dim``, or MLA's decoupled part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3 multi-head latent attention. Each token's K and V of every head are projected
    (``kv_b_proj``) from one compressed latent of ``kv_lora_rank`` features (after its RMSNorm), and each
    head's key has ``qk_rope_head_dim`` more rotated features shared by all heads, so a layer caches one
    ``latent_dim = kv_lora_rank + qk_rope_head_dim`` row per token. Queries come from ``q_proj``, or with
    ``q_lora_rank`` from a low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj``. ``rope_interleave``: the
    rotated features pair as (0, 1), (2, 3) ... (DeepSeek's layout) instead of (i, i + D/2). ``softmax_scale``:
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale squared when the rope sets
    ``mscale_all_dim``."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3's mixture of experts (sigmoid scores, "noaux_tc" routing). Layers from
    ``first_k_dense_replace`` on replace the dense MLP with ``n_routed_experts`` SwiGLU experts of
    ``moe_intermediate_size``, of which each token uses ``num_experts_per_tok``, plus ``n_shared_experts``
    (one SwiGLU ``n_shared_experts`` times as wide) that every token uses. Routing: the experts are split into
    ``n_group`` groups, a group scored by its two best (bias-corrected) scores; the best ``topk_group`` groups
    compete for the token's experts; their weights are the uncorrected scores, normalised to sum to 1 when
    ``norm_topk_prob``, times ``routed_scaling_factor``."""
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool


def _read_json_object(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # ValueError: invalid JSON or invalid UTF-8
        raise ModelFileError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelFileError(f"{file} must hold a JSON object ({{\"field\": value, ...}}), got a {type(raw).__name__}")
    return raw


def _eos_ids(value, file: Path) -> set:
    """``eos_token_id`` as a set: null, one token id or a list of them."""
    if value is None:
        return set()
    ids = [value] if is_int(value) else value
    if not isinstance(ids, (list, tuple)) or not all(is_int(v) and v >= 0 for v in ids):
        raise ModelFileError(f"{file}: eos_token_id must be a token id (an int >= 0), a list of them or null, "
                             f"got {value!r}")
    return {int(v) for v in ids}


def sampling_defaults(raw: dict, file: Path, vocab_size: int) -> dict:
    """The sampling settings of ``generation_config.json`` as SamplingParams keyword arguments, the fields the
    file sets and no others (vLLM's ``generation_config="auto"``): temperature, top_p, top_k, and
    max_new_tokens as max_tokens; null means absent. ``do_sample: false`` is greedy whatever the temperature,
    as in transformers' ``generate``; without ``do_sample`` the file's temperature is used, as vLLM does (for
    transformers an absent ``do_sample`` is false). ``max_length`` counts the prompt too and is ignored."""
    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ModelFileError(f"{file}: do_sample must be true, false or absent, got {do_sample!r}")
    rules = {  # field -> (accepts the value, what is allowed)
        "temperature": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
        "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "top_k": (lambda v: is_int(v) and -1 <= v <= vocab_size,
                  f"an int from -1 to the vocabulary size {vocab_size} (0 or -1: no cut)"),
        "max_new_tokens": (lambda v: is_int(v) and v >= 1, "an int >= 1")}
    defaults = {}
    for name, param in GENERATION_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        accepts, allowed = rules[name]
        if not accepts(value):
            raise ModelFileError(f"{file}: {name} must be {allowed} or absent, got {value!r}")
        defaults[param] = value
    if do_sample is False:
        defaults["temperature"] = 0.0
    return defaults


def _check_numbers(get, file: Path, resolved: bool) -> None:
    """The sizes the model code uses, read with ``get(name)``: from the raw JSON (``resolved`` False: only the
    fields present are checked, before transformers sees them, so the message names the field whatever
    transformers' version says) or from the parsed config (``resolved``: every field, defaults included)."""
    for name, minimum in INT_FIELDS.items():
        value = get(name)
        if value is None and (not resolved or name in OPTIONAL_FIELDS):
            continue
        if not is_int(value) or value < minimum:
            raise ModelFileError(f"{file}: {name} must be an int >= {minimum}, got {value!r}")
    if get("head_dim") is not None and get("head_dim") % 2:
        raise ModelFileError(f"{file}: head_dim must be even (rotary embeddings rotate pairs of features), got "
                             f"{get('head_dim')}")
    eps = get("rms_norm_eps")
    if (eps is not None or resolved) and not _positive_number(eps):
        raise ModelFileError(f"{file}: rms_norm_eps must be a finite number > 0, got {eps!r}")


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(value) -> bool:
    return _number(value) and value > 0


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


def _layer_windows(hf, model_type: str, file: Path) -> tuple:
    """Each layer's sliding window (None: full attention), as transformers' Qwen3 decides it: a layer whose
    ``layer_types`` entry is "sliding_attention" sees the last ``sliding_window`` keys, and Qwen3Config sets
    ``sliding_window`` to None unless ``use_sliding_window`` (so such a layer is then full attention);
    ``layer_types`` defaults to sliding from layer ``max_window_layers`` on."""
    kinds = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    window = getattr(hf, "sliding_window", None)  # already None when use_sliding_window is off
    if model_type != "qwen3" and (window is not None or "sliding_attention" in kinds):
        raise UnsupportedModelError(f"{file}: sliding-window layers are supported for qwen3 only, not {model_type}")
    if len(kinds) != hf.num_hidden_layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(f"{file}: layer_types must list full_attention or sliding_attention for each "
                                    f"of the {hf.num_hidden_layers} layers, got {kinds}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelFileError(f"{file}: sliding_window must be an integer >= 1, got {window!r}")
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _int_field(hf, name: str, minimum: int, file: Path) -> int:
    value = getattr(hf, name, None)
    if not is_int(value) or value < minimum:
        raise ModelFileError(f"{file}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN attention-temperature factor (its reference code's ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla_config(hf, rope: dict, file: Path) -> MLAConfig:
    """The MLA sizes and softmax scale of a DeepSeek config. YaRN's ``mscale_all_dim`` sharpens the softmax
    by mscale squared (transformers' and vLLM's DeepSeek attention do the same); the rotary part's own
    attention factor scales cos/sin (``kvlab.engine.layers.RotaryEmbedding``)."""
    q_lora_rank = getattr(hf, "q_lora_rank", None)
    if q_lora_rank is not None:
        q_lora_rank = _int_field(hf, "q_lora_rank", 1, file)
    nope, rope_dim = _int_field(hf, "qk_nope_head_dim", 1, file), _int_field(hf, "qk_rope_head_dim", 2, file)
    if rope_dim % 2:
        raise ModelFileError(f"{file}: qk_rope_head_dim must be even (rotary embeddings rotate pairs of features), "
                             f"got {rope_dim}")
    interleave = getattr(hf, "rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ModelFileError(f"{file}: rope_interleave must be true or false, got {interleave!r}")
    scale = (nope + rope_dim) ** -0.5
    mscale_all_dim = rope.get("mscale_all_dim") or 0
    if rope["rope_type"] != "default" and mscale_all_dim:
        if not _number(mscale_all_dim) or not _positive_number(rope.get("factor")):
            raise ModelFileError(f"{file}: rope mscale_all_dim and factor must be finite numbers (factor > 0), got "
                                 f"{mscale_all_dim!r} and {rope.get('factor')!r}")
        scale *= _yarn_mscale(rope["factor"], mscale_all_dim) ** 2
    return MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=_int_field(hf, "kv_lora_rank", 1, file),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                     v_head_dim=_int_field(hf, "v_head_dim", 1, file), rope_interleave=interleave,
                     softmax_scale=scale)


def _moe_config(hf, raw: dict, file: Path) -> MoEConfig:
    """DeepSeek-V3's routing settings, checked so that every layer can route a token as transformers does:
    a group is scored by its best two experts, so each holds at least two, and the chosen groups hold at
    least ``num_experts_per_tok`` experts. The original checkpoints' ``scoring_func`` and ``topk_method``
    (which transformers ignores) must be V3's, sigmoid and noaux_tc: DeepSeek-V2's softmax routing is not
    implemented."""
    for name, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, wanted) != wanted:
            raise UnsupportedModelError(f"{file}: {name} {raw[name]!r} is not supported; kvlab's DeepSeek-V3 MoE "
                                        f"routes with {name} {wanted!r}")
    experts = _int_field(hf, "n_routed_experts", 1, file)
    groups = _int_field(hf, "n_group", 1, file)
    if experts % groups or experts // groups < 2:
        raise ModelFileError(f"{file}: n_routed_experts ({experts}) must split into n_group ({groups}) groups of "
                             "at least 2 experts each (a group is scored by its two best experts)")
    topk_group = _int_field(hf, "topk_group", 1, file)
    top_k = _int_field(hf, "num_experts_per_tok", 1, file)
    if topk_group > groups or top_k > topk_group * (experts // groups):
        raise ModelFileError(f"{file}: topk_group ({topk_group}) must be at most n_group ({groups}), and "
                             f"num_experts_per_tok ({top_k}) at most the experts of topk_group groups "
                             f"({topk_group} x {experts // groups})")
    factor, norm = getattr(hf, "routed_scaling_factor", None), getattr(hf, "norm_topk_prob", None)
    if not _positive_number(factor):
        raise ModelFileError(f"{file}: routed_scaling_factor must be a finite number > 0, got {factor!r}")
    if not isinstance(norm, bool):
        raise ModelFileError(f"{file}: norm_topk_prob must be true or false, got {norm!r}")
    return MoEConfig(first_k_dense_replace=_int_field(hf, "first_k_dense_replace", 0, file), n_routed_experts=experts,
                     num_experts_per_tok=top_k, moe_intermediate_size=_int_field(hf, "moe_intermediate_size", 1, file),
                     n_shared_experts=_int_field(hf, "n_shared_experts", 0, file), n_group=groups,
                     topk_group=topk_group, routed_scaling_factor=float(factor), norm_topk_prob=norm)


def load_model_config(path) -> ModelConfig:
    """Read and check ``path/config.json`` (and ``generation_config.json``'s end-of-sequence ids and sampling
    defaults). Raises
    ModelFileError for a missing directory or a file that is unreadable or holds a value that is not allowed,
    UnsupportedModelError for a model the engine cannot run."""
    require(("transformers",), "engine", "reading a Hugging Face model")
    from transformers import AutoConfig  # imported here: transformers is slow to import, and an extra

    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"model must be the path of a Hugging Face model directory (a str or "
                                   f"os.PathLike), got {type(path).__name__}")
    path = Path(path)
    file = path / "config.json"
    if not path.is_dir():
        raise ModelFileError(f"model directory {path} does not exist" if not path.exists() else
                             f"{path} is not a directory: pass the Hugging Face model's directory")
    if not file.is_file():
        raise ModelFileError(f"{path} is not a Hugging Face model directory: it has no config.json")
    raw = _read_json_object(file)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{file}: model_type {model_type!r} (architectures {raw.get('architectures')}) is not supported; "
            f"kvlab.engine runs {', '.join(sorted(ARCHITECTURES))}")
    _check_numbers(raw.get, file, resolved=False)
    for name, kind, allowed in (("layer_types", (list,), "a list of layer kinds"),
                                ("dtype", (str,), "a dtype name such as \"bfloat16\""),
                                ("torch_dtype", (str,), "a dtype name such as \"bfloat16\"")):
        if raw.get(name) is not None and not isinstance(raw[name], kind):  # transformers' own errors omit the name
            raise ModelFileError(f"{file}: {name} must be {allowed} or absent, got {raw[name]!r}")
    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' checks raise many types; each means a bad config.json
        raise ModelFileError(f"{file}: transformers rejects this {model_type} config: {e}") from None
    _check_numbers(lambda name: getattr(hf, name, None), file, resolved=True)
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{file}: hidden_act {hf.hidden_act!r}; the MLP implemented here is SwiGLU "
                                    "(silu)")
    layer_windows = _layer_windows(hf, model_type, file)
    try:
        rope = rope_parameters(hf)
    except (TypeError, ValueError) as e:  # rope_parameters / rope_scaling is not a mapping
        raise ModelFileError(f"{file}: rope_parameters (or rope_scaling) must be a JSON object: {e}") from None
    if not isinstance(rope["rope_type"], str) or rope["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModelError(f"{file}: rope type {rope['rope_type']!r} is not supported; supported: "
                                    f"{', '.join(ROPE_TYPES)}")
    if not _positive_number(rope["rope_theta"]):
        raise ModelFileError(f"{file}: rope_theta must be a finite number > 0, got {rope['rope_theta']!r}")
    num_heads = hf.num_attention_heads
    mla = moe = None
    if model_type == "deepseek_v3":
        mla, moe = _mla_config(hf, rope, file), _moe_config(hf, raw, file)
        # Every head gets its own K and V from the one latent (num_key_value_heads says nothing), and a
        # query / key head has both parts (transformers' DeepSeek config sets head_dim to the rotary part).
        num_kv_heads, head_dim = num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    else:
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(f"{file}: {num_heads} attention heads is not a multiple of {num_kv_heads} "
                                        "kv heads")
        head_dim = getattr(hf, "head_dim", None)
        if head_dim is None:
            if hf.hidden_size % num_heads:
                raise ModelFileError(f"{file}: hidden_size {hf.hidden_size} is not a multiple of num_attention_heads "
                                     f"{num_heads}, and no head_dim is given")
            head_dim = hf.hidden_size // num_heads
    eos = _eos_ids(getattr(hf, "eos_token_id", None), file)
    generation, defaults = path / "generation_config.json", {}
    if generation.is_file():
        generation_raw = _read_json_object(generation)
        eos |= _eos_ids(generation_raw.get("eos_token_id"), generation)
        defaults = sampling_defaults(generation_raw, generation, hf.vocab_size)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    return ModelConfig(
        path=path, model_type=model_type, hf_config=hf, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps,
        attention_bias=bool(getattr(hf, "attention_bias", False)), mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=ARCHITECTURES[model_type], tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=hf.max_position_embeddings, rope_type=rope["rope_type"],
        eos_token_ids=frozenset(eos), dtype=DTYPES.get(dtype_name), sampling_defaults=defaults,
        layer_windows=layer_windows, mla=mla, moe=moe)
