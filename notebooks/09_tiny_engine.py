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
# # 09 · A tiny serving engine
#
# Notebooks 01-08 took the paged KV cache apart: the block manager hands out blocks, shares prefixes and
# forks, and the kernels write and read keys and values through block tables. This notebook puts them back
# together. `kvlab.engine` serves a real model architecture (Llama or Qwen3, loaded from a Hugging Face
# directory) with **continuous batching**: requests join and leave between steps, every step is either a
# *prefill* (new prompts) or a *decode* (one new token for every running sequence), and every byte of K/V
# lives in kvlab's paged cache.
#
# We run it one step at a time and watch the pool: requests arriving, a prefix hit skipping compute, the pool
# filling up until a sequence is preempted, a fork with copy-on-write. Then the whole run as a timeline, a
# check against Hugging Face `transformers`, and throughput and memory from the benchmark.

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

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display

import kvlab
from kvlab import viz
from kvlab.device import DEVICE, mode
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.random_model import save_random_model

# A real model directory (see the README's "Serve a model"), or a tiny random Qwen3 written here: nothing is
# downloaded. Random weights make noise instead of text, but every kernel launch and block is real.
MODEL_DIR = os.environ.get("KVLAB_MODEL") or save_random_model(Path(tempfile.mkdtemp()) / "tiny-qwen3", "tiny")
print(f"kernels run in {mode()} mode on {DEVICE}; model: {MODEL_DIR}")

# %% [markdown]
# ## 1. Two requests arrive
#
# A deliberately tiny pool: 12 blocks of 8 tokens (the knobs `NUM_BLOCKS` and `PREEMPTION_MODE` are for the
# "Try it" in section 3; the numbers in the text are for the defaults). Both requests start with the same 20-token "system
# prompt" (two full blocks and a partial one), then differ. `add_request` only queues them; `step()` runs one
# engine step and returns the requests that finished in it.

# %%
NUM_BLOCKS = 12                  # GPU-pool blocks of 8 tokens
PREEMPTION_MODE = "recompute"    # or "swap": copy the victim's blocks to a CPU pool of 16 blocks
llm = LLM(MODEL_DIR, block_size=8, num_blocks=NUM_BLOCKS, max_num_seqs=8, max_num_batched_tokens=64,
          preemption_mode=PREEMPTION_MODE, num_cpu_blocks=16, scheduling="v0")  # whole-prompt steps
SYSTEM = list(range(100, 120))
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
COLUMNS = ["step", "kind", "num_seqs", "num_tokens", "cached_tokens", "blocks_used", "blocks_free", "blocks_cached",
           "preempted", "cow_copies", "waiting", "running"]
done = {}       # request id -> its RequestOutput, once finished
names = {}      # sequence id -> a readable name, for the pictures


def step(times=1):
    """Run ``times`` engine steps, keeping the outputs of requests that finish."""
    for _ in range(times):
        done.update((out.request_id, out) for out in llm.step())


def step_until(condition, limit=50):
    """Step until ``condition(last step record)`` holds and return that record; None if every request finished
    (or ``limit`` steps ran) first."""
    for _ in range(limit):
        if not llm.has_unfinished_requests():
            return None
        step()
        if condition(llm.step_records[-1]):
            return llm.step_records[-1]
    return None


def add(name, prompt, params=GREEDY):
    llm.add_request(prompt, params, request_id=name)
    names[llm.scheduler.waiting[-1].seq_id] = name


def draw(title):
    """Block tables of every sequence the scheduler holds (running, swapped, then waiting) over the pool."""
    seqs = llm.scheduler.running + list(llm.scheduler.swapped) + list(llm.scheduler.waiting)
    viz.draw_block_tables(llm.block_manager, seqs, names=names, title=title)  # tables labelled A, B, ...
    plt.show()


add("A", SYSTEM + [7, 8, 9])
add("B", SYSTEM + [30, 31, 32, 33, 34])
step()
draw("after the first step: A and B prefilled together")
llm.step_dataframe()[COLUMNS]

# %% [markdown]
# One prefill step ran both prompts. B needed 25 tokens of K/V but the step computed only 23 + 9 = 32 tokens
# in all, with `cached_tokens` = 16: B's first two blocks **are** A's (ref count 2 in the picture). That hit
# happened inside a single step, which is safe because of the ordering rule: in every layer,
# `reshape_and_cache` writes all new tokens' K/V (A's system prompt among them) before `paged_prefill`
# reads the cache for anyone.

# %% [markdown]
# ## 2. A prefix hit skips compute
#
# Two decode steps later, request C arrives with the same system prompt. It joins the running batch at the
# next step (a prefill step: new prompts go first).

# %%
step(2)
add("C", SYSTEM + [50, 51])
step()
print(f"C: {llm.block_manager.stats.hit_tokens} prompt tokens hit so far; C's prefill computed "
      f"{llm.step_records[-1].num_tokens} of its {len(SYSTEM) + 2} tokens")
draw("C joined: its first two blocks are the system prompt's")
llm.step_dataframe()[COLUMNS]

# %% [markdown]
# C's prefill computed 6 tokens instead of 22: its queries attend to all 22 positions, but 16 of them are read
# from the cache through C's block table (`paged_prefill` over a cached prefix, notebook 06), never recomputed.
# On a GPU that is most of a long prompt's time to first token.
#
# ## 3. The pool fills up: preemption
#
# Request D brings 26 unrelated tokens (4 blocks). Everybody keeps decoding; each sequence needs a fresh block
# every 8 tokens. When one needs a block and none is free, the scheduler **preempts** the newest running
# sequence. The default mode is *recompute* (vLLM V1's only mode, and V0's for single-sequence requests): free
# its blocks and queue it again at the front.

# %%
add("D", list(range(200, 226)))
record = step_until(lambda r: r.preempted)
if record is None:
    print(f"no preemption: {NUM_BLOCKS} blocks were enough for everybody")
else:
    print(f"step {record.step}: {record.preempted} sequence preempted ({PREEMPTION_MODE}); waiting: "
          f"{[names[s.seq_id] for s in llm.scheduler.waiting]}, swapped out: "
          f"{[names[s.seq_id] for s in llm.scheduler.swapped]}")
draw("a sequence was preempted: its blocks went back to the pool")
llm.step_dataframe()[COLUMNS].tail(4)

# %% [markdown]
# Freeing a preempted sequence does not erase its blocks: full blocks stay *cached* (warm) until something
# else needs them. So when D is admitted again, its recompute hits most of its own old K/V:

# %%
record = step_until(lambda r: r.kind == "prefill" or r.blocks_swapped_in)
if record is None:
    print("nothing was preempted, so nothing comes back")
elif record.blocks_swapped_in:
    print(f"swapped back in at step {record.step}: {record.blocks_swapped_in} blocks copied back from the CPU "
          "pool, nothing recomputed")
else:
    print(f"re-admitted at step {record.step}: {record.num_tokens} tokens computed, {record.cached_tokens} read "
          "from the prefix cache")

# %% [markdown]
# With `LLM(..., preemption_mode="swap")` the victim's blocks are copied to a CPU pool with `swap_blocks`
# instead and copied back when there is room (vLLM V0 swapped groups of several sequences, such as parallel
# samples, and recomputed single ones; kvlab applies the mode you choose to every sequence). The timeline
# below shows both kinds of work.
#
# **Try it.** Predict first, then change a knob in section 1 and run the notebook again:
# - `PREEMPTION_MODE = "swap"`: what does the preempted sequence's comeback cost now? Recompute pays in
#   tokens computed again (minus what the prefix cache still holds); swap pays in blocks copied out and back
#   (`blocks_swapped_out` / `blocks_swapped_in` in the step table) and needs no prefill. Notebook 10 compares
#   the two on a whole workload.
# - `NUM_BLOCKS = 16`: is anybody preempted? Count the blocks A-D need at their longest (prompt + 10 tokens,
#   8 tokens per block, shared system-prompt blocks counted once) before you run it.
#
# ## 4. Parallel sampling: a fork with copy-on-write
#
# `SamplingParams(n=3)` prefills the prompt once, then forks two more sequences from it: all three point at
# the same blocks. The prompt has 13 tokens, so its second block is partial and shared; the first decode step
# writes into it, and the block manager answers with copy-on-write pairs, applied by `copy_blocks` before the
# step's attention.

# %%
while llm.has_unfinished_requests():
    step()
before = len(llm.step_records)
llm.add_request(list(range(300, 313)), SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
                request_id="F")
step()
for k, seq in enumerate(llm.scheduler.running):
    names[seq.seq_id] = f"F sample {k}"
draw("F prefilled and forked: three samples, the same two blocks (ref count 3)")
step()
print(f"copy-on-write copies in that decode step: {llm.step_records[-1].cow_copies}")
draw("after one decode step: two samples got private copies of the partial block")

# %% [markdown]
# ## 5. The whole run as a timeline
#
# `llm.step_dataframe()` has one row per step; `kvlab.viz.draw_engine_timeline` draws it step by step: the
# prefills with prefix hits, the preemption and the recompute, the copy-on-write step. (With `x="time"` every
# bar is as wide as its step took, and the gaps are whatever ran between steps, here the notebook's own drawing;
# on a CPU those widths are torch-on-CPU time (or, with `attention_backend="triton"`, Triton-interpreter
# time), which says nothing about a GPU, so this notebook draws steps.)

# %%
while llm.has_unfinished_requests():
    step()
viz.draw_engine_timeline(llm, x="step", title="notebook run: A, B, C share a system prompt; D is preempted; F forks")
plt.show()
llm.step_dataframe()[COLUMNS].iloc[before:]

# %% [markdown]
# ## 6. The same tokens as Hugging Face
#
# The engine's model code is plain torch, but attention goes only through kvlab's kernels and the paged
# cache. Greedy decoding must nevertheless give exactly what `transformers` gives (the test suite checks this
# for batches, prefix hits, preemption in both modes and forks).

# %%
from transformers import AutoModelForCausalLM

hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=llm.dtype).to(DEVICE).eval()
hf.generation_config.eos_token_id = None  # like ignore_eos=True
for name in "ABCD":
    prompt = done[name].prompt_token_ids
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=10, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    ours = done[name].outputs[0].token_ids
    print(f"{name}: engine {ours}\n   HF     {reference}  {'same' if ours == reference else 'DIFFERENT'}")
    if llm.dtype == torch.float32:
        assert ours == reference

# %% [markdown]
# ## 7. Throughput and memory
#
# `python -m kvlab.bench engine` runs a nano-vllm-like offline workload (many requests with random prompt and
# output lengths) and a shared-system-prompt workload through the engine, with prefix caching on and off, and
# through Hugging Face `generate` in static batches (no paging: every batch reserves its longest prompt plus
# its longest output for every row). It writes one CSV per device under `data/bench/engine/`; the cells below
# plot whatever is there. Read CPU rows with care: the committed one ran the kernels in the Triton
# interpreter, so the engine is slow and the numbers only show what each run did, not what paging is worth on
# a GPU (without CUDA the engine now attends through a torch path by default; `--suite serving` times it).

# %%
def bench_csvs():
    """data/bench/engine in this checkout (cwd is notebooks/ in CI) or next to the installed package."""
    here = [Path.cwd().parent / "data" / "bench" / "engine",
            Path(kvlab.__file__).resolve().parent.parent / "data" / "bench" / "engine"]
    return sorted({p for d in here if d.is_dir() for p in d.glob("*.csv")})


def plot_bench(df):
    label = {(s, c): ("HF generate" if s == "hf-generate" else f"kvlab, prefix cache {'on' if c else 'off'}")
             for s, c in zip(df.system, df.prefix_caching)}
    df = df.assign(run=[label[k] for k in zip(df.system, df.prefix_caching)])
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
    for ax, column, unit in zip(axes, ["generated_tok_s", "peak_kv_mib"], ["generated tokens / s", "peak KV (MiB)"]):
        df.pivot(index="workload", columns="run", values=column).plot.bar(ax=ax, rot=0)
        ax.set(ylabel=unit, xlabel="")
        ax.legend(fontsize=8, frameon=False)
    row = df.iloc[0].to_dict()  # a dict: "dtype" would be the Series' own attribute
    fig.suptitle(f"{row['model']} ({row['params_m']}M parameters, {row['dtype']}) on {row['device']}; "
                 f"engine kernels: {row['kernels']}", fontsize=10)
    plt.show()


paths = bench_csvs()
if not paths:
    print("No engine benchmark results yet under data/bench/engine/: run `python -m kvlab.bench engine`.")
for path in paths:
    frame = pd.read_csv(path)
    plot_bench(frame)
    display(frame[["workload", "system", "prefix_caching", "generated_tok_s", "total_tok_s", "vs_hf",
                   "peak_kv_mib", "prefix_hit_rate", "preemptions"]])

# %% [markdown]
# What the engine leaves out, on purpose or for now: chunked prefill (a prompt must fit one step's token
# budget), CUDA graphs and `torch.compile`, tensor parallelism, speculative decoding, stop strings, logprobs,
# beam search, and sliding-window layers. Each step is either a prefill or a decode, never both, as in
# nano-vllm.
