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
"""

from dataclasses import dataclass

import torch

from kvlab.errors import InvalidArgumentError
from kvlab.sizing.kv_dtypes import CODEC_BITS, KV_FORMATS, check_kv_format, row_bytes, value_group
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


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] ``[..., n]`` -> ``[..., n / 2]``, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


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
    return torch.cat((_pack(codes.to(torch.uint8).flatten(-2)), meta), -1)


def _int4_token_decode(b, d):
    codes, meta = b[..., :d // 2], b[..., d // 2:]
    scale_zero = meta.contiguous().view(torch.float16).unflatten(-1, (-1, 2)).float()  # [..., D/G, 2]
    groups = _unpack(codes).float().unflatten(-1, (d // value_group(d), value_group(d)))
    return (groups * scale_zero[..., :1] + scale_zero[..., 1:]).flatten(-2)


@dataclass
class KVQuantizer:
    """One layer's cache format and scales. ``k_scale`` / ``v_scale``: fp32 ``[H]`` for fp8 codecs, ``[H, D]``
    for int4_channel (with ``k_zero``), None where the codec has none."""

    format: str
    head_dim: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None

    def __post_init__(self):
        check_kv_format(self.format)
        check_int("head_dim", self.head_dim, 1)
        if self.head_dim % 2 and any(CODEC_BITS[codec] == 4 for codec in self.codecs):
            raise InvalidArgumentError(f"the {self.format} cache packs two 4-bit codes a byte, so head_dim must be "
                                       f"even, got {self.head_dim}")

    @property
    def codecs(self) -> tuple:
        return KV_FORMATS[self.format]

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
            return _pack(codes)
        return _int4_token_encode(x.float())

    def _decode(self, codec, b, scale, zero):
        if codec in FLOAT_CODECS:
            return b.contiguous().view(FLOAT_CODECS[codec]).float()
        if codec in FP8_CODECS:
            return b.view(FP8_CODECS[codec]).float() * scale[..., None]
        if codec == "int4_channel":
            return _unpack(b).float() * scale + zero
        return _int4_token_decode(b, self.head_dim)

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """key, value ``[..., H, D]`` -> uint8 records ``[..., H, k_bytes + v_bytes]``."""
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
