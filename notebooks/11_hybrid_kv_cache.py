# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
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
import pandas as pd

from kvlab import Sequence, viz
from kvlab.course import answer
from kvlab.blocks.manager import HybridBlockManager
from kvlab.blocks.kv_cache_groups import FullAttentionSpec, SlidingWindowSpec
from kvlab.blocks.events import BlockStored, CachedHashes
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
CAPTION = ("Numbers are physical page ids in the one pool both groups share; null: the window group released "
           "that page.")


def draw_groups(manager, seq, ax, title, width, window_end=None, hits=0):
    """One row per group: each logical page's physical page id (grey "null" where the window released it), on an
    x axis of ``width`` pages shared by all panels. ``window_end``: bracket the keys the query at position
    ``window_end - 1`` sees. ``hits``: leading pages served by the prefix cache, drawn with a black edge."""
    for row, (name, table) in enumerate(zip(NAMES, manager.block_tables(seq))):
        for col, block in enumerate(table):
            ax.add_patch(plt.Rectangle((col, -row), 0.9, 0.8, facecolor="#cccccc" if block == 0 else f"C{row}",
                                       edgecolor="k" if col < hits else "none", linewidth=2))
            ax.text(col + 0.45, -row + 0.4, "null" if block == 0 else block, ha="center", va="center", fontsize=8)
        ax.text(-0.2, -row + 0.4, name, ha="right", va="center")
    if window_end is not None:  # token t sits in page t // BS: x = t / BS in page units
        lo, hi = max(0, window_end - WINDOW) / BS, window_end / BS - 0.1
        ax.add_patch(plt.Rectangle((lo, -1.1), hi - lo, 2.05, facecolor="none", edgecolor="C3", linestyle="--"))
        ax.text(hi, 1.0, f"the last query's window ({WINDOW} keys)", color="C3", ha="right", va="bottom",
                fontsize=8)
    ax.set_xlim(-2.5, width + 0.5)
    ax.set_ylim(-1.2, 1.4)
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)



# %% [markdown]
# ## 1. A sequence grows past the window
#
# Blocks of 4 tokens, a window of 8. After the prompt both groups hold every page. Each decode step's query
# at position q sees keys q-7..q (the dashed bracket), so a page wholly before q-7 is released in the window
# group: its table entry becomes the **null block** 0 and the page goes back to the pool (still cached, as in
# vLLM). The full group keeps everything.

# %%
manager = HybridBlockManager(32, BS, groups=GROUPS)
seq = Sequence(list(range(PROMPT)), BS)
manager.allocate(seq)
steps = [0, 2, 6, 10]
width = -(-(PROMPT + max(steps)) // BS)  # the longest table: one x range for every panel
fig, axes = plt.subplots(len(steps), 1, figsize=(7, 1.5 * len(steps)))
done = 0
for ax, upto in zip(axes, steps):
    while done < upto:
        seq.append_token(100 + done)
        manager.append_slots(seq)
        done += 1
    draw_groups(manager, seq, ax, f"{PROMPT + done} tokens, {manager.num_free_blocks} free pages", width,
                window_end=PROMPT + done)
fig.text(0.5, 0.005, CAPTION, ha="center", fontsize=8)
plt.tight_layout(rect=(0, 0.03, 1, 1))
plt.show()
manager.check_invariants()
full, window = manager.block_tables(seq)
last_query = PROMPT + done - 1
released = max(0, last_query - WINDOW + 1) // BS
viz.check(window[:released] == [0] * released and 0 not in window[released:] and 0 not in full,
          f"the window group released exactly the {released} pages before position {last_query - WINDOW + 1}",
          defaults=DEFAULTS)

# %% [markdown]
# ### Exercise: how many pages go to null?
#
# Same prompt and the same 10 decoded tokens, but other windows. Predict how many leading entries of the window
# group's table are null after the last step with `WINDOW = 4`, and with `WINDOW = 64`. Edit the two values,
# then run the cell: it replays the sequence with each window and grades your answer.

# %%
PREDICTED_NULL_W4 = None    # null entries in the window group's table with a 4-token window
PREDICTED_NULL_W64 = None   # ... with a 64-token window


def null_pages(window):
    """Replay section 1's sequence with a ``window``-token window group; count its table's null entries."""
    replay = HybridBlockManager(32, BS, groups=[FullAttentionSpec(), SlidingWindowSpec(window)])
    grown = Sequence(list(range(PROMPT)), BS)
    replay.allocate(grown)
    for token in range(max(steps)):
        grown.append_token(100 + token)
        replay.append_slots(grown)
    return replay.block_tables(grown)[1].count(0)


answer(PREDICTED_NULL_W4, null_pages(4), f"The last query is at position {last_query}; it sees keys from "
       f"{last_query - 3} on, so the pages wholly before that go: ({last_query} - 4 + 1) // {BS}.")
answer(PREDICTED_NULL_W64, null_pages(64), f"The window is longer than the whole sequence ({last_query + 1} "
       "tokens): every key stays visible, and the two tables look alike.")
viz.check((last_query, null_pages(4), null_pages(64)) == (19, 4, 0), "the answer below says: the last query at 19, "
          "4 null pages for W = 4 and none for W = 64", defaults=DEFAULTS)

# %% [markdown]
# **Answer.** With the defaults (`BS = 4`, `PROMPT = 10`), 4 and 0. The window group releases the pages wholly
# before `q - W + 1`, where q = 19 is the last query: `(19 - 4 + 1) // 4 = 4` pages for W = 4, and none for
# W = 64, where nothing has left the window yet.
#
# ## 2. A prefix hit every group can serve
#
# A new request asks each group for its longest cached prefix; the hit is the **shortest** of those, since
# every layer needs its K/V for the hit tokens. Below, a first turn (a 12-token prompt, 8 tokens decoded)
# finishes, and a second turn repeats the whole conversation and adds 2 tokens. The full group's pages stay
# cached; the window group released its early pages to the pool, where they stay cached until reused. We run
# it twice: straight away, and after a burst of other requests that takes free pages until the window
# group's page 0 is evicted, and nothing more. A router-style index (`CachedHashes`, notebook 12) follows the
# KV events to tell which of the first turn's pages each group still caches.

# %%
TURN = 3 * BS        # the first turn's prompt: its window releases page 0 one step before page 1
DECODED = 2 * BS     # tokens the first turn generates


def second_turn(burst):
    """Run the first turn, then (``burst``) other requests until the window group's page 0 is evicted, then the
    second turn. Returns (manager, second turn allocated, whether each of the first turn's pages is still
    cached, per group, when the second turn arrives)."""
    hybrid = HybridBlockManager(24, BS, groups=GROUPS, kv_events=True)
    index, log = CachedHashes(), hybrid.kv_events.subscribe()
    hybrid.kv_events.subscribe(index)
    first = Sequence(list(range(TURN)), BS)
    hybrid.allocate(first)
    for token in range(DECODED):
        first.append_token(100 + token)
        hybrid.append_slots(first)
    pages = [[], []]  # each group's page hashes, page after page (a group stores its pages in order)
    for event in log:
        if isinstance(event, BlockStored):
            pages[event.group_idx].extend(event.block_hashes)
    hybrid.free(first)
    others = []
    while burst and pages[1][0] in index.groups[1]:  # one page per group each, until window page 0 is reused
        start = 1000 * (len(others) + 1)
        others.append(Sequence(list(range(start, start + BS)), BS))
        hybrid.allocate(others[-1])
    for other in others:
        hybrid.free(other)
    cached = [[h in index.groups[g] for h in pages[g]] for g in range(len(GROUPS))]
    second = Sequence(first.token_ids + [500, 501], BS)
    hybrid.allocate(second)
    hybrid.check_invariants()
    return hybrid, second, cached


def vllm_hit_pages(cached, limit, need=-(-(WINDOW - 1) // BS)):
    """vLLM's common hit, in pages, for a full and a window group (``cached[g][i]``: page i cached in group g),
    at most ``limit`` pages: the full group's cached prefix; then, up to there, the window group scans right to
    left for ``need`` contiguous cached pages (``sliding_window_contiguous_blocks``) and the hit ends with them;
    with no such run, the window group's cached pages from page 0 on."""
    full = next((i for i, c in enumerate(cached[0][:limit]) if not c), min(limit, len(cached[0])))
    run = 0
    for i in range(full - 1, -1, -1):
        run = run + 1 if cached[1][i] else 0
        if run >= need:
            return i + run
    return run  # the scan reached page 0: run counts the cached pages from page 0 on


fig, axes = plt.subplots(2, 1, figsize=(7, 3.4))
hits = {}
for ax, burst in zip(axes, [False, True]):
    hybrid, second, cached = second_turn(burst)
    limit = (second.num_tokens - 1) // BS  # both keep the last prompt token to compute
    kvlab_hit, vllm_hit = second.num_cached_tokens, vllm_hit_pages(cached, limit) * BS
    hits[burst] = kvlab_hit, vllm_hit, cached
    when = "after a burst that evicted window page 0" if burst else "straight after the first turn"
    print(f"{when}: first turn's pages still cached: full {cached[0]}, window {cached[1]}; "
          f"kvlab hits {kvlab_hit} tokens, vLLM's rule would hit {vllm_hit}")
    draw_groups(hybrid, second, ax, f"second turn, {when}: kvlab hits {kvlab_hit} tokens (vLLM's rule: "
                f"{vllm_hit})", -(-second.num_tokens // BS), hits=kvlab_hit // BS)
fig.text(0.5, 0.005, CAPTION + "\nBlack edge: a page the prefix cache served (a null one proved the chain; no "
         "query sees it, so it is not held).", ha="center", fontsize=8)
plt.tight_layout(rect=(0, 0.07, 1, 1))
plt.show()
(kvlab_before, vllm_before, _), (kvlab_after, vllm_after, cached_after) = hits[False], hits[True]
viz.check(cached_after[0] == [True] * len(cached_after[0]) and cached_after[1][0] is False
          and all(cached_after[1][1:]), "the burst should evict the window group's page 0 and nothing else",
          defaults=DEFAULTS)
viz.check(kvlab_before == vllm_before > kvlab_after and vllm_after == vllm_before,
          "evicting window page 0 should cut kvlab's hit to nothing and leave vLLM's rule's hit whole",
          defaults=DEFAULTS)
viz.check((kvlab_before, kvlab_after, -(-(WINDOW - 1) // BS)) == (20, 0, 2), "the text below says: 20 tokens hit "
          "before the burst, 0 after, and vLLM's window rule looks for 2 contiguous pages", defaults=DEFAULTS)

# %% [markdown]
# Before the burst both rules hit the whole conversation (5 pages, 20 tokens; the last prompt token is always
# computed). The burst evicted one page, the window group's page 0, which no query of the second turn can
# see. kvlab's lookup verifies every hit from page 0, so the window group serves nothing and the common hit
# falls to 0 tokens: the second turn recomputes everything although the full group, and the window group's
# pages under the window, are still cached. vLLM needs only the pages under the window, and hits all 20.
#
# > **In vLLM.** `KVCacheGroupSpec` (`vllm/v1/kv_cache_interface.py`) names a group's layers and its spec
# > (`FullAttentionSpec`, `SlidingWindowSpec`, ...); `HybridKVCacheCoordinator`
# > (`vllm/v1/core/kv_cache_coordinator.py`) runs one manager per group (`FullAttentionManager`,
# > `SlidingWindowManager` in `vllm/v1/core/single_type_kv_cache_manager.py`) and finds the common hit with
# > `find_longest_cache_hit`, iterating until the groups agree. Released window pages become the null block,
# > as here. **Where kvlab differs:** `SlidingWindowManager.find_longest_cache_hit` scans right to left and
# > stops at the first run of `sliding_window_contiguous_blocks = cdiv(sliding_window - 1, block_size)`
# > cached pages (2 here; one more with EAGLE), the keys the first computed token's window reaches; with no
# > such run it keeps the cached pages from page 0 on. `vllm_hit_pages` above applies that rule to the pages
# > the events say are cached. kvlab verifies every hit from page 0 (see `kvlab/blocks/manager.py`), so
# > a window group whose early pages were evicted serves no hit, where vLLM still hits as long as the pages
# > under the window survive. vLLM's hit shrinks only to the last 2 neighbouring pages the window group still
# > caches: with a 16-token second prompt (a 3-page hit at most) and a burst that took pages 0-2, it would
# > find nothing too. Gemma 3 (4B and up) uses `sliding_window=1024` with every 6th layer global
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
full_pages = summary.loc[hybrid_memory.ALL_FULL.name, "mean_mean"]
window_share = {}  # a window layer's mean pages over a full layer's, per mix
for mix in [hybrid_memory.GEMMA3_LIKE, hybrid_memory.GPT_OSS_LIKE]:
    layers = mix.sliding + mix.full
    # mean_mean = (full * full_pages + sliding * window_pages) / layers: solve for a window layer's pages
    window_pages = (layers * summary.loc[mix.name, "mean_mean"] - mix.full * full_pages) / mix.sliding
    share = mix.full / layers + mix.sliding / layers * window_pages / full_pages
    print(f"{mix.name}: {mix.full}/{layers} full layers x 1 + {mix.sliding}/{layers} window layers x "
          f"({window_pages:.1f} / {full_pages:.1f} pages) = {mix.full / layers:.3f} + "
          f"{mix.sliding / layers * window_pages / full_pages:.3f} = {share:.3f} of all-full")
    viz.check(abs(share - summary.loc[mix.name, "mean_mean_vs_full"]) < 1e-9, "the sum should give the table's "
              "ratio", defaults=True)
    window_share[mix.name] = window_pages / full_pages
viz.check(800 < full_pages < 850 and 64 < window_share[hybrid_memory.GEMMA3_LIKE.name] * full_pages < 75
          and window_share[hybrid_memory.GEMMA3_LIKE.name] < 0.1 and round(gemma, 3) == 0.239
          and 1 / 60 < window_share[hybrid_memory.GPT_OSS_LIKE.name] < 1 / 40 and round(gpt_oss, 2) == 0.51,
          "the paragraph below says: about 820 pages per full layer, about 71 per Gemma-like window layer (under a "
          "tenth), 0.239 of all-full for 5:1, and about 1/50 per window layer and 0.51 for 1:1", defaults=DEFAULTS)

# %% [markdown]
# The full layers dominate. A mean request here holds about 820 pages per full layer; a window layer holds its
# window, W / 16 = 64 pages for W = 1024, plus the part of a prefill chunk past it, about 71 pages on average,
# under a tenth of a full layer. So a 5:1 mix keeps 1/6 (its full layer) plus 5/6 of that tenth: 0.167 + 0.072
# = 0.239 of the all-full memory, well above 1/6 because a window layer is not free. A 1:1 mix with W = 128
# keeps 1/2 + 1/2 x about 1/50 = 0.51. The **peak** depends on chunking: a prompt prefilled in one step needs
# every page in every layer for that step.
#
# ### Exercise: a window layer's peak
#
# One request with a 10,000-token prompt, blocks of 16 tokens, a Gemma-3-like window of 1,024. How many pages
# does a window layer hold at its peak when the prompt is prefilled in chunks of 2,048 tokens, and when it is
# prefilled in one step (`CHUNK = None`)? Edit the two values and run the cell; it counts with
# `hybrid_memory.pages_held`, the closed form behind the table above.

# %%
PREDICTED_PEAK_CHUNKED = None    # pages per window layer at the peak, chunks of 2,048
PREDICTED_PEAK_ONE_STEP = None   # ... the whole prompt in one step


def window_peak(prompt, chunk, block_size=16, window=1024, output=10):
    """A window layer's most pages over a request's steps (its prompt chunks, then ``output`` decode steps)."""
    starts, ends = hybrid_memory.step_bounds(prompt, output, chunk)
    return int(hybrid_memory.pages_held(starts, ends, block_size, window).max())


answer(PREDICTED_PEAK_CHUNKED, window_peak(10_000, 2048), "A chunk's queries see the chunk and the 1,023 keys "
       "before it: about (2,048 + 1,024) / 16 pages, whatever the prompt's length.")
answer(PREDICTED_PEAK_ONE_STEP, window_peak(10_000, None), "In one step the first query still needs page 0 "
       "while the last one writes the last page: every page of the prompt, 10,000 / 16 rounded up.")
viz.check((window_peak(10_000, 2048), window_peak(10_000, None)) == (192, 625), "the answer below says 192 and 625 "
          "pages", defaults=True)

# %% [markdown]
# **Answer.** 192 and 625 pages. In chunks of 2,048 the step that computes tokens 2,048-4,095 holds pages
# 64-255 (keys from 2,048 - 1,023 on): 192 pages, and later chunks hold no more; in one step a window layer
# holds all 625 pages of the prompt, as a full layer does. That is why `mean_peak_vs_full` with `CHUNK = None`
# is much closer to 1 than with chunking (run the notebook with `CHUNK = None` to see the table move), while
# the mean barely changes: the decode steps, which are most of a request's steps, hold the window either way.

# %%
_, one_step = hybrid_memory.run(limit=LIMIT, block_size=16, chunk=None)
chunking = pd.DataFrame({f"chunks of {CHUNK}": summary["mean_peak_vs_full"],
                         "one step": one_step["mean_peak_vs_full"],
                         f"mean, chunks of {CHUNK}": summary["mean_mean_vs_full"],
                         "mean, one step": one_step["mean_mean_vs_full"]}).drop(hybrid_memory.ALL_FULL.name)
mean_moved = (chunking["mean, one step"] - chunking[f"mean, chunks of {CHUNK}"]).abs()
viz.check(CHUNK is None or ((chunking["one step"] > 0.9).all() and (chunking[f"chunks of {CHUNK}"] < 0.6).all()
                            and (mean_moved < 0.02).all()),
          "prefilling in one step should bring the peak close to all-full and move the mean by under 0.02",
          defaults=DEFAULTS)
print("mean_peak_vs_full and mean_mean_vs_full, chunked against one step:")
chunking.round(3)

# %% [markdown]
# ## Takeaways
#
# * A hybrid model gives each kind of layer a KV cache group with its own block table; a window group releases
#   the pages no query can see any more (to the null block), and the full group keeps every page.
# * A prefix hit must be served by every group, so it is the shortest of the groups' hits. kvlab verifies every
#   hit from page 0, so evicting one early window page can cost the whole hit; vLLM's window rule needs only
#   the pages under the window.
# * On the Mooncake conversation trace, a 5:1 window mix keeps about a quarter of the all-full memory on average,
#   and a 1:1 mix with a short window about half: the full layers dominate. The peak falls only with chunked
#   prefill; a prompt prefilled in one step holds every page in every layer for that step.
