"""The torch path on a quantized cache: ``kvlab.kernels.torch_paged``'s plans and masks, with the new
tokens' K/V encoded on write and the gathered context decoded on read (``kvlab.kernels.kv_quant``).

Same plans as the unquantized path (they depend on the cache's shape and strides, not on what a row holds):
a write stores each (token, KV head)'s record, its first half in the K half of the cache and the rest in the
V half; a read gathers both halves of every visible position, joins them into records and decodes them to
fp32 K and V. Unused memory is still never read: padding positions read the sequence's last, written token.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvlab.errors import InvalidArgumentError
from kvlab.kernels._checks import check_attention_options, check_tensor
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.kernels.torch_paged import (CacheWrite, PagedPlan, attend, check_cache, check_plan, plan_cache_write,
                                       plan_paged_attention, row_view)


def _check(kv_cache, quantizer: KVQuantizer):
    """The cache's shape against the format's (not the scales: ``quantizer.check``, once, by the public
    functions here and by the engine when it makes the quantizers); returns (num_blocks, block_size,
    num_kv_heads)."""
    num_blocks, block_size, num_kv_heads, width = check_cache(kv_cache)
    if kv_cache.dtype != quantizer.storage_dtype or width != quantizer.storage_width:
        raise InvalidArgumentError(
            f"a {quantizer.format} cache for head_dim {quantizer.head_dim} is {quantizer.storage_dtype} with a last "
            f"dim of {quantizer.storage_width}; got {kv_cache.dtype} with {width}")
    return num_blocks, block_size, num_kv_heads


def write_cache_quantized(key, value, kv_cache, write: CacheWrite, quantizer: KVQuantizer):
    """Encode the tokens ``write`` names of ``key``/``value [T, H_kv, D]`` and store them (no check). Returns
    kv_cache."""
    records = quantizer.encode(key[write.rows], value[write.rows])              # [W, H, 2 * width]
    halves = records.unflatten(-1, (2, -1)).transpose(1, 2)                     # [W, 2, H, width]
    kv_cache.view(torch.uint8)[write.blocks, :, write.offsets] = halves
    return kv_cache


def reshape_and_cache_quantized(key, value, kv_cache, slot_mapping, quantizer: KVQuantizer):
    """``reshape_and_cache_torch`` for a quantized cache: checks, then encodes and writes."""
    _, _, num_kv_heads = _check(kv_cache, quantizer)
    quantizer.check(num_kv_heads)
    for name, t in (("key", key), ("value", value)):
        check_tensor(t, name, ndim=3, device=kv_cache.device)
        if tuple(t.shape) != (key.shape[0], num_kv_heads, quantizer.head_dim) or not t.is_floating_point():
            raise InvalidArgumentError(f"{name} must be a float tensor [{key.shape[0]}, {num_kv_heads}, "
                                       f"{quantizer.head_dim}] (tokens, kv heads, head_dim), got {t.dtype} "
                                       f"{tuple(t.shape)}")
    return write_cache_quantized(key, value, kv_cache, plan_cache_write(kv_cache, slot_mapping, key.shape[0]),
                                 quantizer)


def paged_attention_torch_quantized(query, kv_cache, plan: PagedPlan, quantizer: KVQuantizer, scale=None,
                                    soft_cap=None):
    """``paged_attention_torch`` reading a quantized cache: ``query [T, H, D]`` (any float dtype) -> a new
    ``[T, H, D]`` tensor in query's dtype, computed in fp32 on the decoded K and V."""
    _, _, num_kv_heads = _check(kv_cache, quantizer)
    check_tensor(query, "query", ndim=3, device=kv_cache.device)
    num_heads = query.shape[1]
    if query.shape[2] != quantizer.head_dim or num_heads % num_kv_heads or not query.is_floating_point():
        raise InvalidArgumentError(f"query must be a float tensor [tokens, a multiple of {num_kv_heads} heads, "
                                   f"{quantizer.head_dim}], got {query.dtype} {tuple(query.shape)}")
    scale, _, soft_cap = check_attention_options(scale=scale, soft_cap=soft_cap)
    check_plan(query, kv_cache, plan)
    if plan.num_tokens == 0:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    S, L = plan.num_seqs, plan.context_len
    halves = row_view(kv_cache.view(torch.uint8)).index_select(0, plan.kv_rows).view(2, S, L, num_kv_heads, -1)
    k, v = quantizer.decode(torch.cat((halves[0], halves[1]), -1))           # each [S, L, H_kv, D] fp32
    return attend(query, k.transpose(1, 2), v.transpose(1, 2), plan, scale, soft_cap)


def paged_attention_decode_torch_quantized(query, kv_cache, block_tables, seq_lens, quantizer: KVQuantizer,
                                           scale=None, sliding_window=None):
    """Decode (one query per sequence at position seq_len - 1) on a quantized cache: the torch twin of the
    Triton decode kernel's fp8 variant."""
    check_tensor(query, "query", ndim=3)
    num_seqs = query.shape[0]
    cu_query_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    plan = plan_paged_attention(kv_cache, block_tables, seq_lens, cu_query_lens, num_seqs, sliding_window)
    quantizer.check(kv_cache.shape[3])
    return paged_attention_torch_quantized(query, kv_cache, plan, quantizer, scale)


# --- KIVI: a full-precision window beside quantized pages -----------------------------------------------------


class ResidualWindow:
    """One layer's full-precision K/V of every sequence's *open chunk* (KIVI's residual; see ``KiviStep``), by
    the block id the chunk starts in: ``entries[block] [2, n, H_kv, D]`` (K, V) in the model's dtype, the
    chunk's first n tokens. ``swapped`` holds the entries of blocks swapped out to the CPU cache, by CPU block
    id. ``apply_moves`` follows the block moves a step makes (copy-on-write, swaps).

    A forward pass only *stages* its changes (``kivi_attention``); the engine's runner commits them once the
    whole pass returned and discards them before the next one, so a pass that raises part-way (some layers
    ran; kvlab.engine.isolation then runs each sequence again alone) leaves every window as it was: a rerun
    reads what the first try read, and the pages it rewrites get the same bytes."""

    def __init__(self):
        self.entries: dict[int, torch.Tensor] = {}
        self.swapped: dict[int, torch.Tensor] = {}
        self.staged: list[tuple[list, dict]] = []  # (blocks whose entries go, new entries), one per call

    def commit(self) -> None:
        for dropped, added in self.staged:
            for block in dropped:
                self.entries.pop(block, None)
            self.entries.update(added)
        self.staged = []

    def discard(self) -> None:
        self.staged = []

    def forget(self, gpu_blocks, cpu_blocks) -> None:
        """Drop the entries of blocks (GPU) and swapped-out blocks (CPU) no sequence holds any more."""
        for block in gpu_blocks:
            self.entries.pop(block, None)
        for block in cpu_blocks:
            self.swapped.pop(block, None)

    def apply_moves(self, kind: str, pairs) -> None:
        """Copy-on-write copies an open chunk with its block; a swap moves it between the GPU and CPU dicts. The
        offload tier takes only full blocks, whose chunks are all sealed (R divides the block size): nothing
        to move."""
        moves = {"copy": (self.entries, self.entries), "swap_out": (self.entries, self.swapped),
                 "swap_in": (self.swapped, self.entries)}
        if kind not in moves:
            return
        source, target = moves[kind]
        for src, dst in pairs:
            if src in source:
                target[dst] = source[src].clone() if kind == "copy" else source.pop(src)


@dataclass
class KiviSeq:
    """One sequence in a step: its new tokens are query rows ``rows`` at positions ``first`` .. ``length - 1``;
    its open chunk starts at ``open_start`` (window entry ``read_key`` holds positions ``open_start`` ..
    ``first - 1``, None when there are none); after the step the open chunk starts at ``next_start``, in block
    ``next_key`` (None: every chunk is sealed); ``sealed_blocks``: blocks wholly before it, whose entries go."""
    rows: slice
    first: int
    length: int
    open_start: int
    read_key: int | None
    next_start: int
    next_key: int | None
    sealed_blocks: list


@dataclass
class KiviStep:
    """What a step of a KIVI cache does, the same for every layer (``plan_kivi_step``).

    A query at position p reads keys and values of its own chunk (positions ``R floor(p / R)`` .. p, R the
    residual length) in full precision, every earlier position dequantized from the pages: a function of
    positions <= p only, so a prefill, a chunked prefill, decoding one token at a time and a prefix hit all
    give the same K/V. A chunk is *sealed* (quantized into the pages, whole key groups, G dividing R) when its
    last token is written; the open chunk's full-precision K/V wait in the layer's ``ResidualWindow``.
    ``open_kv [2, S, open_len, H_kv, D]`` (``kivi_open_chunks``) holds each sequence's full-precision K/V from
    its open chunk's start ``open_starts [S]`` on (the window's tokens, then the new ones): where the seals
    take their rows (``seal_rows [N]``) and the reads their full-precision keys.
    ``seal_seqs`` / ``seal_positions`` ``[N]``: the (sequence, position) pairs sealed this step, stored at
    ``seal_blocks`` / ``seal_offsets``. The torch read only (None for the Triton kernels'): ``read_blocks`` /
    ``read_offsets`` ``[S * Lg]``: where position j of each sequence's context is read (padding reads the
    sequence's last token: unused memory is never read); ``quantized_ok`` / ``full_ok`` ``[S, Lg, 1, 1]``:
    positions holding codes / full precision; ``plan``: the torch plan with the mask over [dequantized keys,
    full-precision keys] ``[S, 1, Q, 2 Lg]``."""
    seqs: list
    open_starts: torch.Tensor
    open_len: int
    seal_seqs: torch.Tensor
    seal_positions: torch.Tensor
    seal_rows: torch.Tensor
    seal_blocks: torch.Tensor
    seal_offsets: torch.Tensor
    read_blocks: torch.Tensor | None = None
    read_offsets: torch.Tensor | None = None
    quantized_ok: torch.Tensor | None = None
    full_ok: torch.Tensor | None = None
    context_len: int = 0
    plan: PagedPlan | None = None


def plan_kivi_step(plan: PagedPlan | None, block_tables, seq_lens, cu_query_lens, block_size: int,
                   residual_length: int, group: int) -> KiviStep:
    """The step's ``KiviStep`` from its metadata (read once, on the host) and, for the torch read, its torch
    ``plan`` (full attention); ``plan`` None: what the Triton kernels take (seals and the window's changes)."""
    device = seq_lens.device
    R = residual_length
    lens = seq_lens.tolist()
    cu = (cu_query_lens.tolist() if cu_query_lens is not None else list(range(len(lens) + 1)))
    tables = block_tables.tolist()
    seqs, seal_seqs, seal_positions = [], [], []
    for s, (length, table) in enumerate(zip(lens, tables)):
        first = length - (cu[s + 1] - cu[s])
        open_start = first // R * R
        next_start = length // R * R
        seqs.append(KiviSeq(slice(cu[s], cu[s + 1]), first, length, open_start,
                            table[open_start // block_size] if first > open_start else None, next_start,
                            table[next_start // block_size] if length > next_start else None,
                            table[:next_start // block_size]))
        seal_seqs += [s] * (next_start - open_start)
        seal_positions += range(open_start, next_start)
    open_starts = torch.tensor([seq.open_start for seq in seqs], dtype=torch.int64, device=device)
    open_len = max((seq.length - seq.open_start for seq in seqs), default=0)
    seal_seqs = torch.tensor(seal_seqs, dtype=torch.int64, device=device)
    seal_positions = torch.tensor(seal_positions, dtype=torch.int64, device=device)
    table_long = block_tables.long()
    seal_blocks = table_long[seal_seqs, seal_positions // block_size]
    step = KiviStep(seqs, open_starts, open_len, seal_seqs, seal_positions, seal_positions - open_starts[seal_seqs],
                    seal_blocks, seal_positions % block_size)
    if plan is None:
        return step
    longest = max(lens, default=0)
    context_len = -(-longest // group) * group                       # Lg: whole key groups
    lens_t = seq_lens.long()[:, None]
    pos = torch.arange(context_len, device=device)[None]             # [1, Lg]
    read = torch.minimum(pos, lens_t - 1)
    read_blocks = table_long.gather(1, read // block_size).flatten()
    # Codes exist below each sequence's last sealed position; full precision from its open chunk on.
    sealed = torch.tensor([seq.next_start for seq in seqs], dtype=torch.int64, device=device)[:, None]
    quantized_ok = pos < sealed
    full_ok = (pos >= open_starts[:, None]) & (pos < lens_t)
    # Each query row's own chunk: full precision from its start, codes before it.
    q_lens = lens_t[:, 0] - torch.tensor([seq.first for seq in seqs], dtype=torch.int64, device=device)
    t = torch.arange(plan.query_len, device=device)
    q_pos = torch.where(t < q_lens[:, None], lens_t - q_lens[:, None] + t, lens_t - 1)  # [S, Q], as the plan
    chunk = (q_pos // R * R)[:, None, :, None]                         # [S, 1, Q, 1]
    visible = F.pad(plan.mask, (0, context_len - plan.context_len))   # [S, 1, Q, Lg]
    keys = pos[:, None, None, :]
    mask = torch.cat((visible & (keys < chunk), visible & (keys >= chunk)), -1)
    return replace(step, read_blocks=read_blocks, read_offsets=(read % block_size).flatten(),
                   quantized_ok=quantized_ok[..., None, None], full_ok=full_ok[..., None, None],
                   context_len=context_len, plan=replace(plan, mask=mask, context_len=2 * context_len))


def kivi_open_chunks(key, value, step: KiviStep, window: ResidualWindow) -> torch.Tensor:
    """``open_kv [2, S, open_len, H_kv, D]`` in key's dtype (``KiviStep``): each sequence's open chunk so far
    from ``window``, then its new ``key``/``value [T, H_kv, D]`` rows; zeros past its length."""
    open_kv = key.new_zeros(2, len(step.seqs), step.open_len, *key.shape[1:])
    new = torch.stack((key, value))
    for s, seq in enumerate(step.seqs):
        waiting = seq.first - seq.open_start
        if seq.read_key is not None:
            open_kv[:, s, :waiting] = window.entries[seq.read_key][:, :waiting]
        open_kv[:, s, waiting:seq.length - seq.open_start] = new[:, seq.rows]
    return open_kv


def kivi_stage(step: KiviStep, window: ResidualWindow, open_kv: torch.Tensor) -> None:
    """Stage the step's window changes (``ResidualWindow.commit``): sealed chunks leave, open chunks are kept."""
    dropped = [block for seq in step.seqs for block in seq.sealed_blocks]
    added = {seq.next_key: open_kv[:, s, seq.next_start - seq.open_start:seq.length - seq.open_start].clone()
             for s, seq in enumerate(step.seqs) if seq.next_key is not None}
    window.staged.append((dropped, added))  # committed by the engine once the whole pass has run


def kivi_read_torch(query, kv_cache, step: KiviStep, quantizer: KVQuantizer, open_kv, scale=None):
    """The read of a KIVI step in torch (the twin of ``kvlab.kernels.kivi_paged_attention``; no checks):
    ``query [T, H, D]`` over the dequantized pages (sealed chunks, the step's included) and ``open_kv``'s
    full-precision chunks, as ``step`` (made with a torch plan) masks them. Returns ``[T, H, D]`` in query's
    dtype."""
    S, Lg = len(step.seqs), step.context_len
    num_kv_heads = kv_cache.shape[3]
    halves = kv_cache.view(torch.uint8)[step.read_blocks, :, step.read_offsets]  # [S * Lg, 2, H, W]
    records = torch.cat((halves[:, 0], halves[:, 1]), -1).view(S, Lg, num_kv_heads, -1)
    k_codes, v_codes = quantizer.decode(records)                        # [S, Lg, H, D] each
    # Position j of sequence s in full precision: open_kv[:, s, j - open_start], where full_ok.
    index = (torch.arange(Lg, device=open_kv.device)[None] - step.open_starts[:, None]).clamp(0, step.open_len - 1)
    full = open_kv.float()[:, torch.arange(S, device=open_kv.device)[:, None], index]  # [2, S, Lg, H, D]
    zero = k_codes.new_zeros(())
    k = torch.cat((torch.where(step.quantized_ok, k_codes, zero), torch.where(step.full_ok, full[0], zero)), 1)
    v = torch.cat((torch.where(step.quantized_ok, v_codes, zero), torch.where(step.full_ok, full[1], zero)), 1)
    return attend(query, k.transpose(1, 2), v.transpose(1, 2), step.plan, scale)


def kivi_attention(query, key, value, kv_cache, step: KiviStep, quantizer: KVQuantizer, window: ResidualWindow,
                   scale=None):
    """One layer of a KIVI step in torch (no checks: ``plan_kivi_step`` made ``step`` for this cache, with a
    torch plan): the new tokens' ``key``/``value [T, H_kv, D]`` join their sequences' open chunks; every chunk
    that fills is quantized into the pages and leaves ``window``; the open chunks are staged there
    (``ResidualWindow.commit``); then ``query [T, H, D]`` attends over the dequantized pages and the
    full-precision chunks (``kivi_read_torch``). Returns ``[T, H, D]`` in query's dtype."""
    open_kv = kivi_open_chunks(key, value, step, window)
    if step.seal_positions.numel():
        sealed = open_kv[:, step.seal_seqs, step.seal_rows]             # [2, N, H, D]
        records = quantizer.encode(sealed[0], sealed[1])                # [N, H, rec]
        halves = records.unflatten(-1, (2, -1)).transpose(1, 2)         # [N, 2, H, W]
        kv_cache.view(torch.uint8)[step.seal_blocks, :, step.seal_offsets] = halves
    kivi_stage(step, window, open_kv)
    return kivi_read_torch(query, kv_cache, step, quantizer, open_kv, scale)
