"""Puzzles: implement a piece of kvlab yourself, and let kvlab grade it (notebook 16).

Each puzzle is a module here holding its spec (the module's docstring), a stub to fill in (it raises
NotImplementedError) and ``check(your_code) -> Report``: your code runs on random cases from a seed against
kvlab's own behaviour, and the report says which case fails first, its inputs, and what was expected against
what came back. ``check(..., strict=True)`` raises ``kvlab.errors.PuzzleNotSolvedError`` instead of returning a
failed report. Whatever your code does (loops forever, calls ``sys.exit()``, answers with NumPy values), the
check comes back with a report: ``kvlab.puzzles.grading`` says how. The solutions are in
``kvlab.puzzles.solutions``, one module per puzzle, so that you can look at one without seeing the others; they
ship with a kvlab checkout only, not in the installed package (``SolutionsNotShippedError`` says so).

``PUZZLES`` lists them in course order, each with what it teaches and the notebook to read first::

    from kvlab.puzzles import PUZZLES, puzzle
    p = puzzle("slot_mapping")
    print(p.module.__doc__)                   # the spec
    p.module.check(my_slot_mapping)           # the report
    print(p.solution_source())                # when you are done (or stuck)

Modules load on first use: the attention puzzles need torch, the Triton puzzles torch and Triton (in its
interpreter on a CPU), the others only kvlab's block manager (and scheduler).
"""

import importlib
import inspect
from types import ModuleType
from typing import NamedTuple

from kvlab.errors import InvalidArgumentError, SolutionsNotShippedError
from kvlab.puzzles.grading import Report

__all__ = ["PUZZLES", "Puzzle", "Report", "puzzle"]


class Puzzle(NamedTuple):
    name: str        # the module in kvlab.puzzles and in kvlab.puzzles.solutions
    stub: str        # the function or class to write, the same name in both
    teaches: str
    read_first: str  # the notebook (and sections) that explain what the puzzle asks

    @property
    def module(self) -> ModuleType:
        """The puzzle: its docstring is the spec, ``check`` grades, ``stub`` is the stub."""
        return importlib.import_module(f"kvlab.puzzles.{self.name}")

    def solution(self):
        """The solved function or class (it passes ``check``)."""
        return getattr(self._solution_module(), self.stub)

    def solution_source(self) -> str:
        return inspect.getsource(self._solution_module())

    def _solution_module(self) -> ModuleType:
        try:
            return importlib.import_module(f"kvlab.puzzles.solutions.{self.name}")
        except ModuleNotFoundError as missing:
            if not missing.name.startswith("kvlab.puzzles.solutions"):
                raise
            raise SolutionsNotShippedError(
                "the puzzles' solutions ship with a kvlab checkout (the instructor's copy), not with an installed "
                "kvlab: `git clone` kvlab and install it from there to read them") from None


#: The puzzles in course order.
PUZZLES: tuple[Puzzle, ...] = (
    Puzzle("slot_mapping", "slot_mapping", "block tables: where a token's K/V lives in the paged cache",
           "01 (§2-3), 04 (§3)"),
    Puzzle("block_hashes", "block_hashes", "prefix caching's chained block hashes: a block's hash covers every "
           "token before it", "02 (§1)"),
    Puzzle("allocate_with_hits", "allocate_with_hits", "admission with prefix hits: reuse cached blocks (ref counts, "
           "out of the free queue), new blocks for the rest, never the last prompt token", "02 (§1, §3-§4)"),
    Puzzle("can_allocate", "can_allocate", "admission: OK, LATER or NEVER, and the blocks a watermark keeps free",
           "01 (§4), 10a (§2)"),
    Puzzle("lru_policy", "MyLRU", "an eviction policy behind kvlab's seam: never-cached blocks first, then least "
           "recently freed", "02 (§4)"),
    Puzzle("copy_on_write", "plan_append", "copy-on-write: which shared blocks a step must copy, which it appends",
           "03a"),
    Puzzle("decode_attention", "decode_attention", "paged decode attention in torch: the gather through the block "
           "table, grouped-query heads, never reading a stale slot", "05 (§1, §3)"),
    Puzzle("prefill_attention", "prefill_attention", "prefill over a cached prefix in torch: the new tokens' "
           "causal attention over the whole paged context", "06"),
    Puzzle("split_k_merge", "split_k_merge", "split-K decode: merge partitions' softmax results exactly, "
           "without overflow", "05 (§2, §4)"),
    Puzzle("window_release", "released_blocks", "a sliding window: which blocks no query can see any more",
           "11 (§1)"),
    Puzzle("v1_step", "v1_step", "one V1 scheduling step: running requests first, then waiting ones, one token "
           "budget, the last prompt in a chunk", "10b (§1-§2)"),
    Puzzle("preemption", "preemption", "preemption by recompute: the newest request not yet scheduled gives up "
           "its blocks and waits at the front", "10a (§3)"),
    Puzzle("kv_cost_router", "MyRouter", "a fleet router behind kvlab's ROUTERS seam: least prefill work, ties "
           "taking turns", "12 (§1, §3)"),
    Puzzle("ngram_proposer", "propose", "speculative decoding's n-gram prompt lookup: the longest, most recent match",
           "13"),
    Puzzle("rejection_sampling", "verify", "speculative verification by rejection sampling: accepted drafts, then "
           "a recovered or bonus token, exact in distribution", "13 (§1)"),
    Puzzle("tier_promotion", "tier_promotion", "an offload tier behind the GPU pool: tier hits promoted, GPU "
           "evictions offloaded, LRU order after a prompt's uses", "14a (§1)"),
    Puzzle("triton_reshape_and_cache", "reshape_and_cache_kernel", "a Triton kernel: new tokens' K/V into their "
           "slots, strides and masks", "04"),
    Puzzle("triton_copy_blocks", "copy_blocks_kernel", "a Triton kernel: copy-on-write's block copies, a program "
           "per pair and half", "03a, 04"),
    Puzzle("triton_decode_attention", "decode_attention_kernel", "a Triton kernel: paged decode attention with "
           "the online softmax, a program per sequence and head", "05"),
    Puzzle("triton_split_k_decode", "split_k_decode_kernel", "a Triton kernel: split-K decode attention, a "
           "program per partition of the context writing its max, sum and output", "05 (§4)"),
)


def puzzle(name: str) -> Puzzle:
    """The puzzle called ``name`` (one of PUZZLES)."""
    for p in PUZZLES:
        if p.name == name:
            return p
    raise InvalidArgumentError(f"unknown puzzle {name!r}; known: {', '.join(p.name for p in PUZZLES)}")
