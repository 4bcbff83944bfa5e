"""Scales for a quantized KV cache (``LLM(kv_cache_dtype=...)``): 1.0 as vLLM's default, or from a
calibration pass that runs given prompts through the model on a throwaway unquantized cache and records
the range of every K and V it stores (vLLM's ``calculate_kv_scales`` does it on the first batch served).

What each codec takes from the ranges (``kvlab.kernels.kv_quant``):
  fp8           scale = |x|max / the format's largest finite value, per KV head, or (``"tensor"``) the
                largest over the layer's heads for every head, so the calibrated |x|max maps to the top code.
  int4_channel  (int4_calibrated_channel's keys) zero = the channel's min, scale = (max - min) / 15, per
                (KV head, channel); it cannot go without calibration (a unit scale would clip nearly every
                key to 16 levels).
  int4_token, KIVI, float   nothing (values, and KIVI's keys, carry their own scales in the rows, computed
                from the data written; floats need none). A KIVI layer gets its residual length instead
                and a ``ResidualWindow`` for its full-precision tokens.
"""

from dataclasses import dataclass, field
from functools import partial

import torch

from kvlab.engine.attention import AttentionBatch
from kvlab.engine.config import ModelConfig
from kvlab.engine.settings import SCALE_GRANULARITIES
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import allocate_kv_cache
from kvlab.kernels.kv_quant import FP8_CODECS, INT4_LEVELS, MIN_SCALE, KVQuantizer
from kvlab.kernels.torch_paged_quant import ResidualWindow
from kvlab.sizing.groups import layer_groups
from kvlab.sizing.kv_dtypes import KV_FORMATS

CALIBRATION_BLOCK_SIZE = 16


@dataclass
class KVRanges:
    """One layer's observed K and V: |x|max per KV head ``[H]`` and K's min / max per channel ``[H, D]``."""
    k_absmax: torch.Tensor | None = None
    v_absmax: torch.Tensor | None = None
    k_min: torch.Tensor | None = None
    k_max: torch.Tensor | None = None
    tokens: int = field(default=0)

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value ``[T, H, D]`` as the layer writes them to the cache (after norms and rotation)."""
        key, value = key.detach().float(), value.detach().float()
        ranges = (key.abs().amax((0, 2)), value.abs().amax((0, 2)), key.amin(0), key.amax(0))
        if self.tokens:
            ranges = (torch.maximum(self.k_absmax, ranges[0]), torch.maximum(self.v_absmax, ranges[1]),
                      torch.minimum(self.k_min, ranges[2]), torch.maximum(self.k_max, ranges[3]))
        self.k_absmax, self.v_absmax, self.k_min, self.k_max = ranges
        self.tokens += key.shape[0]


def calibrate(model, groups, prompts: list[list[int]], dtype: torch.dtype, device) -> list[KVRanges]:
    """Prefill each prompt (token ids) alone through ``model`` on an unquantized paged cache of its own (a
    tensor per layer), with the torch attention path and each layer's window from its KV cache group
    (``groups``), and return every layer's K/V ranges."""
    config: ModelConfig = model.config
    ranges = [KVRanges() for _ in range(config.num_layers)]
    layers = [layer.self_attn for layer in model.model.layers]
    try:
        for attention, layer_ranges in zip(layers, ranges):
            attention.kv_observer = layer_ranges.observe
        for token_ids in prompts:
            n = len(token_ids)
            num_blocks = -(-n // CALIBRATION_BLOCK_SIZE)
            caches = allocate_kv_cache(config.num_layers, config.num_kv_heads, config.head_dim,
                                       block_size=CALIBRATION_BLOCK_SIZE, dtype=dtype, device=device,
                                       num_blocks=num_blocks)
            tensor = partial(torch.tensor, device=device)
            batches = [AttentionBatch.for_backend(
                "torch", caches[0], is_prefill=True, slot_mapping=torch.arange(n, device=device),
                block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
                seq_lens=tensor([n], dtype=torch.int32), cu_query_lens=tensor([0, n], dtype=torch.int32),
                max_seq_len=n, num_heads=config.num_heads, sliding_window=group.sliding_window) for group in groups]
            model(tensor(token_ids, dtype=torch.int64), torch.arange(n, device=device),
                  [batches[g] for g in layer_groups(groups)], caches)
    finally:
        for attention in layers:
            attention.kv_observer = None
    return ranges


def _fp8_scale(absmax, codec: str, granularity: str, num_kv_heads: int, device) -> torch.Tensor:
    if absmax is None:
        return torch.ones(num_kv_heads, device=device)
    if granularity == "tensor":
        absmax = absmax.max().expand(num_kv_heads)
    return (absmax / torch.finfo(FP8_CODECS[codec]).max).clamp(min=MIN_SCALE).float().contiguous()


def make_quantizers(kv_cache_dtype: str, config: ModelConfig, ranges: list[KVRanges] | None,
                    granularity: str, device, residual_length: int | None = None) -> list[KVQuantizer]:
    """One ``KVQuantizer`` per layer for ``kv_cache_dtype`` (not "auto"), from ``calibrate``'s ranges (one
    ``KVRanges`` per layer) or, with ``ranges`` None, unit scales. ``granularity``: fp8's scales, one per layer
    ("tensor") or per KV head ("head"). ``residual_length``: a KIVI format's R (checked by the engine,
    ``check_kivi_geometry``). Raises InvalidArgumentError for a bad argument, or when the format needs
    calibration and ``ranges`` is None."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_FORMATS:
        raise InvalidArgumentError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_FORMATS))} (\"auto\" "
                                   f"needs no quantizers), got {kv_cache_dtype!r}")
    if not isinstance(config, ModelConfig):
        raise InvalidArgumentError(f"config must be a kvlab.engine.config.ModelConfig, got {type(config).__name__}")
    if ranges is not None and not (isinstance(ranges, (list, tuple)) and len(ranges) == config.num_layers
                                   and all(isinstance(r, KVRanges) for r in ranges)):
        got = (f"a {type(ranges).__name__} of {len(ranges)}: {', '.join(type(r).__name__ for r in ranges)}"
               if isinstance(ranges, (list, tuple)) else repr(ranges))  # a KVRanges' repr is its tensors
        raise InvalidArgumentError(f"ranges must be None (unit scales) or a list of {config.num_layers} KVRanges, "
                                   f"one per layer (calibrate's result), got {got}")
    if not isinstance(granularity, str) or granularity not in SCALE_GRANULARITIES:  # fp8 has no per-channel scales
        raise InvalidArgumentError(f"granularity must be one of {', '.join(map(repr, SCALE_GRANULARITIES))} (fp8 "
                                   f"scales per layer or per KV head), got {granularity!r}")
    try:
        device = None if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"device must be None (torch's default), a torch.device or its name (\"cpu\", "
                                   f"\"cuda\"), got {device!r}") from None
    quantizers = []
    for layer in range(config.num_layers):
        observed = ranges[layer] if ranges is not None else KVRanges()
        quantizer = KVQuantizer(kv_cache_dtype, config.head_dim)
        if quantizer.kivi is not None:
            quantizer.residual_length = residual_length
        k_codec, v_codec = quantizer.codecs
        if k_codec == "int4_channel":
            if observed.k_min is None:
                raise InvalidArgumentError(f"kv_cache_dtype={kv_cache_dtype!r} quantizes keys per channel with "
                                           "calibrated ranges: pass kv_calibration_prompts (a few prompts)")
            quantizer.k_zero = observed.k_min.float().contiguous()
            quantizer.k_scale = ((observed.k_max - observed.k_min) / INT4_LEVELS).clamp(min=MIN_SCALE).float()
        elif k_codec in FP8_CODECS:
            quantizer.k_scale = _fp8_scale(observed.k_absmax, k_codec, granularity, config.num_kv_heads, device)
        if v_codec in FP8_CODECS:
            quantizer.v_scale = _fp8_scale(observed.v_absmax, v_codec, granularity, config.num_kv_heads, device)
        quantizer.check(config.num_kv_heads)
        quantizers.append(quantizer)
    return quantizers


def quantize_kv_cache(model, groups, granularity: str, prompts: list[list[int]] | None,
                      dtype: torch.dtype, device, residual_length: int | None = None) -> list[KVQuantizer] | None:
    """Give every attention layer of ``model`` its quantizer for the cache format of its KV cache groups
    (``groups``: every group has the same; calibrated on ``prompts`` when given, unit scales otherwise; KIVI:
    ``residual_length`` and an empty ``ResidualWindow``) and return them; a float format
    (``kv_cache_dtype="auto"``): None, and the layers stay unquantized."""
    if not groups[0].is_quantized:
        return None
    ranges = calibrate(model, groups, prompts, dtype, device) if prompts else None
    quantizers = make_quantizers(groups[0].cache_format, model.config, ranges, granularity, device, residual_length)
    for layer, quantizer in zip(model.model.layers, quantizers):
        layer.self_attn.kv_quantizer = quantizer
        layer.self_attn.kv_window = ResidualWindow() if quantizer.kivi is not None else None
    return quantizers
