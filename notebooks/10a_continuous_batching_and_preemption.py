# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 10a · Continuous batching and preemption
#
# Notebook 09 ran kvlab's engine one step at a time. This one watches the decisions its **scheduler** makes
# before every step when the KV pool is the limit: who joins the batch, who must wait, and who gives their
# blocks back when the pool runs out. (Notebook 10b looks at the other limit, the tokens one step may compute.)
#
# **Objectives.** After this notebook you can:
# 1. read a schedule: requests join and leave the batch between steps (**continuous batching**), and with
#    V0 scheduling each step is a prefill or a decode, so a prefill pauses everybody's decoding;
# 2. predict `can_allocate`'s answer (OK, LATER, NEVER) with and without a **watermark**, and say what a
#    watermark trades: fewer preemptions against a smaller batch;
# 3. compare **preemption** by recompute and by swap on the same workload, counted in tokens, blocks and
#    (under a stated step-time model) milliseconds, and say when each is cheaper;
# 4. read throughput and latency as the pool shrinks, averaged over workloads.
#
# Everything runs on a tiny random model (one layer: nothing is downloaded, the text is noise) with
# `scheduling="v0"` (whole-prompt steps, as vLLM V0 and nano-vllm). Wall times on this machine say nothing
# about a GPU, so costs are counted in **engine steps**, **tokens** and **blocks**, which do not depend on
# the machine, and turned into time by one **step-time model** defined in the knobs cell: a step takes
# `STEP_MS + TOKEN_MS x tokens` (plus `SWAP_BLOCK_MS` per block it copies to or from CPU memory). The model
# and its numbers are an **assumption for illustration**, not a measurement. Its shape is the usual one: on a
# GPU a decode step costs about the same for one or for eight sequences (it is bound by memory bandwidth, the
# fixed part), while a prefill's cost grows with its tokens (the per-token part).

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
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab import AllocStatus, BlockManager, Sequence, viz
from kvlab.course import answer
from kvlab.device import DEVICE
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.random_model import save_random_model
from kvlab.engine.replay import Arrival, replay
from kvlab.kernels import bytes_per_block

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BLOCK_SIZE = 8          # tokens per KV block
ROOMY_POOL = 32         # blocks: enough for the whole workload at once (section 1)
TIGHT_POOL = 14         # blocks: the workload does not fit, so sequences get preempted (section 3)
POOL_SWEEP = [5, 6, 7, 8, 10, 12, 14, 20, 32]  # section 4 (each must hold the longest request: 5 blocks)
NUM_WORKLOADS = 20      # section 4 averages over this many workloads of the same shape
MAX_NUM_SEQS = 8        # sequences in a batch at most
TOKEN_BUDGET = 256      # max_num_batched_tokens: tokens one step may compute (10b varies it)
WATERMARK = 0.1         # section 2: the share of the pool admission keeps free
SEED = 0
# The step-time model, used in every section: an assumption for illustration, not fitted to any measurement.
STEP_MS, TOKEN_MS = 5.0, 0.1   # a step's fixed cost, and its cost per token computed (prefill or decode)
SWAP_BLOCK_MS = 0.05           # one block copied between GPU and CPU memory (a block of 1-2 MiB over PCIe)

DEFAULTS = (BLOCK_SIZE, ROOMY_POOL, TIGHT_POOL, POOL_SWEEP, MAX_NUM_SEQS, TOKEN_BUDGET, WATERMARK, SEED,
            STEP_MS, TOKEN_MS, SWAP_BLOCK_MS) == (8, 32, 14, [5, 6, 7, 8, 10, 12, 14, 20, 32], 8, 256, 0.1, 0,
                                                  5.0, 0.1, 0.05)
# One layer, one KV head of 16 dimensions: the smallest model the kernels take, so every run is quick. At
# this size extra CPU threads only add overhead (and crawl on a shared machine): one is fastest.
torch.set_num_threads(1)
MODEL_DIR = save_random_model(tempfile.mkdtemp() + "/tiny-qwen3", "tiny", num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def step_ms(steps):
    """Each step's time under the step-time model; `steps` is a `step_dataframe()`."""
    copies = steps["blocks_swapped_out"] + steps["blocks_swapped_in"]
    return (STEP_MS + TOKEN_MS * steps["num_tokens"] + SWAP_BLOCK_MS * copies).to_numpy()


# %% [markdown]
# ## The workload, and how we watch the scheduler
#
# Six requests, A to F, arrive in three bursts over the first 8 steps: prompts of 12 to 30 tokens, 10
# generated tokens each (greedy, `ignore_eos`, so every run generates exactly the same tokens and runs differ
# only in scheduling). In total they need about 28 blocks of 8 tokens at their longest.
#
# `kvlab.engine.replay` runs such a timed workload: `replay(llm, workload)` adds each request before the step
# it arrives at and steps the engine until all are done. The engine is made with `record_decisions=True`, so
# `llm.decisions` keeps the scheduler's decision of every step (which requests ran and what each computed,
# who was preempted, who waited in which queue), and the replay reads it per request: `schedule_frame()`
# gives, per step and request, a state (`prefill`, `decode`, `recompute` = a prefill again after a
# preemption, `paused` = running but not run this step, `waiting` or `swapped`); `time_to_first_token`,
# `latency` and `gaps` give durations in steps, or in any per-step cost such as the step-time model's ms.

# %%
NAMES, ARRIVALS = "ABCDEF", (0, 0, 0, 4, 8, 8)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def workload(seed):
    """Six requests of 12-30 random prompt tokens, added before the steps in ARRIVALS."""
    rng = np.random.default_rng(seed)
    return {name: Arrival(rng.integers(0, 500, size=int(rng.integers(12, 31))).tolist(), step, PARAMS)
            for name, step in zip(NAMES, ARRIVALS)}


def run(num_blocks, preemption_mode="recompute", seed=SEED):
    """One engine run of workload(seed) in a pool of num_blocks blocks."""
    llm = LLM(MODEL_DIR, block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=TOKEN_BUDGET, preemption_mode=preemption_mode, seed=SEED,
              scheduling="v0",         # whole-prompt steps: this notebook teaches V0
              record_decisions=True)   # llm.decisions: what the replay reads
    return replay(llm, workload(seed))


def summary(rep):
    """What a run cost, in steps, tokens and blocks, and in model ms under the step-time model."""
    steps = rep.llm.step_dataframe()
    ms = step_ms(steps)
    generated = sum(map(len, rep.outputs.values()))
    with_recompute, recompute_only = rep.recompute_steps()
    return {"steps": len(steps), "prefill steps": int((steps["kind"] == "prefill").sum()),
            "generated tokens per step": generated / len(steps),
            "generated tokens per model s": generated / ms.sum() * 1000,
            "mean latency (steps)": np.mean(list(rep.latency().values())),
            "mean latency (model ms)": np.mean(list(rep.latency(ms).values())),
            "mean time to first token (steps)": np.mean(list(rep.time_to_first_token().values())),
            "mean time to first token (model ms)": np.mean(list(rep.time_to_first_token(ms).values())),
            "longest decode gap (model ms)": rep.longest_gap(ms)["cost"], "model time (ms)": ms.sum(),
            "preemptions": int(steps["preempted"].sum()), "recomputed tokens": rep.recomputed_tokens,
            "prefill steps that recompute": with_recompute, "extra prefill steps (recompute only)": recompute_only,
            "recompute tokens found in the prefix cache": rep.recompute_hits,
            "blocks swapped out + in": int(steps["blocks_swapped_out"].sum() + steps["blocks_swapped_in"].sum())}


WORKLOAD = workload(SEED)
requests = pd.DataFrame({name: {"prompt tokens": len(a.prompt), "arrives before step": a.step,
                                "blocks at the end": -(-(len(a.prompt) + PARAMS.max_tokens) // BLOCK_SIZE)}
                         for name, a in WORKLOAD.items()}).T
viz.check(requests["blocks at the end"].sum() == 28, "the six requests should need 28 blocks at their longest",
          defaults=DEFAULTS)
requests

# %% [markdown]
# ## 1. Continuous batching, step by step
#
# A pool of 32 blocks holds the whole workload. Each row below is a request, each column an engine step.
# Watch three things: a request joins the batch at the first step after it arrives (no waiting for the
# batch to drain, unlike static batching); each step is *either* a prefill (blue: the new prompts, all
# at once) *or* a decode (green: one token for every running request), so a prefill step pauses everybody
# else's decoding (pale green); and a request leaves as soon as it has its 10 tokens, freeing its blocks.

# %%
roomy = run(ROOMY_POOL)
print(f"the engine runs on {DEVICE} with the {roomy.llm.attention_backend!r} attention backend (torch on a "
      "CPU, kvlab's Triton kernels on a GPU); either way the costs below are counted, not timed")
fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 5.5), gridspec_kw=dict(height_ratios=[1.3, 1]),
                                  layout="constrained")
viz.draw_schedule(roomy.schedule_frame(), ax=top, title=f"who ran in each step ({ROOMY_POOL}-block pool)")
steps = roomy.llm.step_dataframe()
bottom.bar(steps["step"], steps["blocks_used"], color="#4e79a7", label="blocks in use")
bottom.bar(steps["step"], steps["blocks_free"], bottom=steps["blocks_used"], color="#d3d3d3", label="free")
bottom.set(xlabel="engine step", ylabel="blocks", title="the pool during each step", xlim=top.get_xlim())
bottom.xaxis.get_major_locator().set_params(integer=True)
bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()
steps[["step", "kind", "num_seqs", "num_tokens", "cached_tokens", "blocks_used", "blocks_free", "waiting",
       "running"]].head(8)

# %%
first_decode = steps.loc[steps["kind"] == "decode", "step"].min()
viz.check(steps.loc[0, "kind"] == "prefill" and steps.loc[0, "num_seqs"] == 3 and
          roomy.arrived["D"] == 4 and summary(roomy)["preemptions"] == 0,
          "step 0 should prefill A, B and C together, D should join at step 4, and the roomy pool should "
          "preempt nothing", defaults=DEFAULTS)
print(f"Reading: step 0 prefills A, B and C in one step ({steps.loc[0, 'num_tokens']} tokens); from step "
      f"{first_decode} each decode step gives every running request one token. D joins at step "
      f"{roomy.arrived['D']} without waiting for the batch to drain; its prefill step gives nobody else a token.")

# %% [markdown]
# > **In vLLM.** kvlab's V0 scheduler works like nano-vllm's (`nanovllm/engine/scheduler.py`) and vLLM
# > **V0**'s without chunked prefill (`vllm/core/scheduler.py`): prefill first, and one kind of step at a
# > time. vLLM **V1** (`vllm/v1/core/sched/scheduler.py`) has no prefill and decode phases: each step hands
# > every request some number of tokens within the budget, running requests first, and with **chunked
# > prefill** (on by default) a long prompt is split over several steps, so prefills and decodes share a step
# > and decoding never pauses. Notebook 10b runs kvlab's V1 scheduling.

# %% [markdown]
# ## 2. Admission: OK, LATER, NEVER, and the watermark
#
# Before admitting a prompt the scheduler asks `can_allocate`: **OK** (it fits the free blocks now), **LATER**
# (it fits the pool, once others finish) or **NEVER** (bigger than the pool: it is aborted). With a
# **watermark** the manager also keeps a share of the pool free: a prompt is OK only if at least
# `watermark x num_blocks` blocks remain free after it, and NEVER if it needs more than the pool minus that
# reserve. Here a 20-block pool has 14 blocks in use and 6 free:

# %%
def admission(watermark, needs=(4, 5, 6, 19, 21)):
    manager = BlockManager(20, BLOCK_SIZE, watermark=watermark)
    manager.allocate(Sequence(range(14 * BLOCK_SIZE), BLOCK_SIZE))  # a running sequence holds 14 blocks
    return {f"needs {n} blocks": manager.can_allocate(Sequence(range(1000, 1000 + n * BLOCK_SIZE), BLOCK_SIZE)).name
            for n in needs}


answers = pd.DataFrame({"watermark 0": admission(0.0), f"watermark {WATERMARK}": admission(WATERMARK)})
answers

# %%
reserve = int(WATERMARK * 20)
viz.check(answers.loc["needs 6 blocks"].tolist() == ["OK", "LATER"] and
          answers.loc["needs 19 blocks"].tolist() == ["LATER", "NEVER"],
          f"with watermark {WATERMARK} the reserve is {reserve} blocks, so the answers move elsewhere",
          defaults=DEFAULTS)
print(f"Reading: the watermark reserves {reserve} of the 20 blocks, so with 6 free a prompt is OK only up to "
      f"{6 - reserve} blocks and larger ones wait (LATER); a 19-block prompt, which only an empty pool could hold, "
      f"becomes NEVER.")

# %% [markdown]
# ### Exercise: a bigger reserve
#
# Predict before you run anything: with `watermark=0.3` (a reserve of 6 of the 20 blocks), how many of the
# five sizes in the table get a different answer than with no watermark? Set `PREDICTED_CHANGED_AT_0_3` to
# your number and run the cell; it checks your answer against `admission(0.3)`.

# %%
PREDICTED_CHANGED_AT_0_3 = None   # your prediction: an int from 0 to 5

at_0_3, at_0 = pd.Series(admission(0.3)), pd.Series(admission(0.0))
moved = [f"{size.removeprefix('needs ')} {at_0[size]} -> {at_0_3[size]}" for size in at_0.index[at_0_3 != at_0]]
answer(PREDICTED_CHANGED_AT_0_3, len(moved), "With 6 of the 20 blocks free, a reserve of 0.3 x 20 blocks moves "
       f"these answers: {'; '.join(moved) or 'none'}.")
viz.check(moved == ["4 blocks OK -> LATER", "5 blocks OK -> LATER", "6 blocks OK -> LATER",
                    "19 blocks LATER -> NEVER"], f"the answer below names four moves, got {moved}", defaults=True)

# %% [markdown]
# **Answer.** **4**. A reserve of 6 blocks with 6 free leaves no room at all,
# so the sizes 4, 5 and 6, OK without a watermark, become LATER; 19 blocks fit the empty pool but not the
# 14 it may fill while keeping 6 free, so LATER becomes NEVER; 21 blocks never fit either way.

# %% [markdown]
# Why keep blocks free? Every running sequence needs a new block every `block_size` tokens. A scheduler that
# admits until the pool is full has to preempt at the very next block boundary. The sketch below is a
# scheduler in about twenty lines on the `BlockManager` alone (no model, so it runs in milliseconds): 16 requests
# arrive at once, the scheduler admits while `can_allocate` says OK, every step each running sequence appends
# a token, and when one cannot get a block the newest is preempted by recompute.

# %%
def admit_and_decode(watermark, num_blocks=24, seed=SEED):
    """Preemptions, mean batch and steps for 16 requests of 9-24 prompt and 16-40 output tokens."""
    gen = np.random.default_rng(seed)
    manager = BlockManager(num_blocks, BLOCK_SIZE, watermark=watermark, enable_prefix_caching=False)
    waiting = [[Sequence(gen.integers(0, 500, size=int(gen.integers(9, 25))), BLOCK_SIZE), int(gen.integers(16, 41))]
               for _ in range(16)]  # [sequence, tokens still to generate]
    running, preemptions, batch, steps = [], 0, 0, 0

    def preempt(item, tokens):  # recompute: free, and queue its tokens so far as a new prompt, at the front
        nonlocal preemptions
        manager.free(item[0], preempted=True)
        waiting.insert(0, [Sequence(tokens, BLOCK_SIZE), item[1]])
        preemptions += 1

    while waiting or running:
        while waiting and manager.can_allocate(waiting[0][0]) is AllocStatus.OK:  # admission, first come first
            manager.allocate(waiting[0][0])
            running.append(waiting.pop(0))
        queue, running = running, []
        while queue:  # decode: every running sequence stores one more token
            item = queue.pop(0)
            item[0].append_token(1)
            while not manager.can_append_slots(item[0]) and queue:  # no block: preempt the newest
                victim = queue.pop()
                preempt(victim, victim[0].token_ids)
            if manager.can_append_slots(item[0]):
                manager.append_slots(item[0])
                item[1] -= 1
                running.append(item)
            else:  # alone and still no block: itself
                preempt(item, item[0].token_ids[:-1])
        batch, steps = batch + len(running), steps + 1
        for item in [r for r in running if r[1] == 0]:  # finished
            manager.free(item[0])
            running.remove(item)
    return {"preemptions": preemptions, "mean batch": batch / steps, "steps": steps}


sketch = pd.DataFrame({w: admit_and_decode(w) for w in sorted({0.0, 0.05, WATERMARK, 0.2})}).T
sketch.rename_axis("watermark").round(1)

# %%
viz.check(sketch["preemptions"].is_monotonic_decreasing
          and sketch.loc[0.2, "mean batch"] < sketch.loc[0.0, "mean batch"]
          and sketch.loc[0.2, "steps"] > sketch.loc[0.0, "steps"],
          "a larger watermark should preempt less, and the largest should shrink the batch and take more steps",
          defaults=DEFAULTS)
print(f"Reading: from no watermark to {WATERMARK}, preemptions go from {sketch.loc[0.0, 'preemptions']:.0f} to "
      f"{sketch.loc[WATERMARK, 'preemptions']:.0f} at a mean batch of {sketch.loc[0.0, 'mean batch']:.1f} vs "
      f"{sketch.loc[WATERMARK, 'mean batch']:.1f}; each preemption throws work away. Reserve too much and admission "
      f"itself shrinks the batch: at 0.2 the mean batch is {sketch.loc[0.2, 'mean batch']:.1f} and the 16 requests "
      f"take {sketch.loc[0.2, 'steps']:.0f} steps instead of {sketch.loc[0.0, 'steps']:.0f}.")

# %% [markdown]
# > **In vLLM.** The watermark began in **V0** (`BlockSpaceManager(watermark=0.01)`, `can_allocate` in
# > `vllm/core/block_manager.py`), and kvlab's `can_allocate` follows it. **V1** shipped without one: its
# > scheduler admitted a request whenever `KVCacheManager.allocate_slots` found the blocks, and relied on
# > preemption by recompute. Today's V1 has one again, **off by default**: `KVCacheManager(...,
# > watermark=0.0)` (`vllm/v1/core/kv_cache_manager.py`) keeps `int(watermark x num_blocks)` blocks free,
# > set from `SchedulerConfig.watermark` (vLLM PR #44594). It differs from V0's in two ways: it applies only
# > to waiting or preempted requests (a running request may grow into the reserve), and only when some
# > request is already scheduled in the step, so it never blocks the first admission into an empty batch and
# > never turns an answer into NEVER. kvlab's engine takes no watermark (`LLM` has no such option); this
# > section used the `BlockManager` directly.

# %% [markdown]
# ## 3. Preemption: recompute or swap, on the same workload
#
# Now a pool of 14 blocks: the six requests need about 28 at their longest, so somebody must give blocks
# back. The scheduler preempts the **newest** running sequence (the one that has done the least work).
#
# * **Recompute** (vLLM V1, nano-vllm, kvlab's default): free its blocks and put it back at the head of the
#   waiting queue; when it is admitted again its prompt *and* the tokens it had generated are prefilled
#   again. Its full blocks stay cached while free, so that prefill often hits its own old blocks.
# * **Swap** (vLLM V0's mode for groups of several sequences): copy its blocks to a CPU pool (`swap_blocks`),
#   and back when there is room. Nothing is computed twice, but every block crosses the CPU-GPU link twice.

# %%
runs = {"recompute": run(TIGHT_POOL, "recompute"), "swap": run(TIGHT_POOL, "swap")}
fig, axes = plt.subplots(2, 1, figsize=(12, 6), layout="constrained", sharex=True)
for ax, (name, r) in zip(axes, runs.items()):
    viz.draw_schedule(r.schedule_frame(), ax=ax, title=f"preemption by {name}, {TIGHT_POOL}-block pool")
    ax.tick_params(labelbottom=True)
plt.show()
same = runs["recompute"].outputs == runs["swap"].outputs == roomy.outputs
viz.check(same, "the two modes (or the roomy pool) generated different tokens: scheduling must not change greedy "
          "output", defaults=True)
costs = pd.DataFrame({name: summary(r) for name, r in runs.items()})
costs.map(lambda v: f"{v:.3g}")

# %% [markdown]
# Both modes generate exactly the same tokens (checked above): preemption changes cost, never results. What
# each costs, against the roomy pool's run of the same workload (no preemption): recompute computes tokens
# again, in prefill steps that also pause every running request's decoding; swap computes nothing twice
# but copies blocks out and back. The step-time model turns both into milliseconds. (For scale, the bytes are
# also given for a Llama-3-8B-sized model: KV of 32 layers x 8 heads x 128 dimensions in fp16.)

# %%
base = summary(roomy)
tiny_block = runs["swap"].llm.kv_cache.bytes_per_block
big_block = bytes_per_block(32, 8, 128, block_size=16, dtype=torch.float16)
recompute_tokens = int(costs.loc["recomputed tokens", "recompute"])
hits = int(costs.loc["recompute tokens found in the prefix cache", "recompute"])
recompute_steps = int(costs.loc["prefill steps that recompute", "recompute"])
extra_prefills = int(costs.loc["extra prefill steps (recompute only)", "recompute"])
swapped_blocks = int(costs.loc["blocks swapped out + in", "swap"])
price = pd.DataFrame({
    "recompute": {"preemption work": f"{recompute_tokens} tokens prefilled again in {recompute_steps} prefill "
                                     f"steps, {extra_prefills} of them extra (recompute only)",
                  "its model ms": recompute_tokens * TOKEN_MS + extra_prefills * STEP_MS},
    "swap": {"preemption work": f"{swapped_blocks} blocks copied ({swapped_blocks * tiny_block:,} bytes here; "
                                f"{swapped_blocks * BLOCK_SIZE * big_block / 16 / 2**20:,.0f} MiB for the same "
                                "tokens of a Llama-3-8B-sized model)",
             "its model ms": swapped_blocks * SWAP_BLOCK_MS}}).T
for name in runs:
    price.loc[name, "whole run, model ms"] = costs.loc["model time (ms)", name]
    price.loc[name, "more than the roomy pool's"] = costs.loc["model time (ms)", name] - base["model time (ms)"]
price.round(1)

# %%
viz.check(recompute_tokens > 0 and swapped_blocks > 0 and (costs.loc["steps"] > base["steps"]).all() and
          (costs.loc["generated tokens per step"] <= base["generated tokens per step"]).all(),
          f"the {TIGHT_POOL}-block pool should make both modes preempt and take more steps than the roomy pool, "
          "with no more sequences per step", defaults=DEFAULTS)
print(f"Reading: recompute prefilled {recompute_tokens} tokens again (and found {hits} more in the prefix cache, "
      f"the victim's own blocks, still cached after it was freed) in {recompute_steps} prefill steps, "
      f"{extra_prefills} of them extra: {price.loc['recompute', 'its model ms']:.1f} model ms. Swap computed "
      f"nothing twice but copied {swapped_blocks} blocks: {price.loc['swap', 'its model ms']:.1f} model ms at the "
      f"assumed {SWAP_BLOCK_MS} ms a block. Both runs also take more steps than the roomy pool's, with fewer "
      "sequences per step. Which mode is cheaper depends on the model, the context length and the link: change "
      "TOKEN_MS or SWAP_BLOCK_MS and the answer can flip.")

# %% [markdown]
# Recompute needs no CPU memory and no copy stream, and prefix caching turns most of a just-freed sequence's
# recomputation into hits on its own blocks. vLLM V1 keeps only recompute.
#
# > **In vLLM.** **V0** (`vllm/core/scheduler.py`, `_preempt`) recomputed single sequences and swapped
# > multi-sequence groups (parallel sampling, beam search), unless `--preemption-mode` said otherwise; the
# > worker's `CacheEngine` copied the blocks with `swap_blocks`. Up to v0.3 it issued those copies on a
# > dedicated `cache_stream` with CUDA events (meant to overlap swapping with the model, an overlap CUDA graphs
# > had already disabled); PR #3461 (March 2024) removed the stream, and from then on V0 swapped on the
# > default stream, in line with the model's kernels. **V1** (`vllm/v1/core/sched/scheduler.py`) always
# > recomputes: the preempted request's blocks are freed (they stay in the prefix cache) and it goes back to
# > the front of the waiting queue. nano-vllm (`nanovllm/engine/scheduler.py`, `preempt`) does the same.

# %% [markdown]
# ### Exercise: a tighter pool
#
# Predict before you run anything: in a pool of 10 blocks instead of 14 (the longest request still fits),
# does each number below grow, shrink or stay the same? Set each `PREDICTED_` value to `"more"`, `"fewer"`
# or `"same"`, then run the cell; it runs the 10-block pool and compares.

# %%
PREDICTED_PREEMPTIONS_AT_10 = None   # preemptions (recompute): "more", "fewer" or "same"
PREDICTED_RECOMPUTED_AT_10 = None    # recomputed tokens (recompute): "more", "fewer" or "same"
PREDICTED_SWAPPED_AT_10 = None       # blocks swapped out + in (swap): "more", "fewer" or "same"

tighter_runs = {mode_name: run(10, mode_name) for mode_name in ("recompute", "swap")}
tighter = {mode_name: summary(r) for mode_name, r in tighter_runs.items()}
now = {"preemptions (recompute)": (tighter["recompute"]["preemptions"], costs.loc["preemptions", "recompute"]),
       "recomputed tokens": (tighter["recompute"]["recomputed tokens"], recompute_tokens),
       "blocks swapped (swap)": (tighter["swap"]["blocks swapped out + in"], swapped_blocks)}
whys = {"preemptions (recompute)": "a tighter pool also admits fewer requests at once, so who is preempted changes",
        "recomputed tokens": "recompute pays per token of the victim not found in the prefix cache",
        "blocks swapped (swap)": "swap pays per block the victim holds"}
for (name, (at_10, at_tight)), yours in zip(now.items(), (PREDICTED_PREEMPTIONS_AT_10, PREDICTED_RECOMPUTED_AT_10,
                                                          PREDICTED_SWAPPED_AT_10)):
    answer(yours, "more" if at_10 > at_tight else "fewer" if at_10 < at_tight else "same",
           f"{name}: {at_tight:.0f} in {TIGHT_POOL} blocks, {at_10:.0f} in 10; {whys[name]}.")

# %% [markdown]
# **Answer.** With the default knobs, preemptions stay the **same** (one),
# recomputed tokens are **more** and swapped blocks **fewer**. The numbers:

# %%
def victims(rep):
    """The requests preempted in a run, and the step each was first prefilled."""
    frame = rep.schedule_frame()
    first_prefill = frame[frame["state"] == "prefill"].groupby("request")["step"].min()
    return sorted(set(frame.loc[frame["preempted"], "request"])), first_prefill


(victims_tight, _), (victims_10, prefilled_10) = victims(runs["recompute"]), victims(tighter_runs["recompute"])
viz.check([now[name] for name in now] == [(1, 1), (17, 6), (6, 10)] and victims_tight == ["C"] and
          victims_10 == ["E"] and prefilled_10["C"] == 10 and hits == 32 and
          tighter["recompute"]["recompute tokens found in the prefix cache"] == 8,
          "the answer and the paragraph below describe one preemption in each pool (C in 14 blocks, E in 10), "
          "C first prefilled at step 10 in 10 blocks, 6 and 17 tokens recomputed after 32 and 8 hits, 10 and 6 "
          "blocks swapped", defaults=DEFAULTS)
pd.DataFrame({name: {f"{TIGHT_POOL} blocks": at_tight, "10 blocks": at_10}
              for name, (at_10, at_tight) in now.items()}).T

# %% [markdown]
# A tighter pool does not simply preempt more: it admits fewer requests at once. In 10 blocks C does not fit
# next to A and B at step 0 and waits (LATER) until step 10, so the victim changes: in 14 blocks it is C,
# after 8 generated tokens (5 blocks of KV to swap out), in 10 blocks it is E, just prefilled (3 blocks).
# Swap pays per block of the victim, so it pays less. Recompute pays per token *not* found in the prefix
# cache: C's 4 full blocks were still cached when it came back (32 hits, 6 tokens recomputed), while the
# 10-block pool reused most of E's freed blocks for others before E returned (8 hits, 17 tokens recomputed).
# Draw the two schedules with `viz.draw_schedule(run(10).schedule_frame())` to see it.
#
# ## 4. Throughput and latency as the pool shrinks
#
# The same kind of workload in pools from roomy to barely enough (5 blocks hold the longest request), in
# both preemption modes. Throughput is generated tokens per second of model time; latency is the model time
# from a request's arrival to its last token. One workload gives a jagged curve: whether a preemption
# happens, whom it hits and at which block boundary are discrete events, so one pool size can be lucky and
# the next one up unlucky. The sweep therefore runs `NUM_WORKLOADS` workloads of the same shape (six
# requests, same arrivals, random prompt lengths) and plots their mean, the band between their quartiles,
# and, dotted, the single default workload of sections 1-3. (Where the recompute run preempts nothing the swap
# run would be the same run, so it is not repeated.)

# %%
sweep = []
for seed in tqdm(range(SEED, SEED + NUM_WORKLOADS), desc="workloads"):
    for blocks in POOL_SWEEP:
        first = summary(run(blocks, "recompute", seed))
        for mode_name in ("recompute", "swap"):
            row = summary(run(blocks, "swap", seed)) if mode_name == "swap" and first["preemptions"] else first
            sweep.append({"workload": seed, "pool (blocks)": blocks, "mode": mode_name, **row})
sweep = pd.DataFrame(sweep)
PANELS = ["generated tokens per model s", "mean latency (model ms)", "recomputed tokens", "blocks swapped out + in"]
mean = sweep.groupby(["mode", "pool (blocks)"])[PANELS + ["preemptions"]].mean()

fig, axes = plt.subplots(2, 2, figsize=(13, 6.5), layout="constrained")
for ax, column in zip(axes[0], PANELS[:2]):
    for colour, (mode_name, rows) in zip(("C0", "C1"), sweep.groupby("mode")):
        spread = rows.groupby("pool (blocks)")[column].quantile([0.25, 0.75]).unstack()
        ax.fill_between(spread.index, spread[0.25], spread[0.75], color=colour, alpha=0.15)
        ax.plot(mean.loc[mode_name].index, mean.loc[mode_name, column], "o-", color=colour,
                label=f"{mode_name}: mean of {NUM_WORKLOADS} workloads (band: quartiles)")
        one = rows[rows["workload"] == SEED]
        ax.plot(one["pool (blocks)"], one[column], ":", color=colour, lw=1,
                label=f"{mode_name}: the default workload")
    ax.set(ylabel=column, ylim=(0, 1.15 * sweep[column].max()))
    ax.legend(fontsize=7)
axes[0, 0].set_title("throughput as the pool shrinks")
axes[0, 1].set_title("latency as the pool shrinks")
axes[1, 0].bar(POOL_SWEEP, mean.loc["recompute", "recomputed tokens"], color="C0")
axes[1, 0].set(ylabel="tokens (mean per workload)", title="recompute's price: tokens prefilled again")
axes[1, 1].bar(POOL_SWEEP, mean.loc["swap", "blocks swapped out + in"], color="C1")
axes[1, 1].set(ylabel="blocks (mean per workload)", title="swap's price: blocks copied out and in")
for ax in axes.flat:
    ax.set_xlabel(f"pool (blocks of {BLOCK_SIZE} tokens)")
    ax.set_xticks(POOL_SWEEP)
    ax.grid(alpha=0.3)
plt.show()
mean.round(1)

# %%
recompute = mean.loc["recompute"]
shrinking = recompute.loc[:TIGHT_POOL]  # the pools where preemption rules
viz.check(shrinking["generated tokens per model s"].is_monotonic_increasing and
          shrinking["mean latency (model ms)"].is_monotonic_decreasing and
          recompute["preemptions"].iloc[-1] == 0 and recompute["preemptions"].iloc[0] > 0,
          f"averaged over workloads, throughput should rise and latency fall with the pool up to {TIGHT_POOL} "
          "blocks, and only the small pools should preempt", defaults=DEFAULTS and NUM_WORKLOADS == 20)
small, large = recompute.iloc[0], recompute.iloc[-1]
print(f"Reading: averaged over {NUM_WORKLOADS} workloads, throughput at {min(POOL_SWEEP)} blocks is "
      f"{small['generated tokens per model s']:.0f} generated tokens per model s (recompute) against "
      f"{large['generated tokens per model s']:.0f} in the roomy pool, and mean latency "
      f"{small['mean latency (model ms)']:.0f} model ms against {large['mean latency (model ms)']:.0f}; preemptions "
      f"per workload fall from {small['preemptions']:.1f} to {large['preemptions']:.1f}.")
steps_by_pool = sweep[sweep["mode"] == "recompute"].groupby("pool (blocks)")[["steps", "prefill steps"]].mean()
interior = POOL_SWEEP[1:-1]
viz.check({14, 20} <= set(POOL_SWEEP)
          and recompute.loc[20, "generated tokens per model s"]
          <= 1.02 * recompute.loc[14, "generated tokens per model s"]
          and steps_by_pool.loc[14, "prefill steps"] < steps_by_pool.loc[20, "prefill steps"]
          and mean.loc["recompute", "recomputed tokens"].idxmax() in interior
          and mean.loc["swap", "blocks swapped out + in"].idxmax() in interior,
          "the paragraph below says: throughput flat or dipping from 14 to 20 blocks, fewer prefill steps at 14 "
          "than at 20, and both prices peaking in the middle of the sweep", defaults=DEFAULTS and NUM_WORKLOADS == 20)
steps_by_pool.T.round(2)

# %% [markdown]
# Reading: a smaller pool runs fewer sequences at once, so each step generates fewer tokens and requests
# take more steps, each paying the fixed step cost; preemptions add work (recomputed tokens, or swapped blocks)
# on top. That is the steady part of the curves, and the average shows it where one workload does not. The
# average is not perfectly monotonic near the top, though: between about 14 and 20 blocks it is flat or dips
# slightly. The table above says why: in a pool that is just short, a prompt that does not fit waits a step or
# two (LATER) and is then prefilled **together** with the next arrivals, in one prefill step instead of two;
# with V0's whole-prompt steps that saves a step's fixed cost and a pause for every running request, about as
# much as the rare preemption costs. The prices (bottom) peak in the middle for a similar reason: in the
# smallest pools so few requests run at once that there is rarely anyone to preempt, and the loss is in the
# waiting instead. This is the curve a server operator tunes with `gpu_memory_utilization`,
# the block size, the batch limits and the preemption mode, and the reason every block that paging and prefix
# caching save (notebooks 01-08) turns into throughput.

# %% [markdown]
# ## Takeaways
#
# * Continuous batching admits and retires requests between steps; with V0 scheduling (like nano-vllm and
#   vLLM V0 without chunked prefill) each step is a prefill or a decode, so a prefill pauses decoding.
# * `can_allocate` answers OK / LATER / NEVER; a watermark keeps blocks free for running sequences to grow
#   into, trading admission for fewer preemptions (vLLM V0 kept 1%; today's V1 has one, off by default).
# * Preemption by recompute costs tokens computed again (partly saved by prefix hits on the victim's own
#   blocks) and sometimes whole extra prefill steps; by swap, blocks copied out and back. Which costs more
#   depends on the step-time model (here an assumption, not a measurement). Outputs are identical either way.
# * Averaged over workloads, throughput falls and latency grows as the pool shrinks and preemptions start
#   throwing work away; a single workload's curve is jagged, and near the top a short pool can even batch
#   prefills a little better.
# * Next, notebook 10b: the other limit of a step, its token budget, and chunked prefill.
