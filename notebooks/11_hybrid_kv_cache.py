# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---
# %% [markdown]
# # 11 · Hybrid KV cache: full and sliding-window layers
#
# Some models mix layer kinds. Gemma 3 has five **sliding-window** (local) layers to one **full-attention**
# (global) layer; gpt-oss alternates windowed and full layers. A window layer's query sees only the last W
# keys, so its K/V for older tokens can be dropped. The hybrid allocator (`HybridBlockManager`) gives each
# kind of layer a **KV cache group** with its own block table per sequence, all drawing equal-size pages
# from one pool. This notebook draws those tables as a sequence grows past the window, shows a prefix hit
# cut back to what every group can serve, and measures the memory saved over the Mooncake conversation trace.

# %%
# Setup (generated from scripts/sync_notebooks.py: edit it there, then `make notebooks`). In a checkout, or in
# CI, this uses the checkout's kvlab. On Colab it clones the repository (code and bundled traces) and installs
# kvlab's missing dependencies; Colab's torch and Triton are kept as they are. `%matplotlib inline` keeps
# figures in the notebook however it runs (Jupyter, Colab, nbconvert with MPLBACKEND=Agg).
# %matplotlib inline
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# The repository to clone when kvlab is not installed: for a fork, change it here or set $KVLAB_REPO.
KVLAB_REPO = os.environ.get("KVLAB_REPO", "https://github.com/kvlab/kvlab")
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
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(checkout)])
    sys.path.insert(0, str(checkout))

# %%
import matplotlib.pyplot as plt
import numpy as np

from kvlab import Sequence, viz
from kvlab.blocks.hybrid_manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.studies import hybrid_memory

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BS = 4          # tokens per page
WINDOW = 8      # the window layers' W, in tokens
PROMPT = 10     # prompt length of section 1
LIMIT = 2000    # Mooncake requests in section 3 (12031 in all; the whole trace takes a few seconds)
CHUNK = 2048    # section 3's prefill chunk (None: every prompt in one step)

DEFAULTS = (BS, WINDOW, PROMPT, LIMIT, CHUNK) == (4, 8, 10, 2000, 2048)
GROUPS = [FullAttentionSpec(), SlidingWindowSpec(WINDOW)]
NAMES = ["full", f"window {WINDOW}"]


def draw_groups(manager, seq, ax, title):
    """One row per group: each logical page's physical block; grey 0 where the window released it."""
    tables = manager.block_tables(seq)
    width = max(len(t) for t in tables)
    for row, (name, table) in enumerate(zip(NAMES, tables)):
        for col, block in enumerate(table):
            ax.add_patch(plt.Rectangle((col, -row), 0.9, 0.8, color="#cccccc" if block == 0 else f"C{row}"))
            ax.text(col + 0.45, -row + 0.4, "null" if block == 0 else block, ha="center", va="center", fontsize=8)
        ax.text(-0.2, -row + 0.4, name, ha="right", va="center")
    ax.set_xlim(-2.5, width + 0.5)
    ax.set_ylim(-len(tables) + 0.5, 1.2)
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)


# %% [markdown]
# ## 1. A sequence grows past the window
#
# Blocks of 4 tokens, a window of 8. After the prompt both groups hold every page. Each decode step's query
# at position q sees keys q-7..q, so a page wholly before q-7 is released in the window group: its table
# entry becomes the **null block** 0 and the page goes back to the pool (still cached, as in vLLM). The full
# group keeps everything.

# %%
manager = HybridBlockManager(32, BS, groups=GROUPS)
seq = Sequence(list(range(PROMPT)), BS)
manager.allocate(seq)
steps = [0, 2, 6, 10]
fig, axes = plt.subplots(len(steps), 1, figsize=(7, 1.3 * len(steps)))
done = 0
for ax, upto in zip(axes, steps):
    while done < upto:
        seq.append_token(100 + done)
        manager.append_slots(seq)
        done += 1
    draw_groups(manager, seq, ax, f"{PROMPT + done} tokens, {manager.num_free_blocks} free pages")
plt.tight_layout()
plt.show()
manager.check_invariants()
full, window = manager.block_tables(seq)
last_query = PROMPT + done - 1
released = max(0, last_query - WINDOW + 1) // BS
viz.check(window[:released] == [0] * released and 0 not in window[released:] and 0 not in full,
          f"the window group released exactly the {released} pages before position {last_query - WINDOW + 1}",
          defaults=DEFAULTS)

# %% [markdown]
# **Try it:** set `WINDOW = 4` (more pages go to null) or `WINDOW = 64` (nothing leaves the window: the two
# tables look alike).
#
# ## 2. A prefix hit every group can serve
#
# A new request with the same prompt asks each group for its longest cached prefix; the hit is the **shortest**
# of those, since every layer needs its K/V for the hit tokens. The full group still holds all of the first
# sequence's pages. The window group released its early pages to the pool, where they stay cached until
# reused; below, a burst of other requests evicts them, and the hit shrinks to nothing although the full group
# could serve it all.

# %%
manager = HybridBlockManager(24, BS, groups=GROUPS)
first = Sequence(list(range(PROMPT + 6)), BS)
manager.allocate(first)
for token in range(6):  # decode 6 tokens: the window group releases the pages before position 15 - 7
    first.append_token(100 + token)
    manager.append_slots(first)
print("tables of the first request:", manager.block_tables(first))
again = Sequence(list(range(PROMPT + 6)), BS)
hit_before = manager.get_num_cached_tokens(again)
others = []
while manager.num_free_blocks >= len(GROUPS):  # one page per group each, until every free page is reused
    others.append(Sequence(list(range(1000 * len(others) + 1000, 1000 * len(others) + 1000 + BS)), BS))
    manager.allocate(others[-1])
for other in others:
    manager.free(other)
hit_after = manager.get_num_cached_tokens(again)
print(f"hit before the burst: {hit_before} tokens; after: {hit_after} tokens")
manager.allocate(again)
fig, ax = plt.subplots(figsize=(7, 1.4))
draw_groups(manager, again, ax, f"the second request after the burst: a {hit_after}-token hit")
plt.show()
manager.check_invariants()
viz.check(hit_before > hit_after, "evicting the window group's released page shortens the common hit",
          defaults=DEFAULTS)

# %% [markdown]
# > **In vLLM.** `KVCacheGroupSpec` (`vllm/v1/kv_cache_interface.py`) names a group's layers and its spec
# > (`FullAttentionSpec`, `SlidingWindowSpec`, ...); `HybridKVCacheCoordinator`
# > (`vllm/v1/core/kv_cache_coordinator.py`) runs one manager per group (`FullAttentionManager`,
# > `SlidingWindowManager` in `vllm/v1/core/single_type_kv_cache_manager.py`) and finds the common hit with
# > `find_longest_cache_hit`, iterating until the groups agree. Released window pages become the null block,
# > as here. **Where kvlab differs:** vLLM's `SlidingWindowManager` scans right to left and needs only the
# > pages under the window before the hit point to be cached, so it would still hit above; kvlab verifies every
# > hit from page 0 (see `kvlab/blocks/hybrid_manager.py`), so a window group whose early pages were evicted
# > serves no hit. Gemma 3 (4B and up) uses `sliding_window=1024` with every 6th layer global
# > (`sliding_window_pattern=6`; the 1B model uses 512); gpt-oss uses 128-token windows.
#
# ## 3. Memory over the Mooncake conversation trace
#
# `kvlab.studies.hybrid_memory` counts **pages per layer, averaged over the model's layers** that a request
# holds after each of its steps (prefill chunks of `CHUNK` tokens, then one step per output token), by closed
# forms checked step by step against `HybridBlockManager`. For a 5:1 mix that is
# `(1 * full_pages + 5 * window_pages) / 6`; all layers full is the baseline.

# %%
footprints, summary = hybrid_memory.run(limit=LIMIT, block_size=16, chunk=CHUNK)
print(summary.round(3).to_string())
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, stat in zip(axes, ["peak", "mean"]):
    hybrid_memory.plot(footprints, ax, stat)
plt.tight_layout()
plt.show()
gemma = summary.loc[hybrid_memory.GEMMA3_LIKE.name, "mean_mean_vs_full"]
gpt_oss = summary.loc[hybrid_memory.GPT_OSS_LIKE.name, "mean_mean_vs_full"]
viz.check(gemma < gpt_oss < 0.6, f"on long conversation prompts, 5:1 keeps least ({gemma:.2f} of all-full) and "
          f"1:1 about half ({gpt_oss:.2f})", defaults=DEFAULTS)

# %% [markdown]
# The full layers dominate: with prompts of thousands of tokens a window layer holds about W / 16 pages, so a
# 5:1 mix keeps a little over 1/6 of the all-full memory and a 1:1 mix a little over 1/2. The **peak** depends
# on chunking: a prompt prefilled in one step needs every page in every layer for that step.
#
# **Try it:** set `CHUNK = None` and compare the peak columns with the mean ones.
