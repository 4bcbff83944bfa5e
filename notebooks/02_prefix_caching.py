# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 02 · Prefix caching
#
# Many requests start the same way: a system prompt, few-shot examples, the earlier turns of a chat. Their
# keys and values for that shared prefix are identical, so a server can compute them once and let every
# request **share the same physical blocks**. The block manager finds shareable blocks by a **hash chained
# over the prefix**: a block's hash covers its parent's hash and its own tokens.
#
# This notebook shows why the chain matters, how hits on blocks in use differ from hits on freed-but-cached
# ("warm") blocks, in which order cached blocks are evicted, what a hit saves and costs, why a weak hash
# function cannot cause wrong sharing, and how the hit rate on a real trace falls as the pool shrinks.

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
KVLAB_EXTRAS = ""  # pyproject.toml's extras this notebook uses ("": kvlab's core only)
KVLAB_KERNELS = False  # whether this notebook runs kvlab's Triton kernels itself (it imports kvlab.kernels)
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
import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

from kvlab import BlockManager, Sequence, viz
from kvlab.studies.traces import MOONCAKE_BLOCK_TOKENS, load_trace, mooncake_token_ids

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BS = 4                      # block size of sections 1-5: try 8 (A's prompt is exactly one block) or 2
EVICTION = "lru"            # section 4's policy: "lru" (kvlab's default), "fifo" or "lfu"
SEED = 0                    # the random user messages
NUM_TRACE_REQUESTS = 1000   # section 6: how much of the Mooncake trace to replay
TRACE_BS = 64               # section 6's block size

DEFAULTS = (BS, EVICTION, SEED, NUM_TRACE_REQUESTS, TRACE_BS) == (4, "lru", 0, 1000, 64)
rng = np.random.default_rng(SEED)
HIT, COMPUTED = "#59a14f", "#dbe6f1"  # colours of a block served from the cache / computed by the model


def hit_colors(seq):
    """One colour per logical block: hit (its K/V came from the cache) or computed."""
    hits = seq.num_cached_tokens // seq.block_size
    return [HIT if i < hits else COMPUTED for i in range(seq.num_blocks)]


# %% [markdown]
# ## 1. Chained hashes: the same tokens after a different prefix must not hit
#
# `A = [1..8]`, `B = [1..10]`, `C = [0, 2, 3, ..., 10]`, in blocks of `BS` = 4 tokens. `B` starts with all of
# `A`; `C` differs from `A` in its very first token only, so its second block holds the same tokens
# `[5, 6, 7, 8]` as A's second block. But the K/V of a token depend on every token before it (attention
# looked at them), so C's second block must **not** reuse A's. The captions show each full block's hash (its
# last 4 hex digits): hash(block i) = xxh64(tokens of block i, seed = hash(block i - 1)).

# %%
manager = BlockManager(16, BS, record_events=True)
A, B, C = Sequence(range(1, 9), BS), Sequence(range(1, 11), BS), Sequence([0, *range(2, 11)], BS)
for seq in (A, B, C):
    manager.allocate(seq)


def hash_captions(seq):
    return [f"{manager.block_hash(b) & 0xFFFF:04x}" if manager.block_hash(b) is not None else "(partial)"
            for b in seq.block_table]


viz.draw_tokens([A, B, C], names=["A", "B", "C"], captions={k: hash_captions(s) for k, s in enumerate((A, B, C))},
                block_colors={k: hit_colors(s) for k, s in enumerate((A, B, C))},
                title=f"blocks of {BS}; green: served from the cache; captions: the block's hash")
plt.show()
print(f"B reuses {B.num_cached_tokens // BS} blocks of A ({B.num_cached_tokens} of its {B.num_tokens} tokens "
      f"need no prefill); C reuses {C.num_cached_tokens // BS}.")
second = {name: seq.block(1) if seq.num_blocks > 1 else [] for name, seq in (("A", A), ("C", C))}
print(f"C's second block holds {second['C']}, A's {second['A']}; their hashes are {hash_captions(C)[1:2]} and "
      f"{hash_captions(A)[1:2]}: different, because the parents differ.")
b_expected = min(A.num_tokens // BS, (B.num_tokens - 1) // BS) * BS  # A's full blocks, never B's last token
viz.check(B.num_cached_tokens == b_expected == 8,
          f"B reused {B.num_cached_tokens} tokens, not 8: with BS={BS} A has {A.num_tokens // BS} full block(s), and "
          f"B may reuse at most its first {(B.num_tokens - 1) // BS} (a prompt never hits its last token)",
          defaults=DEFAULTS)
viz.check(C.num_cached_tokens == 0, "C hit a block: its first token differs from A's, so nothing may be shared",
          defaults=True)  # a law, whatever the knobs
viz.check(second["A"] == second["C"], f"with BS={BS}, A's and C's second blocks hold different tokens "
          f"({second['A']} vs {second['C']}), so this demo of equal tokens after different parents needs BS = 4",
          defaults=DEFAULTS)
viz.check(A.num_blocks < 2 or manager.block_hash(A.block_table[1]) != manager.block_hash(C.block_table[1]),
          "A's and C's second blocks have the same hash although their parents differ", defaults=True)

# %% [markdown]
# What would an unchained cache do? Key each block by its own tokens only, and C's second block would
# be served from A's second block, whose K/V were computed after `[1, 2, 3, 4]`, not after `[0, 2, 3, 4]`.

# %%
by_tokens = {tuple(A.block(i)): A.block_table[i] for i in range(A.num_tokens // BS)}  # unchained cache of A
wrong = by_tokens.get(tuple(C.block(1)))
print(f"An unchained cache would give C's logical block 1 the physical block {wrong} (A's), computed after "
      f"the prefix {A.block(0)} instead of C's {C.block(0)}: silently wrong attention." if wrong is not None else
      f"With BS={BS} no block of C holds the same tokens as a block of A, so even an unchained cache shares nothing.")
viz.draw_block_tables(manager, [A, B, C], names=["A", "B", "C"],
                      title=f"A and B share {B.num_cached_tokens // BS} blocks (ref count 2); C shares nothing")
plt.show()

# %% [markdown]
# One more rule: a prompt never hits **in full**. The model must run at least its last token to produce the
# logits for the first output token, so a prompt of exactly A's 8 tokens reuses only A's first block.

# %%
A_again = Sequence(range(1, 9), BS)
manager.allocate(A_again)
print(f"A again ({A_again.num_tokens} tokens, {A_again.num_tokens // BS} full blocks): "
      f"{A_again.num_cached_tokens // BS} block hit, {A_again.num_tokens - A_again.num_cached_tokens} tokens computed.")
viz.check(A_again.num_cached_tokens == (A_again.num_tokens - 1) // BS * BS == 4,
          f"A again hit {A_again.num_cached_tokens} tokens: with BS={BS} its last full block holds its last token, "
          f"which must be computed, so it may hit only {(A_again.num_tokens - 1) // BS} of its "
          f"{A_again.num_tokens // BS} full blocks", defaults=DEFAULTS)

# %% [markdown]
# **Exercise.** Predict for blocks of 8 instead of 4: how many of A's blocks does B reuse, and how many
# tokens does "A again" compute? (A is exactly one block of 8, and a prompt must compute its last token.)
# Edit the values and run the cell: it replays A, B and "A again" on a fresh pool and checks them.

# %%
from kvlab.course import answer

PREDICTED_B_REUSES = None          # blocks of A that B reuses
PREDICTED_A_AGAIN_COMPUTES = None  # tokens "A again" computes


def section_one(block_size):
    """A, B, then A again on a fresh pool: (blocks B reuses, tokens A again computes)."""
    pool = BlockManager(16, block_size)
    a, b, a_again = (Sequence(range(1, n), block_size) for n in (9, 11, 9))
    for seq in (a, b, a_again):
        pool.allocate(seq)
    return b.num_cached_tokens // block_size, a_again.num_tokens - a_again.num_cached_tokens


b_reuses_8, a_again_computes_8 = section_one(8)
answer(PREDICTED_B_REUSES, b_reuses_8, "A's one full block [1..8] is B's first block too, and B's last token "
       "lies in its second block, so the hit is allowed.")
answer(PREDICTED_A_AGAIN_COMPUTES, a_again_computes_8, "A again's only block holds its last token, which must be "
       "computed for the first output's logits: a hit would skip it, so the whole block is computed.")
viz.check((b_reuses_8, a_again_computes_8, section_one(4)[1]) == (1, 8, 4),
          f"section_one: blocks of 8 gave (B reuses, A again computes) = {(b_reuses_8, a_again_computes_8)} and "
          f"blocks of 4 A again computes {section_one(4)[1]}; the answer below says (1, 8) and 4", defaults=True)

# %% [markdown]
# **Answer.** B reuses 1 block (8 of its 10 tokens), and "A again" computes all 8 tokens: its only full block
# ends with its last token, so it may not hit at all. With blocks of 4 it hit one of its two blocks and
# computed 4. Setting `BS = 8` in the knobs cell shows the same in every cell above, and the checks explain
# what changed.

# %% [markdown]
# ## 2. A shared system prompt across many requests
#
# Ten chat requests start with the same 16-token system prompt followed by a user message of 2 to 9 tokens.
# All ten run at the same time. With prefix caching the system prompt's full blocks are computed once and
# shared by all ten (ref count 10); without, every request holds its own copy.

# %%
SYSTEM = list(range(500, 516))
NUM_REQUESTS = 10
questions = [rng.integers(1000, 2000, size=int(rng.integers(2, 10))).tolist() for _ in range(NUM_REQUESTS)]


def run_all(enable_prefix_caching):
    m = BlockManager(256 // BS, BS, enable_prefix_caching=enable_prefix_caching)
    seqs = [Sequence(SYSTEM + q, BS) for q in questions]
    for s in seqs:
        m.allocate(s)
    return m, seqs


shared_m, shared_seqs = run_all(True)
plain_m, plain_seqs = run_all(False)
system_blocks = len(SYSTEM) // BS
viz.check(all(shared_m.ref_count(b) == NUM_REQUESTS for b in shared_seqs[0].block_table[:system_blocks])
          and plain_m.num_free_blocks == plain_m.num_blocks - sum(s.num_blocks for s in plain_seqs),
          "the system prompt's full blocks are not shared by every request, or without prefix caching the "
          "requests share blocks", defaults=True)
viz.draw_pool(shared_m, title=f"with prefix caching: the {len(SYSTEM) // BS} system-prompt blocks are shared "
                              f"by all {NUM_REQUESTS} requests")
plt.show()

# %%
used = {name: m.num_blocks - m.num_free_blocks for name, m in (("with", shared_m), ("without", plain_m))}
prompt_tokens = sum(s.num_tokens for s in shared_seqs)
computed = {"with": prompt_tokens - sum(s.num_cached_tokens for s in shared_seqs), "without": prompt_tokens}
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 2.6))
for ax, values, label in ((left, used, "blocks in use"), (right, computed, "prompt tokens computed (prefill)")):
    bars = ax.bar([f"{k} prefix caching" for k in values], list(values.values()), color=["#59a14f", "#bab0ac"])
    ax.bar_label(bars)
    ax.set_title(label, fontsize=10)
fig.suptitle(f"{NUM_REQUESTS} requests sharing a {len(SYSTEM)}-token system prompt", fontsize=10)
plt.tight_layout()
plt.show()
print(f"Prefix caching holds {used['with']} blocks instead of {used['without']} "
      f"({100 * (1 - used['with'] / used['without']):.0f}% less) and computes {computed['with']} of "
      f"{prompt_tokens} prompt tokens: the first request computes the system prompt, the other "
      f"{NUM_REQUESTS - 1} hit it ({shared_m.stats.hit_blocks} block hits, hit rate "
      f"{100 * shared_m.stats.hit_rate:.0f}% of prompt tokens).")
viz.check(shared_m.stats.hit_blocks == (NUM_REQUESTS - 1) * system_blocks,
          f"{shared_m.stats.hit_blocks} block hits, not the system prompt's {system_blocks} blocks in each of the "
          f"{NUM_REQUESTS - 1} later requests: with BS={BS} some user messages share a first block",
          defaults=DEFAULTS)

# %% [markdown]
# ## 3. Hits on blocks in use, and warm hits
#
# A hit on a block **in use** costs nothing: the block is already resident, its ref count just goes up. When
# the last request using a block finishes, the block becomes free but keeps its content and stays in the
# hash map: it is **warm**. A hit on a warm block takes it back out of the free list, so it still costs no
# computation, but it consumes a free block (that is how `can_allocate` counts it). Either way the hit
# blocks are **pinned**: nothing can evict them while a request uses them.

# %%
m = BlockManager(64 // BS, BS, record_events=True)
r1, r2, r3 = (Sequence(SYSTEM + q, BS) for q in questions[:3])
steps = []


def admit(seq, label):
    """Allocate ``seq`` and report its hits: in use before (shared for free) or warm (taken off the free list)."""
    refs_before = [m.ref_count(b) for b in range(m.num_blocks)]
    free_before = m.num_free_blocks
    m.allocate(seq)
    hits = seq.block_table[:seq.num_cached_tokens // BS]
    in_use = sum(refs_before[b] > 0 for b in hits)
    viz.check(free_before - m.num_free_blocks == seq.num_blocks - in_use,
              f"{label}: a hit on a block in use took a free block, or a warm hit did not", defaults=True)
    steps.append(viz.snapshot(m, [], label))
    print(f"{label}: {len(hits)} hits ({in_use} on blocks in use, {len(hits) - in_use} warm) save "
          f"{seq.num_cached_tokens} of {seq.num_tokens} prompt tokens; it took {free_before - m.num_free_blocks} "
          f"free blocks ({seq.num_blocks - len(hits)} new + {len(hits) - in_use} warm) and pins {len(hits)} "
          f"shared blocks.")
    return in_use, len(hits)


admit(r1, "r1 arrives (cold cache)")
viz.check(admit(r2, "r2 arrives while r1 runs") == (system_blocks, system_blocks),
          "r2 should hit every system-prompt block, all of them in use by r1", defaults=True)
m.free(r1)
m.free(r2)
steps.append(viz.snapshot(m, [], "r1 and r2 finish: system prompt is warm"))
viz.check(admit(r3, "r3 arrives after both finished") == (0, system_blocks),
          "r3 should hit every system-prompt block, all of them warm", defaults=True)
viz.show_steps(steps, draw=viz.draw_pool, ncols=2, panel_size=(7.5, 1.7 if BS >= 4 else 3))
plt.show()

# %% [markdown]
# ## 4. Eviction order: least recently used, chain tail first
#
# When no never-used block is left, new content must reuse a warm block and its cached prefix is
# **evicted**. kvlab's default order (`eviction="lru"`): never-cached free blocks first, then cached ones
# least recently freed first, and among blocks freed together the **chain's tail first**, because a
# sequence frees its blocks tail first. Two reasons: every request that shares block `i` of a prefix also
# shares blocks `0..i-1`, so heads are worth more; and a lookup stops at its first miss, so evicting a head
# would strand the blocks after it (cached, but unreachable).
#
# Below, in a pool of 10 blocks: `X` (3 full blocks + 1 partial) finishes, then `Y` (2 full + 1 partial).
# Then `Z` needs 7 blocks: the 5 never-cached free blocks, and 2 cached ones. Finally a request starting with
# X's three full blocks asks what is left of X. The free-block numbers are the reuse order.

# %%
def eviction_story(policy, z_blocks=7):
    """X and Y run and finish, Z (z_blocks full blocks) arrives and finishes, then X's prefix comes back.
    Returns the manager, a snapshot before Z, X's blocks, the blocks Z evicted, the returning request, the
    timeline phases and the sequences' names."""
    m = BlockManager(10, BS, eviction=policy, record_events=True)
    X, Y = Sequence(range(100, 100 + 3 * BS + 1), BS), Sequence(range(200, 200 + 2 * BS + 1), BS)
    Z = Sequence(range(300, 300 + z_blocks * BS), BS)
    again = Sequence([*range(100, 100 + 3 * BS), 999], BS)  # X's three full blocks, then something new
    names = {X.seq_id: "X", Y.seq_id: "Y", Z.seq_id: "Z", again.seq_id: "X again"}
    phases = [(0, "X and Y arrive")]
    m.allocate(X)
    m.allocate(Y)
    x_blocks = list(X.block_table)
    phases.append((len(m.events), "X, then Y finish"))
    m.free(X)
    m.free(Y)
    before = viz.snapshot(m, [], f"{policy}: free blocks in reuse order (#0 first) after X, then Y, finished")
    phases.append((len(m.events), f"Z arrives ({z_blocks} blocks)"))
    m.allocate(Z)
    evicted = [e.block_id for e in m.events if e.kind == "evict"]
    phases.append((len(m.events), "Z finishes"))
    m.free(Z)
    phases.append((len(m.events), "X's prefix again"))
    m.allocate(again)
    return m, before, x_blocks, evicted, again, phases, names


lru, lru_before, x_blocks, lru_evicted, lru_again, lru_phases, story_names = eviction_story(EVICTION)
viz.draw_pool(lru_before)
plt.show()
viz.draw_timeline(lru, kinds=["release", "miss", "evict", "hit"], names=story_names, phases=lru_phases,
                  title=f"{EVICTION}: which call released, took, evicted and hit which block")
plt.show()
print(f"X's blocks were {x_blocks[:3]} (full) + {x_blocks[3:]} (partial). Allocating Z evicted {lru_evicted}. "
      f"A new request starting with X's {3 * BS} tokens still hits {lru_again.num_cached_tokens // BS} of them.")
viz.check(lru_evicted == x_blocks[2:0:-1] and lru_again.num_cached_tokens == BS,
          f"with eviction={EVICTION!r}, Z evicted {lru_evicted} (LRU takes X's tail first: {x_blocks[2:0:-1]}), and "
          f"X's prefix came back with {lru_again.num_cached_tokens // BS} block hit(s) (LRU keeps 1)",
          defaults=DEFAULTS)
x_releases = [e.block_id for e in lru.events if e.kind == "release"][:len(x_blocks)]
viz.check(x_releases == x_blocks[::-1], f"X released its blocks in the order {x_releases}, not tail first",
          defaults=True)

# %% [markdown]
# In the timeline, X's `release` row reads `3 2 1 0` (partial block first, then the chain tail to head), and
# Z's `evict` marks take X's blocks in that order. For contrast, `eviction="fifo"` evicts the block whose
# content is **oldest**, which in a chain is the head. The same run then strands X's tail: still cached,
# never reachable again.

# %%
fifo, _, _, fifo_evicted, fifo_again, _, _ = eviction_story("fifo")
stranded = [b for b in x_blocks[:3] if fifo.is_cached(b) and b not in fifo_evicted]
print(f"FIFO evicted {fifo_evicted} (X's head first); X's block(s) {stranded} are still cached but the same "
      f"request hits {fifo_again.num_cached_tokens // BS} blocks: the lookup stops at the evicted head.")
viz.check(fifo_evicted == x_blocks[:2] and stranded == x_blocks[2:3] and fifo_again.num_cached_tokens == 0,
          f"FIFO evicted {fifo_evicted} and stranded {stranded}: this story assumes blocks of several tokens",
          defaults=DEFAULTS)

# %% [markdown]
# > **In vLLM.** The orders differ by engine. **V0** (removed in 2025; read it at a tag such as `v0.8.5`)
# > reuses never-cached free blocks first, then evicts the cached block accessed least recently, and among
# > equally old ones the one ending the longest prefix, i.e. a chain's tail (`vllm/core/evictor.py`,
# > `vllm/core/block/prefix_caching_block.py`). kvlab's default follows V0's first rule; it orders cached blocks
# > by when they were freed, unless the engine records accesses with `touch(seq, now)` (V0's
# > `access_all_blocks_in_seq`, which V0's scheduler calls). **V1** has no separate tier for never-cached blocks: one free queue, a finished
# > request's blocks appended **tail first**, allocation popping from the head
# > (`vllm/v1/core/kv_cache_utils.py`: `FreeKVCacheBlockQueue`; `vllm/v1/core/kv_cache_manager.py`: `free`).
# > So in V1 a freshly freed empty block waits behind older cached ones. Read docs.vllm.ai, *Automatic Prefix
# > Caching* (design docs), for V1's version of this section.
#
# > **In SGLang.** No hashes and no fixed blocks: `RadixCache` (`python/sglang/srt/mem_cache/radix_cache.py`)
# > keeps every cached prefix in a radix tree keyed by the tokens themselves (by default one token per page),
# > so a lookup compares tokens and matches prefixes of any length. It evicts only **leaves**, least recently
# > used first: a head is never evicted while a longer prefix below it is cached, so nothing is ever stranded.
# > The price: a tree walk instead of one dictionary lookup per block.

# %% [markdown]
# **Exercise.** Predict before you move anything: with `policy="lfu"` (and Z of 7 blocks, as above), how
# many of X's three full blocks does X's prefix still hit afterwards? And from how many blocks on does Z
# evict anything at all (the pool has 10; X and Y left 5 of them never cached)? Edit the values and run the
# cell; then the widgets below rerun the story for any policy and size of Z (outside Jupyter or Colab, the
# widget cell runs it once with the defaults).

# %%
PREDICTED_LFU_HITS = None          # of X's 3 full blocks, how many X's prefix hits after Z (policy "lfu")
PREDICTED_FIRST_EVICTING_Z = None  # the smallest z_blocks for which Z evicts a cached block

lfu_hits = eviction_story("lfu", 7)[4].num_cached_tokens // BS
first_evicting = next(z for z in range(1, 11) if eviction_story("lru", z)[3])
answer(PREDICTED_LFU_HITS, lfu_hits, "no cached block was ever hit, so LFU's counts tie and its tie-break "
       "decides: least recently freed first, chain tail first, exactly like LRU.")
answer(PREDICTED_FIRST_EVICTING_Z, first_evicting, "Z takes the never-cached free blocks first, 5 of them, so "
       "its 6th block is the first that evicts a cached one.")
lfu_evicted = eviction_story("lfu", 7)[3]
z8_hits = {policy: eviction_story(policy, 8)[4].num_cached_tokens for policy in ("lru", "lfu")}
viz.check((lfu_hits, first_evicting) == (1, 6) and lfu_evicted == eviction_story("lru", 7)[3]
          and z8_hits == {"lru": 0, "lfu": 0},
          f"LFU's prefix hits {lfu_hits} block(s) (LFU evicted {lfu_evicted}), Z evicts from {first_evicting} blocks "
          f"on, and with Z of 8 X's prefix hits {z8_hits} tokens; the answer below says 1, 6, LRU's order and 0 "
          f"(with BS={BS} X's last block is not partial)", defaults=DEFAULTS)

# %% [markdown]
# **Answer.** 1 hit, and Z evicts from 6 blocks on. Nothing in this story is ever hit before Z arrives, so
# LFU cannot tell X's blocks apart by frequency and falls back to LRU's order: X's tail goes first and its
# head survives. LFU differs from LRU only once blocks have different hit counts (section 6's trace).
# With `z_blocks = 8` Z evicts X's head too, and X's prefix hits nothing.

# %%
def try_eviction(policy="lfu", z_blocks=7):
    m, _, xb, evicted, again, phases, names = eviction_story(policy, z_blocks)
    viz.draw_timeline(m, kinds=["release", "miss", "evict", "hit"], names=names, phases=phases,
                      title=f"{policy}, Z of {z_blocks} blocks")
    plt.show()
    print(f"X's full blocks {xb[:3]}; Z evicted {evicted}; X's prefix hits {again.num_cached_tokens // BS} block(s).")


viz.explore(try_eviction, policy=["lru", "fifo", "lfu"], z_blocks=(1, 10, 1))

# %% [markdown]
# ## 5. A weak hash cannot cause wrong sharing
#
# Hashes can collide: two different prefixes with the same hash. kvlab's pool guards against it: before it
# shares block `c` for logical block `i`, it checks that `c` holds exactly the same tokens **and** that
# `c`'s parent is the block the lookup matched for block `i - 1`. So a collision costs hits, never
# correctness. To see the guard at work we replace the hash by a constant (`hash_fn=lambda parent, tokens:
# 0`: *every* block collides) and replay a small workload: 40 requests, each one of three 12-token system
# prompts plus a user message. A content oracle checks every hit: the hit block must hold the request's
# exact prefix. The third pair of bars is a cache that trusts the hash (no guard).

# %%
systems = [list(range(k * 100, k * 100 + 12)) for k in (7, 8, 9)]
workload = [systems[rng.integers(3)] + rng.integers(1000, 2000, size=int(rng.integers(2, 10))).tolist()
            for _ in range(40)]


def replay_with_oracle(hash_fn):
    """(hit blocks, wrong hits): a hit is wrong if its block holds a different prefix than the request's."""
    m = BlockManager(256, BS, hash_fn=hash_fn)
    prefix_in = {}  # physical block -> the token prefix (up to the end of that block) it was filled with
    hits = wrong = 0
    for tokens in workload:
        seq = Sequence(tokens, BS)
        m.allocate(seq)
        for i, block in enumerate(seq.block_table):
            prefix = tuple(tokens[:(i + 1) * BS])
            if i < seq.num_cached_tokens // BS:
                hits += 1
                wrong += prefix_in[block] != prefix
            else:
                prefix_in[block] = prefix
        m.free(seq)
    return hits, wrong


def replay_trusting_the_hash(hash_fn):
    """A cache that maps hash -> block and shares whatever it finds (stops at the first miss, like kvlab)."""
    table, hits, wrong = {}, 0, 0
    for tokens in workload:
        parent, hitting = None, True
        for i in range(len(tokens) // BS):  # full blocks
            parent = hash_fn(parent, tuple(tokens[i * BS:(i + 1) * BS]))
            prefix = tuple(tokens[:(i + 1) * BS])
            if hitting and parent in table and i < (len(tokens) - 1) // BS:
                hits += 1
                wrong += table[parent] != prefix
            else:
                hitting = False
                table.setdefault(parent, prefix)
    return hits, wrong


def constant(parent, tokens):
    return 0


results = {"default hash (xxh64),\nkvlab": replay_with_oracle(None),
           "constant hash,\nkvlab (tokens + parent checked)": replay_with_oracle(constant),
           "constant hash,\na cache that trusts the hash": replay_trusting_the_hash(constant)}
fig, ax = plt.subplots(figsize=(9, 3.2))
x = np.arange(len(results))
right = ax.bar(x - 0.2, [h for h, _ in results.values()], 0.4, label="block hits (prefill skipped)", color=HIT)
wrong_bars = ax.bar(x + 0.2, [w for _, w in results.values()], 0.4,
                    label="wrong hits (the block holds another prefix's K/V)", color="#d1495b")
ax.bar_label(right, fontsize=8)
ax.bar_label(wrong_bars, fontsize=8)
ax.set_xticks(x, list(results), fontsize=8)
ax.set_ylabel("blocks")
ax.legend(fontsize=8, loc="upper left")
ax.set_ylim(0, 1.3 * max(h for h, _ in results.values()))
ax.set_title(f"{len(workload)} requests, each one of 3 system prompts + a user message: hits and wrong hits",
             fontsize=10)
plt.show()
(good_hits, good_wrong), (weak_hits, weak_wrong), (naive_hits, naive_wrong) = results.values()
same_first_block = sum(tokens[:BS] == workload[0][:BS] for tokens in workload[1:])
print(f"With the real hash: {good_hits} block hits, {good_wrong} wrong. With a constant hash kvlab still shares "
      f"nothing wrongly ({weak_wrong} wrong) but finds only {weak_hits} hits: the hash map has one entry, so only "
      f"the very first block ever sealed is hittable, and {same_first_block} later requests start with it. "
      f"Trusting the hash instead would have shared {naive_wrong} of {naive_hits} blocks wrongly.")
viz.check(good_wrong == weak_wrong == 0, "kvlab shared a block holding another prefix", defaults=True)
viz.check(weak_hits == same_first_block < good_hits and naive_wrong > 0,
          f"with BS={BS} the constant-hash run found {weak_hits} hits ({same_first_block} requests share the first "
          f"sealed block) and the trusting cache {naive_wrong} wrong ones", defaults=DEFAULTS)

# %% [markdown]
# > **In vLLM and nano-vllm.** The token-and-parent check is kvlab's own. **vLLM V1** trusts the hash: a block's
# > hash covers its parent's hash, its tokens and extra keys (`hash_block_tokens` in
# > `vllm/v1/core/kv_cache_utils.py`), and `BlockPool.get_cached_block` (`vllm/v1/core/block_pool.py`) shares
# > whatever block is filed under it. vLLM's answer to collisions is a stronger hash (the
# > `--prefix-caching-hash-algo` option, e.g. `sha256`), not a content check. **nano-vllm**
# > (`nanovllm/engine/block_manager.py`, `allocate`) compares the cached block's token ids with the new
# > block's, but not its parent: with a colliding hash, two prompts whose blocks hold the same tokens after
# > different prefixes would share, exactly the wrong hit of section 1. SGLang's radix tree compares every
# > token of the prefix, so it needs no hash at all.

# %% [markdown]
# ## 6. Hit rate as the pool shrinks, on a real trace
#
# The Mooncake conversation trace (bundled in `data/`) records, for each request, one id per 512-token
# prompt block; two requests share an id exactly when they share the whole prefix up to the end of that
# block. Expanding id `h` into tokens `h * 512 + j` reproduces that sharing at any block size. We replay
# the first requests in arrival order, one at a time (allocate the prompt, then free it), so the whole pool
# acts as cache and only its size and the LRU order decide what is still there.

# %%
trace = load_trace("mooncake_conversation", limit=NUM_TRACE_REQUESTS)
prompts = [mooncake_token_ids(h, n) for h, n in zip(trace["hash_ids"], trace["input_length"])]
per_id = MOONCAKE_BLOCK_TOKENS // TRACE_BS
# A full block is identified by (the 512-token id it falls in, its index inside that id's span).
keys = {(int(h[j // per_id]), j % per_id) for h, n in zip(trace["hash_ids"], trace["input_length"])
        for j in range(n // TRACE_BS)}
largest = max(-(-len(p) // TRACE_BS) for p in prompts)
never_evicts = len(keys) + largest
print(f"{len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, {len(keys):,} distinct full blocks of "
      f"{TRACE_BS} tokens; the largest prompt needs {largest} blocks.")


def replay(num_blocks, policy="lru"):
    m = BlockManager(num_blocks, TRACE_BS, eviction=policy)
    for tokens in prompts:
        seq = Sequence(tokens, TRACE_BS)
        m.allocate(seq)
        m.free(seq)
    return m.stats.hit_rate, m.num_evictions


pool_sizes = np.unique(np.geomspace(largest, never_evicts, 9).astype(int))
curve = [replay(int(n)) for n in tqdm(pool_sizes, desc="pool sizes")]
rates = np.array([r for r, _ in curve])
assert curve[-1][1] == 0  # by construction the largest pool never evicts: its hit rate is the trace's ceiling


def plot_curve(ax):
    ax.plot(pool_sizes, 100 * rates, "o-", color="#4e79a7", label="LRU")
    ax.axhline(100 * rates[-1], ls="--", color="#999999", lw=1)
    ax.annotate("pool that never evicts", (pool_sizes[0], 100 * rates[-1]), xytext=(0, -12),
                textcoords="offset points", fontsize=8, color="#666666")
    ax.set_ylim(0, 110 * rates[-1])
    ax.set_xscale("log")
    ax.set_xlabel(f"pool size (blocks of {TRACE_BS} tokens)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    secondary = ax.secondary_xaxis("top", functions=(lambda b: b * TRACE_BS / 1e6, lambda t: t * 1e6 / TRACE_BS))
    secondary.set_xlabel("pool size (million tokens)", fontsize=8)


# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
plot_curve(ax)
ax.set_title(f"Mooncake conversation trace, first {NUM_TRACE_REQUESTS} requests, one at a time", fontsize=10)
plt.show()
half = int(np.argmax(rates >= rates[-1] / 2))  # the first pool size reaching half the ceiling
first_ids = trace["hash_ids"].map(lambda h: int(h[0]))
common = first_ids.mode()[0]
common_tokens = trace["input_length"][first_ids == common].clip(upper=MOONCAKE_BLOCK_TOKENS).sum()
print(f"A pool that never evicts ({pool_sizes[-1]:,} blocks) serves {100 * rates[-1]:.1f}% of prompt tokens from "
      f"the cache; the smallest pool that fits every prompt ({pool_sizes[0]:,} blocks) still serves "
      f"{100 * rates[0]:.1f}%. That floor is one shared opening: {100 * (first_ids == common).mean():.0f}% of the "
      f"requests start with the same 512-token block (id {common}), {100 * common_tokens / trace['input_length'].sum():.1f}% "
      f"of all prompt tokens, and LRU keeps it because it is used all the time.")
print(f"Half of the ceiling needs about {pool_sizes[half]:,} blocks, {100 * pool_sizes[half] / pool_sizes[-1]:.0f}% "
      "of the never-evicting pool.")
kv_bytes_per_token = 2 * 32 * 4096 * 2  # K and V, 32 layers, 4096 wide, fp16: a Llama-2-7B-sized model
print(f"For a model of Llama-2-7B's size ({kv_bytes_per_token / 2**20:.1f} MiB of KV per token) that is "
      f"{pool_sizes[half] * TRACE_BS * kv_bytes_per_token / 2**30:.0f} GiB of KV cache, "
      f"{pool_sizes[half] * TRACE_BS * kv_bytes_per_token / 80e9:.0f} times an 80 GB GPU: a prefix cache for "
      "traffic like this has to live beyond one GPU's memory.")
opening_share = common_tokens / trace["input_length"].sum()
viz.check(np.all(np.diff(rates) >= 0) and rates[0] < rates[-1] / 2 and abs(rates[0] - opening_share) < 0.005
          and pool_sizes[half] * TRACE_BS * kv_bytes_per_token > 80e9,
          f"the curve is not rising, its floor ({rates[0]:.1%}) is not far below the ceiling ({rates[-1]:.1%}) or "
          f"not the shared opening's share of the tokens ({opening_share:.1%}), or half the ceiling fits one 80 GB "
          "GPU", defaults=DEFAULTS)

# %% [markdown]
# **Exercise.** Predict before you look: at the middle pool size of the curve above, does FIFO land
# `"above"` or `"below"` LRU's point? FIFO evicts chain heads (section 4); LFU keeps the blocks hit most
# often, such as the shared opening. Edit the value and run the cell; then the widget below places any pool
# size and policy against the LRU curve (outside Jupyter or Colab it draws FIFO at the middle size).
# Notebook 08 runs this comparison systematically, on more traces.

# %%
PREDICTED_FIFO_VS_LRU = None   # "above" or "below"

middle = len(pool_sizes) // 2
fifo_rate, _ = replay(int(pool_sizes[middle]), "fifo")
answer(PREDICTED_FIFO_VS_LRU, "above" if fifo_rate > rates[middle] else "below",
       f"at {pool_sizes[middle]:,} blocks FIFO hits {100 * fifo_rate:.1f}% of prompt tokens, LRU "
       f"{100 * rates[middle]:.1f}%: FIFO evicts the oldest content first, and in a conversation that is the "
       "head of the chain every later turn needs.")
viz.check(f"{100 * fifo_rate:.1f} {100 * rates[middle]:.1f}" == "4.3 4.5" and rates[middle] < rates[-1] / 2,
          f"FIFO hits {100 * fifo_rate:.1f}% and LRU {100 * rates[middle]:.1f}% at the middle size (the answer below "
          "says 4.3% and 4.5%, under half the ceiling)", defaults=DEFAULTS)

# %% [markdown]
# **Answer.** Below, if only a little in the default run (about 4.3% against 4.5% at the middle size). A
# conversation's next turn extends the same chain, so its head is both the oldest block and the one every
# later turn must hit first: FIFO evicts it, stranding the blocks behind it, while LRU refreshes it on every
# hit. The gap is small here because at this size most conversations are evicted before they return anyway.

# %%
def try_policy(pool_blocks=int(pool_sizes[len(pool_sizes) // 2]), policy="fifo"):
    rate, evictions = replay(pool_blocks, policy)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    plot_curve(ax)
    ax.plot([pool_blocks], [100 * rate], "D", color="#e15759", ms=9, label=f"{policy}, {pool_blocks:,} blocks")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{policy} at {pool_blocks:,} blocks: {100 * rate:.1f}% ({evictions:,} evictions)", fontsize=10)
    plt.show()


viz.explore(try_policy, pool_blocks=viz.Stops(pool_sizes), policy=["lru", "fifo", "lfu"])  # the curve's sizes

# %% [markdown]
# ## Takeaways
#
# * A block is shareable only with its whole prefix: the hash is chained, and kvlab's guard compares tokens and
#   parent, so a collision costs hits and never correctness (vLLM relies on a strong hash instead).
# * A hit on a block in use is free; a warm hit costs a free block but no computation; both pin the block.
# * LRU evicts chain tails first, which keeps the heads that later requests can still reach.
# * On real conversation traffic, most of the reuse needs a pool large enough to hold conversations between
#   turns: the hit rate falls steeply once the pool is smaller than the working set.
