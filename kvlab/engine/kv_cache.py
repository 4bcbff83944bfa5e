"""The engine's KV memory: one paged cache per layer on the device, its CPU twin for swapping, the offload
tier's CPU cache, and the block moves (swap out, copy-on-write, swap in, offload, promote) the scheduler asks
for before a step's forward pass, applied to those tensors (the moves themselves, plain lists, are the step's:
``kvlab.engine.step.BlockMoves``, so the scheduler imports no torch)."""

import torch

from kvlab.engine.config import ModelConfig
from kvlab.engine.errors import UnsupportedModelError
from kvlab.engine.step import BlockMoves
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import (allocate_cpu_cache, allocate_kv_cache, allocate_latent_cache, copy_blocks, mla_decode,
                           mla_decode_torch, paged_attention_decode, paged_attention_decode_torch, swap_blocks)
from kvlab.kernels.kv_quant import STORAGE_DTYPES, KVQuantizer
from kvlab.sizing import KVLayout, activation_bytes, kv_blocks, kv_memory

#: KV budget on a machine without a GPU when ``num_blocks`` is not given: small enough for any laptop, and the
#: same on every machine so a notebook's pool is reproducible. SmolLM2-135M in fp32 (45 KiB of K and V per
#: token) gets ~5,800 tokens, more than a CPU serves at a useful speed; pass ``num_blocks`` for more.
CPU_KV_CACHE_BYTES = 256 << 20


def engine_layout(config: ModelConfig, dtype, kv_cache_dtype: str = "auto") -> KVLayout:
    """The model's KV layout (``kvlab.sizing``) as the engine stores it: every layer, windowed or not, keeps a
    cache tensor with a page for every block id, so a block id costs ``layout.bytes_per_block``. "auto": K
    and V in the model's ``dtype``; else a quantized format (``kvlab.sizing.kv_dtypes``). MLA: one latent row
    per token and layer (``latent_dim``)."""
    name = str(dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype
    return KVLayout(config.num_kv_heads, config.head_dim, name, config.layer_windows or (None,) * config.num_layers,
                    None if config.mla is None else config.mla.latent_dim)


def cache_storage(config: ModelConfig, dtype, kv_cache_dtype: str) -> tuple:
    """(torch dtype, last dim) of each layer's cache tensor: the model's dtype and head_dim for "auto", else
    the format's storage (``kvlab.kernels.kv_quant``: fp8, or uint8 bytes of K/V records)."""
    if kv_cache_dtype == "auto":
        return dtype, config.head_dim
    storage = KVQuantizer(kv_cache_dtype, config.head_dim)
    return storage.storage_dtype, storage.storage_width


class PagedKVCache:
    """``gpu[layer]``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` on the engine's device (CPU in
    interpreter mode); ``cpu[layer]``: the same layout with ``num_cpu_blocks`` blocks in host memory. A
    quantized ``kv_cache_dtype`` stores its bytes instead (last dim: ``cache_storage``); an MLA model
    ``[num_blocks, block_size, latent_dim]`` latent rows (``_allocate_latent``). ``bytes_per_block`` (from
    ``engine_layout``) is what one block id takes in those tensors."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype, device, num_cpu_blocks: int,
                 num_offload_blocks: int = 0, kv_cache_dtype: str = "auto"):
        if config.mla is not None:
            self._allocate_latent(config, num_blocks, block_size, dtype, device, num_cpu_blocks, num_offload_blocks)
        else:
            storage_dtype, width = cache_storage(config, dtype, kv_cache_dtype)
            shape = (config.num_layers, config.num_kv_heads, width)
            self.gpu = allocate_kv_cache(*shape, block_size=block_size, dtype=storage_dtype, device=device,
                                         num_blocks=num_blocks)
            self.cpu = (allocate_cpu_cache(*shape, block_size=block_size, dtype=storage_dtype,
                                           num_blocks=num_cpu_blocks) if num_cpu_blocks else [])
            # ``tier[layer]``: the offload tier's CPU slots (kvlab.blocks.offload_tier), the same layout again.
            self.tier = (allocate_cpu_cache(*shape, block_size=block_size, dtype=storage_dtype,
                                            num_blocks=num_offload_blocks) if num_offload_blocks else [])
        self.num_offload_blocks = num_offload_blocks
        self.layout = engine_layout(config, dtype, kv_cache_dtype)
        self._format = "" if kv_cache_dtype == "auto" else f" in {kv_cache_dtype}"
        self.bytes_per_block = self.layout.bytes_per_block(block_size)
        self.num_blocks, self.num_cpu_blocks, self.block_size = num_blocks, num_cpu_blocks, block_size

    def _allocate_latent(self, config: ModelConfig, num_blocks, block_size, dtype, device, num_cpu_blocks,
                         num_offload_blocks) -> None:
        """MLA: every layer's cache (device, swap and tier alike) is ``[blocks, block_size, latent_dim]``, one
        row per token (``kvlab.kernels.mla_decode``); the block manager is the same as for any
        full-attention model. (Where the MLA page layout is decided, with ``engine_layout``'s latent_dim.)"""
        def allocate(blocks, on):  # host copies of GPU blocks are pinned (DMA-able), as allocate_cpu_cache's
            pin = on == "cpu" and torch.cuda.is_available()
            return allocate_latent_cache(config.num_layers, config.mla.latent_dim, num_blocks=blocks,
                                         block_size=block_size, dtype=dtype, device=on, pin_memory=pin)

        self.gpu = allocate(num_blocks, device)
        self.cpu = allocate(num_cpu_blocks, "cpu") if num_cpu_blocks else []
        self.tier = allocate(num_offload_blocks, "cpu") if num_offload_blocks else []

    def summary(self) -> str:
        """How many blocks were made, the memory they take and what a token costs, for the engine's log line."""
        mib = self.bytes_per_block / 2**20
        layout = self.layout
        line = (f"{self.num_blocks} blocks of {self.block_size} tokens ({self.num_blocks * self.block_size} "
                f"tokens, {self.num_blocks * mib:.1f} MiB; {layout.bytes_per_token:,} bytes per token{self._format} = "
                f"{layout.bytes_per_token_per_layer:,} x {layout.num_layers} layers) on {self.gpu[0].device}")
        if self.num_cpu_blocks:
            line += f", plus {self.num_cpu_blocks} CPU blocks for swapping ({self.num_cpu_blocks * mib:.1f} MiB)"
        if self.num_offload_blocks:
            line += (f", plus {self.num_offload_blocks} CPU blocks of offloaded prefixes "
                     f"({self.num_offload_blocks * mib:.1f} MiB)")
        return line

    def apply(self, moves: BlockMoves) -> None:
        if self.gpu[0].dtype in STORAGE_DTYPES or self.gpu[0].dim() == 3:  # quantized, or MLA's latent rows
            return self._apply_indexed(moves)
        for kind, pairs, _, _ in moves.rounds:
            if kind == "copy":
                copy_blocks(self.gpu, pairs)  # every layer in one launch
            else:
                host = self.tier if kind in ("offload", "promote") else self.cpu
                for gpu, cpu in zip(self.gpu, host):
                    src, dst = (gpu, cpu) if kind in ("swap_out", "offload") else (cpu, gpu)
                    swap_blocks(src, dst, pairs)

    def _apply_indexed(self, moves: BlockMoves) -> None:
        """Moves of whole blocks with torch indexing, for the caches the copy kernels do not take: a quantized
        cache's bytes and MLA's latent rows (the kernels copy ``[blocks, 2, block_size, heads, head_dim]``
        float caches). A round never reads a block it writes (``BlockMoves``), so one indexed copy per layer
        is the same as copying the pairs one by one."""
        caches = {"copy": (self.gpu, self.gpu), "swap_out": (self.gpu, self.cpu), "swap_in": (self.cpu, self.gpu),
                  "offload": (self.gpu, self.tier), "promote": (self.tier, self.gpu)}  # kind -> (sources, targets)
        for kind, pairs, _, _ in moves.rounds:
            src_ids, dst_ids = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*pairs))
            for src, dst in zip(*caches[kind]):
                dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)


def check_kernel_support(config: ModelConfig, block_size: int, dtype, device, attention_backend: str,
                         kv_cache_dtype: str = "auto") -> None:
    """Run the backend's decode attention once on a one-block cache of the model's shape: it rejects a block
    size, head dim, head grouping or dtype it does not support, with a message saying what it does. Both
    backends take the same shapes; only bf16 on CPU differs (the Triton interpreter computes it wrongly).
    MLA models: the latent decode (``mla_decode``), on an unquantized cache only."""
    one = torch.ones(1, dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    if config.mla is not None:
        if kv_cache_dtype != "auto":
            raise UnsupportedModelError(f"kv_cache_dtype={kv_cache_dtype!r}: {config.path.name} is an MLA model, "
                                        "whose latent cache is kept in the model's dtype only; pass \"auto\"")
        latent_dim, rank = config.mla.latent_dim, config.mla.kv_lora_rank
        cache = torch.zeros(1, block_size, latent_dim, dtype=dtype, device=device)
        query = torch.zeros(1, config.num_heads, latent_dim, dtype=dtype, device=device)
        decode = mla_decode if attention_backend == "triton" else mla_decode_torch
        args = (query, cache, table, one, rank, config.mla.softmax_scale)
        shape = f"{config.num_heads} heads over an MLA latent of kv_lora_rank {rank} + rope {latent_dim - rank}"
    else:
        cache = torch.zeros(1, 2, block_size, config.num_kv_heads, config.head_dim, dtype=dtype, device=device)
        query = torch.zeros(1, config.num_heads, config.head_dim, dtype=dtype, device=device)
        decode = paged_attention_decode if attention_backend == "triton" else paged_attention_decode_torch
        args = (query, cache, table, one)
        shape = f"{config.num_heads} heads, {config.num_kv_heads} kv heads, head_dim {config.head_dim}"
    try:
        decode(*args)
    except InvalidArgumentError as e:
        raise UnsupportedModelError(
            f"kvlab's {attention_backend} attention cannot serve {config.path.name} with block_size={block_size}, "
            f"dtype {str(dtype).replace('torch.', '')} ({shape}): {e}") from None


def blocks_for_memory(config: ModelConfig, block_size: int, dtype, device, *, gpu_memory_utilization: float,
                      max_num_batched_tokens: int, max_num_seqs: int, max_useful_blocks: int,
                      kv_cache_dtype: str = "auto") -> int:
    """``num_blocks=None``: on a GPU, what is left of ``gpu_memory_utilization`` of its memory once the
    weights are loaded and a step's activations are set aside (``kvlab.sizing.budget``, as ``kvlab size``
    estimates it); on CPU, ``CPU_KV_CACHE_BYTES``. Never more than ``max_useful_blocks`` (every sequence at
    full context length). A smaller ``kv_cache_dtype`` fits more blocks in the same bytes."""
    per_block = engine_layout(config, dtype, kv_cache_dtype).bytes_per_block(block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        activations = activation_bytes(
            hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            element_bytes=torch.empty((), dtype=dtype).element_size())
        budget = kv_memory(total, gpu_memory_utilization, total - free, activations)
    else:
        budget = CPU_KV_CACHE_BYTES
    num_blocks = kv_blocks(budget, per_block, max_useful_blocks)
    if num_blocks < 1:
        raise InvalidArgumentError(
            f"no memory left for the KV cache ({budget / 2**20:.0f} MiB after weights and activations; one block "
            f"needs {per_block / 2**20:.2f} MiB): raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "pass num_blocks")
    return num_blocks
