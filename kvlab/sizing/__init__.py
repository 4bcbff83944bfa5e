"""KV cache sizing: what a token costs per layer, per model and per block (``layout``), the KV cache config
that lays a model's layers out in groups and cache tensors as vLLM and kvlab's engine do (``groups``), how
many blocks a memory budget holds (``budget``), all read from a Hugging Face ``config.json`` (``hf_config``)
and put together by ``plan`` for ``kvlab size`` (``cli``). The engine sizes and lays out its own pool with
the same code (``kvlab.engine.kv_cache``)."""

from kvlab.sizing.budget import activation_bytes, kv_blocks, kv_memory, parse_memory
from kvlab.sizing.groups import KVCacheConfig, KVCacheGroupSpec, kv_cache_groups
from kvlab.sizing.layout import DTYPE_BYTES, KVLayout

__all__ = ["KVLayout", "DTYPE_BYTES", "KVCacheConfig", "KVCacheGroupSpec", "kv_cache_groups", "activation_bytes",
           "kv_blocks", "kv_memory", "parse_memory"]
