"""Puzzle: a Triton kernel for paged decode attention, a program per sequence and query head.
Read first: notebook 05, and the torch puzzle ``decode_attention`` (the same math).

**Spec.** Each of S sequences decodes one token: ``query[s, h]`` ``[D]`` attends to the sequence's keys at
positions ``0 .. seq_lens[s] - 1``, which live in ``kv_cache [num_blocks, 2, block_size, H_kv, D]`` (K =
index 0 of the second axis, V = 1) at block ``block_tables[s, p // block_size]``, offset ``p % block_size``.
Query head h reads KV head ``h // (H // H_kv)`` (grouped-query attention). Write ``out[s, h]`` ``[D]``::

    out[s, h] = softmax(scale * K_s @ query[s, h]) @ V_s      (in float32)

Write ``decode_attention_kernel``: the launcher ``launch`` (given) runs ``grid = (S, H)`` and passes every
stride in elements (``check`` pads the cache's heads: ``stride_head`` is larger than ``D``). A program walks the
sequence's blocks one at a time (``BLOCK_SIZE`` positions: a constexpr), keeping the running maximum, the
running sum of exponentials and the running weighted sum of values (the online softmax: rescale the last two
by ``exp(old_max - new_max)`` when the maximum grows). ``BLOCK_D`` is a power of two at least ``D``. Mask
every load: positions past ``seq_lens[s]`` in the last block, and table entries past it, hold stale data
(``check`` fills every unused slot with NaN)::

    s, h = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + s)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + s * stride_table + j)
        ...

``check`` runs your kernel (in Triton's interpreter on a CPU) on tiny odd shapes against kvlab's torch path
(``paged_attention_decode_torch``).
"""

import random

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import torch
import triton
import triton.language as tl

from kvlab.kernels.torch_paged import paged_attention_decode_torch
from kvlab.puzzles.grading import Case, Report, grade, seeded
from kvlab.puzzles.triton_grading import paged_batch, random_rows, seeded_generator, unchanged_stub

NAME = "triton_decode_attention"
TOLERANCE = 1e-4


@triton.jit
def decode_attention_kernel(out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
                            num_query_heads, num_kv_heads, head_dim,
                            stride_table, stride_block, stride_kv, stride_slot, stride_head,
                            BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, query head) (see the module docstring); ``query`` and ``out`` are contiguous
    ``[S, H, D]``. Your code here."""
    pass


def launch(kernel, query, kv_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """``out [S, H, D]`` float32 from ``kernel`` (given)."""
    seqs, heads, dim = query.shape
    out = torch.full_like(query, float("nan"))  # a row no program writes stays NaN
    kernel[(seqs, heads)](out, query, kv_cache, block_tables, seq_lens, scale, heads, kv_cache.shape[3], dim,
                          block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                          kv_cache.stride(3), BLOCK_SIZE=kv_cache.shape[2], BLOCK_D=triton.next_power_of_2(dim))
    return out


def check(kernel, *, strict: bool = False, seed: int = 0, num_cases: int = 6) -> Report:
    """Run ``kernel`` through ``launch`` on ``num_cases`` random batches (from ``seed``) against the torch path."""
    rng = seeded(seed, num_cases)
    return grade(NAME, kernel, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    generator = seeded_generator(rng)
    bs, kv_heads, group, dim = rng.choice((2, 4, 8)), rng.randint(1, 2), rng.randint(1, 3), rng.choice((16, 24))
    lens = [rng.randint(1, 3 * bs + 1) for _ in range(rng.randint(1, 3))]
    kv_cache, tables, seq_lens = paged_batch(lens, bs, kv_heads, dim, generator)
    query = random_rows((len(lens), kv_heads * group, dim), generator)
    scale = rng.choice((dim ** -0.5, 0.3))
    expected = paged_attention_decode_torch(query, kv_cache, tables, seq_lens, scale=scale)

    def run(kernel):
        unchanged_stub(kernel)
        return launch(kernel, query.clone(), kv_cache.clone(), tables.clone(), seq_lens.clone(), scale)

    inputs = (f"S={len(lens)}, seq_lens={lens}, block_size={bs}, H={kv_heads * group}, H_kv={kv_heads}, D={dim}, "
              f"scale={scale:.4g}, block_tables={tables.tolist()}")
    return Case(inputs, run, lambda got: _judge(got, expected, lens, bs, group))


def _judge(got: torch.Tensor, expected: torch.Tensor, lens, bs: int, group: int) -> str | None:
    for s, n in enumerate(lens):
        for h in range(expected.shape[1]):
            row = got[s, h]
            if row.isnan().any():
                return (f"sequence {s}, query head {h}: the output has NaN: the program read a slot that holds no "
                        f"token (seq_len {n}: only offsets 0 .. {(n - 1) % bs} of its last block hold tokens; mask "
                        "positions >= seq_len) or never wrote its row")
            error = float((row - expected[s, h]).abs().max())
            if error > TOLERANCE:
                return (f"sequence {s}, query head {h} (KV head {h // group}): max abs error {error:.3g} (allowed "
                        f"{TOLERANCE}): expected [{', '.join(f'{x:.4f}' for x in expected[s, h, :3].tolist())}, ...], "
                        f"got [{', '.join(f'{x:.4f}' for x in row[:3].tolist())}, ...]")
    return None
