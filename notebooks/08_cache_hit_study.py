# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 08 · How much prefill can a prefix cache save?
#
# A prefix cache keeps the K/V blocks of earlier prompts so that a later prompt starting the same way skips
# that part of its prefill. How much it saves depends on three things: how much the traffic repeats itself
# (a property of the trace alone), how much memory the cache gets, and which cached block it gives up when
# memory runs out (the **eviction policy**).
#
# This notebook replays real and synthetic traces through kvlab's `BlockManager` (the same code a serving
# engine would call) with `kvlab.studies`, and asks: what is the best any cache could do on this trace (the
# **infinite-cache ceiling**)? How close do LRU, FIFO and LFU get at each capacity? What does the block size
# change? How many blocks are ever used twice? And how do you try your own policy?
#
# `kvlab study` on the command line runs the same sweeps and writes a CSV and a plot.

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
import math
import random
from collections import OrderedDict

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kvlab import viz
from kvlab.blocks.eviction import EvictionPolicy
from kvlab.course import answer
from kvlab.studies import EngineModel, cache_hit_study, replay, reuse_profile
from kvlab.studies.doctor import COLUMNS as DOCTOR_COLUMNS
from kvlab.studies.plots import plot_hit_rates, plot_miss_causes
from kvlab.studies.reuse import reuse_counts
from kvlab.studies.sequential import unit_hit_rates
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.traces import load_trace

# Knobs: change them and run the notebook again.
LIMIT = 3000          # Mooncake requests to replay (of 12,031; None: all of them, about three times as long)
TRACE_BS = 512        # Mooncake's natural block size: one trace id per 512 tokens
POLICIES = ["lru", "fifo", "lfu"]
SYNTHETIC_BS = 16     # block size of the synthetic workloads
trace = load_trace("mooncake_conversation", limit=LIMIT)
print(f"Mooncake conversation trace: {len(trace):,} requests over {trace['timestamp'].iloc[-1] / 60_000:.0f} minutes, "
      f"{trace['input_length'].sum() / 1e6:.1f} M prompt tokens (mean {trace['input_length'].mean():,.0f} per request).")

# %% [markdown]
# ## 1. The ceiling: how much the trace repeats itself
#
# Each Mooncake request lists one id per 512-token block of its prompt, and two requests share an id only
# when they share the whole prefix up to that block. So, from the trace alone, every full block has a
# *key* naming its prefix, and a cache that never evicts hits exactly the blocks whose key appeared in an
# earlier request (`kvlab.studies.reuse`). That is the ceiling no policy can beat. The same keys say how
# often each distinct block is used.

# %%
profile = reuse_profile(trace, TRACE_BS)
counts = reuse_counts(trace, TRACE_BS)
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.hist(counts, bins=np.geomspace(1, counts.max() + 1, 30), color="#4e79a7")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("requests using the block")
ax.set_ylabel(f"distinct {TRACE_BS}-token blocks")
ax.set_title("how often each distinct block is used: most once, a few by nearly every request", fontsize=10)
plt.show()
pd.Series({"full blocks in all prompts": profile["full_blocks"], "distinct blocks": profile["distinct_blocks"],
           "infinite-cache ceiling (% of prompt tokens)": round(100 * profile["ceiling_hit_rate_tokens"], 1),
           "distinct blocks used by one request only (%)": round(100 * profile["never_reused"], 1),
           "most requests sharing one block": int(counts.max())}, name="Mooncake", dtype=object).to_frame()

# %% [markdown]
# Reading: a cache that never evicts serves the ceiling's share of prompt tokens, and most distinct blocks are
# never used twice, so caching them is pure cost; the blocks used by hundreds of requests are shared system
# prompts and the opening turns of popular conversations.

# %% [markdown]
# ## 2. Hit rate versus capacity, per policy
#
# Now the real `BlockManager`, one request at a time (allocate the prompt, then free it), so every block
# in the pool is cache. Capacities are fractions of the blocks an infinite cache would keep (the *working
# set*). The dashed line is the ceiling.

# %%
working_set = profile["distinct_blocks"]
capacities = sorted({max(64, working_set // d) for d in (64, 32, 16, 8, 4, 2)}) + [math.inf]
study = cache_hit_study("mooncake_conversation", block_sizes=[TRACE_BS], capacities=capacities, policies=POLICIES,
                        limit=LIMIT)
plot_hit_rates(study)
plt.show()

# %%
finite = study[study["capacity_blocks"] != math.inf].copy()
finite["share_of_ceiling"] = finite["hit_rate_tokens"] / finite["ceiling_hit_rate_tokens"]
gap = finite.pivot(index="capacity_blocks", columns="policy", values="share_of_ceiling")[POLICIES]
fig, ax = plt.subplots(figsize=(8, 3.2))
fractions = gap.index / working_set
for policy in POLICIES:
    ax.plot(fractions, 100 * gap[policy], "o-", label=policy)
ax.set_xscale("log")
ax.set_xticks(fractions, [f"{100 * f:.1f}%" for f in fractions])
ax.minorticks_off()
ax.set_xlabel("capacity, as a share of the blocks an infinite cache keeps")
ax.set_ylabel("% of the ceiling reached")
ax.set_title("Mooncake: how close each policy gets to the ceiling", fontsize=10)
ax.grid(alpha=0.3)
ax.legend()
plt.show()
by_capacity = (100 * gap).round(1).assign(best=gap.idxmax(axis=1))
viz.check(profile["never_reused"] > 0.5, "most distinct blocks should be used by one request only",
          defaults=(LIMIT, TRACE_BS) == (3000, 512))
by_capacity.index = [f"{int(c):,} ({100 * c / working_set:.1f}%)" for c in by_capacity.index]
by_capacity.rename_axis("capacity in blocks (share of working set)")

# %%
viz.check((gap["lru"] >= 0.5).any(), "LRU never reaches half the ceiling in this sweep: with fewer requests "
          "(LIMIT) or another block size the working set and its reuse change",
          defaults=(LIMIT, TRACE_BS) == (3000, 512))
half = int(gap.index[np.argmax(gap["lru"].to_numpy() >= 0.5)]) if (gap["lru"] >= 0.5).any() else int(gap.index[-1])
lru_lead = 100 * (gap["lru"] - gap["lfu"])  # points of the ceiling
viz.check(by_capacity["best"].iloc[0] == "lfu" and by_capacity["best"].iloc[-1] != "fifo"
          and lru_lead.loc[half] > 0 and lru_lead.iloc[-1] > -1,
          "the reading below says: frequency wins the smallest cache, recency wins once conversations fit, and the "
          "policies converge near the working set", defaults=(LIMIT, TRACE_BS) == (3000, 512))
print(f"Reading: LRU reaches half the ceiling at {half:,} blocks, {100 * half / working_set:.0f}% of what an infinite "
      f"cache keeps. The best policy changes with capacity ({', '.join(by_capacity['best'])}, smallest first): in a "
      f"cache too small to hold conversations between turns the shared openings are what is worth keeping "
      f"(frequency), and once it can hold them, recency keeps the conversations that come back; near the working "
      f"set the policies converge (LRU and LFU within {abs(lru_lead.iloc[-1]):.1f} points of the ceiling).")

# %% [markdown]
# ### Why the rest misses: every miss has a cause
#
# A hit rate says how much was served, not why the rest was not. Every study row also carries the **hit-rate
# doctor**'s columns (`kvlab.studies.doctor`; the CSV's `*_tokens` columns): each prompt token is a hit or a miss
# with one cause. **Cold**: these tokens after this prefix were never seen before; **evicted**: the block was
# cached and lost (with its reuse distance: requests since it was last used); **partial block**: the prompt
# shares a prefix with an earlier one that ends inside the block, or its last block holds the last token
# (always computed). The causes add up to the prompt tokens exactly (a property test checks it on random
# workloads). Here are section 2's LRU rows, stacked:

# %%
lru_rows = study[study["policy"] == "lru"].sort_values("capacity_blocks")
ax = plot_miss_causes(lru_rows, "capacity_blocks")
ax.set_title("Mooncake, LRU: the hits and each miss's cause, by capacity (blocks of 512)", fontsize=10)
plt.show()
causes = lru_rows.set_index("capacity_blocks")[["hit_gpu_tokens", "cold_tokens", "evicted_tokens",
                                                "partial_block_tokens", "evicted_reuse_distance_p50"]]
(causes.iloc[:, :4].div(lru_rows["prompt_tokens"].to_numpy(), axis=0) * 100).round(2).assign(
    evicted_reuse_distance_p50=causes["evicted_reuse_distance_p50"]).rename_axis("capacity (blocks)")

# %%
finite_lru = causes.loc[causes.index != math.inf]
ceiling_tokens = lru_rows["ceiling_hit_rate_tokens"].iloc[0] * lru_rows["prompt_tokens"].iloc[0]
viz.check(causes["cold_tokens"].nunique() == 1 and causes["partial_block_tokens"].nunique() == 1,
          "cold and partial-block tokens are the trace's, not the cache's: the same at every capacity", defaults=True)
viz.check((causes["cold_tokens"] > causes["evicted_tokens"]).all(),
          "most misses are cold at every capacity, even the smallest", defaults=(LIMIT, TRACE_BS) == (3000, 512))
viz.check(np.allclose(causes["hit_gpu_tokens"] + causes["evicted_tokens"], ceiling_tokens)
          and causes.loc[math.inf, "evicted_tokens"] == 0,
          "every token the infinite cache hits is, in a finite one, either a hit or evicted", defaults=True)
viz.check(finite_lru["evicted_tokens"].is_monotonic_decreasing
          and finite_lru["evicted_reuse_distance_p50"].is_monotonic_increasing,
          "a larger cache evicts fewer tokens, and the ones it still loses come back later (a longer median "
          "reuse distance)", defaults=(LIMIT, TRACE_BS) == (3000, 512))
print(f"Reading: {100 * causes['cold_tokens'].iloc[0] / lru_rows['prompt_tokens'].iloc[0]:.0f}% of the prompt "
      f"tokens are cold at every capacity: no cache could serve them. Capacity only moves tokens between "
      f"'evicted' and 'hit'. The smallest pool loses blocks reused after a median of "
      f"{finite_lru['evicted_reuse_distance_p50'].iloc[0]:,.0f} requests; the largest finite one only those "
      f"reused after {finite_lru['evicted_reuse_distance_p50'].iloc[-1]:,.0f}. Partial blocks are "
      f"{100 * causes['partial_block_tokens'].iloc[0] / lru_rows['prompt_tokens'].iloc[0]:.2f}% here: the "
      f"trace's ids are 512 tokens wide, so sharing ends on a block boundary (section 4 shows where it does not).")

# %% [markdown]
# ## 3. Synthetic workloads: patterns with known sharing
#
# `kvlab.studies.synthetic` builds seeded workloads where the sharing is known by construction: one system
# prompt for everyone, few-shot prompts that draw examples from a pool in varying order, multi-turn chats
# whose every turn extends the previous one, and parallel sampling (the same prompt several times at once).
# Each workload gets capacities that stress it: from the smallest pool that holds its largest prompt up to
# its working set.

# %%
def stressing_capacities(frame, block_size, steps=6):
    """From the largest prompt's blocks (the smallest pool that runs every request) to the working set."""
    smallest = int((-(-frame["input_length"] // block_size)).max())
    largest = max(smallest + 1, reuse_profile(frame, block_size)["distinct_blocks"])
    return sorted({int(c) for c in np.geomspace(smallest, largest, steps)})


synthetic_frames = {name: make() for name, make in WORKLOADS.items()}
synthetic = pd.concat([cache_hit_study((name, frame), block_sizes=[SYNTHETIC_BS], policies=POLICIES, progress=False,
                                       capacities=stressing_capacities(frame, SYNTHETIC_BS))
                       for name, frame in synthetic_frames.items()])
synthetic["share_of_ceiling"] = synthetic["hit_rate_tokens"] / synthetic["ceiling_hit_rate_tokens"]
synthetic["capacity_share"] = synthetic["capacity_blocks"] / synthetic["trace"].map(
    {n: reuse_profile(f, SYNTHETIC_BS)["distinct_blocks"] for n, f in synthetic_frames.items()})
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), layout="constrained")
for name, rows in synthetic[synthetic["policy"] == "lru"].groupby("trace", sort=False):
    axes[0].plot(rows["capacity_share"], 100 * rows["share_of_ceiling"], "o-", label=name.removeprefix("synthetic_"))
axes[0].set(xscale="log", ylim=(0, 105), xlabel="capacity, share of the working set",
            ylabel="% of the ceiling reached", title="LRU, every workload: who needs a big cache?")
axes[0].legend(fontsize=8)
for ax, name in zip(axes[1:], ["synthetic_few_shot", "synthetic_chat"]):
    rows = synthetic[synthetic["trace"] == name]
    for policy in POLICIES:
        mine = rows[rows["policy"] == policy]
        ax.plot(mine["capacity_blocks"], 100 * mine["hit_rate_tokens"], "o-", label=policy)
    ax.axhline(100 * rows["ceiling_hit_rate_tokens"].iloc[0], color="k", ls="--", lw=1, label="infinite cache")
    ax.set(xscale="log", xlabel=f"capacity (blocks of {SYNTHETIC_BS} tokens)", ylabel="prompt tokens from cache (%)",
           title=f"{name.removeprefix('synthetic_')}: the policies", ylim=(0, None))
    ticks = sorted(rows["capacity_blocks"].unique())
    ax.set_xticks(ticks, [f"{int(t):,}" for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=8)
for ax in axes:
    ax.grid(alpha=0.3)
plt.show()
at_middle = synthetic.loc[synthetic.groupby(["trace", "policy"])["capacity_blocks"].transform(
    lambda c: c == sorted(c.unique())[len(c.unique()) // 2])]
mid = 100 * at_middle.pivot(index="trace", columns="policy", values="hit_rate_tokens")[POLICIES]
viz.check(all(mid.loc[name].round(6).nunique() == 1 for name in ("synthetic_system_prompt", "synthetic_parallel"))
          and mid.loc["synthetic_few_shot"].idxmax() == "lfu" and mid.loc["synthetic_chat"].idxmax() == "lru",
          "the reading below says: the system prompt and parallel sampling hit the same whatever the policy, LFU "
          "wins few-shot and LRU wins chat", defaults=SYNTHETIC_BS == 16)
mid.round(1).assign(capacity_blocks=at_middle.groupby("trace")["capacity_blocks"].first()).rename_axis(
    "hit rate (%) at a mid capacity")

# %% [markdown]
# Reading: a shared system prompt or a prompt sampled several times at once reaches its ceiling as soon as
# the pool holds one request, whatever the policy, because every request hits the shared blocks before
# anything could evict them. Few-shot prompts draw from a fixed pool of examples, so the most-hit blocks stay
# useful (frequency: LFU); a chat's next turn returns after a think time, so the most recently used
# conversations are the ones to keep (recency: LRU).

# %% [markdown]
# **Exercise.** Predict: with room for an eighth of the Mooncake working set (blocks of 512), does LFU take
# `"more"` or `"fewer"` prompt tokens from the cache than LRU? Edit the value and run the cell: it replays
# the trace with both policies at that capacity. Then the widget below places any capacity, policy and
# block size against section 2's LRU curve (dashed: the ceiling at that block size); smaller blocks take
# longer to replay, so on CPU keep the block size at 128 or more. Outside Jupyter or Colab it draws LFU at
# an eighth.

# %%
PREDICTED_LFU_VS_LRU = None   # "more" or "fewer"

eighth = int(0.125 * working_set)
by_policy = {policy: replay(trace, block_size=TRACE_BS, capacity=eighth, policy=policy)["hit_rate_tokens"]
             for policy in ("lru", "lfu")}
answer(PREDICTED_LFU_VS_LRU, "more" if by_policy["lfu"] > by_policy["lru"] else "fewer",
       f"at {eighth:,} blocks LFU hits {100 * by_policy['lfu']:.1f}% of prompt tokens, LRU "
       f"{100 * by_policy['lru']:.1f}%: a conversation's next turn comes back after a think time, so recency "
       "predicts reuse better than a count that never decays.")
viz.check([round(100 * by_policy[p], 1) for p in ("lfu", "lru")] == [14.6, 15.6],
          "the answer below quotes LFU 14.6% against LRU 15.6%", defaults=(LIMIT, TRACE_BS) == (3000, 512))

# %% [markdown]
# **Answer.** Fewer: about 14.6% against LRU's 15.6% at an eighth of the working set. On this chat trace
# recency is the better predictor (section 2's "Reading"): LFU's counts never decay, so it keeps blocks of
# long-finished conversations that were hit often, at the expense of the ones about to return.

# %%
lru_curve = study[(study["policy"] == "lru") & (study["capacity_blocks"] != math.inf)]


def try_mooncake(capacity_share=0.125, policy="lfu", block_size=TRACE_BS):
    blocks = int(capacity_share * working_set * TRACE_BS / block_size)
    row = replay(trace, block_size=block_size, capacity=blocks, policy=policy)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.plot(lru_curve["capacity_blocks"] * TRACE_BS / 1e6, 100 * lru_curve["hit_rate_tokens"], "o-", color="C0",
            label=f"LRU, blocks of {TRACE_BS} (section 2)")
    ax.axhline(100 * reuse_profile(trace, block_size)["ceiling_hit_rate_tokens"], color="k", ls="--", lw=1)
    ax.plot([blocks * block_size / 1e6], [100 * row["hit_rate_tokens"]], "D", color="C3", ms=9,
            label=f"{policy}, blocks of {block_size}")
    ax.set(xscale="log", xlabel="capacity (million tokens)", ylabel="prompt tokens from cache (%)",
           title=f"{policy}, {blocks:,} blocks of {block_size}: {100 * row['hit_rate_tokens']:.1f}% "
                 f"({row['wall_s']:.1f} s to replay)")
    ax.legend(fontsize=8)
    plt.show()


viz.explore(try_mooncake, capacity_share=(0.02, 0.5, 0.02), policy=POLICIES,
            block_size=[512, 256, 128, 64])

# %% [markdown]
# ## 4. Block size
#
# A block is shared only when it is full and its whole prefix matches, so sharing that ends in the middle
# of a block loses the partial block. Larger blocks lose more, which lowers the ceiling. The Mooncake ids
# are 512 tokens wide, so on that trace sharing always ends on a 512-token boundary (except at the end of a
# prompt) and the ceiling hardly moves with the block size; the synthetic workloads share prefixes of any
# length, so there the effect shows.

# %%
block_sizes = [16, 32, 64, 128, 256, 512]
frames = {"mooncake_conversation": trace, **synthetic_frames}
ceilings = pd.DataFrame({name: [100 * reuse_profile(frame, b)["ceiling_hit_rate_tokens"] for b in block_sizes]
                         for name, frame in frames.items()}, index=pd.Index(block_sizes, name="block size"))
fig, ax = plt.subplots(figsize=(8, 3.4))
for name in ceilings:
    ax.plot(block_sizes, ceilings[name], "o-", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(block_sizes, block_sizes)
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("infinite-cache ceiling (%)")
ax.set_title("sharing that ends mid-block is lost: the ceiling by block size", fontsize=10)
ax.legend(fontsize=8, loc="lower left")
plt.show()
ceilings.round(1)

# %% [markdown]
# Reading: the 512-aligned Mooncake ceiling does not move; the few-shot and chat workloads lose many points
# between blocks of 16 and 512, because their sharing ends at arbitrary token positions.
#
# At a fixed amount of memory, does the block size change what the cache achieves, and what does a small
# block cost? Every block is hashed, looked up and tracked. Below, each workload gets a quarter of its
# working set (in tokens, at block size 16), LRU; the right panel is the replay's wall time on this machine
# per million prompt tokens.

# %%
fixed = []
for name in ("synthetic_few_shot", "synthetic_chat", "mooncake_conversation"):
    frame = frames[name]
    budget = reuse_profile(frame, 16)["distinct_blocks"] * 16 // 4
    for b in block_sizes:
        row = replay(frame, block_size=b, capacity=max(1, budget // b), policy="lru", label=name)
        fixed.append({"trace": name, "block size": b, "hit rate (%)": 100 * row["hit_rate_tokens"],
                      "skipped": row["requests_skipped"],
                      "replay s per M prompt tokens": row["wall_s"] / (row["prompt_tokens"] / 1e6),
                      **{column: row[column] for column in DOCTOR_COLUMNS}})  # the causes, for below
fixed = pd.DataFrame(fixed)
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
for name, rows in fixed.groupby("trace", sort=False):
    left.plot(rows["block size"], rows["hit rate (%)"], "o-", label=name)
    right.plot(rows["block size"], rows["replay s per M prompt tokens"], "o-", label=name)
for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_xticks(block_sizes, block_sizes)
    ax.set_xlabel("block size (tokens)")
    ax.grid(alpha=0.3)
left.set(ylabel="prompt tokens from cache (%)", ylim=(0, None), title="a quarter of the working set, LRU")
right.set(yscale="log", ylabel="seconds per M prompt tokens", title="the bookkeeping: replay time (this CPU)")
left.legend(fontsize=8)
plt.show()
fixed.pivot(index="block size", columns="trace", values="hit rate (%)").round(1)

# %%
costs = fixed.pivot(index="block size", columns="trace", values="replay s per M prompt tokens")
cost = costs["mooncake_conversation"]
hit_by_size = fixed.pivot(index="block size", columns="trace", values="hit rate (%)")
viz.check(all(hit_by_size[name].iloc[0] > hit_by_size[name].iloc[-1]
              for name in ("synthetic_few_shot", "synthetic_chat"))
          and hit_by_size["mooncake_conversation"].iloc[0] <= hit_by_size["mooncake_conversation"].iloc[-1] + 0.1
          and all(costs[name].iloc[0] / costs[name].iloc[-1] < cost.iloc[0] / cost.iloc[-1]
                  for name in ("synthetic_few_shot", "synthetic_chat")),
          "small blocks should hit more on few-shot and chat, nothing more on Mooncake, and cost Mooncake's long "
          "prompts the most", defaults=(LIMIT, TRACE_BS) == (3000, 512))
print(f"Reading: where sharing ends anywhere (few-shot, chat), small blocks keep more of it in the same memory; on "
      f"the 512-aligned trace they buy nothing. The price is bookkeeping: from blocks of 512 to blocks of 16 the "
      f"replay time per prompt token grows {cost.iloc[0] / cost.iloc[-1]:.0f}x "
      f"on Mooncake's long prompts (32x as many blocks), less on the short synthetic prompts, where per-request "
      f"costs dominate. A GPU kernel pays a related price in block-table lookups; vLLM settles on 16.")

# %% [markdown]
# Where do the points go that larger blocks lose? The doctor's columns of the same replays, stacked by block
# size: the **partial block** band is the sharing that ends inside a block.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.6), layout="constrained")
for ax, name in zip(axes, ["synthetic_few_shot", "synthetic_chat"]):
    plot_miss_causes(fixed[fixed["trace"] == name], "block size", ax=ax)
    ax.set_title(f"{name.removeprefix('synthetic_')}: a quarter of the working set, LRU", fontsize=10)
axes[0].get_legend().remove()
plt.show()
fixed["partial block (%)"] = 100 * fixed["partial_block_tokens"] / fixed.filter(like="_tokens").sum(axis=1)
partial = fixed.pivot(index="block size", columns="trace", values="partial block (%)")
viz.check(partial["synthetic_few_shot"].is_monotonic_increasing and partial["synthetic_chat"].is_monotonic_increasing
          and (partial.loc[512, ["synthetic_few_shot", "synthetic_chat"]] > 20).all()
          and partial["mooncake_conversation"].max() < 0.1
          and all(fixed[fixed["trace"] == name]["cold_tokens"].is_monotonic_decreasing
                  and fixed[fixed["trace"] == name].set_index("block size")["hit_gpu_tokens"].diff().iloc[-1] < 0
                  for name in ("synthetic_few_shot", "synthetic_chat")),
          "partial blocks grow with the block size where sharing ends anywhere (past a fifth of the tokens at 512), "
          "and stay under 0.1% on the 512-aligned Mooncake trace; the cold band shrinks as they grow, and the last "
          "doubling takes hits too", defaults=True)
partial.round(2)

# %% [markdown]
# Reading: on few-shot and chat prompts the partial-block band grows with every doubling of the block, taking
# tokens from the cold band (a longer unit more often starts with a shared token) and, at the largest blocks,
# from the hits. That is vLLM #40696's 0% hit rate with a 528-token hybrid block, named: the prompts shared
# less than a block, so those tokens are partial blocks, not cold ones.
#
# ### A big block, matched at a finer unit
#
# A model may not get to choose a small block: a hybrid model's attention page is sized to its Mamba state's,
# which is how vLLM issue #40696 ended up with 528-token blocks and no hits below 528 tokens. Matching at a finer
# unit keeps the big block but stops losing the partial one: `BlockManager(..., prefix_match_unit=16)` (vLLM's
# `hash_block_size`) also finds a cached block whose first 16-token units continue the prompt, and admission
# copies that block into a new one (copy-on-write at admission: the `BlockCopies` that `allocate` returns) and
# computes from the first unit that differs.
#
# The same holds when the groups of one model have different block sizes, as a hybrid model's do once each
# group's page is sized to its own layers: `HybridBlockManager(..., group_block_sizes=[528, 16])` hashes every
# prompt once, at 16 tokens, and a 528-token block's hash is every 33rd of those (the chain hash of its last 16
# tokens names its whole prefix). With whole blocks a hit must be served by every group, so it comes in
# steps of 528, the sizes' least common multiple, which is where vLLM aligns a hybrid hit
# (`HybridKVCacheCoordinator` in `vllm/v1/core/kv_cache_coordinator.py`); matched at 16 tokens, the 528-token
# group copies the first units of a block it holds (or whose first units a prompt wrote) into a new one, and the
# hit comes in steps of 16.
#
# Below, this section's Mooncake requests, replayed with their real tokens one at a time through an LRU pool of
# 2^20 tokens (`kvlab.studies.sequential.unit_hit_rates`), by prompt length: 528-token blocks, the same blocks
# at a 16-token unit, 16-token blocks (the ceiling), then the hybrid model, a full-attention group of 528-token
# blocks and a 1,024-token sliding-window group of 16-token blocks (2^20 tokens in each group), with whole
# blocks and at a 16-token unit.

# %%
HYBRID = (528, 16)
units = unit_hit_rates("mooncake_conversation", limit=LIMIT,
                       configs=[(528, None), (528, 16), (16, None), (HYBRID, None), (HYBRID, 16)])
hybrid_whole, hybrid_unit = units["config"].unique()[3:]
by_unit = units[units["requests"] > 0].pivot(index="prompt_tokens", columns="config", values="hit_rate")
by_unit = by_unit.loc[[b for b in units["prompt_tokens"].unique() if b in by_unit.index], units["config"].unique()]
ax = by_unit.plot.bar(figsize=(9, 3.6), rot=0, color=["#bab0ac", "#f28e2b", "#4e79a7", "#d4a6c8", "#b07aa1"])
ax.set(xlabel="prompt tokens", ylabel="prompt tokens from cache (%)",
       title="Mooncake, LRU pool of 2^20 tokens: 528-token blocks matched at 16 tokens")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, axis="y")
plt.show()
viz.check(((by_unit["blocks of 528, unit 16"] >= 0.9 * by_unit["blocks of 16"])
           & (by_unit["blocks of 528, unit 16"] > 2 * by_unit["blocks of 528"])).all()
          and trace["hash_ids"].map(lambda ids: ids[0]).nunique() == 1,
          "a 16-token unit should bring 528-token blocks to within 10% of 16-token blocks' hit rate, and more than "
          "double the whole-block rate, in every length bucket; every prompt should open with the same 512 tokens",
          defaults=(LIMIT, TRACE_BS) == (3000, 512))
print(f"Reading: matched at 16 tokens, the 528-token blocks hit {by_unit['blocks of 528, unit 16'].iloc[0]:.1f}% of "
      f"the shortest prompts' tokens instead of {by_unit['blocks of 528'].iloc[0]:.1f}% (16-token blocks: "
      f"{by_unit['blocks of 16'].iloc[0]:.1f}%): the trace's shared 512-token opening never fills a 528-token "
      "block, but its 32 units match. The price is a copy of the partial block per hit, and a unit becomes "
      "findable only once the step that wrote it ran.")
viz.check(((by_unit[hybrid_unit] >= 0.9 * by_unit["blocks of 16"])
           & (by_unit[hybrid_unit] > 2 * by_unit[hybrid_whole])).all(),
          "the hybrid model's groups of 528 and 16 tokens, matched at 16 tokens, should hit within 10% of 16-token "
          "blocks and more than twice their whole-block rate in every length bucket",
          defaults=(LIMIT, TRACE_BS) == (3000, 512))
print(f"Reading: the hybrid model with whole blocks hits {by_unit[hybrid_whole].iloc[0]:.1f}% of the shortest "
      f"prompts' tokens (a hit must be a multiple of 528 in both groups), and {by_unit[hybrid_unit].iloc[0]:.1f}% "
      "matched at 16 tokens: hits no block size of 528 can give.")
by_unit.round(2)

# %% [markdown]
# ## 5. Requests that overlap in time
#
# So far the whole pool was cache. In a server, running requests hold their blocks (prompt and growing
# output) and only what is left caches. The overlap mode replays arrivals at the trace's timestamps through
# the serving engine's own scheduler (vLLM V1's, as `LLM` runs it: one budget of 8,192 tokens per step shared
# by decodes and prompt chunks, first come first served admission with `can_allocate`, preemption by
# recompute of the newest running request when no block is free) with a cost model in place of the model
# (`kvlab.studies.overlap`; its docstring lists every assumption: a fixed 20 ms step plus a prefill time
# proportional to the uncached tokens it computes).
#
# One assumption matters for hit rates: **generated tokens never hit**. The traces do not record output
# tokens, so the simulation gives them private ids: decode blocks take cache space but are never reused. A
# real engine can do better on multi-turn chat, where the next turn's prompt contains the previous reply:
# kvlab's block manager seals full decode blocks, and vLLM V1 caches them too, so that reply can hit. The hit
# rates below are therefore a floor for chat traffic.

# %%
overlap_capacities = capacities[1:-1]
model = EngineModel()
both = pd.concat([cache_hit_study("mooncake_conversation", block_sizes=[TRACE_BS], capacities=overlap_capacities,
                                  policies=["lru"], mode=mode, limit=LIMIT, engine=model, jobs=-1)
                  for mode in ("sequential", "overlap")])
fig, ax = plt.subplots(figsize=(8, 3.2))
for mode, rows in both.groupby("mode"):
    ax.plot(rows["capacity_blocks"], 100 * rows["hit_rate_tokens"], "o-", label=mode)
ax.set_xscale("log")
ticks = sorted(both["capacity_blocks"].unique())
ax.set_xticks(ticks, [f"{int(t):,}" for t in ticks])
ax.minorticks_off()
ax.set_xlabel(f"capacity (blocks of {TRACE_BS} tokens)")
ax.set_ylabel("prompt tokens from cache (%)")
ax.set_title("one request at a time vs requests overlapping in time (LRU)", fontsize=10)
ax.legend()
plt.show()
overlap = both[both["mode"] == "overlap"].set_index("capacity_blocks")
sequential = both[both["mode"] == "sequential"].set_index("capacity_blocks")
uncached = overlap["prompt_tokens"] * (1 - overlap["hit_rate_tokens"]) + overlap["recomputed_tokens"]
viz.check(((overlap["hit_rate_tokens"] - sequential["hit_rate_tokens"]).abs() < 0.01).all()
          and overlap["mean_batch"].iloc[1:].is_monotonic_decreasing
          and overlap["mean_queue_s"].idxmax() == overlap.index[0] and overlap["preemptions"].iloc[0] > 0,
          "the reading below says: the two modes hit within a point, the mean batch falls past the smallest pool, "
          "and the smallest pool queues and preempts most", defaults=(LIMIT, TRACE_BS) == (3000, 512))
pd.DataFrame({"hit rate, sequential (%)": 100 * sequential["hit_rate_tokens"],
              "hit rate, overlap (%)": 100 * overlap["hit_rate_tokens"],
              "prefill in the model (s)": uncached * model.prefill_ms_per_token / 1000,
              "mean batch": overlap["mean_batch"], "preemptions": overlap["preemptions"],
              "mean queueing (s)": overlap["mean_queue_s"]}).round(1).rename_axis("capacity (blocks)")

# %% [markdown]
# Reading: the two modes' hit rates barely differ, so here a small pool costs a server mostly queueing and
# preemptions (recomputation), not hits. Why does the **mean batch fall** as capacity grows past the
# smallest pools? Every request spends its output length in decode steps whatever the pool, so the sum over
# steps of the batch size is fixed, and the mean batch is that sum divided by the number of steps. A larger
# cache hits more, so less prefill is charged to each step (0.02 ms per uncached token in this model):
# steps get shorter, the trace's minutes hold more of them, and the same work spreads over more, smaller
# batches (Little's law: requests in service = arrival rate x time in service). In the smallest pool the
# batch is instead capped by memory, and requests queue.

# %% [markdown]
# ## 6. Your own policy, in a few lines
#
# A policy is the set of free blocks, in the order they will be reused. Subclass `EvictionPolicy` and
# implement five methods: `add(block, cached)` when a block becomes free, `remove(block)` when a prefix hit
# takes a free block back, `pop()` for the next victim, `__iter__` and `__len__`. (`on_hit` is optional.)
# Here is **random eviction**, the usual baseline, O(1) per call: free blocks that never held a prefix go
# first, then a uniformly random cached one.

# %%
class RandomPolicy(EvictionPolicy):
    def __init__(self, seed=0):
        self.uncached, self.cached, self.where = OrderedDict(), [], {}  # where: block -> index in cached
        self.rng = random.Random(seed)

    def add(self, block, cached):
        if cached:
            self.where[block] = len(self.cached)
            self.cached.append(block)
        else:
            self.uncached[block] = None

    def remove(self, block):
        if block not in self.where:
            del self.uncached[block]
            return
        i, last = self.where.pop(block), self.cached.pop()  # move the last block into the hole
        if last != block:
            self.cached[i], self.where[last] = last, i

    def pop(self):
        if self.uncached:
            return self.uncached.popitem(last=False)[0]
        block = self.cached[self.rng.randrange(len(self.cached))]
        self.remove(block)
        return block

    def __iter__(self):
        return iter([*self.uncached, *self.cached])

    def __len__(self):
        return len(self.uncached) + len(self.cached)


# %%
with_random = pd.concat([study, cache_hit_study("mooncake_conversation", block_sizes=[TRACE_BS], capacities=capacities,
                                                policies=[RandomPolicy], limit=LIMIT)])
plot_hit_rates(with_random)
plt.show()
rates = with_random[with_random["capacity_blocks"] != math.inf].pivot(index="capacity_blocks", columns="policy",
                                                                     values="hit_rate_tokens")
random_gap = rates["lru"] - rates["RandomPolicy"]
viz.check((random_gap > 0).all() and random_gap.idxmax() in rates.index[-2:],
          "random eviction should trail LRU at every capacity, most at the largest pools",
          defaults=(LIMIT, TRACE_BS) == (3000, 512))
(100 * rates[["RandomPolicy", *POLICIES]]).round(1).rename_axis("capacity (blocks)")

# %% [markdown]
# Reading: random eviction trails LRU at every capacity, most where the cache can almost hold the
# conversations between turns; any class works wherever a policy name does in the Python API (add it to
# `kvlab.blocks.eviction.POLICIES` to use it by name).
#
# > **In vLLM and SGLang.** vLLM V1 has one eviction order and no policy option: its free queue (chain tails
# > first, then least recently freed: `vllm/v1/core/kv_cache_utils.py`). SGLang's radix cache evicts least
# > recently used leaves (`python/sglang/srt/mem_cache/radix_cache.py`), and its scheduler can also *order the
# > waiting queue* to raise hits (longest prefix match first, the `--schedule-policy lpm` option), a lever this
# > notebook's FIFO replays do not pull. Both offload evicted blocks to CPU memory or storage in recent
# > versions (vLLM's KV connectors, SGLang's hierarchical cache), turning a miss into a copy instead of a
# > recomputation: Mooncake's own design, and the subject of notebook 14a.

# %% [markdown]
# ## 7. Coding agents: each request re-sends the last
#
# A coding agent's session is a loop: the agent sends its whole conversation, the model answers (a tool call),
# the tool's output is appended, and the next request sends it all again. So each request's prompt starts with
# the previous one, and a prefix cache that kept only the session's last request would already hit most of it.
# kvlab bundles 40 sessions of the public coding-agent traces of `callanjfox/kv-cache-tester` (Apache-2.0, WEKA's
# Claude Code sessions: `load_trace("agentic_coding")`, 64-token hash ids). Below, per session, the share of
# full blocks that the session's previous request already held (`kvlab.studies.reuse.consecutive_hit_rates`),
# against the figure the traces' README publishes over all 739 sessions (median 96%, mean 93%;
# `kvlab validate` keeps the two side by side, and `docs/studies.md` says why they differ).

# %%
from kvlab.studies.reuse import consecutive_hit_rates

agentic = load_trace("agentic_coding")
sessions = consecutive_hit_rates(agentic, 64).xs("main", level="agent")  # sub-agents are streams of their own
rates = 100 * sessions.hit_rate_blocks
PUBLISHED_MEDIAN, PUBLISHED_MEAN = 96.0, 93.0  # kv-cache-tester README, "Conversation-only (no warm prefix)"
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.hist(rates, bins=np.arange(70, 101, 2), color="#4e79a7", alpha=0.8, label=f"kvlab, {len(rates)} bundled sessions")
for value, style, label in ((rates.median(), "-", "kvlab median"), (rates.mean(), ":", "kvlab mean"),
                            (PUBLISHED_MEDIAN, "-", "published median (739 sessions)"),
                            (PUBLISHED_MEAN, ":", "published mean")):
    ax.axvline(value, ls=style, color="black" if label.startswith("kvlab") else "#e15759", label=f"{label}: {value:.1f}%")
ax.set(xlabel="blocks the session's previous request already held (%)", ylabel="sessions",
       title="coding-agent sessions: consecutive-request hit rate (64-token blocks)")
ax.legend(fontsize=7, loc="upper left")
ax.grid(alpha=0.3)
plt.show()
print(f"{len(agentic):,} requests in {len(rates)} sessions; per session: median {rates.median():.1f}%, mean "
      f"{rates.mean():.1f}%, lowest {rates.min():.1f}% (published: median {PUBLISHED_MEDIAN:.0f}%, "
      f"mean {PUBLISHED_MEAN:.0f}%)")
viz.check(abs(rates.median() - PUBLISHED_MEDIAN) < 2.5 and abs(rates.mean() - PUBLISHED_MEAN) < 1.5,
          "the bundled sessions' median and mean sit near the published ones", defaults=True)
viz.check((rates > 90).mean() > 0.5 and rates.min() > 2 * 100 * profile["ceiling_hit_rate_tokens"],
          "in most sessions over 90% of the blocks were in the previous request, and even the lowest session is "
          "over twice the trace's ceiling of section 1", defaults=(LIMIT, TRACE_BS) == (3000, 512))

# %% [markdown]
# In most sessions over nine blocks in ten were already in the session's previous request, and even the lowest
# session is over twice the infinite-cache ceiling of section 1's trace: for an agent, what decides the hit rate
# is whether the previous request's blocks are still cached when the next one arrives, after the tool has run
# (the traces record those think times). Notebook 14a's second tier is the answer when they are not: `kvlab validate --full` measures how
# large a CPU tier behind a GPU pool brings this subset to 95% of its ceiling.

# %% [markdown]
# ## Takeaways
#
# * The trace sets the ceiling: a cache that never evicts serves a fixed share of prompt tokens, and most
#   distinct blocks are never used twice.
# * Capacity matters most; recency suits conversational reuse once the cache can hold conversations between
#   turns, frequency helps when a fixed set of prefixes stays popular (few-shot) and falls behind on chats.
# * Every miss has a cause (the doctor's columns): on Mooncake most misses are cold at every capacity, and
#   capacity only moves tokens between evicted and hit, losing those reused furthest apart.
# * Sharing that ends mid-block is lost (the partial-block band), so small blocks help where prefixes end
#   anywhere, at a bookkeeping cost per block.
# * In a running server, active requests compete with the cache for the same blocks, and better hits make
#   steps shorter; the simulation's hit rates are a floor where replies are reused.
# * A coding agent re-sends its conversation every turn: most of each prompt is the previous one, so keeping a
#   session's last request cached (through the tool's think time) is most of the game.
