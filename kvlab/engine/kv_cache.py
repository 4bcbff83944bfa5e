"""The engine's KV memory: one paged cache per layer on the device, its CPU twin for swapping, and the
block moves (swap out, copy-on-write, swap in) the scheduler asks for before a step's forward pass."""

from collections import namedtuple

import torch

from kvlab.engine.config import ModelConfig
from kvlab.engine.errors import UnsupportedModelError
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import (allocate_cpu_cache, allocate_kv_cache, bytes_per_block, copy_blocks,
                           paged_attention_decode, paged_attention_decode_torch, swap_blocks)

#: KV budget on a machine without a GPU when ``num_blocks`` is not given: small enough for any laptop, and the
#: same on every machine so a notebook's pool is reproducible. SmolLM2-135M in fp32 (45 KiB of K and V per
#: token) gets ~5,800 tokens, more than a CPU serves at a useful speed; pass ``num_blocks`` for more.
CPU_KV_CACHE_BYTES = 256 << 20

Round = namedtuple("Round", "kind pairs srcs dsts")


class BlockMoves:
    """One step's block moves, kept in the order the scheduler made them (a block swapped out may be reused
    by a later copy in the same step, so order matters). Consecutive moves of one kind are grouped into a
    single launch unless a block would be written twice, or (copy-on-write, inside one cache) be both read and
    written in that launch."""

    KINDS = ("swap_out", "copy", "swap_in")

    def __init__(self):
        self.rounds: list[Round] = []
        self.counts = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, pairs) -> None:
        for src, dst in pairs:
            last = self.rounds[-1] if self.rounds else None
            if (last is None or last.kind != kind or dst in last.dsts
                    or (kind == "copy" and (src in last.dsts or dst in last.srcs))):
                last = Round(kind, [], set(), set())
                self.rounds.append(last)
            last.pairs.append((src, dst))
            last.srcs.add(src)
            last.dsts.add(dst)
            self.counts[kind] += 1


class PagedKVCache:
    """``gpu[layer]``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` on the engine's device (CPU in
    interpreter mode); ``cpu[layer]``: the same layout with ``num_cpu_blocks`` blocks in host memory."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype, device, num_cpu_blocks: int):
        shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        self.gpu = allocate_kv_cache(*shape, block_size=block_size, dtype=dtype, device=device, num_blocks=num_blocks)
        self.cpu = (allocate_cpu_cache(*shape, block_size=block_size, dtype=dtype, num_blocks=num_cpu_blocks)
                    if num_cpu_blocks else [])
        self.bytes_per_block = bytes_per_block(*shape, block_size=block_size, dtype=dtype)
        self.num_blocks, self.num_cpu_blocks, self.block_size = num_blocks, num_cpu_blocks, block_size

    def summary(self) -> str:
        """How many blocks were made and the memory they take, for the engine's log line."""
        mib = self.bytes_per_block / 2**20
        line = (f"{self.num_blocks} blocks of {self.block_size} tokens ({self.num_blocks * self.block_size} "
                f"tokens, {self.num_blocks * mib:.1f} MiB) on {self.gpu[0].device}")
        if self.num_cpu_blocks:
            line += f", plus {self.num_cpu_blocks} CPU blocks for swapping ({self.num_cpu_blocks * mib:.1f} MiB)"
        return line

    def apply(self, moves: BlockMoves) -> None:
        for kind, pairs, _, _ in moves.rounds:
            if kind == "copy":
                copy_blocks(self.gpu, pairs)  # every layer in one launch
            else:
                for gpu, cpu in zip(self.gpu, self.cpu):
                    src, dst = (gpu, cpu) if kind == "swap_out" else (cpu, gpu)
                    swap_blocks(src, dst, pairs)


def check_kernel_support(config: ModelConfig, block_size: int, dtype, device, attention_backend: str) -> None:
    """Run the backend's decode attention once on a one-block cache of the model's shape: it rejects a block
    size, head dim, head grouping or dtype it does not support, with a message saying what it does. Both
    backends take the same shapes; only bf16 on CPU differs (the Triton interpreter computes it wrongly)."""
    cache = torch.zeros(1, 2, block_size, config.num_kv_heads, config.head_dim, dtype=dtype, device=device)
    query = torch.zeros(1, config.num_heads, config.head_dim, dtype=dtype, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    decode = paged_attention_decode if attention_backend == "triton" else paged_attention_decode_torch
    try:
        decode(query, cache, torch.zeros(1, 1, dtype=torch.int32, device=device), one)
    except InvalidArgumentError as e:
        raise UnsupportedModelError(
            f"kvlab's {attention_backend} attention cannot serve {config.path.name} with block_size={block_size}, "
            f"dtype {str(dtype).replace('torch.', '')} ({config.num_heads} heads, {config.num_kv_heads} kv heads, "
            f"head_dim {config.head_dim}): {e}") from None


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype) -> int:
    """A generous bound on one step's temporary memory: the widest per-token tensors of a layer for every
    batched token, twice over, plus fp32 logits and sampling copies for every sequence."""
    per_token = (3 * config.hidden_size + (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
                 + 2 * config.intermediate_size)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * max_num_batched_tokens * per_token * element + 3 * max_num_seqs * config.vocab_size * 4


def blocks_for_memory(config: ModelConfig, block_size: int, dtype, device, *, gpu_memory_utilization: float,
                      max_num_batched_tokens: int, max_num_seqs: int, max_useful_blocks: int) -> int:
    """``num_blocks=None``: on a GPU, what is left of ``gpu_memory_utilization`` of its memory once the
    weights are loaded and a step's activations are set aside; on CPU, ``CPU_KV_CACHE_BYTES``. Never more
    than ``max_useful_blocks`` (every sequence at full context length)."""
    per_block = bytes_per_block(config.num_layers, config.num_kv_heads, config.head_dim, block_size=block_size,
                                dtype=dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total
        budget -= activation_bytes(config, max_num_batched_tokens, max_num_seqs, dtype)
    else:
        budget = CPU_KV_CACHE_BYTES
    num_blocks = min(int(budget // per_block), max_useful_blocks)
    if num_blocks < 1:
        raise InvalidArgumentError(
            f"no memory left for the KV cache ({budget / 2**20:.0f} MiB after weights and activations; one block "
            f"needs {per_block / 2**20:.2f} MiB): raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "pass num_blocks")
    return num_blocks
