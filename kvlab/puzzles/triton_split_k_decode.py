"""Puzzle: a Triton kernel for split-K paged decode attention, a program per sequence, query head and partition
of the context. Read first: notebook 05 (§4), and the puzzles ``split_k_merge`` and ``triton_decode_attention``.

**Spec.** The decode attention of puzzle ``triton_decode_attention`` (the same cache, tables, grouped heads and
NaN-poisoned unused slots), but a long context is cut into partitions so that more programs share the work:
partition p of sequence s covers the sequence's blocks ``p * blocks_per_partition`` up to (not including)
``(p + 1) * blocks_per_partition``, and only positions below ``seq_lens[s]``. Sequence s uses the first
``cdiv(cdiv(seq_lens[s], block_size), blocks_per_partition)`` partitions; the launcher runs
``grid = (S, H, P)`` with P the most any sequence uses, so a program whose partition starts past its
sequence's end has nothing to do (it writes nothing). A program with work writes, for its (s, p, h), over the
scores of its positions only (in float32)::

    partial_max[s, p, h]    = the maximum score m           (score = scale * key . query[s, h])
    partial_sum[s, p, h]    = sum of exp(score - m)
    partial_out[s, p, h, :] = sum of exp(score - m) * value, divided by partial_sum[s, p, h]

the layout ``split_k_merge`` takes (its merge, puzzle ``split_k_merge``, turns them into the attention over
every position). Walk the partition's blocks one at a time with the online softmax, as in
``triton_decode_attention``; mask every load (positions past ``seq_lens[s]`` hold NaN)::

    s, h, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    first = p * blocks_per_partition
    last = tl.minimum(first + blocks_per_partition, tl.cdiv(seq_len, BLOCK_SIZE))
    for j in range(first, last):
        ...

``check`` runs your kernel (in Triton's interpreter on a CPU) on tiny odd shapes and compares each used
partition's three results with the same sums computed in torch.
"""

import random

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import torch
import triton
import triton.language as tl

from kvlab.puzzles.grading import Case, Report, grade, seeded
from kvlab.puzzles.triton_grading import paged_batch, random_rows, seeded_generator, unchanged_stub

NAME = "triton_split_k_decode"
TOLERANCE = 1e-4


@triton.jit
def split_k_decode_kernel(partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_ptr, cache_ptr,
                          block_tables_ptr, seq_lens_ptr, scale, num_query_heads, num_kv_heads, head_dim,
                          num_partitions, blocks_per_partition,
                          stride_table, stride_block, stride_kv, stride_slot, stride_head,
                          BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, query head, partition) (see the module docstring); ``query`` is contiguous
    ``[S, H, D]``, ``partial_out`` ``[S, P, H, D]`` and ``partial_max``, ``partial_sum`` ``[S, P, H]`` are
    contiguous (P = ``num_partitions``). Your code here."""
    pass


def launch(kernel, query, kv_cache, block_tables, seq_lens, scale, blocks_per_partition: int) -> tuple:
    """``(partial_out [S, P, H, D], partial_max [S, P, H], partial_sum [S, P, H])`` float32 from ``kernel``
    (given): every element starts as NaN, so what no program writes stays NaN."""
    seqs, heads, dim = query.shape
    most_blocks = -(-int(seq_lens.max()) // kv_cache.shape[2])
    parts = -(-most_blocks // blocks_per_partition)
    partial_out = torch.full((seqs, parts, heads, dim), float("nan"), device=query.device)
    partial_max = torch.full((seqs, parts, heads), float("nan"), device=query.device)
    partial_sum = torch.full((seqs, parts, heads), float("nan"), device=query.device)
    kernel[(seqs, heads, parts)](partial_out, partial_max, partial_sum, query, kv_cache, block_tables, seq_lens,
                                 scale, heads, kv_cache.shape[3], dim, parts, blocks_per_partition,
                                 block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                                 kv_cache.stride(3), BLOCK_SIZE=kv_cache.shape[2], BLOCK_D=triton.next_power_of_2(dim))
    return partial_out, partial_max, partial_sum


def check(kernel, *, strict: bool = False, seed: int = 0, num_cases: int = 5) -> Report:
    """Run ``kernel`` through ``launch`` on ``num_cases`` random batches (from ``seed``) against torch."""
    rng = seeded(seed, num_cases)
    return grade(NAME, kernel, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    generator = seeded_generator(rng)
    bs, kv_heads, group, dim = rng.choice((2, 4)), rng.randint(1, 2), rng.randint(1, 2), rng.choice((16, 24))
    per_part = rng.randint(1, 2)
    lens = [rng.randint(1, 4 * bs + 1) for _ in range(rng.randint(1, 3))]
    kv_cache, tables, seq_lens = paged_batch(lens, bs, kv_heads, dim, generator)
    keys, values = [], []  # each sequence's K and V, [n, H_kv, D], read back through its table
    for s, n in enumerate(lens):
        rows = kv_cache[[int(tables[s, p // bs]) for p in range(n)], :, [p % bs for p in range(n)]]  # [n, 2, H_kv, D]
        keys.append(rows[:, 0])
        values.append(rows[:, 1])
    query = random_rows((len(lens), kv_heads * group, dim), generator)
    scale = rng.choice((dim ** -0.5, 0.3))
    tokens_per_part = per_part * bs
    expected = {}  # (s, p, h) -> (max, sum, out)
    for s, n in enumerate(lens):
        for p in range(-(-n // tokens_per_part)):
            part = slice(p * tokens_per_part, min(n, (p + 1) * tokens_per_part))
            for h in range(kv_heads * group):
                scores = (keys[s][part, h // group] @ query[s, h]) * scale
                best = scores.max()
                weights = (scores - best).exp()
                expected[s, p, h] = (best, weights.sum(), weights @ values[s][part, h // group] / weights.sum())

    def run(kernel):
        unchanged_stub(kernel)
        return launch(kernel, query.clone(), kv_cache.clone(), tables.clone(), seq_lens.clone(), scale, per_part)

    inputs = (f"S={len(lens)}, seq_lens={lens}, block_size={bs}, blocks_per_partition={per_part}, "
              f"H={kv_heads * group}, H_kv={kv_heads}, D={dim}, scale={scale:.4g}, block_tables={tables.tolist()}")
    return Case(inputs, run, lambda got: _judge(got, expected, lens, tokens_per_part))


def _judge(got, expected, lens, tokens_per_part) -> str | None:
    partial_out, partial_max, partial_sum = got
    for (s, p, h), (best, total, out) in expected.items():
        where = (f"sequence {s} (seq_len {lens[s]}), partition {p} (positions {p * tokens_per_part} .. "
                 f"{min(lens[s], (p + 1) * tokens_per_part) - 1}), query head {h}")
        results = (("partial_max", partial_max[s, p, h], best), ("partial_sum", partial_sum[s, p, h], total),
                   ("partial_out", partial_out[s, p, h], out))
        for name, value, want in results:
            if value.isnan().any():
                return (f"{where}: {name} is NaN: the program read a slot that holds no token (mask positions >= "
                        "seq_len and past the partition) or never wrote it")
            error = float((value - want).abs().max())
            if error > TOLERANCE * max(1.0, float(want.abs().max())):
                more = ", ..." if want.dim() else ""
                return (f"{where}: {name} is off by {error:.3g}: expected [{_first(want)}{more}], got "
                        f"[{_first(value)}{more}]: a partition sums over its own positions only, from block "
                        "p * blocks_per_partition on")
    return None


def _first(x) -> str:
    return ", ".join(f"{v:.4f}" for v in x.reshape(-1)[:3].tolist())
