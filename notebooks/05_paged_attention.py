# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 05 · Paged attention for decode: from the reference to the kernel
#
# During decode every sequence adds one token, and that token's query must attend to *all* the keys and
# values its sequence has cached, scattered over blocks of the shared pool. This notebook builds
# `paged_attention_decode` up from the plain-torch reference, one idea at a time, checking each against it:
#
# 1. the **paged gather**: a block table turns positions into slots;
# 2. **online softmax**: attention over a context read tile by tile, never all at once;
# 3. **grouped-query attention**: one program serves every query head that shares a KV head;
# 4. **split-K** (flash-decoding): cut long contexts into partitions and merge the partial softmaxes;
# 5. what it buys on a GPU: achieved memory bandwidth.
#
# On a CPU the kernel runs in the Triton interpreter with small sizes; on a GPU it runs compiled with
# realistic ones.

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
import math
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

import kvlab
from kvlab import viz
from kvlab.course import answer
from kvlab.device import DEVICE, ON_GPU, mode
from kvlab.kernels.paged_attention_decode import (DECODE_TILE_N, choose_num_partitions, compute_units,
                                                  paged_attention_decode)
from kvlab.kernels.reference import attention_ref, gather_kv_ref, paged_attention_decode_ref

# Knobs: change them and run the notebook again (on a GPU, the realistic sizes below replace them). Kernels run
# in the Triton interpreter on CPU: keep contexts in the hundreds there.
BLOCK_SIZE = 8             # any power of two from 1 to 128
NUM_HEADS, NUM_KV_HEADS = 8, 2   # query heads and KV heads: NUM_HEADS must be a multiple of NUM_KV_HEADS
HEAD_DIM = 64              # 16 to 256
SEQ_LENS = [70, 7, 45]     # one decode query per sequence, attending to this many cached tokens
NUM_PARTITIONS = 3         # section 4's split-K partitions (on CPU: 5 tiles of sequence 0 in 2 + 2 + 1)
SCORE_DRIFT = 120          # section 2: how far the scores climb over the context (large: exp overflows)
SEED = 0
DTYPE = torch.float32
if ON_GPU:   # a Llama-3-8B-like layer and contexts of a few thousand tokens
    BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SEQ_LENS = 16, 32, 8, 128, [3001, 37, 1500]
    NUM_PARTITIONS, DTYPE = 4, torch.float16
DEFAULTS = not ON_GPU and (BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SEQ_LENS, NUM_PARTITIONS, SCORE_DRIFT,
                           SEED) == (8, 8, 2, 64, [70, 7, 45], 3, 120, 0)  # the CPU setting CI checks exactly
ATOL = 1e-4 if DTYPE == torch.float32 else 1e-2  # kernel against reference: rounding only
torch.manual_seed(SEED)
print(f"kernels run in {mode()} mode on {DEVICE}; block_size={BLOCK_SIZE}, {NUM_HEADS} query heads, "
      f"{NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, sequence lengths {SEQ_LENS}, {DTYPE}")


def max_error(a, b):
    return (a.float() - b.float()).abs().max().item()


# %% [markdown]
# ## 1. The paged gather
#
# The cache is one tensor `[num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]`. We fill it with NaN,
# give each sequence shuffled blocks and write random K/V into its slots only: anything that reads a slot
# it should not will turn the output into NaN.

# %%
def paged_inputs(num_heads, num_kv_heads, lens, spare_blocks=0):
    """(query, kv_cache, block_tables, seq_lens): every sequence in its own shuffled blocks, K/V random in
    the used slots and NaN everywhere else, table entries past a sequence's blocks -1."""
    counts = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(counts) + spare_blocks
    cache = torch.full((num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"), dtype=DTYPE, device=DEVICE)
    tables = torch.full((len(lens), max(counts)), -1, dtype=torch.int32)
    for s, blocks in enumerate(torch.randperm(num_blocks)[:sum(counts)].split(counts)):
        tables[s, :len(blocks)] = blocks
    tables = tables.to(DEVICE)
    for s, n in enumerate(lens):
        pos = torch.arange(n, device=DEVICE)
        cache[tables[s].long()[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE] = torch.randn(
            n, 2, num_kv_heads, HEAD_DIM, device=DEVICE).to(DTYPE)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, device=DEVICE).to(DTYPE)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


query, kv_cache, block_tables, seq_lens = paged_inputs(NUM_HEADS, NUM_KV_HEADS, SEQ_LENS, spare_blocks=4)
print(f"block tables {tuple(block_tables.shape)} (-1 = unused), first 12 columns:")
print(block_tables[:, :12].cpu().numpy())

# %% [markdown]
# Position `p` of sequence `s` lives in physical block `block_tables[s, p // block_size]` at offset
# `p % block_size`. The picture shows that staircase for every sequence: logical blocks are consecutive,
# physical ones jump around the pool.

# %%
fig, ax = plt.subplots(figsize=(8, 3))
for s, n in enumerate(SEQ_LENS):
    pos = np.arange(n)
    ax.step(pos, block_tables[s].cpu().numpy()[pos // BLOCK_SIZE], where="post", label=f"sequence {s} ({n} tokens)")
ax.set(xlabel="token position", ylabel="physical block", title="where each token's K/V lives")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The reference gathers each sequence's K/V into contiguous tensors and runs ordinary attention; the query
# sits at the last position, so it sees every cached key. The kernel computes the same thing without the
# copy: each program looks up block ids as it walks the context.

# %%
k0, v0 = gather_kv_ref(kv_cache, block_tables[0], SEQ_LENS[0])
print(f"gathered K of sequence 0: {tuple(k0.shape)}, any NaN: {bool(k0.isnan().any())}")
reference = paged_attention_decode_ref(query, kv_cache, block_tables, seq_lens)
by_hand = attention_ref(query[:1], k0, v0, torch.tensor([SEQ_LENS[0] - 1]))[0]
out = paged_attention_decode(query, kv_cache, block_tables, seq_lens)
print(f"reference == gather + attention_ref: {torch.equal(reference[0], by_hand)}")
print(f"kernel vs reference: max |error| = {max_error(out, reference):.2e}, NaN in output: {bool(out.isnan().any())}")
viz.check(torch.equal(reference[0], by_hand) and not out.isnan().any() and max_error(out, reference) < ATOL,
          "the reference differs from gather + attention_ref, or the kernel read a NaN-poisoned slot or differs "
          "from the reference", defaults=True)

# %% [markdown]
# ## 2. Online softmax
#
# A program cannot hold a 32k-token context in registers, so it reads K/V in tiles of `TILE_N` tokens. The
# softmax needs the maximum score (to keep `exp` from overflowing) and the sum over *all* keys, which are
# not known until the last tile. The fix: keep a running max `m`, a running sum `l = Σ exp(s_j - m)` and
# an unnormalised output `acc = Σ exp(s_j - m) v_j`. When a tile raises the max from `m` to `m'`, multiply
# `l` and `acc` by `exp(m - m')`: every earlier term becomes `exp(s_j - m')`, as if `m'` had been used from
# the start. At the end `acc / l` is exactly the softmax-weighted sum.
#
# To make the effect visible, the scores below drift upwards (so the max keeps changing) and are large
# (so a naive `exp` overflows even in fp32).

# %%
def online_softmax(scores, values, tile, rescale=True):
    """softmax(scores) @ values, reading ``tile`` entries at a time; also returns each tile's (m, l).
    ``rescale=False`` forgets to rescale the running sums when the max grows (the bug to avoid)."""
    m, l, acc = -math.inf, 0.0, torch.zeros(values.shape[1], dtype=torch.float64)
    history = []
    for start in range(0, len(scores), tile):
        s, v = scores[start:start + tile].double(), values[start:start + tile].double()
        m_new = max(m, s.max().item())
        alpha = math.exp(m - m_new) if rescale else 1.0   # rescales everything accumulated so far
        p = torch.exp(s - m_new)
        l, acc, m = l * alpha + p.sum().item(), acc * alpha + p @ v, m_new
        history.append((m, l))
    return acc / l, history


n = 8 * DECODE_TILE_N
scores = torch.linspace(0, SCORE_DRIFT, n) + 15 * torch.randn(n)
values = torch.randn(n, 4)
online, history = online_softmax(scores, values, DECODE_TILE_N)
exact = torch.softmax(scores.double(), 0) @ values.double()
naive = torch.exp(scores) / torch.exp(scores).sum()       # fp32 without the max: overflows
print(f"largest score {scores.max():.0f}: exp overflows fp32 -> naive softmax has NaN: {bool(naive.isnan().any())}")
print(f"online softmax vs exact softmax: max |error| = {(online - exact).abs().max():.1e}")
viz.check((online - exact).abs().max() < 1e-9, "the online softmax differs from the exact one", defaults=True)
viz.check(bool(naive.isnan().any()), f"the largest score is only {scores.max():.0f}: with SCORE_DRIFT="
          f"{SCORE_DRIFT} exp does not overflow fp32 (above about 88.7)", defaults=DEFAULTS)

# %%
m_hist, l_hist = (np.array(x) for x in zip(*history))
forgetful, forgetful_history = online_softmax(scores, values, DECODE_TILE_N, rescale=False)
tile_ends = np.arange(1, len(history) + 1) * DECODE_TILE_N
# The invariant after each tile: l equals the sum over everything read so far, measured from the current max.
l_direct = np.array([torch.exp(scores[:end].double() - m).sum().item() for end, m in zip(tile_ends, m_hist)])
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.5))
a.plot(scores, ".", ms=3, alpha=0.5, label="scores")
a.step(np.concatenate([[0], tile_ends]), np.concatenate([[m_hist[0]], m_hist]), where="pre", color="C3",
       label="running max m (after each tile)")
for end in tile_ends:
    a.axvline(end, color="0.85", lw=0.8)
a.set(xlabel="key position", ylabel="score", title="tiles and the running max")
a.legend(fontsize=8)
tiles_read = np.arange(1, len(history) + 1)
b.plot(tiles_read, l_direct, "-", color="0.6", lw=6, alpha=0.5, label="exact: Σ exp(s - m) over all keys so far")
b.plot(tiles_read, l_hist, "o", color="C0", label="running sum, rescaled by exp(m_old - m_new)")
b.plot(tiles_read, [l for _, l in forgetful_history], "x--", color="C3", label="running sum, never rescaled (the bug)")
b.set(xlabel="tiles read", ylabel="running sum l = Σ exp(s - m)", ylim=(0, None),
      title="rescaling keeps the running sum exact")
b.legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"output error with rescaling {(online - exact).abs().max():.1e}, "
      f"without {(forgetful - exact).abs().max():.1e}")
viz.check(np.allclose(l_hist, l_direct, rtol=1e-9), "the rescaled running sum is not the exact one", defaults=True)
viz.check((forgetful - exact).abs().max() > 1e-3, "forgetting to rescale did not change the output: with "
          f"SCORE_DRIFT={SCORE_DRIFT} the max never grew after the first tile", defaults=DEFAULTS)

# %% [markdown]
# The kernel does exactly this, in fp32 and in base 2 (`exp2`, with the scores pre-multiplied by log2 e),
# for a whole tile of query heads at once.
#
# **Exercise.** Predict: if the scores climbed only to 60 (`SCORE_DRIFT = 60`, the same noise), would the
# naive fp32 softmax still overflow? fp32's `exp` overflows above about 88.7, so the largest score decides.
# Edit the value and run the cell: it draws those scores and tries.

# %%
PREDICTED_OVERFLOWS_AT_60 = None   # True or False

gentle = torch.linspace(0, 60, n) + 15 * torch.randn(n, generator=torch.Generator().manual_seed(SEED))
overflows = bool((torch.exp(gentle) / torch.exp(gentle).sum()).isnan().any())
gentle_online, _ = online_softmax(gentle, values, DECODE_TILE_N)
gentle_error = (gentle_online - torch.softmax(gentle.double(), 0) @ values.double()).abs().max()
viz.check(not overflows and round(gentle.max().item()) == 86 and round(scores.max().item()) == 145,
          f"at drift 60 the largest score is {gentle.max():.0f} (overflows: {overflows}), at SCORE_DRIFT={SCORE_DRIFT} "
          f"{scores.max():.0f}; the answer below says about 86, no overflow, and about 145 at the default 120",
          defaults=DEFAULTS)
answer(PREDICTED_OVERFLOWS_AT_60, overflows, f"the largest score is {gentle.max():.0f}: exp({gentle.max():.0f}) is "
       f"{'above' if overflows else 'below'} fp32's limit. The online softmax never exponentiates anything above "
       f"0, so its error stays tiny ({gentle_error:.0e}) either way.")

# %% [markdown]
# **Answer.** No, but only just: with a drift of 60 the noise (15 x a normal draw over 128 scores) lifts the
# largest score to about 86, below 88.7, so every `exp` stays finite (at the default drift of 120 it reaches
# about 145 and the sum is `inf`, then `inf / inf` is NaN). A naive softmax is one unlucky score away from
# NaN; the online softmax subtracts the running max first, so no term ever exceeds `exp(0) = 1`.
#
# ## 3. Grouped-query attention
#
# With `num_heads` query heads and `num_kv_heads` KV heads, query head `h` reads KV head
# `h // (num_heads // num_kv_heads)`. A kernel with one program per *query* head would request every K/V tile
# once per query head of the group; `paged_attention_decode` runs one program per *KV* head, whose query
# tile holds the whole group, so each K/V byte is requested once.
#
# What the bar chart counts is bytes **requested** by the programs, not bytes read from DRAM. The programs of
# one group read the same tiles at about the same time, so on a GPU most repeated requests are served by the
# L2 cache: DRAM traffic is closer to the right-hand bar than the left one suggests. What grouping certainly
# saves is load instructions and L2 bandwidth; how much DRAM traffic it saves depends on how many tiles stay
# in L2 between the group's reads (a profiler's `dram__bytes_read` against `lts__t_bytes` tells).

# %%
group = NUM_HEADS // NUM_KV_HEADS
reads = np.zeros((NUM_HEADS, NUM_KV_HEADS))
reads[np.arange(NUM_HEADS), np.arange(NUM_HEADS) // group] = 1
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5), gridspec_kw={"width_ratios": [1, 1.4]})
a.imshow(reads.T, cmap="Blues", aspect="auto")
for kv in range(NUM_KV_HEADS):
    a.text((kv + 0.5) * group - 0.5, kv, f"program (seq, kv head {kv})", ha="center", va="center", color="white",
           fontsize=8)
a.set(xlabel="query head", ylabel="KV head", title=f"GQA group of {group}: who reads what",
      xticks=range(NUM_HEADS), yticks=range(NUM_KV_HEADS))
context, itemsize = 32768, torch.empty((), dtype=torch.float16).element_size()
kv_bytes = 2 * context * NUM_KV_HEADS * HEAD_DIM * itemsize
b.bar(["one program\nper query head", "one program\nper KV head (kvlab)"], [group * kv_bytes / 1e6, kv_bytes / 1e6],
      color=["C7", "C0"])
b.set(ylabel="MB of K/V requested per sequence", title=f"one decode step, {context} fp16 tokens, this layer\n"
      "(bytes requested; L2 serves part of the repeats)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The same kernel handles multi-head (group 1), grouped (group > 1) and multi-query (one KV head) attention.
# Each configuration below gets its own cache and is checked against the reference:

# %%
for name, kv_heads in [("multi-head", NUM_HEADS), ("grouped-query", NUM_KV_HEADS), ("multi-query", 1)]:
    args = paged_inputs(NUM_HEADS, kv_heads, SEQ_LENS)
    err = max_error(paged_attention_decode(*args), paged_attention_decode_ref(*args))
    print(f"{name:>14} ({NUM_HEADS} query heads / {kv_heads} kv heads): max |error| vs reference {err:.1e}")
    viz.check(err < ATOL, f"{name}: the kernel differs from the reference by {err:.1e}", defaults=True)

# %% [markdown]
# ## 4. Split-K: more programs for long contexts
#
# The grid is `(num_seqs, num_kv_heads)` programs. With few sequences that is far fewer programs than the
# GPU has SMs, and each walks a long context alone. Split-K cuts every context into partitions handled by
# separate programs; each writes its partial `(m, l, acc)`, and a small reduce kernel merges them with the
# same rescaling as the online softmax: `out = Σ_p exp(m_p - M) acc_p / Σ_p exp(m_p - M) l_p`, `M = max m_p`.
# Partitions split a sequence's tiles evenly, so the shortest sequences leave some partitions empty.

# %%
fig, ax = plt.subplots(figsize=(9, 2.2))
for s, n in enumerate(SEQ_LENS):
    tiles = -(-n // DECODE_TILE_N)
    per_part = -(-tiles // NUM_PARTITIONS)
    for p in range(NUM_PARTITIONS):
        lo, hi = p * per_part * DECODE_TILE_N, min((p + 1) * per_part * DECODE_TILE_N, n)
        if hi > lo:
            ax.barh(s, hi - lo, left=lo, color=f"C{p}", edgecolor="white", label=f"partition {p}" if s == 0 else None)
ax.set(xlabel="token position", yticks=range(len(SEQ_LENS)), yticklabels=[f"seq {s}" for s in range(len(SEQ_LENS))],
       title=f"split_k={NUM_PARTITIONS}: every coloured segment is one program (per kv head)")
ax.legend(fontsize=8, ncol=NUM_PARTITIONS, loc="upper center", bbox_to_anchor=(0.5, -0.45))
plt.show()
tiles_per_seq = [-(-n // DECODE_TILE_N) for n in SEQ_LENS]
viz.check(tiles_per_seq[0] == 5 and -(-tiles_per_seq[0] // NUM_PARTITIONS) == 2 and min(tiles_per_seq) < NUM_PARTITIONS,
          f"sequence 0 has {tiles_per_seq[0]} tiles (the knobs' comment: 5, in 2 + 2 + 1) and no sequence is "
          f"shorter than {NUM_PARTITIONS} tiles, so no partition is empty", defaults=DEFAULTS)

# %% [markdown]
# The merge in plain torch first, on one head of sequence 0: partial softmaxes of `NUM_PARTITIONS` partitions,
# rescaled to their common max, give the full softmax.

# %%
k0, v0 = gather_kv_ref(kv_cache, block_tables[0], SEQ_LENS[0])
head = 0
s0 = (k0[:, head // group].double() @ query[0, head].double()) / math.sqrt(HEAD_DIM)
parts = []
for chunk_s, chunk_v in zip(s0.chunk(NUM_PARTITIONS), v0[:, head // group].double().chunk(NUM_PARTITIONS)):
    m_p = chunk_s.max()
    p = torch.exp(chunk_s - m_p)
    parts.append((m_p, p.sum(), p @ chunk_v))
M = max(m for m, _, _ in parts)
merged = sum(torch.exp(m - M) * acc for m, _, acc in parts) / sum(torch.exp(m - M) * l for m, l, _ in parts)
print(f"merged partials vs reference (seq 0, head {head}): max |error| = {max_error(merged, reference[0, head]):.1e}")
viz.check(max_error(merged, reference[0, head]) < ATOL, "the merged partials differ from the reference",
          defaults=True)

# %%
split_outputs = {split: paged_attention_decode(query, kv_cache, block_tables, seq_lens, split_k=split)
                 for split in (False, 2, NUM_PARTITIONS)}
for split, o in split_outputs.items():
    print(f"split_k={split!s:>5}: max |error| vs reference {max_error(o, reference):.1e}, "
          f"vs no split {max_error(o, split_outputs[False]):.1e}")
    viz.check(max_error(o, reference) < ATOL, f"split_k={split} changed the answer beyond rounding", defaults=True)

# %% [markdown]
# **Exercise.** Predict, for three sequences of 7 tokens each (`SEQ_LENS = [7, 7, 7]`) and `split_k=3`:
# how many of sequence 0's partitions are empty, and does the split output still match the reference?
# Edit the values and run the cell: it runs the kernel on those sequences.

# %%
PREDICTED_EMPTY_PARTITIONS = None   # of sequence 0's 3 partitions
PREDICTED_STILL_MATCHES = None      # True or False

short_args = paged_inputs(NUM_HEADS, NUM_KV_HEADS, [7, 7, 7])
short_tiles = -(-7 // DECODE_TILE_N)
empty = 3 - min(3, short_tiles)     # the kernel's split: cdiv(tiles, partitions) tiles per partition
short_error = max_error(paged_attention_decode(*short_args, split_k=3), paged_attention_decode_ref(*short_args))
answer(PREDICTED_EMPTY_PARTITIONS, empty, f"7 tokens are {short_tiles} tile of {DECODE_TILE_N}: one partition "
       "gets it, the others get nothing.")
viz.check(empty == 2 and short_error < ATOL, f"{empty} empty partitions, error {short_error:.1e}; the answer below "
          "says 2, and a match", defaults=True)
answer(PREDICTED_STILL_MATCHES, bool(short_error < ATOL), f"an empty partition writes m = -inf and l = 0, which "
       f"the merge weighs by exp(-inf - M) = 0 (max |error| {short_error:.1e}).")

# %% [markdown]
# **Answer.** 2 empty partitions, and yes, it still matches: the reduce rescales every partial by
# `exp(m_p - M)`, and an empty partition's `m_p = -inf` makes its weight 0. (Setting `NUM_KV_HEADS = 8` in
# the knobs cell makes every group one query head: the GQA picture becomes a diagonal and both bars are
# equal, since each KV head is requested once either way.)
#
# > **In vLLM.** vLLM's **V0** decode kernels are CUDA: `paged_attention_v1` (one pass per sequence and head)
# > and `paged_attention_v2` (split-K, with 512-token partitions and a reduce kernel: flash-decoding), in
# > `csrc/attention/`. **V1** runs prefill and decode through one varlen attention call with a block table
# > (FlashAttention's `flash_attn_varlen_func`, or FlashInfer; `vllm/v1/attention/backends/`), which splits long
# > contexts itself. nano-vllm calls FlashAttention's `flash_attn_with_kvcache` for decode
# > (`nanovllm/layers/attention.py`). The ideas of this notebook (paged gather, online softmax, GQA tiles,
# > split-K) are inside all of them.

# %% [markdown]
# By default (`split_k=None`) the launcher decides: when `num_seqs * num_kv_heads` programs already fill
# the SMs, or the context is short, it does not split; otherwise it aims at about two programs per SM,
# keeping every partition at least a few hundred tokens long. Here is its choice over batch size and
# context length, for a GPU with the SM count below (this machine's when it has one):

# %%
num_sms = compute_units(DEVICE) if ON_GPU else 132   # 132: an H100 SXM
batches, contexts = [1, 2, 4, 8, 16, 32, 64], [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
choice = np.array([[choose_num_partitions(b, 8, c, num_sms) for c in contexts] for b in batches])
fig, ax = plt.subplots(figsize=(8, 3.5))
im = ax.imshow(choice, cmap="viridis", aspect="auto")
for (i, j), value in np.ndenumerate(choice):
    ax.text(j, i, value, ha="center", va="center", color="white" if value < choice.max() / 2 else "black", fontsize=8)
ax.set(xticks=range(len(contexts)), xticklabels=contexts, yticks=range(len(batches)), yticklabels=batches,
       xlabel="context length", ylabel="sequences in the batch",
       title=f"partitions chosen by split_k=None (8 kv heads, {num_sms} SMs)")
plt.show()
programs = np.array(batches)[:, None] * 8
viz.check(np.all(choice[programs.repeat(len(contexts), 1) >= num_sms] == 1) and np.all(choice[:, 0] == 1)
          and np.all((choice == 1) | (np.array(contexts)[None, :] / choice >= 256))
          and np.all(choice * programs < 2 * num_sms + programs),
          "split_k=None split a batch that fills the SMs or a short context, made a partition under 256 tokens, or "
          "went past about two programs per SM", defaults=True)

# %% [markdown]
# ## 5. Bandwidth on a GPU
#
# Decode attention reads every cached byte of the batch once and does little arithmetic per byte, so its
# speed is memory bandwidth. `kvlab.bench.kernels` times the kernel next to baselines (torch SDPA over
# contiguous, pre-gathered K/V; FlashInfer when installed) and reports GB/s from the bytes the operation
# must move. On a GPU this cell runs a small decode grid now; on CPU it plots the CSVs committed under
# `data/bench/` (each titled with the GPU it came from).

# %%
def bench_dirs():
    """data/bench in this checkout (cwd is notebooks/ in CI) or next to the installed package."""
    here = [Path.cwd().parent / "data" / "bench", Path(kvlab.__file__).resolve().parent.parent / "data" / "bench"]
    return [d for d in dict.fromkeys(here) if d.is_dir()]


if ON_GPU:
    from kvlab.bench.kernels import Case, run
    cases = [Case("decode", "fp16", b, c, 32, 8) for b in (1, 4, 16, 64) for c in (512, 2048, 8192)]
    csv_paths = [run(cases, tempfile.mkdtemp())]
else:
    csv_paths = sorted(p for d in bench_dirs() for p in d.glob("*.csv"))
frames = [pd.read_csv(p) for p in csv_paths]
frames = [df[df.kernel == "decode"] for df in frames if (df.kernel == "decode").any()]
if not frames:
    print("No GPU benchmark results yet: data/bench/ holds no CSV with decode rows. They are produced on a "
          "GPU by `python -m kvlab.bench kernels` (then committed); this notebook plots them when present.")


# %%
def plot_bandwidth(df):
    """GB/s against context (at the largest batch) and against batch (at the longest context), one line
    per implementation, with the device's copy bandwidth as the ceiling."""
    gpu = df.gpu.iloc[0]
    copy_gbps = (df.gbps / df.frac_of_copy_bw).median()
    big_batch, long_context = df.batch.max(), df.context.max()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, (x, fixed, value) in zip(axes, [("context", "batch", big_batch), ("batch", "context", long_context)]):
        sub = df[df[fixed] == value]
        for (impl, dtype, heads), rows in sub.groupby(["impl", "dtype", "num_kv_heads"]):
            rows = rows.sort_values(x)
            ax.plot(rows[x], rows.gbps, "o-", label=f"{impl} ({dtype}, {heads} kv heads)")
        ax.axhline(copy_gbps, color="0.5", ls="--", label="device copy bandwidth")
        ax.set(xscale="log", xlabel=x, ylabel="GB/s", title=f"decode, {fixed} = {value}")
        ax.legend(fontsize=7)
    fig.suptitle(f"measured on {gpu}")
    plt.tight_layout()
    plt.show()


for df in frames:
    for gpu, rows in df.groupby("gpu"):
        plot_bandwidth(rows)

# %% [markdown]
# ## Takeaways
#
# * Paging costs one extra lookup per block of K/V: its physical block id. (kvlab's kernel issues that load per
#   token, `block_table[pos // block_size]`, so that tiles need not line up with blocks; the tokens of a block
#   all read the same table entry, which the hardware serves as one cached load.) Masking every load to the
#   sequence's used positions means table padding and unused blocks are never touched, which the
#   NaN-poisoned cache proves.
# * Online softmax turns attention into one pass over the context with O(1) state per query row; the
#   rescale by `exp(m - m')` is what makes tiles independent of the ones after them.
# * Grouped-query attention requests each KV head once for its whole group of query heads; how much DRAM
#   traffic that saves over one program per query head depends on what L2 would have caught anyway.
# * Split-K trades a small merge for parallelism when the batch is too small to fill the GPU; it does not
#   change the answer beyond rounding.
