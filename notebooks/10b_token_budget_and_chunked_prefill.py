# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 10b · The token budget and chunked prefill
#
# Notebook 10a watched the scheduler when the KV pool is the limit. Here the pool is roomy and the limit is
# the other one a server sets: the **token budget**, how many tokens one engine step may compute
# (`max_num_batched_tokens`). It decides how long a running request waits for its next token while a long
# prompt is prefilled, and how long that prompt waits for its first token.
#
# **Objectives.** After this notebook you can:
# 1. say what a token budget bounds with whole-prompt (V0) scheduling, and what it costs: every prompt must
#    fit the budget whole, prefill takes more steps, and first tokens come later;
# 2. read a V1 step (`scheduling="v1"`, **chunked prefill**): running requests' decode tokens first, then
#    prefill chunks cut where the budget runs out, so a step can be **mixed** and decoding never pauses;
# 3. pick a budget by trading the **decode stall** (the longest wait between two tokens of a running request)
#    against a long prompt's **time to first token**.
#
# As in 10a, everything runs on a tiny random model (nothing is downloaded, the text is noise), and costs are
# counted in **engine steps** and **tokens**, then turned into time by the **step-time model** of the knobs
# cell: a step takes `STEP_MS + TOKEN_MS x tokens`. The model is an **assumption for illustration**, not a
# measurement: wall times of this machine say nothing about a GPU.

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
import tempfile
from functools import cache

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from kvlab import viz
from kvlab.course import answer
from kvlab.device import DEVICE
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.random_model import save_random_model
from kvlab.engine.replay import Arrival, replay

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BLOCK_SIZE = 8          # tokens per KV block
NUM_BLOCKS = 64         # a roomy pool: nothing is preempted here (10a is about preemption)
MAX_NUM_SEQS = 8        # sequences in a batch at most
TOKEN_BUDGET = 256      # section 1's wide budget (max_num_batched_tokens)
SMALL_BUDGET = 32       # section 1's tight budget: about one prompt per step (the longest prompt has 30 tokens)
V0_BUDGETS = [32, 48, 64, 128, 256]      # section 1's sweep (V0: each must hold a whole prompt)
LONG_PROMPT = 64        # sections 2-3: C's and D's prompt tokens; V0 needs a budget at least this large
MIX_BUDGET = 64         # section 2: the budget V0 and V1 are compared at (V0's smallest for LONG_PROMPT)
CHUNK_BUDGET = 24       # section 2: a V1 budget well below LONG_PROMPT, so C's prompt spans several steps
BUDGET_SWEEP = [16, 24, 32, 48, 64, 96, 128]  # section 3
SEED = 0
# The step-time model: an assumption for illustration, not fitted to any measurement.
STEP_MS, TOKEN_MS = 5.0, 0.1   # a step's fixed cost, and its cost per token computed (prefill or decode)

DEFAULTS = (BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_SEQS, TOKEN_BUDGET, SMALL_BUDGET, V0_BUDGETS, LONG_PROMPT, MIX_BUDGET,
            CHUNK_BUDGET, BUDGET_SWEEP, SEED, STEP_MS, TOKEN_MS) == (
    8, 64, 8, 256, 32, [32, 48, 64, 128, 256], 64, 64, 24, [16, 24, 32, 48, 64, 96, 128], 0, 5.0, 0.1)
# One layer, one KV head of 16 dimensions: the smallest model the kernels take, so every run is quick. At
# this size extra CPU threads only add overhead (and crawl on a shared machine): one is fastest.
torch.set_num_threads(1)
MODEL_DIR = save_random_model(tempfile.mkdtemp() + "/tiny-qwen3", "tiny", num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def step_ms(steps):
    """Each step's time under the step-time model; `steps` is a `step_dataframe()`."""
    return (STEP_MS + TOKEN_MS * steps["num_tokens"]).to_numpy()


@cache
def run(workload_name, scheduling, budget, long_prompt=LONG_PROMPT):
    """One engine run of a workload below (`kvlab.engine.replay`: each request added before its step)."""
    llm = LLM(MODEL_DIR, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=budget, scheduling=scheduling, seed=SEED,
              record_decisions=True)  # llm.decisions: what the replay reads
    work = bursts() if workload_name == "bursts" else long_prompts(long_prompt)
    return replay(llm, work)


# %% [markdown]
# ## 1. A token budget per step, without chunking
#
# The workload of 10a: six requests, A to F, arriving in three bursts over the first 8 steps, prompts of 12
# to 30 tokens, 10 generated tokens each (greedy, `ignore_eos`: every run generates the same tokens).
# `max_num_batched_tokens` caps the tokens one step may compute, so a burst of prompts cannot make one
# enormous prefill step while everybody else waits. V0 scheduling does not chunk prompts, so every prompt must
# fit the budget on its own; with a budget of about one prompt, each burst (A, B and C; then E and F) is
# admitted one prompt per step. Budget `TOKEN_BUDGET` against `SMALL_BUDGET`:

# %%
NAMES = "ABCDEF"
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def bursts():
    """10a's six requests: 12-30 random prompt tokens, added before steps 0, 0, 0, 4, 8, 8."""
    rng = np.random.default_rng(SEED)
    return {name: Arrival(rng.integers(0, 500, size=int(rng.integers(12, 31))).tolist(), step, PARAMS)
            for name, step in zip(NAMES, (0, 0, 0, 4, 8, 8))}


budgets = {budget: run("bursts", "v0", budget) for budget in (TOKEN_BUDGET, SMALL_BUDGET)}
backend = budgets[TOKEN_BUDGET].llm.attention_backend
print(f"the engine runs on {DEVICE} with the {backend!r} attention backend (torch on a CPU, kvlab's Triton "
      "kernels on a GPU); either way the costs below are counted, not timed")
fig, axes = plt.subplots(2, 1, figsize=(12, 5.5), layout="constrained", sharex=True)
for ax, (budget, r) in zip(axes, budgets.items()):
    viz.draw_schedule(r.schedule_frame(), ax=ax, title=f"V0, budget {budget} tokens per step")
    ax.tick_params(labelbottom=True)
plt.show()
by_budget = pd.DataFrame({f"budget {budget}": {
    "prefill steps": int((r.llm.step_dataframe()["kind"] == "prefill").sum()),
    "largest prefill step (tokens)": int(r.llm.step_dataframe()["num_tokens"].max()),
    **{f"{n}: time to first token (steps)": steps for n, steps in r.time_to_first_token().items()}}
    for budget, r in budgets.items()})
first_tokens = by_budget[f"budget {SMALL_BUDGET}"].filter(like="time to first token").to_dict()
viz.check(by_budget.loc["largest prefill step (tokens)", f"budget {SMALL_BUDGET}"] <= SMALL_BUDGET and
          [first_tokens[f"{n}: time to first token (steps)"] for n in "ABCEF"] == [1, 2, 3, 1, 2],
          "the small budget should admit each burst one prompt per step (A, B, C; then E, F)", defaults=DEFAULTS)
by_budget

# %% [markdown]
# The small budget caps the largest step, but the same prefill work now takes more steps: queued prompts get
# their first token later, and every extra prefill step pauses all running requests (pale green). The
# step-time model puts both sides of the trade in milliseconds, over a sweep of budgets: the mean time to
# first token, and the longest wait of any request between two of its tokens (its decode stall).

# %%
def budget_summary(budget):
    r = run("bursts", "v0", budget)
    steps = r.llm.step_dataframe()
    ms = step_ms(steps)
    return {"budget": budget, "steps": len(steps), "prefill steps": int((steps["kind"] == "prefill").sum()),
            "mean time to first token (model ms)": np.mean(list(r.time_to_first_token(ms).values())),
            "longest decode gap (model ms)": r.longest_gap(ms)["cost"]}


budget_sweep = pd.DataFrame([budget_summary(b) for b in V0_BUDGETS])
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
for ax, column in zip(axes, ["mean time to first token (model ms)", "longest decode gap (model ms)"]):
    ax.plot(budget_sweep["budget"], budget_sweep[column], "o-")
    ax.set(xlabel="token budget per step (max_num_batched_tokens)", ylabel=column, title=f"V0: {column}",
           xscale="log", ylim=(0, 1.15 * budget_sweep[column].max()))
    ax.set_xticks(V0_BUDGETS, [str(b) for b in V0_BUDGETS])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
plt.show()
budget_sweep.round(1)

# %%
tight, wide = (budget_sweep.set_index("budget").loc[b] for b in (SMALL_BUDGET, TOKEN_BUDGET))
viz.check(tight["prefill steps"] > wide["prefill steps"] and
          tight["mean time to first token (model ms)"] > wide["mean time to first token (model ms)"] and
          budget_sweep["longest decode gap (model ms)"].is_monotonic_decreasing,
          "the small budget should need more prefill steps and give later first tokens, and no smaller budget "
          "should shorten the longest decode stall", defaults=DEFAULTS)
print(f"Reading: from budget {TOKEN_BUDGET} to {SMALL_BUDGET}, prefill steps go from {wide['prefill steps']:.0f} to "
      f"{tight['prefill steps']:.0f}, the mean time to first token from "
      f"{wide['mean time to first token (model ms)']:.1f} to {tight['mean time to first token (model ms)']:.1f} "
      f"model ms, and the longest decode stall from {wide['longest decode gap (model ms)']:.1f} to "
      f"{tight['longest decode gap (model ms)']:.1f} ms. Without chunking the budget cannot cut a stall below one "
      "whole prompt's prefill step, and consecutive small prefill steps each pay the fixed STEP_MS: a budget "
      "mostly spreads prefill over time. Chunked prefill (next section) bounds both.")

# %% [markdown]
# ## 2. Chunked prefill: V0 against V1 scheduling
#
# With `scheduling="v1"` kvlab's scheduler works like vLLM V1's: one token budget per step, running requests
# first (one decode token each), then waiting prompts, and a prompt that does not fit what is left of the
# budget is prefilled in chunks over several steps. A step can then be **mixed**: prefill chunks and decode
# tokens in one forward pass.
#
# A new workload shows the difference: two short requests (A, B) decode 30 tokens each while two long
# prompts of `LONG_PROMPT` tokens arrive (C before step 4, D before step 10). For a decoding request what
# matters is the **longest gap** between two of its tokens, in steps and in tokens computed meanwhile; for a
# long prompt, its **time to first token**.
#
# Below, each bar is one step: its prefill tokens (blue, labelled with whose prompt and how many of its
# tokens) and its decode tokens (green). V0 needs a budget of at least `LONG_PROMPT`; at that same budget V1
# decodes A and B first, so only the tokens they took spill over into the next step. At a budget well below
# the prompt, V1 cuts it into chunks that span several steps.

# %%
def long_prompts(long_prompt):
    """A and B: short prompts, 30 tokens each; C and D: long_prompt tokens, added before steps 4 and 10."""
    shape = {"A": (12, 0, 30), "B": (14, 0, 30), "C": (long_prompt, 4, 8), "D": (long_prompt, 10, 8)}
    return {name: Arrival(np.random.default_rng(SEED + i).integers(0, 500, size=n).tolist(), step,
                          SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for i, (name, (n, step, max_tokens)) in enumerate(shape.items())}


PICTURES = [("v0", MIX_BUDGET), ("v1", MIX_BUDGET), ("v1", CHUNK_BUDGET)]
fig, axes = plt.subplots(len(PICTURES), 1, figsize=(12, 8), layout="constrained", sharex=True)
for ax, (scheduling, budget) in zip(axes, PICTURES):
    r = run("long", scheduling, budget)
    steps = r.llm.step_dataframe()
    ax.bar(steps["step"], steps["prefill_tokens"], color="#4e79a7", label="prefill tokens")
    ax.bar(steps["step"], steps["decode_tokens"], bottom=steps["prefill_tokens"], color="#59a14f",
           label="decode tokens")
    for decision in r.llm.decisions:  # label each prefill chunk of a long prompt: whose, and how long
        below, total = 0, sum(seq.num_tokens for seq in decision.ran)
        for seq in decision.ran:
            if seq.prefill and seq.request_id in "CD":
                label = f"{seq.request_id}\n{seq.num_tokens}"
                if seq.num_tokens >= 10:  # inside its chunk
                    ax.text(decision.step, below + seq.num_tokens / 2, label, ha="center", va="center", fontsize=9)
                else:  # too thin to hold a label: above the bar
                    ax.text(decision.step, total + 1, label, ha="center", va="bottom", fontsize=9)
            below += seq.num_tokens if seq.prefill else 0
    ax.axhline(budget, color="gray", ls="--", lw=1, label=f"budget ({budget})")
    ax.set(ylabel="tokens in the step", ylim=(0, 1.25 * MIX_BUDGET),
           title=f"{scheduling.upper()} scheduling, budget {budget}: what each step computed")
    ax.tick_params(labelbottom=True)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8, loc="upper right")
axes[-1].set_xlabel("engine step")
plt.show()

# %%
chunks = {(s, b): [seq.num_tokens for d in run("long", s, b).llm.decisions for seq in d.ran
                   if seq.prefill and seq.request_id == "C"] for s, b in PICTURES}
viz.check(len(chunks["v0", MIX_BUDGET]) == 1 and len(chunks["v1", CHUNK_BUDGET]) >= 3,
          "V0 should prefill C's prompt in one step and V1 at the small budget in three or more chunks",
          defaults=DEFAULTS)
print(f"Reading: C's {LONG_PROMPT}-token prompt is prefilled as {chunks['v0', MIX_BUDGET]} in V0 at budget "
      f"{MIX_BUDGET} (A and B get no token in that step), as {chunks['v1', MIX_BUDGET]} in V1 at the same budget "
      f"(A's and B's decode tokens come first, so the last tokens of the prompt move to the next step), and as "
      f"{chunks['v1', CHUNK_BUDGET]} in V1 at budget {CHUNK_BUDGET}, where every one of those steps also decodes "
      "A and B.")

# %% [markdown]
# ## 3. Choosing the budget: the decode stall against time to first token
#
# Now the budget sweep, in steps, tokens and model ms. V0 runs only the budgets that hold a whole long prompt.

# %%
def stall_summary(scheduling, budget, long_prompt=LONG_PROMPT):
    """A and B's longest decode gap and C and D's time to first token, in steps, tokens and model ms."""
    r = run("long", scheduling, budget, long_prompt)
    steps = r.llm.step_dataframe()
    tokens, ms = steps["num_tokens"].to_numpy(), step_ms(steps)
    gap = r.longest_gap(ms, requests="AB")
    return {"scheduling": scheduling, "budget": budget, "steps": len(steps),
            "longest decode gap (steps)": gap["steps"],
            "longest decode gap (tokens)": tokens[gap["start"] + 1:gap["end"] + 1].sum(),
            "longest decode gap (model ms)": gap["cost"],
            "long prompt TTFT (steps)": np.mean([r.time_to_first_token()[n] for n in "CD"]),
            "long prompt TTFT (model ms)": np.mean([r.time_to_first_token(ms)[n] for n in "CD"])}


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
    ax.set(xlabel="token budget per step (max_num_batched_tokens)", ylabel=column, title=title, xscale="log",
           ylim=(0, 1.15 * stalls[column].max()))
    ax.set_xticks(BUDGET_SWEEP, [str(b) for b in BUDGET_SWEEP])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
plt.show()
stalls.round(1)

# %%
v0, v1 = (stalls[(stalls["scheduling"] == s) & (stalls["budget"] == MIX_BUDGET)].iloc[0] for s in ("v0", "v1"))
small = stalls[(stalls["scheduling"] == "v1")].iloc[0]
v1_rows = stalls[stalls["scheduling"] == "v1"]
viz.check(v0["longest decode gap (steps)"] >= 2 and v1["longest decode gap (steps)"] == 1 and
          v1["longest decode gap (tokens)"] < v0["longest decode gap (tokens)"],
          "V1 should never skip a decode step here, and V0 should", defaults=DEFAULTS)
viz.check((v1_rows["longest decode gap (steps)"] == 1).all() and
          (v1_rows["longest decode gap (tokens)"] <= v1_rows["budget"]).all() and
          v1_rows["longest decode gap (tokens)"].is_monotonic_increasing and
          v1_rows["long prompt TTFT (model ms)"].is_monotonic_decreasing,
          "in V1 the longest decode gap should be one step of at most the budget, and a smaller budget should give "
          "a shorter gap and a later first token", defaults=DEFAULTS)
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

# %% [markdown]
# ### Exercise: a longer prompt
#
# Predict before you run anything: if C's and D's prompts had 120 tokens instead of 64, which budgets of
# `BUDGET_SWEEP` could V0 still run, and, at the largest of them, about how many tokens would the engine
# compute between two tokens of A or B (V0's longest decode gap, in tokens)? Set the two `PREDICTED_` values
# and run the cell; it runs the 120-token workload and compares (the token count is right within 10%).

# %%
PREDICTED_V0_BUDGETS_AT_120 = None    # a list of budgets from BUDGET_SWEEP in increasing order, e.g. [64, 96]
PREDICTED_V0_STALL_AT_120 = None      # an int: tokens computed between two tokens of A or B

fits_120 = [b for b in BUDGET_SWEEP if b >= 120]
at_120 = stall_summary("v0", max(fits_120), long_prompt=120)
stall_120 = int(at_120["longest decode gap (tokens)"])
answer(PREDICTED_V0_BUDGETS_AT_120, fits_120, f"V0 prefills a prompt in one step, so only a budget of at least "
       f"120 tokens can run it: {fits_120} of {BUDGET_SWEEP}.")
answer(PREDICTED_V0_STALL_AT_120, stall_120, f"At budget {max(fits_120)} A and B wait "
       f"{at_120['longest decode gap (steps)']:.0f} steps: a whole prefill step of a 120-token prompt, which gives "
       "them nothing, and the decode step that gives them their next token.", rel_tol=0.1)

# %% [markdown]
# **Answer.** Only budget **128** holds a 120-token prompt whole, and V0's
# longest decode gap there is printed below: a whole step of the long prompt's prefill, which gives A and B
# nothing, plus the decode step that finally gives them their token (about 120 + 4 tokens). V1 at any budget
# of the sweep still gives A and B a token every step.

# %%
v1_gaps_at_120 = [stall_summary("v1", b, long_prompt=120)["longest decode gap (steps)"] for b in BUDGET_SWEEP]
viz.check(fits_120 == [128] and 120 < stall_120 <= 130 and set(v1_gaps_at_120) == {1},
          "the answer says: only budget 128, a gap of about 120 + 4 tokens, and V1 a token every step",
          defaults=DEFAULTS)
print(f"V0 budgets for 120-token prompts: {fits_120}; longest decode gap at {max(fits_120)}: {stall_120} tokens; "
      f"V1's longest gap at every budget of the sweep: {max(v1_gaps_at_120)} step")

# %% [markdown]
# ## Takeaways
#
# * A token budget bounds each step's work. Without chunking (V0) every prompt must fit it whole, so a small
#   budget only spreads prefill over more steps: first tokens come later and no stall gets shorter than one
#   whole prompt's prefill step.
# * Chunked prefill (V1 scheduling, as vLLM V1) schedules running requests' decode tokens first and cuts
#   prompts where the budget runs out: a step can be mixed, and the longest decode gap is one step of at most
#   the budget.
# * The budget then trades the decode stall against a long prompt's time to first token: a smaller budget
#   gives smoother decoding and a later first token.
