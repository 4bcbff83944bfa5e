# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 16 · Puzzles: write a piece of kvlab yourself
#
# Twenty small pieces of a paged KV cache and its scheduler, each 5 to 30 lines to write: where a token's K/V
# lives, what a block's hash covers, how a prompt reuses cached blocks, who may be admitted, which free block
# goes first, what a fork must copy, attention through a block table (decode, prefill over a cached prefix,
# split-K), what a sliding window frees, one V1 scheduling step and its preemptions, where a router sends a
# request, what prompt lookup guesses, how drafts are verified, what an offload tier promotes and drops, and
# four Triton kernels (writing K/V into the cache, copying blocks, paged decode attention, and its split-K). Each puzzle gives a spec and a stub;
# you replace the stub's body, run its check cell, and kvlab grades your code on random cases against its own
# behaviour (or, where kvlab has no such function, the rule the spec states). A check that fails names the
# first case your code gets wrong, its inputs, and what was expected against what came back. Solve them in
# any order; each says which notebook to read first.
#
# **Objectives.** After this notebook you can:
# 1. write the block manager's core rules yourself: the slot mapping, chained block hashes, admission with
#    prefix hits and with a watermark, LRU eviction, copy-on-write on append, sliding-window release, and an
#    offload tier's promotions and evictions;
# 2. write a V1 scheduling step (one token budget, prompts in chunks) and its preemption by recompute;
# 3. write paged attention in torch (decode, prefill over a cached prefix, the split-K merge), then decode as a
#    Triton kernel with the online softmax, never reading a slot no token was written to, its split-K
#    partitions, and the cache's write and copy kernels with strides and masks;
# 4. plug your own code into kvlab's seams: an `EvictionPolicy` into `BlockManager(eviction=...)`, a `Router`
#    into a fleet, a proposer's lookup rule;
# 5. read a failing case and find the bug from it.
#
# **How it works.** Each puzzle's cell holds a stub that raises `NotImplementedError` (a Triton kernel's stub
# has the body `pass`); its check cell prints
# `not yet: ...` until your code is right, then `solved`. Nothing here raises when a check fails, so you can
# run the whole notebook at any time. The spec of each puzzle is its module's docstring (`kvlab.puzzles.NAME`),
# printed above its stub. The solutions ship with the instructor's copy of the course (a kvlab checkout,
# `kvlab/puzzles/solutions/`, one file per puzzle), not with an installed kvlab.

# %%
# Setup (generated from scripts/sync_notebooks.py: edit it there, then `make notebooks`). In a checkout, or in
# CI, this uses the checkout's kvlab. On Colab it clones the repository (code and bundled traces) and installs
# kvlab with the optional dependencies this notebook needs (KVLAB_EXTRAS); Colab's torch and Triton are kept as
# they are. `%matplotlib inline` keeps figures in the notebook however it runs (Jupyter, Colab, nbconvert).
# %matplotlib inline
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# The repository to clone when kvlab is not installed: for a fork, change it here or set $KVLAB_REPO.
KVLAB_REPO = os.environ.get("KVLAB_REPO", "https://github.com/kvlab/kvlab")
KVLAB_EXTRAS = "engine"  # pyproject.toml's extras this notebook uses ("": kvlab's core only)
KVLAB_KERNELS = True  # whether this notebook runs kvlab's Triton kernels itself (it imports kvlab.kernels)
if importlib.util.find_spec("kvlab") is None:
    checkout = Path.cwd().parent
    if not (checkout / "kvlab" / "__init__.py").is_file():  # not run from notebooks/ in a checkout
        checkout = Path.cwd() / "kvlab-repo"
        if not checkout.is_dir():
            clone = subprocess.run(["git", "clone", "-q", "--depth", "1", KVLAB_REPO, str(checkout)],
                                   capture_output=True, text=True)
            if clone.returncode != 0:
                raise RuntimeError(
                    f"Could not clone kvlab from {KVLAB_REPO}: {clone.stderr.strip() or 'git failed'}\n"
                    "If your copy of kvlab lives elsewhere, set KVLAB_REPO in this cell to its address (or the "
                    "KVLAB_REPO environment variable), then run the cell again.") from None
        target = f"{checkout}[{KVLAB_EXTRAS}]" if KVLAB_EXTRAS else str(checkout)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", target])
    sys.path.insert(0, str(checkout))
import kvlab.device

print(kvlab.device.summary(kernels=KVLAB_KERNELS))
if kvlab.device.mode() != "gpu":
    print("For real sizes" + (" and compiled kernels" if KVLAB_KERNELS else "") + ", use a GPU: on Colab, "
          "Runtime > Change runtime type > a GPU, then run the notebook again.")

# %%
import inspect

import matplotlib.pyplot as plt
import torch  # noqa: F401 - for your solutions, as the next five imports
import triton
import triton.language as tl
from IPython.display import Markdown, display

from kvlab.blocks import AllocStatus, EvictionPolicy  # noqa: F401
from kvlab.course.capstone import PARTS, check_engine
from kvlab.errors import OutOfBlocksError  # noqa: F401
from kvlab.puzzles import PUZZLES, puzzle
from kvlab.studies.routers import Router
from kvlab.viz import check

reports = {}  # puzzle name -> the last Report of your code, for the scoreboard in §21


def grade(name, your_code):
    """Check your code for puzzle ``name``; the report prints "solved ..." or "not yet: ..." and the case."""
    reports[name] = puzzle(name).module.check(your_code)
    return reports[name]


def spec(name):
    """Show the puzzle's spec, formatted: its module's docstring (reStructuredText, shown as Markdown: inline
    code in single backquotes, a "::" paragraph ending in a colon before its indented example), which also says
    what to read first."""
    text = inspect.getdoc(puzzle(name).module).replace("``", "`").replace("::\n", ":\n")
    display(Markdown(text))


# %% [markdown]
# ## 1. The slot mapping of a sequence
#
# Every kernel finds a token's K/V through the block table: the slot is the physical block times the block
# size plus the offset. Notebook 01 builds block tables; notebook 04 feeds slot mappings to `reshape_and_cache`.
#
# > **In vLLM.** V1's GPU worker computes the same slots for a whole batch at once
# > (`BlockTable.compute_slot_mapping` in `vllm/v1/worker/block_table.py`), with -1 (`PAD_SLOT_ID`) for padding
# > tokens; kvlab's `slot_mapping` uses -1 for positions whose block a sliding window released.

# %%
spec("slot_mapping")


# %%
def slot_mapping(block_table, block_size, start, end):
    raise NotImplementedError  # your code here


# %%
grade("slot_mapping", slot_mapping)

# %% [markdown]
# ## 2. Chained block hashes
#
# Prefix caching finds a prompt's cached blocks by hash, but a block's K/V depends on every token before it:
# so each full block's hash also covers its parent's hash. Notebook 02 §1 draws the chain.

# %%
spec("block_hashes")


# %%
def block_hashes(tokens, block_size, hash_fn):
    raise NotImplementedError  # your code here


# %%
grade("block_hashes", block_hashes)

# %% [markdown]
# ## 3. Admission with prefix hits
#
# Puzzle 2's hashes find a prompt's cached blocks; admitting it reuses them (a block in use gains a reference,
# a free but warm one leaves the free queue too) and takes new blocks for the rest, from the free queue's front.
# Notebook 02 §3 shows hits on blocks in use and warm hits, §4 the order the free queue hands blocks out.
#
# > **In vLLM.** V1's `KVCacheManager.get_computed_blocks` stops the hit one token short of the prompt
# > (`max_cache_hit_length = request.num_tokens - 1`), and `BlockPool.touch` takes a hit block with no
# > reference out of the free queue (`vllm/v1/core/block_pool.py`).

# %%
spec("allocate_with_hits")


# %%
def allocate_with_hits(num_tokens, block_size, prompt_hashes, cached, ref_counts, free_queue):
    raise NotImplementedError  # your code here: return (block_table, ref_counts, free_queue)


# %%
grade("allocate_with_hits", allocate_with_hits)

# %% [markdown]
# ## 4. Admission with a watermark
#
# `can_allocate` answers OK, LATER or NEVER before the scheduler admits a prompt; the watermark keeps a few
# blocks free so that running sequences can grow without an immediate preemption. Notebook 01 §4 introduces
# the three answers, notebook 10a §2 the watermark (its "In vLLM" box says where vLLM V0 and V1 differ).

# %%
spec("can_allocate")


# %%
def can_allocate(num_tokens, block_size, num_free_blocks, num_blocks, watermark):
    raise NotImplementedError  # your code here: return AllocStatus.OK, AllocStatus.LATER or AllocStatus.NEVER


# %%
grade("can_allocate", can_allocate)

# %% [markdown]
# ## 5. An eviction policy
#
# The pool hands the eviction policy every block that becomes free, and asks it which one to reuse next.
# kvlab's LRU reuses blocks that hold no cached prefix first, then cached ones, least recently freed first
# (notebook 02 §4). Your class plugs into the same seam as kvlab's policies: `BlockManager(eviction=MyLRU())`.
#
# > **In vLLM.** V1 keeps one free queue (`FreeKVCacheBlockQueue`, a doubly linked list in
# > `vllm/v1/core/kv_cache_utils.py`): the block pool's `free_blocks` appends blocks whose count drops to 0 at
# > its end, and allocation takes from its front. Putting never-cached blocks first is vLLM V0's order, which
# > kvlab's LRU keeps (`kvlab/blocks/eviction.py`).

# %%
spec("lru_policy")


# %%
class MyLRU(EvictionPolicy):
    def __init__(self):
        pass  # your state here

    def add(self, block_id, cached):
        raise NotImplementedError  # your code here

    def remove(self, block_id):
        raise NotImplementedError

    def pop(self):
        raise NotImplementedError  # raise OutOfBlocksError(...) when there is no free block

    def __iter__(self):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError


# %%
grade("lru_policy", MyLRU)

# %% [markdown]
# ## 6. Copy-on-write on append
#
# A fork shares its parent's blocks; the first write into a shared block must copy it first. Notebook 03a
# shows forks, beams and the copy-on-write pairs `append_slots` returns.

# %%
spec("copy_on_write")


# %%
def plan_append(block_table, ref_counts, num_computed_tokens, num_tokens, block_size):
    raise NotImplementedError  # your code here: return (copies, num_new_blocks)


# %%
grade("copy_on_write", plan_append)

# %% [markdown]
# ## 7. Decode attention over a block table, in torch
#
# One query per sequence attends to its whole context, gathered block by block through its table. Notebook 05
# §1 writes the gather and §3 grouped-query attention. The check poisons every slot that holds no token with
# NaN, so reading one shows in your output.

# %%
spec("decode_attention")


# %%
def decode_attention(query, kv_cache, block_tables, seq_lens, scale):
    raise NotImplementedError  # your code here: return a [S, H, D] tensor


# %%
grade("decode_attention", decode_attention)

# %% [markdown]
# ## 8. Prefill over a cached prefix, in torch
#
# A prompt admitted with a prefix hit computes only its new tokens, and each of them attends causally to the
# cached prefix and to the new tokens before it (notebook 06). The check poisons every slot past the sequence.

# %%
spec("prefill_attention")


# %%
def prefill_attention(query, kv_cache, block_table, seq_len, scale):
    raise NotImplementedError  # your code here: return a [T, H, D] tensor


# %%
grade("prefill_attention", prefill_attention)

# %% [markdown]
# ## 9. Merging split-K partitions
#
# A long context's decode runs in partitions, each a softmax over its own keys (notebook 05 §4); merging them
# must give exactly one softmax over all the keys, and never overflow.

# %%
spec("split_k_merge")


# %%
def split_k_merge(partial_out, partial_max, partial_sum, num_partitions):
    raise NotImplementedError  # your code here: return a [S, H, D] tensor


# %%
grade("split_k_merge", split_k_merge)

# %% [markdown]
# ## 10. Sliding-window release
#
# A sliding-window layer frees a block once no query of this step or a later one can see it. Notebook 11 §1
# follows a sequence growing past the window.
#
# > **In vLLM.** V1's `SlidingWindowManager.remove_skipped_blocks` (`vllm/v1/core/single_type_kv_cache_manager.py`)
# > computes the same bound, `num_computed_tokens - sliding_window + 1`, divides it by the block size, and
# > replaces the blocks before it with the null block, walking back until it meets one already released.

# %%
spec("window_release")


# %%
def released_blocks(block_table, num_released, first_query, window, block_size):
    raise NotImplementedError  # your code here


# %%
grade("window_release", released_blocks)

# %% [markdown]
# ## 11. One V1 scheduling step
#
# vLLM V1 spends one token budget per step on whatever requests need: decodes and chunks of prompts in the
# same forward pass. Notebook 10b §1 shows the budget and §2 chunked prefill, V0 against V1.

# %%
spec("v1_step")


# %%
def v1_step(running, waiting, token_budget, max_num_seqs):
    raise NotImplementedError  # your code here: return (running_tokens, admitted_tokens)


# %%
grade("v1_step", v1_step)

# %% [markdown]
# ## 12. Preemption by recompute
#
# When a running request needs a block and the pool has none, V1 frees the newest request's blocks and queues
# it again at the front, to be prefilled from scratch. Notebook 10a §3 runs recompute and swap on one workload.
#
# > **In vLLM.** `Scheduler.schedule` in `vllm/v1/core/sched/scheduler.py`: with the FCFS policy
# > `preempted_req = self.running.pop()`, then its blocks freed, `num_computed_tokens = 0` and
# > `self.waiting.prepend_request(preempted_req)`; if the victim was the request itself, the step stops there.

# %%
spec("preemption")


# %%
def preemption(blocks_held, needs_block, num_free_blocks):
    raise NotImplementedError  # your code here: return (scheduled, waiting)


# %%
grade("preemption", preemption)

# %% [markdown]
# ## 13. A router
#
# A fleet's router sees each replica only through what it publishes: its cached block hashes (from KV events)
# and its queue. Notebook 12 §1 shows what a router sees and §3 compares kvlab's routers on a real trace,
# `kv_cost` among them. Your class plugs in where a router name goes
# (`replay_fleet(router=MyRouter)`), or into `kvlab.studies.routers.ROUTERS`.

# %%
spec("kv_cost_router")


# %%
class MyRouter(Router):
    needs_hashes = True

    def choose(self, replicas, num_tokens, hashes):
        raise NotImplementedError  # your code here: return self.pick([...one key per replica...])


# %%
grade("kv_cost_router", MyRouter)

# %% [markdown]
# ## 14. The n-gram proposer
#
# Prompt lookup drafts the next tokens from the context itself, for free; the model verifies them in one
# pass. Notebook 13 measures how often its drafts are accepted.
#
# > **In vLLM.** `method="ngram"` runs `_find_longest_matched_ngram_and_propose_tokens`
# > (`vllm/v1/spec_decode/ngram_proposer.py`): one KMP pass over the reversed context finds the longest match
# > between `prompt_lookup_min` and `prompt_lookup_max`, and among equally long ones keeps the **earliest**
# > occurrence. kvlab's `NgramProposer`, which this puzzle checks against, takes the **most recent** one: what
# > the text said lately. Which choice gets more drafts accepted is an experiment notebook 13's workloads can run.

# %%
spec("ngram_proposer")


# %%
def propose(tokens, max_tokens, min_n, max_n):
    raise NotImplementedError  # your code here


# %%
grade("ngram_proposer", propose)

# %% [markdown]
# ## 15. Verification by rejection sampling
#
# A model-free proposer's drafts are certain guesses; a draft *model* proposes from a distribution, and the
# target must accept each draft with probability min(1, p / q) and, at the first rejection, draw from what is
# left of its own distribution, so that the kept tokens are distributed exactly as the target's own samples.

# %%
spec("rejection_sampling")


# %%
def verify(drafts, draft_probs, target_probs, uniforms, sample):
    raise NotImplementedError  # your code here


# %%
grade("rejection_sampling", verify)

# %% [markdown]
# ## 16. An offload tier: promotion and eviction
#
# A CPU tier behind the GPU pool keeps blocks the GPU evicts; a prompt that misses on the GPU goes on looking
# there, and each tier hit is promoted (copied back into a new GPU block). Notebook 14a §1 follows five requests
# through both tiers, block by block.

# %%
spec("tier_promotion")


# %%
def tier_promotion(tier, num_slots, num_tokens, block_size, prompt_hashes, num_gpu_hits, overwritten):
    raise NotImplementedError  # your code here: return (promoted, tier)


# %%
grade("tier_promotion", tier_promotion)

# %% [markdown]
# ## 17. A Triton kernel: reshape_and_cache
#
# The last four puzzles are Triton kernels, graded as the ones in `kvlab/kernels/` are tested: on a GPU they
# compile; on a CPU they run in Triton's interpreter (slowly, so the checks use tiny shapes). Each gives you the
# kernel's signature and its launcher (`launch` in the puzzle's module: the grid and every argument); you
# write the body. The checks poison every element a kernel must not touch with NaN and pad the cache between
# heads, so a missing mask or an assumed stride shows. The first writes a step's new K/V into their slots:
# notebook 04 draws it.

# %%
spec("triton_reshape_and_cache")


# %%
@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, num_heads, head_dim, block_size,
                             stride_block, stride_kv, stride_slot, stride_head,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pass  # your code here: one program per token


# %%
grade("triton_reshape_and_cache", reshape_and_cache_kernel)

# %% [markdown]
# ## 18. A Triton kernel: copy_blocks
#
# Copy-on-write (notebook 03a, puzzle 6) decides which blocks to copy; this kernel copies them, one program per
# pair of blocks and per half of the cache (K or V).

# %%
spec("triton_copy_blocks")


# %%
@triton.jit
def copy_blocks_kernel(cache_ptr, block_mapping_ptr, num_heads, head_dim, block_size,
                       stride_block, stride_kv, stride_slot, stride_head,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pass  # your code here: one program per (pair, K or V)


# %%
grade("triton_copy_blocks", copy_blocks_kernel)

# %% [markdown]
# ## 19. A Triton kernel: paged decode attention
#
# Puzzle 7's math as a kernel: one program per sequence and query head walks the sequence's blocks through its
# table, one block at a time, with the online softmax (notebook 05 §2 shows it on a tile), so no program ever
# holds the whole context. kvlab's own kernel (`kvlab/kernels/paged_attention_decode.py`) adds tiles of several
# blocks, the grouped heads of one KV head in one program, and split-K.

# %%
spec("triton_decode_attention")


# %%
@triton.jit
def decode_attention_kernel(out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
                            num_query_heads, num_kv_heads, head_dim,
                            stride_table, stride_block, stride_kv, stride_slot, stride_head,
                            BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    pass  # your code here: one program per (sequence, query head)


# %%
grade("triton_decode_attention", decode_attention_kernel)

# %% [markdown]
# ## 20. A Triton kernel: split-K decode attention
#
# A short batch with long contexts leaves most of a GPU idle when each program walks a whole context: split-K
# cuts each context into partitions, one program each, and a merge (puzzle 9) combines their partial results.
# kvlab's own kernel (`kvlab/kernels/paged_attention_decode.py`) picks the number of partitions from the context
# length and the GPU's size.

# %%
spec("triton_split_k_decode")


# %%
@triton.jit
def split_k_decode_kernel(partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_ptr, cache_ptr,
                          block_tables_ptr, seq_lens_ptr, scale, num_query_heads, num_kv_heads, head_dim,
                          num_partitions, blocks_per_partition,
                          stride_table, stride_block, stride_kv, stride_slot, stride_head,
                          BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    pass  # your code here: one program per (sequence, query head, partition)


# %%
grade("triton_split_k_decode", split_k_decode_kernel)

# %% [markdown]
# ## 21. Your scoreboard
#
# Each bar is one puzzle: how many random cases your code passed before its first failure, out of the cases
# its check runs (a solved puzzle fills its bar). Run this cell again after solving one.

# %%
names = [p.name for p in PUZZLES]
done = [reports[name].num_passed / reports[name].num_cases if name in reports else 0 for name in names]
fig, ax = plt.subplots(figsize=(8, 5.5))
ax.barh(names, [1] * len(names), color="0.9")
ax.barh(names, done, color=["tab:green" if reports.get(n) else "tab:orange" for n in names])
for i, name in enumerate(names):
    status = "solved" if reports.get(name) else "not yet" if name in reports else "not run"
    ran = f" ({reports[name].num_passed}/{reports[name].num_cases})" if name in reports else ""
    ax.text(1.01, i, status + ran, va="center")
ax.invert_yaxis()
ax.set(xlim=(0, 1.35), xticks=[0, 0.25, 0.5, 0.75, 1], xlabel="share of the check's random cases passed before the first failure",
       title=f"Puzzles solved: {sum(bool(r) for r in reports.values())} of {len(names)}")
plt.show()

# %% tags=["instructor"]
kvlabs = {name: puzzle(name).module.check(puzzle(name).solution()) for name in names}  # kvlab's own solutions
check(all(report.passed for report in kvlabs.values()), "each of kvlab's own solutions passes its puzzle's check",
      defaults=True)

# %% [markdown] tags=["instructor"]
# **Peeking.** The solutions live in `kvlab/puzzles/solutions/`, one file per puzzle. To read one, and only
# that one, uncomment the line below with the puzzle's name. To check a solution the way CI does:
# `puzzle("slot_mapping").module.check(puzzle("slot_mapping").solution())`. Any check also takes `seed=` (other
# random cases) and `strict=True` (raise `PuzzleNotSolvedError` instead of printing, for your own tests).

# %% tags=["instructor"]
# print(puzzle("slot_mapping").solution_source())

# %% [markdown]
# ## 22. Capstone: your parts in a real engine
#
# Nineteen of the puzzles are parts of a serving engine. `kvlab.course.engine_with(parts)` plugs yours into a real
# `LLM` serving SmolLM2-135M-Instruct: your slot mapping decides where each new token's K/V is written, your
# block hashes are what prefix caching looks blocks up by, your LRU picks which free block is reused, your
# copy-on-write plan says which shared blocks a step copies before writing, your admission decides when a waiting
# prompt is admitted (in a pool that keeps half its blocks free, so that the second prompt waits), your window
# release frees a sliding-window model's blocks, your tier promotion orders the offload tier after each admission,
# your preemption picks the requests the V1 scheduler preempts when the pool is short, your V1 step splits each
# step's token budget (prompts in chunks), your torch attention reads the paged cache (decode steps split into
# partitions of two blocks that your split-K merge combines), your n-gram proposer and rejection sampling run
# speculative decoding, your router places requests on a fleet of two engines, and your Triton kernels write the
# K/V, attend at decode, compute split-K's partitions and copy blocks. `allocate_with_hits` is the one puzzle that
# is not a part: its answer is the pool itself, which only kvlab's `allocate` may change.
# `check_engine(parts)` grades each of your parts by its puzzle first, serves two chat prompts that share the
# chat template's system prompt (so the second hits the first's blocks), with speculation on, and compares the
# greedy tokens with Hugging Face's `generate`: they must be equal, token for token. If they are not, it serves
# them again with one of your parts at a time and names the part that goes wrong. Your Triton kernels run in
# Triton's interpreter on a CPU, where SmolLM2 would take minutes a token, so `check_engine` serves them (with
# all your other parts) on a tiny random-weight model too, two greedy samples per prompt (the second sample's
# first token copies the block they share: copy-on-write), against Hugging Face's tokens there. Greedy samples
# write the same K/V, so a missing copy changes no token: your copy-on-write plan is also run with seeded samples
# at temperature 1, which must give kvlab's own engine's tokens on the same seed; and your window release on a tiny
# model whose layers see only the last 16 tokens, against Hugging Face, which applies the window itself. Your
# router places requests on a fleet of two engines (seeing each through its KV events and its queue): each
# choice must be kvlab's `kv_cost` router's.
#
# The cell below plugs in every part whose puzzle you solved above (none yet: kvlab's own parts throughout, and
# the call says so). Question: why can a wrong hash or a wrong LRU never change a token, when a wrong slot
# mapping always does?

# %%
yours = {"slot_mapping": slot_mapping, "block_hashes": block_hashes, "lru_policy": MyLRU,
         "copy_on_write": plan_append, "can_allocate": can_allocate, "window_release": released_blocks,
         "kv_cost_router": MyRouter, "tier_promotion": tier_promotion, "preemption": preemption,
         "v1_step": v1_step,
         "decode_attention": decode_attention, "prefill_attention": prefill_attention, "ngram_proposer": propose,
         "rejection_sampling": verify, "split_k_merge": split_k_merge,
         "triton_reshape_and_cache": reshape_and_cache_kernel, "triton_decode_attention": decode_attention_kernel,
         "triton_split_k_decode": split_k_decode_kernel, "triton_copy_blocks": copy_blocks_kernel}
solved = {name: code for name, code in yours.items() if reports.get(name)}  # passed its check above
check(sorted(yours) == sorted(PARTS) and len(PARTS) == 19, "the engine takes nineteen of the puzzles as parts",
      defaults=True)
run = check_engine(solved)
print(f"Greedy tokens equal to Hugging Face's on all {len(run.tokens)} prompts; prompt tokens from the prefix "
      f"cache: {run.cached_prompt_tokens}; drafts accepted: {run.accepted_drafts}")
check(run.matches and run.cached_prompt_tokens[-1] > 0,
      "the engine must give Hugging Face's greedy tokens, the second prompt hitting the first's blocks",
      defaults=True)

# %% [markdown] tags=["instructor"]
# **Answer.** A prefix lookup compares a hit block's bytes (its tokens and the exact prefix before it), so a
# wrong hash can only lose hits, never serve wrong K/V; an eviction policy only decides which cached block is
# reused, and a lost block is recomputed. Neither changes what attention reads. A slot mapping decides where
# each K/V is written, so a wrong one makes attention read another token's K/V: the tokens change. That is why
# the puzzle checks guard the hash and the LRU, and the engine's tokens guard the slot mapping and attention.

# %% [markdown]
# ## Takeaways
#
# * A block table turns a position into a slot with one multiply and one add; everything else in a paged
#   cache is bookkeeping about who holds which block.
# * Admission, eviction, copy-on-write and window release are each a few lines, but every one has an
#   off-by-one that a random check finds at once: a boundary where `>=` is not `>`, a block that is full,
#   a window that starts inside a block.
# * Paged attention is a gather followed by ordinary attention; what makes it correct is reading only the
#   slots that hold tokens.
# * kvlab's seams (eviction policies, routers, proposers, schedulers) take your code as it is, so the
#   studies of notebooks 08, 12 and 13 can measure your idea against kvlab's.
# * Nineteen of your parts make a working paged engine: served by `check_engine`, they must give Hugging Face's
#   greedy tokens exactly, and a wrong one is named by the tokens it changes.
