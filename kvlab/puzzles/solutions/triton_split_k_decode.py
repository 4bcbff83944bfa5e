"""A solution of kvlab.puzzles.triton_split_k_decode."""

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import triton
import triton.language as tl


@triton.jit
def split_k_decode_kernel(partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_ptr, cache_ptr,
                          block_tables_ptr, seq_lens_ptr, scale, num_query_heads, num_kv_heads, head_dim,
                          num_partitions, blocks_per_partition,
                          stride_table, stride_block, stride_kv, stride_slot, stride_head,
                          BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    s, h, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = h // (num_query_heads // num_kv_heads)
    seq_len = tl.load(seq_lens_ptr + s)
    first = p * blocks_per_partition
    last = tl.minimum(first + blocks_per_partition, tl.cdiv(seq_len, BLOCK_SIZE))
    if first < last:  # a partition past the sequence's end has nothing to do
        dims = tl.arange(0, BLOCK_D)
        offsets = tl.arange(0, BLOCK_SIZE)
        q = tl.load(query_ptr + (s * num_query_heads + h) * head_dim + dims, mask=dims < head_dim, other=0.0)
        best = -float("inf")                         # running maximum of the scores
        total = 0.0                                  # running sum of exp(score - best)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)  # running sum of exp(score - best) * value
        for j in range(first, last):
            block = tl.load(block_tables_ptr + s * stride_table + j).to(tl.int64)
            valid = j * BLOCK_SIZE + offsets < seq_len
            mask = valid[:, None] & (dims[None, :] < head_dim)
            slots = cache_ptr + block * stride_block + offsets[:, None] * stride_slot + kv_head * stride_head \
                + dims[None, :]
            k = tl.load(slots, mask=mask, other=0.0)
            v = tl.load(slots + stride_kv, mask=mask, other=0.0)
            scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best)
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            best = new_best
        row = (s * num_partitions + p) * num_query_heads + h  # [S, P, H]
        tl.store(partial_max_ptr + row, best)
        tl.store(partial_sum_ptr + row, total)
        tl.store(partial_out_ptr + row * head_dim + dims, acc / total, mask=dims < head_dim)
