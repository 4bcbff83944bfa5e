"""KV cache sizing: what a token costs per layer, per model and per block (``layout``), how vLLM and kvlab's
engine lay out hybrid models' blocks (``groups``), how many blocks a memory budget holds (``budget``), all
read from a Hugging Face ``config.json`` (``hf_config``) and put together by ``plan`` for ``kvlab size``
(``cli``). The engine sizes its own pool with the same code (``kvlab.engine.kv_cache``)."""

from kvlab.sizing.budget import activation_bytes, kv_blocks, kv_memory, parse_memory
from kvlab.sizing.groups import blocks_per_request, engine_groups, vllm_groups
from kvlab.sizing.layout import DTYPE_BYTES, KVLayout

__all__ = ["KVLayout", "DTYPE_BYTES", "blocks_per_request", "engine_groups", "vllm_groups", "activation_bytes",
           "kv_blocks", "kv_memory", "parse_memory"]
