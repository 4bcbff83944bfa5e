"""Quantized KV caches in torch: each format's codecs (``kvlab.sizing.kv_dtypes``) encode a step's K and V rows
into bytes on write and decode them to fp32 on read.

One layer's ``KVQuantizer`` holds its format and scales (vLLM keeps k_scale / v_scale on the attention layer
too). Per (token, KV head), K's encoding (``k_bytes``) and V's (``v_bytes``) make one record of
``k_bytes + v_bytes`` bytes; the cache ``[num_blocks, 2, block_size, num_kv_heads, W]`` stores its first W
bytes in the K half and the rest in the V half (``W = (k_bytes + v_bytes) / 2``). For fp8 formats K and V are
both D bytes, so the halves hold exactly K and V, the layout the Triton kernels read (``storage_dtype`` is then
the fp8 type); otherwise the cache is uint8 and an asymmetric format (K in fp16, V in fp8) costs 3 D bytes, not
4 D. Block copies and swaps move whole blocks, so they need not know any of this.

Codecs (x fp32 ``[..., H, D]``; scales per KV head ``[H]`` or per channel ``[H, D]``):
  float        x cast (fp16 clamped to its range); no scale.
  fp8          x / scale, clamped to the format's largest finite value, cast (round to nearest even);
               decode: code * scale. Scale per KV head (or one per tensor, repeated), 1.0 uncalibrated.
  int4_channel per channel: code = round((x - zero) / scale) in [0, 15], zero and scale from calibrated
               min / max, so a key outside the calibrated range is clipped. Two codes a byte (low nibble first).
  int4_token   per row, per group of G channels: zero = min, scale = (max - min) / 15, both kept as fp16 in
               the row after the D / 2 code bytes: decode is exact to within scale / 2 (plus fp16 rounding).
  kivi keys    (KIVI, b = 4 or 2 bits) per channel over each group of G consecutive tokens: zero = the
               channel's min over the group, scale = (max - min) / (2^b - 1), both fp16, code =
               round((x - zero) / scale) in [0, 2^b - 1] (KIVI's asymmetric min/max, computed from the data).
               A row holds its D b / 8 code bytes (8 / b codes a byte, element i at bits b (i mod 8/b)), then
               its share of the group's scales and zeros: the group's [scale (D), zero (D)] fp16 bytes cut into
               G slices, slice i in the group's i-th row. Encoding and decoding therefore take whole groups:
               a leading token dim (third from last) that is a multiple of G, at a position that is too.
  kivi values  per row, per group of gcd(D, G) channels, the same min/max code and fp16 scale, zero pairs in
               the row (int4_token at b bits).
"""

from dataclasses import dataclass

import torch

from kvlab.errors import InvalidArgumentError
from kvlab.sizing.kv_dtypes import (CODEC_BITS, KV_FORMATS, check_kivi_rows, check_kv_format, kivi_codec,
                                    kivi_settings, kivi_value_group, row_bytes, value_group)
from kvlab.validation import check_int

FLOAT_CODECS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8_CODECS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: dtypes a quantized cache is stored in (its bytes; arithmetic always happens after decoding).
STORAGE_DTYPES = (torch.uint8, *FP8_CODECS.values())
INT4_LEVELS = 15
#: Smallest scale kept: a constant group or channel then decodes to its zero, exactly.
MIN_SCALE = 1e-6


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes below 2^bits ``[..., n]`` -> ``[..., n bits / 8]``, element i at bits ``bits * (i mod 8/bits)``
    (4 bits: element 2i in the low nibble)."""
    per_byte = 8 // bits
    packed = codes[..., 0::per_byte].clone()
    for i in range(1, per_byte):
        packed |= codes[..., i::per_byte] << (bits * i)
    return packed


def _unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (bits * i)) & mask for i in range(8 // bits)], -1).flatten(-2)


def kivi_quantize(x: torch.Tensor, bits: int, dim: int):
    """KIVI's asymmetric quantization of fp32 ``x`` over ``dim``: (uint8 codes like x, fp16 scale, fp16 zero, both
    with ``dim`` kept as 1). zero = min, scale = (max - min) / (2^bits - 1), code = round((x - zero) / scale)
    clamped to [0, 2^bits - 1]; the codes are computed with the fp16 scale and zero that are stored, so decoding
    (``code * scale + zero``) is within scale / 2 of x. A constant group keeps scale ``MIN_SCALE`` and decodes
    to its value (KIVI's reference divides by zero there)."""
    levels = (1 << bits) - 1
    limit = torch.finfo(torch.float16).max
    zero = x.amin(dim, keepdim=True).clamp(-limit, limit).half()
    scale = ((x.amax(dim, keepdim=True) - zero.float()) / levels).clamp(MIN_SCALE, limit).half()
    codes = ((x - zero.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    return codes, scale, zero


def _kivi_key_encode(x, bits, group):
    """[..., N, H, D] (N a multiple of ``group``) -> [..., N, H, D bits / 8 + 4 D / group]."""
    *lead, n, h, d = x.shape
    groups = x.reshape(*lead, n // group, group, h, d)
    codes, scale, zero = kivi_quantize(groups, bits, -3)                   # scale, zero [..., N/G, 1, H, D]
    meta = _as_bytes(torch.cat((scale, zero), -1)).view(*lead, n // group, h, group, -1)  # [.., N/G, H, G, 4D/G]
    rows = torch.cat((_pack_bits(codes, bits), meta.transpose(-2, -3)), -1)
    return rows.reshape(*lead, n, h, -1)


def _kivi_key_decode(b, bits, group, d):
    *lead, n, h, _ = b.shape
    code_bytes = d * bits // 8
    codes = _unpack_bits(b[..., :code_bytes], bits).float().reshape(*lead, n // group, group, h, d)
    meta = b[..., code_bytes:].reshape(*lead, n // group, group, h, -1).transpose(-2, -3)  # [.., N/G, H, G, 4D/G]
    scale_zero = meta.contiguous().view(torch.float16).reshape(*lead, n // group, 1, h, 2, d).float()
    return (codes * scale_zero[..., 0, :] + scale_zero[..., 1, :]).reshape(*lead, n, h, d)


def _kivi_value_encode(x, bits, group):
    d = x.shape[-1]
    channels = kivi_value_group(d, group)
    codes, scale, zero = kivi_quantize(x.unflatten(-1, (d // channels, channels)), bits, -1)  # [..., D/g, 1]
    meta = _as_bytes(torch.cat((scale, zero), -1)).flatten(-2)                               # [..., 4 D/g]
    return torch.cat((_pack_bits(codes.flatten(-2), bits), meta), -1)


def _kivi_value_decode(b, bits, group, d):
    channels = kivi_value_group(d, group)
    code_bytes = d * bits // 8
    scale_zero = b[..., code_bytes:].contiguous().view(torch.float16).unflatten(-1, (-1, 2)).float()
    codes = _unpack_bits(b[..., :code_bytes], bits).float().unflatten(-1, (d // channels, channels))
    return (codes * scale_zero[..., :1] + scale_zero[..., 1:]).flatten(-2)


def _fp8_encode(x, scale, dtype):
    limit = torch.finfo(dtype).max
    return _as_bytes((x / scale[..., None]).clamp(-limit, limit).to(dtype))


def _int4_token_encode(x):
    """Per row and group of G channels: codes, then (scale, zero) fp16 pairs. [..., D] -> [..., D/2 + 4 D/G]."""
    d = x.shape[-1]
    groups = x.unflatten(-1, (d // value_group(d), value_group(d)))        # [..., D/G, G]
    limit = torch.finfo(torch.float16).max
    zero = groups.amin(-1).clamp(-limit, limit).half()
    scale = ((groups.amax(-1) - zero.float()) / INT4_LEVELS).clamp(MIN_SCALE, limit).half()
    codes = ((groups - zero.float()[..., None]) / scale.float()[..., None]).round().clamp(0, INT4_LEVELS)
    meta = _as_bytes(torch.stack((scale, zero), -1)).flatten(-2)           # [..., 4 D/G]
    return torch.cat((_pack_bits(codes.to(torch.uint8).flatten(-2), 4), meta), -1)


def _int4_token_decode(b, d):
    codes, meta = b[..., :d // 2], b[..., d // 2:]
    scale_zero = meta.contiguous().view(torch.float16).unflatten(-1, (-1, 2)).float()  # [..., D/G, 2]
    groups = _unpack_bits(codes, 4).float().unflatten(-1, (d // value_group(d), value_group(d)))
    return (groups * scale_zero[..., :1] + scale_zero[..., 1:]).flatten(-2)


@dataclass
class KVQuantizer:
    """One layer's cache format and scales. ``k_scale`` / ``v_scale``: fp32 ``[H]`` for fp8 codecs, ``[H, D]``
    for int4_channel (with ``k_zero``), None where the codec has none (KIVI keeps its scales in the rows).
    ``residual_length``: a KIVI cache's R, the tokens kept in full precision (``kvlab.kernels.kivi_cache``);
    None for every other format."""

    format: str
    head_dim: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    residual_length: int | None = None

    def __post_init__(self):
        check_kv_format(self.format)
        check_int("head_dim", self.head_dim, 1)
        if self.kivi is not None:
            check_kivi_rows(self.format, self.head_dim)
        elif self.head_dim % 2 and any(CODEC_BITS[codec] == 4 for codec in self.codecs):
            raise InvalidArgumentError(f"the {self.format} cache packs two 4-bit codes a byte, so head_dim must be "
                                       f"even, got {self.head_dim}")

    @property
    def codecs(self) -> tuple:
        return KV_FORMATS[self.format]

    @property
    def kivi(self) -> tuple | None:
        """(bits, G) of a KIVI format, else None."""
        return kivi_settings(self.format)

    @property
    def record_bytes(self) -> tuple:
        """(K bytes, V bytes) of one (token, KV head)."""
        return tuple(row_bytes(codec, self.head_dim) for codec in self.codecs)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache's dtype: the fp8 type when K and V share it (the kernels' layout), else uint8."""
        key, value = self.codecs
        return FP8_CODECS[key] if key == value and key in FP8_CODECS else torch.uint8

    @property
    def storage_width(self) -> int:
        """W, the cache's last dim: half a record."""
        return sum(self.record_bytes) // 2

    def _encode(self, codec, x, scale, zero):
        if codec in FLOAT_CODECS:
            dtype = FLOAT_CODECS[codec]
            limit = torch.finfo(dtype).max
            return _as_bytes(x.float().clamp(-limit, limit).to(dtype))
        if codec in FP8_CODECS:
            return _fp8_encode(x.float(), scale, FP8_CODECS[codec])
        if codec == "int4_channel":
            codes = ((x.float() - zero) / scale).round().clamp(0, INT4_LEVELS).to(torch.uint8)
            return _pack_bits(codes, 4)
        if kivi_codec(codec) is not None:
            bits, part, group = kivi_codec(codec)
            return (_kivi_key_encode if part == "key" else _kivi_value_encode)(x.float(), bits, group)
        return _int4_token_encode(x.float())

    def _decode(self, codec, b, scale, zero):
        if codec in FLOAT_CODECS:
            return b.contiguous().view(FLOAT_CODECS[codec]).float()
        if codec in FP8_CODECS:
            return b.view(FP8_CODECS[codec]).float() * scale[..., None]
        if codec == "int4_channel":
            return _unpack_bits(b, 4).float() * scale + zero
        if kivi_codec(codec) is not None:
            bits, part, group = kivi_codec(codec)
            return (_kivi_key_decode if part == "key" else _kivi_value_decode)(b, bits, group, self.head_dim)
        return _int4_token_decode(b, self.head_dim)

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """key, value ``[..., H, D]`` -> uint8 records ``[..., H, k_bytes + v_bytes]`` (KIVI: ``[..., N, H, D]``,
        whole key groups, see the module's docstring)."""
        k_codec, v_codec = self.codecs
        return torch.cat((self._encode(k_codec, key, self.k_scale, self.k_zero),
                          self._encode(v_codec, value, self.v_scale, None)), -1)

    def decode(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 records ``[..., H, k_bytes + v_bytes]`` -> fp32 key, value ``[..., H, D]``."""
        (k_codec, v_codec), (k_bytes, _) = self.codecs, self.record_bytes
        return (self._decode(k_codec, records[..., :k_bytes], self.k_scale, self.k_zero),
                self._decode(v_codec, records[..., k_bytes:], self.v_scale, None))

    def check(self, num_kv_heads: int) -> None:
        """Every scale the codecs need, of the right shape, finite and > 0."""
        shapes = {"fp8_e4m3": (num_kv_heads,), "fp8_e5m2": (num_kv_heads,),
                  "int4_channel": (num_kv_heads, self.head_dim)}
        for name, codec, tensor in (("k_scale", self.codecs[0], self.k_scale), ("v_scale", self.codecs[1],
                                                                               self.v_scale)):
            if codec not in shapes:
                continue
            if (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shapes[codec]
                    or not bool(torch.isfinite(tensor).all() and (tensor > 0).all())):
                raise InvalidArgumentError(f"{self.format}: {name} must be a tensor of shape {shapes[codec]} with "
                                           f"finite values > 0, got {tensor!r}")
        if self.codecs[0] == "int4_channel" and (self.k_zero is None or self.k_zero.shape != self.k_scale.shape):
            raise InvalidArgumentError(f"{self.format}: k_zero must be a tensor of shape {tuple(self.k_scale.shape)}")
