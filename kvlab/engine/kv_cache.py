"""The engine's KV memory: its KV cache config (groups, pages and tensors, ``kvlab.sizing.groups``), the paged
cache tensors on the device that config lays out, their CPU twin for swapping, the offload tier's CPU cache,
and the block moves (swap out, copy-on-write, swap in, offload, promote) the scheduler asks for before a
step's forward pass, applied to those tensors (the moves themselves, plain lists, are the step's:
``kvlab.engine.step.BlockMoves``, so the scheduler imports no torch)."""

import torch

from kvlab.engine.config import DTYPES, ModelConfig
from kvlab.engine.errors import UnsupportedModelError
from kvlab.engine.step import BlockMoves
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import (allocate_cpu_cache, allocate_kv_cache, allocate_latent_cache, copy_blocks, mla_decode,
                           mla_decode_torch, paged_attention_decode, paged_attention_decode_torch, swap_blocks)
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.sizing import (KVCacheConfig, KVCacheGroupSpec, KVLayout, activation_bytes, kv_blocks, kv_cache_groups,
                          kv_memory)
from kvlab.sizing.groups import bytes_per_block
from kvlab.sizing.kv_dtypes import cache_format, kivi_settings

#: KV budget on a machine without a GPU when ``num_blocks`` is not given: small enough for any laptop, and the
#: same on every machine so a notebook's pool is reproducible. SmolLM2-135M in fp32 (45 KiB of K and V per
#: token) gets ~5,800 tokens, more than a CPU serves at a useful speed; pass ``num_blocks`` for more.
CPU_KV_CACHE_BYTES = 256 << 20


def engine_layout(config: ModelConfig, dtype, kv_cache_dtype: str = "auto") -> KVLayout:
    """The model's KV layout (``kvlab.sizing``) as the engine stores it: "auto": K and V in the model's
    ``dtype``; else a quantized format (``kvlab.sizing.kv_dtypes``). MLA: one latent row per token and layer
    (``mla_latent_dim``, from ``ModelConfig.mla``): the groups made from this layout carry it, and every part
    that lays out or reads a page (``cache_storage``, ``PagedKVCache``, ``check_kernel_support``, the runner)
    takes it from them."""
    name = cache_format(kv_cache_dtype, str(dtype).removeprefix("torch."))
    return KVLayout(config.num_kv_heads, config.head_dim, name, config.layer_windows or (None,) * config.num_layers,
                    None if config.mla is None else config.mla.latent_dim)


def engine_kv_cache_groups(config: ModelConfig, dtype, kv_cache_dtype: str, block_size: int,
                           prefix_match_unit: int | None = None) -> tuple:
    """The model's KV cache groups (``kvlab.sizing.groups.kv_cache_groups``: vLLM V1's), the one place the
    engine reads its block size and cache format from ``LLM``'s settings: everything after (the kernel check,
    calibration, the pool's size, the ``KVCacheConfig`` the manager and the cache tensors are made from) reads
    them from the groups (and the prefix cache's unit, ``prefix_match_unit``)."""
    return kv_cache_groups(engine_layout(config, dtype, kv_cache_dtype), block_size,
                           prefix_match_unit=prefix_match_unit)


def cache_storage(group: KVCacheGroupSpec, dtype) -> tuple:
    """(torch dtype, last dim) of the cache tensors of ``group``'s format: the model's ``dtype`` and a row's
    elements for a float format (the model's own: the engine stores no other; the head size, or an MLA
    group's ``mla_latent_dim``), else the format's storage (``kvlab.kernels.kv_quant``: fp8, or uint8 bytes of
    K/V records; MLA pages are never quantized, ``check_kernel_support``)."""
    if not group.is_quantized:
        return DTYPES[group.cache_format], group.layout.row_elements
    storage = KVQuantizer(group.cache_format, group.head_size)
    return storage.storage_dtype, storage.storage_width


class PagedKVCache:
    """The cache tensors ``config`` (a ``KVCacheConfig``) lays out, as vLLM V1 does: ``gpu[j]``, ``[num_blocks, 2,
    block_size, num_kv_heads, head_dim]`` on the engine's device (CPU in interpreter mode), is shared by the
    j-th layer of every KV cache group (``config.tensors[j]``), and ``layer_caches[i]`` is the tensor layer i
    reads and writes through its group's block tables. A model with one kind of layer has one tensor per layer.
    ``cpu[j]``: the same layout with ``num_cpu_blocks`` blocks in host memory; ``tier[j]``: the offload tier's.
    A quantized format stores its bytes instead (last dim: ``cache_storage``); pages of MLA latent rows (the
    groups' ``mla_latent_dim``) are ``[num_blocks, block_size, mla_latent_dim]`` (``_allocate_latent``).
    ``bytes_per_block`` is what one block id takes in those tensors: a page in each. ``block_copier(gpu, pairs)``
    makes the block copies (None: kvlab's ``copy_blocks``; a learner's kernel, ``kvlab.engine.parts``)."""

    def __init__(self, config: KVCacheConfig, dtype, device, num_cpu_blocks: int, num_offload_blocks: int = 0,
                 block_copier=None):
        group = config.groups[0]  # every group has the same pages
        storage_dtype, width = cache_storage(group, dtype)
        block_size = config.block_size
        if group.mla_latent_dim is not None:
            self._allocate_latent(config, storage_dtype, width, device, num_cpu_blocks, num_offload_blocks)
        else:
            shape = (config.group_size, group.num_kv_heads, width)
            self.gpu = allocate_kv_cache(*shape, block_size=block_size, dtype=storage_dtype, device=device,
                                         num_blocks=config.num_blocks)
            self.cpu = (allocate_cpu_cache(*shape, block_size=block_size, dtype=storage_dtype,
                                           num_blocks=num_cpu_blocks) if num_cpu_blocks else [])
            # The offload tier's CPU slots (kvlab.blocks.tiers), the same layout again.
            self.tier = (allocate_cpu_cache(*shape, block_size=block_size, dtype=storage_dtype,
                                            num_blocks=num_offload_blocks) if num_offload_blocks else [])
        self.layer_caches = [self.gpu[tensor] for tensor in config.layer_tensors]
        self.config, self.num_offload_blocks = config, num_offload_blocks
        self._copy_blocks = block_copier or copy_blocks
        # Whole-block moves by torch indexing (``_apply_indexed``) for the pages the copy kernels do not take.
        self._indexed_moves = group.is_quantized or group.mla_latent_dim is not None
        self._format = f" in {group.cache_format}" if group.is_quantized else ""
        self.bytes_per_block = config.bytes_per_block
        self.num_blocks, self.num_cpu_blocks, self.block_size = config.num_blocks, num_cpu_blocks, block_size
        #: A KIVI cache's per-layer full-precision windows (``ResidualWindow``), which follow the block moves;
        #: set by the engine once the layers have them, empty for every other format.
        self.windows: list = []

    def _allocate_latent(self, config: KVCacheConfig, dtype, latent_dim: int, device, num_cpu_blocks,
                         num_offload_blocks) -> None:
        """MLA pages (the groups' ``mla_latent_dim``): every cache tensor (device, swap and tier alike) is
        ``[blocks, block_size, latent_dim]``, one row per token (``kvlab.kernels.mla_decode``); the block
        manager is the same as for any full-attention model."""
        def allocate(blocks, on):  # host copies of GPU blocks are pinned (DMA-able), as allocate_cpu_cache's
            pin = on == "cpu" and torch.cuda.is_available()
            return allocate_latent_cache(config.group_size, latent_dim, num_blocks=blocks,
                                         block_size=config.block_size, dtype=dtype, device=on, pin_memory=pin)

        self.gpu = allocate(config.num_blocks, device)
        self.cpu = allocate(num_cpu_blocks, "cpu") if num_cpu_blocks else []
        self.tier = allocate(num_offload_blocks, "cpu") if num_offload_blocks else []

    def summary(self) -> str:
        """How many blocks were made, the memory they take and what a token costs, for the engine's log line."""
        mib = self.bytes_per_block / 2**20
        config = self.config
        per_layer = config.groups[0].layout.bytes_per_token_per_layer
        tensors = (f"{config.num_layers} layers" if len(config.groups) == 1 else
                   f"{config.group_size} tensors, each shared by a layer of each of {len(config.groups)} groups")
        line = (f"{self.num_blocks} blocks of {self.block_size} tokens ({self.num_blocks * self.block_size} "
                f"tokens, {self.num_blocks * mib:.1f} MiB; {per_layer * config.group_size:,} bytes per token"
                f"{self._format} = {per_layer:,} x {tensors}) on {self.gpu[0].device}")
        if self.num_cpu_blocks:
            line += f", plus {self.num_cpu_blocks} CPU blocks for swapping ({self.num_cpu_blocks * mib:.1f} MiB)"
        if self.num_offload_blocks:
            line += (f", plus {self.num_offload_blocks} CPU blocks of offloaded prefixes "
                     f"({self.num_offload_blocks * mib:.1f} MiB)")
        return line

    def apply(self, moves: BlockMoves) -> None:
        if self._indexed_moves:
            return self._apply_indexed(moves)
        for kind, pairs, _, _ in moves.rounds:
            if kind == "copy":
                self._copy_blocks(self.gpu, pairs)  # kvlab's: every layer in one launch
            else:
                host = self.tier if kind in ("offload", "promote") else self.cpu
                for gpu, cpu in zip(self.gpu, host):
                    src, dst = (gpu, cpu) if kind in ("swap_out", "offload") else (cpu, gpu)
                    swap_blocks(src, dst, pairs)

    def forget_blocks(self, gpu_blocks, cpu_blocks) -> None:
        """Blocks a freed sequence left unreferenced: their window entries go (the scheduler's
        ``on_blocks_freed``), so a finished, aborted or preempted sequence's open chunk does not wait for its
        block id to be taken again."""
        for window in self.windows:
            window.forget(gpu_blocks, cpu_blocks)

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
            for window in self.windows:
                window.apply_moves(kind, pairs)


def check_kernel_support(config: ModelConfig, groups, dtype, device, attention_backend: str) -> None:
    """Run the backend's decode attention once on a one-block cache of the groups' pages: it rejects a block
    size, head dim, head grouping or dtype it does not support, with a message saying what it does. Both
    backends take the same shapes; only bf16 on CPU differs (the Triton interpreter computes it wrongly).
    Pages of MLA latent rows (the groups' ``mla_latent_dim``): the latent decode (``mla_decode``), on an
    unquantized cache only."""
    group = groups[0]  # every group has the same pages
    block_size = group.block_size
    if kivi_settings(group.cache_format) is not None and any(g.sliding_window is not None for g in groups):
        raise UnsupportedModelError(f"kv_cache_dtype={group.cache_format!r}: {config.path.name} has sliding-window "
                                    "layers, and kvlab's KIVI cache reads every position from 0 (its key groups "
                                    "start there); use it with full-attention models")
    one = torch.ones(1, dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    if group.mla_latent_dim is not None:
        if group.is_quantized:
            raise UnsupportedModelError(f"kv_cache_dtype={group.cache_format!r}: {config.path.name} is an MLA "
                                        "model, whose latent cache is kept in the model's dtype only; pass \"auto\"")
        latent_dim, rank = group.mla_latent_dim, config.mla.kv_lora_rank  # the model splits a row at its rank
        cache = torch.zeros(1, block_size, latent_dim, dtype=dtype, device=device)
        query = torch.zeros(1, config.num_heads, latent_dim, dtype=dtype, device=device)
        decode = mla_decode if attention_backend == "triton" else mla_decode_torch
        args = (query, cache, table, one, rank, config.mla.softmax_scale)
        shape = f"{config.num_heads} heads over an MLA latent of kv_lora_rank {rank} + rope {latent_dim - rank}"
    else:
        num_kv_heads, head_size = group.num_kv_heads, group.head_size
        cache = torch.zeros(1, 2, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
        query = torch.zeros(1, config.num_heads, head_size, dtype=dtype, device=device)
        decode = paged_attention_decode if attention_backend == "triton" else paged_attention_decode_torch
        args = (query, cache, table, one)
        shape = f"{config.num_heads} heads, {num_kv_heads} kv heads, head_dim {head_size}"
    try:
        decode(*args)
    except InvalidArgumentError as e:
        raise UnsupportedModelError(
            f"kvlab's {attention_backend} attention cannot serve {config.path.name} with block_size={block_size}, "
            f"dtype {str(dtype).replace('torch.', '')} ({shape}): {e}") from None


def kivi_window_bytes(config: ModelConfig, dtype, residual_length: int | None, max_num_seqs: int) -> int:
    """What a KIVI cache keeps beside its pages at most: R full-precision tokens (K and V of every layer, in
    the model's ``dtype``) for each of ``max_num_seqs`` running sequences; 0 without KIVI (``residual_length``
    None). The windows of swapped-out sequences move to host memory with their blocks."""
    if residual_length is None:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    return max_num_seqs * residual_length * config.num_layers * 2 * config.num_kv_heads * config.head_dim * element


def blocks_for_memory(groups, config: ModelConfig, dtype, device, *, gpu_memory_utilization: float,
                      max_num_batched_tokens: int, max_num_seqs: int, max_useful_blocks: int,
                      window_bytes: int = 0) -> int:
    """``num_blocks=None``: on a GPU, what is left of ``gpu_memory_utilization`` of its memory once the
    weights are loaded and a step's activations are set aside (``kvlab.sizing.budget``, as ``kvlab size``
    estimates it); on CPU, ``CPU_KV_CACHE_BYTES``; less ``window_bytes`` (a KIVI cache's full-precision
    windows, ``kivi_window_bytes``), divided by what a block id of ``groups`` (the model's KV cache groups)
    costs. Never more than ``max_useful_blocks`` (every sequence at full context length). A smaller cache
    format fits more blocks in the same bytes."""
    per_block = bytes_per_block(groups)
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
    budget -= window_bytes
    num_blocks = kv_blocks(budget, per_block, max_useful_blocks)
    if num_blocks < 1:
        raise InvalidArgumentError(
            f"no memory left for the KV cache ({budget / 2**20:.0f} MiB after weights and activations; one block "
            f"needs {per_block / 2**20:.2f} MiB): raise gpu_memory_utilization, lower max_num_batched_tokens or "
            "pass num_blocks")
    return num_blocks
