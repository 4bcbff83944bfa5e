"""How many KV blocks a memory budget holds, as vLLM sizes its pool: ``gpu_memory_utilization`` of the GPU's
memory, less what is already in use (the weights), less a step's activations, divided by what one block
costs. ``kvlab size`` estimates the weights and activations; the engine measures what is in use
(``kvlab.engine.kv_cache.blocks_for_memory``). Both then call the functions below."""

import re

from kvlab.errors import InvalidArgumentError

#: vLLM's default share of the GPU's memory that it may use (``gpu_memory_utilization``).
GPU_MEMORY_UTILIZATION = 0.9
#: The most memory sizing takes: 2**64 bytes (16 EiB), all a 64-bit address reaches.
MAX_MEMORY = 2**64
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit, e.g. ``80GiB`` (2**30 bytes each), ``80GB`` (10**9),
    ``24e9``, ``512MiB``."""
    match = isinstance(text, str) and re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS:
        raise InvalidArgumentError(f"expected an amount of memory such as 80GiB, 80GB or 24e9 (units: B, KB, MB, "
                                   f"GB, TB, KiB, MiB, GiB, TiB), got {text!r}")
    amount = float(match.group(1)) * UNITS[unit]  # inf when the number is past float's range
    if not 1 <= amount <= MAX_MEMORY:
        raise InvalidArgumentError(f"the memory must be from one byte to 2**64 bytes (16 EiB, all a 64-bit address "
                                   f"reaches), got {text!r}")
    return int(amount)


def activation_bytes(*, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                     vocab_size: int, max_num_batched_tokens: int, max_num_seqs: int, element_bytes: int) -> int:
    """A generous bound on one step's temporary memory: the widest per-token tensors of a layer (the residual
    and normed hidden states, q/k/v, the MLP's two intermediate halves) for every batched token, twice over,
    plus fp32 logits and sampling copies for every sequence."""
    per_token = 3 * hidden_size + (num_heads + 2 * num_kv_heads) * head_dim + 2 * intermediate_size
    return 2 * max_num_batched_tokens * per_token * element_bytes + 3 * max_num_seqs * vocab_size * 4


def kv_memory(total: int, utilization: float, in_use: int, activations: int) -> int:
    """What is left for the KV cache (may be negative): ``utilization`` of ``total``, less the memory in use
    (the weights) and a step's activations."""
    return int(total * utilization - in_use - activations)


def kv_blocks(memory: int, bytes_per_block: int, max_useful_blocks: int | None = None) -> int:
    """Whole blocks of ``bytes_per_block`` in ``memory`` (0 when it is not positive), at most
    ``max_useful_blocks`` (every sequence at full length: more would never be used)."""
    blocks = max(0, memory // bytes_per_block)
    return blocks if max_useful_blocks is None else min(blocks, max_useful_blocks)
