"""What the Triton puzzles share: their kernels run compiled on a GPU, in Triton's interpreter on a CPU (set up by
``kvlab.device``, imported first), on caches whose every unused element is poisoned with NaN, in a layout with
padding between heads (so a kernel that assumes contiguous heads writes where it must not), and the grader
names the first element that differs.

The stub of a Triton puzzle is a kernel whose body is ``pass``; a kernel cannot raise ``NotImplementedError``,
so ``unchanged_stub`` raises it for a kernel whose body is still only that (the grader then says "not yet", as
for the other puzzles).
"""

import ast
import inspect
import random
import textwrap

import torch

from kvlab.device import DEVICE  # before triton: the interpreter on a CPU

HEAD_PADDING = 3  # elements between one head's last dim and the next head's first: a cache that is no plain view


def padded_cache(num_blocks: int, block_size: int, num_heads: int, head_dim: int) -> tuple:
    """(``cache [num_blocks, 2, block_size, num_heads, head_dim]`` whose head stride is ``head_dim +
    HEAD_PADDING``, the whole allocation under it), both NaN (poison)."""
    base = torch.full((num_blocks, 2, block_size, num_heads, head_dim + HEAD_PADDING), float("nan"), device=DEVICE)
    return base[..., :head_dim], base


def random_rows(shape, generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(DEVICE)


def paged_batch(lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, generator) -> tuple:
    """(``kv_cache``: a ``padded_cache`` whose slots of the sequences' tokens hold random K/V and every other element
    NaN, ``block_tables [S, max blocks + 1]`` int32: each sequence's blocks in random places, entries past its end
    pointing at a block no sequence holds, ``seq_lens [S]`` int32): a decode batch of sequences of ``lens``
    tokens."""
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 1
    kv_cache, _ = padded_cache(num_blocks, block_size, num_kv_heads, head_dim)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    stale = order[sum(used)]  # no sequence's block: table entries past a sequence's end point at it
    tables = torch.full((len(lens), max(used) + 1), stale, dtype=torch.int32, device=kv_cache.device)
    for s, n in enumerate(lens):
        blocks, order = order[:used[s]], order[used[s]:]
        tables[s, :used[s]] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(n):  # only slots that hold a token get numbers
            kv_cache[blocks[p // block_size], :, p % block_size] = random_rows((2, num_kv_heads, head_dim), generator)
    return kv_cache, tables, torch.tensor(lens, dtype=torch.int32, device=kv_cache.device)


def unchanged_stub(kernel) -> None:
    """Raise NotImplementedError for a stub: a kernel whose body is only a docstring and ``pass`` (or ``...``)."""
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(getattr(kernel, "fn", kernel)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return  # no source to read: let it run
    if all(isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
           for node in function.body):
        raise NotImplementedError("the stub kernel does nothing yet")


def first_difference(got: torch.Tensor, expected: torch.Tensor, names: tuple) -> tuple | None:
    """Where two equally shaped tensors first differ (NaN equals NaN): ``(index, text)``, the text naming each
    axis (``names``) and both values; None where they are equal."""
    same = (got == expected) | (got.isnan() & expected.isnan())
    if bool(same.all()):
        return None
    index = tuple(int(i) for i in (~same).nonzero()[0])
    where = ", ".join(f"{name}={i}" for name, i in zip(names, index))
    return index, f"at {where}: expected {_value(expected[index])}, got {_value(got[index])}"


def _value(x: torch.Tensor) -> str:
    x = float(x)
    return "NaN (untouched)" if x != x else f"{x:.4g}"


def seeded_generator(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(2**31))
