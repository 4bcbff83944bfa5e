"""Puzzle: a Triton kernel for copy-on-write's block copies inside the cache (``copy_blocks``).
Read first: notebook 03a.

**Spec.** Copy-on-write hands the engine (src, dst) pairs of blocks: before the step, every slot of block dst
must hold what block src holds, K and V, and nothing else may change. ``cache [num_blocks, 2, block_size, H,
D]`` (index 0 of the second axis: K, 1: V), ``block_mapping`` int64 ``[P, 2]`` (src, dst; every dst distinct, no
dst also a src).

Write ``copy_blocks_kernel``: the launcher ``launch`` (given) runs ``grid = (P, 2)``, one program per pair and
half (K or V), and passes the cache's strides in elements: do not assume the cache is contiguous (``check``
pads every head, so ``stride_head`` is larger than ``D``). ``BLOCK_H`` and ``BLOCK_D`` are powers of two at
least ``H`` and ``D``: mask every load and store. A program copies ``block_size`` slots (a loop)::

    pair, kv = tl.program_id(0), tl.program_id(1)
    src = tl.load(block_mapping_ptr + 2 * pair)
    ...

``check`` runs your kernel (in Triton's interpreter on a CPU) on random caches (padding poisoned with NaN) and
compares the whole cache, padding included, with kvlab's torch twin.
"""

import random

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import torch
import triton
import triton.language as tl

from kvlab.puzzles.grading import Case, Report, grade, seeded
from kvlab.puzzles.triton_grading import (first_difference, padded_cache, random_rows, seeded_generator,
                                          unchanged_stub)

NAME = "triton_copy_blocks"


@triton.jit
def copy_blocks_kernel(cache_ptr, block_mapping_ptr, num_heads, head_dim, block_size,
                       stride_block, stride_kv, stride_slot, stride_head,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (pair, K or V) (see the module docstring). Your code here."""
    pass


def launch(kernel, cache, block_mapping) -> None:
    """Run ``kernel`` over ``block_mapping [P, 2]`` in ``cache`` (given)."""
    heads, dim = cache.shape[3], cache.shape[4]
    kernel[(block_mapping.shape[0], 2)](cache, block_mapping, heads, dim, cache.shape[2], cache.stride(0),
                                        cache.stride(1), cache.stride(2), cache.stride(3),
                                        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim))


def copy_blocks_torch(cache, block_mapping) -> None:
    """The torch twin: what the kernel must do."""
    for src, dst in block_mapping.tolist():
        cache[dst] = cache[src]


def check(kernel, *, strict: bool = False, seed: int = 0, num_cases: int = 8) -> Report:
    """Run ``kernel`` through ``launch`` on ``num_cases`` random copies (from ``seed``) against the torch twin."""
    rng = seeded(seed, num_cases)
    return grade(NAME, kernel, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    generator = seeded_generator(rng)
    bs, heads, dim = rng.choice((1, 2, 3, 8)), rng.randint(1, 3), rng.choice((3, 5, 8, 12))
    num_blocks = rng.randint(3, 8)
    blocks = rng.sample(range(num_blocks), num_blocks)
    num_pairs = rng.randint(1, num_blocks // 2)
    pairs = [(blocks[i], blocks[num_pairs + i]) for i in range(num_pairs)]  # sources and destinations apart
    cache, whole = padded_cache(num_blocks, bs, heads, dim)
    cache.copy_(random_rows(cache.shape, generator))
    mapping = torch.tensor(pairs, dtype=torch.int64, device=cache.device).reshape(-1, 2)
    expected = whole.clone()
    copy_blocks_torch(expected[..., :dim], mapping)

    def run(kernel):
        unchanged_stub(kernel)
        mine = whole.clone()
        launch(kernel, mine[..., :dim], mapping.clone())
        return mine

    inputs = f"H={heads}, D={dim}, block_size={bs}, num_blocks={num_blocks}, block_mapping={pairs}"
    return Case(inputs, run, lambda got: _judge(got, expected, dim, pairs))


def _judge(got: torch.Tensor, expected: torch.Tensor, dim: int, pairs) -> str | None:
    wrong = first_difference(got, expected, ("block", "kv", "offset", "head", "dim"))
    if wrong is None:
        return None
    index, text = wrong
    block, kv, offset, _, d = index
    sources = {dst: src for src, dst in pairs}
    if d >= dim:
        why = ": dims from head_dim on are the padding between heads (step heads by stride_head, mask dims)"
    elif block in sources:
        why = (f": block {block} is the copy of block {sources[block]}: every one of its slots, K and V "
               f"({'K' if kv == 0 else 'V'} of slot {offset} is not)")
    else:
        why = f": block {block} is no destination: it must not change"
    return f"the cache differs from the torch twin's {text}{why}"
