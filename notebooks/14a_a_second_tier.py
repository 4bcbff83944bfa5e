# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 14a · A second tier: a CPU cache behind the GPU pool
#
# A GPU pool holds a few hundred thousand tokens of KV. When the pool must reuse a cached block, the prefix it
# held is lost, unless it is first copied to a **second tier**: the server's CPU memory, or further out a local
# disk or a pooled store. A later request that misses on the GPU but hits the tier gets the block
# copied back instead of recomputed. vLLM V1's native KV offloading (`vllm/v1/kv_offload/`), SGLang's
# HiCache, LMCache and Mooncake's store all do this; kvlab's block manager does it with
# `BlockManager(..., num_offload_blocks=N)`. This notebook is about the mechanics and the hits; notebook 14b
# asks what a tier hit is worth, how to read a hit rate, and two more levers on the hits.
#
# **Prerequisites.** Notebook 02 (prefix caching: hashes, warm blocks, eviction) and 08 (the Mooncake trace
# and its infinite-cache ceiling).
#
# **Objectives.** After this notebook you can:
# 1. follow a block through both tiers: a GPU eviction that *offloads* it, a lookup that *promotes* it back,
#    and the copies (`allocate(...).tier_moves`) an engine applies before the forward pass;
# 2. read per-tier hit rates (GPU hit, tier hit, miss) on the Mooncake conversation trace as the tier grows,
#    for LRU, ARC and a reuse filter, and say why the filter helps a small tier and hurts a large one.

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
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrow, Patch, Rectangle

from kvlab import BlockManager, Sequence, viz
from kvlab.blocks.records import TierHitStats
from kvlab.course import answer
from kvlab.course.tiers import replay_through_tier, tier_hit_runs
from kvlab.sizing.hf_config import read_model_shape
from kvlab.studies import reuse_profile
from kvlab.studies.traces import load_trace, mooncake_token_ids
from kvlab.viz.snapshot import CPU_COLOR, FREE, STATE_COLORS, USED, WARM

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BS = 4                      # section 1's block size (tokens per block)
TIER_SLOTS = 4              # section 1's CPU tier, in blocks (its GPU pool has 4)
LIMIT = 3000                # section 2: Mooncake requests to replay (of 12,031; None: all, about 4x as long)
TRACE_BS = 512              # Mooncake's natural block size: one trace id per 512 tokens
MODEL = "Meta-Llama-3-8B"   # whose KV bytes size the pool (tests/sizing/configs)
GPU_KV_GIB = 48             # GPU memory for KV: Llama-3-8B's 16 GB of weights on an 80 GB card leave about this

DEFAULTS = (BS, TIER_SLOTS, LIMIT, TRACE_BS, MODEL, GPU_KV_GIB) == (4, 4, 3000, 512, "Meta-Llama-3-8B", 48)
CONFIGS = Path("..") / "tests" / "sizing" / "configs"   # published config.json files (see its README)
OFFLOAD, PROMOTE = "#e15759", "#59a14f"                 # arrow colours: GPU -> CPU, CPU -> GPU

# %% [markdown]
# ## 1. Two tiers, block by block
#
# A GPU pool of 4 blocks of `BS` tokens with a CPU tier of `TIER_SLOTS` blocks behind it. Five requests run
# one after the other (each allocated, then freed, so its full blocks stay cached, "warm"):
#
# * **A**: a system prompt of two blocks plus a question;
# * **B**: an unrelated prompt that needs the whole pool, so the pool reuses A's two cached blocks. Without a
#   tier they would be lost; here they are **offloaded** (copied GPU -> CPU) before being overwritten;
# * **C**: the same system prompt with another question. The GPU has forgotten it, the tier has not: two **tier
#   hits**, each **promoted** (copied CPU -> GPU into a fresh block). Making room offloads two of B's blocks;
# * **B again**: its first block still hits on the GPU, the next two in the tier;
# * **D**: another new prompt. The tier is full, so its replacement policy drops an entry to take in B's first
#   block; blocks the tier already holds (a promoted block keeps its CPU copy) are not copied again.
#
# Each call returns the copies it made (`allocate(seq).tier_moves`) in batches of one kind,
# `TierMove("offload", gpu_blocks, cpu_slots)` and `TierMove("promote", cpu_slots, gpu_blocks)` (`sources[i]` is
# copied to `targets[i]`), in the order an engine must apply them, before the step's forward pass. An engine can copy
# a batch in one launch, as vLLM's offloading worker takes each transfer as a (source blocks, destination blocks)
# pair (`TransferSpec` in `vllm/v1/kv_offload/worker/worker.py`). Each panel shows the pool right after one
# `allocate` (blue: in use; orange: free but cached), the tier under it, and that call's copies, one arrow per
# block (red: offload, green: promote). The labels name each block's content by the request and block index that
# first computed it (`A0` is A's first block).

# %%
SYSTEM = list(range(100, 108))                 # two blocks of 4
PROMPTS = {"A": SYSTEM + [1, 2, 3], "B": list(range(200, 213)), "C": SYSTEM + [4, 5, 6],
           "B again": list(range(200, 213)), "D": list(range(300, 313))}

m = BlockManager(4, BS, num_offload_blocks=TIER_SLOTS, record_events=True)
content = {}                                   # block hash -> the name of the block that first held it
tier = [None] * TIER_SLOTS                     # what each CPU slot holds, tracked from the moves
steps = []
for name, tokens in PROMPTS.items():
    before = [content.get(m.block_hash(b)) for b in range(m.num_blocks)]  # GPU contents before the call
    seq = Sequence(tokens, BS)
    moves = [(kind, src, dst) for kind, sources, targets in m.allocate(seq).tier_moves  # one per block copied
             for src, dst in zip(sources, targets)]
    for kind, src, dst in moves:               # an offload reads the GPU block before this call rewrote it
        if kind == "offload":
            tier[dst] = before[src]
    for i, block in enumerate(seq.block_table):
        if m.block_hash(block) is not None:
            content.setdefault(m.block_hash(block), f"{name[0]}{i}")
    gpu = [content.get(m.block_hash(b), "") for b in range(m.num_blocks)]
    steps.append(dict(name=name, view=viz.snapshot(m, [seq]), gpu=gpu, tier=list(tier), moves=moves,
                      stats=replace(m.tier_stats)))
    m.free(seq)
    m.check_invariants()


def draw_two_tiers(step, ax):
    """kvlab.viz's pool drawing, with the tier's slots under it and this call's copies as arrows."""
    offloads = sum(kind == "offload" for kind, _, _ in step["moves"])
    promotes = len(step["moves"]) - offloads
    viz.draw_pool(step["view"], ax=ax, title=f"{step['name']}: {offloads} offloaded, {promotes} promoted")
    ax.get_legend().remove()  # one legend for the whole figure instead
    tier_y = -1.9
    for b, name in enumerate(step["gpu"]):
        ax.text(b + 0.5, 1.2, name, ha="center", va="center", fontsize=9, fontweight="bold")
    for s, name in enumerate(step["tier"]):
        ax.add_patch(Rectangle((s + 0.06, tier_y + 0.06), 0.88, 0.88, gid=f"tier-{s}", edgecolor="#555555",
                               facecolor=CPU_COLOR if name else STATE_COLORS[FREE]))
        ax.text(s + 0.5, tier_y + 0.5, f"c{s}\n{name or ''}", ha="center", va="center", fontsize=8,
                color="white" if name else "#1b1b1b")
    ax.text(-0.2, 0.5, "GPU", ha="right", va="center", fontsize=9)
    ax.text(-0.2, tier_y + 0.5, "CPU tier", ha="right", va="center", fontsize=9)
    for kind, src, dst in step["moves"]:
        gpu, slot = (src, dst) if kind == "offload" else (dst, src)
        top, bottom = (gpu + 0.5, 0.02), (slot + 0.5, tier_y + 0.98)
        (x0, y0), (x1, y1) = (top, bottom) if kind == "offload" else (bottom, top)
        shift = 0.12 if kind == "offload" else -0.12   # an offload and a promote of one block stay apart
        ax.add_patch(FancyArrow(x0 + shift, y0, x1 - x0, y1 - y0, width=0.03, head_width=0.14, head_length=0.16,
                                length_includes_head=True, color=OFFLOAD if kind == "offload" else PROMOTE))
    ax.set_xlim(-1.6, max(step["view"].num_blocks, TIER_SLOTS) + 0.1)
    ax.set_ylim(tier_y - 0.2, 1.5)


fig, axes = plt.subplots(3, 2, figsize=(12, 9))
for step, ax in zip(steps, axes.flat):
    draw_two_tiers(step, ax)
axes.flat[-1].axis("off")
legend = [Patch(facecolor=STATE_COLORS[state], edgecolor="#555555", label=label) for state, label in
          ((USED, "GPU block in use"), (WARM, "GPU block free, cached"), (FREE, "free (GPU or CPU)"))]
legend += [Patch(facecolor=CPU_COLOR, label="CPU slot holding a block"),
           Line2D([], [], marker="o", ls="", markerfacecolor="#ffd92f", markeredgecolor="#1b1b1b",
                  label="cached: a lookup can hit it"),
           Line2D([], [], color=OFFLOAD, lw=2, label="offload (GPU -> CPU)"),
           Line2D([], [], color=PROMOTE, lw=2, label="promote (CPU -> GPU)")]
axes.flat[-1].legend(handles=legend, loc="center", fontsize=10, frameon=False)
fig.tight_layout()
plt.show()

# %%
# Each request's lookup, from the tier's counters before and after it (they count every prompt, GPU hits too).
table = pd.DataFrame([dict(request=s["name"], gpu_hits=s["stats"].gpu_hit_blocks - p.gpu_hit_blocks,
                           tier_hits=s["stats"].tier_hit_blocks - p.tier_hit_blocks,
                           missed_blocks=s["stats"].miss_blocks - p.miss_blocks,
                           moves=", ".join(f"{k} {a}->{b}" for k, a, b in s["moves"]) or "none")
                      for s, p in zip(steps, [TierHitStats()] + [s["stats"] for s in steps])]).set_index("request")
with pd.option_context("display.max_colwidth", 100):
    display(table)  # noqa: F821 - IPython's display
stats = m.tier_stats
print(f"the tier's counters after the five requests: {stats.gpu_hit_blocks} blocks hit on the GPU, "
      f"{stats.tier_hit_blocks} in the tier, {stats.miss_blocks} missed; {stats.offloaded_blocks} offloaded")
events = [e for e in m.events if e.kind in ("offload", "promote", "tier_evict")]
print("the event log's tier events (c: a CPU slot):", ", ".join(f"{e.kind} {viz.event_label(e)}" for e in events))
by_name = {s["name"]: s for s in steps}
viz.check([k for k, _, _ in by_name["B"]["moves"]] == ["offload"] * 2 and sorted(filter(None, by_name["B"]["tier"]))
          == ["A0", "A1"],
          "B's allocation offloads exactly A's two cached blocks", defaults=DEFAULTS)
viz.check(table.loc["C", "tier_hits"] == 2 and table.loc["C", "gpu_hits"] == 0,
          "C finds the system prompt in the tier only: 2 tier hits, 0 GPU hits", defaults=DEFAULTS)
viz.check((table.loc["B again", "gpu_hits"], table.loc["B again", "tier_hits"]) == (1, 2),
          "B again hits its first block on the GPU and the next two in the tier", defaults=DEFAULTS)
viz.check(any(e.kind == "tier_evict" for e in events) and sum(k == "offload" for k, _, _ in by_name["D"]["moves"]) == 1,
          "D offloads only B's first block (the others are in the tier already), dropping a tier entry for it",
          defaults=DEFAULTS)

# %% [markdown]
# Three things to notice. **Lookups chain across tiers**: a prompt's blocks are looked up on the GPU first and,
# from its first GPU miss on, in the tier (B again: one GPU hit, then two tier hits); the tier's hits are
# verified like the GPU's (tokens, keys and the exact parent), so a hash collision cannot serve wrong K/V from
# either tier. **The tier is inclusive**: a promoted block keeps its CPU copy, so evicting it from the GPU again
# costs no copy (D offloads one block, not three). **Every copy is data**: the manager moves no bytes; it says
# which block goes where, and the engine (`LLM(num_offload_blocks=...)`) applies the moves with `swap_blocks`
# before the forward pass, in the order given (C's list mixes both kinds): an offload always comes before any
# move of the same call that overwrites its GPU block. The teaching event log (`record_events=True`) records the
# same moves as `offload`, `promote` and `tier_evict` events.
#
# > **In vLLM.** vLLM V1's native offloading is a KV connector (`OffloadingConnector`, turned on by
# > `--kv-offloading-size` in GiB: `kv_offloading_size` in `vllm/config/cache.py`). `CPUOffloadingSpec`
# > (`vllm/v1/kv_offload/cpu/spec.py`; `cpu.py` in earlier versions) turns the bytes into CPU blocks,
# > `num_blocks = cpu_bytes_to_use // kv_bytes_per_offloaded_block`, and picks the manager: `eviction_policy`
# > "lru" or "arc". Two differences from kvlab. **When it stores**: vLLM copies a block to CPU as soon as it is
# > computed (the connector's `_get_reqs_to_store` gathers each request's newly full blocks every step), so an
# > eviction needs no copy; kvlab copies at eviction, which moves only blocks the GPU is about to lose. **How it
# > copies**: asynchronously, `ops.swap_blocks` on a CUDA stream of its own into pinned CPU tensors
# > (`SingleDirectionOffloadingHandler.transfer_async` in `vllm/v1/kv_offload/worker/cpu_gpu.py`), a store
# > waiting for the step's compute; kvlab's engine copies synchronously before the forward pass. Its offloading
# > managers report stores and removals with the tier's `medium` (`OffloadingEvent` in `lru_manager.py` and
# > `arc_manager.py`), which reach routers as KV events; kvlab's tier events carry `medium="CPU"` too.

# %% [markdown]
# ## 2. Per-tier hit rates on a real trace
#
# The Mooncake conversation trace (bundled in `data/`), replayed one request at a time (allocate, free) through
# a GPU pool of `GPU_KV_GIB` GiB of `MODEL`'s KV, with a tier of growing size behind it. Three tiers:
#
# * **LRU**: drop the least recently stored or hit entry (vLLM's `LRUOffloadingManager`);
# * **ARC** (Megiddo & Modha, FAST'03): entries hit once (T1) and hit again (T2), with ghost lists of what was
#   dropped from each steering T1's share (vLLM's `ARCOffloadingManager`);
# * **LRU + reuse filter** (`offload_admission="reused"`): admit a block only once its hash has been looked up
#   twice (vLLM's `FilterReusedOffloadingManager`), so blocks used once never take a slot.
#
# `manager.tier_stats` counts each prompt's tokens as GPU hits, tier hits and misses (every token not hit,
# partial last blocks included), so the three add up to the prompt tokens.

# %%
shape = read_model_shape(CONFIGS / MODEL)
bytes_per_token = shape.layout("bfloat16").bytes_per_token
block_bytes = bytes_per_token * TRACE_BS
GPU_BLOCKS = int(GPU_KV_GIB * 2**30 // block_bytes)
trace = load_trace("mooncake_conversation", limit=LIMIT)
prompts = [mooncake_token_ids(h, n) for h, n in zip(trace["hash_ids"], trace["input_length"])]
seqs = [Sequence(tokens, TRACE_BS) for tokens in prompts]  # a freed sequence can be allocated again: built once
profile = reuse_profile(trace, TRACE_BS)
ceiling = profile["ceiling_hit_rate_tokens"]
print(f"{MODEL}: {bytes_per_token // 1024} KiB of bf16 KV per token, {block_bytes / 2**20:.0f} MiB per "
      f"{TRACE_BS}-token block; {GPU_KV_GIB} GiB of GPU KV = {GPU_BLOCKS} blocks.")
print(f"{len(prompts):,} requests ({trace['timestamp'].iloc[-1] / 60_000:.0f} minutes), "
      f"{trace['input_length'].sum() / 1e6:.1f} M prompt tokens, {profile['distinct_blocks']:,} distinct blocks; "
      f"{profile['never_reused']:.0%} of them used by one request only; a cache that never evicts serves "
      f"{ceiling:.1%} of prompt tokens.")

TIERS = {"LRU": ("lru", "always"), "ARC": ("arc", "always"), "LRU + reuse filter": ("lru", "reused")}
TIER_BLOCKS = [1000, 2000, 4000, 8000, 16000, 32000, 64000]   # the largest holds every distinct block

# One pass per tier and size (kvlab.course.tiers; notebook 14b prices the same replays): each prompt allocated,
# then freed, through a fresh pool. A no-tier run counts its GPU hits the same way.
runs = tier_hit_runs(seqs, GPU_BLOCKS, TIERS, TIER_BLOCKS)
prompt_tokens = int(trace["input_length"].sum())
assert (runs.gpu_hit_tokens + runs.tier_hit_tokens + runs.miss_tokens == prompt_tokens).all()

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
for label in TIERS:
    rows = runs[runs.tier == label]
    left.plot(rows.blocks, 100 * rows.total_hit, "o-", label=label)
left.axhline(100 * runs.total_hit[0], color="#4e79a7", ls=":", label=f"GPU pool alone ({GPU_BLOCKS} blocks)")
left.axhline(100 * ceiling, color="grey", ls="--", label="infinite cache")
left.set(xscale="log", xlabel=f"tier size (blocks of {TRACE_BS} tokens)", ylabel="prompt tokens hit (%, GPU + tier)",
         ylim=(0, 110 * ceiling))
left.set_title("total hit rate as the tier grows", pad=28)
top = left.secondary_xaxis("top", functions=(lambda b: b * block_bytes / 2**40, lambda t: t * 2**40 / block_bytes))
top.set_xlabel(f"tier size (TiB of {MODEL} bf16 KV)", fontsize=8)
left.legend(fontsize=8)
lru = runs[runs.tier.isin(["none", "LRU"])]
x = [f"{b:,}" for b in lru.blocks]
right.bar(x, 100 * lru.gpu_hit, color="#4e79a7", label="GPU hit")
right.bar(x, 100 * lru.tier_hit, bottom=100 * lru.gpu_hit, color=CPU_COLOR, label="tier hit (copied)")
right.bar(x, 100 * lru.miss, bottom=100 * lru.total_hit, color="#dddddd", label="miss (computed)")
right.set(xlabel="LRU tier size (blocks)", ylabel="prompt tokens (%)", title="where each prompt token came from (LRU)")
right.legend(fontsize=8, loc="upper left")
for ax in (left, right):
    ax.grid(alpha=0.3)
plt.show()
display(runs.pivot(index="blocks", columns="tier", values="total_hit").mul(100).round(1))  # noqa: F821

# %%
small, large = TIER_BLOCKS[0], TIER_BLOCKS[-1]
viz.check(large / GPU_BLOCKS > 80 and 3.5 < large * block_bytes / 2**40 < 4.5,
          "the largest tier is over 80 times the pool, about 4 TiB of KV", defaults=DEFAULTS)
at = runs.set_index(["tier", "blocks"]).total_hit
filtered_cap = runs[runs.tier == "LRU + reuse filter"].total_hit.max()
print(f"A {small:,}-block tier: LRU {at['LRU', small]:.1%}, ARC {at['ARC', small]:.1%}, "
      f"LRU + reuse filter {at['LRU + reuse filter', small]:.1%} (the GPU alone: {runs.total_hit[0]:.1%}).")
print(f"A {large:,}-block tier: LRU {at['LRU', large]:.1%}, the reuse filter {at['LRU + reuse filter', large]:.1%} "
      f"(ceiling {ceiling:.1%}).")
viz.check(at["LRU + reuse filter", small] > at["ARC", small] > at["LRU", small] > runs.total_hit[0],
          "a small tier: the reuse filter beats ARC, ARC beats LRU, and any tier beats none", defaults=DEFAULTS)
viz.check(at["LRU", large] > 1.5 * filtered_cap,
          "a large tier: the reuse filter's admission costs hits (every block's first reuse is lost)",
          defaults=DEFAULTS)
viz.check(abs(at["LRU", large] - ceiling) < 1e-3 and abs(at["ARC", large] - ceiling) < 1e-3,
          "a tier that holds every distinct block loses nothing: it reaches the infinite-cache ceiling",
          defaults=DEFAULTS)
blocks_per_request = trace["input_length"].sum() / TRACE_BS / len(prompts)
tens_of_times = min(b for b in TIER_BLOCKS if b >= 20 * GPU_BLOCKS)
viz.check(runs.total_hit[0] < 0.1 and 20 < blocks_per_request < 30 and 25 < GPU_BLOCKS / blocks_per_request < 35
          and at["LRU", tens_of_times] > 0.8 * ceiling and profile["never_reused"] > 0.5
          and all(at["ARC", b] > at["LRU", b] - 1e-3 for b in TIER_BLOCKS),
          "the reading below says: the pool alone hits a few percent, holds about 30 requests of some 26 blocks, a "
          "tier 20 times its size recovers most of the ceiling, most distinct blocks are used once, and ARC never "
          "trails LRU", defaults=DEFAULTS)

# %% [markdown]
# Reading the curves:
#
# * **The tier multiplies the cache**: the GPU pool alone serves a few percent of prompt tokens. It holds about
#   30 requests' worth of blocks (requests average some 26 blocks), so by the time a conversation's next turn
#   arrives its prefix has usually been evicted. A tier tens of times the pool's size recovers most of the
#   ceiling. Behind `hit_rate` lies a price, though: each tier hit is a copy (notebook 14b, section 1).
# * **ARC beats LRU on small tiers**: blocks hit a second time move to T2 and outlive the stream of blocks
#   stored once, and its ghost lists tune that split. On a large tier both keep nearly everything.
# * **The reuse filter is a bet on small tiers**: most distinct blocks of this trace are used by one request
#   only, and keeping them out leaves room for the rest, so it wins when slots are scarce. But a block is
#   admitted only once it has been looked up twice, so a block evicted from the GPU before its first reuse
#   never enters the tier, and that reuse (often a conversation's next turn) misses: the curve flattens far
#   below the ceiling however large the tier.
# * A tier that holds every distinct block (the last point) loses nothing: the pool and the tier together hit
#   exactly what a cache that never evicts would.
#
# > **In vLLM.** The policies are vLLM's: `LRUOffloadingManager` (`vllm/v1/kv_offload/lru_manager.py`) and
# > `ARCOffloadingManager` (`arc_manager.py`: T1/T2, ghost lists B1/B2 bounded by the cache's capacity,
# > `target_t1_size` grown by a B1 hit and shrunk by a B2 hit; `touch` walks a prompt's hashes last to first,
# > as kvlab does). The reuse filter is `FilterReusedOffloadingManager` (`reuse_manager.py`): `lookup` counts
# > every hash in an LRU table of `max_tracker_size` entries (64,000 by default) and `prepare_store` keeps only
# > hashes seen `store_threshold` times. It is **off by default**: `CPUOffloadingSpec` wraps the manager in it
# > only when `kv_connector_extra_config` sets `store_threshold` >= 2. vLLM counts the hashes its connector is
# > asked about (past the GPU's hits); kvlab counts every full block a prompt looks up.

# %% [markdown]
# ### Exercise: a bigger pool or a tier?
#
# Two predictions about the replays above. First, as the LRU tier grows from none to 64,000 blocks, does the
# **GPU's own** share of hits (`gpu_hit`) get larger, smaller or stay the same? Second, you have `GPU_BLOCKS`
# more blocks to spend: double the GPU pool (no tier), or keep the pool and put an **LRU** tier of
# `GPU_BLOCKS` blocks behind it. Which serves more prompt tokens from cache (GPU + tier)? Edit the two values
# and run the cell: the first is read from `runs`, the second replays the trace twice more (under a second).

# %%
PREDICTED_GPU_HITS_WITH_TIER = None   # the GPU's hits as the LRU tier grows: "larger", "smaller" or "same"
PREDICTED_BETTER_SPEND = None         # GPU_BLOCKS more blocks, as "pool" (a doubled pool) or "tier" (LRU)

lru_gpu = runs[runs.tier.isin(["none", "LRU"])].gpu_hit_tokens / prompt_tokens   # tokens: an exact "same"
spent = {"pool": replay_through_tier(seqs, 2 * GPU_BLOCKS),
         "tier": replay_through_tier(seqs, GPU_BLOCKS, GPU_BLOCKS, "lru"),
         "ARC tier": replay_through_tier(seqs, GPU_BLOCKS, GPU_BLOCKS, "arc")}
spent_hit = {k: (s.gpu_hit_tokens + s.tier_hit_tokens) / prompt_tokens for k, s in spent.items()}
answer(PREDICTED_GPU_HITS_WITH_TIER, "same" if lru_gpu.nunique() == 1 else
       "larger" if lru_gpu.iloc[-1] > lru_gpu.iloc[0] else "smaller",
       f"GPU hits: {lru_gpu.iloc[0]:.2%} with no tier, {lru_gpu.iloc[-1]:.2%} with the largest. A tier hit is "
       "promoted into a fresh GPU block exactly where a miss would have been computed, so the pool allocates "
       "and evicts the same blocks with or without a tier: the tier only adds hits on what the GPU lost.")
answer(PREDICTED_BETTER_SPEND, "pool" if spent_hit["pool"] > spent_hit["tier"] else "tier",
       f"A doubled pool serves {spent_hit['pool']:.2%}, the pool plus an LRU tier of {GPU_BLOCKS} blocks "
       f"{spent_hit['tier']:.2%} (an ARC tier of that size: {spent_hit['ARC tier']:.2%}). An LRU tier behind an "
       "LRU pool is roughly one longer LRU list, less the blocks it holds twice (it is inclusive).")
viz.check(lru_gpu.nunique() == 1 and spent_hit["tier"] < spent_hit["pool"] < 1.1 * spent_hit["tier"]
          and spent_hit["ARC tier"] > spent_hit["pool"],
          "the answer below says: the GPU's hits stay the same, the doubled pool beats an LRU tier narrowly, and "
          "an ARC tier of the same size beats the doubled pool", defaults=DEFAULTS)

# %% [markdown]
# **Answer.** With the defaults, **same** and **pool**, narrowly. The GPU's hits do not move at all: a tier
# hit's block is promoted into the fresh block a miss would have taken, so the GPU pool sees the same
# allocations and evictions as without a tier, and every point of the sweep adds tier hits on top of the same
# GPU hits (14b prices them). An LRU tier of the pool's size then acts as the doubled pool's second half, only
# slightly worse: a promoted block keeps its CPU copy, so some slots hold blocks the GPU holds too. The tier's
# case is not slot for slot but size: a tier can be far larger than the pool (the sweep's largest is over 80
# times it, about 4 TiB of this model's KV per replica: more than a server's CPU memory, so in practice a disk
# or a pooled store such as Mooncake's), and a different policy can use the slots better: the ARC tier of the
# same size beats the doubled pool.

# %% [markdown]
# ## Takeaways
#
# * A second tier keeps what the GPU pool evicts; a GPU miss that hits it costs a copy instead of a prefill.
#   Lookups chain across tiers and stay verified; the tier keeps promoted blocks (inclusive).
# * On Mooncake, a tier tens of times the pool recovers most of the infinite-cache ceiling. ARC helps small
#   tiers; the reuse filter helps them more but caps the hit rate: a block evicted before its first reuse
#   never enters the tier.
# * Next, notebook 14b: when a tier hit beats recomputing, how to read a hit rate, and two more levers on the
#   hits (the admission order and a tier shared by a fleet).
