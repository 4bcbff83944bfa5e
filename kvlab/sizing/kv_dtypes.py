"""KV cache formats by name, and what one K or V row (one token, one KV head) costs in each.

A format stores K and V each with a *codec*: a float type (``float32`` ... ``fp8_e5m2``), or one of kvlab's
integer codecs:

* ``int4_channel`` (keys): one 4-bit code per element, two packed in a byte; the scale and zero of each
  (layer, KV head, channel) come from a calibration pass and live beside the cache, not in it.
* ``int4_token`` (values): the same packing, plus an fp16 scale and an fp16 zero for every group of
  ``value_group(head_dim)`` channels of the row, stored in the row itself (4 bytes per group).
* ``kivi{b}_key_g{G}`` (keys, KIVI: Liu et al., ICML 2024): b-bit codes (b = 4 or 2, 8 / b a byte), per
  channel over a group of G consecutive tokens (positions gG .. gG + G - 1): each group has an fp16 scale and
  zero per channel (4 D bytes), spread over its G token rows (4 D / G bytes a row), so a row costs
  ``D b / 8 + 4 D / G`` bytes and no scale lives outside the cache. Computed from the group itself, no
  calibration.
* ``kivi{b}_value_g{G}`` (values, KIVI): b-bit codes per token, an fp16 scale and zero for every
  ``gcd(D, G)`` channels of the row, in the row.

Names are vLLM's ``kv_cache_dtype`` spellings ("fp8" is "fp8_e4m3", as vLLM on CUDA), torch's float names, and
kvlab's: "int4_calibrated_channel" (``int4_channel`` keys, ``int4_token`` values: calibrated key ranges, no
window; formerly "int4_kivi", which is refused now), "kivi_int4" and "kivi_int2" (KIVI with G = 32;
"kivi_int4_g64", "kivi_int2_g128", ... for another G in ``KIVI_GROUP_SIZES``; the full-precision window of
the last R tokens is a setting of the engine's and of ``kvlab size``: ``check_kivi_geometry``), and
"k_fp16_v_fp8" (asymmetric: K in fp16, V in fp8 e4m3). This module is pure Python: ``kvlab size`` uses it
without loading torch.
"""

import math
import re

from kvlab.errors import InvalidArgumentError

#: Channels per value group in int4_token (KIVI uses 32 or 128): the largest divisor of head_dim up to this.
INT4_VALUE_GROUP = 32
#: KIVI's group sizes kvlab offers (the paper uses 32 and 128); the first is "kivi_int4"'s and "kivi_int2"'s.
KIVI_GROUP_SIZES = (32, 64, 128, 16)
KIVI_BITS = (4, 2)
#: The old calibrated format's name, refused with a message naming its successors.
RENAMED_FORMATS = {"int4_kivi": "int4_calibrated_channel"}


def kivi_format(bits: int, group: int) -> str:
    """The format name of KIVI at ``bits`` with key groups of ``group`` tokens: "kivi_int4", "kivi_int2_g128"."""
    return f"kivi_int{bits}" + ("" if group == KIVI_GROUP_SIZES[0] else f"_g{group}")


def _kivi_codecs(bits: int, group: int) -> tuple:
    return f"kivi{bits}_key_g{group}", f"kivi{bits}_value_g{group}"


_KIVI_CODEC = re.compile(r"kivi(\d)_(key|value)_g(\d+)")

#: Codec -> bits per element (the integer codecs' per-group scales are added by ``row_bytes``).
CODEC_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8,
              "int4_channel": 4, "int4_token": 4,
              **{codec: bits for bits in KIVI_BITS for group in KIVI_GROUP_SIZES
                 for codec in _kivi_codecs(bits, group)}}
#: Format name -> (K codec, V codec).
KV_FORMATS = {
    "float32": ("float32",) * 2, "fp32": ("float32",) * 2, "float16": ("float16",) * 2, "fp16": ("float16",) * 2,
    "half": ("float16",) * 2, "bfloat16": ("bfloat16",) * 2, "bf16": ("bfloat16",) * 2,
    "fp8": ("fp8_e4m3",) * 2, "fp8_e4m3": ("fp8_e4m3",) * 2, "fp8_e5m2": ("fp8_e5m2",) * 2,
    "int4_calibrated_channel": ("int4_channel", "int4_token"), "k_fp16_v_fp8": ("float16", "fp8_e4m3"),
    **{kivi_format(bits, group): _kivi_codecs(bits, group) for bits in KIVI_BITS for group in KIVI_GROUP_SIZES},
}
KIVI_FORMATS = tuple(kivi_format(bits, group) for bits in KIVI_BITS for group in KIVI_GROUP_SIZES)
#: What ``LLM(kv_cache_dtype=...)`` takes: "auto" (the model's dtype, unquantized) and the quantized formats.
ENGINE_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4_calibrated_channel", *KIVI_FORMATS,
                          "k_fp16_v_fp8")


def check_renamed_format(name) -> None:
    """A format name kvlab no longer uses: InvalidArgumentError naming what replaced it."""
    if isinstance(name, str) and name in RENAMED_FORMATS:
        raise InvalidArgumentError(
            f"kv cache dtype {name!r} was not KIVI (its key ranges are calibrated offline and it has no "
            f"full-precision window); it is now {RENAMED_FORMATS[name]!r}. KIVI itself is 'kivi_int4' or "
            f"'kivi_int2' (keys per channel over groups of tokens, values per token, scales from the data)")


def kivi_codec(codec: str) -> tuple | None:
    """(bits, "key" or "value", group) of a KIVI codec, None for any other codec."""
    match = _KIVI_CODEC.fullmatch(codec)
    return None if match is None else (int(match[1]), match[2], int(match[3]))


def kivi_settings(name: str) -> tuple | None:
    """(bits, group) of a KIVI format name, None for any other format."""
    parsed = kivi_codec(KV_FORMATS[name][0])
    return None if parsed is None else (parsed[0], parsed[2])


def check_kv_format(name) -> str:
    check_renamed_format(name)
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


def kivi_value_group(head_dim: int, group: int) -> int:
    """Channels sharing one scale and zero in a KIVI value row: gcd(head_dim, G)."""
    return math.gcd(head_dim, group)


def check_kivi_rows(name: str, head_dim: int) -> None:
    """A KIVI format's rows must split evenly: whole bytes of codes (head_dim a multiple of 8 / bits) and each
    key group's 2 x head_dim fp16 scales and zeros spread evenly over its G rows (2 head_dim a multiple of G)."""
    bits, group = kivi_settings(name)
    if head_dim % (8 // bits) or (2 * head_dim) % group:
        raise InvalidArgumentError(
            f"the {name} cache packs {8 // bits} codes a byte and spreads each key group's 2 x head_dim fp16 "
            f"scales and zeros over its {group} tokens, so head_dim must be a multiple of {8 // bits} and "
            f"2 x head_dim a multiple of {group}; got head_dim {head_dim}")


def row_bytes(codec: str, n: int) -> int:
    """Bytes of one row of ``n`` elements in ``codec`` (int4: two codes a byte, ``n`` even; KIVI:
    ``check_kivi_rows``)."""
    if codec == "int4_token":
        return n // 2 + 4 * (n // value_group(n))
    kivi = kivi_codec(codec)
    if kivi is not None:
        bits, part, group = kivi
        meta = 4 * n // group if part == "key" else 4 * (n // kivi_value_group(n, group))
        return n * bits // 8 + meta
    return n * CODEC_BITS[codec] // 8


def is_float_format(name: str) -> bool:
    """K and V both in one float type of at least 16 bits (no scales)."""
    return all(CODEC_BITS[codec] >= 16 for codec in KV_FORMATS[name]) and len(set(KV_FORMATS[name])) == 1


def check_kivi_geometry(group: int, residual_length, block_size: int) -> int:
    """The residual length R (None: the block size) of a KIVI cache with key groups of ``group`` tokens:
    G divides R and R divides the block size, so a chunk is whole key groups and a full block is sealed
    chunks (a prefix hit reads only codes, as a recompute of the prefix would write them)."""
    residual_length = block_size if residual_length is None else residual_length
    if block_size % group:
        raise InvalidArgumentError(f"a KIVI cache quantizes keys in groups of {group} tokens, and a block must "
                                   f"hold whole groups: block_size must be a multiple of {group}, got {block_size}")
    if (isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < group
            or residual_length % group or block_size % residual_length):
        raise InvalidArgumentError(
            f"kv_residual_length (KIVI's R, the tokens kept in full precision) must be a multiple of the key "
            f"group {group} that divides block_size {block_size} (None: block_size), got {residual_length!r}")
    return residual_length
