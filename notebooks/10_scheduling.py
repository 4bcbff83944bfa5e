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
# # 10 · Scheduling: continuous batching, admission, preemption
#
# Notebook 09 ran kvlab's engine one step at a time. This one looks at the decisions its **scheduler** makes
# before every step, the part of a server that turns a fixed pool of KV blocks into throughput and latency:
#
# 1. **continuous batching**: requests join and leave the batch between steps, and each step is a prefill
#    (new prompts) or a decode (one token for every running sequence);
# 2. **admission**: `can_allocate` answers OK, LATER or NEVER, and a **watermark** keeps a reserve of free
#    blocks for the running sequences to grow into;
# 3. **preemption**: when a running sequence needs a block and none is free, someone must give theirs
#    back, by **recompute** (free the blocks, prefill again later) or by **swap** (copy them to CPU memory
#    and back): the same workload, the two costs side by side;
# 4. a **token budget** per step (`max_num_batched_tokens`), and what it does to time to first token;
# 5. throughput and latency as the pool shrinks;
# 6. **chunked prefill** (`scheduling="v1"`): prefill chunks and decodes share each step's budget, and the
#    decode stall of sections 1-5 goes away.
#
# Sections 1-5 run the engine with `scheduling="v0"` (whole-prompt steps, as vLLM V0 and nano-vllm); section 6
# compares it with V1.
#
# Everything runs on a tiny random model (one layer: nothing is downloaded, the text is noise). On a CPU every
# step runs in the Triton interpreter, whose times say nothing about a GPU. Costs are therefore counted in
# **engine steps**, **tokens** and **blocks**, which do not depend on the machine, and turned into time by one
# **step-time model** defined in the knobs cell: a step takes `STEP_MS + TOKEN_MS x tokens` (plus
# `SWAP_BLOCK_MS` per block it copies to or from CPU memory). The model and its numbers are an **assumption for
# illustration**, not a measurement: no GPU benchmark is committed to this repository. Its shape is the usual
# one: on a GPU a decode step costs about the same for one or for eight sequences (it is bound by memory
# bandwidth, the fixed part), while a prefill's cost grows with its tokens (the per-token part).

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
import tempfile
from functools import cache

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from kvlab import AllocStatus, BlockManager, Sequence, viz
from kvlab.device import DEVICE, mode
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.random_model import save_random_model
from kvlab.kernels import bytes_per_block

# Knobs: change them and run the notebook again.
BLOCK_SIZE = 8          # tokens per KV block
ROOMY_POOL = 32         # blocks: enough for the whole workload at once (section 1)
TIGHT_POOL = 14         # blocks: the workload does not fit, so sequences get preempted (section 3)
POOL_SWEEP = [5, 6, 7, 8, 10, 12, 14, 20, 32]  # section 5 (each must hold the longest request: 5 blocks)
MAX_NUM_SEQS = 8        # sequences in a batch at most
TOKEN_BUDGET = 256      # max_num_batched_tokens: tokens one step may compute (a prompt must fit whole)
SMALL_BUDGET = 32       # section 4's tight budget: about one prompt per step (the longest prompt has 30 tokens)
V0_BUDGETS = [32, 48, 64, 128, 256]  # section 4's sweep (V0: each must hold a whole prompt)
WATERMARK = 0.1         # section 2: the share of the pool admission keeps free
SEED = 0
# The step-time model, used in every section: an assumption for illustration, not fitted to any measurement.
STEP_MS, TOKEN_MS = 5.0, 0.1   # a step's fixed cost, and its cost per token computed (prefill or decode)
SWAP_BLOCK_MS = 0.05           # one block copied between GPU and CPU memory (a block of 1-2 MiB over PCIe)

# One layer, one KV head of 16 dimensions: the smallest model the kernels take, so the interpreter is quick.
MODEL_DIR = save_random_model(tempfile.mkdtemp() + "/tiny-qwen3", "tiny", num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
print(f"kernels run in {mode()} mode on {DEVICE}")


def step_ms(steps):
    """Each step's time under the step-time model; `steps` is a `step_dataframe()`."""
    copies = steps["blocks_swapped_out"] + steps["blocks_swapped_in"]
    return (STEP_MS + TOKEN_MS * steps["num_tokens"] + SWAP_BLOCK_MS * copies).to_numpy()

# %% [markdown]
# ## The workload, and how we watch the scheduler
#
# Six requests, A to F, arrive in three bursts over the first 8 steps: prompts of 12 to 30 tokens, 10 generated
# tokens each
# (greedy, `ignore_eos`, so every run generates exactly the same tokens and runs differ only in scheduling).
# In total they need about 28 blocks of 8 tokens at their longest.
#
# `llm.step_dataframe()` has one row per step (what kind, how many tokens, the pool, preemptions, swaps).
# To see *which* request ran in each step, `Run` below creates the engine with `record_decisions=True`:
# `llm.decisions` then keeps the scheduler's decision of every step (one `StepDecision` per row of
# `step_dataframe()`): which requests ran and what each computed, who was preempted, and who waited in which
# queue. From it `Run` lists, per step and request, a state: `prefill`, `decode`, `recompute` (a prefill again
# after a preemption), `paused` (running, but this step prefills others), `waiting` or `swapped`.

# %%
rng = np.random.default_rng(SEED)
NAMES = "ABCDEF"
WORKLOAD = {name: dict(prompt=rng.integers(0, 500, size=int(rng.integers(12, 31))).tolist(), arrives=arrival)
            for name, arrival in zip(NAMES, (0, 0, 0, 4, 8, 8))}
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
pd.DataFrame({name: {"prompt tokens": len(r["prompt"]), "arrives before step": r["arrives"],
                     "blocks at the end": -(-(len(r["prompt"]) + PARAMS.max_tokens) // BLOCK_SIZE)}
              for name, r in WORKLOAD.items()}).T


# %%
class Run:
    """One engine run of WORKLOAD: every step's scheduling decision, per request, and what it cost."""

    def __init__(self, num_blocks, preemption_mode="recompute", budget=TOKEN_BUDGET):
        self.llm = LLM(MODEL_DIR, block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=MAX_NUM_SEQS,
                       max_num_batched_tokens=budget, preemption_mode=preemption_mode, seed=SEED,
                       scheduling="v0",  # whole-prompt steps: this notebook teaches V0
                       record_decisions=True)  # llm.decisions: the scheduler's decision at every step
        self.arrived, self.finished, self.outputs = {}, {}, {}
        pending = dict(WORKLOAD)
        while pending or self.llm.has_unfinished_requests():
            step = len(self.llm.step_records)
            for name in [n for n, r in pending.items() if r["arrives"] <= step]:
                self.llm.add_request(pending.pop(name)["prompt"], PARAMS, request_id=name)
                self.arrived[name] = step
            for out in self.llm.step():
                self.finished[out.request_id] = step
                self.outputs[out.request_id] = out.outputs[0].token_ids
            if len(self.llm.step_records) == step:
                raise RuntimeError("the engine ran no step although requests are unfinished")
        self._read_decisions()

    def _read_decisions(self):
        """Per step and request, its state (and whether it was preempted in that step), from llm.decisions."""
        self.rows = []  # (step, request, state, preempted in this step)
        self.first_token = {}
        self.recomputed_tokens = 0  # tokens prefilled again after a preemption by recompute (prefix hits excluded)
        self.recompute_hits = 0     # tokens of those prefills found in the victim's own cached blocks
        prefilled = set()
        for decision in self.llm.decisions:
            for seq in decision.ran:  # seq.start .. seq.end - 1: the positions this step computes
                state = decision.kind
                if decision.kind == "prefill":
                    if seq.request_id in prefilled:  # its second prefill: a preemption by recompute came first
                        state = "recompute"
                        self.recomputed_tokens += seq.num_tokens
                        self.recompute_hits += seq.start  # a prefill starts after its prefix hits
                    prefilled.add(seq.request_id)
                self.rows.append((decision.step, seq.request_id, state, False))
                self.first_token.setdefault(seq.request_id, decision.step)
            ran = {seq.request_id for seq in decision.ran}
            preempted = {name for name, _ in decision.preempted}
            for queue, state in ((decision.running, "paused"), (decision.waiting, "waiting"),
                                 (decision.swapped, "swapped")):
                for name, _ in queue:  # (request id, sample): one sample per request here
                    if name not in ran:
                        self.rows.append((decision.step, name, state, name in preempted))

    def schedule_frame(self):
        return pd.DataFrame(self.rows, columns=["step", "request", "state", "preempted"])

    def longest_gap(self):
        """The longest wait between two steps that ran one request, in steps and in model ms."""
        ms, frame = step_ms(self.llm.step_dataframe()), self.schedule_frame()
        ran = frame[frame["state"].isin(["prefill", "decode", "recompute"])]
        gaps = [(b - a, ms[a + 1:b + 1].sum()) for _, r in ran.groupby("request")
                for a, b in zip(r["step"], r["step"].iloc[1:])]
        return max(gaps, key=lambda g: g[1])

    def recompute_steps(self):
        """Prefill steps that recompute a preempted request, and those that prefill nothing else: steps that
        exist only because of a preemption, each paying the fixed step cost again."""
        prefills = self.schedule_frame().query("state in ['prefill', 'recompute']").groupby("step")["state"]
        return {"prefill steps that recompute": int(prefills.apply(lambda s: (s == "recompute").any()).sum()),
                "extra prefill steps (recompute only)": int(prefills.apply(lambda s: (s == "recompute").all()).sum())}

    def summary(self):
        """Costs in steps, tokens and blocks (the step counts are 0-based, so +1), and in model ms."""
        steps = self.llm.step_dataframe()
        end = np.cumsum(step_ms(steps))  # when each step ends, in model ms
        start = end - step_ms(steps)
        generated = sum(map(len, self.outputs.values()))
        return {"steps": len(steps), "prefill steps": int((steps["kind"] == "prefill").sum()),
                "generated tokens per step": generated / len(steps),
                "generated tokens per model s": generated / end[-1] * 1000,
                "mean latency (steps)": np.mean([self.finished[n] + 1 - self.arrived[n] for n in self.finished]),
                "mean latency (model ms)": np.mean([end[self.finished[n]] - start[self.arrived[n]]
                                                    for n in self.finished]),
                "mean time to first token (steps)": np.mean([self.first_token[n] + 1 - self.arrived[n]
                                                             for n in self.first_token]),
                "mean time to first token (model ms)": np.mean([end[self.first_token[n]] - start[self.arrived[n]]
                                                                for n in self.first_token]),
                "longest decode gap (model ms)": self.longest_gap()[1], "model time (ms)": end[-1],
                "preemptions": int(steps["preempted"].sum()), "recomputed tokens": self.recomputed_tokens,
                **self.recompute_steps(),
                "recompute tokens hit in own blocks": self.recompute_hits,
                "blocks swapped out + in": int(steps["blocks_swapped_out"].sum() + steps["blocks_swapped_in"].sum())}


@cache
def run(num_blocks, preemption_mode="recompute", budget=TOKEN_BUDGET):
    """Each configuration runs once; later sections reuse it."""
    return Run(num_blocks, preemption_mode, budget)


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

# %% [markdown]
# > **In vLLM.** kvlab's scheduler works like nano-vllm's (`nanovllm/engine/scheduler.py`) and vLLM **V0**'s
# > without chunked prefill (`vllm/core/scheduler.py`): prefill first, and one kind of step at a time. vLLM
# > **V1** (`vllm/v1/core/sched/scheduler.py`) has no prefill and decode phases: each step hands every request
# > some number of tokens within the budget, running requests first, and with **chunked prefill** (on by
# > default) a long prompt is split over several steps, so prefills and decodes share a step and decoding
# > never pauses.

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
          f"with watermark {WATERMARK} the reserve is {reserve} blocks, so the answers move elsewhere", defaults=(
              WATERMARK == 0.1))
print(f"Reading: the watermark reserves {reserve} of the 20 blocks, so with 6 free a prompt is OK only up to "
      f"{6 - reserve} blocks and larger ones wait (LATER); a 19-block prompt, which only an empty pool could hold, "
      f"becomes NEVER.")

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
print(f"Reading: from no watermark to {WATERMARK}, preemptions go from {sketch.loc[0.0, 'preemptions']:.0f} to "
      f"{sketch.loc[WATERMARK, 'preemptions']:.0f} at a mean batch of {sketch.loc[0.0, 'mean batch']:.1f} vs "
      f"{sketch.loc[WATERMARK, 'mean batch']:.1f}; each preemption throws work away. Reserve too much and admission "
      f"itself shrinks the batch: at 0.2 the mean batch is {sketch.loc[0.2, 'mean batch']:.1f} and the 16 requests "
      f"take {sketch.loc[0.2, 'steps']:.0f} steps instead of {sketch.loc[0.0, 'steps']:.0f}.")

# %% [markdown]
# > **In vLLM.** The watermark is vLLM **V0**'s (`BlockSpaceManager(watermark=0.01)`, `can_allocate` in
# > `vllm/core/block_manager.py`), and kvlab's `can_allocate` follows it. **V1** has none: its scheduler admits
# > a request when `KVCacheManager.allocate_slots` finds the blocks, and relies on preemption by recompute
# > when a running request later cannot grow. kvlab's engine uses no watermark either (`LLM` has no such
# > option); this section used the `BlockManager` directly.
#
# **Try it.** Predict, then change `WATERMARK` in the knobs cell: at 0.3, how many of the sizes in the table
# change answer? In the sketch, do fewer preemptions buy fewer steps, or does the smaller batch cost as many
# steps as the preemptions saved (compare the `steps` column with no watermark)?

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
plt.show()
same = runs["recompute"].outputs == runs["swap"].outputs == roomy.outputs
viz.check(same, "the two modes (or the roomy pool) generated different tokens: scheduling must not change greedy "
          "output", defaults=True)
costs = pd.DataFrame({name: r.summary() for name, r in runs.items()})
costs.map(lambda v: f"{v:.3g}")

# %% [markdown]
# Both modes generate exactly the same tokens (checked above): preemption changes cost, never results. What
# each costs, against the roomy pool's run of the same workload (no preemption): recompute computes tokens
# again, in prefill steps that also pause every running request's decoding; swap computes nothing twice
# but copies blocks out and back. The step-time model turns both into milliseconds. (For scale, the bytes are
# also given for a Llama-3-8B-sized model: KV of 32 layers x 8 heads x 128 dimensions in fp16.)

# %%
base = roomy.summary()
tiny_block = runs["swap"].llm.kv_cache.bytes_per_block
big_block = bytes_per_block(32, 8, 128, block_size=16, dtype=torch.float16)
recompute_tokens = int(costs.loc["recomputed tokens", "recompute"])
hits = int(costs.loc["recompute tokens hit in own blocks", "recompute"])
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
viz.check(recompute_tokens > 0 and swapped_blocks > 0 and (costs.loc["steps"] > base["steps"]).all(),
          f"the {TIGHT_POOL}-block pool should make both modes preempt and take more steps than the roomy pool",
          defaults=(TIGHT_POOL == 14 and ROOMY_POOL == 32))
print(f"Reading: recompute prefilled {recompute_tokens} tokens again (and found {hits} more in the victim's own "
      f"blocks, still cached after it was freed) in {recompute_steps} prefill steps, {extra_prefills} of them "
      f"extra: "
      f"{price.loc['recompute', 'its model ms']:.1f} model ms. Swap computed nothing twice but copied "
      f"{swapped_blocks} blocks: {price.loc['swap', 'its model ms']:.1f} model ms at the assumed "
      f"{SWAP_BLOCK_MS} ms a block. Both runs also take more steps than the roomy pool's, with fewer sequences "
      "per step. Which mode is cheaper depends on the model, the context length and the link: change "
      "TOKEN_MS or SWAP_BLOCK_MS and the answer can flip.")

# %% [markdown]
# Recompute needs no CPU memory and no copy stream, and prefix caching turns most of a just-freed sequence's
# recomputation into hits on its own blocks. vLLM V1 keeps only recompute.
#
# > **In vLLM.** **V0** (`vllm/core/scheduler.py`, `_preempt`) recomputed single sequences and swapped
# > multi-sequence groups (parallel sampling, beam search), unless `--preemption-mode` said otherwise; its
# > swaps ran through `swap_blocks` on a dedicated stream. **V1** (`vllm/v1/core/sched/scheduler.py`) always
# > recomputes: the preempted request's blocks are freed (they stay in the prefix cache) and it goes back to
# > the front of the waiting queue. nano-vllm (`nanovllm/engine/scheduler.py`, `preempt`) does the same.
#
# **Try it.** Predict, then set `TIGHT_POOL = 10` in the knobs cell (the longest request still fits): how many
# preemptions, recomputed tokens and swapped blocks now?

# %% [markdown]
# ## 4. A token budget per step
#
# `max_num_batched_tokens` caps the tokens one step may compute, so a burst of prompts cannot make one
# enormous prefill step while everybody else waits. V0 scheduling does not chunk prompts, so every prompt must fit
# the budget on its own; with a budget of about one prompt, each burst (A, B and C; then E and F) is admitted
# one prompt per step. Same pool, budget `TOKEN_BUDGET` against `SMALL_BUDGET`:

# %%
budgets = {f"budget {TOKEN_BUDGET}": roomy, f"budget {SMALL_BUDGET}": run(ROOMY_POOL, budget=SMALL_BUDGET)}
fig, axes = plt.subplots(2, 1, figsize=(12, 5.5), layout="constrained", sharex=True)
for ax, (name, r) in zip(axes, budgets.items()):
    viz.draw_schedule(r.schedule_frame(), ax=ax, title=f"{name} tokens per step")
plt.show()
pd.DataFrame({name: {"prefill steps": int((r.llm.step_dataframe()["kind"] == "prefill").sum()),
                     "largest prefill step (tokens)": int(r.llm.step_dataframe()["num_tokens"].max()),
                     **{f"{n}: time to first token (steps)": r.first_token[n] + 1 - r.arrived[n] for n in NAMES}}
              for name, r in budgets.items()})

# %% [markdown]
# The small budget caps the largest step, but the same prefill work now takes more steps: queued prompts get
# their first token later, and every extra prefill step pauses all running requests (pale green). The
# step-time model puts both sides of the trade in milliseconds, over a sweep of budgets: the mean time to
# first token, and the longest wait of any request between two of its steps (its decode stall).

# %%
budget_sweep = pd.DataFrame([{"budget": b, **run(ROOMY_POOL, budget=b).summary()} for b in V0_BUDGETS])
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
for ax, column in zip(axes, ["mean time to first token (model ms)", "longest decode gap (model ms)"]):
    ax.plot(budget_sweep["budget"], budget_sweep[column], "o-")
    ax.set(xlabel="token budget per step (max_num_batched_tokens)", ylabel=column, title=f"V0: {column}",
           ylim=(0, 1.15 * budget_sweep[column].max()))
    ax.grid(alpha=0.3)
plt.show()
budget_sweep[["budget", "steps", "prefill steps", "mean time to first token (model ms)",
              "longest decode gap (model ms)"]].round(1)

# %%
tight, wide = (budget_sweep.set_index("budget").loc[b] for b in (SMALL_BUDGET, TOKEN_BUDGET))
viz.check(tight["prefill steps"] > wide["prefill steps"] and
          tight["mean time to first token (model ms)"] > wide["mean time to first token (model ms)"],
          "the small budget should need more prefill steps and give later first tokens",
          defaults=(SMALL_BUDGET == 32 and TOKEN_BUDGET == 256 and STEP_MS == 5.0 and TOKEN_MS == 0.1))
print(f"Reading: from budget {TOKEN_BUDGET} to {SMALL_BUDGET}, prefill steps go from {wide['prefill steps']:.0f} to "
      f"{tight['prefill steps']:.0f}, the mean time to first token from "
      f"{wide['mean time to first token (model ms)']:.1f} to {tight['mean time to first token (model ms)']:.1f} "
      f"model ms, and the longest decode stall from {wide['longest decode gap (model ms)']:.1f} to "
      f"{tight['longest decode gap (model ms)']:.1f} ms. Without chunking the budget cannot cut a stall below one "
      "whole prompt's prefill step, and consecutive small prefill steps each pay the fixed STEP_MS: a budget "
      "mostly spreads prefill over time. vLLM V1 bounds both with chunked prefill (section 6): a long prompt "
      "takes its share of the budget in several steps, and each of those steps decodes every running request.")

# %% [markdown]
# ## 5. Throughput and latency as the pool shrinks
#
# The same workload in pools from roomy to barely enough (5 blocks hold the longest request), in both
# preemption modes. Throughput is generated tokens per second of model time; latency is the model time from a
# request's arrival to its last token. Recompute's price is counted in tokens and swap's in blocks, so they
# get separate panels. (Where the recompute run preempts nothing the swap run would be the same run, so it is
# not repeated.)

# %%
sweep = []
for blocks in POOL_SWEEP:
    for mode_name in ("recompute", "swap"):
        r = run(blocks, "recompute")
        if mode_name == "swap" and r.summary()["preemptions"]:
            r = run(blocks, "swap")
        sweep.append({"pool (blocks)": blocks, "mode": mode_name, **r.summary()})
sweep = pd.DataFrame(sweep)
fig, axes = plt.subplots(2, 2, figsize=(13, 6.5), layout="constrained", sharex=True)
for mode_name, rows in sweep.groupby("mode"):
    for ax, column in zip(axes[0], ["generated tokens per model s", "mean latency (model ms)"]):
        ax.plot(rows["pool (blocks)"], rows[column], "o-", label=mode_name)
for ax, column, title in zip(axes[0], ["generated tokens per model s", "mean latency (model ms)"],
                             ["throughput", "latency"]):
    ax.set(ylabel=column, title=f"{title} as the pool shrinks", ylim=(0, 1.15 * sweep[column].max()))
    ax.legend(fontsize=8)
by_mode = sweep.set_index(["mode", "pool (blocks)"])
axes[1, 0].bar(POOL_SWEEP, by_mode.loc["recompute", "recomputed tokens"], color="C0")
axes[1, 0].set(ylabel="tokens", title="recompute's price: tokens prefilled again")
axes[1, 1].bar(POOL_SWEEP, by_mode.loc["swap", "blocks swapped out + in"], color="C1")
axes[1, 1].set(ylabel="blocks", title="swap's price: blocks copied out and in")
for ax in axes.flat:
    ax.set_xlabel(f"pool (blocks of {BLOCK_SIZE} tokens)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
plt.show()
sweep[["pool (blocks)", "mode", "steps", "generated tokens per model s", "mean latency (model ms)", "preemptions",
       "recomputed tokens", "blocks swapped out + in", "model time (ms)"]].round(1)

# %%
fits = sweep[sweep["preemptions"] == 0]["pool (blocks)"].min()
worst = sweep[sweep["pool (blocks)"] == min(POOL_SWEEP)].set_index("mode")
best = sweep[sweep["pool (blocks)"] == max(POOL_SWEEP)].iloc[0]
viz.check(best["preemptions"] == 0 and worst.loc["recompute", "preemptions"] > 0 and
          worst.loc["recompute", "mean latency (model ms)"] > best["mean latency (model ms)"],
          "the largest pool should preempt nothing and the smallest should preempt and be slower",
          defaults=(POOL_SWEEP[0] == 5 and POOL_SWEEP[-1] == 32))
print(f"Reading: in this sweep only pools of {fits} blocks or more preempt nothing. At {min(POOL_SWEEP)} blocks throughput is {worst.loc['recompute', 'generated tokens per model s']:.0f} "
      f"generated tokens per model s (recompute) against {best['generated tokens per model s']:.0f} in the roomy "
      f"pool, and mean latency {worst.loc['recompute', 'mean latency (model ms)']:.0f} model ms against "
      f"{best['mean latency (model ms)']:.0f}.")

# %% [markdown]
# Reading: a smaller pool runs fewer sequences at once, so each step generates fewer tokens and requests
# take more steps, each paying the fixed step cost; below the point where the workload fits, preemptions add
# work (recomputed tokens, or swapped blocks) on top. This is the curve a server operator tunes with
# `gpu_memory_utilization`, the block size, the batch limits and the preemption mode, and the reason every
# block that paging and prefix caching save (notebooks 01-08) turns into throughput.

# %% [markdown]
# ## 6. Chunked prefill: V0 against V1 scheduling
#
# With `scheduling="v1"` kvlab's scheduler works like vLLM V1's: one token budget per step, running requests
# first (one decode token each), then waiting prompts, and a prompt that does not fit what is left of the
# budget is prefilled in chunks over several steps. A step can then be **mixed**: prefill chunks and decode
# tokens in one forward pass.
#
# A new workload shows the difference: two short requests (A, B) decode 30 tokens each while two long
# prompts of `LONG_PROMPT` tokens arrive (C before step 4, D before step 10). For a decoding request what
# matters is the **longest gap** between two of its tokens, in steps and in tokens computed meanwhile; for a
# long prompt, its **time to first token**. Steps do not cost the same: the step-time model of the knobs
# cell (an assumption for illustration, not a measurement) turns both into milliseconds.

# %%
LONG_PROMPT = 64                        # C's and D's prompt tokens: V0 needs a budget at least this large
BUDGET_SWEEP = [16, 24, 32, 48, 64, 96, 128]
MIX_BUDGET = 64                         # the budget of the per-step picture (V0 can serve it)
CHUNK_WORKLOAD = {"A": (12, 0, 30), "B": (14, 0, 30), "C": (LONG_PROMPT, 4, 8), "D": (LONG_PROMPT, 10, 8)}
chunk_prompts = {name: np.random.default_rng(SEED + i).integers(0, 500, size=n).tolist()
                 for i, (name, (n, _, _)) in enumerate(CHUNK_WORKLOAD.items())}


@cache
def chunk_run(scheduling, budget):
    """Steps (one row each) and, per request, the step that gave each of its tokens."""
    llm = LLM(MODEL_DIR, block_size=BLOCK_SIZE, num_blocks=64, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=budget, scheduling=scheduling, seed=SEED, record_decisions=True)
    pending, token_steps = dict(CHUNK_WORKLOAD), {}
    while pending or llm.has_unfinished_requests():
        step = len(llm.step_records)
        for name in [n for n, (_, arrives, _) in pending.items() if arrives <= step]:
            max_tokens = pending.pop(name)[2]
            llm.add_request(chunk_prompts[name], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True), request_id=name)
        llm.step()
    for decision in llm.decisions:  # a request gets a token at each step that computes its last position
        for seq in decision.ran:
            if seq.samples:
                token_steps.setdefault(seq.request_id, []).append(decision.step)
    return llm.step_dataframe(), token_steps


def stall_summary(scheduling, budget):
    """A and B's longest decode gap and C and D's time to first token, in steps, tokens and model ms."""
    steps, token_steps = chunk_run(scheduling, budget)
    tokens, ms = steps["num_tokens"].to_numpy(), step_ms(steps)
    gaps = [(b - a, tokens[a + 1:b + 1].sum(), ms[a + 1:b + 1].sum())
            for n in "AB" for a, b in zip(token_steps[n], token_steps[n][1:])]
    ttft = [(t[0] + 1 - CHUNK_WORKLOAD[n][1], tokens[CHUNK_WORKLOAD[n][1]:t[0] + 1].sum(),
             ms[CHUNK_WORKLOAD[n][1]:t[0] + 1].sum()) for n, t in token_steps.items() if n in "CD"]
    longest = max(gaps, key=lambda g: g[2])
    return {"scheduling": scheduling, "budget": budget, "steps": len(steps),
            "longest decode gap (steps)": longest[0], "longest decode gap (tokens)": longest[1],
            "longest decode gap (model ms)": longest[2], "long prompt TTFT (steps)": np.mean([t[0] for t in ttft]),
            "long prompt TTFT (model ms)": np.mean([t[2] for t in ttft])}


fig, axes = plt.subplots(2, 1, figsize=(12, 5), layout="constrained", sharex=True, sharey=True)
for ax, scheduling in zip(axes, ("v0", "v1")):
    steps, _ = chunk_run(scheduling, MIX_BUDGET)
    ax.bar(steps["step"], steps["prefill_tokens"], color="#4e79a7", label="prefill tokens")
    ax.bar(steps["step"], steps["decode_tokens"], bottom=steps["prefill_tokens"], color="#59a14f",
           label="decode tokens")
    ax.axhline(MIX_BUDGET, color="gray", ls="--", lw=1, label=f"budget ({MIX_BUDGET})")
    ax.set(ylabel="tokens in the step", title=f"{scheduling.upper()} scheduling: what each step computed")
    ax.legend(fontsize=8, loc="upper right")
axes[1].set_xlabel("engine step")
plt.show()

# %% [markdown]
# In V0 the steps where C and D are prefilled have no decode tokens (no green): A and B wait a whole step.
# In V1 every step has A's and B's decode tokens, and C's prompt is cut where the budget runs out, its rest
# going into the next step. Now the budget sweep: V0 runs only budgets that hold a whole long prompt.

# %%
stalls = pd.DataFrame([stall_summary(s, b) for s in ("v0", "v1") for b in BUDGET_SWEEP
                       if s == "v1" or b >= LONG_PROMPT])
STALL_COLUMNS = ["longest decode gap (tokens)", "longest decode gap (model ms)", "long prompt TTFT (model ms)"]
fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), layout="constrained")
for scheduling, rows in stalls.groupby("scheduling"):
    for ax, column in zip(axes, STALL_COLUMNS):
        ax.plot(rows["budget"], rows[column], "o-", label=scheduling.upper())
for ax, column, title in zip(axes, STALL_COLUMNS, ["work between two tokens of A or B",
                                                   "the decode stall, step-time model",
                                                   "C and D's first token, step-time model"]):
    ax.set(xlabel="token budget per step (max_num_batched_tokens)", ylabel=column, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
plt.show()
stalls.round(1)

# %%
v0, v1 = (stalls[(stalls["scheduling"] == s) & (stalls["budget"] == MIX_BUDGET)].iloc[0] for s in ("v0", "v1"))
small = stalls[(stalls["scheduling"] == "v1")].iloc[0]
viz.check(v0["longest decode gap (steps)"] >= 2 and v1["longest decode gap (steps)"] == 1 and
          v1["longest decode gap (tokens)"] < v0["longest decode gap (tokens)"],
          "V1 should never skip a decode step here, and V0 should", defaults=(LONG_PROMPT == 64 and MIX_BUDGET == 64))
print(f"Reading: at budget {MIX_BUDGET}, V0 makes A or B wait {v0['longest decode gap (steps)']:.0f} steps "
      f"({v0['longest decode gap (tokens)']:.0f} tokens computed between two of its tokens, "
      f"{v0['longest decode gap (model ms)']:.1f} model ms); V1 gives them a token every step, the longest gap "
      f"{v1['longest decode gap (tokens)']:.0f} tokens ({v1['longest decode gap (model ms)']:.1f} ms). A V1 "
      f"budget of {small['budget']:.0f} bounds the gap to {small['longest decode gap (model ms)']:.1f} ms but C and "
      f"D wait {small['long prompt TTFT (steps)']:.1f} steps for their first token "
      f"({small['long prompt TTFT (model ms)']:.1f} ms) instead of {v1['long prompt TTFT (steps)']:.1f}: "
      "the budget trades decode smoothness against time to first token.")

# %% [markdown]
# > **In vLLM.** This is V1's scheduler (`vllm/v1/core/sched/scheduler.py`): running requests are scheduled
# > first, then waiting ones, each taking at most what is left of the step's token budget, so a long prompt
# > is prefilled over several steps and shares them with decodes. `python -m kvlab.bench engine --suite
# > scheduling` measures the same comparison in wall time on nano-vllm's workload shape.
#
# **Try it.** Predict, then set `LONG_PROMPT = 120`: which V0 budgets remain, and how long is V0's stall now?

# %% [markdown]
# ## Takeaways
#
# * Continuous batching admits and retires requests between steps; with V0 scheduling (like nano-vllm and
#   vLLM V0 without chunked prefill) each step is a prefill or a decode, so a prefill pauses decoding.
# * `can_allocate` answers OK / LATER / NEVER; a watermark keeps blocks free for running sequences to grow
#   into, trading admission for fewer preemptions.
# * Preemption by recompute costs tokens computed again (partly saved by prefix hits on the victim's own
#   blocks) and sometimes whole extra prefill steps; by swap, blocks copied out and back. Which costs more
#   depends on the step-time model (here an assumption, not a measurement). Outputs are identical either way.
# * A token budget bounds each step's work at the price of later first tokens for queued prompts; chunked
#   prefill (V1 scheduling) removes most of that trade: the longest decode gap is one step of at most
#   the budget, and the price moves to the long prompt's time to first token.
# * Throughput and latency degrade smoothly as the pool shrinks, until preemptions start throwing work away.
