# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 03a · Forks and copy-on-write
#
# **Parallel sampling** returns `n` different completions of one prompt. All of them share the prompt, so
# the block manager's `fork(parent, child)` gives the child the parent's tokens and **the same physical
# blocks** (ref counts go up, nothing is copied). A block is copied only when a sequence is about to write
# into a block someone else still uses: **copy-on-write**. `append_slots` returns those `(src, dst)` pairs,
# and the engine copies the blocks (kernel `copy_blocks`) before the forward pass writes the new tokens'
# keys and values. This notebook follows one fork from the block tables down to the cache tensor.
#
# **Objectives.** After this notebook you can:
# 1. say what `fork` shares (every block, by reference count) and predict which appends return a
#    copy-on-write pair (the first writes into a shared *partial* block) and how many blocks are in use after;
# 2. explain why the engine must apply the pairs with `copy_blocks` *before* the forward pass writes, and
#    show what goes wrong when it does not;
# 3. say how vLLM V0 and V1 share a prompt between samples (a fork against the prefix cache).
#
# Notebook 03b takes the same machinery to beam search, swapping and the memory that sharing saves.

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
import inspect

import matplotlib.pyplot as plt
import numpy as np
import torch

from kvlab import Sequence, viz
from kvlab.course import answer
from kvlab.course.forks import Blocks, TinyEngine
from kvlab.device import DEVICE, mode
from kvlab.kernels import copy_blocks  # Triton: compiled on a GPU, interpreted on CPU
from kvlab.kernels.reference import copy_blocks_ref

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BS = 8             # block size
PROMPT_LEN = 20    # the prompt: 20 = two full blocks and a partial one
NUM_SAMPLES = 3    # parallel samples
SEED = 0

DEFAULTS = (BS, PROMPT_LEN, NUM_SAMPLES, SEED) == (8, 20, 3, 0)
KERNELS = f"kvlab.kernels.copy_blocks (Triton, {mode()} mode)"
rng = np.random.default_rng(SEED)
torch.manual_seed(SEED)
print(f"block copies use {KERNELS}; cache tensors live on {DEVICE}")

# %% [markdown]
# A tiny engine ties the block manager to a cache. `kvlab.course.forks.Blocks` is what a scheduler asks of
# the block manager (prefill, fork, one decode step, free); `TinyEngine` adds a one-layer cache
# `gpu[num_blocks, 2, block_size, heads, head_dim]` and, for every sequence, the keys and values its tokens
# produced (its *truth*). After any sequence of forks and copies, `wrong_reads` reads every sequence back
# through its block table and compares it with its truth. Prefix caching is off, to keep the focus on
# forks. Its decode step is the heart of this notebook:

# %%
print(inspect.getsource(Blocks.step))
print(inspect.getsource(TinyEngine.step))

# %% [markdown]
# ## 1. Parallel sampling: one prompt, several completions
#
# The prompt has 20 tokens: two full blocks of 8 and a partial one holding 4. The parent is the first
# sample; the other samples are forked from it. All of them point at the same three blocks (ref count 3).

# %%
engine = TinyEngine(num_blocks=(PROMPT_LEN // BS + 2) * NUM_SAMPLES, block_size=BS)
parent = Sequence(rng.integers(0, 1000, size=PROMPT_LEN), BS)
engine.prefill(parent)
samples = [parent] + [engine.fork(parent) for _ in range(NUM_SAMPLES - 1)]
names = {s.seq_id: f"sample {k}" for k, s in enumerate(samples)}
fork_phases = [(0, "prefill + forks")]
steps = [viz.snapshot(engine.manager, samples, "prompt allocated, children forked", names=names)]
print(f"After the forks: tables {[s.block_table for s in samples]}, ref counts "
      f"{[engine.manager.ref_count(b) for b in parent.block_table]}, {engine.blocks_in_use()} blocks in use for "
      f"{len(samples)} sequences of {parent.num_tokens} tokens.")
viz.check(all(s.block_table == parent.block_table for s in samples)
          and all(engine.manager.ref_count(b) == len(samples) for b in parent.block_table),
          "a fork did not share every block of its parent", defaults=True)
viz.check((parent.num_tokens, PROMPT_LEN // BS, PROMPT_LEN % BS, len(samples)) == (20, 2, 4, 3),
          f"the text's prompt (20 tokens: two full blocks of 8 and a partial one holding 4, 3 samples) is now "
          f"{PROMPT_LEN} tokens in blocks of {BS} ({PROMPT_LEN // BS} full, {PROMPT_LEN % BS} in the last) and "
          f"{len(samples)} samples", defaults=DEFAULTS)

# %% [markdown]
# Each sample now draws a *different* first token. Writing it needs slot 20, which lives in the shared
# partial block: the first writers get a private copy (copy-on-write), and the last one, by then the
# block's only user, writes in place. One sample at a time so we can watch:

# %%
first_tokens = rng.integers(1000, 2000, size=len(samples))
shared_partial = parent.block_table[-1]  # the prompt's last block, shared by every sample
cow_pairs = []
fork_phases.append((len(engine.manager.events), "first token: copy-on-write"))
for seq, token in zip(samples, first_tokens):
    pairs = engine.step({seq: token})
    cow_pairs += pairs
    steps.append(viz.snapshot(engine.manager, samples, f"{names[seq.seq_id]} appends: copies {pairs or 'nothing'}",
                              names=names))
viz.show_steps(steps, ncols=2)
plt.show()
shared_blocks = parent.block_table[:PROMPT_LEN // BS]
print(f"The appends returned the copy-on-write pairs {cow_pairs}; the last writer found its block no longer "
      f"shared and wrote in place. The full prompt blocks {list(shared_blocks)} stay shared by all "
      f"{engine.manager.ref_count(shared_blocks[0]) if shared_blocks else 0}.")
last_block = ("full, so every sample starts a new block and nothing is copied" if PROMPT_LEN % BS == 0
              else "partial")
viz.check(len(cow_pairs) == len(samples) - 1 and samples[-1].block_table[-1] == shared_partial,
          f"{len(cow_pairs)} copies instead of {len(samples) - 1}, or the last writer did not write in place: with "
          f"PROMPT_LEN={PROMPT_LEN} and BS={BS} the prompt's last block is {last_block}", defaults=DEFAULTS)
viz.check(all(engine.manager.ref_count(b) == len(samples) for b in shared_blocks),
          "a full prompt block is no longer shared by every sample", defaults=True)

# %% [markdown]
# ### The kernel side
#
# The manager only hands out integers. The engine applies the pairs with `copy_blocks` (one launch for
# all pairs and layers) **before** the forward pass writes the new tokens: the copy carries the four prompt
# tokens' K/V into the new block, then each sample writes its own token at offset 4. `TinyEngine.step` did
# exactly that; every sample reads back exactly its own keys and values:

# %%
print(f"samples reading wrong K/V: {[names[i] for i in engine.wrong_reads(samples)]} (none)")
assert engine.wrong_reads(samples) == []  # whatever the knobs: copy-on-write must keep every sample's K/V
scratch = torch.randn_like(engine.gpu)
by_kernel = copy_blocks([scratch.clone()], cow_pairs)[0]
by_reference = copy_blocks_ref([scratch.clone()], cow_pairs)[0]
print(f"{KERNELS} and copy_blocks_ref agree bit for bit on the pairs {cow_pairs} (fresh random cache): "
      f"{torch.equal(by_kernel, by_reference)}")
assert torch.equal(by_kernel, by_reference)

# %% [markdown]
# What if the manager shared the block but nobody copied it? Replay the same step without applying the
# pairs: the new blocks keep whatever they held (zeros here), and the prompt's last four tokens are lost
# for the samples that moved.

# %%
broken = TinyEngine(num_blocks=engine.manager.num_blocks, block_size=BS)
p2 = Sequence(parent.token_ids[:PROMPT_LEN], BS)
broken.prefill(p2)
group = [p2] + [broken.fork(p2) for _ in range(NUM_SAMPLES - 1)]
for seq, token in zip(group, first_tokens):
    broken.step({seq: token}, apply_copies=False)
wrong = broken.wrong_reads(group)
print(f"Without the copies, {len(wrong)} of {len(group)} samples read wrong K/V: the ones whose partial block "
      "was copied on write.")
viz.check(sorted(wrong) == sorted(seq.seq_id for seq in group[:len(cow_pairs)]),
          f"{len(wrong)} samples read wrong K/V for {len(cow_pairs)} skipped copies, or not the ones that moved",
          defaults=True)

# %% [markdown]
# The samples keep decoding; none of them shares a partial block any more, so there are no more copies.
# The timeline shows the whole story: `fork` marks read `child<parent`, `cow` marks `copied block>new block`.

# %%
fork_phases.append((len(engine.manager.events), "9 more tokens each"))
for _ in range(9):
    assert engine.step({s: rng.integers(1000, 2000) for s in samples}) == []  # nothing shared is written
assert engine.wrong_reads(samples) == []
viz.check(all(engine.manager.ref_count(b) == len(samples) for b in shared_blocks),
          "after decoding, a full prompt block is no longer shared by every sample", defaults=True)
viz.draw_block_tables(engine.manager, samples, names=names,
                      title="the samples after 10 tokens each: the prompt's full blocks are shared")
plt.show()
viz.draw_timeline(engine.manager, names=names, phases=fork_phases,
                  title="parallel sampling: fork, copy-on-write, then private growth")
plt.show()

# %% [markdown]
# ## 2. Exercise: a prompt that fills its blocks
#
# Predict, for a prompt of **16** tokens (two full blocks of 8) and 3 samples: how many copy-on-write pairs
# does the first token cause, and how many blocks are in use after it? Edit the two values, then run the
# cell: it replays the fork with `Blocks` and says whether you were right.

# %%
PREDICTED_COPIES = None   # copy-on-write pairs returned by the first decode step
PREDICTED_BLOCKS = None   # blocks in use after it


def first_token(prompt_len, num_samples, block_size=8):
    """Fork ``num_samples`` sequences from a prompt, append one token each; return (pairs, blocks in use)."""
    blocks = Blocks(num_blocks=4 * num_samples + prompt_len // block_size, block_size=block_size)
    parent = Sequence(range(prompt_len), block_size)
    blocks.prefill(parent)
    group = [parent] + [blocks.fork(parent) for _ in range(num_samples - 1)]
    pairs = blocks.step({seq: 1000 + k for k, seq in enumerate(group)})
    return len(pairs), blocks.blocks_in_use()


copies, in_use = first_token(16, 3)
answer(PREDICTED_COPIES, copies, "The prompt's last block is full, so every sample's first token opens a new "
       "block of its own: nothing shared is written, nothing is copied.")
answer(PREDICTED_BLOCKS, in_use, "2 shared prompt blocks + 3 new private blocks, one per sample.")
viz.check((copies, in_use) == (0, 5) and first_token(20, 3) == (2, 5),
          f"first_token(16, 3) gave {(copies, in_use)} and first_token(20, 3) {first_token(20, 3)}; the answer "
          "below says (0, 5) and (2, 5)", defaults=True)

# %% [markdown]
# **Answer.** 0 copies and 5 blocks. A block is copied only when someone writes into a block that is still
# shared, and only a *partial* block can be written into. With the 20-token prompt above, the shared partial
# block cost 2 copies (the third writer found it private); 16 tokens leave no partial block, so each sample
# takes a fresh block instead. (`first_token(20, 3)` gives `(2, 5)`: the same 5 blocks, 2 of them by copy.)
#
# > **In vLLM.** Forks sharing blocks and copy-on-write are the PagedAttention paper's design and vLLM's
# > **V0** engine (removed in 2025; read it at a tag such as `v0.8.5`): `vllm/core/block_manager.py`
# > (`fork`) and `vllm/core/block/common.py` (`CopyOnWriteTracker`). **V1** has no forks: it runs `n > 1` as
# > `n` separate child requests (`vllm/v1/engine/parallel_sampling.py`) that share the prompt through
# > **prefix caching**: only the prompt's full blocks are shared, and no block is ever copied (each child
# > computes its own partial last block).

# %% [markdown]
# ## Takeaways
#
# * `fork` shares every block by reference count; nothing is copied until someone writes.
# * The first write into a shared partial block returns a `(src, dst)` pair; the last writer, by then the
#   block's only user, writes in place. A prompt that fills its blocks causes no copy at all.
# * The engine must apply the pairs with `copy_blocks` before the forward pass writes the new token:
#   without the copies, the samples that moved lose the prompt's last tokens.
# * vLLM V1 dropped forks: parallel samples share the prompt's full blocks through the prefix cache.
# * Next, notebook 03b: beam search (beams fork *and* die), swapping a forked group, and the memory that
#   sharing saves against the PagedAttention paper.
