"""KV cache formats by name, and what one K or V row (one token, one KV head) costs in each.

A format stores K and V each with a *codec*: a float type (``float32`` ... ``fp8_e5m2``), or one of kvlab's
4-bit integer codecs, KIVI-style (Liu et al., ICML 2024: keys quantized per channel, values per token):

* ``int4_channel`` (keys): one 4-bit code per element, two packed in a byte; the scale and zero of each
  (layer, KV head, channel) come from a calibration pass and live beside the cache, not in it.
* ``int4_token`` (values): the same packing, plus an fp16 scale and an fp16 zero for every group of
  ``value_group(head_dim)`` channels of the row, stored in the row itself (4 bytes per group).

Names are vLLM's ``kv_cache_dtype`` spellings ("fp8" is "fp8_e4m3", as vLLM on CUDA), torch's float names, and
two of kvlab's: "int4_kivi" (the two integer codecs) and "k_fp16_v_fp8" (asymmetric: K in fp16, V in fp8
e4m3). This module is pure Python: ``kvlab size`` uses it without loading torch.
"""

import math

from kvlab.errors import InvalidArgumentError

#: Channels per value group in int4_token (KIVI uses 32 or 128): the largest divisor of head_dim up to this.
INT4_VALUE_GROUP = 32
#: Codec -> bits per element (the integer codecs' per-group scales are added by ``row_bytes``).
CODEC_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8,
              "int4_channel": 4, "int4_token": 4}
#: Format name -> (K codec, V codec).
KV_FORMATS = {
    "float32": ("float32",) * 2, "fp32": ("float32",) * 2, "float16": ("float16",) * 2, "fp16": ("float16",) * 2,
    "half": ("float16",) * 2, "bfloat16": ("bfloat16",) * 2, "bf16": ("bfloat16",) * 2,
    "fp8": ("fp8_e4m3",) * 2, "fp8_e4m3": ("fp8_e4m3",) * 2, "fp8_e5m2": ("fp8_e5m2",) * 2,
    "int4_kivi": ("int4_channel", "int4_token"), "k_fp16_v_fp8": ("float16", "fp8_e4m3"),
}
#: What ``LLM(kv_cache_dtype=...)`` takes: "auto" (the model's dtype, unquantized) and the quantized formats.
ENGINE_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4_kivi", "k_fp16_v_fp8")


def check_kv_format(name) -> str:
    if not isinstance(name, str) or name not in KV_FORMATS:
        raise InvalidArgumentError(f"unknown KV cache dtype {name!r}; known: {', '.join(KV_FORMATS)}")
    return name


def cache_format(kv_cache_dtype, model_dtype: str) -> str:
    """The format a ``kv_cache_dtype`` setting stores K and V in: "auto" is ``model_dtype`` (the dtype the model
    runs in, a float name), any other name is itself, checked. ``kvlab size`` and the engine both ask here."""
    return check_kv_format(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)


def value_group(head_dim: int) -> int:
    """Channels sharing one scale and zero in an int4_token row: gcd(head_dim, 32) (32 for head_dim 64 or 128)."""
    return math.gcd(head_dim, INT4_VALUE_GROUP)


def row_bytes(codec: str, n: int) -> int:
    """Bytes of one row of ``n`` elements in ``codec`` (int4: two codes a byte, ``n`` even)."""
    if codec == "int4_token":
        return n // 2 + 4 * (n // value_group(n))
    return n * CODEC_BITS[codec] // 8


def is_float_format(name: str) -> bool:
    """K and V both in one float type of at least 16 bits (no scales)."""
    return all(CODEC_BITS[codec] >= 16 for codec in KV_FORMATS[name]) and len(set(KV_FORMATS[name])) == 1
