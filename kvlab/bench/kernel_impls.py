"""What the kernel benchmark times: for each case, kvlab's kernel and its peers on the same inputs, as
zero-argument callables (``{impl name: callable}``). Setup (inputs, contiguous copies, masks) happens here,
untimed. Everything takes a ``device``, so the pure-torch peers are checked on CPU and the GPU run book's dry
run goes through the same code in the Triton interpreter."""

import sys

import torch

from kvlab.bench.kernel_cases import COPY_LAYERS, DTYPES, FP8, io_dtype

#: FlexAttention's query tile (rows of the block mask); its default sparse block size.
FLEX_Q_BLOCK = 128


def paged_inputs(case, device="cuda"):
    """A cache holding ``batch`` sequences of ``context`` tokens in shuffled blocks, its block tables and
    seq_lens, the queries (``case.query_len`` per sequence) and cu_query_lens."""
    dtype, q_len = io_dtype(case.dtype), case.query_len
    blocks_per_seq = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_seq
    kv_cache = torch.randn(num_blocks, 2, case.block_size, case.num_kv_heads, case.head_dim, dtype=dtype,
                           device=device).to(DTYPES[case.dtype])
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(case.batch, blocks_per_seq)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    query = torch.randn(case.batch * q_len, case.num_heads, case.head_dim, dtype=dtype, device=device)
    cu_query_lens = torch.arange(0, case.batch + 1, dtype=torch.int32, device=device) * q_len
    return kv_cache, block_tables, seq_lens, query, cu_query_lens


def contiguous_kv(kv_cache, block_tables, seq_len):
    """The no-paging baseline's K, V ``[batch, num_kv_heads, seq_len, head_dim]`` (gathered once, not timed)."""
    k, v = (kv_cache[block_tables.long(), i].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous() for i in (0, 1))
    return k, v


def sdpa_contiguous(case, query, kv_cache, block_tables):
    """The no-paging baseline: torch SDPA over K/V gathered once into contiguous tensors (not timed).
    Returns a callable giving ``[batch, num_heads, q_len, head_dim]``."""
    q_len = query.shape[0] // case.batch
    k, v = contiguous_kv(kv_cache, block_tables, case.context)
    q = query.view(case.batch, q_len, case.num_heads, case.head_dim).transpose(1, 2)
    mask = None
    if q_len > 1:
        from torch.nn.attention.bias import causal_lower_right  # new tokens sit at the end of the context
        mask = causal_lower_right(q_len, case.context)
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=case.num_heads != case.num_kv_heads)


def paged_block_mask(block_tables, seq_lens, q_len, block_size, num_blocks):
    """A FlexAttention BlockMask whose key blocks are kvlab's pages: row r of sequence b lists, in logical
    order, the physical blocks its queries can see (straight from the block table), whole ones as "full" (no
    mask_mod call) and the rest as partial. The mask_mod maps a physical slot back to its owner and logical
    position, so it is also right where the block lists are ignored (eager mode)."""
    from torch.nn.attention.flex_attention import BlockMask

    device, (batch, width) = block_tables.device, block_tables.shape
    tables = block_tables.long()
    owner = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
    logical = torch.zeros(num_blocks, dtype=torch.long, device=device)
    for b in range(batch):  # setup only: which sequence owns each physical block, and at which logical index
        used = -(-int(seq_lens[b]) // block_size)
        owner[tables[b, :used]] = b
        logical[tables[b, :used]] = torch.arange(used, device=device)
    rows = torch.arange(-(-q_len // FLEX_Q_BLOCK), device=device)
    first = seq_lens.long()[:, None] - q_len + rows * FLEX_Q_BLOCK               # [batch, rows] positions
    last = torch.minimum(first + FLEX_Q_BLOCK, seq_lens.long()[:, None]) - 1
    num_full, num_seen = (first + 1) // block_size, last // block_size + 1
    # Flex sizes its dense views of the mask by the index lists' width, which must cover every physical block.
    padded = torch.zeros(batch, num_blocks, dtype=torch.long, device=device)
    padded[:, :width] = tables.clamp(min=0)
    cols = torch.arange(num_blocks, device=device)
    expanded = padded[:, None, :].expand(batch, rows.numel(), num_blocks)
    partial = torch.gather(expanded, 2, (cols + num_full[..., None]).clamp(max=num_blocks - 1))
    query_start = seq_lens.long() - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // block_size
        position = logical[page] * block_size + kv_idx % block_size
        return (owner[page] == b) & (position <= query_start[b] + q_idx)

    as_mask = (lambda t: t[:, None].to(torch.int32).contiguous())
    return BlockMask.from_kv_blocks(as_mask(num_seen - num_full), as_mask(partial), as_mask(num_full),
                                    as_mask(expanded), BLOCK_SIZE=(FLEX_Q_BLOCK, block_size), mask_mod=mask_mod,
                                    seq_lengths=(q_len, num_blocks * block_size))


_compiled_flex = None


def flex_attention_fn(device):
    """Compiled FlexAttention on a GPU (eager flex materialises every score: far too big there), eager on CPU.
    One compiled function for the whole run, with dynamic shapes, so cases share compilations."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if torch.device(device).type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    return _compiled_flex


def flex_paged(case, query, kv_cache, block_tables, seq_lens):
    """FlexAttention over kvlab's pages with ``paged_block_mask``. Flex reads K/V as ``[1, heads, slots, dim]``
    with one token stride, so the cache is copied once (untimed) into that layout, pages in the same physical
    order; every query sequence is one batch entry reading that shared K/V through its row of the mask."""
    q_len, num_blocks = case.query_len, kv_cache.shape[0]
    k, v = (kv_cache[:, i].reshape(1, num_blocks * case.block_size, case.num_kv_heads, case.head_dim)
            .transpose(1, 2).contiguous() for i in (0, 1))
    q = query.view(case.batch, q_len, case.num_heads, case.head_dim).transpose(1, 2)
    mask = paged_block_mask(block_tables, seq_lens, q_len, case.block_size, num_blocks)
    # Flex's prefill kernel needs its key tile to divide the page; its decode kernel shrinks its own.
    options = {"BLOCK_N": min(case.block_size, 64)} if q_len > 1 else None
    flex = flex_attention_fn(query.device)
    return lambda: flex(q, k, v, block_mask=mask, enable_gqa=case.num_heads != case.num_kv_heads,
                        kernel_options=options)


def attention_impls(case, device="cuda"):
    """{impl name: callable} for one decode or prefill case; peers that fail to import or set up are reported
    and skipped. Decode runs three ways: split-K chosen by the launcher ("kvlab", what the engine runs), forced
    on and forced off."""
    kv_cache, block_tables, seq_lens, query, cu_query_lens = paged_inputs(case, device)
    impls, scales = {}, fp8_unit_scales(case, device)
    if case.kernel == "decode":
        from kvlab.kernels.paged_attention_decode import paged_attention_decode
        for impl, split_k in (("kvlab", None), ("kvlab_split_k", True), ("kvlab_no_split", False)):
            impls[impl] = (lambda s: lambda: paged_attention_decode(query, kv_cache, block_tables, seq_lens,
                                                                    split_k=s, **scales))(split_k)
    else:
        from kvlab.kernels.paged_prefill import paged_prefill
        impls["kvlab"] = lambda: paged_prefill(query, kv_cache, block_tables, seq_lens, cu_query_lens, **scales)
    if case.dtype in FP8:  # no peer here reads an fp8 paged cache: compare with the fp16 rows' peers
        return impls

    impls["torch_sdpa_contiguous"] = sdpa_contiguous(case, query, kv_cache, block_tables)
    peers = {"flex_attention_paged": lambda: flex_paged(case, query, kv_cache, block_tables, seq_lens),
             "flashinfer": lambda: flashinfer_impl(case, query, kv_cache, block_tables, cu_query_lens)}
    for name, make in peers.items():
        try:
            impls[name] = make()
        except Exception as error:  # optional peers: absent, or an incompatible version
            print(f"  {name} skipped: {type(error).__name__}: {error}", file=sys.stderr)
    return impls


def flashinfer_impl(case, query, kv_cache, block_tables, cu_query_lens):
    """flashinfer's paged wrappers read our cache layout as is ("NHD": [pages, 2, page_size, heads, dim])."""
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    blocks_per_seq = block_tables.shape[1]
    indptr = torch.arange(0, case.batch + 1, dtype=torch.int32, device="cuda") * blocks_per_seq
    indices = block_tables.flatten().contiguous()
    last_page_len = torch.full((case.batch,), (case.context - 1) % case.block_size + 1, dtype=torch.int32,
                               device="cuda")
    shape = (case.num_heads, case.num_kv_heads, case.head_dim, case.block_size)
    if case.query_len == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last_page_len, *shape, data_type=query.dtype)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(cu_query_lens, indptr, indices, last_page_len, *shape, causal=True, q_data_type=query.dtype)
    return lambda: wrapper.run(query, kv_cache)


def fp8_unit_scales(case, device) -> dict:
    """An fp8 case's ``k_scale`` / ``v_scale`` keyword arguments (1.0 per KV head, vLLM's default); none else."""
    if case.dtype not in FP8:
        return {}
    return {name: torch.ones(case.num_kv_heads, device=device) for name in ("k_scale", "v_scale")}


def cache_op_impls(case, device="cuda"):
    """{impl name: callable} for reshape_and_cache, copy_blocks, swap_out or swap_in: the kernel and a plain
    torch peer (none for an fp8 cache: the peer would be a different computation, a cast)."""
    dtype = DTYPES[case.dtype]
    from kvlab.kernels.cache import allocate_kv_cache
    if case.kernel == "reshape_and_cache":
        from kvlab.kernels.reshape_and_cache import reshape_and_cache
        num_blocks = 2 * (-(-case.batch // case.block_size))
        (kv_cache,) = allocate_kv_cache(1, case.num_kv_heads, case.head_dim, block_size=case.block_size, dtype=dtype,
                                        device=device, num_blocks=num_blocks)
        key, value = (torch.randn(case.batch, case.num_kv_heads, case.head_dim, dtype=io_dtype(case.dtype),
                                  device=device) for _ in range(2))
        slots = torch.randperm(num_blocks * case.block_size, device=device)[:case.batch]
        blocks, offsets = slots // case.block_size, slots % case.block_size
        scales = fp8_unit_scales(case, device)
        if scales:
            return {"kvlab": lambda: reshape_and_cache(key, value, kv_cache, slots, **scales)}

        def torch_scatter():
            kv_cache[blocks, 0, offsets] = key
            kv_cache[blocks, 1, offsets] = value
        return {"kvlab": lambda: reshape_and_cache(key, value, kv_cache, slots), "torch_index_put": torch_scatter}

    if case.kernel in ("swap_out", "swap_in"):
        return swap_impls(case, device)

    from kvlab.kernels.copy_blocks import copy_blocks
    kv_caches = allocate_kv_cache(COPY_LAYERS, case.num_kv_heads, case.head_dim, block_size=case.block_size,
                                  dtype=dtype, device=device, num_blocks=2 * case.batch)
    pairs = torch.randperm(2 * case.batch, device=device).view(-1, 2)  # disjoint srcs and dsts

    def torch_per_layer():
        for kv_cache in kv_caches:
            kv_cache[pairs[:, 1]] = kv_cache[pairs[:, 0]]
    return {"kvlab": lambda: copy_blocks(kv_caches, pairs), "torch_per_layer": torch_per_layer}


def swap_impls(case, device):
    """``batch`` scattered blocks of one layer between the device cache and a host cache (pinned when there
    is CUDA), out (device -> host) or in; the peer indexes and copies with plain torch."""
    from kvlab.kernels.cache import allocate_cpu_cache, allocate_kv_cache
    from kvlab.kernels.copy_blocks import swap_blocks

    dtype, num_blocks = DTYPES[case.dtype], 2 * case.batch
    (gpu,) = allocate_kv_cache(1, case.num_kv_heads, case.head_dim, block_size=case.block_size, dtype=dtype,
                               device=device, num_blocks=num_blocks)
    (cpu,) = allocate_cpu_cache(1, case.num_kv_heads, case.head_dim, block_size=case.block_size, dtype=dtype,
                                num_blocks=num_blocks, pin_memory=torch.device(device).type == "cuda")
    src, dst = (gpu, cpu) if case.kernel == "swap_out" else (cpu, gpu)
    pairs = torch.stack([torch.randperm(num_blocks)[:case.batch], torch.randperm(num_blocks)[:case.batch]], dim=1)
    src_ids, dst_ids = pairs[:, 0].to(src.device), pairs[:, 1].to(dst.device)

    def torch_index_copy():
        dst[dst_ids] = src[src_ids].to(dst.device)
    return {"kvlab": lambda: swap_blocks(src, dst, pairs), "torch_index_copy": torch_index_copy}
