"""Launcher-side validation shared by every kvlab kernel.

A Triton kernel trusts its inputs: an out-of-range block id or slot silently reads or writes someone
else's memory. So every launcher checks its arguments here first and raises
``kvlab.errors.InvalidArgumentError`` saying what was wrong and what is allowed, before anything is
written. Value checks are a handful of tensor reductions (no Python loops over tensor elements), so they
stay cheap on a GPU; the slower work of pinpointing the first bad entry only happens on the error path.
"""

import torch

from kvlab.device import DEVICE, ON_GPU
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_number, check_optional_int, is_int

#: Cache dtypes the kernels accept (bf16 only where it works, see ``check_cache_dtype``).
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: fp8 caches (vLLM's kv_cache_dtype fp8_e4m3 / fp8_e5m2): reshape_and_cache quantizes into them and
#: paged_attention_decode dequantizes from them, with fp32 scales per KV head.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Tokens per block the kernels accept: every power of two from 1 to 128 (vLLM, FlashInfer and SGLang use 1
#: and 128 too). Kernels find each token's block by division (slot // block_size), so no tile depends on it.
SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
#: Head dims the kernels accept: any from 16 to 256. Kernels work on a power-of-two tile of at least 16 (the
#: smallest ``tl.dot`` operand) and mask the padding, so 80, 96 or 17 run on a tile of 128, 128 or 32.
SUPPORTED_HEAD_DIMS = range(16, 257)
#: What each dim of a cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` indexes, for messages.
CACHE_DIM_NAMES = ("blocks", "K and V halves", "slots", "heads", "head_dim elements")
#: MLA's latent cache ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (``kvlab.kernels.mla_decode``):
#: the compressed KV part's sizes and the rotary part's. The kernel tiles each part on a power of two of at
#: least 16 and masks the padding; DeepSeek-V2/V3 use 512 + 64.
SUPPORTED_KV_LORA_RANKS = range(16, 1025)
SUPPORTED_ROPE_DIMS = range(1, 257)
LATENT_CACHE_DIM_NAMES = ("blocks", "slots", "latent elements")


def _fail(message: str):
    raise InvalidArgumentError(message)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype_names(dtypes) -> str:
    return ", ".join(_dtype_name(d) for d in dtypes)


def _allowed(values) -> str:
    """``values`` for a message: "1, 2, 4" or, for a range, "any int from 16 to 256"."""
    if isinstance(values, range):
        return f"any int from {values.start} to {values.stop - 1}"
    return ", ".join(map(str, values))


def _same_device(actual, wanted):
    """``wanted`` may leave out the index ("cuda" matches "cuda:0")."""
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


def check_tensor(t, name, *, ndim=None, dtypes=None, device=None, last_dim_contiguous=True):
    """Check that ``t`` is a tensor with the given rank, one of ``dtypes`` and on ``device``.

    ``last_dim_contiguous`` requires stride 1 along the last dim (kernels vectorise along it and take
    every other stride as an argument).
    """
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)} ({t.dim()}-D)")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(f"{name} has dtype {_dtype_name(t.dtype)}; allowed: {_dtype_names(dtypes)}")
    if device is not None and not _same_device(t.device, torch.device(device)):
        _fail(f"{name} is on {t.device} but must be on {torch.device(device)}")
    check_has_memory(t, name)
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")


def check_has_memory(t, name):
    """A meta tensor has a shape and a dtype but no memory: a kernel (or a value check) cannot read it."""
    if t.device.type == "meta":
        _fail(f"{name} is a meta tensor (shape and dtype only, no memory), but kernels read and write real "
              f"memory: pass a real tensor (on {DEVICE})")


def check_no_overlap(t, name, dim_names):
    """No two indices of ``t`` may reach one element (else parallel writes race and reads see another slot's
    data): no zero stride (``expand``), and no step along a dim landing inside what the smaller-stride dims
    span (an ``as_strided`` view where block i + 1 starts inside block i). Visiting dims from the smallest
    stride up, each stride must exceed the largest offset the dims before it reach; then two different indices
    differ by at least their largest differing dim's stride, more than the smaller dims can make up. Every
    permuted or padded contiguous tensor passes; interleaved strides that happen not to collide (shape (3, 2),
    strides (2, 3)) are refused too, which no real cache layout needs."""
    shape, strides = tuple(t.shape), t.stride()
    reach = 0  # largest offset reachable with the dims visited so far
    for dim in sorted((dim for dim in range(t.dim()) if shape[dim] > 1), key=lambda dim: strides[dim]):
        if strides[dim] <= reach:
            step = "a zero stride" if strides[dim] == 0 else \
                f"a stride of {strides[dim]}, inside the {reach + 1} elements its smaller-stride dims span"
            _fail(f"{name} (shape {shape}, strides {strides}) gives its {dim_names[dim]} {step}, so they overlap "
                  "in memory; allocate a real tensor (kvlab.kernels.allocate_kv_cache)")
        reach += strides[dim] * (shape[dim] - 1)


def check_kernel_device(t, name):
    """Compiled kernels need CUDA tensors (the interpreter takes CPU tensors, and copies CUDA ones to the host)."""
    if ON_GPU and t.device.type != "cuda":
        _fail(f"{name} is on {t.device}, but kernels run compiled on the GPU here: move it to cuda")


def check_cache_dtype(dtype, name, *, arithmetic=True):
    """bf16 needs hardware support on the GPU. In the Triton 3.9 interpreter bf16 *arithmetic* gives wrong
    results silently, so kernels that compute (attention) reject it there; pure copies move bf16 bits
    correctly and pass ``arithmetic=False``."""
    if dtype not in CACHE_DTYPES:
        _fail(f"{name} has dtype {_dtype_name(dtype)}; allowed: {_dtype_names(CACHE_DTYPES)}")
    if dtype != torch.bfloat16:
        return
    if ON_GPU and not torch.cuda.is_bf16_supported(including_emulation=False):  # native bf16: sm_80+
        _fail(f"{name} is bfloat16 but this GPU does not support bf16; use float16 or float32")
    if not ON_GPU and arithmetic:
        _fail(f"{name} is bfloat16, which the Triton interpreter (CPU mode) computes wrongly; "
              "use float16 or float32 on CPU (bf16 works on a GPU that supports it)")


def check_kv_cache(kv_cache, name="kv_cache", *, arithmetic=True, block_sizes=SUPPORTED_BLOCK_SIZES,
                   head_dims=SUPPORTED_HEAD_DIMS, storage_dtypes=None):
    """Validate one layer's cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (any strides, last
    dim contiguous). ``storage_dtypes``: the dtypes a quantized cache may have instead of ``CACHE_DTYPES``
    (``kvlab.kernels.kv_quant``). Returns ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
    check_tensor(kv_cache, name, ndim=5)
    if storage_dtypes is None:
        check_cache_dtype(kv_cache.dtype, name, arithmetic=arithmetic)
    elif kv_cache.dtype not in storage_dtypes:
        _fail(f"{name} has dtype {_dtype_name(kv_cache.dtype)}; allowed: {_dtype_names(storage_dtypes)}")
    check_kernel_device(kv_cache, name)
    num_blocks, two, block_size, num_kv_heads, head_dim = kv_cache.shape
    if two != 2:
        _fail(f"{name} must be laid out [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]; "
              f"got shape {tuple(kv_cache.shape)} (dim 1 is {two}, not 2)")
    if num_blocks < 1 or num_kv_heads < 1:
        _fail(f"{name} must have at least one block and one kv head, got shape {tuple(kv_cache.shape)}")
    if block_size not in block_sizes:
        _fail(f"{name} has block_size {block_size}; supported: {_allowed(block_sizes)}")
    if head_dim not in head_dims:
        _fail(f"{name} has head_dim {head_dim}; supported: {_allowed(head_dims)}")
    if kv_cache.stride(-1) != 1:
        _fail(f"{name} must be contiguous in head_dim (stride 1), got strides {kv_cache.stride()}")
    check_no_overlap(kv_cache, name, CACHE_DIM_NAMES)
    return num_blocks, block_size, num_kv_heads, head_dim


def check_latent_cache(latent_cache, kv_lora_rank, name="latent_cache", *, arithmetic=True):
    """Validate one MLA layer's cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (any strides, last
    dim contiguous), whose rows hold the compressed KV (``kv_lora_rank`` features, also the values) and then
    the key's rotary part. Returns ``(num_blocks, block_size, latent_dim)``."""
    check_tensor(latent_cache, name, ndim=3)
    check_cache_dtype(latent_cache.dtype, name, arithmetic=arithmetic)
    check_kernel_device(latent_cache, name)
    num_blocks, block_size, latent_dim = latent_cache.shape
    if not is_int(kv_lora_rank) or kv_lora_rank not in SUPPORTED_KV_LORA_RANKS:
        _fail(f"kv_lora_rank must be an int, {_allowed(SUPPORTED_KV_LORA_RANKS)}, got {kv_lora_rank!r}")
    if latent_dim - kv_lora_rank not in SUPPORTED_ROPE_DIMS:
        _fail(f"{name} rows have {latent_dim} elements: kv_lora_rank {kv_lora_rank} plus a rotary part of "
              f"{latent_dim - kv_lora_rank}; the rotary part must be {_allowed(SUPPORTED_ROPE_DIMS)}")
    if num_blocks < 1:
        _fail(f"{name} must have at least one block, got shape {tuple(latent_cache.shape)}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        _fail(f"{name} has block_size {block_size}; supported: {_allowed(SUPPORTED_BLOCK_SIZES)}")
    check_no_overlap(latent_cache, name, LATENT_CACHE_DIM_NAMES)
    return num_blocks, block_size, latent_dim


def check_seq_lens(seq_lens, num_seqs, *, device=None, min_len=1, max_len=None):
    """int32 ``[num_seqs]`` with every entry in ``[min_len, max_len]``. Returns the longest length (an int:
    launchers need it for the grid anyway, and it costs the one sync this check already pays)."""
    check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=(torch.int32,), device=device)
    if seq_lens.shape[0] != num_seqs:
        _fail(f"seq_lens has {seq_lens.shape[0]} entries but there are {num_seqs} sequences")
    if num_seqs == 0:
        return 0
    lo, hi = seq_lens.min().item(), seq_lens.max().item()
    if lo < min_len:
        seq = int(torch.argmin(seq_lens))
        _fail(f"seq_lens[{seq}] = {lo}; every sequence length must be >= {min_len}")
    if max_len is not None and hi > max_len:
        seq = int(torch.argmax(seq_lens))
        _fail(f"seq_lens[{seq}] = {hi}; every sequence length must be <= {max_len}")
    return int(hi)


def check_block_tables(block_tables, num_seqs, num_blocks, seq_lens, block_size):
    """int32 ``[num_seqs, max_blocks_per_seq]``, on seq_lens' device. The first ``ceil(seq_len/block_size)``
    entries of each row (the blocks the sequence uses) must be in ``[0, num_blocks)``; the rest of the row
    is never read and may hold anything (-1 padding, stale ids)."""
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=seq_lens.device,
                 last_dim_contiguous=False)
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables has {block_tables.shape[0]} rows but there are {num_seqs} sequences")
    if num_seqs == 0:
        return
    width = block_tables.shape[1]
    blocks_needed = (seq_lens.long() + block_size - 1) // block_size  # [num_seqs]
    widest = int(blocks_needed.max())
    if widest > width:
        seq = int(torch.argmax(blocks_needed))
        _fail(f"sequence {seq} has {int(seq_lens[seq])} tokens = {widest} blocks of {block_size}, but "
              f"block_tables has only {width} columns; make it at least {widest} wide")
    used = torch.arange(width, device=block_tables.device)[None, :] < blocks_needed[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        _fail(f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is used by sequence {seq} "
              f"but not a block id; used entries must be in [0, {num_blocks})")


def check_cu_query_lens(cu_query_lens, num_seqs, num_query_tokens, seq_lens):
    """int32 ``[num_seqs + 1]`` prefix sums of query lengths: starts at 0, non-decreasing, ends at the number
    of query rows, and no sequence has more new tokens than tokens in total (q_len <= seq_len)."""
    check_tensor(cu_query_lens, "cu_query_lens", ndim=1, dtypes=(torch.int32,), device=seq_lens.device)
    if cu_query_lens.shape[0] != num_seqs + 1:
        _fail(f"cu_query_lens must have num_seqs + 1 = {num_seqs + 1} entries, got {cu_query_lens.shape[0]}")
    first, last = int(cu_query_lens[0]), int(cu_query_lens[-1])
    if first != 0 or last != num_query_tokens:
        _fail(f"cu_query_lens must start at 0 and end at the number of query rows ({num_query_tokens}); "
              f"got {first} ... {last}")
    if num_seqs == 0:
        return
    query_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    if bool((query_lens < 0).any()):
        seq = int((query_lens < 0).nonzero()[0])
        _fail(f"cu_query_lens decreases at sequence {seq}; it must be non-decreasing (prefix sums of q_lens)")
    if bool((query_lens > seq_lens).any()):
        seq = int((query_lens > seq_lens).nonzero()[0])
        _fail(f"sequence {seq} has {int(query_lens[seq])} query tokens but seq_lens[{seq}] = "
              f"{int(seq_lens[seq])}; the cache must hold every query token too (q_len <= seq_len)")


def check_kv_scales(k_scale, v_scale, num_kv_heads, kv_cache, fp8: bool):
    """An fp8 cache needs ``k_scale`` and ``v_scale``: fp32 ``[num_kv_heads]`` on the cache's device, finite and
    > 0; a float cache takes none."""
    if not fp8:
        if k_scale is not None or v_scale is not None:
            _fail(f"k_scale and v_scale are for fp8 caches; this cache is {_dtype_name(kv_cache.dtype)}: pass None")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(scale, name, ndim=1, dtypes=(torch.float32,), device=kv_cache.device)
        if scale.shape[0] != num_kv_heads or not bool((torch.isfinite(scale) & (scale > 0)).all()):
            _fail(f"{name} must hold {num_kv_heads} finite scales > 0 (one per KV head), got {scale.tolist()}")


def check_query(query, kv_cache, name="query"):
    """``[num_query_tokens, num_heads, head_dim]`` in the cache's dtype (any float cache dtype for an fp8 cache)
    and on its device, with num_heads a multiple of num_kv_heads (grouped-query attention). Returns num_heads."""
    dtypes = CACHE_DTYPES if kv_cache.dtype in FP8_CACHE_DTYPES else (kv_cache.dtype,)
    check_tensor(query, name, ndim=3, dtypes=dtypes, device=kv_cache.device)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    num_heads = query.shape[1]
    if query.shape[2] != head_dim:
        _fail(f"{name} has head_dim {query.shape[2]} but the cache has {head_dim}; they must match")
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        _fail(f"{name} has {num_heads} heads; it must be a positive multiple of the cache's "
              f"{num_kv_heads} kv heads")
    return num_heads


def check_latent_query(query, latent_cache, name="query"):
    """MLA's absorbed queries ``[num_seqs or tokens, num_heads, latent_dim]`` (each head's query in the latent
    space, then its rotary part: one row of the latent cache's width), in the cache's dtype and on its device.
    Returns num_heads."""
    check_tensor(query, name, ndim=3, dtypes=(latent_cache.dtype,), device=latent_cache.device)
    if query.shape[2] != latent_cache.shape[2]:
        _fail(f"{name} has {query.shape[2]} features per head but the latent cache's rows have "
              f"{latent_cache.shape[2]}; they must match (kv_lora_rank + the rotary part)")
    if query.shape[1] < 1:
        _fail(f"{name} must have at least one head, got shape {tuple(query.shape)}")
    return query.shape[1]


def check_attention_options(scale=None, sliding_window=None, soft_cap=None):
    """``scale`` and ``soft_cap``: None or a positive finite number; ``sliding_window``: None or an int >= 1.
    Returns them normalised (floats, an int; None stays None)."""
    scale, soft_cap = (None if value is None else check_number(name, value, 0, min_open=True)
                       for name, value in (("scale", scale), ("soft_cap", soft_cap)))
    return scale, check_optional_int("sliding_window", sliding_window, 1), soft_cap


def check_slot_mapping(slot_mapping, num_tokens, num_slots, *, device=None):
    """int64 ``[num_tokens]``; each entry is -1 (skip the token) or a slot in ``[0, num_slots)``, where
    num_slots = num_blocks * block_size. Two tokens may not share a slot: parallel writers would race."""
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=(torch.int64,), device=device)
    if slot_mapping.shape[0] != num_tokens:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries but there are {num_tokens} tokens")
    if num_tokens == 0:
        return
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        token = int(bad.nonzero()[0])
        _fail(f"slot_mapping[{token}] = {int(slot_mapping[token])}; slots must be -1 (skip) or in "
              f"[0, {num_slots}) (num_blocks * block_size)")
    ordered = torch.sort(slot_mapping).values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    if bool(repeated.any()):
        slot = int(ordered[1:][repeated][0])
        tokens = (slot_mapping == slot).nonzero().flatten().tolist()
        _fail(f"slot {slot} is the target of tokens {tokens}; each slot may be written by at most one token")


def _int_pairs(block_mapping):
    """A sequence of (src, dst) pairs as a list of int 2-tuples. Every id must be an int: torch.tensor would
    silently truncate 1.7 to 1 and turn True into 1."""
    message = "block_mapping must be (src, dst) pairs: a list of int pairs or an int32/int64 [n, 2] tensor"
    try:
        rows = list(block_mapping)
    except TypeError:
        _fail(f"{message}; got {type(block_mapping).__name__}")
    pairs = []
    for i, row in enumerate(rows):
        try:
            src, dst = row
        except (TypeError, ValueError):
            src = dst = None
        if not (is_int(src) and is_int(dst)):
            _fail(f"{message}; block_mapping[{i}] is {row!r}")
        if not all(-2**63 <= block < 2**63 for block in (src, dst)):
            _fail(f"block_mapping[{i}] is {row!r}; block ids are int64")
        pairs.append((int(src), int(dst)))
    return pairs


def check_block_mapping(block_mapping, num_src_blocks, num_dst_blocks, *, device, same_cache):
    """Turn (src, dst) pairs (a list of pairs or an int tensor ``[n, 2]``) into int64 ``[n, 2]`` on ``device``.

    src ids must be in ``[0, num_src_blocks)``, dst ids in ``[0, num_dst_blocks)`` and no dst may repeat.
    With ``same_cache`` (copy-on-write inside one cache) no block may be both a src and a dst: copies run
    in parallel, so a block being read while it is overwritten would give an order-dependent result.
    """
    if isinstance(block_mapping, torch.Tensor):
        check_has_memory(block_mapping, "block_mapping")
        pairs = block_mapping
    else:
        pairs = torch.tensor(_int_pairs(block_mapping), dtype=torch.int64).reshape(-1, 2)
    if pairs.dtype not in (torch.int32, torch.int64) or pairs.dim() != 2 or pairs.shape[1] != 2:
        _fail(f"block_mapping must be (src, dst) pairs: an int32/int64 [n, 2] tensor or a list of pairs; "
              f"got {_dtype_name(pairs.dtype)} of shape {tuple(pairs.shape)}")
    pairs = pairs.to(device=device, dtype=torch.int64)
    if pairs.shape[0] == 0:
        return pairs
    src, dst = pairs[:, 0], pairs[:, 1]
    for ids, limit, role in ((src, num_src_blocks, "src"), (dst, num_dst_blocks, "dst")):
        bad = (ids < 0) | (ids >= limit)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            _fail(f"block_mapping[{i}] has {role} block {int(ids[i])}; {role} ids must be in [0, {limit})")
    ordered = torch.sort(dst).values
    repeated = ordered[1:] == ordered[:-1]
    if bool(repeated.any()):
        _fail(f"dst block {int(ordered[1:][repeated][0])} appears more than once in block_mapping; "
              "each dst may be written once")
    if same_cache:
        both = torch.isin(src, dst)
        if bool(both.any()):
            _fail(f"block {int(src[both][0])} is both a src and a dst in block_mapping; the copies run in "
                  "parallel, so split the mapping into rounds where no block is both")
    return pairs
