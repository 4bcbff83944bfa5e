"""Checking and resolving ``LLM(...)``'s arguments before anything is loaded."""

import os

import torch

import kvlab.device
from kvlab.engine.config import DTYPES, ModelConfig
from kvlab.engine.sampling_params import MAX_SEED
from kvlab.errors import InvalidArgumentError, UnsupportedError
from kvlab.sizing.kv_dtypes import ENGINE_KV_CACHE_DTYPES, check_kivi_geometry, check_renamed_format, kivi_settings
from kvlab.validation import check_int, check_number

PREEMPTION_MODES = ("recompute", "swap")
#: A quantized cache's fp8 scales: one per layer for K and one for V ("tensor", vLLM's), or one per KV head.
SCALE_GRANULARITIES = ("tensor", "head")
#: How attention reads and writes the paged cache: kvlab's Triton kernels (compiled on CUDA, interpreted on
#: CPU) or the batched torch path of ``kvlab.kernels.torch_paged`` (same cache, tables and slots).
ATTENTION_BACKENDS = ("torch", "triton")
#: The formats kvlab's Triton kernels write and read: fp8 caches with a scale per KV head.
TRITON_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
#: The first compute capability with fp8 (Ada, sm_89), which the Triton fp8 write needs compiled.
FP8_CAPABILITY = (8, 9)
#: The Triton backend's debug switch (``kvlab.engine.attention``): "1" makes every layer check the step's
#: slots and tables again, "0" or unset checks them once per step.
CHECK_EVERY_LAYER_ENV = "KVLAB_CHECK_EVERY_LAYER"


def resolve_device(device) -> torch.device:
    """None: where kvlab's kernels run (the GPU if there is one, else CPU with the Triton interpreter). The
    kernels run compiled on CUDA tensors or interpreted on CPU ones, never both on one machine."""
    if device is None:
        return kvlab.device.DEVICE
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        raise InvalidArgumentError(f"device must be None, 'cpu', 'cuda' or a torch.device, got {device!r}") from None
    if device.type != kvlab.device.DEVICE.type:
        raise InvalidArgumentError(
            f"device {device} cannot run kvlab's kernels here: they run in {kvlab.device.mode()} mode, on "
            f"{kvlab.device.DEVICE.type} tensors (pass device=None)")
    return device


def resolve_attention_backend(backend, device: torch.device) -> str:
    """None: the device's default (``kvlab.device.default_attention_backend``: "triton" on CUDA, else "torch").
    "triton" on CPU is allowed: it is how the kernels are stepped through and tested without a GPU."""
    if backend is None:
        return kvlab.device.default_attention_backend(device)
    if not isinstance(backend, str) or backend not in ATTENTION_BACKENDS:
        raise InvalidArgumentError(f"attention_backend must be None (the default for the device) or one of "
                                   f"{', '.join(map(repr, ATTENTION_BACKENDS))}, got {backend!r}")
    return backend


def check_kv_cache_options(kv_cache_dtype, kv_scale_granularity, kv_calibration_prompts) -> None:
    """``kv_cache_dtype``: one of ``ENGINE_KV_CACHE_DTYPES`` (vLLM's names and kvlab's); the scales' granularity
    ("tensor" or "head"); calibration prompts None or a non-empty list of prompts (checked when encoded)."""
    check_renamed_format(kv_cache_dtype)
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in ENGINE_KV_CACHE_DTYPES:
        raise InvalidArgumentError(f"kv_cache_dtype must be one of {', '.join(map(repr, ENGINE_KV_CACHE_DTYPES))}, "
                                   f"got {kv_cache_dtype!r}")
    if kv_scale_granularity not in SCALE_GRANULARITIES:
        raise InvalidArgumentError(f"kv_scale_granularity must be one of {SCALE_GRANULARITIES} (one scale per "
                                   f"layer, or per KV head), got {kv_scale_granularity!r}")
    if kv_calibration_prompts is not None and (not isinstance(kv_calibration_prompts, (list, tuple))
                                               or not kv_calibration_prompts):
        raise InvalidArgumentError("kv_calibration_prompts must be None (unit scales) or a non-empty list of "
                                   f"prompts (strings or token-id lists), got {kv_calibration_prompts!r}")
    if kv_calibration_prompts is not None and kv_cache_dtype == "auto":
        raise InvalidArgumentError("kv_calibration_prompts sets the scales of a quantized cache; with "
                                   "kv_cache_dtype='auto' there is nothing to calibrate")
    if kv_calibration_prompts is not None and kivi_settings(kv_cache_dtype) is not None:
        raise InvalidArgumentError(f"kv_calibration_prompts sets offline scales; kv_cache_dtype={kv_cache_dtype!r} "
                                   "(KIVI) computes its scales from the K/V it quantizes: pass none")


def check_kivi_options(kv_cache_dtype: str, kv_residual_length, block_size: int, speculative_config) -> int | None:
    """A KIVI cache's residual length R (``check_kivi_geometry``: None gives the block size), None for any other
    format, where ``kv_residual_length`` must be None. KIVI does not take speculative decoding: a rejected
    draft may already have sealed a chunk into the pages."""
    kivi = kivi_settings(kv_cache_dtype) if kv_cache_dtype != "auto" else None
    if kivi is None:
        if kv_residual_length is not None:
            raise InvalidArgumentError(f"kv_residual_length is the full-precision window of a KIVI cache "
                                       f"('kivi_int4', 'kivi_int2'); kv_cache_dtype={kv_cache_dtype!r} has none")
        return None
    if speculative_config is not None:
        raise InvalidArgumentError(f"kv_cache_dtype={kv_cache_dtype!r} does not take speculative_config: a KIVI "
                                   "cache seals whole chunks into its pages as they fill, and a rejected draft "
                                   "could have sealed one")
    return check_kivi_geometry(kivi[1], kv_residual_length, block_size)


def fp8_writes_compile(device: torch.device) -> bool:
    """Whether Triton's ``reshape_and_cache`` can write an fp8 cache on ``device``: compiled on a GPU with fp8
    (sm_89+) only; the interpreter rounds float -> fp8 wrongly."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def resolve_quantized_backend(backend, kv_cache_dtype: str, device: torch.device) -> str:
    """The attention backend for ``kv_cache_dtype``. A quantized cache is served by the torch path when
    ``backend`` is None, on any device. "triton" serves the fp8 formats where their write compiles (a GPU with
    fp8, sm_89+: ``reshape_and_cache`` quantizes, ``paged_prefill`` and ``paged_attention_decode`` dequantize)
    and the KIVI formats anywhere (``kivi_seal`` and ``kivi_paged_attention``: integer and fp16 arithmetic,
    which the interpreter computes as a GPU does); elsewhere, and for the other integer and asymmetric formats,
    which no Triton kernel reads, it raises UnsupportedError saying so."""
    if kv_cache_dtype == "auto":
        return resolve_attention_backend(backend, device)
    if backend is None:
        return "torch"
    backend = resolve_attention_backend(backend, device)
    if backend == "triton" and kivi_settings(kv_cache_dtype) is not None:
        return backend
    if backend == "triton" and kv_cache_dtype not in TRITON_KV_CACHE_DTYPES:
        raise UnsupportedError(
            f"kv_cache_dtype={kv_cache_dtype!r} cannot run on the triton backend: kvlab's Triton kernels take fp8 "
            f"caches ({', '.join(TRITON_KV_CACHE_DTYPES)}) and KIVI's ('kivi_int4', 'kivi_int2', ...) only, none "
            "reads the other integer or asymmetric formats. Use attention_backend='torch' or None")
    if backend == "triton" and not fp8_writes_compile(device):
        raise UnsupportedError(
            f"kv_cache_dtype={kv_cache_dtype!r} cannot run on the triton backend on {device}: kvlab's Triton "
            "reshape_and_cache writes fp8 compiled on GPUs with fp8 (sm_89+) only (the interpreter rounds float "
            "-> fp8 wrongly), though paged_prefill and paged_attention_decode read it anywhere. Use "
            "attention_backend='torch' or None")
    return backend


def check_every_layer_from_env() -> bool:
    """Whether ``$KVLAB_CHECK_EVERY_LAYER`` turns the per-layer checks of the Triton backend back on."""
    value = os.environ.get(CHECK_EVERY_LAYER_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise InvalidArgumentError(f"{CHECK_EVERY_LAYER_ENV} must be 1 (check every layer), 0 or unset (check "
                                   f"once per step), got {value!r}")
    return value == "1"


def resolve_dtype(dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """None: float32 on CPU (the Triton interpreter computes bf16 wrongly and fp16 slowly; the torch attention
    backend takes either when asked); on a GPU the checkpoint's dtype, with bf16 replaced by fp16 where the
    GPU lacks native bf16."""
    if dtype is None:
        if device.type != "cuda":
            return torch.float32
        dtype = config.dtype or torch.float16
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.float16
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in DTYPES.values():
        return dtype
    raise InvalidArgumentError(f"dtype must be None or one of {', '.join(DTYPES)} (a name or torch dtype), "
                               f"got {dtype!r}")


def check_settings(*, block_size, num_blocks, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
                   preemption_mode, max_model_len, num_cpu_blocks, gpu_memory_utilization, seed,
                   record_events, kv_events, record_decisions):
    """Validate the plain-value settings (each error names the argument and what is allowed)."""
    check_int("block_size", block_size, minimum=1)
    if num_blocks is not None:
        check_int("num_blocks", num_blocks, minimum=1)
    for name, value in (("enable_prefix_caching", enable_prefix_caching), ("record_events", record_events),
                        ("kv_events", kv_events), ("record_decisions", record_decisions)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    check_int("max_num_seqs", max_num_seqs, minimum=1)
    check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=max_num_seqs)  # a full decode step fits
    if preemption_mode not in PREEMPTION_MODES:
        raise InvalidArgumentError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, minimum=2)
    if num_cpu_blocks is not None:
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=1 if preemption_mode == "swap" else 0)
    check_number("gpu_memory_utilization", gpu_memory_utilization, 0.0, 1.0, min_open=True)
    check_int("seed", seed, minimum=0, maximum=MAX_SEED)
