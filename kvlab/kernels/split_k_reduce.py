"""Second half of split-K ("flash-decoding") attention: merge per-partition softmax partials.

Partition p of a (sequence, head) row left its running max m_p, sum l_p = sum_j exp2(s_j - m_p) and
unnormalised output acc_p = sum_j exp2(s_j - m_p) v_j. With M = max_p m_p, rescaling each by exp2(m_p - M)
puts them on one scale, so

    out = sum_p exp2(m_p - M) acc_p / sum_p exp2(m_p - M) l_p

is exactly the softmax over the whole context. An empty partition (l_p = 0, acc_p = 0, m_p = a huge negative
number) gets weight 0.
"""

import triton
import triton.language as tl

import kvlab.device  # noqa: F401  (selects the interpreter before any @triton.jit runs)


@triton.jit
def split_k_reduce_kernel(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, num_heads, num_partitions,
                          stride_o_seq, stride_o_head,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_P: tl.constexpr):
    # Grid (num_seqs, num_heads). Partials are contiguous: max/sum [seqs, heads, P], acc [seqs, heads, P, D].
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = (seq * num_heads + head) * num_partitions  # first partial of this (seq, head)
    chunk = tl.arange(0, CHUNK_P)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    global_max = tl.max(tl.load(part_max_ptr + row + chunk, mask=chunk < num_partitions, other=float("-inf")))
    for start in range(CHUNK_P, num_partitions, CHUNK_P):
        parts = start + chunk
        chunk_max = tl.max(tl.load(part_max_ptr + row + parts, mask=parts < num_partitions, other=float("-inf")))
        global_max = tl.maximum(global_max, chunk_max)

    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, num_partitions, CHUNK_P):
        parts = start + chunk
        ok = parts < num_partitions
        weight = tl.exp2(tl.load(part_max_ptr + row + parts, mask=ok, other=float("-inf")) - global_max)
        total += tl.sum(weight * tl.load(part_sum_ptr + row + parts, mask=ok, other=0.0))
        part_acc = tl.load(part_acc_ptr + (row + parts)[:, None] * HEAD_DIM + d[None, :],
                           mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(weight[:, None] * part_acc, 0)

    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=d_ok)


def split_k_reduce_config(num_seqs, num_heads, num_partitions, head_dim):
    """How ``split_k_reduce`` launches its kernel (shared with tests/kernels/gpu_compile_variants.py): one
    program per (sequence, head), reading partials in chunks of up to 16 partitions. Returns ``grid``,
    ``num_warps`` and the kernel's constexprs."""
    return dict(grid=(num_seqs, num_heads), num_warps=4, HEAD_DIM=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim), CHUNK_P=min(16, triton.next_power_of_2(num_partitions)))


def split_k_reduce(out, part_max, part_sum, part_acc):
    """Write ``out [num_seqs, num_heads, head_dim]`` (last dim contiguous) from fp32 contiguous partials
    ``part_max, part_sum [num_seqs, num_heads, P]`` and ``part_acc [num_seqs, num_heads, P, head_dim]``
    (all produced by ``paged_attention_decode_kernel``, so no validation here). Returns ``out``."""
    num_seqs, num_heads, num_partitions, head_dim = part_acc.shape
    config = split_k_reduce_config(num_seqs, num_heads, num_partitions, head_dim)
    split_k_reduce_kernel[config.pop("grid")](
        out, part_max, part_sum, part_acc, num_heads, num_partitions, out.stride(0), out.stride(1), **config)
    return out
