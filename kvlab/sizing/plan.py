"""A model on a GPU: what its KV cache costs per token and per block, and how many blocks, tokens and
concurrent requests a memory budget holds after the weights and activations (``kvlab size`` prints this).

Assumptions, printed with the result (``kvlab.sizing.report.ASSUMPTIONS``): the budget is ``gpu_memory_utilization``
(vLLM's default 0.9) of the GPU's memory; the weights take the ``*.safetensors`` files' size, or the
parameter count (``kvlab.sizing.hf_config``) times the config's dtype (``QUANTIZED`` checkpoints: their
quantized parameters at their own size); activations take the engine's bound
(``kvlab.sizing.budget.activation_bytes``) for ``max_num_batched_tokens`` tokens and ``max_num_seqs``
sequences; the pool is laid out in KV cache groups and tensors as vLLM V1 and kvlab's engine lay it out
(``kvlab.sizing.groups``), and a request holds each group's ``blocks_per_request`` at ``max_model_len``. A
hybrid state model's (Qwen3-Next's, Jamba's, Falcon-H1's) state layers keep their convolution state in the
model's dtype and their recurrent state in ``mamba_ssm_cache_dtype`` (vLLM's ``--mamba-ssm-cache-dtype``; auto:
the model's dtype), and the block size grows to vLLM's aligned one (``kvlab.sizing.groups.aligned_block_size``).
A KIVI cache (``kivi_int4``, ``kivi_int2``) keeps each running sequence's newest R tokens in the model's dtype
beside its pages (``kv_residual_length``, default the block size, ``check_kivi_geometry``): ``max_num_seqs`` of these
windows are set aside before the blocks, as the engine's ``kivi_window_bytes`` does.
"""

from dataclasses import dataclass, replace

from kvlab.errors import InvalidArgumentError
from kvlab.sizing.budget import MAX_MEMORY, activation_bytes, kv_blocks, kv_memory
from kvlab.sizing.groups import KVCacheConfig, aligned_block_size, bytes_per_block, kv_cache_groups
from kvlab.sizing.hf_config import DEFAULT_DTYPE, MAX_TOKENS, ModelShape
from kvlab.sizing.kv_dtypes import cache_format, check_kivi_geometry, kivi_settings
from kvlab.sizing.layout import DTYPE_BYTES, KVLayout
from kvlab.validation import check_int, check_number, check_optional_int

#: The pools ``size_model`` lays out: the one kvlab's engine and vLLM V1 make, and, for a hybrid model, the one
#: with every layer kept as full attention (vLLM's ``--disable-hybrid-kv-cache-manager``).
ENGINE, ALL_FULL = "kvlab engine and vLLM V1", "every layer as full attention"
#: The pool of a hybrid state model, which only vLLM serves.
VLLM_ONLY = "vLLM V1"


def resolve_kv_cache_dtype(name: str, shape: ModelShape) -> str:
    """vLLM's ``--kv-cache-dtype``: ``auto`` is the model's dtype (``DEFAULT_DTYPE`` if its config states none)."""
    return cache_format(name, shape.dtype if shape.dtype in DTYPE_BYTES else DEFAULT_DTYPE)


@dataclass(frozen=True)
class Pool:
    """The pool one layout makes of the KV memory: ``config`` holds its groups, tensors and blocks."""

    name: str
    config: KVCacheConfig
    blocks_per_request: int   # at max_model_len, summed over the groups

    @property
    def bytes_per_block(self) -> int:
        return self.config.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once, as vLLM logs it ("Maximum concurrency")."""
        return self.num_blocks / self.blocks_per_request


@dataclass(frozen=True)
class Sizing:
    shape: ModelShape
    layout: KVLayout
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory: int
    gpu_memory_utilization: float
    weights: int
    weights_source: str
    activations: int
    kv_memory: int         # what is left for the KV cache (negative: the model does not fit)
    pools: tuple           # (the engine's Pool,), and for a hybrid model the all-full one after it
    requested_block_size: int = 16  # the block size asked for; block_size is a state model's aligned one
    state_bytes: int = 0            # a state layer's state per request (0: no state layers)
    state_formula: str = ""         # its arithmetic
    window_bytes: int = 0           # a KIVI cache's full-precision windows, all running sequences (0: none)
    window_formula: str = ""        # their arithmetic


#: quantization_config's quant_method -> (which parameters it quantizes, bytes per quantized parameter): fp8
#: (DeepSeek-V3) every linear layer, the embeddings stay in the model's dtype; mxfp4 (gpt-oss) the routed
#: experts, 4-bit values with one 8-bit scale per 32 (4.25 bits).
QUANTIZED = {"fp8": (lambda p: p.total - p.embeddings, 1), "mxfp4": (lambda p: p.routed_experts, 17 / 32)}


def weights_estimate(shape: ModelShape) -> tuple[int, str]:
    """(bytes, how they were estimated)."""
    if shape.weight_files_bytes is not None:
        return shape.weight_files_bytes, "the *.safetensors files' size"
    dtype = shape.dtype if shape.dtype in DTYPE_BYTES else DEFAULT_DTYPE
    params = shape.parameters
    how = f"{params.total:,} parameters counted from the config x {DTYPE_BYTES[dtype]} bytes ({dtype})"
    if shape.quantization in QUANTIZED:
        which, size = QUANTIZED[shape.quantization]
        quantized = which(params)
        how = (f"{params.total - quantized:,} parameters counted from the config x {DTYPE_BYTES[dtype]} bytes "
               f"({dtype}) + {quantized:,} x {size:g} bytes ({shape.quantization})")
        return int((params.total - quantized) * DTYPE_BYTES[dtype] + quantized * size), how
    if shape.quantization:
        how += (f"; the checkpoint is quantized ({shape.quantization}), so its weights are smaller: pass the "
                "model directory to use its files' size")
    return params.total * DTYPE_BYTES[dtype], how


def size_model(shape: ModelShape, *, kv_cache_dtype: str = "auto", gpu_memory: int, gpu_memory_utilization: float,
               max_model_len: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 8192,
               max_num_seqs: int = 256, mamba_ssm_cache_dtype: str = "auto",
               kv_residual_length: int | None = None) -> Sizing:
    if not isinstance(shape, ModelShape):
        raise InvalidArgumentError(f"shape must be a ModelShape (kvlab.sizing.hf_config.read_model_shape), got "
                                   f"{type(shape).__name__}")
    check_int("gpu_memory", gpu_memory, 1, MAX_MEMORY)
    check_number("gpu_memory_utilization", gpu_memory_utilization, 0, 1, min_open=True)
    for name, value in (("block_size", block_size), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs)):
        check_int(name, value, 1, MAX_TOKENS)
    check_optional_int("max_model_len", max_model_len, 1, MAX_TOKENS)
    if mamba_ssm_cache_dtype != "auto" and mamba_ssm_cache_dtype not in DTYPE_BYTES:
        raise InvalidArgumentError(f"mamba_ssm_cache_dtype must be auto or one of {', '.join(DTYPE_BYTES)}, got "
                                   f"{mamba_ssm_cache_dtype!r}")
    layout = shape.layout(resolve_kv_cache_dtype(kv_cache_dtype, shape))
    max_model_len = max_model_len or shape.max_position_embeddings
    weights, weights_source = weights_estimate(shape)
    model_dtype = shape.dtype if shape.dtype in DTYPE_BYTES else DEFAULT_DTYPE
    activations = activation_bytes(
        hidden_size=shape.hidden_size, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        element_bytes=DTYPE_BYTES[model_dtype])
    window_bytes, window_formula = kivi_windows(layout, model_dtype, kv_residual_length, block_size, max_num_seqs)
    memory = kv_memory(gpu_memory, gpu_memory_utilization, weights, activations) - window_bytes
    state_bytes, state_formula, requested_block_size = 0, "", block_size
    if shape.state_layers:
        ssm_dtype = model_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
        state_bytes = (shape.conv_state_elements * DTYPE_BYTES[model_dtype]
                       + shape.recurrent_state_elements * DTYPE_BYTES[ssm_dtype])
        state_formula = (f"{shape.conv_state_elements:,} conv elements x {DTYPE_BYTES[model_dtype]} B "
                         f"({model_dtype}) + {shape.recurrent_state_elements:,} recurrent elements x "
                         f"{DTYPE_BYTES[ssm_dtype]} B ({ssm_dtype}) = {state_bytes:,} B")
        block_size = aligned_block_size(state_bytes, layout.page_bytes(1), block_size)
    layouts = [(VLLM_ONLY if shape.state_layers else ENGINE, layout)]
    if layout.is_hybrid:
        layouts.append((ALL_FULL, replace(layout, layer_windows=(None,) * layout.num_layers)))
    pools = []
    for name, pool_layout in layouts:
        groups = kv_cache_groups(pool_layout, block_size, shape.state_layers, state_bytes or None)
        config = KVCacheConfig(groups, kv_blocks(memory, bytes_per_block(groups)))
        pools.append(Pool(name, config, config.blocks_per_request(max_model_len, max_num_batched_tokens)))
    return Sizing(shape, layout, block_size, max_model_len, max_num_batched_tokens, max_num_seqs, gpu_memory,
                  gpu_memory_utilization, weights, weights_source, activations, memory, tuple(pools),
                  requested_block_size, state_bytes, state_formula, window_bytes, window_formula)


def kivi_windows(layout: KVLayout, model_dtype: str, residual_length, block_size: int,
                 max_num_seqs: int) -> tuple[int, str]:
    """(bytes, arithmetic) of a KIVI cache's full-precision windows: R tokens of K and V in every layer, in the
    model's dtype, for each of ``max_num_seqs`` running sequences; (0, "") for any other format, which takes
    no ``residual_length``."""
    kivi = kivi_settings(layout.dtype)
    if kivi is None:
        if residual_length is not None:
            raise InvalidArgumentError(f"kv_residual_length is the full-precision window of a KIVI cache "
                                       f"('kivi_int4', 'kivi_int2'); {layout.dtype} has none")
        return 0, ""
    R = check_kivi_geometry(kivi[1], residual_length, block_size)
    per_token = replace(layout, dtype=model_dtype).bytes_per_token
    total = max_num_seqs * R * per_token
    return total, (f"{max_num_seqs} sequences x R {R} tokens x {per_token:,} B per token in {model_dtype} "
                   f"= {total:,} B")
