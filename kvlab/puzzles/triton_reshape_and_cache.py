"""Puzzle: a Triton kernel that writes new tokens' K/V into the paged cache (``reshape_and_cache``).
Read first: notebook 04.

**Spec.** A step computed the keys and values of T new tokens, ``key`` and ``value`` ``[T, H, D]`` (contiguous,
float32). Token t goes to cache slot ``slot_mapping[t]`` (int64): block ``slot // block_size``, offset
``slot % block_size`` of ``cache [num_blocks, 2, block_size, H, D]`` (index 0 of the second axis holds K, 1
holds V); a slot of -1 means "no slot" (a padding token): write nothing for it.

Write the kernel ``reshape_and_cache_kernel``: the launcher ``launch`` (given) runs one program per token,
``grid = (T,)``, and passes the cache's strides in elements: do not assume the cache is contiguous (``check``
pads every head, so ``stride_head`` is larger than ``D``). ``BLOCK_H`` and ``BLOCK_D`` are powers of two at
least ``H`` and ``D``: mask every load and store (``tl.arange(0, BLOCK_D) < head_dim``)::

    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    ...

``check`` runs your kernel (in Triton's interpreter on a CPU) on random odd shapes into a cache poisoned with
NaN, and compares the whole cache, padding included, with kvlab's torch twin: every slot a token maps to holds
its K and V, and nothing else changed.
"""

import random

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import torch
import triton
import triton.language as tl

from kvlab.puzzles.grading import Case, Report, grade, seeded
from kvlab.puzzles.triton_grading import (first_difference, padded_cache, random_rows, seeded_generator,
                                          unchanged_stub)

NAME = "triton_reshape_and_cache"


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, num_heads, head_dim, block_size,
                             stride_block, stride_kv, stride_slot, stride_head,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per new token (see the module docstring). Your code here."""
    pass


def launch(kernel, key, value, cache, slot_mapping) -> None:
    """Run ``kernel`` over ``key``/``value`` ``[T, H, D]`` into ``cache`` at ``slot_mapping`` (given)."""
    tokens, heads, dim = key.shape
    kernel[(tokens,)](key, value, cache, slot_mapping, heads, dim, cache.shape[2], cache.stride(0), cache.stride(1),
                      cache.stride(2), cache.stride(3), BLOCK_H=triton.next_power_of_2(heads),
                      BLOCK_D=triton.next_power_of_2(dim))


def reshape_and_cache_torch(key, value, cache, slot_mapping) -> None:
    """The torch twin: what the kernel must do."""
    block_size = cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            cache[slot // block_size, 0, slot % block_size] = key[t]
            cache[slot // block_size, 1, slot % block_size] = value[t]


def check(kernel, *, strict: bool = False, seed: int = 0, num_cases: int = 8) -> Report:
    """Run ``kernel`` through ``launch`` on ``num_cases`` random steps (from ``seed``) against the torch twin."""
    rng = seeded(seed, num_cases)
    return grade(NAME, kernel, (_case(rng) for _ in range(num_cases)), num_cases=num_cases, strict=strict)


def _case(rng: random.Random) -> Case:
    generator = seeded_generator(rng)
    bs, heads, dim = rng.choice((1, 2, 4, 8)), rng.randint(1, 3), rng.choice((3, 5, 8, 12))
    num_blocks, tokens = rng.randint(2, 5), rng.randint(1, 7)
    slots = rng.sample(range(num_blocks * bs), min(tokens, num_blocks * bs))
    slots = [slot if rng.random() > 0.2 else -1 for slot in slots]  # some padding tokens
    key, value = random_rows((len(slots), heads, dim), generator), random_rows((len(slots), heads, dim), generator)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=key.device)
    expected_cache, expected = padded_cache(num_blocks, bs, heads, dim)
    reshape_and_cache_torch(key, value, expected_cache, slot_mapping)

    def run(kernel):
        unchanged_stub(kernel)
        cache, whole = padded_cache(num_blocks, bs, heads, dim)
        launch(kernel, key.clone(), value.clone(), cache, slot_mapping.clone())
        return whole

    inputs = (f"T={len(slots)} tokens, H={heads}, D={dim}, block_size={bs}, num_blocks={num_blocks}, "
              f"slot_mapping={slots}")
    return Case(inputs, run, lambda got: _judge(got, expected, dim))


def _judge(got: torch.Tensor, expected: torch.Tensor, dim: int) -> str | None:
    wrong = first_difference(got, expected, ("block", "kv", "offset", "head", "dim"))
    if wrong is None:
        return None
    index, text = wrong
    padding = (f" (dims {dim} and up are the padding between heads: step heads by stride_head, not by D, and mask "
               "dims >= head_dim)" if index[-1] >= dim else "")
    return f"the cache differs from the torch twin's {text}{padding}"
